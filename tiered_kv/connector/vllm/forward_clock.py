"""Worker side of the learned prefill model: how long each step's forward ran on this rank.

The scheduler cannot see when a forward runs. Timed there, from when a step was scheduled (or the previous step's
output was applied) to when its output is applied, a step's time holds whatever the engine did between those two
points, and under vLLM's asynchronous scheduling the order is: schedule step N, launch it, then apply step N-1's
output, so a launch that outlasts what was left of N-1 on the GPU delays N-1's output and moves N's start. On the
H200 (2026-11-29, Llama-3-8B shape, vLLM 0.26, asynchronous scheduling on) the model fitted to those times gave
54k tokens/s and predicted an 8k-token turn 1 at 0.65x of its measured time; the same fit given that run's step
sizes at the times measured from outside predicts it within 10% (tests/planner/test_rates.py): the times it was
given were short, not the fit. Which late output shortened them was not seen (the run kept no per-step times;
``StepMeter.recent`` keeps them now).

So each rank times its own forwards:

- ``begin(step, loaded)`` in ``bind_connector_metadata``, the model runner's first connector call of a step (vLLM
  0.33 calls ``start_load_kv`` after the forward's launch in steps without in-step loads: it cannot mark the start);
- ``end()`` in ``wait_for_save``, which every version calls after the forward;
- ``take()`` in ``build_connector_worker_meta``: the steps whose forward finished since the last call, as
  ``{step: (seconds, loaded)}``.

On CUDA a step is a pair of timing events on the stream current at ``begin`` and ``end``: the GPU stamps ``begin``
when it gets there, after the previous step's work, so the time is this step's own, gaps waiting for the CPU's
kernel launches included; a pair is read (``Event.query``, no wait) once the GPU passed ``end``, usually in the
next step's metadata. Without CUDA (the CPU fallback, tests) the forward runs on the caller's thread, so ``clock``
(``time.perf_counter``) read at both calls is the time.

``loaded``: the step had in-step loads (``StepPlan.sync``), which the forward's stream waits for, whole or layer by
layer: its time is not a recompute's, and the scheduler leaves it out of the fit.

Threading contract: every method on vLLM's worker thread (the model runner), like the rest of the worker side.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import torch

#: Forwards whose end the GPU has not reached yet, kept at most (older ones are dropped: a step that never ends)
PENDING = 64


class ForwardClock:
    """This rank's forward time per step (see the module). ``device``: a CUDA device (events) or None (``clock``)."""

    def __init__(self, device: torch.device | None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.cuda = device is not None and device.type == "cuda"
        self.device = device
        self.clock = clock
        self._open: tuple[int, bool, object] | None = None  # the step begun and not ended: (step, loaded, mark)
        self._pending: deque[tuple[int, bool, object, object]] = deque()  # ended, not read yet (CUDA)
        self._done: dict[int, tuple[float, bool]] = {}

    def begin(self, step: int, loaded: bool) -> None:
        """Step ``step``'s forward is about to be launched; ``loaded``: its forward waits for in-step loads."""
        if step < 0:
            return
        self._open = (step, bool(loaded), self._mark())

    def end(self) -> None:
        """The forward of the step begun was launched (CUDA) or ran (CPU); a second call for it does nothing."""
        if self._open is None:
            return
        step, loaded, start = self._open
        self._open = None
        stop = self._mark()
        if not self.cuda:
            self._done[step] = (max(0.0, stop - start), loaded)
            return
        self._pending.append((step, loaded, start, stop))
        while len(self._pending) > PENDING:
            self._pending.popleft()

    def take(self) -> dict[int, tuple[float, bool]]:
        """``{step: (seconds, loaded)}`` of the forwards that finished since the last call (CUDA: those the GPU is
        done with, in order; the rest wait for a later call)."""
        while self._pending and self._pending[0][3].query():
            step, loaded, start, stop = self._pending.popleft()
            self._done[step] = (start.elapsed_time(stop) / 1e3, loaded)
        out, self._done = self._done, {}
        return out

    def _mark(self):
        if not self.cuda:
            return self.clock()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev
