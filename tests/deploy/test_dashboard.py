"""The Grafana dashboard (``deploy/grafana/tiered_kv.json``): valid PromQL, and every metric it queries is exported.

The metrics are scraped from live front ends, each serving its ``metrics_port``: a ``TieredStore`` with all
four tiers (GPU stand-in, CPU, disk, and the remote tier on the session's real Redis Cluster) after a
workload that evicts down the chain and loads back, and vLLM's real Scheduler with our connector (the test
harness plays the worker) after a turn-2 hit, which also exports the load gate's families. The SGLang
backend's endpoint has its own test (``tests/connector/sglang/test_metrics.py``, in .venv-sglang).
"""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

from tests._metrics import (COMMON_PREFIXES, DASHBOARD, dashboard_exprs, dashboard_metrics, free_port, sample_names,
                            scrape_text)
from tests._redis import PASSWORD_ENV
from tiered_kv import TieredStore
from tiered_kv.store.metrics import METRICS

SHAPE = (2, 4, 64)


def test_dashboard_is_grafana_json_with_a_datasource_variable():
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] == "tiered-kv"
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "store", "instance"}
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        assert {"x", "y", "w", "h"} <= p["gridPos"].keys()
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for what in ("hit rate per tier", "bytes/s per tier edge", "load latency", "evictions", "load gate",
                 "remote tier errors", "our hooks"):
        assert what in titles, what


def test_every_dashboard_expression_is_valid_promql(tmp_path):
    """``promtool check rules`` parses each expression (Grafana's variables replaced as Grafana would)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool missing: scripts/setup_venvs.sh installs it (apt prometheus); run_tests.sh requires it")
    rules = [{"record": f"tiered_kv:dashboard_expr_{i}", "expr": _grafana_vars(e)} for i, e in enumerate(dashboard_exprs())
             if not e.startswith("label_values(")]
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))  # JSON is YAML
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def _grafana_vars(expr: str) -> str:
    return expr.replace("$__rate_interval", "1m").replace("$store", ".*").replace("$instance", ".*")


def _store_scrape(redis_cluster, tmp_path) -> str:
    port = free_port()
    cfg = dict(block_shape=list(SHAPE), dtype="float32", gpu_bytes=8 * 2048, cpu_bytes=16 * 2048,
               disk_path=str(tmp_path / "kv"), disk_bytes=32 * 4096, model="dash", metrics_port=port,
               remote_url=redis_cluster.url, remote_password_env=PASSWORD_ENV)
    with TieredStore(cfg) as store:
        keys = [bytes([i]) * 32 for i in range(48)]  # 48 blocks through 8 GPU, 16 CPU, 32 disk slots: to remote
        assert all(store.put(keys, torch.randn((48, *SHAPE))).wait(30)) and store.drain(30)
        out = torch.empty((48, *SHAPE))
        assert store.get(keys, out).wait(30) == 48 and store.drain(30)
        return scrape_text(port)


def _vllm_scrape(tmp_path) -> str:
    pytest.importorskip("vllm")
    from tests.connector.vllm.harness import BS, Engine, write_model_dir

    port = free_port()
    extra = {"chunk_blocks": 4, "cpu_bytes": 2 * 4 * 4096, "disk_path": str(tmp_path / "vkv"), "disk_bytes": "4MiB",
             "metrics_port": port}
    eng = Engine.create(write_model_dir(str(tmp_path / "tiny-llama")), extra)
    try:
        for turn, seed in (("a", 1), ("b", 2), ("a2", 1)):  # b pushes a's chunks to disk; a2 hits them there
            eng.add(turn, [100 + (seed * 7919 + i * 31) % 800 for i in range(8 * BS + 4)], max_tokens=1)
            eng.run()
            eng.settle()
            eng.sched.reset_prefix_cache()
        eng.connector._prom_at = 0.0  # the snapshot refreshes at most once a second
        eng.step()
        return scrape_text(port)
    finally:
        eng.close()


def test_every_dashboard_metric_is_exported_by_live_front_ends(redis_cluster, tmp_path):
    wanted = dashboard_metrics()
    scraped = {"store": sample_names(_store_scrape(redis_cluster, tmp_path)),
               "vllm": sample_names(_vllm_scrape(tmp_path))}
    missing = wanted - set().union(*scraped.values())
    assert not missing, f"the dashboard queries metrics no front end exported: {sorted(missing)}"
    for front, names in scraped.items():  # the store families come from every front end
        common = {m for m in wanted if m.startswith(COMMON_PREFIXES)}
        assert common <= names, (front, sorted(common - names))
    assert "tiered_kv_gate_decisions_total" in scraped["vllm"] and "tiered_kv_remote_errors_total" in scraped["store"]
    families = set(METRICS)  # tiered_kv.store.metrics.METRICS lists what a scrape can show
    for names in scraped.values():
        assert {n.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum") for n in names} <= families
