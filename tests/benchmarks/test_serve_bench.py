"""``benchmarks/serve_bench.py`` on the CPU: workload, stats, modes and command lines, report, client.

A real ``vllm serve`` cannot run on this CPU machine (no GPU, and the vLLM in .venv is a CPU build
of 0.32, not the 0.26 the GPU machine serves), so the client and the whole drive loop run against
``serve_stub.StubServer``, an aiohttp app that streams vLLM-style SSE chunks. The command lines
are checked with vLLM's own server argument parser (the one installed in .venv).
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import time
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import serve_bench  # noqa: E402
from serving import report, stats  # noqa: E402
from serving.modes import BUILTIN, ModeRegistry, ServerOptions, Sizes, serve_argv, serve_env  # noqa: E402
from serving.shapes import SHAPES, kv_bytes_per_token, kv_groups, pool_blocks, write_model_dir  # noqa: E402
from serving.workload import Workload, WorkloadParams, plan_phases, resident_gpu_blocks, sizes  # noqa: E402

SIZES = Sizes(cpu_gib=30, disk_cpu_gib=6, disk_gib=36, disk_root="/data/sb")
SMALL = WorkloadParams(users=6, system_tokens=32, context_tokens=48, turn_tokens=16, answer_tokens=4,
                       concurrency=(4, 2, 1), c1_users=2)


# ============================================================================ workload
def test_prompts_grow_by_message_and_answer_and_share_only_the_system_prompt():
    wl = Workload(SMALL, seed=7)
    p = SMALL
    for t in range(4):
        assert len(wl.prompt(0, t)) == p.prompt_len(t) == 32 + 48 + t * 20 + 16
    for t in range(3):  # turn t+1 = turn t + its stand-in answer + a new message
        assert wl.prompt(0, t + 1) == wl.prompt(0, t) + wl.answer(0, t) + wl.message(0, t + 1)
    a, b = wl.prompt(0, 0), wl.prompt(1, 0)
    assert a[:32] == b[:32] == wl.system
    assert a[32] != b[32] and wl.context(0) != wl.context(1)
    assert all(1000 <= x < p.vocab_size - 1000 for x in a)


def test_conversations_are_fresh_per_seed_and_reproducible():
    a, b, a2 = Workload(SMALL, 1), Workload(SMALL, 2), Workload(SMALL, 1)
    assert a.system == b.system  # the system prompt is the same in every run
    assert a.context(0) != b.context(0) and a.message(3, 1) != b.message(3, 1)
    assert a.prompt(3, 2) == a2.prompt(3, 2)


def test_phases_warm_then_one_per_level_in_order():
    ph = plan_phases(SMALL)
    assert [(x.name, x.concurrency) for x in ph] == [("warm", 4), ("c4", 4), ("c2", 2), ("c1", 1)]
    assert ph[0].items == tuple((u, 0) for u in range(6))
    assert ph[1].items == tuple((u, 1) for u in range(6))
    assert ph[3].items == ((0, 3), (1, 3))  # level 1: only the first c1_users users
    two = plan_phases(WorkloadParams(**{**SMALL.__dict__, "turns": 2, "concurrency": (2, 2)}))
    assert [x.name for x in two] == ["warm", "c2", "c2-2"]
    assert two[1].items == tuple((u, t) for t in (1, 2) for u in range(6))  # round robin over users
    assert two[2].items[0] == (0, 3)


def test_sizes_count_distinct_prompt_tokens_and_eviction():
    s = sizes(SMALL, kv_bytes_per_token("llama3-8b"), gpu_blocks=10)
    wl = Workload(SMALL, 0)
    last = {u: max(t for ph in plan_phases(SMALL) for uu, t in ph.items if uu == u) for u in range(6)}
    distinct = {tuple(wl.prompt(u, t)[:i]) for u, t in last.items() for i in range(1, SMALL.prompt_len(t) + 1)}
    assert s["stored_tokens"] == len(distinct)  # prefixes: one per distinct prompt token position
    assert s["stored_bytes"] == s["stored_tokens"] * 128 * 1024
    assert s["gpu_cache_tokens"] == 160
    assert s["evict_ratio"] == round(5 * (48 + 16 + 4) / 160, 2)
    assert s["max_seq_len"] == SMALL.prompt_len(3) + 4
    assert [p["requests"] for p in s["phases"]] == [6, 6, 6, 2]


def test_default_workload_history_exceeds_the_gpu_cache_for_every_shape():
    for shape in SHAPES:
        a = serve_bench.parse_args(["--shape", shape])
        wp = serve_bench.workload_params(a)
        s = sizes(wp, kv_bytes_per_token(shape), a.gpu_blocks)
        assert s["history_over_gpu"] > 1.3 and s["evict_ratio"] > 1.1, shape
        assert s["running_tokens_max"] <= s["gpu_cache_tokens"], shape  # 32 users fit: no preemption
        assert s["max_seq_len"] <= 8192


def test_hybrid_shapes_name_vllms_groups_and_size_the_pool_per_group():
    assert kv_groups("llama3-8b") == [None] and kv_groups("dsv2-lite") == [None]
    assert kv_groups("gpt-oss") == [None, 128] and kv_groups("gemma2") == [None, 4096]
    assert kv_groups("gemma3") == [None] + [1024] * 6  # 5 full, 29 window layers: groups of 5
    assert pool_blocks("llama3-8b", 6912, 32, 2688, 8192) == 6912  # one group: the history itself
    # gpt-oss: the 128-token window keeps 9 blocks per running request plus one step's prefill (512 blocks)
    assert pool_blocks("gpt-oss", 6912, 32, 2688, 8192) == 6912 + 32 * 9 + 512
    # gemma2: the 4,096-token window spans every sequence, so its group keeps the whole history too
    assert pool_blocks("gemma2", 5760, 32, 2688, 8192) == 2 * 5760
    assert pool_blocks("gemma2", 5760, 32, 8192, 8192) == 5760 + 32 * 257 + 512  # longer sequences: the window
    assert kv_bytes_per_token("dsv2-lite") == 27 * 576 * 2  # MLA: one latent per layer
    assert kv_bytes_per_token("gemma2") == 2 * 42 * 8 * 256 * 2


def test_a_hybrid_shape_starts_vllm_with_the_pool_of_its_groups(tmp_path, monkeypatch):
    rec_path = tmp_path / "rec.jsonl"
    monkeypatch.setenv("FAKE_SERVE_RECORD", str(rec_path))
    args = ["--shape", "gpt-oss"] + SMALL_ARGS[2:]
    out = tmp_path / "out"
    serve_bench.main(args + ["--python", _fake_python(tmp_path), "--modes", "none,none-resident",
                             "--gpu-blocks", "8", "--out-dir", str(out)])
    got = sorted(int(r["argv"][r["argv"].index("--num-gpu-blocks-override") + 1]) for r in _records(rec_path))
    # 4 running requests x (8 window blocks + 1) + one step's 8,192-token prefill (512 blocks) beside the history
    assert got[0] == 8 + 4 * 9 + 512, got
    doc = json.loads((out / "serve_bench_gpt-oss.json").read_text())
    assert doc["sizes"]["vllm_gpu_blocks"] == got[0] and doc["sizes"]["kv_groups"] == [None, 128]
    assert got[1] > got[0]  # the resident floor: the whole history plus the same window blocks


def test_smoke_preset_is_small_but_still_evicts():
    a = serve_bench.parse_args(["--shape", "llama3-8b", "--preset", "smoke"])
    wp = serve_bench.workload_params(a)
    s = sizes(wp, kv_bytes_per_token("llama3-8b"), a.gpu_blocks)
    assert [p["requests"] for p in s["phases"]] == [24, 24, 4]
    assert s["evict_ratio"] > 1.0 and s["running_tokens_max"] <= s["gpu_cache_tokens"]


def test_shapes_kv_bytes_and_model_dir(tmp_path):
    assert kv_bytes_per_token("llama3-8b") == 128 * 1024
    assert kv_bytes_per_token("qwen2.5-7b") == 56 * 1024  # 28 layers, 4 KV heads
    assert kv_bytes_per_token("qwen2.5-32b") == 256 * 1024  # 64 layers
    d = write_model_dir("qwen2.5-7b", str(tmp_path / "m"), tokenizer=False)
    cfg = json.loads((Path(d) / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 28 and cfg["num_key_value_heads"] == 4 and cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert not (Path(d) / "tokenizer.json").exists()
    assert list(Path(d).iterdir()) == [Path(d) / "config.json"]  # written aside and renamed: no temporary file left


def test_the_model_dir_is_one_path_per_shape_config(tmp_path, monkeypatch):
    """vLLM keys its compile cache on the model path: one path per shape's config, so later calls find it; another
    config gets another path; a run leaves the directory for the next (and for neighbours on the same host)."""
    from serving import shapes

    a, b = shapes.stable_model_dir("gemma2", str(tmp_path)), shapes.stable_model_dir("gemma2", str(tmp_path))
    assert a == b and a.startswith(str(tmp_path / "serve-bench-gemma2-"))
    assert shapes.stable_model_dir("gpt-oss", str(tmp_path)) != a
    changed = {**SHAPES["gemma2"], "num_hidden_layers": 40}
    monkeypatch.setitem(shapes.SHAPES, "gemma2", changed)
    assert shapes.stable_model_dir("gemma2", str(tmp_path)) != a
    monkeypatch.setattr(shapes.tempfile, "tempdir", str(tmp_path))
    out = tmp_path / "out"
    serve_bench.main(SMALL_ARGS + ["--python", _fake_python(tmp_path), "--modes", "none", "--out-dir", str(out)])
    (start,) = json.loads((out / "serve_bench_llama3-8b.json").read_text())["starts"]
    model = shapes.stable_model_dir("llama3-8b")
    assert model.startswith(str(tmp_path)) and f" serve {model} " in start["command"]
    assert (Path(model) / "config.json").is_file()  # left for the next call


def test_pack_logs_packs_this_runs_logs_and_drops_the_partial_json(tmp_path):
    """``--pack-logs``: a device call brings back at most 8 files, so the run's server logs (and traces) go into one
    archive; a log an earlier run left in the folder stays where it is."""
    import tarfile

    out = tmp_path / "out"
    out.mkdir()
    old = out / "serve_llama3-8b_none_r7.log"
    old.write_text("an earlier run's\n")
    os.utime(old, (1, 1))
    serve_bench.main(SMALL_ARGS + ["--python", _fake_python(tmp_path), "--modes", "none,none-resident",
                                   "--out-dir", str(out), "--pack-logs", "--no-plot"])
    assert sorted(p.name for p in out.iterdir()) == ["serve_bench_llama3-8b.json", "serve_llama3-8b_none_r7.log",
                                                     "serve_logs_llama3-8b.tgz"]
    with tarfile.open(out / "serve_logs_llama3-8b.tgz") as tar:
        assert sorted(tar.getnames()) == ["serve_llama3-8b_none-resident_r0.log", "serve_llama3-8b_none_r0.log"]


def test_pack_logs_takes_both_sides_of_a_trace(tmp_path):
    """A traced start's files: the server log, each worker rank's trace and the scheduler's (``.sched.jsonl``)."""
    import tarfile

    from serving import replicas

    names = ["serve_qwen2.5-7b_tiered_r0.log", "trace_qwen2.5-7b_tiered_r0.rank0.jsonl",
             "trace_qwen2.5-7b_tiered_r0.sched.jsonl"]
    for n in names + ["trace_llama3-8b_tiered_r0.sched.jsonl"]:  # another shape's stays
        (tmp_path / n).write_text("{}\n")
    path = replicas.pack_logs(str(tmp_path), "qwen2.5-7b", "logs.tgz", every_start=True)
    with tarfile.open(path) as tar:
        assert sorted(tar.getnames()) == sorted(names)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs.tgz", "trace_llama3-8b_tiered_r0.sched.jsonl"]


def test_pack_logs_packs_a_stopped_run_too_and_keeps_its_partial_json(tmp_path, monkeypatch):
    """A run the device call's time limit stops (here: the end of the run fails) still packs its logs, and keeps the
    .partial.json, the only record of its starts then."""
    import tarfile

    def stopped(doc, path, plot):
        raise SystemExit(143)

    monkeypatch.setattr(serve_bench, "finish", stopped)
    out = tmp_path / "out"
    with pytest.raises(SystemExit):
        serve_bench.main(SMALL_ARGS + ["--python", _fake_python(tmp_path), "--modes", "none", "--out-dir", str(out),
                                       "--pack-logs", "--no-plot"])
    assert sorted(p.name for p in out.iterdir()) == ["serve_bench_llama3-8b.partial.json", "serve_logs_llama3-8b.tgz"]
    with tarfile.open(out / "serve_logs_llama3-8b.tgz") as tar:
        assert tar.getnames() == ["serve_llama3-8b_none_r0.log"]


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None, reason="needs tokenizers")
def test_offline_tokenizer_round_trips_ids(tmp_path):
    from tokenizers import Tokenizer

    d = write_model_dir("llama3-8b", str(tmp_path / "m"), tokenizer=True)
    tok = Tokenizer.from_file(str(Path(d) / "tokenizer.json"))
    assert tok.get_vocab_size() == SHAPES["llama3-8b"]["vocab_size"]
    assert tok.decode([5, 6, 128000]) == "t5 t6 t128000"
    assert tok.encode("t5 t6 t128000").ids == [5, 6, 128000]


# ============================================================================ stats
def test_percentile_is_linear_between_ranks():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert stats.percentile(xs, 50) == 3.0
    assert stats.percentile(xs, 0) == 1.0 and stats.percentile(xs, 100) == 5.0
    assert stats.percentile(xs, 90) == pytest.approx(4.6)
    assert stats.percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert stats.percentile([], 50) is None


def test_inter_token_gaps_spread_multi_token_chunks():
    # first chunk (TTFT) carries 2 tokens, then 1 token after 10 ms, then 3 tokens after 30 ms
    assert stats.spread_gaps([0.1, 0.11, 0.14], [2, 1, 3]) == pytest.approx([0.0, 0.01, 0.01, 0.01, 0.01])
    assert stats.spread_gaps([], []) == []


def test_summarize_a_phase():
    res = [{"ttft_s": 0.1, "chunk_times": [0.1, 0.12, 0.14], "chunk_tokens": [1, 1, 1], "completion_tokens": 3,
            "prompt_tokens": 100, "cached_tokens": 64, "queue_ms": 1.0},
           {"ttft_s": 0.3, "chunk_times": [0.3, 0.34], "chunk_tokens": [1, 2], "completion_tokens": 3,
            "prompt_tokens": 100, "cached_tokens": 0, "queue_ms": 3.0},
           {"error": "HTTP 500", "chunk_times": [], "chunk_tokens": []}]
    s = stats.summarize(res, wall_s=2.0)
    assert s["requests"] == 3 and s["errors"] == 1
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0) and s["ttft_ms"]["p99"] == pytest.approx(298.0)
    assert s["itl_ms"]["p50"] == pytest.approx(20.0)  # gaps 20, 20, 20, 20 ms
    assert s["output_tokens"] == 6 and s["output_tok_s"] == 3.0 and s["req_s"] == 1.0
    assert s["cached_tokens"] == 64 and s["server_queue_ms_p50"] == 2.0


def test_first_token_waves_say_how_a_closed_loop_bunched():
    # 8 users: a wave of 5 first tokens within 2 ms, a wave of 2, one alone; an error and a request without a first
    # token are not counted
    at = [(0.100, 0.050), (0.1005, 0.0501), (0.140, 0.0112), (0.145, 0.0068), (0.1508, 0.0006),  # 0.1501..0.1518
          (0.300, 0.020), (0.301, 0.0205), (0.500, 0.010)]
    res = [{"sent_at": s, "ttft_s": t} for s, t in at] + [{"sent_at": 0.2, "error": "HTTP 500"},
                                                            {"sent_at": 0.2, "ttft_s": None}]
    w = stats.first_token_waves(res, concurrency=8)
    assert (w["waves"], w["max"], w["mean"]) == (3, 5, round(8 / 3, 2))
    assert w["together"] == pytest.approx(5 / 8)  # waves of >= 4 first tokens: the five
    assert stats.first_token_waves(res, concurrency=8, gap_s=0.0001)["waves"] == 8  # every first token apart
    assert stats.first_token_waves([], concurrency=8) is None
    line = serve_bench._wave_line(w, 8)
    assert "3 waves" in line and "62% in waves >= 4" in line and serve_bench._wave_line(w, 1) == ""


PROM_A = """# HELP vllm:prompt_tokens_by_source_total x
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 100.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 3.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
tiered_kv_tier_hits_total{store="vllm",tier="cpu"} 4.0
tiered_kv_tier_hits_total{store="vllm",tier="disk"} 1.0
"""
PROM_B = PROM_A.replace('local_compute"} 100.0', 'local_compute"} 350.0').replace(
    'external_kv_transfer"} 0.0', 'external_kv_transfer"} 2048.0').replace("_sum{engine=\"0\",model_name=\"m\"} 0.5",
                                                                           "_sum{engine=\"0\",model_name=\"m\"} 0.75").replace(
    'tier="cpu"} 4.0', 'tier="cpu"} 12.0').replace("0.25", "0.5")


def test_prometheus_deltas_sources_and_tiers():
    a, b = stats.parse_prometheus(PROM_A), stats.parse_prometheus(PROM_B)
    assert a['vllm:prompt_tokens_by_source_total{source="local_compute"}'] == 100.0
    assert not any("_bucket" in k for k in a)
    d = stats.prom_delta(a, b)
    assert d == {'vllm:prompt_tokens_by_source_total{source="local_compute"}': 250.0,
                 'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}': 2048.0,
                 "vllm:time_to_first_token_seconds_sum": 0.25, "vllm:kv_cache_usage_perc": 0.5,
                 'tiered_kv_tier_hits_total{store="vllm",tier="cpu"}': 8.0}
    assert stats.token_sources(d) == {"computed": 250.0, "gpu_hit": 0.0, "connector_hit": 2048.0}
    assert stats.tier_hits(d, chunk_tokens=256) == {"cpu": 2048.0}


def test_engine_times_are_the_phase_means_of_vllms_histograms():
    """``stats.engine_times``: the mean of each request-time histogram over the phase (sum / count of the delta), in
    ms; a histogram that did not move is left out."""
    before = {"vllm:request_prefill_time_seconds_sum": 10.0, "vllm:request_prefill_time_seconds_count": 300.0,
              "vllm:request_queue_time_seconds_sum": 0.5, "vllm:request_queue_time_seconds_count": 300.0}
    after = {"vllm:request_prefill_time_seconds_sum": 12.33, "vllm:request_prefill_time_seconds_count": 364.0,
             "vllm:request_queue_time_seconds_sum": 0.5, "vllm:request_queue_time_seconds_count": 300.0,
             "vllm:time_to_first_token_seconds_sum": 2.624, "vllm:time_to_first_token_seconds_count": 64.0}
    assert stats.engine_times(stats.prom_delta(before, after)) == {"prefill": pytest.approx(36.406), "n": 64.0,
                                                                   "ttft": pytest.approx(41.0)}
    assert stats.engine_times({}) == {}


def test_worker_time_per_step_from_our_real_metrics_page():
    """``stats.worker_time``: the workers' counters as our Prometheus page shows them (``tiered_kv.store.metrics``),
    a phase's delta, per engine step (vLLM's iteration count)."""
    from prometheus_client import generate_latest

    from tiered_kv.store.metrics import make_registry

    def page(workers: dict, steps: int) -> dict:
        base = {"lookups": 0, "hits": 0, "misses": 0, "bytes_in": 0, "bytes_out": 0, "puts_refused": 0,
                "resident_bytes": 0, "inflight_jobs": 0, "tiers": {}, "workers": workers}
        text = generate_latest(make_registry(lambda: base, "vllm")).decode()
        text += f'vllm:iteration_tokens_total_count{{engine="0",model_name="m"}} {steps}.0\n'
        return stats.parse_prometheus(text)

    a = page({"hook_start_load_kv_seconds": 0.010, "layer_submit_seconds": 0.0, "fence_wait_seconds": 0.0,
              "stores_cancelled": 0, "sync_loads": 2, "bytes_loaded": 1 << 20}, steps=10)
    b = page({"hook_start_load_kv_seconds": 0.110, "hook_get_finished_seconds": 0.020, "layer_submit_seconds": 0.070,
              "fence_wait_seconds": 0.005, "stores_cancelled": 3, "sync_loads": 42, "bytes_loaded": 1 << 30,
              "mover_cpu_seconds": 0.25, "store_cpu_seconds": 0.125}, steps=110)
    w = stats.worker_time(stats.prom_delta(a, b), stats.prom_delta(a, b))
    assert w["steps"] == 100 and w["hook_ms"] == pytest.approx(190.0) and w["hook_ms_per_step"] == pytest.approx(1.9)
    assert w["by_hook_ms"] == pytest.approx({"start_load_kv": 100.0, "get_finished": 20.0, "layer_submit": 70.0})
    assert w["fence_wait_ms"] == pytest.approx(5.0) and w["stores_cancelled"] == 3 and w["copies"]["sync_loads"] == 40
    assert w["mover_cpu_ms"] == pytest.approx(250.0) and w["store_cpu_ms"] == pytest.approx(125.0)
    assert w["submit_ms_per_load"] == pytest.approx((100.0 + 70.0) / 40)  # start_load_kv + between layers, per load
    assert "4.25 ms to submit a load" in serve_bench._worker_line(w)
    c = page({"hook_start_load_kv_seconds": 0.115, "hook_get_finished_seconds": 0.020, "layer_submit_seconds": 0.070,
              "fence_wait_seconds": 0.005, "stores_cancelled": 3, "sync_loads": 42, "bytes_loaded": 1 << 30,
              "mover_cpu_seconds": 0.25, "store_cpu_seconds": 0.125}, steps=120)
    assert stats.worker_time(stats.prom_delta(b, c), stats.prom_delta(b, c))["submit_ms_per_load"] is None  # no loads
    assert stats.worker_time(stats.prom_delta(a, a), {}) == {}  # nothing moved: no section


def test_load_costs_from_our_real_metrics_page():
    """``stats.load_costs``: the split's measured load floor and overlap cost (gauges: their value at the phase's
    end) and the hits its floor recomputed in the phase (a counter's delta), from a real ``SplitGate``'s report on
    our Prometheus page; nothing measured: no section. The phase line prints them."""
    from prometheus_client import generate_latest

    from benchmarks.serve_bench import _cost_line
    from tiered_kv.planner.gate import SplitGate
    from tiered_kv.planner.rates import PrefillEstimator, PrefillModel, ReadRate
    from tiered_kv.store.metrics import make_registry

    gate = SplitGate("auto", 0, {"disk": ReadRate(2.0)}, PrefillEstimator(PrefillModel(0.0, 1 / 40000, 0.0)),
                     overlap=True, unit_tokens=256, unit_nbytes=256 << 17)

    def page() -> dict:
        base = {"lookups": 0, "hits": 0, "misses": 0, "bytes_in": 0, "bytes_out": 0, "puts_refused": 0,
                "resident_bytes": 0, "inflight_jobs": 0, "tiers": {}, "gate": gate.report()}
        return stats.parse_prometheus(generate_latest(make_registry(lambda: base, "vllm")).decode())

    a = page()
    assert stats.load_costs(stats.prom_delta(a, a)) == {}
    gate.observe_loaded_step({"cpu": 1e8}, 0.030, 0.006)
    gate.observe_loaded_step({"disk": 1e9}, 0.5, 0.2)
    gate._decisions["recompute"] += 3  # what the lookups of the phase decided (counted as ``count`` does)
    c = stats.load_costs(stats.prom_delta(a, page()))
    assert c == {"load_floor_ms": pytest.approx(30.0), "overlap_s_per_gb": {"disk": pytest.approx(0.3)},
                 "recomputed_hits": 3.0}, c
    assert _cost_line(c) == " | load floor 30.0 ms, 3 hits recomputed, disk overlap 0.300 s/GB"


# ============================================================================ modes and command lines
def _argv(name: str, reg: ModeRegistry | None = None, **opts) -> tuple[list[str], dict]:
    spec = (reg or ModeRegistry()).spec(name, SIZES, metrics_port=9400 if name.startswith("tiered") else None)
    argv = serve_argv(spec, ServerOptions(**opts), "/tmp/model", 8123)
    _, env = serve_env(spec, str(ROOT), {"PYTHONPATH": "/tmp/site"})
    return argv, env


def _kv(argv: list[str]) -> dict | None:
    return json.loads(argv[argv.index("--kv-transfer-config") + 1]) if "--kv-transfer-config" in argv else None


def test_every_mode_shares_the_server_flags_and_only_the_connector_differs():
    base, _ = _argv("none")
    assert base[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", "/tmp/model"]
    for flag, value in (("--load-format", "dummy"), ("--num-gpu-blocks-override", "6912"), ("--port", "8123"),
                        ("--max-num-seqs", "64"), ("--served-model-name", "m")):
        assert base[base.index(flag) + 1] == value
    assert "--skip-tokenizer-init" in base and "--enable-prefix-caching" in base and "-cc.mode=none" in base
    assert "-cc.cudagraph_mode=FULL_DECODE_ONLY" in base and "--enforce-eager" not in base
    for name in BUILTIN:
        argv, env = _argv(name)
        rest = argv[:argv.index("--kv-transfer-config")] if "--kv-transfer-config" in argv else argv
        assert rest == base, name
        assert env["PYTHONHASHSEED"] == "0" and env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
        assert env["PYTHONPATH"].split(os.pathsep) == ["/tmp/site", str(ROOT)]


def test_connector_configs_per_mode():
    assert _kv(_argv("none")[0]) is None
    off = _kv(_argv("offloading")[0])
    assert off["kv_connector"] == "OffloadingConnector" and off["kv_connector_extra_config"] == {"cpu_bytes_to_use": 30 << 30}
    fs = _kv(_argv("offloading-fs")[0])["kv_connector_extra_config"]
    assert fs["spec_name"] == "TieringOffloadingSpec" and fs["cpu_bytes_to_use"] == 6 << 30
    assert fs["secondary_tiers"][0]["type"] == "fs" and fs["secondary_tiers"][0]["root_dir"] == "/data/sb/offloading-fs"
    ours = _kv(_argv("tiered")[0])
    assert ours["kv_connector_module_path"] == "tiered_kv.connector.vllm" and ours["kv_connector"] == "TieredKVConnector"
    assert ours["kv_connector_extra_config"] == {"cpu_bytes": "30GiB", "metrics_port": 9400}
    assert _kv(_argv("tiered-onfinish")[0])["kv_connector_extra_config"]["store_policy"] == "on_finish"
    disk = _kv(_argv("tiered-disk")[0])["kv_connector_extra_config"]
    assert disk == {"cpu_bytes": "6GiB", "disk_path": "/data/sb/tiered-disk", "disk_bytes": "36GiB", "metrics_port": 9400}
    assert _kv(_argv("simple-lazy")[0])["kv_connector_extra_config"] == {"cpu_bytes_to_use": 30 << 30, "lazy_offload": True}
    argv, env = _argv("lmcache")
    assert _kv(argv) == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    assert env["LMCACHE_MAX_LOCAL_CPU_SIZE"] == "30.0" and env["LMCACHE_CHUNK_SIZE"] == "256"
    assert env["LMCACHE_LOCAL_CPU"] == "True" and env["LMCACHE_TRACK_USAGE"] == "false" and "LMCACHE_LOCAL_DISK" not in env
    _, env = _argv("lmcache-disk")
    assert env["LMCACHE_LOCAL_DISK"] == "file:///data/sb/lmcache-disk/" and env["LMCACHE_MAX_LOCAL_CPU_SIZE"] == "6.0"
    assert "LMCACHE_CHUNK_SIZE" not in _argv("tiered")[1]


def test_extra_settings_from_the_command_line():
    reg = ModeRegistry({"tiered": {"store_policy": "on_finish"}, "lmcache": {"chunk_size": 16}})
    reg.define("tiered-g1", {"load_groups": 1})
    reg.define("tiered-disk-eager", {"store_policy": "eager"})
    assert _kv(_argv("tiered", reg)[0])["kv_connector_extra_config"]["store_policy"] == "on_finish"
    g1 = _kv(_argv("tiered-g1", reg)[0])["kv_connector_extra_config"]
    assert g1["load_groups"] == 1 and g1["store_policy"] == "on_finish"
    de = _kv(_argv("tiered-disk-eager", reg)[0])["kv_connector_extra_config"]
    assert de["store_policy"] == "eager" and de["disk_path"] == "/data/sb/tiered-disk-eager"  # disk from the base
    assert _argv("lmcache", reg)[1]["LMCACHE_CHUNK_SIZE"] == "16"
    with pytest.raises(ValueError, match="must start with a known mode"):
        reg.define("other", {})
    with pytest.raises(ValueError, match="unknown mode"):
        reg.spec("tiered-x", SIZES)


def test_the_warm_up_covers_every_moe_band_a_follow_up_and_a_batch_of_the_highest_concurrency(tmp_path):
    """Before the first phase: two prefills per fused-MoE tile band that fits the model length (a token count that is
    a multiple of 16 and one that is not), a follow-up over the longest, then as many short prompts at once as the busiest phase runs (their seconds recorded, batch as one)."""
    from kernel_jit import MOE_BAND_LENGTHS

    out = tmp_path / "out"
    serve_bench.main(SMALL_ARGS + ["--python", _fake_python(tmp_path), "--modes", "none", "--out-dir", str(out),
                                   "--max-model-len", "4096"])
    (start,) = json.loads((out / "serve_bench_llama3-8b.json").read_text())["starts"]
    fits = [n for n in MOE_BAND_LENGTHS if n + 1 <= 4096 - 16 - 64]
    assert start["status"] == "ok" and len(fits) == len(MOE_BAND_LENGTHS) - 1  # 6,144 does not fit
    assert len(start["warmup_s"]) == 2 * len(fits) + 2 and all(x >= 0 for x in start["warmup_s"])


def test_kernel_compilations_inside_a_phase_are_counted_from_the_server_log(tmp_path, capsys):
    """vLLM's JIT monitor lines (the form of 2026-11-30's H200 logs, and ``--jit-monitor-verbose``'s detail) are
    placed in the phases whose times hold them, a second either side; none from the warm-up before the first."""
    t0 = time.mktime((2026, 11, 30, 0, 24, 10, 0, 0, -1))
    stamp = lambda dt: time.strftime("%m-%d %H:%M:%S", time.localtime(t0 + dt))  # noqa: E731
    log = tmp_path / "serve.log"
    log.write_text(
        f"(EngineCore pid=1787) WARNING {stamp(-5)} [jit_monitor.py:135] Triton kernel JIT compilation during "
        "inference: fused_moe_kernel. This causes a latency spike; consider extending warmup to cover this shape.\n"
        f"(EngineCore pid=1787) WARNING {stamp(3)} [jit_monitor.py:132] Triton kernel JIT compilation during "
        "inference: fused_moe_kernel (BLOCK_SIZE_M=64, M=288). This causes a latency spike; ...\n"
        f"(EngineCore pid=1787) WARNING {stamp(3)} [jit_monitor.py:132] Triton kernel JIT compilation during "
        "inference: copy_pieces (ELEM=8). This causes a latency spike; ...\n"
        f"(EngineCore pid=1787) INFO {stamp(4)} [core.py:1] nothing to see\n")
    rec = {"repeats": [{"phases": [{"name": "warm", "t_start": t0, "t_end": t0 + 1.5},
                                   {"name": "c32", "t_start": t0 + 2.5, "t_end": t0 + 6.0},
                                   {"name": "c1", "t_start": t0 + 8.0, "t_end": t0 + 9.0}]}]}
    serve_bench.add_jit(rec, [str(log), str(tmp_path / "missing.log")], "tiered")
    warm, c32, c1 = rec["repeats"][0]["phases"]
    assert rec["jit_compiles"] == 3 and warm["jit"]["n"] == 0 and c1["jit"] == {"n": 0, "kernels": []}
    assert c32["jit"] == {"n": 2, "kernels": ["Triton:copy_pieces", "Triton:fused_moe_kernel"]}
    assert "c32: 2 kernel compilation(s) inside the phase" in capsys.readouterr().out
    assert "--jit-monitor-verbose" in _argv("none")[0]
    # a log of the same name is appended to by later calls: lines before this start's servers began do not count
    serve_bench.add_jit(rec, [str(log)], "tiered", since=t0 + 4.5)  # the log has whole seconds: 1 s of slack
    assert rec["jit_compiles"] == 0 and rec["repeats"][0]["phases"][1]["jit"] == {"n": 0, "kernels": []}
    # eager: vLLM's monitor is off, so nothing logged means nothing known
    serve_bench.add_jit(rec, [str(log)], "tiered", graphs="eager")
    assert all(ph["jit"] is None for ph in rec["repeats"][0]["phases"])


def test_greedy_equality_over_alike_outputs_is_called_weak():
    from serving.report import weak_check

    assert weak_check(16, 1) == " (1 distinct output: a weak check)"
    assert weak_check(128, 3) == " (3 distinct outputs: a weak check)"
    assert weak_check(16, 4) == ""  # a quarter: the check has power
    assert weak_check(3, 1) == ""  # too few requests to tell
    assert weak_check(16, None) == ""  # summaries written before the count


def test_graph_and_tokenizer_options():
    argv, _ = _argv("none", graphs="eager", tokenizer="word")
    assert "--enforce-eager" in argv and "-cc.mode=none" not in argv and "--skip-tokenizer-init" not in argv
    a = serve_bench.parse_args(["--shape", "llama3-8b", "--enforce-eager"])
    assert a.graphs == "eager"
    argv, _ = _argv("tiered", graphs="compile")  # vLLM's own defaults: no compilation or graph flag at all
    assert not any(x.startswith("-cc.") or x in ("--enforce-eager", "--max-cudagraph-capture-size") for x in argv)
    assert "-cc.mode=none" in _argv("tiered")[0]
    assert serve_bench.parse_args(["--shape", "gpt-oss", "--graphs", "compile"]).graphs == "compile"


def test_schedule_interleaves_and_rotates_modes():
    a = serve_bench.parse_args(["--shape", "llama3-8b", "--runs", "3", "--modes", "a,b,c"])
    assert serve_bench.schedule(a, ["a", "b", "c"]) == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"),
                                                       (2, "c"), (2, "a"), (2, "b")]
    a = serve_bench.parse_args(["--shape", "llama3-8b", "--run-offset", "1", "--modes", "a,b"])
    assert serve_bench.schedule(a, ["a", "b"]) == [(1, "b"), (1, "a")]


def test_dry_run_prints_every_mode(capsys):
    serve_bench.main(["--shape", "qwen2.5-32b", "--dry-run", "--modes", "none,tiered,lmcache-disk,offloading-fs"])
    out = capsys.readouterr().out
    assert "# workload" in out and "96 users" in out and "KV 256 KiB/token" in out
    assert out.count("vllm.entrypoints.cli.main serve") == 4
    assert "LMCACHE_LOCAL_DISK=file:///root/tkv/serve-bench/lmcache-disk/" in out


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM lives in .venv")
def test_dry_run_commands_parse_with_vllms_own_server_parser():
    """Every built-in mode's command line goes through vLLM's ``serve`` argument parser (.venv's vLLM),
    our connector's keys through its own validator; a bad key is reported and fails the run."""
    modes = ",".join([*BUILTIN, "tiered-g1", "tiered-bogus"])
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_bench.py"), "--shape", "llama3-8b",
                          "--dry-run", "--validate", "--modes", modes, "--define", 'tiered-g1={"load_groups":1}',
                          "--define", 'tiered-bogus={"bogus":1}'],
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "VLLM_TARGET_DEVICE": "cpu", "PYTHONPATH": str(ROOT)})
    assert out.returncode != 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("vLLM's parser accepts it") == len(BUILTIN) + 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "# tiered-bogus: REJECTED: ConfigError" in out.stdout and "1 mode(s) rejected" in out.stderr


# ============================================================================ report
def _start(mode: str, ttft: float, toks: float, outs: dict, truncated: bool = False, status: str = "ok") -> dict:
    rows = [[u, 1, 100, ttft, 0, 0.1, h, []] for u, h in outs.items()]
    ph = {"name": "c8", "concurrency": 8, "truncated": truncated, "errors": 0,
          "ttft_ms": {"p50": ttft, "p90": ttft * 2, "p99": ttft * 3}, "itl_ms": {"p50": 8.0},
          "output_tok_s": toks, "sources": {"computed": 10.0, "gpu_hit": 0.0, "connector_hit": 90.0},
          "tiers": {"cpu": 90.0} if mode.startswith("tiered") else {}, "rows": rows}
    return {"mode": mode, "status": status, "startup_s": 40.0, "workload_id": "w", "repeats": [{"seed": 1, "phases": [ph]}]}


def test_summary_min_median_max_greedy_and_ratios():
    starts = [_start("none", 100.0, 1000.0, {0: "a", 1: "b"}), _start("none", 120.0, 900.0, {0: "a", 1: "b"}),
              _start("offloading", 80.0, 1100.0, {0: "a", 1: "b"}),
              _start("tiered", 50.0, 1300.0, {0: "a", 1: "x"}), _start("tiered", 40.0, 1250.0, {0: "a", 1: "b"}),
              _start("tiered", 60.0, 1200.0, {0: "a", 1: "b"}), _start("tiered", 1.0, 1.0, {}, truncated=True),
              {"mode": "lmcache", "status": "failed", "error": "boom"}]
    s = report.summarize(starts)
    t = s["tiered"]["phases"]["c8"]
    assert t["ttft_p50_ms"] == {"min": 40.0, "median": 50.0, "max": 60.0, "n": 3}  # the truncated phase is not a sample
    assert t["output_tok_s"]["median"] == 1250.0 and t["tier_cpu"]["median"] == 90.0
    assert t["greedy_vs_none"] == {"compared": 6, "equal": 5} and t["greedy_reference_outputs"] == 2
    assert s["lmcache"]["failed"] == 1 and s["lmcache"]["phases"] == {}
    text = report.table(s)
    assert "| c8 | tiered | 3 | 50.0 [40.0-60.0] |" in text and "5/6" in text
    rows = report.ratio_rows(s)
    assert "| c8 | tiered | offloading | 0.62x | 1.14x | yes |" in rows
    assert "| c8 | tiered | none | 0.45x | 1.32x | yes |" in rows


def test_summary_carries_our_hooks_ms_per_step_where_the_starts_have_it():
    starts = [_start("tiered", 50.0, 1300.0, {0: "a"}), _start("tiered", 40.0, 1250.0, {0: "a"}),
              _start("offloading", 80.0, 1100.0, {0: "a"})]
    for st, ms in zip(starts, (1.9, 2.3)):
        st["repeats"][0]["phases"][0]["worker_time"] = {"hook_ms_per_step": ms, "fence_wait_ms": 0.0}
    s = report.summarize(starts)
    assert s["tiered"]["phases"]["c8"]["hook_ms_per_step"] == {"min": 1.9, "median": 2.1, "max": 2.3, "n": 2}
    assert "hook_ms_per_step" not in s["offloading"]["phases"]["c8"]  # older files and peers: no figure
    text = report.table(s)
    assert "cpu 90; hooks 2.10 [1.90-2.30] ms/step |" in text


def test_floor_table_puts_every_mode_against_the_resident_floor():
    starts = [_start("none-resident", 40.0, 1400.0, {0: "a"}), _start("offloading", 80.0, 1100.0, {0: "a"}),
              _start("tiered", 50.0, 1300.0, {0: "a"}), _start("none", 100.0, 1000.0, {0: "a"})]
    s = report.summarize(starts)
    rows = report.floor_rows(s)
    assert "| c8 | offloading | 2.00x | 0.79x | 40.0 | 56.0 |" in rows
    assert "| c8 | tiered | 1.25x | 0.93x | 40.0 | 56.0 |" in rows
    assert not any("| none-resident |" in r for r in rows)
    assert "Against the engine's floor" in report.table(s)
    assert s["none-resident"]["phases"]["c8"]["greedy_vs_none"] == {"compared": 1, "equal": 1}
    assert report.floor_rows(report.summarize(starts[1:])) == []  # no floor start: no table


def test_v1runner_modes_are_compared_with_the_floor_and_peers_on_their_own_runner():
    starts = [_start("none-resident", 40.0, 1400.0, {0: "a"}), _start("none-resident-v1runner", 30.0, 1500.0, {0: "a"}),
              _start("offloading", 80.0, 1100.0, {0: "a"}), _start("offloading-v1runner", 60.0, 1200.0, {0: "a"}),
              _start("tiered", 50.0, 1300.0, {0: "a"}), _start("tiered-v1runner", 45.0, 1320.0, {0: "a"}),
              _start("tiered-async-v1runner", 36.0, 1440.0, {0: "a"}), _start("tiered-resident", 41.0, 1390.0, {0: "a"})]
    s = report.summarize(starts)
    rows = report.floor_rows(s)
    assert "| c8 | tiered-resident | 1.02x | 0.99x | 40.0 | 56.0 |" in rows  # ours beside the floor's cache: vs it
    assert not any("| tiered-resident |" in r for r in report.ratio_rows(s))  # never a peer's match
    # since 2026-12-01 a start records it, and its summary says so, whatever the name
    assert report.is_resident("tiered-x", {"tiered-x": {"resident": True}})
    assert not report.is_resident("tiered-resident-off", {"tiered-resident-off": {"resident": False}})
    assert report.is_resident("tiered-resident-2") and not report.is_resident("tiered-nonresident")
    assert "| c8 | tiered | 1.25x | 0.93x | 40.0 | 56.0 |" in rows
    assert "| c8 | tiered-v1runner (vs none-resident-v1runner) | 1.50x | 0.88x | 30.0 | 42.0 |" in rows
    assert "| c8 | offloading-v1runner (vs none-resident-v1runner) | 2.00x | 0.80x | 30.0 | 42.0 |" in rows
    assert not any("| none-resident" in r for r in rows)
    ratios = report.ratio_rows(s)
    assert "| c8 | tiered-async-v1runner | offloading-v1runner | 0.60x | 1.20x | yes |" in ratios
    assert "| c8 | tiered | offloading | 0.62x | 1.18x | yes |" in ratios
    assert not any("| tiered-v1runner | offloading |" in r for r in ratios)
    # without the V1 runner's own floor, a V1 mode falls back to the default runner's floor
    rows2 = report.floor_rows(report.summarize([x for x in starts if x["mode"] != "none-resident-v1runner"]))
    assert "| c8 | tiered-v1runner | 1.12x | 0.94x | 40.0 | 42.0 |" in rows2


def test_greedy_outputs_are_checked_against_the_floor_when_a_call_ran_no_none():
    starts = [_start("none-resident", 40.0, 1400.0, {0: "a", 1: "b"}), _start("tiered", 50.0, 1300.0, {0: "a", 1: "x"}),
              _start("offloading", 80.0, 1100.0, {0: "a", 1: "b"})]
    s = report.summarize(starts)
    assert s["tiered"]["phases"]["c8"]["greedy_vs_none"] == {"compared": 2, "equal": 1}  # user 1 differs
    assert s["offloading"]["phases"]["c8"]["greedy_vs_none"] == {"compared": 2, "equal": 2}
    assert s["none-resident"]["phases"]["c8"]["greedy_vs_none"] == {"compared": 0, "equal": 0}  # not with itself
    # where `none` ran, it is the reference (the floor is compared with it like any other mode)
    s2 = report.summarize([_start("none", 100.0, 1000.0, {0: "a", 1: "x"})] + starts)
    assert s2["tiered"]["phases"]["c8"]["greedy_vs_none"] == {"compared": 2, "equal": 2}
    assert s2["none-resident"]["phases"]["c8"]["greedy_vs_none"] == {"compared": 2, "equal": 1}
    assert "greedy_vs_peer" not in s2["tiered"]["phases"]["c8"]  # a reference without a connector was there


def test_greedy_outputs_fall_back_to_vllms_connector_when_a_call_ran_neither_none_nor_the_floor():
    starts = [_start("tiered", 50.0, 1300.0, {0: "a", 1: "x"}), _start("offloading", 80.0, 1100.0, {0: "a", 1: "b"}),
              _start("lmcache", 90.0, 1000.0, {0: "a", 1: "b"})]
    s = report.summarize(starts)
    ph = s["tiered"]["phases"]["c8"]
    assert ph["greedy_vs_none"] == {"compared": 0, "equal": 0}
    assert ph["greedy_vs_peer"] == {"peer": "offloading", "compared": 2, "equal": 1}  # user 1 differs
    assert s["lmcache"]["phases"]["c8"]["greedy_vs_peer"]["equal"] == 2
    assert "greedy_vs_peer" not in s["offloading"]["phases"]["c8"]  # not with itself
    assert any("| c8 | tiered |" in r and "| 1/2 vs offloading |" in r for r in report.table(s).splitlines())


def test_resident_floor_mode_gets_a_gpu_cache_for_the_whole_history(tmp_path, monkeypatch):
    wp = WorkloadParams(users=128, system_tokens=1024, context_tokens=1024, turn_tokens=128, answer_tokens=32)
    sz = sizes(wp, kv_bytes_per_token("llama3-8b"), 6912)
    blocks = resident_gpu_blocks(wp, sz)
    assert blocks * 16 >= sz["stored_tokens"] + 128 * 32 and blocks * 16 < 1.3 * sz["stored_tokens"]
    rec_path = tmp_path / "rec.jsonl"
    monkeypatch.setenv("FAKE_SERVE_RECORD", str(rec_path))
    out = tmp_path / "out"
    serve_bench.main(SMALL_ARGS + ["--python", _fake_python(tmp_path), "--modes", "none,none-resident",
                                   "--gpu-blocks", "8", "--out-dir", str(out)])
    got = sorted(int(r["argv"][r["argv"].index("--num-gpu-blocks-override") + 1]) for r in _records(rec_path))
    small = WorkloadParams(users=6, system_tokens=32, context_tokens=48, turn_tokens=16, answer_tokens=4,
                           concurrency=(4, 2, 1), c1_users=2, vocab_size=SHAPES["llama3-8b"]["vocab_size"])
    want = resident_gpu_blocks(small, sizes(small, kv_bytes_per_token("llama3-8b"), 8))
    assert got == [8, want] and want > 8, (got, want)
    doc = json.loads((out / "serve_bench_llama3-8b.json").read_text())
    assert [s["status"] for s in doc["starts"]] == ["ok", "ok"]


def test_merge_files_and_write_json(tmp_path):
    a = {"shape": "llama3-8b", "device": "H200", "date": "d1", "starts": [_start("none", 100.0, 1000.0, {0: "a"})]}
    b = {"shape": "llama3-8b", "device": "H200", "date": "d2", "starts": [_start("tiered", 50.0, 1200.0, {0: "a"})]}
    m = report.merge([a, b])["llama3-8b"]
    assert len(m["starts"]) == 2 and m["devices"] == ["H200"]
    assert m["summary"]["tiered"]["phases"]["c8"]["greedy_vs_none"] == {"compared": 1, "equal": 1}
    path = report.write_json(str(tmp_path / "x" / "r.json"), m)
    assert json.loads(Path(path).read_text())["shape"] == "llama3-8b"
    # a merged document merges again (plot.py reads the merged files of docs/results): devices survive
    c = {"shape": "llama3-8b", "device": "H100", "date": "d3", "starts": [_start("offloading", 70.0, 1100.0, {0: "a"})]}
    again = report.merge([m, c])["llama3-8b"]
    assert again["devices"] == ["H100", "H200"] and again["dates"] == ["d1", "d2", "d3"]
    assert [s["device"] for s in again["starts"]] == ["H200", "H200", "H100"]
    assert [s["call"] for s in again["starts"]] == [0, 1, 2]  # each start's index in ``files``, kept through merges
    legacy = {**m, "starts": [{k: v for k, v in st.items() if k != "call"} for st in m["starts"]]}
    twice = report.merge([c, legacy])["llama3-8b"]
    assert [s["call"] for s in twice["starts"]] == [0, None, None]
    assert [s["call"] for s in report.merge([twice, a])["llama3-8b"]["starts"]] == [0, None, None, 3]


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not in .venv (it is on the GPU image)")
def test_plot_writes_a_png(tmp_path):
    starts = [_start("none", 100.0, 1000.0, {0: "a"}), _start("tiered", 50.0, 1200.0, {0: "a"})]
    png = report.plot(report.summarize(starts), "t", str(tmp_path / "p.png"))
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_from_merges_files_and_prints_the_table(tmp_path, capsys):
    for i, (mode, ttft) in enumerate((("none", 100.0), ("tiered", 50.0))):
        doc = {"shape": "qwen2.5-7b", "device": "H200", "starts": [_start(mode, ttft, 1000.0, {0: "a"})]}
        (tmp_path / f"{i}.json").write_text(json.dumps(doc))
    serve_bench.main(["--plot-from", str(tmp_path / "0.json"), str(tmp_path / "1.json"), "--out-dir",
                      str(tmp_path / "o"), "--no-plot"])
    out = capsys.readouterr().out
    assert "| c8 | tiered | 1 | 50.0 |" in out
    merged = json.loads((tmp_path / "o" / "serve_bench_qwen2.5-7b.merged.json").read_text())
    assert merged["summary"]["none"]["starts_ok"] == 1


# ============================================================================ client against the stub
@pytest.fixture
def stub():
    from serve_stub import StubServer

    s = StubServer().start()
    yield s
    s.stop()


def test_stream_completion_records_ttft_chunks_usage(stub):
    from serving import client

    stub.chunk_tokens = 3

    async def go():
        async with client.make_session(2, 30) as session:
            return await client.stream_completion(session, stub.url, list(range(1000, 1040)), 7)

    r = asyncio.run(go())
    assert r.error is None and r.token_ids == stub.outputs(list(range(1000, 1040)), 7)
    assert r.chunk_tokens == [3, 3, 1] and r.ttft_s == r.chunk_times[0] > 0
    assert r.prompt_tokens == 40 and r.completion_tokens == 7 and r.cached_tokens == 0 and r.queue_ms == 0.5


def test_stream_completion_reports_http_errors(stub):
    from serving import client

    stub.fail_every = 1

    async def go():
        async with client.make_session(2, 30) as session:
            return await client.stream_completion(session, stub.url, [1000] * 8, 2)

    r = asyncio.run(go())
    assert r.error.startswith("HTTP 500") and r.ttft_s is None


def test_phase_keeps_exactly_c_users_in_flight_and_turns_in_order(stub):
    from serving import client

    stub.token_delay_s = 0.003
    wl = Workload(SMALL, 3)
    items = [(u, t) for t in (0, 1) for u in range(6)]

    async def go():
        async with client.make_session(4, 30) as session:
            return await client.run_phase(session, stub.url, items, wl.prompt, 4, 4)

    run = asyncio.run(go())
    assert len(run.results) == 12 and not run.truncated and all(r.error is None for r in run.results)
    assert stub.max_in_flight == 4
    for u in range(6):  # a user's turn 1 was sent only after its turn 0 finished
        r0, r1 = (next(r for r in run.results if (r.user, r.turn) == (u, t)) for t in (0, 1))
        assert r1.sent_at >= r0.sent_at + r0.chunk_times[-1]


def test_phase_stops_taking_requests_at_the_deadline(stub):
    import time

    from serving import client

    wl = Workload(SMALL, 3)

    async def go():
        async with client.make_session(2, 30) as session:
            return await client.run_phase(session, stub.url, [(u, 0) for u in range(6)], wl.prompt, 2, 4,
                                          stop_at=time.monotonic() - 1)

    run = asyncio.run(go())
    assert run.truncated and run.results == []


def test_attach_drives_all_phases_and_compares_greedy_outputs(stub, tmp_path, capsys):
    common = ["--shape", "llama3-8b", "--attach", stub.url, "--users", "6", "--system-tokens", "32",
              "--context-tokens", "48", "--turn-tokens", "16", "--answer-tokens", "4", "--concurrency", "4,2,1",
              "--c1-users", "2", "--phase-gap-s", "0", "--no-plot"]
    serve_bench.main(common + ["--modes", "none", "--out-dir", str(tmp_path / "a")])
    serve_bench.main(common + ["--modes", "tiered", "--out-dir", str(tmp_path / "b")])
    a = json.loads((tmp_path / "a" / "serve_bench_llama3-8b.json").read_text())
    phases = a["starts"][0]["repeats"][0]["phases"]
    assert [p["name"] for p in phases] == ["warm", "c4", "c2", "c1"]
    assert [p["requests"] for p in phases] == [6, 6, 6, 2] and all(p["errors"] == 0 for p in phases)
    # the flush request after each phase adds 16 computed tokens: sources come from /metrics deltas
    assert phases[0]["sources"]["computed"] == 6 * 96 - 32 * 5 + 16  # the system prompt is cached after user 0
    assert phases[1]["sources"]["connector_hit"] > 0
    assert len(phases[1]["rows"]) == 6 and phases[1]["rows"][0][:2] == [0, 1]
    assert a["starts"][0]["status"] == "ok" and "summary" in a and "| c4 | none |" in a["table"]
    merged = report.merge([a, json.loads((tmp_path / "b" / "serve_bench_llama3-8b.json").read_text())])
    g = merged["llama3-8b"]["summary"]["tiered"]["phases"]["c4"]["greedy_vs_none"]
    assert g == {"compared": 6, "equal": 6}  # same prompts, the stub is deterministic: equal outputs


# ============================================================================ engine starts (a fake `vllm serve`)
SMALL_ARGS = ["--shape", "llama3-8b", "--users", "6", "--system-tokens", "32", "--context-tokens", "48",
              "--turn-tokens", "16", "--answer-tokens", "4", "--concurrency", "4,2,1", "--c1-users", "2",
              "--phase-gap-s", "0", "--no-plot"]


def _fake_python(tmp_path: Path, lmcache: bool = True) -> str:
    """An interpreter stand-in whose ``-m vllm.entrypoints.cli.main serve`` runs ``fake_serve.py``; its ``-c`` (the
    benchmark's look for a peer's package) runs the real interpreter with an empty ``lmcache`` package on its path
    (LMCache cannot be installed here; the fake server stands in for its engine too), or without (``lmcache``
    False: a GPU machine set up with ``SERVE_ONLY=1``)."""
    stub = tmp_path / "peer-packages"
    (stub / "lmcache").mkdir(parents=True, exist_ok=True)
    (stub / "lmcache" / "__init__.py").write_text("")
    path = f"PYTHONPATH={stub}:$PYTHONPATH " if lmcache else ""
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\nif [ \"$1\" = -c ]; then {path}exec {sys.executable} \"$@\"; fi\n"
                       f"exec {sys.executable} {Path(__file__).resolve().parent / 'fake_serve.py'} \"$@\"\n")
    wrapper.chmod(0o755)
    return str(wrapper)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("fail, tries, settled", [
    ("skip", [("compile", "skip")], ("compile", "word")),  # the log names the tokenizer: that changes first
    ("graphs", [("compile", "skip"), ("decode", "skip")], ("eager", "skip")),  # compile, then decode, then eager
])
def test_starts_fall_back_once_then_keep_what_worked(tmp_path, monkeypatch, fail, tries, settled):
    rec_path = tmp_path / "rec.jsonl"
    monkeypatch.setenv("FAKE_SERVE_FAIL", fail)
    monkeypatch.setenv("FAKE_SERVE_RECORD", str(rec_path))
    out = tmp_path / "out"
    serve_bench.main(SMALL_ARGS + ["--python", _fake_python(tmp_path), "--modes", "none,lmcache,tiered-disk",
                                   "--out-dir", str(out), "--disk-root", str(tmp_path / "disk")])
    doc = json.loads((out / "serve_bench_llama3-8b.json").read_text())
    first, second, third = doc["starts"]
    assert [s["status"] for s in doc["starts"]] == ["ok", "ok", "ok"]
    assert [(t["graphs"], t["tokenizer"]) for t in first["failed_tries"]] == tries
    assert (first["graphs"], first["tokenizer"]) == settled == (doc["fallback"]["graphs"], doc["fallback"]["tokenizer"])
    assert "failed_tries" not in second and (second["graphs"], second["tokenizer"]) == settled
    assert second["mode"] == "lmcache" and second["lmcache_native_ops"] is True and "lmcache_native_ops" not in first
    assert len(first["repeats"][0]["phases"]) == 4 and first["startup_s"] > 0
    runs = _records(rec_path)
    n = len(tries)  # failed tries before the first start's success
    assert len(runs) == n + 3 and all(r["PYTHONHASHSEED"] == "0" for r in runs)
    assert runs[n + 1]["LMCACHE_CHUNK_SIZE"] == "256" and runs[0]["LMCACHE_CHUNK_SIZE"] is None
    disk_kv = json.loads(runs[n + 2]["argv"][runs[n + 2]["argv"].index("--kv-transfer-config") + 1])
    assert disk_kv["kv_connector_extra_config"]["disk_path"] == str(tmp_path / "disk" / "tiered-disk")
    assert not (tmp_path / "disk" / "tiered-disk").exists()  # wiped after the start
    assert all(_gone(r["pid"]) for r in runs)  # every server's process group was stopped
    logs = sorted(p.name for p in out.glob("*.log"))
    assert logs == sorted(["serve_llama3-8b_lmcache_r0.log", "serve_llama3-8b_none_r0.log",
                           *(f"serve_llama3-8b_none_r0_try{i}.log" for i in range(1, n + 1)),
                           "serve_llama3-8b_tiered-disk_r0.log"])
    assert ("tokenizer needed" if fail == "skip" else "graph capture failed") in first["failed_tries"][0]["error"] + \
        (out / "serve_llama3-8b_none_r0.log").read_text()
    assert (out / "serve_bench_llama3-8b.partial.json").exists()


def test_a_failed_mode_is_recorded_with_its_log_tail_and_the_rest_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_SERVE_FAIL", "skip")
    out = tmp_path / "out"
    serve_bench.main(SMALL_ARGS + ["--python", _fake_python(tmp_path), "--modes", "none,tiered", "--tokenizer", "skip",
                                   "--out-dir", str(out), "--runs", "2"])
    doc = json.loads((out / "serve_bench_llama3-8b.json").read_text())
    assert [(s["mode"], s["run"], s["status"]) for s in doc["starts"]] == [
        ("none", 0, "failed"), ("tiered", 0, "failed"), ("tiered", 1, "failed"), ("none", 1, "failed")]
    assert "tokenizer needed" in doc["starts"][0]["log_tail"]
    assert "FAILED" in capsys.readouterr().out


def test_an_lmcache_start_on_its_torch_fallback_is_flagged(tmp_path, monkeypatch, capsys):
    # the warning LMCache 0.5.3 logs (CudaDeviceOps.ensure_native) when `import lmcache.c_ops` fails
    monkeypatch.setenv("FAKE_SERVE_SAY", "[2026-11-23 12:00:00] LMCache WARNING: lmcache.c_ops compiled extension "
                       "not found; CudaDeviceOps stays on the torch baseline for all ops.")
    out = tmp_path / "out"
    serve_bench.main(SMALL_ARGS + ["--python", _fake_python(tmp_path), "--modes", "lmcache,none",
                                   "--out-dir", str(out)])
    starts = {s["mode"]: s for s in json.loads((out / "serve_bench_llama3-8b.json").read_text())["starts"]}
    assert starts["lmcache"]["status"] == "ok" and starts["lmcache"]["lmcache_native_ops"] is False
    assert "lmcache_native_ops" not in starts["none"]  # only LMCache's own warning counts, only for its modes
    assert "LMCache runs on its torch fallback" in capsys.readouterr().out


def test_lmcache_modes_are_skipped_when_the_servers_python_cannot_import_it(tmp_path):
    """Round 25 set up the GPU machine with ``SERVE_ONLY=1`` and an LMCache start died in vLLM's engine start-up
    (``No module named 'lmcache'``): now the start is skipped before any GPU time, saying why and what to do, and
    the other modes run."""
    out = tmp_path / "out"
    serve_bench.main(SMALL_ARGS + ["--python", _fake_python(tmp_path, lmcache=False), "--modes", "lmcache,none",
                                   "--out-dir", str(out)])
    starts = {s["mode"]: s for s in json.loads((out / "serve_bench_llama3-8b.json").read_text())["starts"]}
    assert starts["lmcache"]["status"] == "skipped" and starts["none"]["status"] == "ok"
    assert "lmcache is not importable" in starts["lmcache"]["reason"]
    assert "serve_setup.sh" in starts["lmcache"]["reason"]


def test_a_failing_interpreter_is_not_reported_as_a_missing_package(tmp_path):
    """``module_missing`` says the package is missing only when the interpreter ran and did not find it (exit 3); an
    interpreter that fails is named as such."""
    broken = tmp_path / "broken-python"
    broken.write_text("#!/bin/sh\nexit 1\n")
    broken.chmod(0o755)
    assert serve_bench.module_missing(sys.executable, dict(os.environ), "json") is None
    assert "is not importable" in serve_bench.module_missing(sys.executable, dict(os.environ), "no_such_pkg_xyz")
    assert "could not look for lmcache (exit 1)" in serve_bench.module_missing(str(broken), dict(os.environ), "lmcache")


def test_deadline_skips_starts_that_would_not_fit(tmp_path):
    out = tmp_path / "out"
    serve_bench.main(SMALL_ARGS + ["--python", _fake_python(tmp_path), "--modes", "none,tiered", "--deadline-s", "30",
                                   "--out-dir", str(out)])
    doc = json.loads((out / "serve_bench_llama3-8b.json").read_text())
    assert [s["status"] for s in doc["starts"]] == ["skipped", "skipped"]
    assert doc["starts"][0]["reason"].startswith("deadline")


def test_a_server_that_dies_mid_run_fails_its_start_without_fallbacks(tmp_path, monkeypatch):
    from kernel_jit import MOE_BAND_LENGTHS

    warm = 2 * len(MOE_BAND_LENGTHS) + 1 + 4  # the warm-up: 2 prefills per MoE band (all fit 8,192), a follow-up, 4 at once
    monkeypatch.setenv("FAKE_SERVE_EXIT_AFTER", str(warm + 3))  # then 3 of the warm phase
    out = tmp_path / "out"
    serve_bench.main(SMALL_ARGS + ["--python", _fake_python(tmp_path), "--modes", "none", "--out-dir", str(out)])
    (start,) = json.loads((out / "serve_bench_llama3-8b.json").read_text())["starts"]
    assert start["status"] == "failed" and "during the workload" in start["error"]
    assert len(start["failed_tries"]) == 1
    assert start["repeats"][0]["phases"][0]["errors"] > 0


def test_env_setting_goes_to_the_server_environment_not_the_connector():
    reg = ModeRegistry()
    sz = Sizes(cpu_gib=4, disk_cpu_gib=1, disk_gib=8, disk_root="/tmp/x")
    v1 = reg.spec("tiered-v1runner", sz)
    assert v1.env == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert "env" not in v1.kv_transfer["kv_connector_extra_config"]
    assert reg.spec("offloading-v1runner", sz).env == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    floor_v1 = reg.spec("none-resident-v1runner", sz)
    assert floor_v1.gpu_resident and floor_v1.kv_transfer is None and floor_v1.env == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    async_v1 = reg.spec("tiered-async-v1runner", sz)
    assert async_v1.kv_transfer["kv_connector_extra_config"]["load_mode"] == "async"
    assert async_v1.env == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert reg.spec("tiered-smk", sz).kv_transfer["kv_connector_extra_config"]["in_step_copy"] == "sm_kernel"
    resident = reg.spec("tiered-resident", sz)  # ours beside the floor's GPU cache: the flag is serve_bench's own
    assert resident.gpu_resident and "gpu_resident" not in resident.kv_transfer["kv_connector_extra_config"]
    assert not reg.spec("tiered", sz).gpu_resident
    reg.define("none-v1", {"env": {"VLLM_USE_V2_MODEL_RUNNER": "0"}})
    assert reg.spec("none-v1", sz).env == {"VLLM_USE_V2_MODEL_RUNNER": "0"} and reg.spec("none-v1", sz).kv_transfer is None
    env, delta = serve_env(v1, "/repo", {})
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0" == delta["VLLM_USE_V2_MODEL_RUNNER"]
    reg.define("tiered-badenv", {"env": {"X": 1}})
    with pytest.raises(ValueError, match="'env' must map variable names to strings"):
        reg.spec("tiered-badenv", sz)
    with pytest.raises(ValueError, match="takes no settings"):
        reg.define("none-x", {"load_mode": "async"})


# ============================================================================ load trace (--trace)
def test_burst_modes_and_trace_path_in_the_commands():
    ours = lambda m: _kv(_argv(m)[0])["kv_connector_extra_config"]  # noqa: E731
    assert ours("tiered-async")["load_mode"] == "async" and ours("tiered-adaptive")["load_mode"] == "adaptive"
    assert ours("tiered-staged")["in_step_copy"] == "staged" and "load_mode" not in ours("tiered-staged")
    assert ours("tiered-copyengine")["in_step_copy"] == "copy_engine" and "in_step_copy" not in ours("tiered")
    both = ours("tiered-adaptive-staged")
    assert both["load_mode"] == "adaptive" and both["in_step_copy"] == "staged"
    from serving.modes import with_trace

    spec = with_trace(ModeRegistry().spec("tiered-adaptive", SIZES), "/o/trace_x")
    assert spec.kv_transfer["kv_connector_extra_config"]["trace_path"] == "/o/trace_x"
    assert ModeRegistry().spec("tiered-adaptive", SIZES).kv_transfer["kv_connector_extra_config"].get("trace_path") is None
    off = ModeRegistry().spec("offloading", SIZES)
    assert with_trace(off, "/o/t") is off


def test_trace_summary_per_phase(tmp_path):
    from serving import trace_summary

    def ln(t, ins, asy, held, landed=()):
        return {"step": int(t * 10), "t": t, "in_step": {"loads": ins, "bytes": ins * 100_000_000},
                "async": {"loads": asy, "bytes": asy * 100_000_000}, "start_load_ms": held, "fence_ms": 0.0,
                "async_in_flight": asy, "landed": list(landed)}

    land = lambda kind, ms: {"job": 1, "kind": kind, "step": 1, "bytes": 100_000_000, "gpu_ms": ms, "host_ms": 2 * ms}  # noqa: E731
    lines = [ln(10.0, 2, 6, 4.0, [land("in_step", 2.0), land("in_step", 4.0)]),
             ln(10.1, 0, 0, 0.0, [land("async", 2.0)] * 6),
             ln(20.0, 1, 0, 1.0)]  # another phase
    (tmp_path / "tr.rank0.jsonl").write_text("\n".join(json.dumps(x) for x in lines[:2]) + "\n{cut")
    (tmp_path / "tr.rank1.jsonl").write_text(json.dumps(lines[2]) + "\n")
    read = trace_summary.read_lines(str(tmp_path / "tr"))
    assert [x["t"] for x in read] == [10.0, 10.1, 20.0]  # both ranks, sorted, the cut line skipped
    s = trace_summary.summarize_phase(read, 9.9, 10.05)
    assert s["lines"] == 2 and s["loading_steps"] == 1
    assert s["in_step"]["loads"] == 2 and s["async"]["loads"] == 6 and s["async"]["bytes"] == 600_000_000
    assert s["in_step"]["gpu_ms"]["p50"] == 3.0 and s["in_step"]["gbps"] == round(200e6 / 6.0 / 1e6, 2)
    assert s["async"]["host_ms"]["p50"] == 4.0 and s["start_load_ms"]["max"] == 4.0
    assert trace_summary.summarize_phase(read, 19.5, 20.5)["in_step"]["loads"] == 1
    assert "trace: 1 loading steps" in trace_summary.line("tiered", "c32", s)
    assert s["big_step_hold_gbps"] == {"n": 0}  # 0.2 GB in-step: no big step
    # two steps of >= 1 GB in-step: bytes over the time start_load_kv held the thread
    big = [ln(30.0, 12, 0, 24.0), ln(30.1, 20, 0, 40.0), ln(30.2, 3, 0, 2.0)]
    b = trace_summary.summarize_phase(big, 29.9, 30.3)
    assert b["big_step_hold_gbps"]["n"] == 2 and b["big_step_hold_gbps"]["p50"] == 50.0
    assert "held the thread for bytes / 50.0 GB/s" in trace_summary.line("tiered", "c32", b)
    assert b["staged_steps"] == 0 and "staged in" not in trace_summary.line("tiered", "c32", b)
    big[0]["in_step"]["staged"] = 1  # in_step_copy staged / auto: that step's copy went through the staging buffer
    b = trace_summary.summarize_phase(big, 29.9, 30.3)
    assert b["staged_steps"] == 1 and "staged in 1 steps" in trace_summary.line("tiered", "c32", b)
    assert b["sm_steps"] == 0 and "SM kernel in" not in trace_summary.line("tiered", "c32", b)
    big[1]["in_step"]["sm"] = 1  # in_step_copy auto in a step of few tokens: that step's copy took the SM kernel
    b = trace_summary.summarize_phase(big, 29.9, 30.3)
    assert b["sm_steps"] == 1 and "SM kernel in 1 steps" in trace_summary.line("tiered", "c32", b)
    assert b["staging_alloc_steps"]["n"] == 0 and "staging allocated" not in trace_summary.line("tiered", "c32", b)
    big[0]["in_step"]["staging_allocs"] = 1  # that step's staged load allocated its buffer: its hold is listed
    b = trace_summary.summarize_phase(big, 29.9, 30.3)
    assert b["staging_alloc_steps"] == {"n": 1, "start_load_ms": [24.0]}
    assert "staging allocated in 1 steps (start_load_kv [24.0] ms)" in trace_summary.line("tiered", "c32", b)
    assert b["steps"]["loading"]["n"] == 0  # traces written before launch_ms: no forward figures, nothing claimed
    assert "beside stores" not in trace_summary.line("tiered", "c32", b)  # older traces: no front_jobs
    for x, jobs, launch in zip(big, (3, 0, 1), (30.0, 20.0, 10.0)):  # stores queued at two steps' start_load_kv
        x["front_jobs"], x["launch_ms"] = jobs, launch
    b = trace_summary.summarize_phase(big, 29.9, 30.3)
    busy, idle = b["beside_stores"]["busy"], b["beside_stores"]["idle"]
    assert busy["start_load_ms"]["n"] == 2 and idle["launch_ms"]["p50"] == 20.0
    assert ("beside stores 2: start_load_kv p50 13.0, launch p50 20.0 ms; without 1: start_load_kv p50 40.0, launch "
            "p50 20.0 ms") in trace_summary.line("tiered", "c32", b)


def test_the_summary_counts_prefill_steps_from_the_size_the_trace_writes_them():
    from serving import trace_summary
    from tiered_kv.connector.vllm import trace

    assert trace_summary.PREFILL_LINE_TOKENS == trace.PREFILL_LINE_TOKENS


def test_forward_times_belong_to_the_file_that_wrote_them():
    """Two engines (replicas) or ranks number their steps alike: a step's GPU time is the one its own file gave."""
    from serving import trace_summary

    def ln(src, step, tokens, fwd):
        return {"_src": src, "step": step, "t": 1.0, "tokens": tokens, "launch_ms": 5.0, "fwd": fwd,
                "in_step": {"loads": 0, "bytes": 0}, "async": {"loads": 0, "bytes": 0}, "landed": []}

    lines = [ln("a", 7, 1000, {}), ln("b", 7, 200, {}), ln("a", 8, 4, {"7": 40.0}), ln("b", 8, 4, {"7": 9.0})]
    assert trace_summary.forward_times(lines) == {("a", 7): 40.0, ("b", 7): 9.0}
    s = trace_summary.summarize_phase(lines, 0.0, 2.0)
    assert s["steps"]["recompute"]["n"] == 2 and s["steps"]["recompute"]["gpu_fwd_ms"]["max"] == 40.0
    assert s["steps"]["recompute"]["gpu_fwd_ms"]["sum"] == 49.0  # not 80: b's step 7 keeps b's time


def test_trace_timeline_cuts_scheduled_to_applied_at_the_workers_clock(tmp_path):
    """The scheduler's lines (``read_sched``) joined to the worker lines of the same engine by step: the parts of a
    step's scheduled-to-applied time; another replica's step of the same number, or a step without the scheduler's
    ``t_applied``, does not mix in."""
    from serving import trace_summary

    def ln(step, t_begin, t, loads):
        return {"step": step, "t_begin": t_begin, "t": t, "tokens": 1121, "launch_ms": 17.0,
                "in_step": {"loads": loads, "bytes": loads * 75_000_000}, "async": {"loads": 0, "bytes": 0},
                "start_load_ms": 1.5 if loads else 0.0, "fence_ms": 0.0, "landed": [], "fwd": {}}

    for base, rows in (("a", [ln(7, 100.004, 100.020, 7), ln(9, 100.104, 100.120, 0)]),
                       ("b", [ln(7, 200.001, 200.002, 7)])):
        (tmp_path / f"{base}.rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # a second rank of engine a, which took step 7 earlier and returned later: the step's output waited for it
    (tmp_path / "a.rank1.jsonl").write_text(json.dumps(ln(7, 100.002, 100.024, 7)) + "\n")
    sched_a = [{"step": 7, "t": 100.0, "t_hook": 99.997, "t_applied": 100.030, "tokens": 1121, "new": 7, "loads": 7,
                "async_loads": 0, "hooks_ms": 2.0, "apply_ms": 0.5},
               {"step": 9, "t": 100.1, "tokens": 1121, "new": 7, "loads": 0, "async_loads": 0, "hooks_ms": 1.0}]
    (tmp_path / "a.sched.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sched_a) + '{"cut')
    (tmp_path / "b.sched.jsonl").write_text(json.dumps({**sched_a[0], "t": 199.0, "t_hook": None, "t_applied": 201.0}) + "\n")
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    lines = sorted((x for p in paths for x in trace_summary.read_lines(p)), key=lambda x: x["t"])
    sched = [x for p in paths for x in trace_summary.read_sched(p)]
    assert len(sched) == 3  # the cut line skipped
    s = trace_summary.summarize_phase([x for x in lines if "/a.rank" in x["_src"]], 99.0, 101.0, sched)
    tl = s["steps"]["loading"]["timeline"]
    assert tl["sched_ms"]["n"] == 1 and tl["sched_ms"]["p50"] == pytest.approx(33.0)  # from our first hook
    assert tl["schedule_ms"]["p50"] == pytest.approx(3.0)
    assert tl["to_worker_ms"]["p50"] == pytest.approx(2.0) and tl["worker_ms"]["p50"] == pytest.approx(22.0)  # rank 1
    assert tl["after_ms"]["p50"] == pytest.approx(6.0)
    assert tl["hooks_ms"]["p50"] == 2.0 and tl["apply_ms"]["p50"] == 0.5
    assert s["steps"]["recompute"]["timeline"]["sched_ms"]["n"] == 0  # step 9's output never came back
    assert s["steps_by_tokens"]["1120"]["loading"]["timeline"]["sched_ms"]["p50"] == pytest.approx(33.0)
    assert "scheduled to applied p50 33.0 ms (schedule 3.0, to worker 2.0, worker 22.0, after 6.0)" in \
        trace_summary.line("tiered", "c8", s)
    b = trace_summary.summarize_phase(lines, 199.0, 201.0, sched)["steps"]["loading"]["timeline"]
    assert b["sched_ms"]["p50"] == pytest.approx(2000.0) and b["sched_ms"]["n"] == 1  # b's own line, not a's
    assert b["schedule_ms"]["n"] == 0  # b's line has no t_hook: its time starts at the build
    assert "timeline" not in trace_summary.summarize_phase(lines, 99.0, 101.0)["steps"]["loading"]  # no sched lines


def test_trace_summary_sets_loading_forwards_beside_recomputing_ones():
    """Lined steps (loads, or >= PREFILL_LINE_TOKENS scheduled): launch time and the GPU forward time that a later
    line carries, loading steps apart from recomputing ones; decode lines that only carry ``fwd`` count for neither."""
    from serving import trace_summary

    def ln(step, t, tokens, loads, launch, fwd=None):
        return {"step": step, "t": t, "tokens": tokens, "launch_ms": launch,
                "in_step": {"loads": loads, "bytes": loads * 60_000_000}, "async": {"loads": 0, "bytes": 0},
                "start_load_ms": 2.5 if loads else 0.0, "fence_ms": 0.0, "landed": [], "fwd": fwd or {}}

    lines = [ln(1, 1.0, 353, 1, 40.0), ln(2, 1.1, 1633, 0, 30.0, {"1": 41.0}), ln(3, 1.2, 4, 0, 0.5, {"2": 31.0}),
             ln(4, 1.3, 353, 1, 44.0, {}), ln(5, 9.0, 2, 0, 0.4, {"4": 12.0, "99": 5.0})]  # 4's time after the phase
    s = trace_summary.summarize_phase(lines, 0.9, 1.35)
    lo, re_ = s["steps"]["loading"], s["steps"]["recompute"]
    assert lo["n"] == 2 and lo["launch_ms"]["p50"] == 42.0 and lo["gpu_fwd_ms"]["n"] == 2
    assert lo["gpu_fwd_ms"]["p50"] == 26.5 and lo["gpu_fwd_ms"]["max"] == 41.0  # 12.0 from the line after
    assert re_["n"] == 1 and re_["tokens"]["p50"] == 1633 and re_["gpu_fwd_ms"]["p50"] == 31.0
    text = trace_summary.line("tiered", "c1", s)
    assert "loading 2 steps: tokens p50 353.0, launch p50 42.0 ms, GPU forward p50 26.5 ms" in text
    assert "recompute 1 steps: tokens p50 1633.0, launch p50 30.0 ms, GPU forward p50 31.0 ms" in text
    # by step size (16-token buckets): the two 353-token loading steps apart from the 1,633-token recompute
    by = s["steps_by_tokens"]
    assert set(by) == {"352", "1632"} and by["352"]["loading"]["n"] == 2 and by["352"]["recompute"]["n"] == 0
    assert by["1632"]["recompute"]["gpu_fwd_ms"]["p50"] == 31.0 and by["1632"]["loading"]["n"] == 0
    # 160-167 tokens share a bucket; the most frequent buckets win, ties to the smaller size; plain JSON
    many = [ln(10 + i, 1.0 + i / 100, size, i % 2, 5.0)
            for i, size in enumerate([160, 167, 163] + [400] * 3 + [500] * 2 + [600] * 2 + [700] * 2 + [1121] * 4)]
    by = trace_summary.summarize_phase(many, 0.9, 2.0)["steps_by_tokens"]
    assert list(by) == ["160", "400", "496", "1120"]  # counts 3, 3, 2 (the smaller of 496 / 592 / 688), 4
    assert by["160"]["loading"]["n"] + by["160"]["recompute"]["n"] == 3 and by["1120"]["recompute"]["n"] == 2
    assert json.loads(json.dumps(by)) == by


def test_trace_flag_collects_each_start_and_summarises_its_phases(tmp_path):
    out = tmp_path / "out"
    serve_bench.main(SMALL_ARGS + ["--python", _fake_python(tmp_path), "--modes", "tiered-adaptive,none", "--trace",
                                   "--out-dir", str(out), "--tokenizer", "skip", "--graphs", "decode"])
    doc = json.loads((out / "serve_bench_llama3-8b.json").read_text())
    ours, none = doc["starts"]
    assert ours["status"] == "ok" and ours["trace_path"] == "trace_llama3-8b_tiered-adaptive_r0"
    assert (out / "trace_llama3-8b_tiered-adaptive_r0.rank0.jsonl").exists() and ours["trace_lines"] > 0
    kv = json.loads(ours["command"].split("--kv-transfer-config ")[1].split(" ")[0].strip("'"))
    assert kv["kv_connector_extra_config"]["trace_path"] == str(out / "trace_llama3-8b_tiered-adaptive_r0")
    phases = ours["repeats"][0]["phases"]
    # the fake writes a line per 50 ms with one in-step load; its phases last a few ms: the first one sees lines
    assert all(ph["trace"]["in_step"]["loads"] == ph["trace"]["loading_steps"] for ph in phases)
    assert phases[0]["trace"]["loading_steps"] > 0 and phases[0]["trace"]["start_load_ms"]["p50"] == 1.5
    assert "trace_path" not in none and all("trace" not in ph for ph in none["repeats"][0]["phases"])


# ============================================================================ several engines on one host
def test_a_run_on_one_gpu_of_several_asks_nvidia_smi_only_about_its_own(monkeypatch, tmp_path):
    """``on_each_gpu.sh`` gives each run one GPU: its wait for the last engine's memory and the device it
    records must read that GPU, not its neighbours' (busy with their own engines)."""
    from serving import server
    log = tmp_path / "argv"
    fake = tmp_path / "nvidia-smi"
    # a stand-in for nvidia-smi (none on this CPU machine): records its arguments, reports two GPUs
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\ncase \"$*\" in *--list-gpus*) printf 'GPU 0\\nGPU 1\\n';; "
                    "*memory.used*) echo 100;; *) echo 'NVIDIA H200, 580';; esac\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert server.gpu_memory_used_mib() == [100]
    assert server.device_name() == "NVIDIA H200, 580"
    assert server.gpu_share() == {"visible": "1", "host_gpus": 2}
    calls = log.read_text().splitlines()
    assert all("--id=1" in c for c in calls if "--list-gpus" not in c), calls
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    server.gpu_memory_used_mib()
    assert "--id" not in log.read_text().splitlines()[-1]
    assert server.gpu_share() == {"visible": None, "host_gpus": 2}


def test_on_each_gpu_refuses_more_commands_than_gpus(tmp_path):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200'\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "STAGGER_S": "0"}
    script = str(ROOT / "scripts" / "gpu" / "on_each_gpu.sh")
    r = subprocess.run(["bash", script, "true", "true"], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "2 commands but 1 GPU" in r.stderr
    r = subprocess.run(["bash", script, 'echo "gpu=$CUDA_VISIBLE_DEVICES out=$OUT"; exit 3'], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 3
    assert f"gpu=0 out={tmp_path / 'out' / 'g0'}" in r.stdout
    import tarfile
    with tarfile.open(tmp_path / "out" / "gpus.tgz") as tar:  # packed: the device tool returns 8 files a call
        assert "g0/log.txt" in tar.getnames()
    assert not (tmp_path / "out" / "g0").exists()


def test_compiled_serving_leaves_max_num_seqs_and_graph_sizes_to_vllm(tmp_path):
    """Compiled, a start gets vLLM's own --max-num-seqs (the graph sizes follow from it); the log's config line
    says the largest graph, the last start's line counting."""
    wp = serve_bench.workload_params(serve_bench.parse_args(["--shape", "gemma2", "--graphs", "compile"]))
    assert serve_bench.default_max_num_seqs(wp, "compile") == 0
    assert serve_bench.default_max_num_seqs(wp, "decode") == max(64, max(wp.concurrency + (wp.warm_c,)))
    argv, _ = _argv("tiered", graphs="compile", max_num_seqs=0)
    assert "--max-num-seqs" not in argv and "--max-num-batched-tokens" in argv
    assert _argv("none", max_num_seqs=96)[0][_argv("none", max_num_seqs=96)[0].index("--max-num-seqs") + 1] == "96"
    log = tmp_path / "server.log"
    log.write_text("INFO engine: compilation_config={'mode': 3, 'max_cudagraph_capture_size': 128, 'x': 1}\n"
                   "INFO later start: compilation_config={\"max_cudagraph_capture_size\": 512}\n")
    assert serve_bench.graph_capture_max(str(log)) == 512
    log.write_text("INFO eager: no config line of that kind\n")
    assert serve_bench.graph_capture_max(str(log)) is None
    assert serve_bench.graph_capture_max(str(tmp_path / "missing.log")) is None
