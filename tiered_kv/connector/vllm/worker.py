"""Worker side of the vLLM connector: this rank's tiers and movers over vLLM's KV tensors.

``WorkerRuntime`` holds one TP rank's CPU slab tier and (optionally) disk tier, and runs the
jobs of each ``StepPlan`` the scheduler-side planner sends:

- GPU edge (one "front" mover thread; every ``BlockCopier`` call of a mover job happens on it):
  stores (``INGRESS``: GPU blocks -> CPU slots) and loads (``EGRESS``: CPU slots or disk records ->
  GPU blocks, disk reads staged through a small slab);
- CPU<->disk edge (``disk_workers`` threads): demotions, write-through copies, promotions,
  deletes.

The movers run each job through the rank's ``JobRunner`` (``runner.py``: the code of the mover threads).

A completed job is reported once, in the next ``poll``: its per-item outcome goes back to the
planner (``JobReport``), a request whose loads all finished goes into ``finished_recving``,
and GPU blocks a load could not fill go into the load-error set (vLLM then recomputes them).

Hybrid models (several KV cache groups, ``Geometry.parts``): each group has its own ``KVLayout``
over its layers and its own ``BlockCopier``; a slot (and a disk record) holds one group's part of a
chunk, and each group's *plane* views the whole slab in that group's block rows (``slab_planes``),
so a part starts at its slot's first byte whichever group it belongs to. A job item's GPU ids are
``part_blocks`` per group in group order, -1 outside the item's group. With one group plane 0 is
the slab in block rows. Either way a record is a slab row. vLLM takes no per-block load errors
with several groups: a load whose batched copy cannot start falls back to a plain torch copy, and
one that still fails stops the worker rather than serve wrong KV.

Replicated caches (MLA with TP, ``Geometry.replicated``): one ``SharedSlab`` and one disk
directory serve every rank; rank 0 runs every job that writes a host or disk copy (stores,
demotions, promotions, deletes), the other ranks acknowledge those at once, and every rank
loads into its own GPU.

In-step loads (``StepPlan.sync``: CPU-tier hits vLLM scheduled in this very step) do not go
through the front mover: ``before_forward`` registers each as a job and hands its copy to the
rank's ``InStepLoader`` (``in_step.py``: layer groups submitted on vLLM's thread, per-layer GPU
waits in ``wait_layer``); ``poll`` of the same step takes their completions from it and reports
them like any other job, so vLLM learns of a failed in-step load in the step that read it.

Asynchronous CPU-tier loads (one KV cache group) do not go through the front mover either:
``before_forward`` hands the step's batch to the rank's ``AsyncLoader`` (``async_loads.py``: one
submission for all, in plan order, after the in-step loads), and each ``poll`` reports those
whose bytes landed, one request at a time. Disk and remote loads, and models with several
groups, keep the front mover. In a step that schedules no token (``StepPlan.idle``: every request
waits for its KV) ``poll`` first waits, GIL released, for a load or promotion to complete (``idle.py``): vLLM's
engine would spin through such steps and starve the copying threads of the GIL.

Ordering on CUDA: a store starts after an event recorded on the engine's current stream at
``after_forward`` (the KV it reads has been written), and is held on its mover until the next step's
``bind_connector_metadata`` (``store_gate.py``: its copy would delay the sampler's); a load starts after an event
recorded at ``before_forward``'s submission point (after vLLM's block zeroing); ``JobRunner`` makes its side stream
wait for it. A fence waits on the CPU until the fenced job is done with GPU memory (it
finished, or, for a store into a host pool, its copy landed: the publish goes on after), so a
re-allocated block is never overwritten under a copy.

Threading contract: ``register``/``on_plan``/``before_forward``/``wait_layer``/``after_forward``/
``poll``/``stats``/``close`` run on vLLM's worker thread (the model runner), and so does all of
``InStepLoader``. Mover threads only run ``JobRunner.execute`` and ``_on_done``; the completed list,
the job events and the runner's job tables are shared under ``_lock``.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tiered_kv.copy import (BlockCopier, KVLayout, Mechanism, allocate_slab, vllm_layer_layout, warm_copy_paths,
                            warm_sm_kernel)
from tiered_kv.errors import ConfigError
from tiered_kv.values.keys import Namespace
from tiered_kv.tiers.cpu import CpuTier
from tiered_kv.values.jobs import Completion, JobKind, TransferJob
from tiered_kv.movers.mover import Mover, close_at_exit
from tiered_kv.connector.vllm.config import (
    ConnectorConfig,
    disk_slot_nbytes,
    namespace_layout,
    rank_disk_dir,
    rank_remote_part,
)
from tiered_kv.connector.vllm.geometry import Geometry, GroupGeo
from tiered_kv.connector.vllm.async_loads import AsyncLoader
from tiered_kv.connector.vllm.idle import IdleWait
from tiered_kv.connector.vllm.in_step import InStepLoader
from tiered_kv.connector.vllm.in_step_disk import overlap_loader
from tiered_kv.connector.vllm.worker_loads import StepLoads, async_load
from tiered_kv.connector.vllm.pool_io import PoolIO
from tiered_kv.connector.vllm.runner import JobRunner, WorkerCounters
from tiered_kv.connector.vllm.trace import LoadTrace
from tiered_kv.connector.vllm.common import CPU, JobReport, StepPlan, tier_indices
from tiered_kv.connector.vllm.shared_slab import SharedSlab
from tiered_kv.connector.vllm.store_gate import StoreGate

if TYPE_CHECKING:
    from tiered_kv.tiers.disk import DiskTier
    from tiered_kv.tiers.remote import RemoteTier

log = logging.getLogger(__name__)

_FRONT_KINDS = (JobKind.INGRESS, JobKind.EGRESS)
#: How long a fence lets a queued store start before cancelling it (most are next in line).
FENCE_PATIENCE_S = 0.002
#: At most one warning this often (seconds) while fences cancel queued stores.
DROP_WARN_INTERVAL_S = 60.0


def slab_planes(slab: torch.Tensor, sections: list[tuple[int, int]]) -> list[torch.Tensor]:
    """One block-row plane per group over a ``(slots, row_bytes)`` slab: plane g views the whole slab in
    rows of group g's block bytes (``sections[g] = (ids per item, block bytes)``), so block j of slot s is
    row ``s * row_bytes // block_bytes + j``. A slot holds one group's part from its first byte (several
    groups, ``Geometry.parts``) or the one group's chunk."""
    flat = slab.view(-1)
    return [flat.view(-1, nbytes) for _, nbytes in sections]


def _layer_tensors(kv) -> list[torch.Tensor]:
    """One layer's KV tensors as vLLM registers them: a tensor, or a list of state tensors (Mamba)."""
    return list(kv) if isinstance(kv, (list, tuple)) else [kv]


def group_layout(g: GroupGeo, tensors: list[torch.Tensor], rank: int) -> KVLayout:
    """The layout of one KV cache group's tensors on ``rank``, blocks indexed like vLLM's block table.

    vLLM may cut each block into ``r`` kernel blocks for the attention backend (its tensors
    then have ``r`` rows per block, adjacent in memory): ``r`` rows make one block here, so a
    block's bytes (and a stored record) are the same as without the cut.
    """
    kv = vllm_layer_layout(tensors, name="vllm")
    if kv.block_nbytes == g.block_nbytes:
        return kv
    ratio, rest = divmod(g.block_nbytes, kv.block_nbytes)
    if ratio > 1 and not rest and all(t.shape[0] % ratio == 0 for t in tensors):
        log.info("TieredKVConnector rank %d: KV cache group %d has %d kernel blocks per block", rank, g.index, ratio)
        return KVLayout(tuple(tensors), block_dim=0, rows_per_block=ratio, name="vllm")
    raise ConfigError(f"TieredKVConnector: a GPU block of KV cache group {g.index} ({g.kind}) is "
                      f"{kv.block_nbytes} bytes on rank {rank} but the KV cache spec says "
                      f"{g.block_nbytes}; unsupported KV layout")


@dataclass
class PollResult:
    """What one ``poll`` hands back to vLLM (through the connector) and to the planner."""

    reports: dict[int, JobReport] = field(default_factory=dict)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)


def open_disk_tier(make):
    """``make()`` a rank's DiskTier; a damaged index is moved aside (loudly) and the rank starts an empty one.

    The scheduler planned with a disk tier, so the rank keeps one: empty is what the engine sees either way
    (every disk lookup a miss until chunks are stored again). ``tiered-kv repair`` salvages the moved copy.
    A directory that is not moved (other processes have its index open, or the move failed) raises
    ``DamagedIndexError`` saying so: the rank cannot open it safely and must not split it.
    """
    from tiered_kv.errors import DamagedIndexError
    from tiered_kv.tiers.disk import quarantine

    try:
        return make()
    except DamagedIndexError as exc:
        moved = quarantine(exc.path, exc.reason)
        if moved is None:
            try:  # another process (a rank sharing the directory) may have put a fresh one there meanwhile
                return make()
            except DamagedIndexError as again:
                raise DamagedIndexError(
                    f"TieredKVConnector: the disk index of {exc.path} is damaged ({again.reason}) and was left in "
                    f"place (other processes have it open, or it could not be moved: see the log). Stop the engines "
                    f"using {exc.path} and run `tiered-kv repair {exc.path}`, or give this engine another disk_path",
                    exc.path, again.reason) from exc
        log.error("TieredKVConnector: the disk index of %s is damaged (%s); moved it to %s, starting empty. "
                  "`tiered-kv repair %s` salvages what it can.", exc.path, exc.reason, moved, moved)
        return make()


def open_cpu_tier(cfg: ConnectorConfig, geo: Geometry, ns: Namespace, rank: int, cpu_chunks: int,
                  shared_name: str | None):
    """The rank's CPU tier: a private pinned slab, one shared-memory slab for every TP rank (MLA with TP), or the
    host pool (``cpu_pool``, TP=1: one pool for every process on the host that names it, of ``cpu_bytes``)."""
    if geo.replicated and geo.tp_size > 1:
        return SharedSlab(shared_name or f"tkv-{ns.prefix.hex()[:16]}", cpu_chunks, geo.rank_chunk_nbytes, rank,
                          geo.tp_size)
    if cfg.cpu_pool is not None:
        from tiered_kv.tiers.pool import PoolTier  # lazily, as the disk tier (lmdb)

        return PoolTier(namespace_layout(geo), cfg.cpu_pool, cfg.cpu_bytes, owner=ns.prefix,
                        weight=cfg.cpu_pool_weight)
    return CpuTier(geo.rank_layout(rank), cpu_chunks * geo.rank_chunk_nbytes)


class WorkerRuntime(StepLoads):
    """One TP rank's tiers, movers and job bookkeeping; in-step copies go through its ``InStepLoader``."""

    def __init__(self, cfg: ConnectorConfig, geo: Geometry, ns: Namespace, rank: int,
                 cpu_chunks: int, disk_chunks: int, shared_name: str | None = None) -> None:
        self.cfg, self.geo, self.rank = cfg, geo, rank
        self.layout = geo.rank_layout(rank)  # one row = one chunk of this rank's share
        # replicated (MLA): one copy for every rank; rank 0 writes it, the others acknowledge
        self.shared = geo.replicated and geo.tp_size > 1
        self.writes_copies = not self.shared or rank == 0
        self._name_released = not self.shared
        self.cpu = open_cpu_tier(cfg, geo, ns, rank, cpu_chunks, shared_name)
        self.sections = geo.sections
        self.planes = slab_planes(self.cpu.slab, self.sections)
        self.disk: DiskTier | None = None
        path = rank_disk_dir(cfg, ns, rank, geo.tp_size, geo.replicated)
        if path is not None and disk_chunks:
            from tiered_kv.tiers.disk import DiskTier  # lazily: needs lmdb and zstandard, a CPU-only setup does not

            self.disk = open_disk_tier(lambda: DiskTier(
                self.layout, path, disk_chunks * disk_slot_nbytes(geo), cfg.compression, cfg.zstd_level, cfg.disk_sync,
                writer=self.writes_copies, owner=ns.prefix, budget=cfg.disk_budget, weight=cfg.disk_weight,
                evicts=cfg.disk_budget == "shared" and cfg.remote_settings() is None))
        self.remote: RemoteTier | None = None
        settings = cfg.remote_settings()
        if settings is not None:
            from tiered_kv.tiers.remote import RemoteTier  # lazily: needs redis-py

            # rank 0 announces what it stored on the namespace's presence stream (every rank stores its share
            # under its own part; a rank whose share is missing reads a miss, and vLLM recomputes)
            self.remote = RemoteTier(self.layout, settings, ns.prefix, publish_writes=rank == 0,
                                     part=rank_remote_part(geo, rank))
        disk_i, remote_i = tier_indices(self.disk is not None, self.remote is not None)
        self.keyed: dict[int, DiskTier | RemoteTier] = {i: t for i, t in ((disk_i, self.disk), (remote_i, self.remote))
                                                        if t is not None}  # chain index -> keyed tier
        self.counters = WorkerCounters()
        self._lock = threading.Lock()
        self.pool = PoolIO(self.cpu, self.counters, self._lock) if cfg.cpu_pool is not None else None
        self._completed: list[tuple[TransferJob, Completion]] = []
        self._events: dict[int, threading.Event] = {}
        self._loading: set[int] = set()  # asynchronous loads and promotions in flight: what a waiting request needs
        # what the movers run, and the job tables they share with this thread (under _lock)
        self.runner = JobRunner(geo, rank, self.layout, self.cpu, self.keyed, self.disk, self.writes_copies,
                                self.counters, self._lock, self.pool)
        self.runner.gpu_released = self._gpu_released  # a pool store's fence waits for its copy, not its publish
        self._load_reqs: dict[str, set[int]] = {}  # request -> load job ids not finished yet
        self._job_req: dict[int, str] = {}
        self._pending_fail: dict[str, list[int]] = {}
        self._plan: StepPlan | None = None
        self._early_done = self._stores_done = self._fenced = True
        self._held_stores: list[TransferJob] = []  # this step's stores, until its in-step loads are known good
        self._drops_warned_at: float | None = None  # monotonic time of the last dropped-stores warning
        self._drops_unwarned = 0  # chunks cancelled since that warning
        self.copier: BlockCopier | None = None  # group 0's (the only one for most models)
        self.copiers: list[BlockCopier] = []
        # in-step loads, on vLLM's thread; None before ``register`` and with load_mode "async"
        # (the planner then plans none)
        self.in_step: InStepLoader | None = None
        # asynchronous CPU-tier loads (one KV cache group); None before ``register`` (several groups: the mover)
        self.async_loads: AsyncLoader | None = None
        self.trace = LoadTrace(cfg.trace_path, rank) if cfg.trace_path else None  # per-step load trace (off)
        self.idle_wait = IdleWait(self.counters)  # a step with nothing to compute waits for the jobs (idle.py)
        self._cuda = False
        self.store_gate = self.runner.store_gate = StoreGate(None, self.counters)  # stores wait for the next step
        self.front = Mover(f"vllm-gpu-r{rank}", self.runner.execute, self._on_done, workers=1)
        workers = (cfg.disk_workers if self.disk is not None else 0) + (cfg.remote_workers if self.remote else 0)
        self.back = (Mover(f"vllm-disk-r{rank}", self.runner.execute, self._on_done, workers=workers)
                     if self.keyed else None)
        self._closed = False
        # An engine that exits without shutting its connector down (e.g. ``LLM`` in-process) would leave our
        # daemon threads inside torch copies while the interpreter finalizes: C++ then aborts the process
        # ("terminate called without an active exception") after the work is done. Close first.
        close_at_exit(self, f"TieredKVConnector rank {rank}")

    # ------------------------------------------------------------------ set-up
    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Bind vLLM's KV tensors (``register_kv_caches``; each group's block size checked); compile the SM kernel's
        variants on CUDA (``copy.warm_sm_kernel``); pay the first copies' costs now (``copy.warm_copy_paths``)."""
        missing = [n for n in self.geo.layer_names if n not in kv_caches]
        if missing:
            raise ConfigError(f"TieredKVConnector: register_kv_caches lacks layers {missing[:4]} of the KV cache "
                              f"groups ({len(missing)} missing)")
        kvs = [group_layout(g, [t for n in g.layer_names for t in _layer_tensors(kv_caches[n])], self.rank)
               for g in self.geo.groups]
        self.kvs, self.kv = kvs, kvs[0]
        self._cuda = self.kv.device.type == "cuda"
        self.store_gate.device = self.kv.device
        if self._cuda:
            self.cpu.wait_pinned()  # the copy path needs page-locked rows
        # each group's plane holds its block rows; one staging cap for every staged load (in-step and asynchronous)
        self.copiers = [BlockCopier(kv, plane, staging_bytes=self.cfg.load_staging_bytes,
                                    staging_buffers=self.cfg.load_staging_buffers,
                                    scatter_kernel=self.cfg.staged_scatter == "kernel",
                                    load_priority=self.cfg.load_stream_priority)
                        for kv, plane in zip(kvs, self.planes)]
        self.copier = self.copiers[0]
        if self._cuda and self.cfg.in_step_copy in ("auto", "sm_kernel"):  # its first launch would compile in a step
            warm_sm_kernel(self.copiers, f"TieredKVConnector rank {self.rank}")
        if self.cfg.load_mode != "async":
            self.in_step = InStepLoader([(kv, plane, g.layer_names) for kv, plane, g in
                                         zip(kvs, self.planes, self.geo.groups)], self.cfg, self.rank,
                                        plain_fallback=not self.geo.block_level_errors,
                                        timing=self.trace is not None)
            self.in_step.disk = overlap_loader(self.cfg, self.geo, kvs, self.rank, self.runner, self._cuda)
        if self.geo.block_level_errors:
            # staged only when named: ``auto`` picks it for in-step copies (measured under load), not for these
            self.async_loads = AsyncLoader(self.copier, Mechanism.STAGED if self.cfg.in_step_copy == "staged" else None)
        # disk and remote loads read records into a small staging slab and copy from there
        staging = allocate_slab(self.cfg.staging_chunks, self.geo.rank_chunk_nbytes, pin=self._cuda)
        scratch = [BlockCopier(kv, plane) for kv, plane in zip(kvs, slab_planes(staging, self.sections))]
        self.runner.bind(self.copiers, scratch, staging, self.kv.device if self._cuda else None)
        warm_copy_paths([*self.copiers, *(self.in_step.every_copier() if self.in_step is not None else ())], scratch,
                        self.cfg.in_step_copy, f"TieredKVConnector rank {self.rank}")  # first copies' one-off costs
        log.info("TieredKVConnector rank %d: %d group(s), %d layers, %d B per chunk, %d-block chunks, %d CPU chunk "
                 "slots%s, disk %s", self.rank, len(kvs), sum(len(kv.tensors) for kv in kvs),
                 self.geo.rank_chunk_nbytes, self.geo.chunk_blocks, self.cpu.capacity,
                 " (shared by all ranks)" if self.shared else "", self.disk.path if self.disk is not None else "off")

    # ------------------------------------------------------------------ per step
    def on_plan(self, plan: StepPlan) -> None:
        """Take this step's plan (``bind_connector_metadata``); idempotent for the same plan."""
        if plan is self._plan:
            return
        with self._lock:
            self.runner.ext.update(plan.ext)
        self._plan = plan
        self._early_done = self._stores_done = self._fenced = False
        if self.trace is not None:
            self.trace.begin(plan.step, plan.tokens)

    def fence(self) -> None:
        """Make every fenced job done with GPU memory (``handle_preemptions``).

        A store still queued behind other jobs gets ``FENCE_PATIENCE_S`` to start; one that has not started by then is
        cancelled (its items fail, nothing is written and the planner frees their CPU slots): a cache may drop a store,
        and waiting for a long queue held vLLM's thread 15-68 ms per step on the H200 with the disk tier on. A load, or
        a store whose copy began, is waited for.
        """
        plan = self._plan
        if plan is None or self._fenced or not plan.fences:
            return
        self._fenced = True  # the plan is shared data (one object per rank in-process): never edit it
        self.store_gate.open()  # a fenced store held for this step must run now
        loader = self.async_loads
        if loader is not None and loader.pending:  # only a poll would see these land: wait here
            held = {j for j in plan.fences if loader.holds(j)}
            if held:
                self._finish_async(loader.wait(held))
        with self._lock:
            fenced = [(job_id, ev) for job_id in plan.fences if (ev := self._events.get(job_id)) is not None]
            queued = [(job_id, ev) for job_id, ev in fenced if job_id in self.runner.queued_stores]
        pending = {job_id for job_id, ev in fenced if not ev.is_set()}
        t0 = time.perf_counter()
        deadline = t0 + FENCE_PATIENCE_S
        for _, ev in queued:  # most queued stores are about to run: give them a moment
            ev.wait(max(0.0, deadline - time.perf_counter()))
        waits = []
        dropped = 0
        with self._lock:
            for job_id, ev in fenced:
                items = self.runner.queued_stores.pop(job_id, None)
                if items is not None:
                    self.runner.cancelled.add(job_id)
                    pending.discard(job_id)
                    self.counters.stores_cancelled += items
                    dropped += items
                    log.debug("rank %d: fence cancelled queued store job %d", self.rank, job_id)
                else:
                    waits.append(ev)
        self.counters.fences_waited += len(pending)  # fenced jobs not done when the fence began
        if dropped:
            self._warn_dropped(dropped)
        for ev in waits:
            ev.wait()
        if pending or queued:
            waited = time.perf_counter() - t0
            self.counters.fence_wait_seconds += waited
            log.debug("rank %d: fence waited %.1f ms for %d job(s)", self.rank, waited * 1e3, len(pending))

    def _warn_dropped(self, items: int) -> None:
        """Say, at most once per ``DROP_WARN_INTERVAL_S``, that fences cancelled queued stores: each is a later miss."""
        self._drops_unwarned += items
        now = time.monotonic()
        if self._drops_warned_at is not None and now - self._drops_warned_at < DROP_WARN_INTERVAL_S:
            return
        log.warning("TieredKVConnector rank %d: %d stored chunk(s) dropped so far (%d since the last warning): their "
                    "copies were still queued when vLLM re-used the GPU blocks, so those prefixes will be recomputed. "
                    "The movers fall behind the engine; most often a full CPU tier that must first move chunks down "
                    "to a slower disk tier. A larger cpu_bytes absorbs longer bursts",
                    self.rank, self.counters.stores_cancelled, self._drops_unwarned)
        self._drops_warned_at = now
        self._drops_unwarned = 0

    def before_forward(self, layerwise_ok: bool = False) -> None:
        """Submit loads and tier moves (``start_load_kv``); idempotent per step.

        In-step loads start here, ordered after the work already on vLLM's stream (block zeroing). ``layerwise_ok``:
        vLLM will call ``wait_layer`` for every attention layer of this step's forward; otherwise the forward's stream
        waits for the whole load now.
        """
        if self._early_done or self._plan is None:
            return
        trace = self.trace
        t0, movers = (time.perf_counter(), self.front.depth) if trace is not None else (0.0, 0)
        self.fence()
        t1 = time.perf_counter() if trace is not None else 0.0
        self._early_done = True
        plan = self._plan
        for rid, blocks in plan.load_fail.items():
            self._pending_fail.setdefault(rid, []).extend(blocks)
        for rid, ids in plan.loads.items():
            pending = self._load_reqs.setdefault(rid, set())
            pending.update(ids)
            for j in ids:
                self._job_req[j] = rid
        early = plan.early
        if self.pool is not None:  # hold the pool records of this step's loads before anything is copied
            early = self.pool.lease(early, self._on_done)
        if plan.sync:
            sync = set(plan.sync)
            in_step, c = self.in_step, self.counters
            first = len(in_step.loads)
            for job in early:
                if job.job_id in sync:  # a job like any other; only its copy is the loader's
                    with self._lock:
                        self._events[job.job_id] = threading.Event()
                    in_step.start(job, self.runner.load_rows(job) if job.src_tier == CPU else None)  # None: disk
            early = in_step.adopt([j for j in early if j.job_id not in sync], self._events, self._lock)
            # asynchronous loads of this step are ordered after the in-step copies: those must all exist
            pipelined = not (self.async_loads is not None and any(async_load(j) for j in early))
            staged, sm = in_step.staged_copies, in_step.sm_copies
            loads, groups = in_step.submit(layerwise_ok, self.runner.mechanism, pipelined, plan.tokens)
            c.sync_loads += loads
            c.sync_load_groups += groups
            staged, sm = in_step.staged_copies - staged, in_step.sm_copies - sm
            c.sync_staged_copies += staged
            c.sync_sm_copies += sm
            if trace is not None:
                if staged or sm:
                    trace.copies(staged, sm)
                for load in in_step.loads[first:]:
                    trace.started("in_step", load.job.job_id, load.nbytes, load.marks)
        if self.async_loads is not None and plan.loads:
            early = self._start_async(early)
        self._submit(early)
        if trace is not None:
            trace.held((time.perf_counter() - t0) * 1e3, (t1 - t0) * 1e3, movers)

    def wait_layer(self, layer_name: str) -> None:
        """``wait_for_layer_load``: vLLM's stream waits (on the GPU) for this layer's in-step loads."""
        in_step = self.in_step
        if in_step is not None and in_step.busy:  # checked here: vLLM calls this for every layer
            in_step.wait_layer(layer_name)

    def after_forward(self) -> None:
        """Submit stores of this step's KV (``wait_for_save``, or ``get_finished`` without a forward)."""
        if self.trace is not None:
            self.trace.launched()
        self.before_forward()
        if self._stores_done or self._plan is None:
            return
        self._stores_done = True
        self._store_or_hold(self._plan.stores)

    def _submit(self, jobs: list[TransferJob]) -> None:
        if not jobs:
            return
        ev = None
        if self._cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.kv.device))
        if self.cfg.store_start == "after_sampler" and self.writes_copies:  # held before a mover can take one
            self.store_gate.hold(j.job_id for j in jobs if j.kind is JobKind.INGRESS)  # (store_gate.py)
        for job in jobs:
            with self._lock:
                self._events[job.job_id] = threading.Event()
                if job.kind.is_load:
                    self._loading.add(job.job_id)
                if ev is not None and job.kind in _FRONT_KINDS:
                    self.runner.cuda_events[job.job_id] = ev
                if job.kind is JobKind.INGRESS:
                    self.runner.queued_stores[job.job_id] = len(job)
            if job.kind in _FRONT_KINDS or self.back is None:
                self.front.submit(job)
            else:
                self.back.submit(job)

    def poll(self) -> PollResult:
        """Drain completed jobs into reports, finished loads and failed GPU blocks (``get_finished``)."""
        self.after_forward()
        if self.shared and not self._name_released:  # every rank mapped the shared slab: drop its name
            self._name_released = self.cpu.release_name()
        in_step = self.in_step
        self._release_stores(self._finish_in_step(in_step) if in_step is not None and in_step.pending else False)
        loader = self.async_loads
        if self._plan is not None and self._plan.idle and self._loading:  # vLLM would spin: let the loads run
            self.store_gate.open()  # (and the stores the front mover holds before them)
            # (stores alone never hold a step back: a finished request's last output must not wait for them)
            self.idle_wait.wait(lambda: bool(self._completed) or (loader is not None and loader.any_landed()))
        if loader is not None and loader.pending:
            self._finish_async(loader.landed())  # each load as soon as it landed (after an idle step's wait)
        with self._lock:
            done, self._completed = self._completed, []
            for job, _ in done:
                self._events.pop(job.job_id, None)
                self._loading.discard(job.job_id)
        out = PollResult()
        for job, c in done:
            out.reports[job.job_id] = JobReport(1, list(c.ok), list(c.corrupt), c.nbytes, c.seconds, list(c.missing),
                                                list(c.evicted))
            ext = self.runner.ext.pop(job.job_id, None)
            if job.kind is JobKind.EGRESS and ext is not None and not all(c.ok):
                if not self.geo.block_level_errors:
                    # vLLM takes no block errors with several KV cache groups (0.26 crashes on them, 0.32
                    # refuses them); the planner only loads from ready CPU copies and the copy already fell
                    # back to plain torch copies: stop here rather than let vLLM compute on wrong KV
                    raise RuntimeError(f"TieredKVConnector rank {self.rank}: load job {job.job_id} failed "
                                       f"({len(c.ok) - sum(c.ok)} of {len(c.ok)} chunks) and vLLM cannot recompute "
                                       f"blocks of a model with {len(self.geo.groups)} KV cache groups")
                k = self.geo.slot_blocks
                out.invalid_block_ids.update(g for i, ok in enumerate(c.ok) if not ok
                                             for g in ext[i * k:(i + 1) * k] if g >= 0)
            rid = self._job_req.pop(job.job_id, None)
            if rid is not None:
                pending = self._load_reqs.get(rid)
                if pending is not None:
                    pending.discard(job.job_id)
        for rid in [r for r, p in self._load_reqs.items() if not p]:
            del self._load_reqs[rid]
            out.finished_recving.add(rid)
            log.debug("rank %d: load of %s done, reported to vLLM", self.rank, rid)
            out.invalid_block_ids.update(self._pending_fail.pop(rid, ()))
        if self.trace is not None:
            if self.in_step is not None:
                self.trace.staging(sum(c.staging_allocations() for c in self.in_step.every_copier()))
            self.trace.flush(len(self.async_loads.pending) if self.async_loads is not None else 0)
        return out

    def idle(self) -> bool:
        """True when no job is queued, running or unreported on this rank."""
        with self._lock:
            return not self._events and not self._load_reqs

    # ------------------------------------------------------------------ mover side
    def _gpu_released(self, job_id: int) -> None:
        """A host-pool store's copy landed (a mover thread, before its publish): its job is done with GPU memory,
        which is all a fence waits for (``fence``); its completion still comes with ``_on_done``."""
        with self._lock:
            ev = self._events.get(job_id)
        if ev is not None:
            ev.set()

    def _on_done(self, job: TransferJob, done: Completion) -> None:
        if self.pool is not None:  # a load's lease ends with its copy; items whose record was gone fail
            done = self.pool.done(job, done)
        with self._lock:
            self._completed.append((job, done))
            self.runner.cuda_events.pop(job.job_id, None)
            ev = self._events.get(job.job_id)
        if ev is not None:
            ev.set()
        self.idle_wait.notify()

    # ------------------------------------------------------------------ stats and shutdown
    def stats(self) -> dict:
        """Counters plus queue depths (for vLLM's connector stats and tests)."""
        with self._lock:
            d = dict(vars(self.counters))
            d["jobs_unreported"] = len(self._events)
            d["loads_pending_requests"] = len(self._load_reqs)
        d["front_queue"] = self.front.depth
        d["disk_queue"] = self.back.depth if self.back is not None else 0
        return d

    def close(self) -> None:
        """Finish queued jobs, stop movers and submitter threads, close the tiers; twice is safe (shutdown, atexit)."""
        if self._closed:
            return
        self._closed = True
        if self.in_step is not None and self.in_step.pending:
            self._release_stores(self._finish_in_step(self.in_step))
        if self.async_loads is not None and self.async_loads.pending:
            self._finish_async(self.async_loads.wait())
        self.store_gate.open()
        self.front.close()
        if self.back is not None:
            self.back.close()
        for copier in [*self.copiers, *self.runner.staging_copiers,
                       *(self.in_step.copiers if self.in_step is not None else [])]:
            copier.close()
        if self.in_step is not None and self.in_step.disk is not None:
            self.in_step.disk.close()
        if self.disk is not None:
            self.disk.flush()
            self.disk.close()
        if self.remote is not None:
            self.remote.close()
        if self.trace is not None:
            self.trace.close()
        self.cpu.close()
