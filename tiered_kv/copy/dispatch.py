"""GPU side of a copier: choose the descriptor form and mechanism, plan and enqueue.

Role: everything ``BlockCopier`` does with CUDA once the block ids are
validated. ``decide`` runs on the caller's thread and only does arithmetic on
per-layout constants (descriptors per block), so a call returns in well under a
millisecond whatever its size. ``submit`` runs on the submitter thread: it
plans the byte runs slice by slice (8 blocks first, doubling to 512) and hands
each slice to the driver before planning the next, so the first bytes move
about 0.1 ms after the call and planning overlaps the transfer.

Descriptor forms (all on the copy engine unless the SM kernel is chosen):
- batched 1-D runs (``cuMemcpyBatchAsync``), adjacent chunks merged;
- 2-D copies (``cuMemcpy2DAsync``), one per pitched rectangle of a block, used
  when the merged runs average ``RECT_MAX_MEAN_RUN`` (32 KiB) or less;
- the SM kernel (``triton_kernel``), by ``select.choose_mechanism``.

Threading: ``decide`` from the copier's caller thread (and from the load
submitter for a staged load that found no device memory for its buffer: the
lazily created engines are then at worst created twice, one is dropped);
``submit`` from one submitter thread per direction (or the caller's, when not
threaded). The engines are created on the caller's thread before the first job
needs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tiered_kv.copy.errors import BackendUnavailableError
from tiered_kv.copy.layouts import KVLayout
from tiered_kv.copy.segments import ChunkTable, RectTable, Runs, block_runs, merge_runs, plan_rects, plan_runs
from tiered_kv.copy.select import Mechanism, SelectionPolicy, choose_mechanism

if TYPE_CHECKING:
    from tiered_kv.copy.engine import BatchMemcpy, RectMemcpy

#: One ``cuMemcpy2DAsync`` call costs about this many batched descriptors of CPU time.
RECT_CALL_COST = 4
#: 2-D copies only pay when 1-D runs are this small or smaller: the copy engine moves
#: pitched rows a little slower than batched runs (H200: 50 vs 54 GB/s for 64 KiB rows),
#: but batched runs of 32 KiB and less are bound by the driver's per-descriptor cost
#: (and swing 22-50 GB/s from run to run with the host's speed; 2-D holds 35-42).
RECT_MAX_MEAN_RUN = 32 * 1024
FIRST_SLICE_BLOCKS = 8
MAX_SLICE_BLOCKS = 512


@dataclass(frozen=True)
class Plan:
    """The caller-side decision for one copy: mechanism, 2-D or not, descriptors expected."""

    mechanism: Mechanism
    rects: bool
    descriptors: int


class GpuDispatcher:
    """Per-copier CUDA state: chunk tables, engines, and the per-block descriptor counts."""

    def __init__(self, layout: KVLayout, slab: torch.Tensor, policy: SelectionPolicy, prefer_overlap: bool,
                 max_runs_per_call: int, sm_programs: int, rect_copies: bool | None) -> None:
        """Flatten the layout once; engines are resolved on first use."""
        self.layout = layout
        self.slab = slab
        self.policy = policy
        self.table = ChunkTable.from_layout(layout)
        rows = [0]
        for m in layout.maps:
            rows.append(rows[-1] + len(m.chunk_offsets))
        self._tensor_rows = rows  # chunk-table rows of tensor t: [rows[t], rows[t+1])
        self.rect_table = RectTable.from_chunks(self.table)
        self.runs_per_block = block_runs(self.table)
        self._prefer_overlap = prefer_overlap
        self._max_runs = max_runs_per_call
        self._sm_programs = sm_programs
        self._rect_mode = rect_copies
        self._batch: BatchMemcpy | None = None
        self._rect: RectMemcpy | None = None
        self._sm_ok: bool | None = None

    def decide(self, n: int, forced: Mechanism | None) -> Plan:
        """Choose mechanism and descriptor form for ``n`` blocks; raise if the choice cannot run here."""
        runs = n * self.runs_per_block
        rects = forced in (None, Mechanism.COPY_ENGINE) and self._rects_pay(n, runs)
        ce_cost = n * self.rect_table.count * RECT_CALL_COST if rects else runs
        mech = forced or choose_mechanism(ce_cost, n * self.layout.block_nbytes, self.sm_available(), self.policy)
        if mech is Mechanism.CPU:
            raise BackendUnavailableError("mechanism 'cpu' needs CPU tensors; this layout is on CUDA")
        if mech is Mechanism.SM_KERNEL and not self.sm_available():
            raise BackendUnavailableError("mechanism 'sm_kernel' needs Triton and CUDA")
        rects = rects and mech is Mechanism.COPY_ENGINE
        if mech is Mechanism.COPY_ENGINE:
            self._batch_engine()  # resolve the driver entry point here: a missing one raises in the caller
        return Plan(mech, rects, n * self.rect_table.count if rects else runs)

    def submit(self, plan: Plan, ids: torch.Tensor, slots: torch.Tensor, to_cpu: bool, stream: torch.cuda.Stream) -> int:
        """Plan and enqueue the copy on ``stream``; return the descriptors used."""
        base, pitch = self.slab.data_ptr(), self.slab.stride(0)
        if plan.rects:
            assert self._rect is not None
            rects = plan_rects(self.rect_table, ids, slots, base, pitch)
            self._rect.submit(rects, to_cpu, stream.cuda_stream)
            return rects.count
        if plan.mechanism is Mechanism.SM_KERNEL:
            from tiered_kv.copy import triton_kernel

            runs = plan_runs(self.table, ids, slots, base, pitch, to_cpu)
            triton_kernel.launch(runs, self.layout.device, stream, self._sm_programs)
            return runs.count
        engine = self._batch_engine()
        total, start, step = 0, 0, FIRST_SLICE_BLOCKS
        while start < ids.numel():
            part = slice(start, start + step)
            runs = plan_runs(self.table, ids[part], slots[part], base, pitch, to_cpu)
            engine.submit(runs, stream.cuda_stream)
            total += runs.count
            start += step
            step = min(2 * step, MAX_SLICE_BLOCKS)
        return total

    def plan_groups(self, ids: torch.Tensor, slots: torch.Tensor, to_cpu: bool,
                    groups: list[tuple[int, int]]) -> list[Runs]:
        """The runs of each group of tensors, planned in one pass (a few vectorised ops, any thread).

        A group ``(a, b)`` is tensors ``a..b-1`` of the layout (e.g. one layer of vLLM's per-layer
        views); its runs go block by block, adjacent ones merged.
        """
        base, pitch = self.slab.data_ptr(), self.slab.stride(0)
        t = self.table
        # every chunk of every block at once, (blocks, chunks); a group is a column range, block by
        # block, so a block's chunks of adjacent tensors merge (one run per block and group when
        # vLLM's layers of a block are contiguous, as in its cross-layer tensor)
        gpu = t.gpu_base[None, :] + ids[:, None] * t.gpu_stride[None, :]
        cpu = base + slots[:, None] * pitch + t.slot_offset[None, :]
        src_all, dst_all = (gpu, cpu) if to_cpu else (cpu, gpu)
        out = []
        for a, b in groups:
            cols = slice(self._tensor_rows[a], self._tensor_rows[b])
            out.append(merge_runs(Runs(src_all[:, cols].reshape(-1), dst_all[:, cols].reshape(-1),
                                       t.size[cols].repeat(ids.numel()))))
        return out

    def submit_groups(self, mechanism: Mechanism, planned: list[Runs], stream: torch.cuda.Stream, on_group) -> None:
        """Enqueue planned groups in order on ``stream``; ``on_group(g, descriptors)`` after each.

        Groups land in order, so the caller records one event per group to let a consumer start
        on the first layers while later ones are still moving. 1-D runs (or the SM kernel) only:
        2-D copies span every tensor of a block.
        """
        for g, runs in enumerate(planned):
            if mechanism is Mechanism.SM_KERNEL:
                from tiered_kv.copy import triton_kernel

                triton_kernel.launch(runs, self.layout.device, stream, self._sm_programs)
            else:
                self._batch_engine().submit(runs, stream.cuda_stream)
            on_group(g, runs.count)

    def sm_variants(self) -> set[tuple[int, int]]:
        """The SM kernel's specializations (``triton_kernel.variant``) this layout's copies launch: two blocks' runs
        each way, whole and a layer tensor at a time (the in-step loads' groups), addresses of the real slab and
        engine tensors (pure arithmetic: nothing is copied)."""
        from tiered_kv.copy.triton_kernel import variant

        ids = torch.arange(min(2, self.layout.num_blocks))
        slots = torch.arange(min(2, int(self.slab.shape[0])))
        if ids.numel() == 0 or slots.numel() == 0:
            return set()
        ids, slots = ids[:len(slots)], slots[:len(ids)]
        base, pitch = self.slab.data_ptr(), self.slab.stride(0)
        out = {variant(plan_runs(self.table, ids, slots, base, pitch, to_cpu)) for to_cpu in (False, True)}
        n = len(self.layout.tensors)
        out |= {variant(r) for r in self.plan_groups(ids, slots, False, [(t, t + 1) for t in range(n)]) if r.count}
        return out

    def sm_available(self) -> bool:
        """True when the SM kernel can run (Triton imports, CUDA present)."""
        if self._sm_ok is None:
            from tiered_kv.copy.triton_kernel import triton_available

            self._sm_ok = triton_available()
        return self._sm_ok

    def _rects_pay(self, n: int, runs: int) -> bool:
        if self._rect_mode is False or self.rect_table.count == 0 or n == 0:
            return False
        if self._rect_mode is None and (
            self.rect_table.count * n * RECT_CALL_COST >= runs or n * self.layout.block_nbytes > RECT_MAX_MEAN_RUN * runs
        ):
            return False
        if self._rect is None:
            from tiered_kv.copy.engine import RectMemcpy

            self._rect = RectMemcpy(self.layout.device)
        return int(self.rect_table.pitch.max()) <= self._rect.max_pitch

    def prepare(self) -> None:
        """Bind the driver's batched copy (``engine.BatchMemcpy``: cuda-python's import, ``cuGetProcAddress``) now,
        not at the first copy-engine copy; ``BackendUnavailableError`` where it cannot be bound."""
        self._batch_engine()

    def _batch_engine(self) -> BatchMemcpy:
        if self._batch is None:
            from tiered_kv.copy.engine import BatchMemcpy

            self._batch = BatchMemcpy(self._prefer_overlap, self._max_runs)
        return self._batch
