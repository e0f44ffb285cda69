"""GPU blocks on the vLLM scheduler side: which in-flight job touches which block, and when vLLM re-allocated one.

vLLM frees a request's blocks without waiting for the connector, so the planner never delays a free; it
protects the jobs instead. ``BlockTracker`` keeps:

- per in-flight job the GPU blocks it reads or writes (``track``), and, once the blocks may change hands,
  which job is the newest on each block (``publish``, a list indexed by block id): a block vLLM hands out
  again while a published job still touches it puts that job in the next plan's fences (``allocated_now``);
- the step each block was last (re-)allocated, while stores planned in an earlier step wait (``watching``):
  such a store is handed out only if none of its blocks was re-allocated since it was planned
  (``JobRouter.take_valid_stores``);
- sliding-window groups' block owners: vLLM frees a running request's out-of-window blocks without telling
  the connector, so table entries re-allocated since are zeroed before any store reads them.

With one full-attention (or MLA) group vLLM re-allocates a block only after the request holding it finished
or was preempted, so a job's blocks are published only then (``release``): most jobs end first, with no
per-block dictionary work. Sliding windows free blocks mid-request: those jobs publish at once.

Threading contract: vLLM's scheduler thread only; no I/O, no torch.
"""
from __future__ import annotations

from collections.abc import Sequence
from operator import itemgetter

from tiered_kv.connector.vllm.geometry import Geometry
from tiered_kv.connector.vllm.state import PlannerCounters, RequestState


class BlockTracker:
    """In-flight jobs' GPU blocks, re-allocation dates and sliding-window block owners (see the module)."""

    def __init__(self, geo: Geometry, counters: PlannerCounters) -> None:
        self._groups = geo.groups
        self._single = not geo.parts
        self._swa = [i for i, g in enumerate(geo.groups) if g.kind == "swa"]  # groups that lose blocks mid-request
        self.counters = counters
        self.owner: dict[int, tuple[RequestState, int, int]] = {}  # sliding-window block -> (request, group, pos)
        self.alloc_step: dict[int, int] = {}  # GPU block -> last step it was (re)allocated (while watching)
        self.watching = False  # stores planned in an earlier step wait: record re-allocation dates
        # GPU block id -> newest published in-flight job touching it, 0 for none (job ids start at 1): a list indexed
        # by block id, grown on demand, so publishing a job's blocks is a store per block with no hashing
        self.gpu_busy: list[int] = []
        self.job_gpu: dict[int, list[int]] = {}
        self._lazy_busy = self._single  # publish a job's blocks only once a request holding them lets go
        self.published: set[int] = set()  # in-flight jobs whose blocks are in gpu_busy
        self.req_jobs: dict[str, list[int]] = {}  # request -> its unpublished in-flight jobs (may list ended ones)
        self.fenced_jobs: set[int] = set()  # jobs named in a fence: a store among them may come back cancelled

    # ------------------------------------------------------------------ allocations
    def scan(self, scheduler_output, step: int, fences: set[int]) -> None:
        """Every block vLLM handed out in this step: fence published jobs on them, date them while watching,
        and drop stale sliding-window table entries (before any store of this step reads them)."""
        if self._single:
            # One group: a block allocation matters only to re-allocation dates (while watching) and to published
            # in-flight jobs (fences); with neither, decode steps skip the scan of every running request's new
            # blocks. With either, every block handed out this step is checked in one call.
            if not (self.watching or self.published):
                return
            gi = self._groups[0].index
            fresh: list[int] = []
            for new in scheduler_output.scheduled_new_reqs:
                fresh += new.block_ids[gi]
            for new_ids in filter(None, scheduler_output.scheduled_cached_reqs.new_block_ids):  # None: no new block
                fresh += new_ids[gi]
            if fresh:
                self.allocated_now({gi: fresh}, step, fences)
            return
        for new in scheduler_output.scheduled_new_reqs:
            self.allocated_now(new.block_ids, step, fences)
        for new_ids in scheduler_output.scheduled_cached_reqs.new_block_ids:
            if new_ids is not None:
                self.allocated_now(new_ids, step, fences)

    def allocated_now(self, block_ids, step: int, fences: set[int]) -> None:
        """Blocks vLLM (re-)allocated this step, one list per KV cache group: fence in-flight jobs on them,
        and zero the stale entries sliding-window tables still hold for them."""
        for g in self._groups:
            ids = block_ids[g.index]
            if not ids:
                continue
            if self.watching:  # only stores planned in an earlier step need re-allocation dates
                self.alloc_step.update(dict.fromkeys(ids, step))
            if self.published:  # rare: jobs usually end before the requests holding their blocks let go
                hit = self.busy_jobs(ids)
                if hit:
                    fences.update(hit)
                    self.fenced_jobs.update(hit)
            owner = self.owner
            if owner and not owner.keys().isdisjoint(ids):
                for b in ids:
                    o = owner.pop(b, None)
                    if o is not None and o[0].tables[o[1]][o[2]] == b:
                        o[0].tables[o[1]][o[2]] = 0  # vLLM freed it from that request and handed it on
                        self.counters.stale_blocks_dropped += 1

    # ------------------------------------------------------------------ block tables
    def set_tables(self, st: RequestState, tables: list[list[int]]) -> None:
        """Give ``st`` new block tables (a new or resumed request)."""
        if not self._swa:  # no sliding window: no block owners to keep
            st.tables = tables
            return
        self.disown(st)
        st.tables = tables
        self._own(st, [0] * len(tables))

    def extend_tables(self, st: RequestState, block_ids) -> None:
        """Append the blocks vLLM added to a running request (one list per KV cache group)."""
        if self._single:
            st.tables[0].extend(block_ids[self._groups[0].index])
            return
        starts = [len(t) for t in st.tables]
        for t, g in zip(st.tables, self._groups):
            t.extend(block_ids[g.index])
        self._own(st, starts)

    def _own(self, st: RequestState, starts: list[int]) -> None:
        """Remember which request holds each sliding-window block not stored yet (see ``allocated_now``)."""
        for gi in self._swa:
            table, k = st.tables[gi], self._groups[gi].chunk_blocks
            owner = self.owner
            for pos in range(max(starts[gi], st.stored * k), len(table)):
                b = table[pos]
                if b:
                    owner[b] = (st, gi, pos)

    def disown(self, st: RequestState) -> None:
        """Forget the sliding-window blocks ``st`` holds (it finished, or stored every prompt chunk)."""
        owner = self.owner
        if not owner:
            return
        for gi in self._swa:
            if gi < len(st.tables):
                for b in st.tables[gi]:
                    o = owner.get(b)
                    if o is not None and o[0] is st:
                        del owner[b]

    # ------------------------------------------------------------------ in-flight jobs
    def track(self, job_id: int, gpu_ids: list[int], reqs: Sequence[str] = ()) -> None:
        """Remember that ``job_id`` touches ``gpu_ids``, which ``reqs`` hold (() or several groups: publish
        them to ``gpu_busy`` now; else when one of ``reqs`` finishes or is preempted, see ``release``)."""
        self.job_gpu[job_id] = gpu_ids
        if self._lazy_busy and reqs:
            req_jobs = self.req_jobs
            for rid in reqs:
                jobs = req_jobs.get(rid)
                if jobs is None:
                    req_jobs[rid] = [job_id]
                else:
                    jobs.append(job_id)
        else:
            self.publish(job_id, gpu_ids)

    def publish(self, job_id: int, gpu_ids: list[int]) -> None:
        """Put ``gpu_ids`` in ``gpu_busy`` under ``job_id`` (the newest job wins: an older job on a block was
        fenced when vLLM re-allocated that block, which is the only way a block gets a new job)."""
        busy = self.gpu_busy
        try:
            for g in gpu_ids:
                busy[g] = job_id
        except IndexError:  # a block id past the list: grow it to the largest one and store them all
            self._cover(gpu_ids)
            for g in gpu_ids:
                busy[g] = job_id
        self.published.add(job_id)

    def _cover(self, ids: list[int]) -> None:
        """Grow ``gpu_busy`` (0: no job) so that every block id in ``ids`` indexes it, to twice that: vLLM hands
        out fresh block ids in rising order, and each miss costs an exception and a second look."""
        busy = self.gpu_busy
        busy.extend([0] * (2 * (max(ids) + 1) - len(busy)))

    def busy_jobs(self, ids: list[int]) -> set[int]:
        """The published in-flight jobs touching any of the GPU blocks ``ids``."""
        busy = self.gpu_busy
        try:
            jobs = itemgetter(*ids)(busy) if len(ids) > 1 else (busy[ids[0]],)
        except IndexError:  # an id past every published block (not busy): grow the list to cover it, look again
            self._cover(ids)
            jobs = itemgetter(*ids)(busy) if len(ids) > 1 else (busy[ids[0]],)
        if jobs.count(0) == len(jobs):  # none busy (the usual answer): no set to build
            return set()
        hit = set(jobs)
        hit.discard(0)
        return hit

    def release(self, rid: str) -> None:
        """Request ``rid`` let its blocks go (finished, aborted, preempted): publish its in-flight jobs' blocks,
        so a re-allocation of any of them fences the job."""
        jobs = self.req_jobs.pop(rid, None)
        if jobs:
            job_gpu, published = self.job_gpu, self.published
            for job_id in jobs:
                ids = job_gpu.get(job_id)
                if ids is not None and job_id not in published:
                    self.publish(job_id, ids)

    def untrack(self, job_id: int) -> bool:
        """``job_id`` ended: forget its blocks. True when a fence named it (a store may come back cancelled)."""
        fenced = job_id in self.fenced_jobs
        self.fenced_jobs.discard(job_id)
        ids = self.job_gpu.pop(job_id, ())
        if job_id in self.published:
            self.published.discard(job_id)
            busy = self.gpu_busy
            for g in ids:
                if busy[g] == job_id:
                    busy[g] = 0
        return fenced

    def busy_count(self) -> int:
        """GPU blocks under a published job plus jobs tracked (zero when idle)."""
        return len(self.gpu_busy) - self.gpu_busy.count(0) + len(self.job_gpu)
