"""The SGLang backend's Prometheus endpoint (``metrics_port``): the store families, the load gate's and the split's,
under the ``sglang`` store label; every metric of the Grafana dashboard that is not vLLM- or remote-only is there."""
from __future__ import annotations

import pytest

from tests._metrics import COMMON_PREFIXES, dashboard_metrics, free_port, sample_names, scrape_text
from tests.connector.sglang.harness import PAGE_SIZE, attached_backend, create_backend, extra_config, fill_random, mha_pool

from tiered_kv.errors import ConfigError
from tiered_kv.store.metrics import METRICS


def test_backend_serves_store_and_gate_metrics(tmp_path):
    port = free_port()
    pool = mha_pool("page_first")
    # disk only and a disk assumed slow: every hit goes through the gate, which declines it (recompute)
    backend = attached_backend(extra_config(tmp_path, metrics_port=port, disk_read_gbps=0.001, disk_probe_every=2),
                               pool)
    try:
        fill_random(pool, 3)
        keys = [f"m{i}" for i in range(4)]
        assert all(backend.batch_set_v1(keys, pool.alloc(4 * PAGE_SIZE)))
        backend.store.drain(30)
        assert [backend.batch_exists(keys) for _ in range(2)] == [0, 4]  # declined, then a probe reads them
        assert backend.batch_get_v1(keys, pool.alloc(4 * PAGE_SIZE)) == [True] * 4
        backend.store.drain(30)
        text = scrape_text(port)
    finally:
        backend.close()
    names = sample_names(text)
    assert 'tiered_kv_gate_decisions_total{decision="declined",store="sglang"} 1.0' in text
    assert 'tiered_kv_gate_decisions_total{decision="probe",store="sglang"} 1.0' in text
    assert 'tiered_kv_gate_declined_blocks_total{store="sglang"} 4.0' in text
    assert 'tiered_kv_edge_blocks_total{dst="disk",src="engine",store="sglang"} 4.0' in text
    # the split: 4 pages of 4 tokens recomputed, then loaded by the probe; the estimates in use
    assert 'tiered_kv_split_tokens_total{action="recomputed",store="sglang",tier="disk"} 16.0' in text
    assert 'tiered_kv_split_tokens_total{action="loaded",store="sglang",tier="disk"} 16.0' in text
    assert 'tiered_kv_split_prefill_tokens_per_s{context="0",source="fixed",store="sglang"}' in text
    assert 'tiered_kv_split_prefill_samples_total{store="sglang"} 0.0' in text  # SGLang gives no step timing
    assert 'tiered_kv_split_read_gbps{store="sglang",tier="disk"}' in text
    assert "tiered_kv_split_estimated_seconds_total" in names
    wanted = {m for m in dashboard_metrics() if m.startswith(COMMON_PREFIXES) or m.startswith("tiered_kv_gate_")}
    wanted |= {m for m in METRICS if m.startswith("tiered_kv_split_")}
    assert wanted <= names, sorted(wanted - names)


def test_bad_metrics_port_is_refused_naming_it(tmp_path):
    with pytest.raises(ConfigError, match="metrics_port"):
        create_backend(extra_config(tmp_path, metrics_port=70000))
