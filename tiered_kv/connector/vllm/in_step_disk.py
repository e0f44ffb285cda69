"""In-step disk loads under the forward (``disk_overlap_bytes``): a hit's disk part read layer group by layer group.

The split (``planner.split``, ``overlap=True``) may load the first ``m`` held tokens of a hit and recompute the rest
only if the load runs while the forward computes: layer i's bytes must be on the GPU when layer i's attention runs,
no sooner. So a disk chunk of such a hit (``StepPlan.sync`` holds its job, like a CPU hit's) goes here, not to the
front mover:

- ``start(job, parts_of)``: its records get a row each in a pinned staging slab (``disk_overlap_bytes`` of whole
  record images, slot-row format), are leased (``DiskTier.open_ranges``), and reader threads begin at once: layer
  group 0's byte range of every block of every record of the step, then group 1's, ... (the groups are
  ``config.overlap_spans``: at most ``OVERLAP_GROUPS`` equal ones), each range one positional read (O_DIRECT where
  the file system allows; through Linux AIO, ``tiers/disk/aio.py``, for the disk tier), the next group's reads
  queued behind this one's (no drain at a group's end); the remote tier's as one ``GETRANGE`` exchange per group
  (``RemoteRangeReads.read_group``: one pipelined round trip per node for every record's ranges), on one thread.
  AIO reads go on one lane (one ``AioReader``, one thread), or, where the disk tier's file is on a memory file
  system (``SlotFile.memory_fs``: tmpfs, where ``io_submit`` itself copies each read), on ``AIO_LANES_MEMORY_FS``
  lanes at once, the requests dealt in turn so that every lane reads its part of group 0 before group 1, one
  group's share a submit (a submit returns only once its reads are copied there); a group is read once every lane
  has read its part of it. On a disk the one lane submits as many reads as the depth has room for (each submit
  costs a wait for the GIL beside vLLM's busy thread: ``tiers/disk/aio.py``);
- ``submit``: this loader's own ``InStepLoader`` over the staging plane, pipelined with nothing submitted ahead,
  so it hands the driver a layer group's copy only when the forward reaches that group's first layer
  (``wait_layer``), and first waits (on the CPU, ``ready``) until the readers have that group's bytes: vLLM's
  thread stops launching there while the GPU still runs the layers launched before; then the engine's stream
  waits, on the GPU, for that group's copy;
- ``finish`` (the step's ``poll``): the copies land, every record is verified whole against its header's
  checksum, and each job's ``Completion`` says which chunks were good: a bad or vanished record fails its
  chunk's GPU blocks in this very step, so vLLM discards the step's output for them and recomputes (one KV cache
  group: vLLM takes block errors), as for any failed in-step load. Damaged records are dropped;
- ``adopt``: the step's promotions of those records to the CPU tier (``promote_on_hit``) are served from the
  verified staging images (a reader thread copies each into its CPU slot) instead of a second disk read that would
  compete with these.

Threading contract: ``start``, ``adopt``, ``submit``, ``wait_layer``, ``finish`` and ``busy`` on vLLM's worker
thread, ``close`` once after the last ``finish``; the reads on this loader's step thread (through AIO: lane 0 there,
the other lanes each on a reader thread with an ``AioReader`` of its own, made once and kept for every step) or its
reader threads, which touch only the staging rows of the step's records, the CPU slots of its adopted promotions
(reserved for them by the planner) and the step's progress (``left``, ``read_upto``: under ``_cond``, from any of
these threads).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import lmdb
import torch

from tiered_kv.copy import KVLayout, allocate_slab
from tiered_kv.errors import StoreClosedError
from tiered_kv.values.jobs import Completion, JobKind, TransferJob
from tiered_kv.connector.vllm.common import CPU
from tiered_kv.connector.vllm.config import OVERLAP_GROUPS, ConnectorConfig, overlap_possible, overlap_spans
from tiered_kv.connector.vllm.in_step import InStepLoader
from tiered_kv.connector.vllm.runner import WorkerCounters
from tiered_kv.tiers.cpu import aligned_empty
from tiered_kv.tiers.disk import DiskTier
from tiered_kv.tiers.disk.aio import AioReader, aio_available

log = logging.getLogger(__name__)

#: Reads in flight at once through Linux AIO (``tiers.disk.aio``: the disk tier's O_DIRECT reads), per lane
AIO_DEPTH = 128
#: AIO lanes (an ``AioReader`` on a thread each) where the disk tier's file is on a memory file system; elsewhere
#: one. There ``io_submit`` copies each read on the submitting thread, so a lane reads at one core's speed:
#: 2026-11-30, CPU box, 2 cores, from /dev/shm: 3.6 GB/s with 1 lane, 6.3 with 2 (idle); beside a spinning Python
#: thread (vLLM's, launching the forward) 1.74 / 2.47 / 3.74 GB/s with 1 / 2 / 4; the H200 host (16 cores) read
#: 2.4 GB/s with one. Half the cores (at least 2) leaves the rest to vLLM's thread and the copy's submitter; at
#: most 8, past which the copies share the memory bus more than they add cores.
AIO_LANES_MEMORY_FS = min(8, max(2, (os.cpu_count() or 2) // 2))
#: Fewest reads a lane submits at once on a memory file system: each submit costs the lane a wait for the GIL beside
#: vLLM's busy thread (up to its 5 ms switch interval; ``tiers/disk/aio.py`` has the numbers)
AIO_MIN_SUBMIT = 16
#: Without AIO (a remote tier; a buffered disk file): reads in flight at once, per rank (reader threads), and
#: block ranges per read task: the queue is kept full
#: across layer groups (a group's tasks are queued behind the previous group's, not after it drains). The GPU
#: machine's virtio disk reads 256 KiB ranges at about a quarter of its rate with 8 in flight (0.56 vs 2.0 GB/s,
#: 2026-11-29); docs/notes/2026-11-29-gpu-round4.md has the sweep behind these numbers.
READERS = 32
RANGES_PER_TASK = 4


def overlap_loader(cfg: ConnectorConfig, geo, kvs: Sequence[KVLayout], rank: int, runner,
                   cuda: bool) -> "InStepDiskLoader | None":
    """The rank's ``InStepDiskLoader`` (``WorkerRuntime.register``) over its keyed tiers (``runner.keyed``: the disk
    tier, the remote tier), or None where ``overlap_possible`` says no."""
    why = overlap_possible(cfg, len(kvs), geo.rank_chunk_nbytes)
    if why is not None or not runner.keyed:
        if cfg.disk_overlap_bytes:
            log.warning("TieredKVConnector rank %d: disk_overlap_bytes is set but disk and remote hits are not read "
                        "under the forward here: %s", rank, why or "no disk or remote tier")
        return None
    return InStepDiskLoader(kvs[0], geo.groups[0].layer_names, cfg, rank, runner.keyed, geo.rank_chunk_nbytes,
                            geo.chunk_blocks, runner.flat, cuda, runner.cpu.slab, runner.counters)


@dataclass
class _StepReads:
    """What the readers do for one step: the records (job, item, staging row), the leases, the progress."""

    records: list[tuple[int, int, int]]  # (index into ``jobs``, item, staging slot)
    jobs: list[TransferJob]
    reads: list  # one ``RangeReads`` per job
    spans: list[tuple[int, int]]
    read_upto: int = 0  # tensors whose bytes every record has (a span's end, once all of its ranges are read)
    groups_read: int = 0  # leading spans whose every range is read
    left: list[int] = field(default_factory=list)  # read tasks not yet done, per span
    read_s: float = 0.0  # from the first read to the last (the verification not included)
    promote: dict[bytes, int] = field(default_factory=dict)  # key -> CPU slot its verified image goes to
    good: list[bool] = field(default_factory=list)  # per record, after the verification
    failed: BaseException | None = None
    done: bool = False


class InStepDiskLoader:
    """One TP rank's overlapped in-step disk loads (see the module)."""

    def __init__(self, kv: KVLayout, layer_names: Sequence[str], cfg: ConnectorConfig, rank: int, tiers: dict,
                 chunk_nbytes: int, chunk_blocks: int, flat: Callable, pin: bool, cpu_slab: torch.Tensor,
                 counters=None) -> None:
        """``tiers``: the rank's keyed tiers by chain index (``DiskTier``, ``RemoteTier``: each has ``open_ranges``);
        ``flat(job, slots, items)``: ``JobRunner.flat`` (GPU blocks and plane
        rows of a job's items in given slots); ``cpu_slab``: the CPU tier's slab (chunk rows), for ``adopt``;
        ``counters``: the rank's ``WorkerCounters`` (``overlap_*``; None: a private set)."""
        self.kv, self.rank, self.tiers = kv, rank, dict(tiers)
        self.k, self.chunk_nbytes = chunk_blocks, chunk_nbytes
        self.capacity = cfg.disk_overlap_bytes // chunk_nbytes
        # page-aligned rows either way (cudaHostAlloc's are): O_DIRECT and AIO read straight into them
        self.staging = allocate_slab(self.capacity, chunk_nbytes, pin=True) if pin else \
            aligned_empty(self.capacity, chunk_nbytes)
        self.plane = self.staging.view(self.capacity * chunk_blocks, chunk_nbytes // chunk_blocks)
        # pipelined with OVERLAP_GROUPS groups: it copies the groups ``overlap_spans`` reads
        self.loader = InStepLoader([(kv, self.plane, layer_names)], cfg, rank, pipeline=(OVERLAP_GROUPS, 0))
        self.loader.span_ready = self.ready
        self._flat = flat
        self._cpu_slab = cpu_slab
        self._adopted: list[TransferJob] = []  # this step's promotions of the records read here (``adopt``)
        # byte offset of tensor t's part inside a block of the slot format (tensors in order)
        self._offsets = [0]
        for m in kv.maps:
            self._offsets.append(self._offsets[-1] + m.nbytes)
        self._pool = ThreadPoolExecutor(READERS, thread_name_prefix=f"tkv-overlap-r{rank}")
        # chain index -> whether that disk tier's file is in memory (its AIO reads then go on several lanes)
        # (only an O_DIRECT file reads through AIO at all: a buffered one goes to the reader threads)
        self._memory_fs = {t: isinstance(tier, DiskTier) and tier.slots.memory_fs and tier.slots.direct
                           for t, tier in self.tiers.items()}
        self._lanes = self._aio_lanes(cfg.disk_overlap_aio and aio_available(), any(self._memory_fs.values()))
        self._cond = threading.Condition()
        self._step: _StepReads | None = None
        self._pending: list[tuple[TransferJob, list[int]]] = []  # (job, staging slot per item) started this step
        self._next_slot = 0
        self.counters = counters if counters is not None else WorkerCounters()

    @property
    def busy(self) -> bool:
        """Loads started and not finished (``finish`` is due)."""
        return bool(self._pending) or self._step is not None

    def start(self, job: TransferJob) -> None:
        """Take one in-step load whose items are disk records (``before_forward``); its reads begin at ``submit``.
        Items beyond the staging's room fail (the planner keeps within it)."""
        n = len(job)
        room = max(0, min(n, self.capacity - self._next_slot))
        slots = list(range(self._next_slot, self._next_slot + room)) + [-1] * (n - room)
        self._next_slot += room
        self._pending.append((job, slots))
        if room < n:
            log.warning("TieredKVConnector rank %d: in-step disk load job %d has %d chunks, staging room for %d; "
                        "the rest fail and vLLM recomputes them", self.rank, job.job_id, n, room)

    def adopt(self, jobs: list[TransferJob], events: dict, lock) -> list[TransferJob]:
        """Take over this step's promotions (disk -> CPU tier, ``promote_on_hit``) of records this step's loads read
        anyway: ``finish`` copies their verified staging images into the CPU slots, so a record is read from disk
        once, and not while the forward waits for the overlapped reads. Registers each one's event in ``events``
        (under ``lock``), as the worker does for its jobs. Returns the other jobs."""
        staged = {key for job, slots in self._pending for key, slot in zip(job.keys, slots) if slot >= 0}
        rest = []
        for job in jobs:
            if job.kind is JobKind.PROMOTE and job.dst_tier == CPU and all(k in staged for k in job.keys):
                with lock:
                    events[job.job_id] = threading.Event()
                self._adopted.append(job)
            else:
                rest.append(job)
        return rest

    def submit(self, layerwise_ok: bool) -> int:
        """Start the reads of the loads ``start`` took, then submit their copies (the first group's once read).
        Returns the loads started."""
        if not self._pending or self._step is not None:  # nothing taken, or submitted already this step
            return 0
        jobs = [job for job, _ in self._pending]
        records = [(j, i, slot) for j, (_, slots) in enumerate(self._pending) for i, slot in enumerate(slots)
                   if slot >= 0]
        spans = overlap_spans(len(self.kv.tensors)) if layerwise_ok else [(0, len(self.kv.tensors))]
        reads = []
        for job in jobs:
            try:
                reads.append(self.tiers[job.src_tier].open_ranges(job.keys))
            except (lmdb.Error, OSError, StoreClosedError, KeyError) as exc:  # its chunks fail; vLLM recomputes them
                log.warning("TieredKVConnector rank %d: in-step load job %d cannot read tier %d: %r",
                            self.rank, job.job_id, job.src_tier, exc)
                reads.append(None)
        records = [r for r in records if reads[r[0]] is not None]
        step = self._step = _StepReads(records, jobs, reads, spans,
                                       promote={k: d for job in self._adopted for k, d in zip(job.keys, job.dst_slots)})
        threading.Thread(target=self._read_all, args=(step,), name=f"tkv-overlap-step-r{self.rank}",
                         daemon=True).start()
        for (job, slots) in self._pending:
            items = [i for i, s in enumerate(slots) if s >= 0]
            self.loader.start(job, self._flat(job, slots, items))
        self.counters.overlap_loads += len(jobs)
        started, _ = self.loader.submit(layerwise_ok, None)
        return started

    def wait_layer(self, layer_name: str) -> None:
        """``wait_for_layer_load``: this layer's group, read and copied, before the layer runs on the GPU."""
        if self.loader.busy:
            self.loader.wait_layer(layer_name)

    def ready(self, upto: int) -> None:
        """Block until the readers have tensors ``[0, upto)`` of every record of the step (the copy's span hook)."""
        step = self._step
        if step is None:
            return
        t0 = time.perf_counter()
        with self._cond:
            while step.read_upto < upto and not step.done:
                self._cond.wait()
        self.counters.overlap_wait_seconds += time.perf_counter() - t0

    def finish(self) -> list[tuple[TransferJob, Completion]]:
        """The step's copies landed and its records verified: each job's ``Completion`` (a bad, vanished or
        unstaged record fails its item)."""
        if not self.busy:
            return []
        copied = {job.job_id: c for job, c in self.loader.finish()}
        if self.loader._cuda and any(not all(c.ok) for c in copied.values()):
            # a failed copy's earlier groups may still read the staging: let them end before rows are reused
            torch.cuda.synchronize(self.kv.device)
        step, self._step = self._step, None
        pending, self._pending, self._next_slot = self._pending, [], 0
        with self._cond:
            while not step.done:
                self._cond.wait()
        good = {(j, i) for (j, i, _), ok in zip(step.records, step.good) if ok}
        share = step.read_s / max(1, len(step.records))  # a job's part of the step's reads, by its records
        out = []
        for j, (job, slots) in enumerate(pending):
            c = copied.get(job.job_id)
            n = len(job)
            ok = [bool(c is not None and c.ok and all(c.ok)) and (j, i) in good for i in range(n)]
            reads = step.reads[j]
            corrupt = [reads is not None and reads.corrupt(i) for i in range(n)]
            missing = [reads is not None and reads.missing[i] for i in range(n)]
            # seconds: its records' share of the step's reads (they ran together): the disk's rate for the split
            secs = share * sum(1 for s_ in slots if s_ >= 0)
            out.append((job, Completion(job.job_id, ok, corrupt, sum(ok) * self.chunk_nbytes, secs, missing=missing)))
        verified = {pending[j][0].keys[i] for (j, i, _), ok in zip(step.records, step.good) if ok}
        adopted, self._adopted = self._adopted, []
        for job in adopted:  # the readers copied each verified image into its CPU slot: no second disk read
            ok = [key in verified for key in job.keys]
            out.append((job, Completion(job.job_id, ok, [False] * len(job), 0, 0.0)))  # no bytes read for it
            self.counters.overlap_promotions += 1
        self.counters.overlap_read_seconds += step.read_s
        for r in step.reads:
            if r is not None:
                r.close()
        if step.failed is not None:
            log.warning("TieredKVConnector rank %d: overlapped disk reads failed: %s", self.rank, step.failed)
        return out

    def close(self) -> None:
        """Stop the reader threads and the staging copier's, close the AIO lanes (after a step's ``finish``)."""
        self._pool.shutdown(wait=True)
        for lane in self._lanes:
            lane.close()
        for copier in self.loader.copiers:
            copier.close()

    # ------------------------------------------------------------------ reader threads
    def _read_all(self, step: _StepReads) -> None:
        """Every record's ranges, group by group in queue order (``RANGES_PER_TASK`` blocks' ranges of one record
        a task, ``READERS`` tasks at once, the next group's queued behind this one's so the disk never idles at
        a group's end); ``ready`` wakes as each group completes; then every record is verified."""
        try:
            off, k, bn = self._offsets, self.k, self.chunk_nbytes // self.k
            t0 = time.perf_counter()
            grouped = self._read_groups(step)  # the remote tier: no per-task list to build
            # a task: (group, job, item, staging slot, the byte ranges of its blocks in the record)
            tasks = [] if grouped else [(g, j, i, slot, [(blk * bn + off[a], blk * bn + off[b])
                                                         for blk in range(b0, min(k, b0 + RANGES_PER_TASK))])
                                        for g, (a, b) in enumerate(step.spans) for j, i, slot in step.records
                                        for b0 in range(0, k, RANGES_PER_TASK)]
            if not grouped and not self._read_aio(step, tasks):
                self._expect(step, (t[0] for t in tasks))
                futures = [self._pool.submit(self._read_ranges, step, *t) for t in tasks]
                wait(futures)
                errors = [f.exception() for f in futures if f.exception() is not None]
                if errors:
                    raise errors[0]
            step.read_s = time.perf_counter() - t0
            checks = [self._pool.submit(self._verify, step, j, i, slot) for j, i, slot in step.records]
            step.good = [f.result() for f in checks]
        except BaseException as exc:  # noqa: BLE001 - a reader must wake the forward whatever happened
            step.failed = exc
            step.good = [False] * len(step.records)
        finally:
            with self._cond:
                step.done = True
                self._cond.notify_all()

    def _aio_lanes(self, aio: bool, memory_fs: bool) -> list[AioReader]:
        """The AIO readers, made once: none without AIO, one, or ``AIO_LANES_MEMORY_FS`` where a disk tier's file
        is in memory (as many as the kernel grants past the first: ``/proc/sys/fs/aio-max-nr`` is shared)."""
        if not aio:
            return []
        lanes = [AioReader(AIO_DEPTH)]
        while memory_fs and len(lanes) < AIO_LANES_MEMORY_FS:
            try:
                lanes.append(AioReader(AIO_DEPTH))
            except OSError as exc:
                log.warning("TieredKVConnector rank %d: %d AIO lanes of %d for the in-memory disk tier: %s",
                            self.rank, len(lanes), AIO_LANES_MEMORY_FS, exc)
                break
        if len(lanes) > 1:
            log.info("TieredKVConnector rank %d: the disk tier's file is on a memory file system: in-step reads "
                     "on %d AIO lanes", self.rank, len(lanes))
        return lanes

    def _read_aio(self, step: _StepReads, tasks: list) -> bool:
        """The step's reads through Linux AIO (``tiers.disk.aio``), in the tasks' order, on this thread and, for a
        disk tier in memory, the other lanes' reader threads: False, having read nothing, where some range cannot
        go that way (a remote tier, a buffered disk file); the threads read them then."""
        if not self._lanes:
            return False
        reqs, owner = [], []  # owner[n]: (group, job, item, nbytes) of request n
        for g, j, i, slot, ranges in tasks:
            reads = step.reads[j]
            got = reads.requests(i, ranges, self.staging[slot]) if hasattr(reads, "requests") else None
            if got is None:
                return False
            reqs.extend(got)
            owner.extend((g, j, i, r[2]) for r in got)
        self._expect(step, (g for g, *_ in owner))

        def done(n: int, result: int) -> None:
            g, j, i, nbytes = owner[n]
            step.reads[j].landed(i, result, nbytes)
            with self._cond:  # lanes finish reads of one group on several threads
                step.left[g] -= 1
                last = step.left[g] == 0
            if last:
                self._advance(step)

        in_memory = all(self._memory_fs.get(step.jobs[j].src_tier, False) for j in {j for _, j, _, _ in owner})
        if in_memory:
            self._run_lanes(self._lanes, reqs, done, len(step.spans))
        else:  # a disk: each submit only queues its reads; every free slot at once, as few GIL waits as can be
            self._run_lanes(self._lanes[:1], reqs, done, 0)
        self.counters.overlap_aio_reads += len(reqs)
        return True

    def _run_lanes(self, lanes: list[AioReader], reqs: list, done: Callable[[int, int], None], groups: int) -> None:
        """Request n on lane ``n % len(lanes)`` (each lane's part in the requests' order, so group by group): lane 0
        on this thread, the others on reader threads; ``done(n, result)`` from each. A lane submits one layer
        group's share of its reads at a time (``groups``: the step's; at least ``AIO_MIN_SUBMIT``), so on a memory
        file system group g is read after g + 1 submits while a lane's share of a group fits its depth; 0: the whole
        depth at once. Returns once every lane's reads ended, also when one failed (then raises a failed lane's
        error, lane 0's first): no read is left writing into staging."""
        count = len(lanes)
        batch = max(AIO_MIN_SUBMIT, -(-len(reqs) // (count * groups))) if groups else AIO_DEPTH
        futures = []
        try:
            for k in range(1, count):
                futures.append(self._pool.submit(lanes[k].run, reqs[k::count],
                                                 lambda i, res, k=k: done(k + i * count, res), batch))
            lanes[0].run(reqs[0::count], lambda i, res: done(i * count, res), batch)
        finally:
            wait(futures)
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            raise errors[0]

    def _read_groups(self, step: _StepReads) -> bool:
        """The step's reads as one exchange per layer group and job over every record's ranges of that group
        (``RemoteRangeReads.read_group``), group by group on this thread: False, having read nothing, where a job's
        reads cannot (a disk tier without AIO). Loopback Redis (2026-11-30, ``benchmarks/probes/remote_ranges.py``):
        idle 2.31 GB/s against 0.66 with 32 reader threads on the H200 host; beside a spinning Python thread (an
        uncompiled forward's launch) 0.18 GB/s on the CPU box since the client gives up the GIL a few times an
        exchange (``tiers.remote.client._Wire``), against 0.01 reply by reply."""
        if not all(hasattr(r, "read_group") for r in step.reads if r is not None):
            return False
        off, bn = self._offsets, self.chunk_nbytes // self.k
        per_job: dict[int, tuple[list[int], list[torch.Tensor]]] = {}  # job -> (its items, their staging rows)
        for j, i, slot in step.records:
            items, rows = per_job.setdefault(j, ([], []))
            items.append(i)
            rows.append(self.staging[slot])
        self._expect(step, range(len(step.spans)))  # one unit of work per group
        for g, (a, b) in enumerate(step.spans):
            ranges = [(blk * bn + off[a], blk * bn + off[b]) for blk in range(self.k)]
            try:
                for j, (items, rows) in per_job.items():
                    step.reads[j].read_group(items, ranges, rows)
                    self.counters.overlap_group_reads += 1
            finally:
                with self._cond:
                    step.left[g] = 0
                self._advance(step)
        return True

    def _expect(self, step: _StepReads, groups) -> None:
        """Count the reads (or read tasks) still due per layer group, one per item of ``groups`` (its group), and
        mark complete at once any leading group that has none (a span with no records)."""
        step.left = [0] * len(step.spans)
        for g in groups:
            step.left[g] += 1
        self._advance(step)

    def _advance(self, step: _StepReads) -> None:
        """Move ``read_upto`` past every leading group whose reads are all done, and wake ``ready``."""
        with self._cond:
            g = step.groups_read
            while g < len(step.spans) and step.left[g] == 0:
                g += 1
            if g > step.groups_read:
                step.groups_read, step.read_upto = g, step.spans[g - 1][1]
                self._cond.notify_all()

    def _verify(self, step: _StepReads, j: int, i: int, slot: int) -> bool:
        """Record ``(j, i)``'s image against its header; a verified one adopted for promotion is copied into its
        CPU slot here, on a reader thread (not on vLLM's thread in ``finish``)."""
        image = self.staging[slot]
        if not step.reads[j].verify(i, image):
            return False
        dst = step.promote.get(step.jobs[j].keys[i])
        if dst is not None:
            self._cpu_slab[dst].copy_(image)
        return True

    def _read_ranges(self, step: _StepReads, g: int, j: int, i: int, slot: int, ranges: list[tuple[int, int]]) -> None:
        """Byte ``ranges`` of record ``(j, i)`` into its staging row (group ``g``'s part of some of its blocks); a
        failed read marks the record damaged (``RangeReads``) and still counts the task done."""
        try:
            step.reads[j].read_many(i, ranges, self.staging[slot])
        finally:
            with self._cond:
                step.left[g] -= 1
            self._advance(step)
