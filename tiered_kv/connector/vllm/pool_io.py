"""A vLLM worker's side of a host pool (``cpu_pool``): stores into reserved pool slots, loads from leased ones.

With ``cpu_pool`` the rank's CPU tier is a ``PoolTier``: its ``slab`` has the shape of a private CPU slab, so the
copy path (``BlockCopier``, ``InStepLoader``, ``AsyncLoader``) works on it as is; only the slot numbers come from
the pool's index instead of the planner (which plans the pool as a keyed, governed tier: its jobs carry no slots).

- A store (``INGRESS``, on the front mover thread): ``reserve`` the job's keys (one write txn; the pool evicts by
  its budget's rules and names what it evicted), copy the GPU blocks into the reserved rows, say the job is done
  with GPU memory (a fence waits for no more: ``publish``'s checksums take ~8x the copy's time, 6-7 GB/s on one
  core against ~50 GB/s over PCIe), ``publish`` the rows written (one write txn) and give back the rest. A key
  the pool holds already (another replica stored it first) is done without a copy; one it refuses (every slot it
  may take is leased) fails. The evicted keys go back to the planner in the job's report (``JobReport.evicted``).
- A load (``EGRESS`` from the pool: in-step, asynchronous or on the front mover): ``lease`` the job's keys in
  ``WorkerRuntime.before_forward`` (one write txn per job, before anything is copied), copy from the leased
  slots, and ``done`` releases the lease once the copy landed. A key whose record is gone (another process's
  write evicted it since the planner's lookup) fails its item as ``missing``: its GPU blocks are reported as
  load errors and vLLM recomputes them, and the planner forgets that copy. No lease is taken without a
  ``done``; a job none of whose keys are held is completed at once (``lease`` hands it to ``failed``).

Leases are taken with ``verify=False``: no checksum pass over the bytes on vLLM's thread (the private CPU tier
makes none either). The pool's protocol already rules out a torn read (a record is committed only after its
bytes are written, a leased slot is never reused); the checksums guard against a process that scribbles on
the shared pages, outside that protocol. ``publish`` computes them, on the mover thread.

Threading contract: ``lease`` and ``done`` run on vLLM's worker thread (``done`` also on a mover thread), ``slots``
on either, ``store`` on the front mover thread; the table of leases is guarded by a lock of its own. The LMDB
transactions of ``lease`` and of the release in ``done`` (``/dev/shm``: memory, no disk I/O) are the only work a
pool adds on vLLM's thread.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from tiered_kv.values.jobs import Completion, JobKind, TransferJob
from tiered_kv.connector.vllm.common import CPU

if TYPE_CHECKING:  # the pool needs lmdb, imported by whoever opens one
    from tiered_kv.tiers.pool import PoolLease, PoolTier

log = logging.getLogger(__name__)


class PoolIO:
    """One rank's reservations and leases in its host pool ``pool`` (see the module); counts in ``counters``
    (``WorkerCounters``: ``pool_load_misses``, ``failed_items``) under ``lock``."""

    def __init__(self, pool: PoolTier, counters, lock: threading.Lock) -> None:
        self.pool = pool
        self.counters = counters
        self._counter_lock = lock
        self._lock = threading.Lock()
        self._leases: dict[int, PoolLease] = {}  # load job id -> its lease, until ``done``

    # ------------------------------------------------------------------ loads
    def lease(self, jobs: list[TransferJob], failed: Callable[[TransferJob, Completion], None]) -> list[TransferJob]:
        """Lease the records of every load from the pool among ``jobs``; returns ``jobs`` less the loads none of
        whose keys is held, which go to ``failed`` at once (with a completion ``done`` turns into every item
        missing)."""
        out: list[TransferJob] = []
        for job in jobs:
            if job.kind is not JobKind.EGRESS or job.src_tier != CPU:
                out.append(job)
                continue
            lease = self.pool.lease(job.keys, verify=False)
            with self._lock:
                self._leases[job.job_id] = lease
            if any(s >= 0 for s in lease.slots):
                out.append(job)
            else:
                n = len(job)
                failed(job, Completion(job.job_id, [True] * n, [False] * n))
        return out

    def slots(self, job: TransferJob) -> tuple[list[int], list[int]]:
        """``(slot per item, items held)`` of a leased load: the pool slot of each item (-1: missed)."""
        with self._lock:
            slots = self._leases[job.job_id].slots
        return slots, [i for i, s in enumerate(slots) if s >= 0]

    def done(self, job: TransferJob, c: Completion) -> Completion:
        """A job finished: release its lease (a load's bytes have landed) and fail the items its lease missed (as
        ``missing``: the pool no longer held them). Other jobs' completions pass unchanged."""
        with self._lock:
            lease = self._leases.pop(job.job_id, None)
        if lease is None:
            return c
        n = len(job)
        hit = [s >= 0 for s in lease.slots]
        self.pool.release(lease, [k for k, h, ok in zip(job.keys, hit, c.ok) if h and ok])
        if all(hit):
            return c
        misses = n - sum(hit)
        with self._counter_lock:
            self.counters.pool_load_misses += misses
            self.counters.failed_items += sum(1 for h, ok in zip(hit, c.ok) if ok and not h)
        log.debug("job %d: %d of %d chunks gone from the host pool before their load", job.job_id, misses, n)
        missing = [not h or (i < len(c.missing) and c.missing[i]) for i, h in enumerate(hit)]
        return Completion(c.job_id, [ok and h for ok, h in zip(c.ok, hit)], list(c.corrupt) or [False] * n,
                          c.nbytes, c.seconds, c.error, missing, list(c.evicted))

    # ------------------------------------------------------------------ stores
    def store(self, job: TransferJob, copy: Callable[[list[int], list[int]], int],
              copied: Callable[[], None] | None = None) -> tuple[list[bool], int, list[bytes]]:
        """Store ``job``'s items: reserve pool slots, ``copy(slots, items)`` the GPU blocks of ``items`` into them
        (returns the bytes copied, once they landed), call ``copied()`` (the job is done with GPU memory: a fence
        need not wait for the rest), publish (the rows' checksums and one write txn). Returns ``(ok per item,
        bytes copied, keys the pool evicted)``; a copy that fails publishes nothing (the slots go back) and fails
        the items it was to write."""
        res = self.pool.reserve(job.keys)
        items = [i for i, v in enumerate(res.views) if v is not None]
        nbytes, written = 0, None
        if items:
            try:
                nbytes = copy(res.slots, items)
            except Exception as exc:  # noqa: BLE001 - the reservation must end in publish, whatever failed
                log.warning("store job %d into the host pool failed: %s", job.job_id, exc)
                written = [False] * len(job)
        if copied is not None:  # the GPU blocks are read (or the copy failed): nothing below touches them
            copied()
        return self.pool.publish(res, written), nbytes, res.evicted
