"""Adaptive load admission (``load_mode: adaptive``): which CPU-tier hits of a step load inside it.

An in-step load is the fastest way to serve one request (no scheduler round trip), but every
request of that step waits for the step's in-step bytes: the forward waits for each layer's
bytes, and ``start_load_kv`` holds vLLM's thread while it submits them. In a burst (many
requests with CPU hits scheduled in one step) the whole burst then waits for the whole burst's
bytes. ``StepLoadBudget`` caps the in-step bytes of one scheduler step; a hit past the cap loads
asynchronously (between steps, in arrival order) and its request joins a later step as soon as
its own bytes landed, so the first requests of a burst no longer wait for the last ones' bytes.

The cap, and why: loading in-step saves a request one scheduler round trip, about one step of
the engine's current pace; the bytes a step may take in-step without delaying its batch by more
than that are what PCIe moves in about one step. So ``auto`` = measured H2D rate per rank x the
engine's recent step time (both running averages: the rate from completed asynchronous CPU
loads, the step time from the interval between the scheduler's steps while it has work). A fixed
``step_load_bytes`` replaces it. The first hit of a step always loads in-step (up to
``sync_max_tokens``, as before), so a request that arrives alone keeps the in-step win.

Threading contract: vLLM's scheduler thread only (called from ``SchedulerPlanner``); no lock.
Pure Python, no I/O.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

#: Starting guess of the engine's step time before any step was measured (seconds).
START_STEP_S = 0.02
#: Step intervals outside [MIN_STEP_S, MAX_STEP_S] are clamped: a long one is an idle gap (no request)
#: or a stall, not the pace a burst will see; a tiny one would shrink the budget to nothing.
MIN_STEP_S, MAX_STEP_S = 0.002, 0.25
#: Weight of a new sample in the running averages (a few steps of memory: bursts change the pace quickly).
EMA = 0.2


@dataclass
class AdmissionCounters:
    """What the budget decided (monotonic), and its current state."""

    in_step: int = 0  # hits admitted to load in their step
    deferred: int = 0  # hits the budget sent to an asynchronous load
    first_of_step: int = 0  # of ``in_step``: hits admitted only because they were a step's first


class StepLoadBudget:
    """The in-step load bytes one scheduler step may take; ``admit`` per hit, ``charge`` per admitted load."""

    def __init__(self, fixed_bytes: int | None, start_gbps: float, clock=time.monotonic) -> None:
        """``fixed_bytes``: a fixed cap per step (None: ``auto``, measured); ``start_gbps``: the H2D rate per rank
        (GB/s) assumed until loads were measured; ``clock``: seconds (tests pass their own)."""
        self.fixed = fixed_bytes
        self.gbps = float(start_gbps)
        self.step_s = START_STEP_S
        self.counters = AdmissionCounters()
        self._clock = clock
        self._used = 0  # in-step bytes charged in the step being scheduled
        self._loads = 0  # in-step loads charged in the step being scheduled
        self._last: float | None = None  # clock at the previous step's build
        self._last_busy = False
        self._rate_seen = False

    @property
    def budget(self) -> int:
        """The cap of in-step bytes per step (per rank) in effect now."""
        if self.fixed is not None:
            return self.fixed
        return int(self.gbps * 1e9 * self.step_s)

    def admit(self, nbytes: int) -> bool:
        """Whether a CPU-tier hit of ``nbytes`` (per rank) may load inside the step being scheduled.

        Counts the decision; ``charge`` then counts the bytes once vLLM allocated the request's blocks
        (a request vLLM could not allocate is asked again next step and charged nothing).
        """
        if self._loads == 0:
            self.counters.in_step += 1
            if nbytes > self.budget:
                self.counters.first_of_step += 1
            return True
        if self._used + nbytes <= self.budget:
            self.counters.in_step += 1
            return True
        self.counters.deferred += 1
        return False

    def charge(self, nbytes: int) -> None:
        """An admitted hit's load was planned in the step being scheduled."""
        self._used += nbytes
        self._loads += 1

    def next_step(self, busy: bool) -> None:
        """The step being scheduled is complete (``build``); ``busy``: it scheduled tokens. Starts the next one."""
        now = self._clock()
        if self._last is not None and self._last_busy and busy:
            dt = min(MAX_STEP_S, max(MIN_STEP_S, now - self._last))
            self.step_s += EMA * (dt - self.step_s)
        self._last, self._last_busy = now, busy
        self._used = self._loads = 0

    def observe(self, nbytes: int, seconds: float) -> None:
        """A CPU-tier asynchronous load of ``nbytes`` per rank moved in ``seconds`` (its copy time)."""
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds / 1e9
        if not self._rate_seen:  # the first measurement replaces the guess
            self.gbps, self._rate_seen = rate, True
        else:
            self.gbps += EMA * (rate - self.gbps)

    def stats(self) -> dict:
        """Counters and the current estimates, for ``SchedulerPlanner.stats``."""
        c = self.counters
        return {"admit_in_step": c.in_step, "admit_deferred": c.deferred, "admit_first_of_step": c.first_of_step,
                "admit_budget_bytes": self.budget, "admit_gbps": round(self.gbps, 3),
                "admit_step_ms": round(self.step_s * 1e3, 3)}
