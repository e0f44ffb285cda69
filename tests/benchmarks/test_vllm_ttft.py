"""``benchmarks/vllm_ttft.py`` on the CPU: issue 14 item 2 (CPU-hit TTFT against its floor, spread over starts).

The engine starts need the GPU machine; here run the parts that decide what a GPU call does and what
it reports: the shapes' KV bytes (checked against what earlier H200 runs measured), the start order,
the deadline (real child processes: a skipped start never starts, a start past the deadline is killed
with its process group), the PCIe probe's process without CUDA, and the floor / ratio / spread
arithmetic with numbers worked out by hand.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import vllm_ttft as vt  # noqa: E402

W = {"prefix": 8192, "n_conv": 8, "gpu_blocks": 2048, "cpu_gib": 24}


def _r(mode: str, start: int, t: float, **kw) -> dict:
    """One start's result with the fields run_one writes (those the tables read)."""
    r = {"mode": mode, "start": start, "turn2_median_s": t, "turn2_hit_rate": 0.992, "first_tokens": [[5, 6]]}
    if "bytes_per_hit" in kw:
        r.update(bytes_per_hit_token=kw["bytes_per_hit"] / 8192, turn1_bytes_stored=0, turn1_store_seconds=0.0)
    return {**r, **kw}


def test_qwen32b_shape_is_the_public_config():
    c = vt.MODELS["qwen2.5-32b"]  # Qwen/Qwen2.5-32B config.json
    assert (c["num_hidden_layers"], c["num_key_value_heads"], c["head_dim"]) == (64, 8, 128)
    assert (c["hidden_size"], c["num_attention_heads"], c["intermediate_size"]) == (5120, 40, 27648)
    assert c["vocab_size"] == 152064 and c["model_type"] == "qwen2" and not c["tie_word_embeddings"]
    assert vt.kv_bytes_per_token("qwen2.5-32b") == 64 * 2 * 8 * 128 * 2 == 262144
    assert "qwen2.5-32b" in vt.DEFAULT_MODES and vt.workload("qwen2.5-32b")["gpu_util"] == 0.8
    assert vt.workload("llama3-8b")["gpu_util"] == 0.6


@pytest.mark.parametrize("model", ["qwen2.5-7b", "dsv2-lite"])
def test_kv_bytes_per_token_equals_what_the_h200_runs_loaded(model):
    """The fallback for hit bytes must agree with the connector's own counters of the 2026-11-23 runs."""
    doc = json.loads((ROOT / f"docs/results/vllm_ttft_{model}_2026-11-23_h200.json").read_text())
    measured = {r["bytes_per_hit_token"] for r in doc["results"] if r.get("bytes_per_hit_token")}
    assert measured == {vt.kv_bytes_per_token(model)}


def test_hybrids_have_no_single_bytes_per_token():
    assert vt.kv_bytes_per_token("gemma3") is None and vt.kv_bytes_per_token("gpt-oss") is None
    assert vt.kv_bytes_per_token("llama3-8b") == 131072


def test_expected_hit_tokens_whole_blocks_of_the_prefix():
    assert vt.expected_hit_tokens({"prefix": 8192}) == 8192
    assert vt.expected_hit_tokens({"prefix": 8200}) == 8192  # the partial block is recomputed
    assert vt.expected_hit_tokens({"prefix": 100}) == 96


def test_schedule_rotates_the_mode_order_per_start():
    assert vt.schedule(["a", "b", "c"], 3) == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"),
                                                (2, "c"), (2, "a"), (2, "b")]
    assert vt.schedule(["a", "b"], 1, offset=3) == [(3, "b"), (3, "a")]  # a later call goes on rotating


def test_start_need_uses_measured_walls_first():
    assert vt.start_need_s({}, "floor", "qwen2.5-32b") == vt.START_GUESS_S["qwen2.5-32b"]
    assert vt.start_need_s({}, "floor", "llama3-8b") == vt.START_GUESS_DEFAULT_S
    walls = {"floor": [40.0, 44.0]}
    assert vt.start_need_s(walls, "floor", "llama3-8b") == 44.0
    assert vt.start_need_s(walls, "tiered-cpu", "llama3-8b") == pytest.approx(55.0)  # unseen mode: 1.25x


def test_item2_summary_arithmetic():
    results = [
        _r("floor", 0, 0.020), _r("offloading", 0, 0.050), _r("tiered-cpu", 0, 0.035, bytes_per_hit=1_000_000_000),
        _r("floor", 1, 0.022), _r("offloading", 1, 0.070), _r("tiered-cpu", 1, 0.040, bytes_per_hit=1_000_000_000),
        _r("floor", 2, 0.021), _r("tiered-cpu", 2, 0.038, bytes_per_hit=1_100_000_000),
        {"mode": "offloading", "start": 2, "error": "rc=1"},  # a failed start counts nowhere
    ]
    pcie = [{"when": "before", "h2d": {"samples_gbps": [50.0, 55.0, 54.0]}},
            {"when": "after", "h2d": {"samples_gbps": [53.0]}}]
    s = vt.item2_summary(results, pcie, "llama3-8b", W)
    assert s["hit_bytes"] == 1_000_000_000 and s["hit_bytes_source"].startswith("tiered-cpu counters")
    assert s["pcie_h2d_ceiling_gbps"] == 55.0 and s["pcie_h2d_median_gbps"] == 53.5
    copy_s = 1e9 / 55e9  # 18.18 ms
    assert s["copy_s"] == pytest.approx(copy_s, abs=1e-5) and s["floor_ttft_s"] == 0.021
    floor_s = copy_s + 0.021
    assert s["floor_s"] == pytest.approx(floor_s, abs=1e-5)
    t = s["modes"]["tiered-cpu"]
    assert (t["starts"], t["min_s"], t["median_s"], t["max_s"]) == (3, 0.035, 0.038, 0.040)
    assert t["spread"] == pytest.approx(0.040 / 0.035, abs=1e-3) and t["spread_ok"]
    assert t["ratio"] == pytest.approx(0.038 / floor_s, abs=1e-3) and t["ratio_ok"]
    assert t["ratio_per_start"] == pytest.approx([0.035 / (copy_s + 0.020), 0.040 / (copy_s + 0.022),
                                                  0.038 / (copy_s + 0.021)], abs=1e-3)
    o = s["modes"]["offloading"]
    assert o["starts"] == 2 and o["median_s"] == pytest.approx(0.060)
    assert o["spread"] == pytest.approx(1.4) and o["spread_ok"] is False
    assert o["ratio"] == pytest.approx(0.060 / floor_s, abs=1e-3) and o["ratio_ok"] is False
    assert "ratio" not in s["modes"]["floor"]
    text = vt.item2_table(s)
    assert "best 55.00 GB/s, median of all copies 53.50 GB/s" in text
    assert "floor_s = 18.2 ms (hit bytes / ceiling) + 21.0 ms" in text
    assert "| tiered-cpu | 3 | 0.0350 / 0.0380 / 0.0400 | 1.143 ok | 0.970 ok |" in text
    assert "| offloading | 2 | 0.0500 / 0.0600 / 0.0700 | 1.400 MISSED | 1.531 MISSED |" in text


def test_item2_summary_without_counters_floor_or_rate():
    results = [_r("offloading", 0, 0.05)]
    s = vt.item2_summary(results, [{"error": "no CUDA device"}], "qwen2.5-32b", W)
    assert s["hit_bytes"] == 8192 * 262144 and s["hit_bytes_source"].startswith("computed")
    assert s["floor_s"] is None and s["floor_missing"] == ["a PCIe rate", "mode floor"]
    assert s["modes"]["offloading"]["spread"] is None  # one start: no spread
    assert "n/a (1 start)" in vt.item2_table(s) and "missing: a PCIe rate, mode floor" in vt.item2_table(s)
    s = vt.item2_summary([_r("floor", 0, 0.02)], [], "gemma3", W)
    assert s["hit_bytes"] is None and s["floor_missing"] == ["hit bytes", "a PCIe rate"]


def test_merge_keeps_each_calls_ceiling(tmp_path):
    def doc(call, ceiling, t_floor, t_tiered):
        return {"model": "llama3-8b", "call": call, "workload": {"prefix": 8192},
                "results": [_r("floor", 0, t_floor), _r("tiered-cpu", 0, t_tiered, bytes_per_hit=2_000_000_000)],
                "pcie": [{"when": "before", "h2d": {"samples_gbps": [ceiling - 1, ceiling]}}]}
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    a.write_text(json.dumps(doc("A", 50.0, 0.020, 0.060)))
    b.write_text(json.dumps(doc("B", 40.0, 0.030, 0.080)))
    m = vt.merge([str(a), str(b)])
    s = m["item2"]
    assert s["pcie_calls"] == {"A": 50.0, "B": 40.0} and s["pcie_h2d_ceiling_gbps"] == 45.0
    assert s["modes"]["tiered-cpu"]["spread"] == pytest.approx(80 / 60, abs=1e-3)
    assert s["modes"]["tiered-cpu"]["ratio_per_start"] == pytest.approx([0.060 / (0.040 + 0.020),
                                                                         0.080 / (0.050 + 0.030)], abs=1e-3)
    assert "(start 0, A)" in m["table"] and "(start 0, B)" in m["table"]
    c.write_text(json.dumps(dict(doc("C", 50.0, 0.02, 0.06), model="qwen2.5-7b")))
    with pytest.raises(SystemExit, match="one model"):
        vt.merge([str(a), str(c)])


def test_plan_sizes_and_deadline_guess(monkeypatch):
    for k in ("N_CONV", "PREFIX", "GPU_BLOCKS", "CPU_GIB"):
        monkeypatch.delenv(k, raising=False)
    p = vt.plan("qwen2.5-32b", ["floor", "offloading", "tiered-cpu"], 3, 560.0)
    assert len(p["schedule"]) == 9 and p["schedule"][3] == [1, "offloading"]
    assert p["expected_hit_bytes"] == 8192 * 262144
    assert p["working_set_exceeds_gpu_cache"] and p["working_set_fits_cpu_tier"]  # 16.1 GiB vs 8 GiB / 24 GiB
    assert p["starts_that_fit_by_guess"] == int((560 - vt.STOP_MARGIN_S - 2 * vt.PCIE_GUESS_S) // 150)
    p = vt.plan("llama3-8b", ["floor", "tiered-cpu"], 2, 0.0, pcie=False)
    assert p["starts_that_fit_by_guess"] == 4 and p["pcie_probes"] == 0


def test_run_all_skips_starts_the_deadline_cannot_hold(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    t0 = time.monotonic()
    doc = vt.run_all("llama3-8b", ["floor", "tiered-cpu"], starts=2, deadline_s=vt.STOP_MARGIN_S + 5)
    assert time.monotonic() - t0 < 2  # nothing was started
    assert doc["results"] == [] and doc["pcie"] == []
    assert [(s["mode"], s["start"]) for s in doc["skipped"]] == [("floor", 0), ("tiered-cpu", 0),
                                                                  ("tiered-cpu", 1), ("floor", 1)]
    assert all("deadline" in s["reason"] for s in doc["skipped"])


def test_run_child_kills_the_process_group_at_the_timeout(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); print('started', flush=True); time.sleep(60)")
    t0 = time.monotonic()
    rc, out, err = vt.run_child([sys.executable, "-c", code], dict(os.environ), 2.0)
    assert rc is None and "started" in out and "killed after 2 s" in err
    assert time.monotonic() - t0 < 10
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # SIGKILL went to the whole group; the orphan is reaped by init
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"grandchild {grandchild} survived the group kill")
    assert vt.run_child([sys.executable, "-c", "print('RESULT {\"x\": 1}')"], dict(os.environ), 30)[0] == 0


def test_pcie_probe_process_without_cuda_reports_why():
    """The probe's own process (gpu_copy.pcie_ceiling) on this CPU machine: a record saying why, no rate."""
    rec = vt.pcie_probe("before", 120)
    assert rec["when"] == "before" and rec["error"] == "no CUDA device" and "h2d" not in rec


def test_hit_bytes_from_a_tiered_variant_when_tiered_cpu_did_not_run():
    results = [_r("floor", 0, 0.02), _r("tiered-cpu-staged", 0, 0.03, bytes_per_hit=470_000_000)]
    s = vt.item2_summary(results, [{"h2d": {"samples_gbps": [47.0]}}], "qwen2.5-7b", W)
    assert s["hit_bytes"] == 470_000_000 and s["hit_bytes_source"].startswith("tiered-cpu-staged counters")
    assert s["modes"]["tiered-cpu-staged"]["ratio"] == pytest.approx(0.03 / (0.01 + 0.02), abs=1e-3)


def test_table_checks_tokens_against_floor_without_none():
    results = [_r("floor", 0, 0.02), _r("tiered-cpu", 0, 0.03, bytes_per_hit=1e9),
               dict(_r("offloading", 0, 0.04), first_tokens=[[9, 9]])]
    text = vt.table(results)
    assert "greedy tokens = floor" in text.splitlines()[0]
    rows = {ln.split(" | ")[0].strip("| "): ln for ln in text.splitlines()[2:]}
    assert " | yes | " in rows["tiered-cpu"] and " | NO | " in rows["offloading"]


def test_a_child_dies_with_the_benchmark_process(tmp_path):
    """A call killed from outside (SIGKILL, as a device tool's time limit does) takes its engine start with it,
    although the start runs in a process group of its own."""
    pid_file = tmp_path / "child.pid"
    sleeper = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); "
                               f"import vllm_ttft as vt; vt.run_child([sys.executable, '-c', {sleeper!r}], {{}}, 60)"],
                              env=dict(os.environ))
    for _ in range(200):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.05)
    child = int(pid_file.read_text())
    parent.kill()
    parent.wait()
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(child, 9)
    pytest.fail(f"child {child} outlived its killed parent")


def test_prefill_check_compares_the_learned_model_with_turn_1():
    """Issue 32's must-show 3 as the GPU run reports it: the connector's learned model predicts turn 1 (a cold
    prefill of the prefix and one decode step), set beside turn 1's measured time; nothing without the engine."""
    from types import SimpleNamespace

    from tiered_kv.connector.vllm.prefill import StepMeter
    from tiered_kv.planner.rates import PrefillEstimator, PrefillModel

    model = PrefillModel(0.004, 1 / 40000, 1 / 40000 / 30000, 2e-9)
    est = PrefillEstimator(model, fixed=True)
    meter = StepMeter(est)
    meter.recent.append((5, 8192, 0.15, 0.21, False))  # a step both clocks timed
    planner = SimpleNamespace(steps=meter)
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(engine_core=SimpleNamespace(
        scheduler=SimpleNamespace(connector=SimpleNamespace(planner=planner))))))
    want = model.seconds(8192, 0) + model.step_seconds([(1, 8192)])
    got = vt._prefill_check(llm, W, want * 1.05)
    assert got["turn1_predicted_s"] == pytest.approx(want, abs=1e-4) and got["source"] == "fixed"
    assert got["predicted_over_measured"] == pytest.approx(1 / 1.05, abs=1e-3)
    assert got["clock"] == "scheduler" and got["recent_steps"] == [[5, 8192, 0.15, 0.21, False]]
    assert vt._prefill_check(SimpleNamespace(), W, 0.3) == {}


def test_overlap_summary_compares_the_split_with_the_better_of_recompute_and_a_full_load():
    """Issue 32 item 2 as the GPU run reports it: medians over starts, against min(none, tiered-disk-always)."""
    res = [{"mode": "none", "turn2_median_s": 0.22}, {"mode": "tiered-disk-always", "turn2_median_s": 0.55},
           {"mode": "tiered-disk-overlap", "turn2_median_s": 0.15}, {"mode": "tiered-disk-overlap",
                                                                      "turn2_median_s": 0.16},
           {"mode": "tiered-disk-overlap", "turn2_median_s": 0.30}]
    o = vt.overlap_summary(res)
    assert o["overlap_s"] == 0.16 and o["ratio"] == round(0.16 / 0.22, 3) and o["met"]
    assert "0.727x" in vt.overlap_line(o) and "met" in vt.overlap_line(o)
    assert not vt.overlap_summary(res[:2] + [{"mode": "tiered-disk-overlap", "turn2_median_s": 0.2}])["met"]
    assert vt.overlap_summary(res[:2]) is None and vt.overlap_line(None) == ""


def test_remote_modes_get_a_loopback_cluster_for_their_start():
    """``tiered-remote*``: each engine start runs beside a 3-master Redis Cluster on 127.0.0.1 (Debian's
    redis-server, as the tests use), which the mode's config points at; it is gone after the start."""
    w = dict(vt.workload("llama3-8b"), redis_maxmemory="64mb")
    with vt.loopback_cluster(w) as cluster:
        extra = vt.tiered_extra("tiered-remote-overlap", w)
        assert extra["remote_url"] == cluster.url == os.environ["TKV_REMOTE_URL"]
        assert extra["disk_overlap_bytes"] == f"{w['overlap_gib']}GiB" and "disk_path" not in extra
        assert vt.tiered_extra("tiered-remote-always", w)["disk_load_policy"] == "always"
        cluster.wait_ok()
    assert not cluster.live()


def _overlap_run(loaded_tokens: int, read_s: float, t2: float) -> dict:
    return {"mode": "tiered-disk-overlap", "model": "llama3-8b", "turn2_median_s": t2, "prefix": 8192,
            "bytes_per_hit_token": 131072,
            "connector_counters": {"split_disk_loaded_tokens": loaded_tokens, "rank0_overlap_read_seconds": read_s},
            "prefill_model": {"coefficients": [0.004, 1 / 40000, 0.0, 0.0]}}


def test_the_split_floor_is_priced_at_the_rate_the_overlap_reads_got():
    """The restated item 2: the split's best at the read rate its own reads got (bytes loaded over read seconds,
    all starts together), scaled to the measured recompute. A disk at 4 GB/s: the floor loads much of the prefix
    and beats recompute by far; at 0.5 GB/s (an eighth of this model's prefill rate in bytes) no split pays once the
    pipeline's fill (1/8 with 32 layers in 8 groups) is counted: the floor is recompute itself."""
    base = [{"mode": "none", "turn2_median_s": 0.21}, {"mode": "tiered-disk-always", "turn2_median_s": 0.40}]
    fast = vt.overlap_summary(base + [_overlap_run(4096, 4096 * 131072 / 4e9, 0.16)])
    assert fast["read_gbps"] == 4.0 and 0 < fast["floor_load_tokens"] < 8192
    assert fast["floor_load_tokens"] % 256 == 0 and fast["floor_s"] < 0.21  # whole chunks; faster than recompute
    assert fast["floor_ratio"] == round(0.16 / fast["floor_s"], 3)
    assert "the split's floor at the 4.00 GB/s" in vt.overlap_line(fast)
    slow = vt.overlap_summary(base + [_overlap_run(1024, 1024 * 131072 / 0.5e9, 0.22),
                                      _overlap_run(0, 0.0, 0.21)])  # a start that read nothing adds nothing
    assert slow["read_gbps"] == 0.5 and slow["floor_load_tokens"] == 0 and slow["floor_s"] == 0.21
    assert fast["floor_s"] < 0.15
    none_read = vt.overlap_summary(base + [_overlap_run(0, 0.0, 0.21)])
    assert "floor_s" not in none_read and "floor" not in vt.overlap_line(none_read)
