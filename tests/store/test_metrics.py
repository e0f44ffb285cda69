"""Prometheus metrics: the collector reflects stats(), and the optional HTTP endpoint serves them on loopback."""
from __future__ import annotations

import socket
import time
import urllib.request

import pytest
import torch
from prometheus_client import generate_latest

from tiered_kv import TieredStore
from tiered_kv.store.metrics import make_registry

from tests.store._blocks import blocks_of, key_of

SHAPE = (2, 4, 64)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_collector_reports_store_counters(small_cfg):
    with TieredStore(small_cfg()) as s:
        keys = [key_of(i) for i in range(20)]
        s.put(keys, blocks_of(keys, SHAPE)).wait(10)
        s.drain()
        out = torch.empty((20, *SHAPE))
        assert s.get(keys, out).wait(10) == 20
        assert s.drain(10)
        text = generate_latest(make_registry(s.stats, "t")).decode()
        gpu = s.stats()["tiers"]["gpu"]
    assert gpu["evictions"] >= 12  # 20 puts into 8 GPU slots, then promotions
    assert 'tiered_kv_lookups_total{store="t"} 20.0' in text
    assert 'tiered_kv_hits_total{store="t"} 20.0' in text
    assert f'tiered_kv_tier_evictions_total{{store="t",tier="gpu"}} {float(gpu["evictions"])}' in text
    assert 'tiered_kv_tier_queue_depth{store="t",tier="disk"} 0.0' in text
    assert 'tiered_kv_tier_resident_blocks{store="t",tier="disk"}' in text


def test_metrics_port_serves_on_loopback(small_cfg):
    port = _free_port()
    with TieredStore(small_cfg(metrics_port=port)):
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "tiered_kv_resident_bytes" in body and "tiered_kv_tier_capacity_blocks" in body


def test_collector_reports_the_split_of_a_split_gate(small_cfg):
    """A ``SplitGate``'s report under ``gate``: the gate families and the split's (tokens per tier and action, read
    rates per tier, the prefill model in use, estimated seconds, the measured overlap cost and load floor); every
    name is in ``METRICS``."""
    from prometheus_client.parser import text_string_to_metric_families

    from tiered_kv.planner.gate import SplitGate
    from tiered_kv.planner.rates import PrefillEstimator, PrefillModel, ReadRate
    from tiered_kv.store.metrics import METRICS

    gate = SplitGate("auto", 0, {"disk": ReadRate(2.15)}, PrefillEstimator(PrefillModel(0.0, 0.22 / 8192, 0.0)),
                     overlap=True, unit_tokens=256, unit_nbytes=256 << 17)
    plan, _ = gate.decide([("cpu", 512), ("disk", 8192)], 0, 0)
    gate.observe_loaded_step({"disk": 1e9}, 0.3, 0.1)  # measured: 0.2 s a GB under the forward
    gate.observe_loaded_step({"cpu": 1e8}, 0.035, 0.006)  # a loading step on a 35 ms floor
    gate.observe_unloaded_step(0.06, 0.05)  # a prefill step 1.2x its price: the engine's speed now
    with TieredStore(small_cfg()) as s:
        text = generate_latest(make_registry(lambda: {**s.stats(), "gate": gate.report()}, "t")).decode()
    loaded = plan.load_tokens - 512
    assert f'tiered_kv_split_tokens_total{{action="loaded",store="t",tier="disk"}} {float(loaded)}' in text
    assert f'tiered_kv_split_tokens_total{{action="recomputed",store="t",tier="disk"}} {float(8192 - loaded)}' in text
    assert 'tiered_kv_split_tokens_total{action="loaded",store="t",tier="cpu"} 512.0' in text
    assert 'tiered_kv_split_read_gbps{store="t",tier="disk"} 2.15' in text
    assert 'tiered_kv_split_prefill_tokens_per_s{context="32768",source="start",store="t"}' in text
    assert 'tiered_kv_gate_decisions_total{decision="split",store="t"} 1.0' in text
    assert 'tiered_kv_split_estimated_seconds_total{plan="chosen",store="t"}' in text
    gauges = {(s.name, s.labels.get("tier")): s.value for fam in text_string_to_metric_families(text)
              for s in fam.samples if s.name.startswith(("tiered_kv_split_overlap", "tiered_kv_split_load_floor",
                                                          "tiered_kv_split_recompute"))}
    assert gauges == {("tiered_kv_split_overlap_seconds_per_gb", "disk"): pytest.approx(0.2),
                      ("tiered_kv_split_load_floor_seconds", None): pytest.approx(0.035),
                      ("tiered_kv_split_recompute_scale", None): pytest.approx(1.2)}, gauges
    names = {s.name.removesuffix("_total") for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert {m.removesuffix("_total") for m in METRICS if m.startswith("tiered_kv_split_")} <= names


def test_on_write_reports_each_write_job_into_a_tier_and_not_the_loads(small_cfg):
    """``on_write``: every job that wrote into a tier (here the disk, written through) is reported with its tier,
    bytes and mover's seconds; reads from the disk report none; a listener that raises stops nothing."""
    def broken(*_):
        raise RuntimeError("a listener's bug")

    with TieredStore(small_cfg(write_policy="write_through")) as s:
        got: list[tuple[str, int, float]] = []
        s.on_write(broken)
        # a slow listener: drain() must still return only after every finished job was reported (CI caught it
        # returning in between when the listeners ran after the job counted as done)
        s.on_write(lambda tier, nbytes, seconds: (time.sleep(0.02), got.append((tier, nbytes, seconds))))
        disk = lambda: [(n, sec) for t, n, sec in got if t == "disk"]  # noqa: E731
        keys = [key_of(i) for i in range(6)]
        s.put(keys, blocks_of(keys, SHAPE)).wait(10)
        assert s.drain(10)
        writes = disk()
        seen = len(writes)
        assert seen >= 1
        assert sum(n for n, _ in writes) == 6 * s.stats()["block_nbytes"]  # every block written once
        assert all(sec > 0 for _, sec in writes)
        assert not [t for t, _, _ in got if t not in {spec.name for spec in s.tiers}]  # no such tier: nothing written
        more = [key_of(i) for i in range(6, 9)]
        s.put(more, blocks_of(more, SHAPE)).wait(10)
        assert s.drain(10)
        total, newer = len(disk()), disk()[seen:]
        assert total > seen and sum(n for n, _ in newer) == 3 * s.stats()["block_nbytes"]
        out = torch.empty((9, *SHAPE))
        assert s.get(keys + more, out).wait(10) == 9 and s.drain(10)  # reads write nothing to the disk
        assert len(disk()) == total
