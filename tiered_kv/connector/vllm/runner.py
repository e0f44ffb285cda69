"""Mover side of a vLLM worker rank: one job of the plan, run against the rank's tiers and copiers.

``JobRunner.execute`` is what the rank's movers run (``WorkerRuntime`` makes them): the GPU edge's "front"
mover (one thread; every ``BlockCopier`` call of a mover job happens on it) and the keyed edge's
``disk_workers`` + ``remote_workers`` threads:

- ``INGRESS`` (a store): GPU blocks -> CPU slots, each group's blocks into its plane's rows (a host pool: slots
  the pool reserves, ``pool_io.PoolIO.store``);
- ``EGRESS`` (a load): CPU slots -> GPU blocks (a host pool: the slots leased for the job, ``load_rows``), or disk
  / remote records read into a small staging slab a few chunks at a time and loaded from there;
- ``DEMOTE`` / ``COPY_DOWN``: CPU slots -> disk or remote records; ``PROMOTE``: records -> CPU slots (or
  another keyed tier); ``DELETE``.

Ordering on CUDA: a job's copy runs on the runner's side stream after the CUDA event ``WorkerRuntime``
recorded for it (a store: at ``after_forward``, so the KV it reads has been written; a load: at
``before_forward``'s submission point, after vLLM's block zeroing). A store first waits on the mover until the
next step began (``store_gate.py``) and then also after the event recorded there, so its copy does not delay the
sampler's copy of the tokens to the host. A store a fence cancelled before its
copy began fails whole (nothing written). Several KV cache groups: a batched copy that cannot start or
finish is retried as a plain torch copy (vLLM takes no per-block load errors then). Replicated caches
(MLA): only rank 0 writes host and disk copies; the other ranks acknowledge those jobs at once.

Threading contract: ``execute`` runs on mover threads (several at once on the keyed edge); ``flat`` and
``count`` also on vLLM's worker thread. The tables shared with that thread (``ext``, ``cuda_events``,
``queued_stores``, ``cancelled``) and the counters are guarded by ``lock`` (``WorkerRuntime``'s). ``bind``
runs once, on vLLM's thread, before any job.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tiered_kv.copy import BackendUnavailableError, BlockCopier, CopyLaunchError, Mechanism
from tiered_kv.errors import ConfigError
from tiered_kv.values.jobs import Completion, JobKind, TransferJob
from tiered_kv.values.layout import BlockLayout
from tiered_kv.connector.vllm.common import CPU
from tiered_kv.connector.vllm.geometry import Geometry
from tiered_kv.connector.vllm.store_gate import StoreGate, order_after

if TYPE_CHECKING:
    from tiered_kv.connector.vllm.pool_io import PoolIO
    from tiered_kv.tiers.disk import DiskTier
    from tiered_kv.tiers.remote import RemoteTier

log = logging.getLogger(__name__)

#: What a batched copy raises when it cannot start or finish (several groups: retried as a plain copy)
_COPY_ERRORS = (BackendUnavailableError, CopyLaunchError, RuntimeError)


@dataclass
class WorkerCounters:
    """Bytes and seconds moved by this rank since start (monotonic)."""

    bytes_loaded: int = 0
    bytes_stored: int = 0
    bytes_to_disk: int = 0
    bytes_from_disk: int = 0
    bytes_to_remote: int = 0
    bytes_from_remote: int = 0
    load_seconds: float = 0.0
    store_seconds: float = 0.0
    failed_items: int = 0
    corrupt_items: int = 0
    fences_waited: int = 0
    fence_wait_seconds: float = 0.0  # vLLM's thread in fences (re-used blocks whose store or load had not finished)
    stores_cancelled: int = 0
    sync_loads: int = 0
    sync_load_groups: int = 0
    sync_staged_copies: int = 0  # in-step merged copies (one per KV cache group and step) that went staged
    sync_sm_copies: int = 0  # in-step merged copies that went through the SM kernel (forced or ``auto``)
    async_loads: int = 0  # asynchronous CPU-tier loads submitted through the AsyncLoader
    async_batches: int = 0  # steps that submitted such loads (one submission each)
    plain_copy_fallbacks: int = 0  # several groups: batched copies retried as plain torch copies
    acked_for_rank0: int = 0  # replicated caches: jobs rank 0 runs for every rank, acknowledged here
    pool_load_misses: int = 0  # host pool: chunks a load found gone (another process's write evicted them)
    idle_waits: int = 0  # steps that computed nothing and waited for this rank's loads (GIL released: idle.py)
    idle_wait_seconds: float = 0.0  # their time waiting
    overlap_loads: int = 0  # in-step disk loads read under the forward (``disk_overlap_bytes``, in_step_disk.py)
    overlap_read_seconds: float = 0.0  # their reads, first to last range, summed over steps
    overlap_wait_seconds: float = 0.0  # vLLM's thread waiting for a layer group's bytes to come off the disk
    overlap_aio_reads: int = 0  # their range reads that went through Linux AIO (tiers/disk/aio.py)
    overlap_group_reads: int = 0  # their layer groups read in one exchange per job (the remote tier's read_group)
    overlap_promotions: int = 0  # promotions to the CPU tier served from the staged images (no second disk read)
    stores_held_opened: int = 0  # stores held on the mover until the next step began (store_gate.py)
    stores_held_timed_out: int = 0  # held stores that went with no next step in time (an idle engine)
    stores_dropped_after_failed_load: int = 0  # store jobs of steps whose in-step loads failed (worker_loads.py)
    mover_cpu_seconds: float = 0.0  # the movers' threads' CPU time running jobs (stores, loads, tier moves), less
    # their waits for copies to land (CUDA spins there, GIL released): time the GIL may have been taken from vLLM's
    # thread
    store_cpu_seconds: float = 0.0  # of it, the stores' (GPU -> CPU tier)
    layer_submit_seconds: float = 0.0  # vLLM's thread in wait_for_layer_load submitting in-step layer groups (and
    # waiting for an overlapped disk load's bytes)


class JobRunner:
    """Runs one rank's jobs on its tiers and copiers (see the module)."""

    def __init__(self, geo: Geometry, rank: int, layout: BlockLayout, cpu, keyed: dict[int, DiskTier | RemoteTier],
                 disk: DiskTier | None, writes_copies: bool, counters: WorkerCounters, lock: threading.Lock,
                 pool: PoolIO | None = None) -> None:
        self.geo, self.rank = geo, rank
        self.k = geo.slot_blocks  # GPU ids per job item
        self.sections = geo.sections
        self.plane_rows = geo.plane_rows  # block rows per slot in each group's plane
        self.layout = layout  # one row = one chunk of this rank's share
        self.cpu = cpu  # CpuTier, SharedSlab or PoolTier
        self.pool = pool  # with a host pool: its reservations and leases
        self._waits = threading.local()  # per mover thread: CPU seconds of this job's waits for copies to land, and a
        # store's gate event (``store_after``; the keyed edge's threads run other jobs meanwhile)
        self.keyed = keyed  # chain index -> keyed tier (disk, remote)
        self.disk = disk
        self.writes_copies = writes_copies
        self.counters = counters
        self.lock = lock
        self.ext: dict[int, list[int]] = {}  # job id -> its items' GPU block ids, k per item (-1 = skip)
        self.cuda_events: dict[int, object] = {}  # job id -> torch.cuda.Event the job must wait for
        self.queued_stores: dict[int, int] = {}  # store job -> items, submitted, GPU read not started
        self.cancelled: set[int] = set()  # queued store jobs a fence cancelled
        self.mechanism: Mechanism | None = None  # None: the copier chooses per call
        # job id -> None, called on the mover once a host-pool store's copy landed (before its publish)
        self.gpu_released: Callable[[int], None] | None = None
        self.copiers: list[BlockCopier] = []
        self.staging_copiers: list[BlockCopier] = []
        self._staging_rows: torch.Tensor | None = None
        self._device: torch.device | None = None  # vLLM's CUDA device (None: CPU tensors)
        self._dep_stream = None
        self.store_gate: StoreGate | None = None  # holds stores until the next step (``WorkerRuntime`` sets it)

    def bind(self, copiers: list[BlockCopier], staging_copiers: list[BlockCopier], staging_rows: torch.Tensor,
             device: torch.device | None) -> None:
        """The copiers of each group's plane of the CPU slab and of the staging slab (``register``)."""
        self.copiers, self.staging_copiers, self._staging_rows, self._device = (copiers, staging_copiers,
                                                                                staging_rows, device)

    def execute(self, job: TransferJob) -> Completion:
        """Run ``job`` (on a mover thread) and return its outcome."""
        t0, c0 = time.perf_counter(), time.thread_time()
        self._waits.cpu = 0.0
        self._waits.store_after = None  # a store's gate event, for its own copy only (``_wait_stream``)
        n = len(job)
        ok, corrupt = [True] * n, [False] * n
        kind = job.kind
        if kind is JobKind.INGRESS:
            with self.lock:
                cancelled = job.job_id in self.cancelled
                self.cancelled.discard(job.job_id)
                self.queued_stores.pop(job.job_id, None)  # from here on a fence waits for it
            if cancelled:
                if self.store_gate is not None:
                    self.store_gate.forget(job.job_id)
                return Completion(job.job_id, [False] * n, [False] * n, 0, time.perf_counter() - t0)
        if not self.writes_copies and kind is not JobKind.EGRESS:
            # replicated cache: rank 0 writes the one host/disk copy every rank reads; the planner
            # completes the job when rank 0's report (with the real outcome) arrives too
            with self.lock:
                self.counters.acked_for_rank0 += 1
            return Completion(job.job_id, ok, corrupt, 0, time.perf_counter() - t0)
        nbytes = None
        missing: list[bool] = []
        evicted: list[bytes] = []  # a shared disk directory's evictions for this job's writes
        src, dst = self.keyed.get(job.src_tier), self.keyed.get(job.dst_tier)
        if kind is JobKind.DELETE:
            (src if src is not None else self.cpu).delete(job.keys)  # a keyed tier, or a host pool
            return Completion(job.job_id, ok, corrupt)
        if kind is JobKind.INGRESS and self.store_gate is not None:  # wait for the next step (store_gate.py)
            with self.lock:
                forward = self.cuda_events.get(job.job_id)
            self._waits.store_after = self.store_gate.wait(job.job_id, forward)
        if kind is JobKind.INGRESS and self.pool is not None:
            released = self.gpu_released
            ok, nbytes, evicted = self.pool.store(job, lambda slots, items: self._copy(
                self.copiers, job, self.flat(job, slots, items), to_cpu=True),
                None if released is None else lambda: released(job.job_id))
        elif kind is JobKind.INGRESS:
            nbytes = self._copy(self.copiers, job, self.flat(job, job.dst_slots), to_cpu=True)
        elif kind is JobKind.EGRESS and job.src_tier == CPU:
            nbytes = self._copy(self.copiers, job, self.load_rows(job), to_cpu=False)
        elif kind is JobKind.EGRESS:
            ok, corrupt, missing, nbytes = self._keyed_to_gpu(job, src)
        elif job.src_tier == CPU and dst is not None:  # DEMOTE, COPY_DOWN (to disk or remote)
            # from the slab's rows themselves (the job holds its source slots); a host pool's rows are snapshotted
            # first, as other processes share its slots
            src_rows = (self.cpu.slab[job.src_slots] if self.pool is not None
                        else [self.cpu.slab[s] for s in job.src_slots])
            ok, evicted = dst.write_ex(job.keys, job.dst_slots, src_rows)
        elif src is not None and job.dst_tier == CPU and self.pool is None:
            # PROMOTE to the private CPU tier: straight into the slots the planner reserved for it (no reader
            # sees them before this job reports ok; a failed row leaves bytes nobody will read). A temporary
            # tensor cost a first touch of its pages plus a second copy: on a 2-core box 0.9-1.3 s of the
            # 208 MB of one gpt-oss prefix whose read takes ~0.1 s, all of it counted as the disk's read time.
            ok, corrupt, missing = src.read_ex(job.keys, job.src_slots, [self.cpu.slab[s] for s in job.dst_slots])
        elif src is not None:  # PROMOTE to a host pool, or a move between two keyed tiers
            rows = torch.empty((n, self.layout.nbytes), dtype=torch.uint8)
            ok, corrupt, missing = src.read_ex(job.keys, job.src_slots, rows)
            good = [i for i in range(n) if ok[i]]
            if good and job.dst_tier == CPU:
                self.cpu.slab[[job.dst_slots[i] for i in good]] = rows[good]
            elif good and dst is not None:
                written, evicted = dst.write_ex([job.keys[i] for i in good], [job.dst_slots[i] for i in good],
                                                rows[good])
                for i, w in zip(good, written):
                    ok[i] = w
            elif dst is None and job.dst_tier != CPU:
                raise ConfigError(f"job {job.job_id}: unexpected {kind.name} to tier {job.dst_tier}")
        else:
            raise ConfigError(f"job {job.job_id}: unexpected {kind.name} from tier {job.src_tier} to {job.dst_tier}")
        secs = time.perf_counter() - t0
        if nbytes is None:  # a whole record per item
            nbytes = sum(ok) * self.layout.nbytes
        log.debug("rank %d job %d %s %d->%d: %d items in %.1f ms (%.1f GB/s)", self.rank, job.job_id, kind.name,
                  job.src_tier, job.dst_tier, n, secs * 1e3, nbytes / secs / 1e9 if secs else 0.0)
        self.count(job, nbytes, secs, ok, corrupt, cpu=max(0.0, time.thread_time() - c0 - self._waits.cpu))
        return Completion(job.job_id, ok, corrupt, nbytes, secs, missing=missing, evicted=evicted)

    def load_rows(self, job: TransferJob) -> list[tuple[list[int], list[int]]]:
        """``flat`` of a load from the CPU tier: its planned slots, or with a host pool the slots leased for it (the
        items whose records were gone left out)."""
        if self.pool is None:
            return self.flat(job, job.src_slots)
        slots, items = self.pool.slots(job)
        return self.flat(job, slots, items)

    def flat(self, job: TransferJob, chunk_slots: list[int], items=None) -> list[tuple[list[int], list[int]]]:
        """Per group: GPU block ids and plane rows of ``job``'s items (all, or ``items``), skipping -1 blocks."""
        with self.lock:
            ext = self.ext[job.job_id]
        k = self.k
        sections = self.sections
        if len(sections) == 1:
            gpu: list[int] = []
            rows: list[int] = []
            for i in (range(len(job)) if items is None else items):
                base = chunk_slots[i] * k
                blocks = ext[i * k:(i + 1) * k]
                if blocks and min(blocks) >= 0:  # the common item: every block loaded (a C-speed scan, no loop)
                    gpu.extend(blocks)
                    rows.extend(range(base, base + len(blocks)))
                    continue
                for j, g in enumerate(blocks):
                    if g >= 0:
                        gpu.append(g)
                        rows.append(base + j)
            return [(gpu, rows)]
        out: list[tuple[list[int], list[int]]] = [([], []) for _ in sections]
        rows_per_slot = self.plane_rows
        for i in (range(len(job)) if items is None else items):
            pos = i * k
            slot = chunk_slots[i]
            for (gpu, rows), (blocks, _), per_slot in zip(out, sections, rows_per_slot):
                base = slot * per_slot
                for j, g in enumerate(ext[pos:pos + blocks]):
                    if g >= 0:
                        gpu.append(g)
                        rows.append(base + j)
                pos += blocks
        return out

    def _copy(self, copiers: list[BlockCopier], job: TransferJob, parts: list[tuple[list[int], list[int]]],
              to_cpu: bool) -> int:
        """Copy each group's blocks (``parts[g]`` = GPU ids, plane rows) and wait; returns the bytes moved."""
        stream = self._wait_stream(job)
        results = []
        nbytes = 0
        for copier, (gpu, rows) in zip(copiers, parts):
            if not gpu:
                continue
            nbytes += len(gpu) * copier.layout.block_nbytes
            src, dst = (gpu, rows) if to_cpu else (rows, gpu)
            try:
                results.append((copier, src, dst, self._start_copy(copier, src, dst, stream, to_cpu)))
            except _COPY_ERRORS as exc:
                if self.geo.block_level_errors:
                    raise
                self._plain_copy(copier, src, dst, to_cpu, exc)
        w0 = time.thread_time()
        for copier, src, dst, res in results:
            try:
                res.wait()
            except _COPY_ERRORS as exc:
                if self.geo.block_level_errors:
                    raise
                self._plain_copy(copier, src, dst, to_cpu, exc)
        # CUDA spins while a copy lands (GIL released): not the movers' Python time ``execute`` counts
        self._waits.cpu += time.thread_time() - w0  # execute set it to 0 for this job
        return nbytes

    def _start_copy(self, copier: BlockCopier, src: list[int], dst: list[int], stream, to_cpu: bool):
        copy = copier.gpu_to_cpu if to_cpu else copier.cpu_to_gpu
        try:
            return copy(src, dst, stream=stream, mechanism=self.mechanism)
        except BackendUnavailableError as exc:
            if self.mechanism is not None:
                raise
            # e.g. no cuda-python for the copy engine: the SM kernel (Triton, shipped with vLLM) still works
            log.warning("TieredKVConnector rank %d: %s; using the SM-kernel copy from now on", self.rank, exc)
            self.mechanism = Mechanism.SM_KERNEL
            return copy(src, dst, stream=stream, mechanism=self.mechanism)

    def _plain_copy(self, copier: BlockCopier, src: list[int], dst: list[int], to_cpu: bool, exc) -> None:
        """Several groups: redo a batched copy that failed as a plain torch copy (no per-block errors there)."""
        log.warning("TieredKVConnector rank %d: batched copy failed (%s); retrying it as a plain copy", self.rank, exc)
        with self.lock:
            self.counters.plain_copy_fallbacks += 1
        if to_cpu:
            copier.copy_plain(src, dst, to_cpu=True)
        else:
            copier.copy_plain(dst, src, to_cpu=False)

    def _wait_stream(self, job: TransferJob):
        if self._device is None:
            return None
        with self.lock:
            ev = self.cuda_events.get(job.job_id)
        if self._dep_stream is None:  # only the front mover thread gets here
            self._dep_stream = torch.cuda.Stream(device=self._device)
        stream = self._dep_stream
        if ev is not None:
            stream.wait_event(ev)
        after, self._waits.store_after = getattr(self._waits, "store_after", None), None
        if after is not None:
            order_after(stream, after)
        return stream

    def _keyed_to_gpu(self, job: TransferJob, tier) -> tuple[list[bool], list[bool], list[bool], int]:
        """Read records of a keyed tier (disk or remote) into the staging slab a few chunks at a time and load each
        batch into its GPU blocks; returns (ok, corrupt, missing, bytes)."""
        n = len(job)
        ok, corrupt, missing = [False] * n, [False] * n, [False] * n
        rows = self._staging_rows
        step = rows.shape[0]
        nbytes = 0
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            into = rows[:hi - lo]  # a record is a staging row
            part_ok, part_bad, part_gone = tier.read_ex(job.keys[lo:hi], job.src_slots[lo:hi], into)
            ok[lo:hi], corrupt[lo:hi], missing[lo:hi] = part_ok, part_bad, part_gone
            good = [lo + i for i in range(hi - lo) if part_ok[i]]
            if good:
                local = list(range(-lo, n - lo))  # staging row of item i is i - lo
                nbytes += self._copy(self.staging_copiers, job, self.flat(job, local, good), to_cpu=False)
        return ok, corrupt, missing, nbytes

    def count(self, job: TransferJob, nbytes: int, secs: float, ok: list[bool], corrupt: list[bool],
              cpu: float = 0.0) -> None:
        """Count a finished job's bytes, seconds and failed items; ``cpu``: the mover thread's CPU seconds on it
        (0 for the in-step loads vLLM's own thread copies)."""
        c = self.counters
        with self.lock:
            if cpu:
                c.mover_cpu_seconds += cpu
                if job.kind is JobKind.INGRESS:
                    c.store_cpu_seconds += cpu
            c.failed_items += len(ok) - sum(ok)
            c.corrupt_items += sum(corrupt)
            if job.kind is JobKind.EGRESS:
                c.bytes_loaded += nbytes
                c.load_seconds += secs
            elif job.kind is JobKind.INGRESS:
                c.bytes_stored += nbytes
                c.store_seconds += secs
            dst, src = self.keyed.get(job.dst_tier), self.keyed.get(job.src_tier)
            if dst is not None and dst is self.disk:
                c.bytes_to_disk += nbytes
            elif dst is not None:
                c.bytes_to_remote += nbytes
            if src is not None and src is self.disk:
                c.bytes_from_disk += nbytes
            elif src is not None:
                c.bytes_from_remote += nbytes
