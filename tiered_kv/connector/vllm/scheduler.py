"""Scheduler side of the vLLM connector: the planner in vLLM's EngineCore process.

``SchedulerPlanner`` owns a ``TierChain`` ([cpu, disk]; ``EXT`` = the engine's GPU blocks)
and turns vLLM's scheduler callbacks into ``TransferJob``s for the workers:

- ``match``: how many tokens beyond the local prefix hit the tiers hold (n-1 rule: at
  least one prompt token is always left to compute; disk hits only when loading them is
  estimated faster than recomputing), and whether the load runs inside the step
  (``load_mode`` "layerwise"/"sync": every chunk in the CPU tier and at most
  ``sync_max_tokens``; vLLM then schedules the request at once and the workers load before
  or alongside the forward) or between steps (asynchronous: disk hits, big hits, "async");
- ``allocated``: after vLLM allocated GPU blocks for an async hit, plan the loads into them;
- ``build``: once per step, plan eager stores of newly computed prompt blocks, add fences
  (jobs that must finish on the GPU before a re-allocated block is overwritten) and hand
  out every job planned since the last step as a ``StepPlan``;
- ``apply_reports``: apply the workers' completions (a job is done when every TP rank
  reported it) and plan whatever they unblocked.

GPU source blocks are protected without delaying vLLM's frees: a store job is only handed
out if none of its blocks was re-allocated since the store was planned, and a block that is
re-allocated while a job still reads or writes it puts that job in the next plan's fences.

Threading contract: every method runs on vLLM's scheduler thread (EngineCore); not
thread-safe and needs no lock. No torch, no I/O (DESIGN invariant 7) except opening the
disk index read-only once at start-up to adopt what a previous engine stored.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tiered_kv.planner.chain import TierChain, TierSpec
from tiered_kv.errors import ConfigError
from tiered_kv.values.keys import Namespace
from tiered_kv.planner.policy import PlacementPolicy
from tiered_kv.values.jobs import Completion, JobKind, TransferJob
from tiered_kv.connector.vllm.config import ConnectorConfig, Geometry

log = logging.getLogger(__name__)

CPU, DISK = 0, 1


@dataclass
class StepPlan:
    """What the workers do for one scheduler step (pickled to every worker inside the metadata).

    ``early`` jobs start at once (loads into GPU blocks, tier-to-tier moves); ``stores`` read
    GPU blocks and start after this step's forward; ``ext`` gives, for every job with a GPU
    side, its items' GPU block ids, ``chunk_blocks`` per item, flat (-1 = leave that block alone);
    ``fences`` are job ids that must have finished touching GPU memory before this step's
    forward runs; ``loads`` maps a request to its load job ids (reported in
    ``finished_recving`` when all are done) and ``load_fail`` to GPU blocks its load cannot
    fill (reported as load errors, so vLLM recomputes them).
    """

    step: int
    early: list[TransferJob] = field(default_factory=list)
    stores: list[TransferJob] = field(default_factory=list)
    ext: dict[int, list[int]] = field(default_factory=dict)
    fences: list[int] = field(default_factory=list)
    loads: dict[str, list[int]] = field(default_factory=dict)
    load_fail: dict[str, list[int]] = field(default_factory=dict)
    sync: list[int] = field(default_factory=list)
    sync_fail: list[int] = field(default_factory=list)

    def empty(self) -> bool:
        """True when the workers have nothing to do."""
        return not (self.early or self.stores or self.fences or self.loads or self.sync_fail)


@dataclass
class JobReport:
    """One job's outcome as reported by ``count`` TP ranks (merged: ok = all, corrupt = any)."""

    count: int
    ok: list[bool]
    corrupt: list[bool]
    nbytes: int = 0
    seconds: float = 0.0

    def merge(self, other: "JobReport") -> None:
        """Fold another rank's report of the same job into this one."""
        self.count += other.count
        self.ok = [a and b for a, b in zip(self.ok, other.ok)]
        self.corrupt = [a or b for a, b in zip(self.corrupt, other.corrupt)]
        self.nbytes += other.nbytes
        self.seconds = max(self.seconds, other.seconds)


@dataclass
class _Req:
    request: object  # vllm.v1.request.Request
    keys: list[bytes] = field(default_factory=list)  # chunk keys, computed lazily
    block_ids: list[int] = field(default_factory=list)
    stored: int = 0  # leading chunks already offered to the store
    lookup: tuple[int, int, int] = (0, 0, 0)  # (first chunk, chunks, blocks of the first chunk held locally)
    sync: bool = False  # the last match is loaded inside the step (all chunks in the CPU tier)


@dataclass
class _Put:
    gpu: list[int]  # chunk_blocks GPU block ids per item, flat
    step: int  # the step the source blocks were last known to hold this KV


@dataclass
class PlannerCounters:
    """Scheduler-side counters (monotonic)."""

    lookups: int = 0
    hit_tokens_cpu: int = 0
    hit_tokens_disk: int = 0
    sync_loads: int = 0
    disk_hits_declined: int = 0
    disk_probes: int = 0
    load_jobs: int = 0
    store_chunks: int = 0
    stores_dropped_reused: int = 0
    fences: int = 0
    failed_load_blocks: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0


class SchedulerPlanner:
    """The planner behind ``TieredKVConnector``'s scheduler role; works in chunks of blocks."""

    def __init__(self, cfg: ConnectorConfig, geo: Geometry, ns: Namespace, cpu_chunks: int, disk_chunks: int,
                 adopted: Sequence[bytes] = ()) -> None:
        self.cfg, self.geo = cfg, geo
        self.bs = geo.block_size
        self.k = geo.chunk_blocks
        specs = [TierSpec("cpu", cpu_chunks)]
        if disk_chunks:
            specs.append(TierSpec("disk", disk_chunks, slotted=False))
        self.chain = TierChain(specs, cfg.eviction, PlacementPolicy(cfg.write_policy, cfg.promote_on_hit))
        self.key = ns.key  # prefix and keyed hasher cached on the namespace
        self.counters = PlannerCounters()
        self._step = 0
        self._reqs: dict[str, _Req] = {}
        self._storing: dict[str, _Req] = {}  # requests with prompt chunks still to store (eager)
        self._puts: dict[int, _Put] = {}
        self._gets: dict[int, list[int]] = {}  # handle -> its items' GPU ids, flat
        self._handle_ids = iter(range(1, 1 << 62))
        self._early: list[TransferJob] = []
        self._stores: list[TransferJob] = []
        self._ext: dict[int, list[int]] = {}  # job id -> its items' GPU ids (flat), until handed out
        self._loads: dict[str, list[int]] = {}
        self._load_fail: dict[str, list[int]] = {}
        self._sync: list[int] = []
        self._sync_fail: list[int] = []
        self._finish_puts: list[tuple[list[bytes], list[int], int]] = []
        self._alloc_step: dict[int, int] = {}  # GPU block -> last step it was (re)allocated (while watching)
        self._watching = False
        self._gpu_busy: dict[int, int] = {}  # GPU block -> newest in-flight job touching it
        self._job_gpu: dict[int, list[int]] = {}
        self._job_kind: dict[int, tuple[JobKind, int]] = {}
        self._fenced_jobs: set[int] = set()  # jobs named in a fence: a store among them may come back cancelled
        self._reports: dict[int, JobReport] = {}
        self._disk_gbps = cfg.disk_read_gbps
        self._declined = 0
        if adopted and disk_chunks:
            self._route(self.chain.adopt(DISK, list(adopted)))
            log.info("TieredKVConnector: adopted %d chunks from disk", len(adopted))

    # ------------------------------------------------------------------ keys
    def _state(self, request) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None or st.request is not request:
            st = self._reqs[request.request_id] = _Req(request)
        return st

    def _chunk_keys(self, st: _Req, upto: int) -> list[bytes]:
        """Keys of chunks ``[0, upto)``: chunk c is named by the hash of its last block (which chains the prefix)."""
        keys = st.keys
        if len(keys) < upto:
            hashes = st.request.block_hashes
            k = self.k
            keys.extend(self.key(hashes[(c + 1) * k - 1]) for c in range(len(keys), upto))
        return keys

    def _gpu_ids(self, block_ids: Sequence[int], c0: int, n: int, skip: int = 0) -> list[int]:
        """GPU block ids of chunks ``[c0, c0+n)``, flat; the first ``skip`` are -1 (held locally already)."""
        k = self.k
        out = list(block_ids[c0 * k:(c0 + n) * k])
        if skip and out:
            out[:skip] = [-1] * skip
        return out

    # ------------------------------------------------------------------ lookups and loads
    def match(self, request, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` that can be loaded asynchronously (0 if none)."""
        self.counters.lookups += 1
        bs, k = self.bs, self.k
        if num_computed_tokens % bs:
            return 0
        c0, skip = divmod(num_computed_tokens // bs, k)
        # n-1 rule: leave at least one prompt token to compute
        usable = min(len(request.block_hashes), (request.num_tokens - 1) // bs) // k - c0
        if usable <= 0:
            return 0
        st = self._state(request)
        st.sync = False
        index = self.chain.index
        where: list[int] = []
        for c in range(c0, c0 + usable):
            e = index.get(self._chunk_keys(st, c + 1)[c])  # keys made lazily: a miss stops the walk
            best = None if e is None else e.best()
            if best is None:
                break
            where.append(best)
        n = self._worth_loading(where)
        blocks = n * k - skip
        log.debug("match %s: computed %d, %d of %d chunks held %s, %d worth loading", request.request_id,
                  num_computed_tokens, len(where), usable, where[:4], n)
        if n == 0 or blocks < self.cfg.min_hit_blocks:
            return 0
        st.lookup = (c0, n, skip)
        st.sync = (self.cfg.load_mode != "async" and blocks * bs <= self.cfg.sync_max_tokens
                   and all(t == CPU for t in where[:n]))
        return blocks * bs

    def load_async(self, request) -> bool:
        """Whether the hit the last ``match`` of ``request`` found loads between steps (else inside the step)."""
        st = self._reqs.get(request.request_id)
        return st is None or not st.sync

    def _worth_loading(self, where: list[int]) -> int:
        """Leading chunks worth loading: disk chunks only while reading beats recomputing."""
        n_cpu = next((i for i, t in enumerate(where) if t != CPU), len(where))
        if n_cpu == len(where) or self.cfg.disk_load_policy == "always":
            return len(where)
        if self.cfg.disk_load_policy == "auto":
            disk_s = self.geo.chunk_nbytes / (self._disk_gbps * 1e9)
            recompute_s = self.geo.chunk_tokens / self.cfg.prefill_tokens_per_s
            if disk_s < recompute_s:
                return len(where)
            # A declined disk is never measured again: now and then take the hit anyway, so the
            # bandwidth estimate follows the disk (a faster disk, a warmer page cache).
            self._declined += 1
            probe = self.cfg.disk_probe_every
            if probe and self._declined % probe == 0:
                self.counters.disk_probes += 1
                return len(where)
        self.counters.disk_hits_declined += 1
        return n_cpu

    def allocated(self, request, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """vLLM allocated ``block_ids`` (all of the request's blocks) after a hit of ``num_external_tokens``."""
        st = self._state(request)
        if num_external_tokens <= 0:
            return
        c0, n, skip = st.lookup
        n = min(n, (num_external_tokens // self.bs + skip) // self.k)
        gpu = self._gpu_ids(block_ids, c0, n, skip)
        keys = self._chunk_keys(st, c0 + n)[c0:c0 + n]
        hid = next(self._handle_ids)
        self._gets[hid] = gpu
        got, jobs = self.chain.get(keys, hid)
        rid = request.request_id
        if got < n:  # a chunk vanished since the lookup: report its blocks, vLLM recomputes from there
            lost = [g for g in gpu[got * self.k:] if g >= 0]
            if st.sync:
                self._sync_fail.extend(lost)
            else:
                self._load_fail[rid] = lost
            self.counters.failed_load_blocks += len(lost)
        loads = [j for j in jobs if j.kind is JobKind.EGRESS]
        if st.sync:
            # matched in this same schedule() call, so every chunk is still a READY CPU copy: one
            # EGRESS job from the CPU tier, which the workers run before/alongside this step's forward
            self._sync.extend(j.job_id for j in loads)
            self.counters.sync_loads += len(loads)
            st.sync = False
        else:
            self._loads.setdefault(rid, []).extend(j.job_id for j in loads)
        self.counters.load_jobs += len(loads)
        k = self.k
        for j in loads:
            tokens = sum(1 for i in j.dst_slots for g in gpu[i * k:(i + 1) * k] if g >= 0) * self.bs
            if j.src_tier == CPU:
                self.counters.hit_tokens_cpu += tokens
            else:
                self.counters.hit_tokens_disk += tokens
        st.stored = max(st.stored, c0 + got)
        self._route(jobs)
        self._drain_finished()

    # ------------------------------------------------------------------ per step
    def build(self, scheduler_output) -> StepPlan:
        """Plan this step: track block tables, plan stores, add fences, hand out all pending jobs."""
        self._step += 1
        step = self._step
        fences: set[int] = set()
        keys_out: list[bytes] = []
        gpu_out: list[int] = []
        eager = self.cfg.store_policy == "eager"
        scheduled = scheduler_output.num_scheduled_tokens
        # Stores planned in an earlier step (waiting for room, granted since, or planned at a
        # request's finish) are checked against re-allocations: record those only while any exist.
        self._watching = bool(self._stores or self._finish_puts or self.chain.waiting())
        storing = self._storing if eager else {}
        for new in scheduler_output.scheduled_new_reqs:
            ids = new.block_ids[0]
            self._allocated_now(ids, step, fences)
            st = self._reqs.get(new.req_id)
            if st is None or not eager:
                continue
            st.block_ids = list(ids)
            storing[new.req_id] = st
            self._plan_store(st, new.num_computed_tokens + scheduled.get(new.req_id, 0), keys_out, gpu_out)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = _resumed_ids(cached) if cached.req_ids else set()
        # Decode steps list every running request: keep the per-request work to a lookup unless the
        # request still has chunks to store (prompt-only stores finish with the prefill).
        for i, rid in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if new_ids is not None and new_ids[0]:
                self._allocated_now(new_ids[0], step, fences)
            st = storing.get(rid)
            if st is None:
                continue
            if new_ids is not None:
                if rid in resumed:
                    st.block_ids = list(new_ids[0])
                else:
                    st.block_ids.extend(new_ids[0])
            self._plan_store(st, cached.num_computed_tokens[i] + scheduled.get(rid, 0), keys_out, gpu_out)
        self._put(keys_out, gpu_out, step)
        if self._finish_puts:  # planned when their requests finished, i.e. in an earlier step
            first = min(s for _, _, s in self._finish_puts)
            self._put([k for ks, _, _ in self._finish_puts for k in ks],
                      [g for _, gs, _ in self._finish_puts for g in gs], first)
            self._finish_puts = []
        stores = self._valid_stores()
        self._drain_finished()
        self.counters.fences += len(fences)
        ext = {j.job_id: self._ext.pop(j.job_id) for j in stores}
        ext.update((j.job_id, self._ext.pop(j.job_id)) for j in self._early if j.job_id in self._ext)
        plan = StepPlan(step, self._early, stores, ext, sorted(fences), self._loads, self._load_fail, self._sync,
                        self._sync_fail)
        if plan.early or plan.stores or plan.fences:
            log.debug("step %d: %d early jobs, %d store jobs (%d keys), %d fences, %d in flight", step,
                      len(plan.early), len(stores), sum(len(j) for j in stores), len(plan.fences),
                      self.chain.inflight())
        self._early, self._loads, self._load_fail, self._sync, self._sync_fail = [], {}, {}, [], []
        return plan

    def _put(self, keys: list[bytes], gpu: list[int], step: int) -> None:
        if not keys:
            return
        hid = next(self._handle_ids)
        self._puts[hid] = _Put(gpu, step)
        self.counters.store_chunks += len(keys)
        self._route(self.chain.put(keys, hid))

    def _allocated_now(self, ids: list[int], step: int, fences: set[int]) -> None:
        if self._watching:  # only stores planned in an earlier step need re-allocation dates
            self._alloc_step.update(dict.fromkeys(ids, step))
        busy = self._gpu_busy
        if busy and not busy.keys().isdisjoint(ids):  # rare: checked at C speed first
            hit = {busy[g] for g in ids if g in busy}
            fences.update(hit)
            self._fenced_jobs.update(hit)

    def _plan_store(self, st: _Req, computed: int, keys_out: list[bytes], gpu_out: list[int]) -> None:
        req = st.request
        if not self.cfg.store_decode_tokens:
            computed = min(computed, req.num_prompt_tokens)
        n = min(computed // self.bs, len(req.block_hashes), len(st.block_ids)) // self.k
        if n > st.stored:
            keys = self._chunk_keys(st, n)
            keys_out.extend(keys[st.stored:n])
            gpu_out.extend(st.block_ids[st.stored * self.k:n * self.k])
            st.stored = n
        if not self.cfg.store_decode_tokens and st.stored >= req.num_prompt_tokens // self.bs // self.k:
            self._storing.pop(req.request_id, None)  # every prompt chunk offered: stop tracking its table

    def _valid_stores(self) -> list[TransferJob]:
        """Stores whose GPU source blocks were not re-allocated since planned; the rest fail now."""
        out: list[TransferJob] = []
        alloc = self._alloc_step
        while self._stores:  # failing a store can grant a waiting one: loop until none is left
            job = self._stores.pop()
            put = self._puts.get(job.handle)
            ids = self._ext[job.job_id]
            # a store planned in this step reads blocks computed in this step: valid by construction
            if put is not None and (put.step == self._step or all(alloc.get(g, 0) <= put.step for g in ids)):
                self._track(job.job_id, ids)
                out.append(job)
                continue
            self.counters.stores_dropped_reused += len(job)
            self._job_kind.pop(job.job_id, None)
            self._ext.pop(job.job_id, None)
            self._route(self.chain.complete(Completion.failed(job, "GPU block re-allocated before the store")))
        return out

    # ------------------------------------------------------------------ routing
    def _route(self, jobs: Iterable[TransferJob]) -> None:
        """Record each job's GPU side (per item, from its handle) and queue it for the next plan."""
        for job in jobs:
            self._job_kind[job.job_id] = (job.kind, job.src_tier)
            if job.kind is JobKind.INGRESS:
                self._ext[job.job_id] = self._items(self._puts[job.handle].gpu, job.src_slots)
                self._stores.append(job)
            elif job.kind is JobKind.EGRESS:
                ext = self._ext[job.job_id] = self._items(self._gets[job.handle], job.dst_slots)
                self._track(job.job_id, [g for g in ext if g >= 0])
                self._early.append(job)
            else:
                self._early.append(job)

    def _items(self, gpu: list[int], items: list[int]) -> list[int]:
        """The flat GPU ids of ``items`` (indices into a handle's keys), in item order."""
        k = self.k
        if items and len(items) * k == len(gpu) and items[0] == 0 and items[-1] == len(items) - 1:
            return gpu  # the whole handle in order: the common case, no copy
        out: list[int] = []
        for i in items:
            out.extend(gpu[i * k:(i + 1) * k])
        return out

    def _track(self, job_id: int, gpu_ids: list[int]) -> None:
        """Mark ``gpu_ids`` as touched by ``job_id`` (the newest job wins: an older job on a block was
        fenced when vLLM re-allocated that block, which is the only way a block gets a new job)."""
        self._job_gpu[job_id] = gpu_ids
        self._gpu_busy.update(dict.fromkeys(gpu_ids, job_id))

    def _untrack(self, job_id: int) -> None:
        busy = self._gpu_busy
        for g in self._job_gpu.pop(job_id, ()):
            if busy.get(g) == job_id:
                del busy[g]

    def _drain_finished(self) -> None:
        for hid, _ in self.chain.take_finished():
            self._puts.pop(hid, None)
            self._gets.pop(hid, None)

    # ------------------------------------------------------------------ completions
    def apply_reports(self, reports: dict[int, JobReport]) -> None:
        """Fold in worker reports; a job completes once all TP ranks reported it."""
        tp = self.geo.tp_size
        for job_id, rep in reports.items():
            acc = self._reports.get(job_id)
            if acc is None:
                acc = self._reports[job_id] = JobReport(0, list(rep.ok), list(rep.corrupt))
            acc.merge(rep)
            if acc.count < tp:
                continue
            del self._reports[job_id]
            self._complete(job_id, acc)
        self._drain_finished()

    def _complete(self, job_id: int, rep: JobReport) -> None:
        kind_src = self._job_kind.pop(job_id, None)
        if kind_src is None:
            log.warning("TieredKVConnector: report for unknown job %d ignored", job_id)
            return
        kind, src = kind_src
        fenced = job_id in self._fenced_jobs
        self._fenced_jobs.discard(job_id)
        self._untrack(job_id)
        if kind is JobKind.EGRESS:
            self.counters.bytes_loaded += rep.nbytes
            if src == DISK and rep.seconds > 0 and rep.nbytes > 0:
                gbps = rep.nbytes / rep.seconds / 1e9  # ranks read their shares in parallel
                self._disk_gbps = 0.8 * self._disk_gbps + 0.2 * gbps
        elif kind is JobKind.INGRESS:
            self.counters.bytes_stored += rep.nbytes
        if not all(rep.ok) and kind is JobKind.INGRESS and fenced:
            log.debug("store job %d dropped %d of %d chunks: vLLM re-allocated its blocks before the copy began",
                      job_id, len(rep.ok) - sum(rep.ok), len(rep.ok))
        elif not all(rep.ok):
            log.warning("TieredKVConnector: %s job %d: %d of %d items failed", kind.name, job_id,
                        len(rep.ok) - sum(rep.ok), len(rep.ok))
        else:
            log.debug("job %d (%s) done: %d items, %d bytes", job_id, kind.name, len(rep.ok), rep.nbytes)
        self._route(self.chain.complete(Completion(job_id, rep.ok, rep.corrupt, rep.nbytes, rep.seconds)))

    # ------------------------------------------------------------------ lifecycle
    def finished(self, request, block_ids: Sequence[int]) -> None:
        """A request finished (or was aborted): forget it; with ``on_finish`` stores, plan its chunks."""
        st = self._reqs.pop(request.request_id, None)
        self._storing.pop(request.request_id, None)
        if st is None or self.cfg.store_policy != "on_finish":
            return
        computed = request.num_computed_tokens
        if not self.cfg.store_decode_tokens:
            computed = min(computed, request.num_prompt_tokens)
        n = min(computed // self.bs, len(request.block_hashes), len(block_ids)) // self.k
        if n > st.stored:
            keys = self._chunk_keys(st, n)
            # vLLM frees the blocks now: the store stays valid only while they are not re-allocated
            # after this step, which _valid_stores checks
            self._finish_puts.append((keys[st.stored:n], list(block_ids[st.stored * self.k:n * self.k]),
                                      self._step))

    def has_pending_work_to_ship(self) -> bool:
        """True while planned jobs wait for the next plan (in-flight jobs do not count: no busy stepping)."""
        return bool(self._early or self._stores or self._finish_puts or self._loads)

    def store_stats(self) -> dict:
        """The planner's numbers in ``TieredStore.stats()``'s shape, for ``tiered_kv.store.metrics`` (Prometheus).

        Block counts are chunks; bytes are whole-engine (all TP ranks).
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
                "inflight_jobs": c.inflight(), "tiers": tiers}

    def stats(self) -> dict:
        """Planner state for tests, logs and vLLM's connector stats (zero in flight when idle)."""
        c = self.chain
        out = {f"sched_{k}": v for k, v in vars(self.counters).items()}
        out.update({
            "inflight_jobs": c.inflight(), "pinned": c.pinned(), "waiting": c.waiting(),
            "gpu_blocks_busy": len(self._gpu_busy), "tracked_requests": len(self._reqs) + len(self._storing),
            "open_puts": len(self._puts), "open_gets": len(self._gets), "unshipped_ext": len(self._ext),
            "resident_cpu": c.resident(CPU), "resident_disk": c.resident(DISK) if c.num_tiers > 1 else 0,
            "disk_gbps_estimate": round(self._disk_gbps, 3),
        })
        for i, tc in enumerate(c.tier_counters):
            name = c.specs[i].name
            out.update({f"{name}_{k}": v for k, v in vars(tc).items()})
        return out


def _resumed_ids(cached) -> set[str]:
    """Requests whose ``new_block_ids`` replace (not extend) their block table, in both vLLM versions."""
    resumed = getattr(cached, "resumed_req_ids", None)  # version probe, kept to this one function
    if resumed is not None:
        return set(resumed)
    flags = getattr(cached, "resumed_from_preemption", None)  # older vLLM: one bool per cached request
    if flags is not None:
        return {rid for rid, f in zip(cached.req_ids, flags) if f}
    raise ConfigError("TieredKVConnector: this vLLM's CachedRequestData has neither resumed_req_ids nor "
                      "resumed_from_preemption; unsupported vLLM version")
