"""The load gate: how many leading held pages ``batch_exists`` tells SGLang about; SGLang recomputes the rest.

What SGLang does with the answer (0.5.23; ``HybridCacheController._storage_hit_query`` and
``UnifiedRadixCache``): ``batch_exists`` returns how many *leading* pages of the queried span L3
holds. SGLang MIN-reduces that count over its ranks, drops it if it is below ``prefetch_threshold``
(256 tokens by default; SGLang pops that key, so the backend does not see it), allocates host slots
for that many pages, and its prefetch IO thread reads them (``batch_get_v1``). Pages it was not told
about are computed by the prefill like any miss. A shorter answer is honoured exactly: the first
``n`` pages load, the rest are recomputed. A 0 is a miss SGLang may ask about again while the
request waits in the queue (its miss re-query pacing).

When the read runs: the prefetch completes (or SGLang's prefetch policy stops it) *before* the
request's forward; only the host->GPU copy of the landed pages overlaps the forward, layer by
layer. So an L3 read never overlaps the compute of the same request, and the split runs in its
no-overlap mode (``planner.split``): per tier all or nothing, the memory tiers always loaded, then
the disk pages while loading them beats recomputing them, then the remote ones likewise. That is
the old "load only while reading beats recomputing" rule, now per tier with each tier's own rate
and with a recompute cost that grows with the context (a page deep in a long prompt costs more to
recompute than one near its start).

The estimates: each slow tier's read rate starts at ``disk_read_gbps`` (``remote_read_gbps`` for the
remote tier) and follows the reads the backend times (an exponential average; a read that moved
pages of two slow tiers is shared between them by their estimated times). Left at its default
(``DEFAULT_READ_GBPS``) the start is a guess (``ReadRate``): the tier's write jobs of 4 MiB or more bound
it until a read is measured (``hint_write``, which the backend registers with its store's ``on_write``), and the
first read of 4 MiB or more replaces it (smaller ones, a few small pages, are averaged in). The prefill model is the
configured one, ``prefill_tokens_per_s`` at short context and ``prefill_half_rate_context``: SGLang
gives a storage backend no step or forward timing (its calls are ``batch_exists``, ``batch_get*``,
``batch_set*``, ``get_stats``, ``clear``), so it is not learned here. The context of a query is the
number of pages before it, from ``prefix_keys`` when SGLang passes them
(``hicache_storage_pass_prefix_keys: true``); without them it is taken as 0, which prices a
recompute at its lowest (the gate then leans to recomputing). A declined tier is never read, so its
estimate would never change: every ``disk_probe_every``-th query that leaves held slow-tier pages
out is answered in full, and its read refreshes the estimates. ``disk_load_policy``: ``auto`` (the
above), ``always`` (report every page held), ``never`` (only the leading memory-tier pages).

Threading contract: ``worth_loading`` runs on SGLang's prefetch thread and ``observe_read`` on its
prefetch IO thread, at once; the gate, its rates and its counters take their locks.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence

from tiered_kv.errors import ConfigError
from tiered_kv.planner import gate as core
from tiered_kv.planner.gate import DISK_LOAD_POLICIES, SplitGate
from tiered_kv.planner.rates import DEFAULT_READ_GBPS, HINT_MIN_BYTES, PrefillEstimator, PrefillModel, ReadRate
from tiered_kv.planner.split import MEMORY_TIERS

__all__ = ["DEFAULT_READ_GBPS", "MEMORY_TIERS", "PageGate", "check_gate_options"]


def check_gate_options(policy: object, read_gbps: object, probe_every: object, prefill_tps: object,
                       half_rate_context: object = 1, remote_gbps: object = None) -> None:
    """Validate the gate keys of the extra config (ConfigError names the bad one)."""
    if policy not in DISK_LOAD_POLICIES:
        raise ConfigError(f"disk_load_policy: expected one of {list(DISK_LOAD_POLICIES)}, got {policy!r}")
    checks = [("disk_read_gbps", read_gbps), ("prefill_tokens_per_s", prefill_tps),
              ("prefill_half_rate_context", half_rate_context)]
    if remote_gbps is not None:
        checks.append(("remote_read_gbps", remote_gbps))
    for key, v in checks:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ConfigError(f"{key}: expected a number > 0, got {v!r}")
    if isinstance(probe_every, bool) or not isinstance(probe_every, int) or probe_every < 0:
        raise ConfigError(f"disk_probe_every: expected an int >= 0 (0 = never probe), got {probe_every!r}")


class PageGate:
    """Decides how many leading held pages of a query SGLang should load (the rest it recomputes)."""

    def __init__(self, policy: str, probe_every: int, read_gbps: Mapping[str, float], prefill: PrefillModel,
                 page_tokens: int, page_nbytes: int) -> None:
        """``read_gbps``: the start rate of every slow tier the store has (``disk``, ``remote``); the default
        ``DEFAULT_READ_GBPS`` is a guess (``ReadRate``): the tier's writes of 4 MiB or more bound it (``hint_write``)
        and its first read of 4 MiB or more replaces it; a rate the user set is averaged from, as before."""
        if page_tokens <= 0 or page_nbytes <= 0:
            raise ConfigError(f"load gate: page of {page_tokens} tokens / {page_nbytes} B; both must be > 0")
        rates = {tier: ReadRate(gbps, guess=gbps == DEFAULT_READ_GBPS, replace_min_bytes=HINT_MIN_BYTES)
                 for tier, gbps in read_gbps.items()}
        self.split = SplitGate(policy, probe_every, rates, PrefillEstimator(prefill, fixed=True), overlap=False,
                               unit_tokens=page_tokens, unit_nbytes=page_nbytes)
        self.policy = policy
        self.page_tokens, self.page_nbytes = page_tokens, page_nbytes
        self._lock = threading.Lock()
        self._counts = {"gate_declined_pages": 0, "gate_declined_queries": 0, "gate_split_queries": 0,
                        "gate_probes": 0, "gate_disk_pages_reported": 0, "gate_reads_observed": 0}

    @classmethod
    def for_tiers(cls, options, tiers: Iterable[str], page_tokens: int, page_nbytes: int) -> "PageGate":
        """The gate of a store with ``tiers`` (names), from the backend's options (``SGLangBackendConfig``)."""
        remote = options.remote_read_gbps if options.remote_read_gbps is not None else options.disk_read_gbps
        rates = {t: (remote if t == "remote" else options.disk_read_gbps) for t in tiers if t not in MEMORY_TIERS}
        prefill = PrefillModel.from_rate(options.prefill_tokens_per_s, options.prefill_half_rate_context)
        return cls(options.disk_load_policy, options.disk_probe_every, rates, prefill, page_tokens, page_nbytes)

    # ------------------------------------------------------------------ decisions
    def worth_loading(self, where: Sequence[str | None], context_pages: int = 0) -> int:
        """Leading pages of a held run worth reporting; ``where[i]`` is the fastest tier holding page i, and
        ``context_pages`` pages precede the run (0 when SGLang does not pass ``prefix_keys``)."""
        where = list(where[:next((i for i, t in enumerate(where) if t is None), len(where))])  # evicted since
        if not where:
            return 0
        runs = [(tier, self.page_tokens) for tier in where]
        plan, outcome = self.split.decide(runs, 0, context_pages * self.page_tokens)
        pages = plan.load_tokens // self.page_tokens
        fast = next((i for i, t in enumerate(where) if t not in MEMORY_TIERS), len(where))
        counts = {"gate_disk_pages_reported": pages - fast}
        if outcome in (core.DECLINED, core.SPLIT):
            counts.update(gate_declined_pages=len(where) - pages, gate_declined_queries=int(outcome == core.DECLINED),
                          gate_split_queries=int(outcome == core.SPLIT))
        elif outcome == core.PROBE:  # read it anyway now and then, so the estimates follow the tiers
            counts["gate_probes"] = 1
        self._count(**counts)
        return pages

    def observe_read(self, pages_by_tier: Mapping[str, int], seconds: float) -> None:
        """A read that moved ``pages_by_tier`` (pages per tier they were read from) took ``seconds`` (its whole
        wall time: conservative)."""
        nbytes = {t: n * self.page_nbytes for t, n in pages_by_tier.items() if n > 0 and t not in MEMORY_TIERS}
        if not nbytes or seconds <= 0:
            return
        self.split.observe_reads(nbytes, seconds)
        self._count(gate_reads_observed=1)

    def guessing(self) -> list[str]:
        """The slow tiers whose read rate is still the built-in guess (no read large enough to replace it yet): those
        ``hint_write`` can lower."""
        return [t for t, r in self.split.rates.items() if r.guess and not r.replaced]

    def hint_write(self, tier: str, nbytes: int, seconds: float) -> None:
        """A finished write of ``nbytes`` into ``tier`` took ``seconds``: it bounds that tier's guessed read rate
        (``ReadRate.hint``: writes under 4 MiB, a rate someone set and one already measured are left alone; memory
        tiers and tiers the gate does not rate are ignored). Any thread (the store's movers call it)."""
        self.split.hint_writes({tier: nbytes}, seconds)

    def disk_beats_recompute(self) -> bool:
        """Whether, at the current disk-rate estimate, a disk page at the start of a prompt loads faster than it is
        recomputed."""
        return self._gbps("disk") > self.split.break_even_gbps()

    # ------------------------------------------------------------------ reporting
    def _gbps(self, tier: str) -> float:
        rate = self.split.rates.get(tier)
        return 0.0 if rate is None else rate.gbps

    def _count(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                self._counts[k] += v

    def report(self) -> dict:
        """For Prometheus: ``SplitGate.report``."""
        return self.split.report()

    def snapshot(self) -> dict:
        """Policy, the read-rate estimates, the break-even rate, the prefill model and the decision counters."""
        with self._lock:
            out: dict = dict(self._counts)
        out["policy"] = self.policy
        # significant digits: small test pages too
        out["disk_gbps_estimate"] = float(f"{self._gbps('disk'):.4g}")
        out["read_gbps"] = {t: float(f"{r.gbps:.4g}") for t, r in self.split.rates.items()}
        out["read_gbps_source"] = {t: r.source for t, r in self.split.rates.items()}  # guess / writes / reads / set
        # the disk rate above which a page at a prompt's start loads faster than the prefill recomputes it
        out["break_even_gbps"] = float(f"{self.split.break_even_gbps():.4g}")
        split = self.split.report()["split"]
        out["prefill_tokens_per_s"] = {c: round(v) for c, v in split["prefill"]["tokens_per_s"].items()}
        out["tokens"] = split["tokens"]
        return out

