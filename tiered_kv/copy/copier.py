"""``BlockCopier``: batched block <-> slot copies between engine KV tensors and a slab.

Role: the one interface the GPU tier, the vLLM connector and the SGLang backend call. A copier binds a ``KVLayout``
(the engine's tensors) to a slab (a ``(num_slots, >= block_nbytes)`` uint8 CPU tensor, pinned when the layout is on
CUDA). ``gpu_to_cpu`` / ``cpu_to_gpu`` move many blocks in one batched operation and return a ``CopyResult`` whose
CUDA event fires when the bytes have landed. Mechanism per call: the copy engine (``engine.py``, batched 1-D runs or
2-D copies), the SM kernel (``triton_kernel.py``) or, for CPU tensors, torch indexing (``cpu.py``), chosen by
``dispatch.py`` / ``select.py`` unless the caller names one. Loads may also name ``Mechanism.STAGED`` (``staged.py``:
whole slot rows in one DMA per run of adjacent slots into a device staging buffer, then an on-device scatter); it runs
on CPU tensors too, with a CPU staging buffer. A store that names it is chosen for as under ``"auto"``.

Ordering contract (CUDA): a copy starts after all work enqueued on ``stream``
(default: the device's current stream) before the call, and runs on the
copier's own side stream for its direction, so stores and loads overlap each
other and the model. Copies in one direction run in call order. The caller
keeps source blocks and slots unchanged, and does not read destination blocks
or slots, until the result reports done (``CopyResult.wait``,
``CopyResult.done``, or ``CopyResult.wait_on(stream)`` to make a stream wait).

Threading: ``gpu_to_cpu`` / ``cpu_to_gpu`` only validate the ids, decide the
mechanism (arithmetic on per-layout constants) and enqueue; planning the runs
and handing them to the driver happen on one daemon submitter thread per
direction (the driver spends about 1 us of the calling thread per descriptor,
so a large copy of small runs holds its caller for about as long as the bytes
take to cross PCIe, and the two directions must not wait on each other). The ids are copied at the call, so
the caller may reuse its buffers at once. Call a copier from one thread at a time; distinct
copiers may run in parallel. ``close()`` stops the submitter threads. The CPU
path is synchronous.

The staged loads' device buffer belongs to the thread that runs the loads: the h2d submitter
thread of a threaded copier (the caller's thread with ``threaded_submit=False``) allocates and
grows it, under the load side stream, at the start of each load job; the caller's thread never
touches it, so a call can never resize it under a load the submitter is still queuing
(``staged.py`` says why the old buffer's memory is never reused under a copy in flight).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from tiered_kv.copy import cpu
from tiered_kv.copy.dispatch import GpuDispatcher, Plan
from tiered_kv.copy.errors import BackendUnavailableError, BlockIndexError, LayoutError
from tiered_kv.copy.layouts import KVLayout
from tiered_kv.copy.segments import BlockIds, ChunkTable, Runs, as_index_tensor, check_indices, plan_runs
from tiered_kv.copy.select import Mechanism, SelectionPolicy
from tiered_kv.copy.staged import DEFAULT_STAGING_BYTES, StagedLoader, StagingMemoryError, check_buffers
from tiered_kv.copy.submit import CopyResult, Lanes

log = logging.getLogger(__name__)

#: Stream priority of the load (host -> device) side stream; stores keep the default (0). A lower number is
#: a higher priority; torch maps it to the device's range. Loads are what the engine's forward waits for,
#: layer by layer, and the staged load's scatter and the SM kernel are kernels: at the default priority
#: they queue behind every pending block of the forward's kernels and hold the next DMA of the same
#: stream back. (H200, 2026-11-28: a c32 wave's staged in-step copy, 4.68 GB in 32 layer groups, took
#: 116-118 ms under the prefill, 40 GB/s against the 55 GB/s PCIe ceiling; this priority is the first
#: remedy, not yet measured: docs/benchmarks.md "Next GPU session".)
LOAD_STREAM_PRIORITY = -1


def warm_sm_kernel(copiers: Sequence["BlockCopier"], who: str) -> set[tuple[int, int]]:
    """Compile the SM kernel's specializations that ``copiers`` launch (``BlockCopier.sm_variants``) now, with
    ``triton_kernel.warm``, so no copy compiles it inside an engine step; ``who`` names the caller in the log.
    Returns the specializations compiled (none without CUDA tensors or Triton). A failure is logged, not raised:
    the first launch then compiles, as it would without a warm-up."""
    variants = set().union(*(c.sm_variants() for c in copiers))
    if not variants:
        return set()
    from tiered_kv.copy import triton_kernel

    device = copiers[0].layout.device
    try:
        seconds = triton_kernel.warm(device, variants)
    except Exception as exc:  # noqa: BLE001 - a warm-up must not stop the engine
        log.warning("%s: the SM-kernel copy did not compile at start-up (%r); its first launch will", who, exc)
        return set()
    log.info("%s: SM-kernel copy compiled for (word bytes, loop step) %s in %.2f s", who, sorted(variants), seconds)
    return variants


def prepare_copier(copier: "BlockCopier", mechanisms: Sequence[Mechanism]) -> set[Mechanism]:
    """Create now what ``copier``'s first loads by ``mechanisms`` would create inside an engine step: both side
    streams and submitter threads, the driver's batched copy (``COPY_ENGINE``: cuda-python's import,
    ``cuGetProcAddress``), the staged loader with its DMA entry points and, with ``scatter_kernel``, its one-launch
    scatter's table uploaded and kernel compiled (``STAGED``; its device buffer still comes with the first load, at
    the size that load needs). Copies no KV bytes; nothing to create on CPU layouts. Returns the mechanisms ready:
    one whose entry point cannot be bound (no cuda-python, an old driver) is logged and left out, as its first copy
    would fall back. ``CopyLaunchError`` when a submitter thread does not start."""
    if not copier._on_cuda:
        return set(mechanisms)
    for to_cpu in (False, True):
        copier._lanes.prepare(to_cpu)
    ready = set()
    for m in mechanisms:
        try:
            if m is Mechanism.COPY_ENGINE:
                copier._gpu.prepare()
            elif m is Mechanism.STAGED:
                copier._staged_loader().prepare()
            ready.add(m)
        except BackendUnavailableError as exc:
            log.info("copier on %s: %s not prepared (%s)", copier.layout.device, m.value, exc)
    return ready


def warm_copy_paths(copiers: Sequence["BlockCopier"], scratch: Sequence["BlockCopier"], choice: str,
                    who: str) -> float | None:
    """Pay at start-up what the first copies of ``choice`` (``"auto"``: the copy engine and the staged load; else
    one ``Mechanism`` value) would pay inside an engine step: ``prepare_copier`` for each of ``copiers`` and
    ``scratch``, then one block's round trip through each of ``scratch`` (block 0 to slot 0, and back by each
    mechanism ready; on CPU layouts by the CPU path, or the staged one when ``choice`` names it), whose first
    kernels and driver calls load what later copies in the process reuse. The in-step probe's first copy-engine
    load in a new process held its thread 20 ms against 1 ms warm (H200, 2026-11-30). ``scratch``: copiers over
    a private slab, one per layout of ``copiers`` (never the CPU tier's, which other processes may share); block
    0 gets its own bytes back. The SM kernel is compiled apart (``warm_sm_kernel``). Returns the seconds taken, or
    None when it failed: logged, not raised (the first copies then pay as before)."""
    t0 = time.perf_counter()
    back: list[Mechanism] = []
    try:
        wanted = [Mechanism.COPY_ENGINE, Mechanism.STAGED] if choice == "auto" else [Mechanism(choice)]
        ready = {m for m in wanted if m is not Mechanism.SM_KERNEL}
        for copier in (*copiers, *scratch):
            ready &= prepare_copier(copier, sorted(ready, key=lambda m: m.value))
        if scratch and scratch[0].layout.device.type != "cuda":  # CPU loads: the CPU path unless staged is named
            back = [Mechanism.STAGED if choice == "staged" else Mechanism.CPU]
        elif scratch:
            back = sorted(ready, key=lambda m: m.value)
        for s in scratch:
            try:
                s.gpu_to_cpu([0], [0]).wait()
            except BackendUnavailableError as exc:  # no driver entry points (no cuda-python): nothing to warm
                log.info("%s: no round trip at start-up (%s)", who, exc)
                back = []
                break
            groups = [(t, t + 1) for t in range(len(s.layout.tensors))]  # as an in-step load goes: layer by layer
            for m in back:
                for res in s.cpu_to_gpu_grouped([0], [0], groups, mechanism=m):
                    res.wait()
            s._staged = None  # its one-block device buffer (the loader comes back at a staged load's first use)
    except Exception as exc:  # noqa: BLE001 - a warm-up must not stop the engine
        log.warning("%s: the copy paths did not warm up at start-up (%r); the first copies pay for it", who, exc)
        return None
    seconds = time.perf_counter() - t0
    log.info("%s: copy paths warmed in %.1f ms (round trip by %s)", who, seconds * 1e3,
             ", ".join(m.value for m in back) or "none")
    return seconds


def allocate_slab(num_slots: int, block_nbytes: int, pin: bool | None = None) -> torch.Tensor:
    """A ``(num_slots, block_nbytes)`` uint8 CPU slab; pinned when ``pin`` (default: CUDA is available).

    Pinning costs ~0.1-0.5 s per GB: allocate slabs once, at start-up or in the background.
    """
    if num_slots < 1 or block_nbytes < 1:
        raise LayoutError(f"slab of {num_slots} slots x {block_nbytes} bytes: both must be >= 1")
    if pin is None:
        pin = torch.cuda.is_available()
    return torch.empty((num_slots, block_nbytes), dtype=torch.uint8, pin_memory=pin)


class BlockCopier:
    """Copies blocks of ``layout`` to and from slots of ``slab``.

    ``mechanism``: ``"auto"`` (per call, by ``policy``), or a ``Mechanism`` to force one. ``prefer_overlap`` and
    ``max_runs_per_call`` tune the copy engine (see ``engine.BatchMemcpy``); ``sm_programs`` caps the SM kernel's
    CTAs (see ``triton_kernel.launch``). ``rect_copies``: copy-engine 2-D copies always (True, where the layout
    allows), never (False), or when they need fewer descriptor-equivalents than merged runs and those runs average
    32 KiB or less (None; the measured rule, docs/gpu_copy.md, ``dispatch.py``). ``threaded_submit=False`` plans and
    hands runs to the driver on the caller's thread (the call then holds it ~1 us per descriptor inside the driver;
    for callers that already run copies on their own mover thread). ``staging_bytes`` caps the device staging buffer
    of ``Mechanism.STAGED`` loads (allocated at the first such load, at the size it needs; a larger load goes in
    pieces); ``staging_buffers`` 2 alternates two halves of it so that a load's next piece crosses PCIe while the
    last one scatters; ``scatter_kernel`` scatters in one launch over a table on the device once ``prepare_copier``
    ran (``staged.StagedLoader``). ``load_priority``: the CUDA stream priority of the loads' side stream (lower is
    higher; default ``LOAD_STREAM_PRIORITY``).

    Use as a context manager or call ``close()`` to stop the submitter threads.
    """

    def __init__(
        self,
        layout: KVLayout,
        slab: torch.Tensor,
        *,
        mechanism: Mechanism | str = "auto",
        policy: SelectionPolicy = SelectionPolicy(),
        prefer_overlap: bool = True,
        max_runs_per_call: int = 2048,
        sm_programs: int = 32,
        threaded_submit: bool = True,
        rect_copies: bool | None = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        staging_buffers: int = 1,
        scatter_kernel: bool = False,
        load_priority: int = LOAD_STREAM_PRIORITY,
    ) -> None:
        """Validate the slab against the layout; CUDA resources are created on first use."""
        _check_slab(slab, layout)
        self.layout = layout
        self.slab = slab
        self.policy = policy
        self._fixed = None if mechanism == "auto" else Mechanism(mechanism)
        self._on_cuda = layout.device.type == "cuda"
        if not self._on_cuda and self._fixed not in (None, Mechanism.CPU, Mechanism.STAGED):  # staged: CPU too
            raise BackendUnavailableError(f"mechanism {self._fixed.value} needs CUDA tensors; layout is on {layout.device}")
        if self._on_cuda and self._fixed is Mechanism.CPU:
            raise LayoutError("mechanism 'cpu' needs CPU tensors; this layout is on CUDA")
        self._gpu = (
            GpuDispatcher(layout, slab, policy, prefer_overlap, max_runs_per_call, sm_programs, rect_copies)
            if self._on_cuda
            else None
        )
        self._lanes = Lanes(layout.device, threaded_submit, load_priority)  # side streams, submitter threads
        self._staging_bytes = staging_bytes
        self._staging_buffers = check_buffers(staging_buffers)  # checked now: the staged loader comes at first use
        self._scatter_kernel = scatter_kernel
        self._staged: StagedLoader | None = None
        self._staged_warned = False

    def __enter__(self) -> BlockCopier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Let queued copies be submitted, then stop the submitter threads (results stay valid)."""
        self._lanes.close()

    def sm_kernel_available(self) -> bool:
        """Whether ``Mechanism.SM_KERNEL`` can run for this layout (CUDA tensors and Triton present)."""
        return self._gpu is not None and self._gpu.sm_available()

    def sm_variants(self) -> set[tuple[int, int]]:
        """The SM kernel's specializations this layout's copies launch (``GpuDispatcher.sm_variants``; empty without
        it: CPU tensors, no Triton). Give the union of a worker's copiers to ``triton_kernel.warm`` at start-up."""
        return self._gpu.sm_variants() if self.sm_kernel_available() else set()

    def staging_allocations(self) -> int:
        """Device buffers this copier's staged loads have allocated so far (the first, then each growth)."""
        return self._staged.allocations if self._staged is not None else 0

    @property
    def num_slots(self) -> int:
        """Slots in the slab."""
        return int(self.slab.shape[0])

    def gpu_to_cpu(
        self,
        gpu_block_ids: BlockIds,
        cpu_slots: BlockIds,
        *,
        stream: torch.cuda.Stream | None = None,
        mechanism: Mechanism | str | None = None,
    ) -> CopyResult:
        """Copy engine blocks ``gpu_block_ids[i]`` into slab slots ``cpu_slots[i]``."""
        return self._copy(gpu_block_ids, cpu_slots, True, stream, mechanism)

    def load_indices(self, cpu_slots: BlockIds, gpu_block_ids: BlockIds) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cpu_slots, gpu_block_ids)`` of a load, checked (in range, equal lengths, each block written once) and
        as private int64 CPU tensors, in the order ``cpu_to_gpu_grouped`` takes them; ``BlockIndexError``
        otherwise. A caller that loads the same blocks in several calls (the layer groups of one in-step load)
        checks them once here and passes the pair to ``cpu_to_gpu_grouped(..., checked=True)``, without changing
        the tensors in between. Any thread."""
        ids, slots = self._indices(gpu_block_ids, cpu_slots, False)
        return slots, ids

    def cpu_to_gpu(
        self,
        cpu_slots: BlockIds,
        gpu_block_ids: BlockIds,
        *,
        stream: torch.cuda.Stream | None = None,
        mechanism: Mechanism | str | None = None,
    ) -> CopyResult:
        """Copy slab slots ``cpu_slots[i]`` into engine blocks ``gpu_block_ids[i]``."""
        return self._copy(gpu_block_ids, cpu_slots, False, stream, mechanism)

    def cpu_to_gpu_grouped(
        self,
        cpu_slots: BlockIds,
        gpu_block_ids: BlockIds,
        groups: Sequence[tuple[int, int]],
        *,
        stream: torch.cuda.Stream | None = None,
        mechanism: Mechanism | str | None = None,
        ordered: bool = True,
        checked: bool = False,
    ) -> list[CopyResult]:
        """Copy slots into blocks one group of tensors at a time, in order; one result per group.

        ``groups[g] = (a, b)`` names tensors ``a..b-1`` of the layout (for vLLM's per-layer views, ``[(l, l + 1) for l
        in range(L)]`` loads layer by layer). Result ``g`` turns done when that group's bytes have landed; groups land
        in the order given, so a consumer can make its stream wait for group ``g`` (``CopyResult.wait_on``) and start on
        the first layers while later ones are still moving. Validation and planning happen on the caller's thread (a few
        vectorised ops), so a submitter thread only makes driver calls and records events. Copy-engine 1-D runs or the
        SM kernel (never 2-D copies: those span all tensors).
        ``ordered=False`` skips waiting for the work on ``stream``: the copy is ordered only after this
        copier's earlier loads (its load side stream runs them in call order). For the later parts of a
        load whose first part was ordered, submitted while the forward that reads them is on ``stream``.
        ``checked=True``: the ids are the pair ``load_indices`` returned (not checked again; a staged load also
        reuses what it derived from the same pair in the previous call).
        """
        if checked:
            if not (isinstance(gpu_block_ids, torch.Tensor) and isinstance(cpu_slots, torch.Tensor)):
                raise BlockIndexError("checked=True takes the tensors load_indices returned; pass them, or "
                                      "checked=False to have the ids checked here")
            ids, slots = gpu_block_ids, cpu_slots
        else:
            ids, slots = self._indices(gpu_block_ids, cpu_slots, False)
        spans = _check_groups(groups, len(self.layout.tensors))
        n = int(ids.numel())
        sizes = [sum(m.nbytes for m in self.layout.maps[a:b]) for a, b in spans]
        forced = Mechanism(mechanism) if mechanism is not None else self._fixed
        if forced is Mechanism.STAGED:
            return self._staged_grouped(ids, slots, spans, sizes, stream, ordered)
        if not self._on_cuda:
            if forced not in (None, Mechanism.CPU):
                raise BackendUnavailableError(f"mechanism {forced.value} needs CUDA tensors")
            out = []
            for (a, b), size in zip(spans, sizes):
                if n:
                    cpu.slab_to_blocks(self.layout, self.slab, slots, ids, range(a, b))
                res = CopyResult(Mechanism.CPU, False, n, n * size, n * (b - a))
                res._finish(None)
                out.append(res)
            return out
        assert self._gpu is not None
        mech = self._gpu.decide(n, forced).mechanism  # raises if the mechanism cannot run here
        results = [CopyResult(mech, False, n, n * size, n * (b - a)) for (a, b), size in zip(spans, sizes)]
        planned = self._gpu.plan_groups(ids, slots, False, spans)  # here: the submitter only calls the driver

        def body(side: torch.cuda.Stream) -> None:
            def landed(g: int, descriptors: int) -> None:
                done = torch.cuda.Event()
                done.record(side)
                results[g]._finish(done, descriptors=descriptors)

            self._gpu.submit_groups(mech, planned, side, landed)

        return self._lanes.launch_load(stream, results, body, ordered)

    def cpu_to_gpu_many(
        self,
        loads: Sequence[tuple[BlockIds, BlockIds]],
        *,
        stream: torch.cuda.Stream | None = None,
        mechanism: Mechanism | str | None = None,
        timing: bool = False,
    ) -> list[CopyResult]:
        """Several loads ``(cpu_slots, gpu_block_ids)`` back to back, in order; one result per load.

        All of them go to the driver in one submitter job (one hand-over to the submitter thread, not one per load), on
        the load direction's side stream, so they land in the order given and each result turns done as soon as its own
        bytes landed: a consumer serves the first loads while the last ones still move. ``timing``: each result also
        gets ``start``, a CUDA event recorded where its copy begins (``start.elapsed_time(event)``: its time on the
        GPU). ``Mechanism.STAGED`` stages each load through the device buffer in turn (one stream, so a load never
        overwrites the buffer under the previous one's scatter); other mechanisms as ``cpu_to_gpu``. On CPU tensors the
        copies run now, on the caller's thread.
        """
        checked = [self._indices(ids, slots, False) for slots, ids in loads]
        forced = Mechanism(mechanism) if mechanism is not None else self._fixed
        whole = [(0, len(self.layout.tensors))]
        if not self._on_cuda:
            if forced not in (None, Mechanism.CPU, Mechanism.STAGED):
                raise BackendUnavailableError(f"mechanism {forced.value} needs CUDA tensors")
            out = []
            for ids, slots in checked:
                n = int(ids.numel())
                res = CopyResult(forced or Mechanism.CPU, False, n, n * self.layout.block_nbytes,
                                 self.layout.num_chunks * n)
                if forced is Mechanism.STAGED:
                    self._staged_loader().load(ids, slots, whole, None,
                                               lambda g, ops, r=res: r._finish(None, None, ops))
                else:
                    if n:
                        cpu.slab_to_blocks(self.layout, self.slab, slots, ids)
                    res._finish(None)
                out.append(res)
            return out
        assert self._gpu is not None
        staged = forced is Mechanism.STAGED
        plans = [None if staged else self._gpu.decide(int(ids.numel()), forced) for ids, _ in checked]
        results = [CopyResult(Mechanism.STAGED if staged else p.mechanism, False, int(ids.numel()),
                              int(ids.numel()) * self.layout.block_nbytes, 0 if staged else p.descriptors)
                   for (ids, _), p in zip(checked, plans)]

        def body(side: torch.cuda.Stream) -> None:
            use_staging = staged
            if staged:  # the buffer for the batch's largest load, here on the submitter, before anything is queued
                try:
                    self._staged_loader().reserve(max((int(i.numel()) for i, _ in checked), default=0), whole, side)
                except StagingMemoryError as exc:
                    self._staging_failed(exc)
                    use_staging = False
            for (ids, slots), plan, res in zip(checked, plans, results):
                if timing:
                    res.start = torch.cuda.Event(enable_timing=True)
                    res.start.record(side)
                if use_staging:
                    ops = self._staged_loader().load(ids, slots, whole, side, lambda g, o: None)
                else:
                    if plan is None:  # a staged batch the device had no memory for: as under "auto"
                        plan = self._gpu.decide(int(ids.numel()), None)
                        res.mechanism = plan.mechanism
                    ops = self._gpu.submit(plan, ids, slots, False, side)
                done = torch.cuda.Event(enable_timing=timing)
                done.record(side)
                res._finish(done, descriptors=ops)

        return self._lanes.launch_load(stream, results, body)

    def _staged_grouped(self, ids: torch.Tensor, slots: torch.Tensor, spans: list[tuple[int, int]], sizes: list[int],
                        stream: torch.cuda.Stream | None, ordered: bool = True) -> list[CopyResult]:
        """A ``Mechanism.STAGED`` load of ``spans``: one result per group, submitted like the other mechanisms.

        The staging buffer is reserved where the load runs (the submitter thread of a threaded copier),
        never here on the caller's thread. When the device has no memory for it the load is copied as
        under ``"auto"`` there instead (logged once per copier; the results name the mechanism used).
        """
        n = int(ids.numel())
        loader = self._staged_loader()
        results = [CopyResult(Mechanism.STAGED, False, n, n * size, 0) for size in sizes]
        if not self._on_cuda:
            def landed_cpu(g: int, ops: int) -> None:
                results[g]._finish(None, descriptors=ops)

            loader.load(ids, slots, spans, None, landed_cpu)
            return results

        def body(side: torch.cuda.Stream) -> None:
            def landed(g: int, ops: int) -> None:
                done = torch.cuda.Event()
                done.record(side)
                results[g]._finish(done, descriptors=ops)

            try:
                loader.load(ids, slots, spans, side, landed)
            except StagingMemoryError as exc:  # raised before anything of the load was queued
                self._staging_failed(exc)
                self._submit_unstaged(ids, slots, spans, results, side, landed)

        return self._lanes.launch_load(stream, results, body, ordered)

    def _submit_unstaged(self, ids: torch.Tensor, slots: torch.Tensor, spans: list[tuple[int, int]],
                         results: list[CopyResult], side: torch.cuda.Stream,
                         landed: Callable[[int, int], None]) -> None:
        """A staged load without a staging buffer, on the submitter: as under ``"auto"`` (all tensors in one
        copy, 2-D copies where they pay) or, for several groups, 1-D runs group by group."""
        assert self._gpu is not None
        plan = self._gpu.decide(int(ids.numel()), None)
        for res in results:
            res.mechanism = plan.mechanism
        if spans == [(0, len(self.layout.tensors))]:
            landed(0, self._gpu.submit(plan, ids, slots, False, side))
        else:
            self._gpu.submit_groups(plan.mechanism, self._gpu.plan_groups(ids, slots, False, spans), side, landed)

    def _staging_failed(self, exc: StagingMemoryError) -> None:
        """Log, once per copier, that staged loads go another way for want of device memory."""
        if not self._staged_warned:
            self._staged_warned = True
            log.warning("staged loads fall back to the other mechanisms: %s", exc)

    def _staged_loader(self) -> StagedLoader:
        if self._staged is None:
            self._staged = StagedLoader(self.layout, self.slab, self._staging_bytes, self._staging_buffers,
                                        self._scatter_kernel)
        return self._staged

    def copy_plain(self, gpu_block_ids: BlockIds, cpu_slots: BlockIds, *, to_cpu: bool) -> None:
        """Copy blocks and slots with plain torch indexing on the caller's thread, and wait for it.

        The fallback for callers that must not fail a copy when the batched mechanisms cannot
        launch (a driver error, a missing backend): slow (one gather or scatter per tensor chunk,
        through pageable memory, on the device's current stream) but it needs nothing beyond
        torch. Same bytes as ``gpu_to_cpu`` (``to_cpu``) or ``cpu_to_gpu``.
        """
        ids, slots = self._indices(gpu_block_ids, cpu_slots, to_cpu)
        if ids.numel() == 0:
            return
        if to_cpu:
            cpu.blocks_to_slab(self.layout, ids, self.slab, slots)
        else:
            cpu.slab_to_blocks(self.layout, self.slab, slots, ids)
        if self._on_cuda:
            torch.cuda.current_stream(self.layout.device).synchronize()

    def plan(self, gpu_block_ids: BlockIds, cpu_slots: BlockIds, to_cpu: bool) -> Runs:
        """The merged byte runs a GPU copy of these blocks would enqueue (for inspection and tests)."""
        ids, slots = self._indices(gpu_block_ids, cpu_slots, to_cpu)
        table = self._gpu.table if self._gpu is not None else ChunkTable.from_layout(self.layout)
        return plan_runs(table, ids, slots, self.slab.data_ptr(), self.slab.stride(0), to_cpu)

    def _indices(self, gpu_block_ids: BlockIds, cpu_slots: BlockIds, to_cpu: bool) -> tuple[torch.Tensor, torch.Tensor]:
        ids = as_index_tensor(gpu_block_ids, "gpu_block_ids")
        slots = as_index_tensor(cpu_slots, "cpu_slots")
        if ids.numel() != slots.numel():
            raise BlockIndexError(f"{ids.numel()} gpu_block_ids but {slots.numel()} cpu_slots")
        check_indices(ids, self.layout.num_blocks, "gpu_block_ids", unique=not to_cpu)
        check_indices(slots, self.num_slots, "cpu_slots", unique=to_cpu)
        return ids, slots

    def _copy(
        self,
        gpu_block_ids: BlockIds,
        cpu_slots: BlockIds,
        to_cpu: bool,
        stream: torch.cuda.Stream | None,
        mechanism: Mechanism | str | None,
    ) -> CopyResult:
        ids, slots = self._indices(gpu_block_ids, cpu_slots, to_cpu)
        n = int(ids.numel())
        nbytes = n * self.layout.block_nbytes
        forced = Mechanism(mechanism) if mechanism is not None else self._fixed
        if forced is Mechanism.STAGED:
            if not to_cpu:  # a load: one group of every tensor
                return self._staged_grouped(ids, slots, [(0, len(self.layout.tensors))],
                                            [self.layout.block_nbytes], stream)[0]
            forced = None  # a store (staging is a load path): as under "auto"
        if not self._on_cuda:
            if forced not in (None, Mechanism.CPU):
                raise BackendUnavailableError(f"mechanism {forced.value} needs CUDA tensors")
            if n and to_cpu:
                cpu.blocks_to_slab(self.layout, ids, self.slab, slots)
            elif n:
                cpu.slab_to_blocks(self.layout, self.slab, slots, ids)
            result = CopyResult(Mechanism.CPU, to_cpu, n, nbytes, self.layout.num_chunks * n)
            result._finish(None)
            return result
        assert self._gpu is not None
        plan = self._gpu.decide(n, forced)
        caller = torch.cuda.Event()
        caller.record(stream if stream is not None else torch.cuda.current_stream(self.layout.device))
        side = self._lanes.stream(to_cpu)
        result = CopyResult(plan.mechanism, to_cpu, n, nbytes, plan.descriptors)
        self._lanes.run(to_cpu, lambda: self._submit(plan, ids, slots, caller, side, result))
        return result

    def _submit(
        self,
        plan: Plan,
        ids: torch.Tensor,
        slots: torch.Tensor,
        caller: torch.cuda.Event,
        side: torch.cuda.Stream,
        result: CopyResult,
    ) -> None:
        """Runs on the submitter thread: wait for the caller's work, enqueue, record the event."""
        assert self._gpu is not None
        try:
            side.wait_event(caller)
            descriptors = self._gpu.submit(plan, ids, slots, result.to_cpu, side)
            done = torch.cuda.Event()
            done.record(side)
        except Exception as exc:  # noqa: BLE001 - reported through the result, never lost
            result._finish(None, exc)
            return
        result._finish(done, descriptors=descriptors)


def _check_groups(groups: Sequence[tuple[int, int]], num_tensors: int) -> list[tuple[int, int]]:
    """Validate tensor groups: each ``(a, b)`` with ``0 <= a < b <= num_tensors``, in order, disjoint."""
    spans = [(int(a), int(b)) for a, b in groups]
    if not spans:
        raise LayoutError("groups is empty; pass at least one (first, end) range of tensors")
    prev = 0
    for a, b in spans:
        if not (prev <= a < b <= num_tensors):
            raise LayoutError(f"tensor group ({a}, {b}) is out of order, empty, overlapping or beyond the layout's "
                              f"{num_tensors} tensors; pass ascending disjoint ranges such as [(0, 1), (1, 2)]")
        prev = b
    return spans


def _check_slab(slab: torch.Tensor, layout: KVLayout) -> None:
    """Raise ``LayoutError`` unless ``slab`` can hold ``layout``'s blocks."""
    if not isinstance(slab, torch.Tensor):
        raise LayoutError(f"slab is a {type(slab).__name__}, not a torch.Tensor")
    if slab.dtype != torch.uint8 or slab.dim() != 2:
        raise LayoutError(f"slab must be a 2-D uint8 tensor, got {slab.dtype} of shape {tuple(slab.shape)}")
    if slab.device.type != "cpu":
        raise LayoutError(f"slab must live in CPU memory, got {slab.device}")
    if slab.shape[1] < layout.block_nbytes:
        raise LayoutError(f"slab rows hold {slab.shape[1]} bytes; a block of {layout.name} needs {layout.block_nbytes}")
    if slab.stride(1) != 1 or (slab.shape[0] > 1 and slab.stride(0) < slab.shape[1]):
        raise LayoutError(f"slab rows must be contiguous and disjoint, got strides {slab.stride()}")
    if layout.device.type == "cuda" and not slab.is_pinned():
        raise LayoutError("slab must be pinned (allocate_slab or pin_memory=True) for a CUDA layout")
