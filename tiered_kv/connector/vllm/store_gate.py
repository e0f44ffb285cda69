"""When a step's stores start copying: after that step's sampler has sent its tokens, not beside it.

Measured on the H200 (2026-11-30, ``benchmarks/probes/store_beside_step.py``, a 1,312-token Llama-3-8B prefill step
with vLLM's sampler and its token copy, 30 steps a variant): a store's device-to-host copy that starts when the
forward ends holds up the sampler's copy of the token ids to the host, because the copy engine takes copies of one
direction in order. The step took 3.0 ms longer with the store's 172 MB copied alone, 3.8 ms longer with our mover
doing it (its Python also competes with vLLM's thread for the GIL); 3.2 / 4.2 ms with the token copy on the forward's
stream. Round 19 had seen ours ~1.5 ms slower per prefill than no connector in vLLM's own prefill time, in steps that
loaded nothing.

So a store submitted in step N's ``wait_for_save`` is *held*: its mover waits before touching it until ``open`` runs
in step N+1's ``bind_connector_metadata``. By then vLLM has enqueued step N's sampler, the token copy and step N+1's
input copies; ``open`` records a CUDA event on vLLM's stream there and the store's copy waits for that event as well
as for its forward. With asynchronous scheduling the next step is bound while step N still runs on the GPU, so the
mover's Python runs while the GPU is busy, not while vLLM's thread hands out step N's tokens.

The probe measured it (async token copy, 30 steps a variant): the store copied at once +3.8 ms a step; held until
the next step +1.0 ms; with the sleep kernel below +0.9 ms; the mover's Python alone (no copy) +0.6 ms.

When no step N+1 comes (the engine went idle), the mover stops waiting ``HOLD_AFTER_FORWARD_S`` after it saw the GPU
past the store's forward (its CUDA event, polled every ``POLL_S``; without CUDA the forward ran before the store was
submitted), or ``HOLD_MAX_S`` after it took the job in any case. A fence opens the gate before it waits for the jobs
it fences (in ``handle_preemptions``, before the next step's inputs are enqueued: those stores copy ahead of them),
and so does an idle step before it waits for loads queued behind held stores, and ``close``. A store whose mover is
still busy with an earlier job when the gate opens finds it open, with the event, when it gets there.

Threading contract: ``hold`` and ``open`` run on vLLM's worker thread, ``wait`` on the front mover's thread; one lock
guards the table of held jobs; each of the two counters is written by one of those threads.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from types import SimpleNamespace

import torch

#: How often a held store's mover checks whether its forward ended
POLL_S = 0.002
#: How long a held store waits for the next step after the GPU passed its forward (an idle engine has none)
HOLD_AFTER_FORWARD_S = 0.005
#: The longest a store is held whatever its forward's event says
HOLD_MAX_S = 2.0
#: GPU cycles of the one-block sleep kernel queued between that event and the copy (~50 us at 2 GHz): the sampler's
#: token copy and the event can become ready together, and the copy engine takes whichever copy it sees first
SPIN_CYCLES = 100_000


class _Held:
    """One held store job: set once the gate opened, with the event its copy must wait for (None: none). It stays in
    the table until its mover takes it (``wait``) or the job ends without a copy (``forget``): a mover still busy with
    an earlier job when the gate opens finds it opened, with its event."""

    __slots__ = ("opened", "after", "claimed")

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.after = None
        self.claimed = False  # taken by ``open`` or by its mover's timeout (under the gate's lock)


class StoreGate:
    """Holds store jobs on their movers until the next step began (see the module).

    ``device``: the device of vLLM's KV tensors (CUDA: events are recorded on its current stream; the CPU or None:
    no event). ``counters``: where ``stores_held_opened`` (stores let go by ``open``: the next step, a fence, an idle
    step, close; a store a fence opens and then cancels included) and ``stores_held_timed_out`` (stores that went on
    their own: no next step in time) are added (the rank's ``WorkerCounters``; default: a private one). ``clock``:
    monotonic seconds (tests pass their own).
    """

    def __init__(self, device: torch.device | None, counters=None, clock: Callable[[], float] = time.monotonic) -> None:
        self.device = device  # set again once vLLM's KV tensors are registered (``WorkerRuntime.register``)
        self.counters = (counters if counters is not None
                         else SimpleNamespace(stores_held_opened=0, stores_held_timed_out=0))
        self.clock = clock
        self._lock = threading.Lock()
        self._held: dict[int, _Held] = {}

    @property
    def holding(self) -> int:
        """How many store jobs wait for the gate now (held and not opened)."""
        with self._lock:
            return sum(not h.claimed for h in self._held.values())

    def hold(self, job_ids: Iterable[int]) -> None:
        """Hold these store jobs (vLLM's thread, before they reach a mover)."""
        with self._lock:
            for job_id in job_ids:
                self._held[job_id] = _Held()

    def forget(self, job_id: int) -> None:
        """``job_id`` ends without a copy (a fence cancelled it): drop it from the table (any thread)."""
        with self._lock:
            self._held.pop(job_id, None)

    def open(self) -> None:
        """Let every held store go (vLLM's thread); on CUDA each copy also waits for an event recorded here."""
        with self._lock:
            held = [h for h in self._held.values() if not h.claimed]
            for h in held:
                h.claimed = True
        if not held:
            return
        ev = None
        try:
            if self.device is not None and self.device.type == "cuda":
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(self.device))
        finally:  # a mover must never wait on a gate that failed to open
            for h in held:
                h.after = ev
                h.opened.set()
        self.counters.stores_held_opened += len(held)

    def wait(self, job_id: int, forward=None):
        """On the mover, before a store's copy: block until the gate opens for ``job_id`` (a job never held passes at
        once). ``forward``: the CUDA event marking the end of the forward the store reads (None: it ended). Returns
        the event the copy must also wait for, or None."""
        with self._lock:
            h = self._held.get(job_id)
        if h is None:
            return None
        try:
            return self._wait(h, forward)
        finally:
            with self._lock:
                self._held.pop(job_id, None)

    def _wait(self, h: _Held, forward):
        start = self.clock()
        ended_at = None
        while not h.opened.wait(POLL_S):
            now = self.clock()
            if ended_at is None and (forward is None or forward.query()):
                ended_at = now
            if (ended_at is not None and now - ended_at >= HOLD_AFTER_FORWARD_S) or now - start >= HOLD_MAX_S:
                with self._lock:  # either ``open`` claimed this job or its mover does, never both
                    if not h.claimed:
                        h.claimed = True
                        self.counters.stores_held_timed_out += 1
                        return None
                h.opened.wait()  # ``open`` took it meanwhile and sets it at once
                break
        return h.after


def order_after(stream, after) -> None:
    """Make ``stream`` (a held store's copy stream) wait for ``after`` (the event ``open`` recorded), then for a sleep
    kernel of ``SPIN_CYCLES`` on one block, so a token copy that became ready at the same moment goes first."""
    stream.wait_event(after)
    sleep = getattr(torch.cuda, "_sleep", None)  # torch's own test kernel; without it the event alone orders
    if sleep is not None and SPIN_CYCLES > 0:
        with torch.cuda.stream(stream):
            sleep(SPIN_CYCLES)
