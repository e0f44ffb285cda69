"""The load gate: load a hit from a slow tier (disk, remote) only while reading it beats recomputing it.

One rule for both engine adapters (the vLLM connector's scheduler per chunk, the SGLang backend per
page): with ``disk_load_policy`` ``auto``, the leading units held in memory tiers always load; the
units after them, held only in a slow tier, load while ``unit_nbytes / rate < unit_tokens /
prefill_tokens_per_s``. The rate starts at ``disk_read_gbps`` and follows the reads the caller times
(an exponential average, ``EWMA_NEW`` for the newest). A declined tier is never read, so its estimate
would never change: every ``probe_every``-th declined decision takes the hit anyway (``0``: never).
``always`` loads every held unit; ``never`` only the memory-tier ones.

Threading contract: ``decide`` and ``observe`` may run on different threads at once (SGLang's
prefetch and prefetch-IO threads); both take the gate's lock.
"""
from __future__ import annotations

import threading

from tiered_kv.errors import ConfigError

DISK_LOAD_POLICIES = ("auto", "always", "never")
#: Weight of the newest read in the slow-tier rate average.
EWMA_NEW = 0.2

#: ``LoadGate.decide`` outcomes
ALL_FAST, ALWAYS, BEATS, PROBE, DECLINED = "all_fast", "always", "beats", "probe", "declined"
OUTCOMES = (ALL_FAST, ALWAYS, BEATS, PROBE, DECLINED)


class LoadGate:
    """How many leading held units (chunks, pages) are worth loading; the rest are recomputed."""

    def __init__(self, policy: str, disk_read_gbps: float, probe_every: int, prefill_tokens_per_s: float,
                 unit_tokens: int, unit_nbytes: int) -> None:
        if policy not in DISK_LOAD_POLICIES:
            raise ConfigError(f"disk_load_policy: expected one of {list(DISK_LOAD_POLICIES)}, got {policy!r}")
        if unit_tokens <= 0 or unit_nbytes <= 0:
            raise ConfigError(f"load gate: unit of {unit_tokens} tokens / {unit_nbytes} B; both must be > 0")
        self.policy = policy
        self.probe_every = int(probe_every)
        self.prefill_tokens_per_s = float(prefill_tokens_per_s)
        self.unit_tokens = int(unit_tokens)
        self.unit_nbytes = int(unit_nbytes)
        self._gbps = float(disk_read_gbps)
        self._declined = 0
        self._decisions = dict.fromkeys(OUTCOMES, 0)
        self._declined_units = 0
        self._lock = threading.Lock()

    @property
    def gbps(self) -> float:
        """The current slow-tier read-rate estimate (GB/s)."""
        with self._lock:
            return self._gbps

    def beats_recompute(self) -> bool:
        """Whether, at the current estimate, a slow-tier unit loads faster than it is recomputed."""
        return self.unit_nbytes / (self.gbps * 1e9) < self.unit_tokens / self.prefill_tokens_per_s

    def break_even_gbps(self) -> float:
        """The slow-tier rate above which loading a unit beats recomputing it."""
        return self.unit_nbytes * self.prefill_tokens_per_s / self.unit_tokens / 1e9

    def decide(self, n_fast: int, n: int) -> tuple[int, str]:
        """Of ``n`` held leading units, the first ``n_fast`` in memory tiers: how many to load, and why
        (``ALL_FAST``, ``ALWAYS``, ``BEATS``, ``PROBE`` or ``DECLINED``). Each outcome is counted (``report``)."""
        hits, outcome = self._decide(n_fast, n)
        with self._lock:
            self._decisions[outcome] += 1
            self._declined_units += n - hits
        return hits, outcome

    def _decide(self, n_fast: int, n: int) -> tuple[int, str]:
        if n_fast == n:
            return n, ALL_FAST
        if self.policy == "always":
            return n, ALWAYS
        if self.policy == "auto":
            if self.beats_recompute():
                return n, BEATS
            with self._lock:
                self._declined += 1
                probe = self.probe_every > 0 and self._declined % self.probe_every == 0
            if probe:
                return n, PROBE
        return n_fast, DECLINED

    def report(self) -> dict:
        """For metrics: ``decisions`` (count per outcome), ``declined_units`` (held slow-tier units not loaded, so
        recomputed), ``read_gbps`` (the slow-tier rate estimate) and ``break_even_gbps``."""
        with self._lock:
            return {"decisions": dict(self._decisions), "declined_units": self._declined_units,
                    "read_gbps": self._gbps, "break_even_gbps": self.break_even_gbps()}

    def observe(self, nbytes: int, seconds: float) -> None:
        """A slow-tier read moved ``nbytes`` in ``seconds``: fold its rate into the estimate."""
        if nbytes <= 0 or seconds <= 0:
            return
        gbps = nbytes / seconds / 1e9
        with self._lock:
            self._gbps = (1 - EWMA_NEW) * self._gbps + EWMA_NEW * gbps
