"""Adaptive load admission (``load_mode: adaptive``): which CPU-tier hits of a step load inside it.

An in-step load is the fastest way to serve one request (no scheduler round trip), but every
request of that step waits for the step's in-step bytes: the forward waits for each layer's
bytes, and ``start_load_kv`` holds vLLM's thread while it submits them. In a burst (many
requests with CPU hits scheduled in one step) the whole burst then waits for the whole burst's
bytes. ``StepLoadBudget`` caps the in-step bytes of one scheduler step; a hit past the cap loads
asynchronously (between steps, in arrival order) and its request joins a later step as soon as
its own bytes landed, so the first requests of a burst no longer wait for the last ones' bytes.

The cap, and why: an in-step load only ever rides in a step that *prefills* (its own request's
new tokens are in it), and such a step costs far more than a decode step: vLLM replays decode-only
batches as a CUDA graph (~5.5 ms for an 8B model on an H200) but runs any batch with a prefill
eagerly (~22-30 ms, measured in the H200 serving trace of 2026-11-23). Bytes that PCIe moves
within that time ride along for free; deferring a hit instead costs its request a round trip and
the batch one more eager prefill step later. So ``auto`` = measured H2D rate per rank x the
engine's recent *prefill-step* time (the rate from completed asynchronous CPU loads,
``LoadRate``; the prefill-step time a running average over steps that scheduled more tokens than
requests, i.e. some request's prompt or a chunk of it, ``PREFILL_WINDOW``). Until a prefill step
was measured, the average interval between busy steps stands in. A fixed ``step_load_bytes``
replaces it. (Before: the all-steps pace, i.e. decode steps: ~150-250 MB per step on 8B, so a c8
serving run loaded one hit per step in-step and sent the rest back as separate prefills: 89 eager
loading steps for 128 requests where ``layerwise`` needed 32, and 6-22% less output tokens/s.)

How a step's time is read: the interval between consecutive ``build_connector_meta`` calls. With
vLLM's synchronous scheduling the interval that follows a step's build is that step's forward;
with asynchronous scheduling (the next step is scheduled while this one runs) it is the one after.
So a prefill step's sample is the longest of the ``PREFILL_WINDOW`` intervals after its build (the
other one is a decode step's, shorter). The in-step load itself lengthens its step, but only when
it takes longer than the forward; then the sample is its copy time and the budget stays where it
was (bytes / rate = time): it grows only while steps are compute-bound, so it settles at about
rate x the prefill step's compute time, not above.

The rate is weighted by bytes: sum of bytes / sum of copy seconds over the last loads, the
starting guess (``load_gbps``) counting as a pseudo-load of ``PRIOR_BYTES`` until that many
measured bytes are in the window. A load's time is a fixed cost (driver calls, events: tens of
microseconds) plus its bytes over the rate, so a small load measures the fixed cost, not PCIe:
loads under ``MIN_SAMPLE_BYTES`` are not counted at all, and the estimate is clamped to
``[MIN_GBPS, MAX_GBPS]``. (Before: the first sample replaced the guess and each later one moved
it by a fifth whatever its size, so a 4 KiB load at 0.1 GB/s shrank the budget to nothing.)

The first hit of a step always loads in-step (up to ``sync_max_tokens``, as before), so a
request that arrives alone keeps the in-step win.

Threading contract: vLLM's scheduler thread only (called from ``SchedulerPlanner``); no lock.
Pure Python, no I/O.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

#: Starting guess of the engine's step time before any step was measured (seconds).
START_STEP_S = 0.02
#: Step intervals outside [MIN_STEP_S, MAX_STEP_S] are clamped: a long one is an idle gap (no request)
#: or a stall, not the pace a burst will see; a tiny one would shrink the budget to nothing.
MIN_STEP_S, MAX_STEP_S = 0.002, 0.25
#: Weight of a new step interval in the step-time average (a few steps of memory: bursts change the pace quickly).
EMA = 0.2
#: A prefill step's time is the longest of this many busy intervals after its build (see the module text).
PREFILL_WINDOW = 2
#: Weight of a new prefill-step sample in its average (prefill steps are rarer than steps).
PREFILL_EMA = 0.3
#: Loads smaller than this are not rate samples: their time is mostly the fixed cost of a load (at 25 GB/s
#: 1 MiB moves in 42 us, about the fixed cost of a load's driver calls and events).
MIN_SAMPLE_BYTES = 1 << 20
#: The starting guess (``load_gbps``) counts as a load of this many bytes until the window holds as many
#: measured bytes (a few large loads replace it; many small ones only nudge it).
PRIOR_BYTES = 64 << 20
#: The rate is over the last this many counted loads (a few bursts' worth: it follows a change of load).
RATE_WINDOW = 32
#: The estimate is clamped to this range (GB/s per rank): a timing glitch (a load of ~0 s) or a stalled copy
#: must not set a budget of terabytes or of nothing. 500 GB/s is above any host link (GH200's C2C: ~450).
MIN_GBPS, MAX_GBPS = 1.0, 500.0


class LoadRate:
    """The H2D rate per rank (GB/s) from measured loads: bytes-weighted over a window, with a prior."""

    def __init__(self, prior_gbps: float) -> None:
        """``prior_gbps``: the rate assumed until loads were measured (clamped to ``[MIN_GBPS, MAX_GBPS]``)."""
        self.prior_gbps = min(MAX_GBPS, max(MIN_GBPS, float(prior_gbps)))
        self.ignored = 0  # loads too small to count (``MIN_SAMPLE_BYTES``)
        self._window: deque[tuple[int, float]] = deque(maxlen=RATE_WINDOW)
        self.gbps = self.prior_gbps

    @property
    def samples(self) -> int:
        """Loads in the window now."""
        return len(self._window)

    def observe(self, nbytes: int, seconds: float) -> None:
        """A load of ``nbytes`` took ``seconds`` of copy time; ignored when too small or not positive."""
        if nbytes <= 0 or seconds <= 0:
            return
        if nbytes < MIN_SAMPLE_BYTES:
            self.ignored += 1
            return
        self._window.append((int(nbytes), float(seconds)))
        measured = sum(b for b, _ in self._window)  # a few dozen loads: summed afresh, no drift
        secs = sum(t for _, t in self._window)
        prior = max(0, PRIOR_BYTES - measured)  # the guess fills the window up to PRIOR_BYTES
        rate = (measured + prior) / (secs + prior / (self.prior_gbps * 1e9)) / 1e9
        self.gbps = min(MAX_GBPS, max(MIN_GBPS, rate))


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
        self.rate = LoadRate(start_gbps)
        self.step_s = START_STEP_S
        self.counters = AdmissionCounters()
        self._clock = clock
        self._used = 0  # in-step bytes charged in the step being scheduled
        self._loads = 0  # in-step loads charged in the step being scheduled
        self._last: float | None = None  # clock at the previous step's build
        self._last_busy = False
        self.prefill_s: float | None = None  # running average of prefill steps' time; None until one was measured
        self._window = 0  # busy intervals still to read for the prefill step being measured
        self._window_max = 0.0  # the longest of them so far

    @property
    def gbps(self) -> float:
        """The H2D rate per rank (GB/s) the budget assumes now."""
        return self.rate.gbps

    @property
    def budget(self) -> int:
        """The cap of in-step bytes per step (per rank) in effect now."""
        if self.fixed is not None:
            return self.fixed
        return int(self.gbps * 1e9 * self.pace_s)

    @property
    def pace_s(self) -> float:
        """The step time the budget prices: the prefill steps' average, or all busy steps' until one was measured."""
        return self.step_s if self.prefill_s is None else self.prefill_s

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

    def next_step(self, busy: bool, prefill: bool = False) -> None:
        """The step being scheduled is complete (``build``); ``busy``: it scheduled tokens; ``prefill``: more
        tokens than requests (some prompt, or a chunk of one). Starts the next one."""
        now = self._clock()
        if self._last is not None and self._last_busy and busy:
            dt = min(MAX_STEP_S, max(MIN_STEP_S, now - self._last))
            self.step_s += EMA * (dt - self.step_s)
            if self._window:
                self._window_max = max(self._window_max, dt)
                self._window -= 1
                if not self._window:
                    x = self._window_max
                    self.prefill_s = x if self.prefill_s is None else self.prefill_s + PREFILL_EMA * (x - self.prefill_s)
        elif self._window:  # an idle gap inside the window: that prefill step's time is unknown
            self._window = 0
        if prefill and busy:
            if not self._window:
                self._window_max = 0.0
            self._window = PREFILL_WINDOW  # back-to-back prefill steps: one sample, the longest interval
        self._last, self._last_busy = now, busy
        self._used = self._loads = 0

    def observe(self, nbytes: int, seconds: float) -> None:
        """A CPU-tier asynchronous load of ``nbytes`` per rank moved in ``seconds`` (its copy time): ``LoadRate``."""
        self.rate.observe(nbytes, seconds)

    def stats(self) -> dict:
        """Counters and the current estimates, for ``SchedulerPlanner.stats``."""
        c = self.counters
        return {"admit_in_step": c.in_step, "admit_deferred": c.deferred, "admit_first_of_step": c.first_of_step,
                "admit_budget_bytes": self.budget, "admit_gbps": round(self.gbps, 3),
                "admit_rate_samples": self.rate.samples, "admit_rate_ignored": self.rate.ignored,
                "admit_step_ms": round(self.step_s * 1e3, 3),
                "admit_prefill_step_ms": round((self.prefill_s or 0.0) * 1e3, 3)}
