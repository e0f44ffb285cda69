"""The load gate: report a disk hit to SGLang only while reading it beats recomputing it.

SGLang asks ``batch_exists`` how many leading pages L3 holds and then loads that many; a page
it is not told about is recomputed by the prefill. A page in one of our memory tiers always
loads faster than a prefill computes it. A page only on disk (or a slower tier below it) loads
at the disk's speed, which can be slower than the GPU recomputes it (a virtio disk against an
H100 prefill of an 8B model: 1-2 GB/s against ~4 GB/s of KV per second of prefill). Telling
SGLang about such a page would make the request slower than with no HiCache at all. So:

- ``disk_load_policy: auto`` (default): a slow-tier page counts as a hit while
  ``page_bytes / disk_read_bytes_per_s < page_tokens / prefill_tokens_per_s``. The disk rate
  starts at ``disk_read_gbps`` and follows the reads the backend times (an exponential average
  of every ``batch_get`` that read slow-tier pages). A declined disk is never read, so its
  estimate would never change: every ``disk_probe_every``-th declined query is answered in full
  anyway, and its read refreshes the estimate (a faster disk, a warm page cache). ``0``: never probe.
- ``always``: report every page held (measure the disk, or a disk known to be fast).
- ``never``: report only the leading pages in memory tiers.

The rule itself is ``tiered_kv.planner.gate.LoadGate``, shared with the vLLM connector (which applies it
per chunk); this module applies it per SGLang page and keeps SGLang's counters.

Threading contract: ``worth_loading`` runs on SGLang's prefetch thread and ``observe_read`` on its
prefetch IO thread, at once; both take the gate's lock.
"""
from __future__ import annotations

from collections.abc import Sequence

from tiered_kv.errors import ConfigError
from tiered_kv.planner import gate as core
from tiered_kv.planner.gate import DISK_LOAD_POLICIES

#: Tiers whose pages always load faster than a prefill recomputes them.
MEMORY_TIERS = frozenset({"gpu", "cpu"})


def check_gate_options(policy: object, read_gbps: object, probe_every: object, prefill_tps: object) -> None:
    """Validate the four gate keys of the extra config (ConfigError names the bad one)."""
    if policy not in DISK_LOAD_POLICIES:
        raise ConfigError(f"disk_load_policy: expected one of {list(DISK_LOAD_POLICIES)}, got {policy!r}")
    for key, v in (("disk_read_gbps", read_gbps), ("prefill_tokens_per_s", prefill_tps)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ConfigError(f"{key}: expected a number > 0, got {v!r}")
    if isinstance(probe_every, bool) or not isinstance(probe_every, int) or probe_every < 0:
        raise ConfigError(f"disk_probe_every: expected an int >= 0 (0 = never probe), got {probe_every!r}")


class LoadGate(core.LoadGate):
    """Decides how many leading held pages of a query SGLang should load (the rest it recomputes)."""

    def __init__(self, policy: str, disk_read_gbps: float, probe_every: int, prefill_tokens_per_s: float,
                 page_tokens: int, page_nbytes: int) -> None:
        check_gate_options(policy, disk_read_gbps, probe_every, prefill_tokens_per_s)
        if page_tokens <= 0 or page_nbytes <= 0:
            raise ConfigError(f"load gate: page of {page_tokens} tokens / {page_nbytes} B; both must be > 0")
        super().__init__(policy, disk_read_gbps, probe_every, prefill_tokens_per_s, page_tokens, page_nbytes)
        self.page_tokens = self.unit_tokens
        self.page_nbytes = self.unit_nbytes
        self._counts = {"gate_declined_pages": 0, "gate_declined_queries": 0, "gate_probes": 0,
                        "gate_disk_pages_reported": 0, "gate_reads_observed": 0}

    # ------------------------------------------------------------------ decisions
    def disk_beats_recompute(self) -> bool:
        """Whether, at the current disk-rate estimate, a slow-tier page loads faster than it is recomputed."""
        return self.beats_recompute()

    def worth_loading(self, where: Sequence[str | None]) -> int:
        """Leading pages of a held run worth reporting; ``where[i]`` is the fastest tier holding page i."""
        n = len(where)
        n_fast = next((i for i, t in enumerate(where) if t not in MEMORY_TIERS), n)
        hits, outcome = self.decide(n_fast, n)
        if outcome == core.DECLINED:
            self._count(gate_declined_pages=n - n_fast, gate_declined_queries=1)
        elif outcome == core.PROBE:  # read it anyway now and then, so the estimate follows the disk
            self._count(gate_probes=1, gate_disk_pages_reported=n - n_fast)
        else:
            self._count(gate_disk_pages_reported=n - n_fast)
        return hits

    def observe_read(self, slow_pages: int, seconds: float) -> None:
        """A read that moved ``slow_pages`` slow-tier pages took ``seconds`` (its whole wall time, conservative)."""
        if slow_pages <= 0 or seconds <= 0:
            return
        self.observe(slow_pages * self.page_nbytes, seconds)
        self._count(gate_reads_observed=1)

    # ------------------------------------------------------------------ reporting
    def _count(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                self._counts[k] += v

    def snapshot(self) -> dict:
        """Policy, the disk-rate estimate, the break-even rate, and the decision counters."""
        with self._lock:
            out = dict(self._counts)
            out["disk_gbps_estimate"] = float(f"{self._gbps:.4g}")  # significant digits: small test pages too
        out["policy"] = self.policy
        # the disk rate above which a slow-tier page loads faster than the prefill recomputes it
        out["break_even_gbps"] = float(f"{self.break_even_gbps():.4g}")
        return out
