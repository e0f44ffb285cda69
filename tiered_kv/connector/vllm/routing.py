"""Job routing on the vLLM scheduler side: every job the ``TierChain`` plans passes here on its way to the workers.

The chain names a job's engine side only by its handle and item numbers; ``JobRouter`` remembers, per open
handle, where the items' KV sits on the GPU (``puts``: a planned store, ``gets``: a planned load) and turns
each job into its flat GPU block ids (``ext``, ``Geometry.slot_blocks`` per item), queued for the next
``StepPlan``: loads and tier moves as ``early`` jobs, stores (which read this step's KV) as ``stores``. A
store planned in an earlier step is handed out only if none of its blocks was re-allocated since
(``take_valid_stores``, with ``BlockTracker``'s dates); the rest fail at once. ``take_plan`` hands out
everything routed since the last plan.

Threading contract: vLLM's scheduler thread only; no I/O, no torch.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from tiered_kv.planner.chain import TierChain
from tiered_kv.values.jobs import Completion, JobKind, TransferJob
from tiered_kv.connector.vllm.blocks import BlockTracker
from tiered_kv.connector.vllm.common import StepPlan
from tiered_kv.connector.vllm.state import PlannerCounters, RequestState

log = logging.getLogger(__name__)


class PlannedPut:
    """One planned store (a ``TierChain.put`` handle): where its items' KV sits on the GPU."""

    __slots__ = ("gpu", "step", "reqs", "holes")

    def __init__(self, gpu: list[int], step: int, reqs: Sequence[str], holes: bool) -> None:
        self.gpu = gpu  # Geometry.slot_blocks GPU block ids per item, flat
        self.step = step  # the step the source blocks were last known to hold this KV
        self.reqs = reqs  # the requests whose blocks it reads ((): already freed, e.g. on_finish)
        self.holes = holes  # gpu may hold -1 (a block to leave alone); False: every id is a block


class JobRouter:
    """Open handles' GPU sides, and the jobs routed since the last ``StepPlan`` (see the module)."""

    def __init__(self, chain: TierChain, slot_blocks: int, single: bool, blocks: BlockTracker,
                 counters: PlannerCounters) -> None:
        self.chain = chain
        self._w = slot_blocks  # GPU ids per item of a job
        self._single = single  # one full-attention (or MLA) group
        self._blocks = blocks
        self._track = blocks.track
        self.counters = counters
        self.handle_ids = iter(range(1, 1 << 62))
        self.puts: dict[int, PlannedPut] = {}
        self.gets: dict[int, list[int]] = {}  # handle -> its items' GPU ids, flat
        self.promotions: dict[int, RequestState] = {}  # prefetch handle -> the request waiting for it
        self.early: list[TransferJob] = []
        self.stores: list[TransferJob] = []
        self.ext: dict[int, list[int]] = {}  # job id -> its items' GPU ids (flat), until handed out
        self.loads: dict[str, list[int]] = {}
        self.load_fail: dict[str, list[int]] = {}
        self.sync: list[int] = []
        self.sync_fail: list[int] = []
        self._routing_req: str | None = None  # the request whose blocks the jobs being routed touch (loads)

    def route(self, jobs: Iterable[TransferJob]) -> None:
        """Record each job's GPU side (per item, from its handle) and queue it for the next plan."""
        for job in jobs:
            if job.kind is JobKind.INGRESS:
                self.ext[job.job_id] = self._items(self.puts[job.handle].gpu, job.src_slots)
                self.stores.append(job)
            elif job.kind is JobKind.EGRESS:
                ext = self.ext[job.job_id] = self._items(self.gets[job.handle], job.dst_slots)
                rid = self._routing_req
                self._track(job.job_id, [g for g in ext if g >= 0], (rid,) if rid is not None else ())
                self.early.append(job)
            else:
                self.early.append(job)

    def _items(self, gpu: list[int], items: list[int]) -> list[int]:
        """The flat GPU ids of ``items`` (indices into a handle's keys), in item order."""
        k = self._w
        if items and len(items) * k == len(gpu) and items[0] == 0 and items[-1] == len(items) - 1:
            return gpu  # the whole handle in order: the common case, no copy
        out: list[int] = []
        for i in items:
            out.extend(gpu[i * k:(i + 1) * k])
        return out

    def route_loads(self, rid: str, jobs: list[TransferJob]) -> None:
        """Route a hit's jobs: its loads write blocks request ``rid`` holds."""
        self._routing_req = rid
        try:
            self.route(jobs)
        finally:
            self._routing_req = None
        self.drain_finished()

    def drain_finished(self) -> None:
        """Close the handles the chain finished; a request whose promotion ran takes what the CPU tier holds."""
        for hid, _ in self.chain.take_finished():
            self.puts.pop(hid, None)
            self.gets.pop(hid, None)
            st = self.promotions.pop(hid, None)
            if st is not None:  # its next match takes what the CPU tier holds now
                st.promoting = 0
                st.promoted = True

    def take_valid_stores(self, step: int) -> list[TransferJob]:
        """Stores whose GPU source blocks were not re-allocated since planned; the rest fail now."""
        out: list[TransferJob] = []
        alloc = self._blocks.alloc_step
        while self.stores:  # failing a store can grant a waiting one: loop until none is left
            job = self.stores.pop()
            put = self.puts.get(job.handle)
            ids = self.ext[job.job_id]
            # a store planned in this step reads blocks computed in this step: valid by construction
            if put is not None and (put.step == step or all(alloc.get(g, 0) <= put.step for g in ids)):
                # planned in this step: its requests still hold the blocks; later: they may have let go since
                self._track(job.job_id, ids if self._single and not put.holes else [g for g in ids if g >= 0],
                            put.reqs if put.step == step else ())
                out.append(job)
                continue
            self.counters.stores_dropped_reused += len(job)
            self.ext.pop(job.job_id, None)
            self.route(self.chain.complete(Completion.failed(job, "GPU block re-allocated before the store")))
        return out

    def take_plan(self, step: int, stores: list[TransferJob], fences: set[int], tokens: int | None = None
                  ) -> StepPlan:
        """Hand out every job routed since the last plan, with ``stores`` (valid ones) and ``fences``; ``tokens``:
        what vLLM scheduled in the step (``StepPlan.tokens``)."""
        ext = {j.job_id: self.ext.pop(j.job_id) for j in stores}
        if self.early:
            ext.update((j.job_id, self.ext.pop(j.job_id)) for j in self.early if j.job_id in self.ext)
        plan = StepPlan(step, self.early, stores, ext, sorted(fences), self.loads, self.load_fail, self.sync,
                        self.sync_fail, tokens)
        if (plan.early or plan.stores or plan.fences) and log.isEnabledFor(logging.DEBUG):
            log.debug("step %d: %d early jobs, %d store jobs (%d keys), %d fences, %d in flight", step,
                      len(plan.early), len(stores), sum(len(j) for j in stores), len(plan.fences),
                      self.chain.inflight())
        self.early, self.loads, self.load_fail, self.sync, self.sync_fail = [], {}, {}, [], []
        return plan

    def pending(self) -> bool:
        """Jobs routed and not yet handed out (stores waiting for room count too)."""
        return bool(self.early or self.stores or self.loads)
