"""Prometheus metrics for a store, read from ``stats()`` at scrape time.

A ``StoreCollector`` turns one ``stats()`` dict into metric families, so counters are never
updated twice and cost nothing between scrapes. Every front end exports the same families under
its ``store`` label (``default`` for the Python API, ``vllm`` for the vLLM connector, ``sglang`` for
the SGLang backend); ``METRICS`` lists them, and ``deploy/grafana/tiered_kv.json`` queries them:

- store: lookups, hits, misses, bytes in/out, resident bytes, jobs in flight;
- per tier: hits, blocks/bytes in and out, evictions, failed transfers, corrupt records dropped,
  refused puts, residency, capacity, queue depth;
- per tier edge (``src``/``dst`` tier names, ``engine`` for the caller's side): blocks and bytes moved;
- per source tier: a histogram of load-job seconds (loads toward the engine and promotions);
- the load gate, where the front end has one (vLLM, SGLang): decisions by outcome, slow-tier blocks
  declined (recomputed instead), the read-rate estimate and the break-even rate;
- the split, where the gate is a ``SplitGate`` (SGLang, vLLM): held tokens loaded and
  recomputed per tier, the read-rate estimate per tier, the prefill rate in use at a few contexts,
  the prefill samples fitted, and the summed estimated seconds of the plans taken against
  recompute-all and load-all;
- the remote tier, where this process holds its client (Python API, SGLang): errors by kind;
- the vLLM workers' own counters (vLLM's scheduler process, which sums every rank's): bytes, seconds (vLLM's
  thread inside each of our hooks, fence waits, copies) and events.

Optional sections of ``stats()`` (``transfers``, ``gate``, ``gate["split"]``, ``remote``, ``workers``) yield their
families only when present.

Threading contract: ``collect()`` runs on the scraping thread (prometheus-client's HTTP
server) and only calls ``stats()``, which takes the store's lock briefly (or returns a snapshot).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

_TIER_COUNTERS = ("hits", "blocks_in", "blocks_out", "bytes_in", "bytes_out", "evictions", "failed_transfers",
                  "corrupt_dropped", "refused")
_TIER_GAUGES = ("resident_blocks", "capacity_blocks", "queue_depth")
_STORE_COUNTERS = ("lookups", "hits", "misses", "bytes_in", "bytes_out", "puts_refused")
#: Remote-tier counters that are errors (``RemoteTier.counters`` and its client's ``client_*``); the others
#: (missing: evicted by Redis, foreign, redirects, refreshes) are normal life in a cluster.
REMOTE_ERRORS = ("unavailable", "write_failed", "corrupt", "client_node_failures")

#: Every family name a scrape can show (counters with their ``_total`` suffix, histograms by base name).
METRICS = (
    *(f"tiered_kv_{k}_total" for k in _STORE_COUNTERS), "tiered_kv_resident_bytes", "tiered_kv_inflight_jobs",
    *(f"tiered_kv_tier_{k}_total" for k in _TIER_COUNTERS), *(f"tiered_kv_tier_{k}" for k in _TIER_GAUGES),
    "tiered_kv_edge_blocks_total", "tiered_kv_edge_bytes_total", "tiered_kv_load_seconds",
    "tiered_kv_gate_decisions_total", "tiered_kv_gate_declined_blocks_total", "tiered_kv_gate_read_gbps",
    "tiered_kv_gate_break_even_gbps", "tiered_kv_remote_errors_total",
    "tiered_kv_split_tokens_total", "tiered_kv_split_read_gbps", "tiered_kv_split_prefill_tokens_per_s",
    "tiered_kv_split_prefill_samples_total", "tiered_kv_split_estimated_seconds_total",
    "tiered_kv_split_overlap_seconds_per_gb", "tiered_kv_split_load_floor_seconds", "tiered_kv_split_recompute_scale",
    "tiered_kv_worker_bytes_total", "tiered_kv_worker_seconds_total", "tiered_kv_worker_events_total",
)


class StoreCollector:
    """prometheus-client custom collector over a ``stats()`` callable."""

    def __init__(self, stats: Callable[[], dict], store_name: str = "default") -> None:
        self._stats = stats
        self._name = store_name

    def collect(self) -> Iterator:
        """Yield metric families for the current stats (none while ``stats()`` is empty: nothing open yet)."""
        s = self._stats()
        if not s:
            return
        yield from _store_families(s, self._name)
        yield from _tier_families(s["tiers"], self._name)
        if "transfers" in s:
            yield from _transfer_families(s["transfers"], self._name)
        if s.get("gate") is not None:
            yield from _gate_families(s["gate"], self._name)
            if "split" in s["gate"]:
                yield from _split_families(s["gate"]["split"], self._name)
        if s.get("remote") is not None:
            yield from _remote_families(s["remote"], self._name)
        if s.get("workers"):
            yield from _worker_families(s["workers"], self._name)


def _store_families(s: dict, name: str) -> Iterator:
    for key in _STORE_COUNTERS:
        m = CounterMetricFamily(f"tiered_kv_{key}", f"tiered_kv store {key}", labels=["store"])
        m.add_metric([name], s[key])
        yield m
    g = GaugeMetricFamily("tiered_kv_resident_bytes", "bytes of blocks held", labels=["store"])
    g.add_metric([name], s["resident_bytes"])
    yield g
    g = GaugeMetricFamily("tiered_kv_inflight_jobs", "transfer jobs issued and not completed", labels=["store"])
    g.add_metric([name], s["inflight_jobs"])
    yield g


def _tier_families(tiers: dict, name: str) -> Iterator:
    for key in _TIER_COUNTERS:
        m = CounterMetricFamily(f"tiered_kv_tier_{key}", f"per-tier {key}", labels=["store", "tier"])
        for tier, t in tiers.items():
            m.add_metric([name, tier], t[key])
        yield m
    for key in _TIER_GAUGES:
        g = GaugeMetricFamily(f"tiered_kv_tier_{key}", f"per-tier {key}", labels=["store", "tier"])
        for tier, t in tiers.items():
            g.add_metric([name, tier], t[key])
        yield g


def _transfer_families(transfers: dict, name: str) -> Iterator:
    labels = ["store", "src", "dst"]
    blocks = CounterMetricFamily("tiered_kv_edge_blocks", "blocks moved from tier src to tier dst (engine: the "
                                 "caller's side)", labels=labels)
    nbytes = CounterMetricFamily("tiered_kv_edge_bytes", "bytes moved from tier src to tier dst (engine: the "
                                 "caller's side)", labels=labels)
    for e in transfers["edges"]:
        blocks.add_metric([name, e["src"], e["dst"]], e["blocks"])
        nbytes.add_metric([name, e["src"], e["dst"]], e["bytes"])
    yield blocks
    yield nbytes
    h = HistogramMetricFamily("tiered_kv_load_seconds", "seconds a load job reading from this tier took on its "
                              "mover (loads toward the engine, promotions)", labels=["store", "tier"])
    for tier, snap in transfers["load_seconds"].items():
        h.add_metric([name, tier], [(_le(le), n) for le, n in snap["buckets"]], snap["sum"])
    yield h


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


def _by_label(family: type, metric: str, doc: str, name: str, label: str, values: dict):
    """One family with a sample per ``values`` item, labelled ``store=name`` and ``label=key``."""
    m = family(metric, doc, labels=["store", label])
    for key, value in values.items():
        m.add_metric([name, str(key)], value)
    return m


def _gate_families(gate: dict, name: str) -> Iterator:
    yield _by_label(CounterMetricFamily, "tiered_kv_gate_decisions", "load-gate decisions on hits: all_fast (memory "
                    "tiers only), always/beats (slow-tier blocks loaded), split (some loaded, the rest recomputed), "
                    "probe (declined but read to re-measure), declined (slow-tier blocks recomputed), recompute "
                    "(a whole hit recomputed: its loading steps were measured slower)", name, "decision",
                    gate["decisions"])
    m = CounterMetricFamily("tiered_kv_gate_declined_blocks", "held slow-tier blocks the gate did not load "
                            "(recomputed instead)", labels=["store"])
    m.add_metric([name], gate["declined_units"])
    yield m
    for key, doc in (("read_gbps", "the gate's slow-tier read-rate estimate (GB/s)"),
                     ("break_even_gbps", "slow-tier read rate above which loading beats recomputing (GB/s)")):
        g = GaugeMetricFamily(f"tiered_kv_gate_{key}", doc, labels=["store"])
        g.add_metric([name], gate[key])
        yield g


def _split_families(split: dict, name: str) -> Iterator:
    m = CounterMetricFamily("tiered_kv_split_tokens", "held tokens per tier the split loaded (action=loaded) or "
                            "left to the engine to recompute (action=recomputed)", labels=["store", "tier", "action"])
    for tier, t in split["tokens"].items():
        for action in ("loaded", "recomputed"):
            m.add_metric([name, tier, action], t[action])
    yield m
    yield _by_label(GaugeMetricFamily, "tiered_kv_split_read_gbps", "the split's read-rate estimate per tier (GB/s)",
                    name, "tier", split["read_gbps"])
    prefill = split["prefill"]
    g = GaugeMetricFamily("tiered_kv_split_prefill_tokens_per_s", "the prefill model in use: tokens/s of a 2048-token "
                          "chunk after `context` cached tokens", labels=["store", "context", "source"])
    for context, rate in prefill["tokens_per_s"].items():
        g.add_metric([name, str(context), prefill["source"]], rate)
    yield g
    m = CounterMetricFamily("tiered_kv_split_prefill_samples", "engine steps the prefill model was fitted to (0: the "
                            "configured model)", labels=["store"])
    m.add_metric([name], prefill["samples"])
    yield m
    yield _by_label(CounterMetricFamily, "tiered_kv_split_estimated_seconds", "summed estimated seconds of the plans "
                    "taken (plan=chosen), of recomputing every slow-tier token (recompute) and of loading every held "
                    "token (load_all)", name, "plan", split["estimated_seconds"])
    if "overlap_cost" in split:  # the vLLM connector's, measured from its steps' forward times
        yield _by_label(GaugeMetricFamily, "tiered_kv_split_overlap_seconds_per_gb", "what reading a GB of a slow tier "
                        "under the forward was measured to add to a step beyond the split's price", name, "tier",
                        {t: c["s_per_gb"] for t, c in split["overlap_cost"].items()})
        g = GaugeMetricFamily("tiered_kv_split_load_floor_seconds", "the time a step with in-step CPU loads was "
                              "measured not to go below (0: none; above a hit's recompute, the hit is recomputed)",
                              labels=["store"])
        g.add_metric([name], split["load_floor"]["seconds"])
        yield g
        g = GaugeMetricFamily("tiered_kv_split_recompute_scale", "the engine's recent prefill steps' measured over "
                              "priced time, at which the load floor's decision prices recompute (1: as the model)",
                              labels=["store"])
        g.add_metric([name], split["load_floor"]["recompute_scale"])
        yield g


def _remote_families(remote: dict, name: str) -> Iterator:
    m = CounterMetricFamily("tiered_kv_remote_errors", "remote-tier errors: unavailable (a read whose node was down "
                            "or skipped), write_failed, corrupt (damaged records dropped), client_node_failures",
                            labels=["store", "kind"])
    for kind in REMOTE_ERRORS:
        m.add_metric([name, kind], remote.get(kind, 0))
    yield m


def _worker_families(workers: dict, name: str) -> Iterator:
    """The vLLM workers' own counters, summed over ranks by vLLM (``stats()["workers"]``): bytes by what moved them,
    seconds by what took them (``hook_<hook>``: vLLM's thread inside that hook; ``fence_wait``, ``layer_submit``,
    ``load``, ``store``...), the rest as event counts."""
    fams = {
        "bytes": CounterMetricFamily("tiered_kv_worker_bytes", "bytes the vLLM workers moved, by what (loaded, stored, "
                                     "to_disk, from_disk, to_remote, from_remote), summed over ranks",
                                     labels=["store", "what"]),
        "seconds": CounterMetricFamily("tiered_kv_worker_seconds", "seconds in the vLLM workers, by what: hook_<hook> "
                                       "is vLLM's thread inside that hook, fence_wait its waits for copies of re-used "
                                       "blocks, layer_submit its in-step submissions between layers, load/store the "
                                       "copies' own time; summed over ranks", labels=["store", "what"]),
        "events": CounterMetricFamily("tiered_kv_worker_events", "counts in the vLLM workers, by what (sync_loads, "
                                      "stores_cancelled, fences_waited, sync_staged_copies, ...), summed over ranks",
                                      labels=["store", "what"]),
    }
    for key, value in sorted(workers.items()):
        if key.startswith("bytes_"):
            fams["bytes"].add_metric([name, key[len("bytes_"):]], value)
        elif key.endswith("_seconds"):
            fams["seconds"].add_metric([name, key[:-len("_seconds")]], value)
        else:
            fams["events"].add_metric([name, key], value)
    yield from fams.values()


def make_registry(stats: Callable[[], dict], store_name: str = "default") -> CollectorRegistry:
    """A fresh registry holding one ``StoreCollector``."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(StoreCollector(stats, store_name))
    return reg


def serve(registry: CollectorRegistry, port: int, addr: str = "127.0.0.1"):
    """Start prometheus-client's HTTP server for ``registry`` on ``addr:port``; returns (server, thread)."""
    return start_http_server(port, addr=addr, registry=registry)
