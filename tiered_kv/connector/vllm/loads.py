"""Load planning on the vLLM scheduler side: a hit's chunks into the GPU blocks vLLM allocated for it.

``LoadPlanner.allocated`` runs once vLLM allocated a request's blocks after a hit ``match`` reported: it
asks the ``TierChain`` for the hit's keys (a ``get`` handle whose items' GPU ids are the blocks vLLM holds
for them, -1 where vLLM holds the KV already) and hands the load jobs to this step (in-step loads,
``StepPlan.sync``: every chunk a ready CPU copy, or a disk record read under the forward, matched in this same
``schedule()`` call) or to the
request's asynchronous loads (``StepPlan.loads``, reported in ``finished_recving``). A chunk that vanished
since the lookup is reported as failed blocks, so vLLM recomputes from there (one group only: with several
groups vLLM takes no block errors, and every load comes from a ready CPU copy). A tail piece loads into the
first blocks of its slot.

It also counts the split gate's plan for the hit once vLLM allocated the request (``RequestState.split``: the
tokens loaded and recomputed per tier), keeps each request's prefix in order in the CPU tier's eviction policy
(``refresh``), and feeds what completed loads measured back to the split's read rates per tier and the adaptive
load budget (``load_done``), and what completed writes to a tier measured to its read rate while that is a guess
(``write_done``). Per step it sums the bytes the in-step hits load per tier and what their plans priced beyond
compute (``take_in_step``): the step's forward time then measures what those loads cost it (``prefill.StepMeter``,
``SplitGate.observe_loaded_step``).

Threading contract: vLLM's scheduler thread only; no I/O, no torch.
"""
from __future__ import annotations

from tiered_kv.planner.chain import TierChain
from tiered_kv.planner.gate import SplitGate
from tiered_kv.values.jobs import JobKind, TransferJob
from tiered_kv.connector.vllm.admission import StepLoadBudget
from tiered_kv.connector.vllm.common import CPU, JobReport
from tiered_kv.connector.vllm.geometry import Geometry
from tiered_kv.connector.vllm.parts import PartPlanner
from tiered_kv.connector.vllm.prefill import tier_names
from tiered_kv.connector.vllm.routing import JobRouter
from tiered_kv.connector.vllm.state import PlannerCounters, RequestState, RequestTable


class LoadPlanner:
    """``allocated``: plan the loads of the hit the last ``match`` found (see the module)."""

    def __init__(self, geo: Geometry, chain: TierChain, requests: RequestTable, router: JobRouter,
                 parts: PartPlanner | None, gate: SplitGate, budget: StepLoadBudget | None,
                 counters: PlannerCounters) -> None:
        self.geo = geo
        self.bs = geo.block_size
        self.k = geo.chunk_blocks
        self.w = geo.slot_blocks  # GPU ids per item of a job
        self.chunk = geo.chunk_tokens
        self.chain = chain
        self._requests = requests
        self._router = router
        self._parts = parts
        self._gate = gate
        self._tier_names = tier_names(chain)
        self._budget = budget
        self.counters = counters
        self.async_cpu_loads: set[int] = set()  # adaptive: asynchronous CPU-tier loads (their rate feeds the budget)
        # this step's in-step loads: bytes per tier, and the seconds their plans priced beyond compute
        self._in_step_bytes: dict[str, float] = {}
        self._in_step_exposed = 0.0

    def allocated(self, request, block_ids, num_external_tokens: int) -> None:
        """vLLM allocated ``block_ids`` (all of the request's blocks, one list per KV cache group) after a
        hit of ``num_external_tokens``."""
        st = self._requests.state(request)
        split = None
        if st.split is not None:  # the plan of the match vLLM took: count it once
            self._gate.count(*st.split)
            split = st.split[0]
            st.split = None
        if num_external_tokens <= 0:
            return
        if st.sync and split is not None:
            self._note_in_step(split)
        if self._parts is not None:
            self._allocated_parts(st, block_ids, num_external_tokens)
            return
        c0, whole, local = st.lookup
        end_blocks = (local + num_external_tokens) // self.bs
        n = min(whole, end_blocks // self.k - c0)
        tables = self._requests.tables(block_ids)
        gpu = self._load_ids(tables, c0, n, local)
        keys = st.hit_keys[:n]
        tail = st.hit_tail if n == whole and end_blocks >= (c0 + n) * self.k + st.hit_tail else 0
        if tail:  # the piece's m blocks, then -1 for the rest of its slot
            base = (c0 + n) * self.k
            piece = tables[0][base:base + tail]
            skip = local // self.bs - base
            if skip > 0:
                piece[:skip] = [-1] * skip
            gpu = gpu + piece + [-1] * (self.k - tail)
            keys.append(st.hit_keys[n])
            self.counters.tail_hits += 1
        items = n + (1 if tail else 0)
        router = self._router
        hid = next(router.handle_ids)
        router.gets[hid] = gpu
        got, jobs = self.chain.get(keys, hid)
        rid = request.request_id
        if got < items:  # a chunk vanished since the lookup: report its blocks, vLLM recomputes from there
            lost = [g for g in gpu[got * self.w:] if g >= 0]
            if st.sync:
                router.sync_fail.extend(lost)
            else:
                router.load_fail[rid] = lost
            self.counters.failed_load_blocks += len(lost)
        loads = self._plan_loads(st, jobs, num_external_tokens)
        chunk = self.chunk
        for j in loads:
            tokens = 0
            for i in j.dst_slots:
                start = (c0 + i) * chunk
                end = start + (chunk if i < n else tail * self.bs)
                part = end - max(start, min(local, end))
                tokens += part
                if i >= n:
                    self.counters.hit_tokens_tail += part
            if j.src_tier == CPU:
                self.counters.hit_tokens_cpu += tokens
            else:
                self.counters.hit_tokens_disk += tokens
        st.stored = max(st.stored, c0 + min(got, n))
        self.refresh(st)
        router.route_loads(rid, jobs)

    def _allocated_parts(self, st: RequestState, block_ids, num_external_tokens: int) -> None:
        """``allocated`` for hybrid models: load the parts the last match found, every one a ready CPU copy."""
        c0, _, local = st.lookup
        hit, rid = st.parts, st.request.request_id
        end = hit.end * self.chunk + hit.tail * self.bs
        if local + num_external_tokens != end:
            raise RuntimeError(f"TieredKVConnector: vLLM allocated {num_external_tokens} external tokens for request "
                               f"{rid} after {local} local ones, but the hit over parts ends at token "
                               f"{end}; this vLLM version schedules hybrid hits differently")
        gpu = self._parts.load_ids(self._requests.tables(block_ids), hit, c0, local)
        router = self._router
        hid = next(router.handle_ids)
        router.gets[hid] = gpu
        got, jobs = self.chain.get(hit.keys, hid)
        if got < len(hit.keys):  # vLLM calls match and this back to back: cannot happen
            raise RuntimeError(f"TieredKVConnector: {len(hit.keys) - got} part(s) of request {rid} vanished between "
                               f"the lookup and the load; with several KV cache groups vLLM takes no block errors")
        if not st.sync:
            self._requests.async_waiting.add(rid)  # until vLLM schedules it (``SchedulerPlanner.build``)
        self._plan_loads(st, jobs, num_external_tokens)
        self.counters.hit_tokens_cpu += num_external_tokens  # several groups load only from the CPU tier
        if hit.tail:
            self.counters.tail_hits += 1
            self.counters.hit_tokens_tail += end - max(local, hit.end * self.chunk)
        st.stored = max(st.stored, hit.end)
        st.parts = None
        st.owned += hit.keys
        self.refresh(st)
        router.route_loads(rid, jobs)

    def _load_ids(self, tables: list[list[int]], c0: int, n: int, local: int) -> list[int]:
        """One group: GPU ids a load of chunks ``[c0, c0+n)`` fills, ``chunk_blocks`` per chunk; -1 for the
        blocks vLLM holds already (``local`` tokens)."""
        k = self.k
        out = list(tables[0][c0 * k:(c0 + n) * k])
        skip = local // self.bs - c0 * k
        if skip > 0 and out:
            out[:skip] = [-1] * skip
        return out

    def _note_in_step(self, split) -> None:
        """An in-step hit's plan: its bytes load inside this step (CPU copies, slow-tier reads under the forward). A
        hybrid model loads only from the CPU tier (its disk parts were promoted first, the plan still names them)."""
        loaded = split.loaded_bytes()
        if loaded and self._parts is not None:
            loaded = {self._tier_names[CPU]: sum(loaded.values())}
        if loaded:
            for t, n in loaded.items():
                self._in_step_bytes[t] = self._in_step_bytes.get(t, 0.0) + n
            self._in_step_exposed += split.seconds_exposed

    def take_in_step(self) -> tuple[dict[str, float], float] | None:
        """The step being built: the bytes its in-step loads move per tier (the CPU tier's copies, slow tiers' reads
        under the forward) and the seconds their plans priced beyond compute; None when it loads none. Resets for the
        next step."""
        if not self._in_step_bytes:
            return None
        out = (self._in_step_bytes, self._in_step_exposed)
        self._in_step_bytes, self._in_step_exposed = {}, 0.0
        return out

    def _plan_loads(self, st: RequestState, jobs: list[TransferJob], tokens: int) -> list[TransferJob]:
        """Hand a hit's load jobs to this step (in-step) or to the request's asynchronous loads; returns them."""
        loads = [j for j in jobs if j.kind is JobKind.EGRESS]
        router = self._router
        if st.sync:
            # matched in this same schedule() call, so every chunk is still a READY CPU copy (or, with
            # disk_overlap_bytes, a disk record read under the forward): one EGRESS job per source tier, which the
            # workers run before/alongside this step's forward
            router.sync.extend(j.job_id for j in loads)
            self.counters.sync_loads += len(loads)
            st.sync = False
            if self._budget is not None:
                self._budget.charge(self.geo.hit_nbytes(tokens))
        else:
            router.loads.setdefault(st.request.request_id, []).extend(j.job_id for j in loads)
            if self._budget is not None:
                self.async_cpu_loads.update(j.job_id for j in loads if j.src_tier == CPU)
        self.counters.load_jobs += len(loads)
        return loads

    def refresh(self, st: RequestState) -> None:
        """Order the request's prefix in the CPU tier's eviction policy deepest first (its first chunk the most
        recently used): a full tier then evicts the least recently used prefix from its end, so it still
        hits what is left. (In chunk order, eviction took each prefix's first chunk, which makes the rest
        useless, and the next recompute evicted the next prefix's first chunk: under a cyclic workload
        every lookup missed.)"""
        keys = st.owned if self._parts is not None else st.keys[:st.stored]
        if keys:
            self.chain.touch(reversed(keys))

    def load_done(self, job: TransferJob, rep: JobReport) -> None:
        """A load job (``EGRESS``: into GPU blocks; ``PROMOTE``: up a tier) completed on every rank: count a GPU
        load's bytes and feed its rate to the budget; feed a read from a disk or remote tier into GPU blocks, or into
        the CPU tier for a reader (a hybrid hit's promotion before its load), to the split's rate of that tier (the
        ranks read their shares in parallel: every rank's bytes over the slowest rank's seconds; one rank's where
        each holds the whole, replicated KV)."""
        egress = job.kind is JobKind.EGRESS
        if egress:
            self.counters.bytes_loaded += rep.nbytes
            job_id = job.job_id
            if self.async_cpu_loads and job_id in self.async_cpu_loads:
                self.async_cpu_loads.discard(job_id)
                if all(rep.ok):  # the ranks loaded in parallel: per-rank bytes over the slowest rank's time
                    self._budget.observe(rep.nbytes // max(1, rep.count), rep.seconds)
        # a promotion only for placement (``promote_on_hit``: one chunk, beside the disk workers' other jobs) is not a
        # read the split plans: on a CPU box its rate was ~7x below the overlapped loads' in the same run
        if job.src_tier != CPU and (egress or (job.dst_tier == CPU and self.chain.for_reader(job.job_id))):
            # a replicated KV (MLA at TP > 1): every rank read the whole record, the gate prices one copy
            nbytes = rep.nbytes // max(1, rep.count) if self.geo.replicated else rep.nbytes
            self._gate.observe_reads({self._tier_names[job.src_tier]: nbytes}, rep.seconds)
            c = self.counters  # what each kind of read showed (PlannerCounters), as ``observe_reads`` takes them
            if nbytes > 0 and rep.seconds > 0:
                if egress:
                    c.rate_reads_gpu += 1
                    c.rate_read_bytes_gpu += nbytes
                    c.rate_read_seconds_gpu += rep.seconds
                else:
                    c.rate_reads_cpu += 1
                    c.rate_read_bytes_cpu += nbytes
                    c.rate_read_seconds_cpu += rep.seconds

    def write_done(self, job: TransferJob, rep: JobReport) -> None:
        """A demotion or write-through (CPU tier -> disk or remote) completed on every rank: before the tier's first
        measured read, its write rate bounds the split's built-in read-rate guess (``ReadRate.hint``)."""
        if job.src_tier == CPU and job.dst_tier != CPU and all(rep.ok) and rep.nbytes > 0:
            self._gate.hint_writes({self._tier_names[job.dst_tier]: rep.nbytes}, rep.seconds)
