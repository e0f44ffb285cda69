"""Scheduler side of the vLLM connector: the planner in vLLM's EngineCore process.

``SchedulerPlanner`` owns a ``TierChain`` ([cpu, disk]; ``EXT`` = the engine's GPU blocks)
and turns vLLM's scheduler callbacks into ``TransferJob``s for the workers:

- ``match``: how many tokens beyond the local prefix hit the tiers hold (n-1 rule: at
  least one prompt token is always left to compute; disk hits only when loading them is
  estimated faster than recomputing), and whether the load runs inside the step
  (``load_mode`` "layerwise"/"sync": every chunk in the CPU tier and at most
  ``sync_max_tokens``; vLLM then schedules the request at once and the workers load before
  or alongside the forward; "adaptive": the same while the step's in-step bytes stay within
  a per-step budget, ``admission.py``) or between steps (asynchronous: disk hits, big hits,
  "async", hits past the budget);
- ``allocated``: after vLLM allocated GPU blocks for an async hit, plan the loads into them;
- ``build``: once per step, plan eager stores of newly computed prompt blocks, add fences
  (jobs that must finish on the GPU before a re-allocated block is overwritten) and hand
  out every job planned since the last step as a ``StepPlan``;
- ``apply_reports``: apply the workers' completions (a job is done when every TP rank
  reported it) and plan whatever they unblocked.

GPU source blocks are protected without delaying vLLM's frees: a store job is only handed
out if none of its blocks was re-allocated since the store was planned, and a block that is
re-allocated while a job still reads or writes it puts that job in the next plan's fences.

Hybrid models (several KV cache groups, ``Geometry.parts``): each group's share of a chunk is a
record of its own (a *part*), and ``parts.PartPlanner`` decides which parts a hit reads and a store
writes (full attention: every chunk; a sliding window: only the window before a stored prefix's end;
Mamba: the state where one was kept), so a tier's bytes hold what later hits can use. A job's GPU ids
per item are ``Geometry.slot_blocks`` (the item's group's blocks in its section, -1 elsewhere). vLLM
frees a running request's out-of-window blocks without telling the connector, so table entries
re-allocated since are zeroed before any store reads them. With several groups vLLM takes no
per-block load errors, so every load comes from a ready CPU copy (disk hits are promoted to the CPU
tier first; ``match`` answers "ask again" while they move) and the worker falls back to a plain copy
rather than report a block.

Tail pieces (``tail_chunks``; one full-attention or MLA group, and with ``tail_chunks: true`` (not ``auto``)
sliding windows and full attention too, not Mamba: a Mamba state at a tail's end is not kept): a prompt rarely
ends on a chunk boundary, so the full blocks after its last whole chunk are stored too, once its prefill is
complete (``on_finish``: when it finishes), as one *tail* record (hybrids: one per group, like parts,
``parts.py``): a chunk slot whose first ``m`` blocks hold them (the job's other GPU ids are -1, so the rest of
the slot is neither written nor read). Its key is the namespace prefix, ``TAIL_MARK`` and vLLM's block hash of
its last block, which chains the whole prefix: equal keys name equal KV, across restarts too (disk records are
adopted like any other). ``match`` probes tails where the walk over whole chunks stopped, longest first; a later
turn that holds the same prefix hits the whole chunks and then the tail, so only what lies after the earlier
prompt's last full block is computed again.

The work is split by responsibility; ``SchedulerPlanner`` owns one of each part and hands every callback
to the part whose job it is (their state is their own; they share the ``TierChain``, the ``RequestTable``
and the counters):

- ``lookup.LookupPlanner``: ``match`` (walk, tail probes, hybrid parts, promotions, the split: load or recompute);
- ``prefill``: the split gate and ``StepMeter`` (the prefill model learned from vLLM's steps, ``self.steps``);
- ``loads.LoadPlanner``: ``allocated`` (the hit's loads, in-step or asynchronous), prefix order, load rates;
- ``stores.StorePlanner``: each step's stores, tail pieces, ``on_finish`` stores; ``stores.ChunkEvents``;
- ``blocks.BlockTracker``: block tables, sliding-window owners, re-allocation dates, in-flight jobs' blocks
  and the fences they need;
- ``routing.JobRouter``: every job on its way to the workers (its GPU side, valid stores, the ``StepPlan``);
- ``presence.RemotePresence``: what the fleet stored in the remote tier; ``presence.PoolPresence``: what other
  processes stored in a host pool (``cpu_pool``: the CPU tier, keyed and governed), from a ``PoolWatch`` thread;
- ``state``: ``RequestState``/``RequestTable`` (requests followed, chunk and tail keys) and ``PlannerCounters``;
- ``common``: ``StepPlan`` and ``JobReport``, the messages each way, and the tier numbering.

Threading contract: every method runs on vLLM's scheduler thread (EngineCore); not
thread-safe and needs no lock. No torch, no I/O (DESIGN invariant 7) except opening the
disk index read-only once at start-up to adopt what a previous engine stored.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

from tiered_kv.planner.chain import TierChain, TierSpec
from tiered_kv.values.keys import Namespace
from tiered_kv.planner.policy import PlacementPolicy
from tiered_kv.values.jobs import Completion, JobKind
from tiered_kv.connector.vllm.admission import StepLoadBudget
from tiered_kv.connector.vllm.blocks import BlockTracker
from tiered_kv.connector.vllm.common import CPU, DISK, JobReport, StepPlan, tier_indices
from tiered_kv.connector.vllm.config import ConnectorConfig
from tiered_kv.connector.vllm.geometry import Geometry
from tiered_kv.connector.vllm.loads import LoadPlanner
from tiered_kv.connector.vllm.lookup import LookupPlanner
from tiered_kv.connector.vllm.reseed import SharedPrefixWatch
from tiered_kv.connector.vllm.parts import PartPlanner
from tiered_kv.connector.vllm.prefill import StepMeter, split_gate, split_stats, tier_names
from tiered_kv.connector.vllm.presence import PoolPresence, PoolSource, PresenceSource, RemotePresence
from tiered_kv.connector.vllm.routing import JobRouter
from tiered_kv.connector.vllm.state import PlannerCounters, RequestTable
from tiered_kv.connector.vllm.stores import ChunkEvents, StorePlanner

log = logging.getLogger(__name__)


class SchedulerPlanner:
    """The planner behind ``TieredKVConnector``'s scheduler role; works in chunks of blocks.

    vLLM's lookup callbacks are its parts' own methods: ``match(request, num_computed_tokens)`` and
    ``load_async(request)`` (``LookupPlanner``), ``allocated(request, block_ids, num_external_tokens)``
    (``LoadPlanner``); the rest are below.
    """

    def __init__(self, cfg: ConnectorConfig, geo: Geometry, ns: Namespace, cpu_chunks: int, disk_chunks: int,
                 adopted: Sequence[bytes] = (), presence: PresenceSource | None = None,
                 pool: PoolSource | None = None) -> None:
        self.cfg, self.geo = cfg, geo
        # one full-attention (or MLA) group: a record is a chunk; else a record is one group's part of a chunk
        single = not geo.parts
        self._parts = PartPlanner(geo, ns.key, cfg.swa_store) if geo.parts else None
        # a host pool (``pool``: its watch) is keyed and governed like a shared disk directory: it places and evicts
        specs = [TierSpec("cpu", cpu_chunks, slotted=pool is None, governed=pool is not None)]
        if disk_chunks:
            # shared budget without a remote tier below: the directory evicts by itself (governed); a load of a
            # chunk it evicted fails and vLLM recomputes. With a remote tier, the planner evicts (demotes) as before.
            shared = cfg.disk_budget == "shared" and presence is None
            specs.append(TierSpec("disk", disk_chunks, slotted=False, governed=shared))
        # the remote tier (a Redis Cluster shared by the fleet) is governed: Redis keeps its budget
        _, self.remote = tier_indices(bool(disk_chunks), presence is not None)
        if self.remote is not None:
            specs.append(TierSpec("remote", 0, slotted=False, governed=True))
        write_policy = cfg.write_policy
        if disk_chunks and write_policy == "write_back" and any(g.kind in ("swa", "mamba") for g in geo.groups):
            # write-back makes a store wait for a demotion when the CPU tier is full, and vLLM re-uses
            # sliding-window and Mamba blocks within a step or two: the store would be dropped. With
            # write-through CPU copies are clean, so room is made at once; in steady state (CPU full)
            # both write each chunk to disk once.
            log.info("TieredKVConnector: hybrid model with a disk tier: write_through instead of write_back "
                     "(sliding-window and Mamba blocks do not live long enough to wait for a demotion)")
            write_policy = "write_through"
        copy_to = (self.remote,) if self.remote is not None and cfg.remote_write == "through" else ()
        self.chain = TierChain(specs, cfg.eviction, PlacementPolicy(write_policy, cfg.promote_on_hit, copy_to=copy_to))
        self.key = ns.key  # prefix and keyed hasher cached on the namespace
        # tail pieces: only when a chunk has several blocks; one full-attention (or MLA) group, or (``tail_chunks:
        # true``, not ``auto``) full attention and sliding windows of one block size (a Mamba state at a tail's end
        # is not kept)
        windows = (cfg.tail_chunks is True and not single and not geo.has_mamba and bool(self._parts.full)
                   and geo.hash_block_size == geo.block_size
                   and all(g.block_size == geo.block_size for g in geo.groups))
        self._tails = bool(cfg.tail_chunks) and (single or windows) and geo.chunk_blocks > 1
        self.counters = PlannerCounters()
        self._step = 0
        self._reports: dict[int, JobReport] = {}  # jobs some TP ranks reported, waiting for the others
        # disk and remote chunks load only while reading them beats recomputing them (shared with SGLang's backend);
        # the prefill model is learned from vLLM's steps (the connector calls self.steps: prefill.py)
        self._gate = split_gate(cfg, geo, tier_names(self.chain))
        self.steps = StepMeter(self._gate.prefill, on_loaded=self._gate.observe_loaded_step,
                               on_unloaded=self._gate.observe_unloaded_step)
        #: the step last built: what its in-step loads move per tier and their priced exposure (``take_in_step``)
        self.step_in_step: tuple[dict[str, float], float] | None = None
        # load_mode adaptive: the in-step load bytes (per rank) each step may take; None in the other modes
        self._budget = (StepLoadBudget(None if cfg.step_load_bytes == "auto" else cfg.step_load_bytes, cfg.load_gbps)
                        if cfg.load_mode == "adaptive" else None)
        counters = self.counters
        self._requests = RequestTable(geo, ns)
        self._blocks = BlockTracker(geo, counters)
        self._router = JobRouter(self.chain, geo.slot_blocks, single, self._blocks, counters)
        self._presence = (RemotePresence(presence, self.chain, self.remote, self._router, counters)
                        if presence is not None else None)
        self._pool = PoolPresence(pool, self.chain, CPU, self._router, counters) if pool is not None else None
        self._events = ChunkEvents(geo, self.chain)
        reseed = (SharedPrefixWatch(cfg.hybrid_reseed_interval_s) if cfg.hybrid_reseed and not geo.has_mamba
                  and any(g.kind == "swa" for g in geo.groups) else None)
        self._lookup = LookupPlanner(cfg, geo, self.chain, self._requests, self._router, self._parts, self._tails,
                                     self._gate, self._budget, self._presence, counters, reseed)
        self._loads = LoadPlanner(geo, self.chain, self._requests, self._router, self._parts, self._gate,
                                  self._budget, counters)
        self._stores = StorePlanner(cfg, geo, self.chain, self._requests, self._blocks, self._router, self._parts,
                                    self._tails, self._events, counters)
        # vLLM's lookup callbacks go straight to the part that answers them: no extra call per request
        self.match = self._lookup.match if self._pool is None else self._pool.before(self._lookup.match)
        self.load_async = self._lookup.load_async
        self.allocated = self._loads.allocated
        if adopted and disk_chunks:
            self._router.route(self.chain.adopt(DISK, list(adopted)))
            log.info("TieredKVConnector: adopted %d chunks from disk", len(adopted))

    # ------------------------------------------------------------------ per step
    def build(self, scheduler_output) -> StepPlan:
        """Plan this step: track block tables, plan stores, add fences, hand out all pending jobs."""
        self._step += 1
        step = self._step
        self._lookup.next_step()
        if self._budget is not None:
            total = scheduler_output.total_num_scheduled_tokens
            # more tokens than requests: some request prefills (or verifies speculative tokens) in this step
            self._budget.next_step(total > 0, total > len(scheduler_output.num_scheduled_tokens))
        if self._presence is not None and self._presence.pending():
            self._presence.sync()
        if self._pool is not None and self._pool.pending():
            self._pool.sync()
        router, blocks = self._router, self._blocks
        fences: set[int] = set()
        # Stores planned in an earlier step (waiting for room, granted since, or planned at a
        # request's finish) are checked against re-allocations: record those only while any exist.
        blocks.watching = bool(router.stores or self._stores.finish_puts or self.chain.waiting())
        preempted = scheduler_output.preempted_req_ids  # a set, or None (vLLM 0.26 and 0.32 alike)
        if preempted and blocks.req_jobs:  # their blocks may be re-allocated in this very step
            for rid in preempted:
                blocks.release(rid)
        waiting = self._requests.async_waiting
        if waiting:  # scheduled at last: its remaining blocks are allocated, the next hybrid load may be admitted
            waiting.difference_update(scheduler_output.num_scheduled_tokens)
        blocks.scan(scheduler_output, step, fences)  # first: stale table entries go before a store reads them
        self._stores.plan_step(scheduler_output, step)
        stores = router.take_valid_stores(step)
        router.drain_finished()
        self.counters.fences += len(fences)
        self.step_in_step = self._loads.take_in_step()
        return router.take_plan(step, stores, fences, int(scheduler_output.total_num_scheduled_tokens))

    # ------------------------------------------------------------------ completions
    def apply_reports(self, reports: dict[int, JobReport]) -> None:
        """Fold in worker reports; a job completes once all TP ranks reported it."""
        tp = self.geo.tp_size
        for job_id, rep in reports.items():
            acc = self._reports.get(job_id)
            if acc is None:
                acc = self._reports[job_id] = JobReport(0, list(rep.ok), list(rep.corrupt),
                                                        missing=[False] * len(rep.ok) if rep.missing else [])
            acc.merge(rep)
            if acc.count < tp:
                continue
            del self._reports[job_id]
            self._complete(job_id, acc)
        self._router.drain_finished()

    def _complete(self, job_id: int, rep: JobReport) -> None:
        job = self.chain.job(job_id)  # every job the chain plans is routed here, and leaves it only completed
        if job is None:
            log.warning("TieredKVConnector: report for unknown job %d ignored", job_id)
            return
        unreadable = self._presence.job_done(job, rep) if self._presence is not None else []
        kind = job.kind
        fenced = self._blocks.untrack(job_id)
        if kind.is_load:  # into GPU blocks (EGRESS), or up to the CPU tier (PROMOTE)
            self._loads.load_done(job, rep)
        elif kind is JobKind.INGRESS:
            self.counters.bytes_stored += rep.nbytes
        elif kind in (JobKind.DEMOTE, JobKind.COPY_DOWN):
            self._loads.write_done(job, rep)
        if not all(rep.ok) and kind is JobKind.INGRESS and fenced:
            log.debug("store job %d dropped %d of %d chunks: vLLM re-allocated its blocks before the copy began",
                      job_id, len(rep.ok) - sum(rep.ok), len(rep.ok))
        elif not all(rep.ok):
            log.warning("TieredKVConnector: %s job %d: %d of %d items failed", kind.name, job_id,
                        len(rep.ok) - sum(rep.ok), len(rep.ok))
        else:
            log.debug("job %d (%s) done: %d items, %d bytes", job_id, kind.name, len(rep.ok), rep.nbytes)
        route = self._router.route
        route(self.chain.complete(Completion(job_id, rep.ok, rep.corrupt, rep.nbytes, rep.seconds,
                                             missing=rep.missing, evicted=rep.evicted)))
        if unreadable:
            route(self.chain.forget(self.remote, unreadable, unreadable=True))
        if kind is JobKind.INGRESS:  # the stored keys are the most recently used now: put the prefix back in order
            put = self._router.puts.get(job.handle)
            for rid in put.reqs if put is not None else ():
                st = self._requests.reqs.get(rid)
                if st is not None:
                    self._loads.refresh(st)

    # ------------------------------------------------------------------ lifecycle
    def finished(self, request, block_ids) -> None:
        """A request finished (or was aborted): forget it; with ``on_finish`` stores, plan its chunks.

        ``block_ids``: one list per KV cache group, as vLLM frees them (0 where a sliding window
        or a Mamba group already let a block go).
        """
        rid = request.request_id
        st = self._requests.reqs.pop(rid, None)
        self._requests.async_waiting.discard(rid)
        self._stores.storing.pop(rid, None)
        if self._blocks.req_jobs:
            self._blocks.release(rid)
        if st is not None:
            self._blocks.disown(st)
            if self.cfg.store_policy == "on_finish":
                self._stores.on_finish(st, request, block_ids, self._step)

    def has_pending_work_to_ship(self) -> bool:
        """True while planned jobs wait for the next plan (in-flight jobs do not count: no busy stepping)."""
        return self._router.pending() or bool(self._stores.finish_puts)

    # ------------------------------------------------------------------ remote tier and KV events
    def sync_remote(self) -> None:
        """Take what the presence feed reported since the last call (``RemotePresence.sync``)."""
        self._presence.sync()

    def enable_events(self) -> None:
        """Record what each chunk this engine stores names in vLLM's terms, for ``take_events``."""
        self._events.enable()

    def take_events(self) -> list[tuple[bool, str, tuple]]:
        """``(stored, tier name, event metadata)`` for every chunk this engine stored that landed in or left a tier
        since the last call; metadata is dropped once no tier holds the chunk."""
        return self._events.take()

    # ------------------------------------------------------------------ stats
    def store_stats(self) -> dict:
        """The planner's numbers in ``TieredStore.stats()``'s shape, for ``tiered_kv.store.metrics`` (Prometheus).

        Block counts are chunks; bytes are whole-engine (all TP ranks). Adds the load gate's ``report()``
        (``gate``); the remote tier's own error counters live in the workers (failed remote transfers show in
        ``tiers["remote"]``).
        """
        c, cc, nb = self.chain, self.chain.counters, self.geo.chunk_nbytes
        tiers = {}
        for i, spec in enumerate(c.specs):
            tc = c.tier_counters[i]
            tiers[spec.name] = {
                "hits": tc.hits, "blocks_in": tc.blocks_in, "blocks_out": tc.blocks_out,
                "bytes_in": tc.blocks_in * nb, "bytes_out": tc.blocks_out * nb, "evictions": tc.evictions,
                "failed_transfers": tc.failed_transfers, "corrupt_dropped": tc.corrupt_dropped,
                "refused": tc.refused, "resident_blocks": c.resident(i), "capacity_blocks": spec.capacity,
                "queue_depth": c.inflight(),
            }
        return {"lookups": cc.lookups, "hits": cc.hits, "misses": cc.misses, "puts_refused": cc.puts_refused,
                "bytes_in": self.counters.bytes_stored, "bytes_out": self.counters.bytes_loaded,
                "resident_bytes": sum(c.resident(i) for i in range(c.num_tiers)) * nb,
                "inflight_jobs": c.inflight(), "tiers": tiers, "transfers": c.transfers.snapshot(nb),
                "gate": self._gate.report()}

    def stats(self) -> dict:
        """Planner state for tests, logs and vLLM's connector stats (zero in flight when idle)."""
        c, blocks, router = self.chain, self._blocks, self._router
        out = {f"sched_{k}": v for k, v in vars(self.counters).items()}
        out.update({
            "inflight_jobs": c.inflight(), "pinned": c.pinned(), "waiting": c.waiting(),
            "gpu_blocks_busy": blocks.busy_count(),
            "tracked_requests": len(self._requests.reqs) + len(self._stores.storing) + len(blocks.req_jobs),
            "tracked_window_blocks": len(blocks.owner), "promotions_pending": len(router.promotions),
            "open_puts": len(router.puts), "open_gets": len(router.gets), "unshipped_ext": len(router.ext),
            "resident_cpu": c.resident(CPU),
            "resident_disk": c.resident(DISK) if c.num_tiers > 1 and c.specs[DISK].name == "disk" else 0,
            "resident_remote": c.resident(self.remote) if self.remote is not None else 0,
            "remote_known": len(self._presence.known) if self._presence is not None else 0,
            "prefill_steps_timed": self.steps.timed, "prefill_fits": self.steps.fits,
            "prefill_steps_loaded": self.steps.loaded_steps,
            "prefill_steps_priced": self.steps.priced_steps,
            "prefill_clock": "workers" if self.steps.worker_clock else "scheduler", **split_stats(self._gate),
        })
        if self._budget is not None:
            out.update(self._budget.stats())
        for i, tc in enumerate(c.tier_counters):
            name = c.specs[i].name
            out.update({f"{name}_{k}": v for k, v in vars(tc).items()})
        return out
