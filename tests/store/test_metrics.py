"""Prometheus metrics: the collector reflects stats(), and the optional HTTP endpoint serves them on loopback."""
from __future__ import annotations

import socket
import urllib.request

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
