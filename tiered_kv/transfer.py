"""Transfer jobs, completions and movers: the records and the threads that move bytes.

The planner (``TierChain``) emits ``TransferJob`` records and applies ``Completion``
records; both are plain data (``to_dict``/``from_dict`` give JSON-able dicts) so the
planner and the tiers can live in different processes (vLLM's scheduler vs. workers).

A ``Mover`` owns one tier edge: a small pool of worker threads and a priority queue in
which loads (reads toward the caller) run ahead of stores. It calls an ``execute``
function for each job and hands the resulting ``Completion`` to a callback. It never
chooses victims and never touches the planner's index.

Tier index ``EXT`` (-1) names the caller's side of a job: the caller's tensor for the
Python API, the engine's GPU blocks for a connector. Slots on that side are indices into
the caller's buffer (or engine block ids).

Threading contract: ``TransferJob``/``Completion`` are plain values. ``Mover.submit`` may
be called from any thread; ``execute`` and ``on_done`` run on the mover's worker threads,
so they must be thread-safe with respect to each other and the submitting thread.
"""
from __future__ import annotations

import enum
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

EXT = -1
NO_SLOT = -1


class JobKind(enum.IntEnum):
    """What a job does. Loads (toward the caller) are served before stores."""

    INGRESS = 0    # caller -> tier (a put)
    EGRESS = 1     # tier -> caller (a get)
    DEMOTE = 2     # tier i -> tier i+1, source released after commit (eviction)
    PROMOTE = 3    # tier j -> tier j-1, source kept (hit promotion, prefetch)
    COPY_DOWN = 4  # tier i -> tier i+1, source kept (write-through)
    DELETE = 5     # remove records from a keyed tier

    @property
    def is_load(self) -> bool:
        """True for jobs a caller waits on to read data."""
        return self in (JobKind.EGRESS, JobKind.PROMOTE)


@dataclass(slots=True)
class TransferJob:
    """One batched transfer between two tiers (or a tier and the caller).

    ``keys[i]`` moves from ``src_slots[i]`` in ``src_tier`` to ``dst_slots[i]`` in
    ``dst_tier``. Slots are ``NO_SLOT`` for keyed tiers (the disk tier finds records by key).
    """

    job_id: int
    kind: JobKind
    src_tier: int
    dst_tier: int
    keys: list[bytes]
    src_slots: list[int]
    dst_slots: list[int]
    handle: int = 0

    @property
    def priority(self) -> int:
        """0 for loads, 1 for stores (lower runs first)."""
        return 0 if self.kind.is_load else 1

    def __len__(self) -> int:
        return len(self.keys)

    def to_dict(self) -> dict:
        """Plain, JSON-able form (keys as hex) for crossing process boundaries."""
        return {"job_id": self.job_id, "kind": int(self.kind), "src_tier": self.src_tier,
                "dst_tier": self.dst_tier, "keys": [k.hex() for k in self.keys],
                "src_slots": list(self.src_slots), "dst_slots": list(self.dst_slots), "handle": self.handle}

    @classmethod
    def from_dict(cls, d: dict) -> "TransferJob":
        """Inverse of ``to_dict``."""
        return cls(int(d["job_id"]), JobKind(int(d["kind"])), int(d["src_tier"]), int(d["dst_tier"]),
                   [bytes.fromhex(k) for k in d["keys"]], [int(s) for s in d["src_slots"]],
                   [int(s) for s in d["dst_slots"]], int(d.get("handle", 0)))


@dataclass(slots=True)
class Completion:
    """Outcome of one job: per-item success, and which source records failed verification.

    ``corrupt[i]`` means the source tier found item i's record damaged and already removed it;
    ``missing[i]`` that the source tier no longer has the record at all (removed by another
    process sharing the medium). Either way the planner forgets that copy.
    """

    job_id: int
    ok: list[bool]
    corrupt: list[bool] = field(default_factory=list)
    nbytes: int = 0
    seconds: float = 0.0
    error: str = ""
    missing: list[bool] = field(default_factory=list)

    @classmethod
    def failed(cls, job: TransferJob, error: str) -> "Completion":
        """A completion in which every item failed."""
        return cls(job.job_id, [False] * len(job), [False] * len(job), error=error)

    def to_dict(self) -> dict:
        """Plain, JSON-able form."""
        return {"job_id": self.job_id, "ok": list(self.ok), "corrupt": list(self.corrupt),
                "nbytes": self.nbytes, "seconds": self.seconds, "error": self.error, "missing": list(self.missing)}

    @classmethod
    def from_dict(cls, d: dict) -> "Completion":
        """Inverse of ``to_dict``."""
        return cls(int(d["job_id"]), [bool(x) for x in d["ok"]], [bool(x) for x in d.get("corrupt", [])],
                   int(d.get("nbytes", 0)), float(d.get("seconds", 0.0)), str(d.get("error", "")),
                   [bool(x) for x in d.get("missing", [])])


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
