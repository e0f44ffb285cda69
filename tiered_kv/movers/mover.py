"""Movers: the worker threads that execute transfer jobs for one tier edge.

A ``Mover`` owns one tier edge: a small pool of worker threads and a priority queue in
which loads (reads toward the caller) run ahead of stores. It calls an ``execute``
function for each job and hands the resulting ``Completion`` to a callback. It never
chooses victims and never touches the planner's index.

Threading contract: ``Mover.submit`` may be called from any thread; ``execute`` and
``on_done`` run on the mover's worker threads, so they must be thread-safe with respect
to each other and the submitting thread.
"""
from __future__ import annotations

import atexit
import itertools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable

from tiered_kv.values.jobs import Completion, TransferJob

log = logging.getLogger(__name__)

class Mover:
    """Worker threads for one tier edge; loads run before stores.

    ``execute(job) -> Completion`` does the copy; an exception in it becomes a failed
    completion (logged), never a dead thread. ``on_done(job, completion)`` is called on
    the worker thread after each job.
    """

    def __init__(self, name: str, execute: Callable[[TransferJob], Completion],
                 on_done: Callable[[TransferJob, Completion], None], workers: int = 1) -> None:
        self.name = name
        self._execute = execute
        self._on_done = on_done
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._busy = 0
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [threading.Thread(target=self._run, name=f"tkv-mover-{name}-{i}", daemon=True)
                         for i in range(max(1, workers))]
        for t in self._threads:
            t.start()

    def submit(self, job: TransferJob) -> None:
        """Queue ``job``; returns at once."""
        if self._closed:
            self._on_done(job, Completion.failed(job, f"mover {self.name} is closed"))
            return
        self._queue.put((job.priority, next(self._seq), job))

    @property
    def depth(self) -> int:
        """Jobs queued or running."""
        with self._lock:
            return self._queue.qsize() + self._busy

    def _run(self) -> None:
        while True:
            _, _, job = self._queue.get()
            if job is None:
                return
            with self._lock:
                self._busy += 1
            t0 = time.perf_counter()
            try:
                done = self._execute(job)
            except Exception as exc:  # an I/O or copy failure must never kill the mover
                log.warning("mover %s: job %d (%s, %d items) failed: %s", self.name, job.job_id,
                            job.kind.name, len(job), exc)
                done = Completion.failed(job, f"{type(exc).__name__}: {exc}")
            if not done.seconds:
                done.seconds = time.perf_counter() - t0
            try:
                self._on_done(job, done)
            except Exception:  # the planner's bookkeeping failing is a bug: say so loudly
                log.exception("mover %s: completion handler failed for job %d", self.name, job.job_id)
            finally:
                with self._lock:
                    self._busy -= 1

    def close(self) -> None:
        """Finish queued jobs, then stop the threads."""
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._queue.put((2, next(self._seq), None))
        for t in self._threads:
            t.join()


def close_at_exit(owner, what: str) -> None:
    """Close ``owner`` (anything running movers, with an idempotent ``close()`` and a ``_closed`` flag) at
    interpreter exit if nobody closed it: ``atexit`` runs before the interpreter kills daemon threads, and a
    mover thread killed inside a torch copy aborts the process ("terminate called without an active
    exception") and drops its queued work. Holds only a weak reference; ``what`` names it in the log."""
    atexit.register(_close_at_exit, weakref.ref(owner), what)


def _close_at_exit(ref: weakref.ref, what: str) -> None:
    owner = ref()
    if owner is None or owner._closed:
        return
    try:
        owner.close()
        log.info("%s: closed at interpreter exit (queued work finished)", what)
    except Exception:  # noqa: BLE001 - at exit there is no caller to raise to; say what went wrong
        log.exception("%s: closing at interpreter exit failed", what)
