"""``benchmarks/sglang_ttft.py`` on the CPU: engine arguments per mode, the session's plumbing, the table.

The engine itself runs on the GPU machine only; here a mode's process really starts, and where SGLang
cannot start (no SGLang or no GPU in this environment) the session records the error and goes on.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import sglang_ttft as bench  # noqa: E402

from tiered_kv.connector.sglang.config import SGLangBackendConfig  # noqa: E402


def _args(tmp_path, **kw) -> argparse.Namespace:
    base = dict(prefix=8192, n_conv=12, gpu_tokens=32768, hicache_ratio=1.5, mem_fraction=0.55, chunked_prefill=16384,
                settle_s=0.0, drop_caches=False, disk_gib=40, prefill_tps=0.0, disk_gbps=2.0, prefetch_policy="timeout",
                log_level="warning", skip=2, disk_dir=str(tmp_path / "disk"), deadline_s=560.0, first_mode_s=90.0,
                mode_timeout_s=120.0, keep_disk=False)
    base.update(kw)
    return argparse.Namespace(**base)


def test_modes_engine_arguments(tmp_path):
    a = _args(tmp_path)
    kw = {m: bench.engine_kwargs(m, "/m", f"/d/{m}", a) for m in bench.MODES}
    assert "enable_hierarchical_cache" not in kw["none"] and "enable_hierarchical_cache" not in kw["mla-none"]
    assert kw["l2"]["enable_hierarchical_cache"] and "hicache_storage_backend" not in kw["l2"]
    assert kw["file"]["hicache_storage_backend"] == "file"
    for m in bench.MODES:
        assert kw[m]["attention_backend"] == "triton" and kw[m]["sampling_backend"] == "pytorch"
        assert kw[m]["load_format"] == "dummy" and kw[m]["skip_tokenizer_init"]
    policies = {}
    for m in ("tiered", "tiered-always", "restart", "mla-tiered"):
        assert kw[m]["hicache_storage_backend"] == "dynamic"
        extra = json.loads(kw[m]["hicache_storage_backend_extra_config"])
        cfg = SGLangBackendConfig.from_extra_config(extra)  # our own validator accepts what the benchmark passes
        assert cfg.disk_path == f"/d/{m}" and cfg.disk_read_gbps == 2.0 and extra["interface_v1"] == 1
        policies[m] = cfg.disk_load_policy
    assert policies == {"tiered": "auto", "tiered-always": "always", "restart": "always", "mla-tiered": "always"}


def test_dry_run_pools_are_smaller_than_the_working_set(tmp_path):
    out = bench.dry_run(list(bench.MODES), _args(tmp_path))
    llama, mla = out["workload"]["llama3-8b"], out["workload"]["dsv2-lite"]
    assert llama["page_bytes"] == 8 << 20 and llama["kv_bytes_per_token"] == 128 << 10
    assert mla["kv_bytes_per_token"] == 27 * 576 * 2
    for w in (llama, mla):
        assert w["pool_smaller_than_working_set"] and w["gpu_pool_tokens"] < w["host_pool_tokens"]
        assert w["turn1_tokens"] + bench.FOLLOW + 2 + 64 <= bench.engine_kwargs("none", "/m", "/d", _args(
            Path("/tmp")))["context_length"]


def _res(secs, storage, tokens):
    t2 = [{"s": s, "tokens": [tok], "cached": 0, "device": 0, "host": 0, "storage": storage} for s, tok in
          zip(secs, tokens)]
    return {"start_s": 20.0, "wall_s": 60.0, "turn1": [{"s": 0.3, "tokens": [1, 2]}] * len(secs), "turn2": t2}


def test_summary_comparison_and_goal_verdicts():
    secs_none, secs_file, secs_ours = [0.5, 0.4, 0.30, 0.31, 0.32], [0.9, 0.6, 0.45, 0.46, 0.47], [0.3, 0.2, 0.1] * 2
    results = [bench.summarize("none", _res(secs_none, 0, range(5)), 2),
               bench.summarize("file", _res(secs_file, 8256, range(5)), 2),
               bench.summarize("tiered-always", _res(secs_ours[:5], 8256, range(5)), 2),
               bench.summarize("tiered", _res(secs_none, 0, [0, 1, 2, 3, 9]), 2),
               {"mode": "l2", "model": "llama3-8b", "skipped": "deadline: 3 s left"}]
    bench.compare(results)
    by = {r["mode"]: r for r in results}
    assert by["none"]["turn2_median_s"] == 0.31 and by["file"]["turn2_median_s"] == 0.46
    assert by["tiered-always"]["turn2_median_s"] == 0.2 and by["tiered-always"]["vs_file"] == 2.3
    assert by["tiered-always"]["l3_hit_tokens"] == 5 * 8256 and by["tiered-always"]["greedy_equal_none"]
    assert by["tiered"]["greedy_equal_none"] is False and by["tiered"]["vs_none"] == 1.0
    text = bench.table({"results": results})
    assert "goal tiered-always >= 1.5x file: met (2.3x)" in text
    assert "goal tiered >= 1.5x file: NOT met" in text
    assert "goal tiered never slower than none: met" in text
    assert "| l2 | llama3-8b | deadline: 3 s left |" in text


def test_session_records_an_engine_that_cannot_start_and_skips_past_the_deadline(tmp_path):
    """A mode's process really runs; without a startable SGLang here it reports why, and the session goes on."""
    a = _args(tmp_path, mode_timeout_s=60.0)
    session = bench.run_session(["none"], a)
    (r,) = session["results"]
    assert "error" in r and r["wall_s"] > 0
    late = bench.run_session(["none", "file"], _args(tmp_path, deadline_s=0.0))
    assert [x.get("skipped", "")[:8] for x in late["results"]] == ["deadline", "deadline"]


def test_disk_probe_measures_a_read_rate(tmp_path):
    got = bench.measure_disk_gbps(str(tmp_path), mib=16, block_mib=4)
    assert got["gbps"] > 0 and got["mib"] == 16
    assert not list(tmp_path.iterdir())  # the probe file is gone


@pytest.mark.parametrize("bad", ["nonsense", "none,bogus"])
def test_unknown_modes_are_refused(bad, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["sglang_ttft.py", "--modes", bad, "--dry-run"])
    with pytest.raises(SystemExit):
        bench.main()
    assert "unknown mode" in capsys.readouterr().err


def test_mla_gated_uses_the_mla_calibration_and_the_auto_policy(tmp_path):
    a = _args(tmp_path, prefill_tps=50000.0, prefill_tps_mla=90000.0)
    gated = bench.tiered_extra("mla-gated", "/d", a)
    assert gated["disk_load_policy"] == "auto" and gated["prefill_tokens_per_s"] == 90000.0
    assert bench.tiered_extra("mla-tiered", "/d", a)["disk_load_policy"] == "always"
    assert bench.tiered_extra("tiered", "/d", a)["prefill_tokens_per_s"] == 50000.0
    # no MLA calibration yet (mla-none did not run): the default rate, not the Llama one
    assert bench.tiered_extra("mla-gated", "/d", _args(tmp_path, prefill_tps=50000.0))["prefill_tokens_per_s"] == 30000.0
