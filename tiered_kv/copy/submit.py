"""Per-direction submitter thread and side stream (``Lanes``), and the result handle of one copy.

Role: ``cuMemcpyBatchAsync`` holds the calling thread about 1 us per descriptor
inside the driver (measured: a 4096-block, 131k-run store keeps the caller
134 ms there), so submission runs on a daemon thread per direction. The
caller's thread only plans and enqueues; the two directions never wait on each
other, which is what lets stores and loads run at the same time.

``Lanes`` are a copier's two directions: per direction one side stream (loads
at a higher priority) and one submitter thread, and how a load is launched on
them (after the caller's stream, its errors reported through its results).

``CopyResult`` is the handle a caller gets back at once: it turns ready when
the submitter has enqueued the copy and recorded its CUDA event, and done when
that event has fired.

Threading: ``Submitter.put`` may be called from any thread; jobs run one at a
time, in put order, on the submitter's thread. ``Lanes`` belong to one copier
(called from one thread at a time, like it). ``CopyResult`` methods are safe
from any thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

from tiered_kv.copy.errors import CopyLaunchError
from tiered_kv.copy.select import Mechanism


class CopyResult:
    """What one ``gpu_to_cpu`` / ``cpu_to_gpu`` call enqueued, and whether it has landed.

    ``start`` (``cpu_to_gpu_many(timing=True)`` only): a timing event recorded where the copy
    began on its stream; ``start.elapsed_time(event)`` is its time on the GPU once done.
    ``num_runs`` is the number of descriptors (1-D runs, 2-D copies or kernel
    runs): an upper bound at return, exact once the copy is submitted.
    """

    __slots__ = ("mechanism", "to_cpu", "num_blocks", "nbytes", "num_runs", "event", "error", "start", "_submitted")

    def __init__(self, mechanism: Mechanism, to_cpu: bool, num_blocks: int, nbytes: int, num_runs: int) -> None:
        """A pending result; the submitter calls ``_finish`` once the copy is enqueued or has failed."""
        self.mechanism = mechanism
        self.to_cpu = to_cpu
        self.num_blocks = num_blocks
        self.nbytes = nbytes
        self.num_runs = num_runs
        self.event: torch.cuda.Event | None = None
        self.error: BaseException | None = None
        self.start: torch.cuda.Event | None = None  # timing event where the copy began (only when asked for)
        self._submitted = threading.Event()

    def _finish(self, event: torch.cuda.Event | None, error: BaseException | None = None,
                descriptors: int | None = None) -> None:
        self.event = event
        self.error = error
        if descriptors is not None:
            self.num_runs = descriptors
        self._submitted.set()

    def done(self) -> bool:
        """True once the copy has landed or has failed (see ``error``); never blocks."""
        if not self._submitted.is_set():
            return False
        # a failed copy may have queued part of its work before the error: done once that has landed too
        return self.event is None or self.event.query()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the copy has landed; raise ``CopyLaunchError`` if it failed or ``TimeoutError``."""
        if not self._submitted.wait(timeout):
            raise TimeoutError(f"copy of {self.num_blocks} blocks not submitted within {timeout} s")
        if self.event is not None:  # a failed copy's event: what it had queued lands before anyone reuses its blocks
            self.event.synchronize()
        if self.error is not None:
            raise CopyLaunchError(f"copy of {self.num_blocks} blocks failed: {self.error}") from self.error

    def wait_on(self, stream: torch.cuda.Stream) -> None:
        """Make ``stream`` wait for the copy (blocks the host only until it is submitted, not until it lands)."""
        self._submitted.wait()
        if self.error is not None:
            raise CopyLaunchError(f"copy of {self.num_blocks} blocks failed: {self.error}") from self.error
        if self.event is not None:
            stream.wait_event(self.event)


class Submitter:
    """A daemon thread that runs submission jobs in order on one CUDA device."""

    def __init__(self, device: torch.device, name: str) -> None:
        """Create the queue; the thread starts with the first job."""
        self._device = device
        self._name = name
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def put(self, job: Callable[[], None]) -> None:
        """Queue ``job``; it must report its own outcome (it runs on the submitter thread)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._jobs.put(job)

    def close(self) -> None:
        """Finish queued jobs, then stop the thread."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
            thread.join()

    def _run(self) -> None:
        # The driver call needs a current context on this thread: cudaSetDevice makes
        # the primary context current (CUDA 12+), which is the context torch uses.
        torch.cuda.set_device(self._device)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()


#: how long ``Lanes.prepare`` waits for a submitter thread's first job (the thread's start and ``set_device``)
PREPARE_TIMEOUT_S = 30.0


class Lanes:
    """A copier's two directions (``to_cpu`` True: stores, False: loads): each has a side stream, made at
    first use (loads at ``load_priority``, stores at the default 0), and, when ``threaded``, a submitter
    thread that runs its jobs in order; without one a job runs on the caller's thread."""

    def __init__(self, device: torch.device, threaded: bool, load_priority: int) -> None:
        self.device = device
        self.threaded = threaded
        self.load_priority = int(load_priority)
        self._streams: dict[bool, torch.cuda.Stream] = {}
        self._submitters: dict[bool, Submitter] = {}

    def stream(self, to_cpu: bool) -> torch.cuda.Stream:
        """The stream of one direction's copies (created at first use): loads at ``load_priority``."""
        if to_cpu not in self._streams:
            self._streams[to_cpu] = torch.cuda.Stream(device=self.device,
                                                      priority=0 if to_cpu else self.load_priority)
        return self._streams[to_cpu]

    def prepare(self, to_cpu: bool) -> None:
        """Make the direction's side stream now and, when threaded, start its submitter thread and wait until the
        thread has made the device current: what the direction's first copy would otherwise pay inside a step."""
        self.stream(to_cpu)
        if self.threaded:
            started = threading.Event()
            self.run(to_cpu, started.set)
            if not started.wait(PREPARE_TIMEOUT_S):  # a thread that cannot make the device current dies unheard
                raise CopyLaunchError(f"the {'d2h' if to_cpu else 'h2d'} submitter thread on {self.device} did not "
                                      f"start within {PREPARE_TIMEOUT_S} s (see the log for its error)")

    def run(self, to_cpu: bool, job: Callable[[], None]) -> None:
        """Run ``job`` on the direction's submitter thread (made at first use), or now when not threaded."""
        if not self.threaded:
            job()
            return
        if to_cpu not in self._submitters:
            self._submitters[to_cpu] = Submitter(self.device, f"tkv-copy-{'d2h' if to_cpu else 'h2d'}")
        self._submitters[to_cpu].put(job)

    def launch_load(self, stream: torch.cuda.Stream | None, results: list[CopyResult],
                    body: Callable[[torch.cuda.Stream], None], ordered: bool = True) -> list[CopyResult]:
        """Run ``body(side)`` for a load on the load direction's side stream, after the work queued so far
        on ``stream`` (the caller's; default the current one; not with ``ordered=False``), on the submitter
        thread when there is one. An error finishes every result ``body`` had not finished with it.
        Returns ``results``."""
        caller = None
        if ordered:
            caller = torch.cuda.Event()
            caller.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        side = self.stream(False)

        def job() -> None:
            try:
                if caller is not None:
                    side.wait_event(caller)
                body(side)
            except Exception as exc:  # noqa: BLE001 - reported through every unfinished result
                # part of a failed load may already be queued on ``side``: its result turns done only once
                # that part has landed, so its blocks are never handed back while a DMA still writes them
                queued = torch.cuda.Event()
                queued.record(side)
                for res in results:
                    if not res._submitted.is_set():
                        res._finish(queued, exc)

        self.run(False, job)
        return results

    def close(self) -> None:
        """Let queued jobs be submitted, then stop the submitter threads."""
        for sub in self._submitters.values():
            sub.close()
        self._submitters.clear()
