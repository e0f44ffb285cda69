"""Engine steps that compute nothing while a worker rank moves bytes: wait for them with the GIL released.

While every request waits for its KV (``WAITING_FOR_REMOTE_KVS`` until ``get_finished`` names it, or a hybrid
hit's promotion to the CPU tier), vLLM's engine core keeps stepping without a pause: each step schedules
nothing and the model runner only calls the connector (``kv_connector_no_forward``). That loop is pure Python
on the thread holding the GIL. The threads that move the bytes (the front mover, a copier's submitter, the
disk workers) let go of the GIL at every torch op, driver call, lock and event, and each time must wait for
the spinning thread to drop it again, which Python forces only every switch interval (5 ms,
``sys.getswitchinterval``). A load of a few hundred such calls then takes seconds: on the H200, the gpt-oss-20b
shape's 8,192-token turn 2 from the CPU tier (two KV cache groups, so the front mover's path) took 1,787 ms
TTFT with ``load_mode: async`` against 30-49 ms loaded layer by layer; on a CPU, 150 small torch ops on a
second thread took 956 ms beside a spinning thread and 58 ms beside a waiting one, and with vLLM's scheduler
stepping as fast as it can, a 3-chunk gptoss turn 2 was scheduled after 56-2,078 steps (17-275 ms; gemma3's
six groups: not within 5,000), a one-group disk hit after 1,111 (``tests/connector/vllm/test_idle_steps.py``).
One group's CPU-tier loads go through the ``AsyncLoader``, whose copier's submitter thread (on a GPU) plans
and submits under the same GIL.

``IdleWait.wait`` (from ``WorkerRuntime.poll``, vLLM's ``get_finished``, in a step whose plan says no token
was scheduled, ``StepPlan.idle``, while the rank has loads or promotions in flight: what a waiting request
needs; stores alone never hold a step, whose output may be a finished request's last) blocks vLLM's thread instead, GIL
released, until a job of the rank completes or one of its asynchronous loads has landed, for at most
``IDLE_WAIT_S``: the step had nothing to compute, and a request arriving meanwhile waits at most that long.
The same ``poll`` then reports what completed, so vLLM schedules the request in its next step.

Threading contract: ``wait`` on vLLM's worker thread; ``notify`` from any thread (the movers' ``on_done``).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

#: The longest a step that computes nothing waits for the rank's jobs (a request arriving meanwhile waits this long).
IDLE_WAIT_S = 0.005
#: How often that wait checks for landed asynchronous loads (nothing signals a CUDA event's completion).
IDLE_POLL_S = 0.0005


class IdleWait:
    """Blocks vLLM's thread, GIL released, while a step with nothing to compute waits for the rank's jobs."""

    def __init__(self, counters) -> None:
        """``counters``: the rank's ``WorkerCounters`` (``idle_waits``, ``idle_wait_seconds``)."""
        self._progress = threading.Event()
        self.counters = counters

    def notify(self) -> None:
        """A job of the rank completed (any thread)."""
        self._progress.set()

    def wait(self, ready: Callable[[], bool]) -> bool:
        """Wait until ``ready()`` (something to report: a completed job, a landed load), at most ``IDLE_WAIT_S``;
        returns whether it is."""
        t0 = time.perf_counter()
        deadline = t0 + IDLE_WAIT_S
        self.counters.idle_waits += 1
        try:
            while True:
                self._progress.clear()  # before the check: a completion after it sets the event again
                if ready():
                    return True
                left = deadline - time.perf_counter()
                if left <= 0:
                    return False
                self._progress.wait(min(left, IDLE_POLL_S))
        finally:
            self.counters.idle_wait_seconds += time.perf_counter() - t0
