"""Prometheus metrics for a store, read from ``stats()`` at scrape time.

A ``StoreCollector`` turns one store's ``stats()`` dict into metric families (per-tier
hits, bytes in/out, evictions, failed transfers, corrupt records dropped, residency,
queue depth), so counters are never updated twice and cost nothing between scrapes.

Threading contract: ``collect()`` runs on the scraping thread (prometheus-client's HTTP
server) and only calls ``stats()``, which takes the store's lock briefly.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_TIER_COUNTERS = ("hits", "blocks_in", "blocks_out", "bytes_in", "bytes_out", "evictions", "failed_transfers",
                  "corrupt_dropped", "refused")
_TIER_GAUGES = ("resident_blocks", "capacity_blocks", "queue_depth")
_STORE_COUNTERS = ("lookups", "hits", "misses", "bytes_in", "bytes_out", "puts_refused")


class StoreCollector:
    """prometheus-client custom collector over a ``stats()`` callable."""

    def __init__(self, stats: Callable[[], dict], store_name: str = "default") -> None:
        self._stats = stats
        self._name = store_name

    def collect(self) -> Iterator:
        """Yield metric families for the current stats."""
        s = self._stats()
        for key in _STORE_COUNTERS:
            m = CounterMetricFamily(f"tiered_kv_{key}", f"tiered_kv store {key}", labels=["store"])
            m.add_metric([self._name], s[key])
            yield m
        g = GaugeMetricFamily("tiered_kv_resident_bytes", "bytes of blocks held", labels=["store"])
        g.add_metric([self._name], s["resident_bytes"])
        yield g
        g = GaugeMetricFamily("tiered_kv_inflight_jobs", "transfer jobs issued and not completed", labels=["store"])
        g.add_metric([self._name], s["inflight_jobs"])
        yield g
        for key in _TIER_COUNTERS:
            m = CounterMetricFamily(f"tiered_kv_tier_{key}", f"per-tier {key}", labels=["store", "tier"])
            for tier, t in s["tiers"].items():
                m.add_metric([self._name, tier], t[key])
            yield m
        for key in _TIER_GAUGES:
            g = GaugeMetricFamily(f"tiered_kv_tier_{key}", f"per-tier {key}", labels=["store", "tier"])
            for tier, t in s["tiers"].items():
                g.add_metric([self._name, tier], t[key])
            yield g


def make_registry(stats: Callable[[], dict], store_name: str = "default") -> CollectorRegistry:
    """A fresh registry holding one ``StoreCollector``."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(StoreCollector(stats, store_name))
    return reg


def serve(registry: CollectorRegistry, port: int, addr: str = "127.0.0.1"):
    """Start prometheus-client's HTTP server for ``registry`` on ``addr:port``; returns (server, thread)."""
    return start_http_server(port, addr=addr, registry=registry)
