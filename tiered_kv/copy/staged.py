"""Staged mechanism: whole slab rows in one DMA per run of adjacent slots, then an on-device scatter.

Role: loads (slab -> engine blocks) for layouts whose blocks split into many small chunks
(vLLM's per-layer tensors: one chunk per layer, 18-32 KiB each for MLA and 4-KV-head models),
where the copy engine pays its per-descriptor cost once per (layer, block). A slot holds one
block's chunks back to back (``layouts.py``), and the slots of one chunk of a request are
adjacent rows of the slab, so the load moves as:

1. **DMA**: the slots' bytes into a staging buffer on the device, staged row ``i`` being item
   ``i`` of the call. On CUDA the copies go to the driver as addresses computed from plain ints,
   in batched calls: a descriptor per run of adjacent slots when the copy takes whole rows
   (``cuMemcpyBatchAsync``, ``engine.BatchMemcpy``), and a pitched 2-D copy per run when it takes
   a column range of the rows, a group of tensors of a layer-by-layer load: a run of
   ``RECT_MIN_ROWS`` or more rows is one ``cuMemcpy2DAsync`` (``RectMemcpy.gather_rows``, about as
   much host time as that many batched descriptors) and the rows of shorter runs go as batched
   descriptors. The driver's batched 2-D copies (``cuMemcpy3DBatchAsync``,
   ``engine.RectBatchMemcpy``) take every run of a column range instead only with ``RECT_BATCH``:
   off, as the H200 measured them slower (the constant says by how much). On the legacy default
   stream, which the batched calls refuse, whole rows go as torch copies and every column range as
   2-D copies.
2. **Scatter**: for each *rectangle* of the layout (the chunks of one allocation at a fixed
   pitch: one per layer tensor, or one for all layers when they are views of one buffer), one
   torch ``index_put_`` from a strided view of the staging rows into a strided view of the
   engine tensor's storage, indexed by the block ids (on the device). Elements are the widest
   word (8, 4, 2 or 1 bytes) that every offset, stride and width divides. With ``scatter_kernel``
   (the ``staged_scatter: kernel`` connector key) and ``prepare`` done on CUDA with Triton, a scatter
   of ``SCATTER_KERNEL_MIN_ROWS`` rectangle rows or more goes instead as one launch over the
   layout's table of rectangle rows, kept on the device (``scatter_table.py``): no tensor view or
   ``index_put_`` per layer on the caller's thread.

With one buffer (``buffers=1``, the default) both steps run in order on one stream (the copier's
side stream): the staging buffer is reused by the next piece or call only after the previous
scatter read it, by stream order alone, so the DMA engine idles while each piece scatters. A call
larger than the buffer is cut into pieces of whole rows. With ``buffers=2`` a load of more than
one piece (several pieces, or several layer groups) splits the same cap into two halves and
alternates between them: the DMAs run on a second stream of the same priority, each scatter waits
for its piece's DMA (an event), and each DMA into a half waits for the scatter that last read that
half (an event), so piece ``k+1`` crosses PCIe while piece ``k`` scatters. The second stream first
waits for everything already queued on the load stream, so a call's DMAs never overtake work the
caller ordered before it (nor the previous call's scatters), and the caller's completion events,
recorded on the load stream after the last scatter, still cover every DMA. On CPU tensors the same
code runs with a CPU staging buffer and torch copies in place of the DMA, halves included (CI
checks it bit-exact against the other mechanisms).

The buffer is allocated at the start of a load, before anything of it is queued, at the size
the load needs (rounded up to 16 MiB), and grows up to ``staging_bytes``. It is replaced only
inside ``load`` / ``reserve``, under the loader's lock, which a load holds until its last
scatter is queued: a load uses one buffer from its first DMA to its last scatter, and no other
thread can swap it in between. The copies that read an old buffer are queued on the stream it
was allocated on (or recorded on their own stream with ``record_stream``), so the caching
allocator hands its memory to a new tensor only once they have run: no copy is in flight on
memory that changed owner. ``StagingMemoryError`` (no device memory) is raised before anything
of the load is queued, so the caller may copy it another way.

Threading: one lock per loader serialises ``load`` and ``reserve``. ``BlockCopier`` calls them
only from the thread that runs its loads (the h2d submitter thread; the caller's thread with
``threaded_submit=False``), never from the caller of a threaded copier; the lock keeps the
buffer consistent should two threads share a loader anyway. The second (DMA) stream of a two-half
load is created and used under the same lock. The one-launch scatter is made on the same thread, on the load
stream; ``prepare`` (which builds its table) runs before the loads start.
"""

from __future__ import annotations

import logging
import threading
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tiered_kv.copy.errors import BackendUnavailableError, CopyLaunchError
from tiered_kv.copy.layouts import KVLayout
from tiered_kv.copy.scatter_table import ScatterTable, word_of as _word, words as _words
from tiered_kv.copy.segments import Runs

log = logging.getLogger(__name__)

#: The staging buffer grows in steps of this many bytes (fewer re-allocations as loads vary).
GROW_STEP = 16 << 20
#: Default cap on the staging buffer (``BlockCopier(staging_bytes=...)``).
DEFAULT_STAGING_BYTES = 256 << 20
#: With two buffers, the second half starts at a multiple of this (the scatter's word width stays the widest).
HALF_ALIGN = 256
#: A run of a column-range DMA with at least this many rows goes as one ``cuMemcpy2DAsync``, shorter ones as a
#: batched descriptor per row: one 2-D call holds the host about as long as four batched descriptors (H200,
#: 2026-11-30, ``benchmarks/probes/in_step_probe.py``: 16,384 2-D calls 68.8 ms, 16,384 batched descriptors of
#: the copy engine 11.4 ms; ``dispatch.RECT_CALL_COST`` is the same ratio).
RECT_MIN_ROWS = 4
#: Send a column range's runs as batched pitched copies (``cuMemcpy3DBatchAsync``) instead of the above. Off: on the
#: H200 (2026-11-30, round 16, ``in_step_probe.py``, Llama-3-8B blocks, 32 layer groups) the batched op held the host
#: ~4 us per run like a single 2-D call (16,384 random slots: 67.6 ms, against 19.2 ms as batched 1-D descriptors;
#: slots in runs of 16: 6.2 ms, against 4.2 ms as one 2-D call a run).
RECT_BATCH = False
#: With ``scatter_kernel``: a scatter of at least this many rectangle rows, chunks a block (one a layer for vLLM 0.26's
#: per-layer tensors, two for 0.33's K/V-split views), goes as one launch (``scatter_table.py``); fewer: ``index_put_``.
SCATTER_KERNEL_MIN_ROWS = 8


def check_buffers(buffers: object) -> int:
    """``buffers`` if it is 1 or 2 (the staging modes ``StagedLoader`` knows), else ``BackendUnavailableError``.
    ``BlockCopier`` checks its ``staging_buffers`` with this at construction (its loader comes later)."""
    if buffers not in (1, 2):
        raise BackendUnavailableError(f"staging_buffers={buffers!r}: use 1 (DMA, then scatter, in turn) or 2 (two "
                                      f"halves of staging_bytes, the next piece's DMA beside the last scatter)")
    return buffers


class StagingMemoryError(BackendUnavailableError):
    """The device has no memory for the staging buffer a load needs; nothing of that load was queued."""


@dataclass(frozen=True)
class _Rect:
    """Chunks of one tensor storage at a fixed pitch: ``height`` rows of ``width`` bytes per block.

    Row ``r`` of block ``b`` sits at byte ``offset + b * block_stride + r * pitch`` of the storage
    of ``layout.tensors[tensor]`` and at ``slot_offset + r * width`` in a slot.
    """

    tensor: int
    offset: int
    block_stride: int
    pitch: int
    width: int
    height: int
    slot_offset: int


def layout_rects(layout: KVLayout, first: int, end: int) -> list[_Rect]:
    """The rectangles of tensors ``first..end-1``: consecutive chunks of one storage with equal size and
    block stride, contiguous in the slot and a constant address step apart, merged into one."""
    rects: list[list[int]] = []  # tensor, offset, block_stride, pitch, width, height, slot_offset, storage ptr
    for t in range(first, end):
        tensor, m = layout.tensors[t], layout.maps[t]
        storage = tensor.untyped_storage().data_ptr()
        base = m.base_ptr - storage
        pos = m.slot_offset
        for off, size in zip(m.chunk_offsets, m.chunk_sizes):
            addr = base + off
            if rects and rects[-1][7] == storage:
                r = rects[-1]
                same = size == r[4] and m.block_stride == r[2] and pos == r[6] + r[4] * r[5]
                step = addr - (r[1] + (r[5] - 1) * r[3])
                if same and r[5] == 1 and step >= size:
                    r[3], r[5] = step, 2
                    pos += size
                    continue
                if same and r[5] > 1 and step == r[3]:
                    r[5] += 1
                    pos += size
                    continue
            rects.append([t, addr, m.block_stride, size, size, 1, pos, storage])
            pos += size
    return [_Rect(*r[:7]) for r in rects]


class SlotRuns:
    """A load's items as runs of adjacent slots, in plain ints: run ``k`` is items ``first[k] .. first[k+1]-1``,
    read from slots ``slot[k]``, ``slot[k]+1``, ... (``slot_runs``). Built once per load; ``piece`` answers for
    each piece of it without touching a tensor. Never changed after construction: any thread may read it."""

    __slots__ = ("first", "slot")

    def __init__(self, first: list[int], slot: list[int]) -> None:
        """``first``: the runs' first items, then the item count; ``slot``: each run's first slot."""
        self.first = first
        self.slot = slot

    def piece(self, i0: int, i1: int, width: int) -> list[tuple[int, int, int]]:
        """The copies of items ``i0..i1-1`` packed ``width`` bytes a row from staging row 0: ``(staging byte
        offset, first slot, rows)`` per run (runs cut at the piece's ends)."""
        first, slot = self.first, self.slot
        if i0 <= 0 and i1 >= first[-1]:  # the whole call in one piece (the common case): no cutting
            return [(a * width, s, b - a) for a, b, s in zip(first, first[1:], slot)]
        out = []
        k = max(0, bisect_right(first, i0) - 1)
        while k < len(slot) and first[k] < i1:
            a, b = max(first[k], i0), min(first[k + 1], i1)
            if a < b:
                out.append(((a - i0) * width, slot[k] + a - first[k], b - a))
            k += 1
        return out


def slot_runs(slots: torch.Tensor) -> SlotRuns:
    """``slots`` (an int64 CPU tensor, item i's slot) as runs of adjacent slots."""
    values = slots.tolist()
    if not values:
        return SlotRuns([0], [])
    # a run starts at item 0 and wherever a slot does not follow the one before it
    first = [0, *torch.diff(slots).ne_(1).nonzero().reshape(-1).add_(1).tolist()]
    return SlotRuns(first + [len(values)], [values[i] for i in first])


class StagedLoader:
    """Slab -> blocks through a device staging buffer: one DMA per run of adjacent slots, one scatter per rectangle."""

    def __init__(self, layout: KVLayout, slab: torch.Tensor, staging_bytes: int = DEFAULT_STAGING_BYTES,
                 buffers: int = 1, scatter_kernel: bool = False) -> None:
        """Bind the layout and slab; the staging buffer is allocated at the first call. ``buffers``: 1 (DMA and
        scatter in turn on one stream) or 2 (a load of several pieces alternates two halves of the cap, its
        DMAs on a second stream overlapping the scatters: see the module text). ``scatter_kernel``: scatter in
        one launch where ``prepare`` made that possible (CUDA with Triton), else ``index_put_`` per rectangle."""
        if staging_bytes < layout.block_nbytes:
            raise BackendUnavailableError(
                f"staging_bytes={staging_bytes} cannot hold one block of {layout.block_nbytes} bytes; "
                f"raise it to at least {layout.block_nbytes} (a few hundred MiB lets a whole load go in one piece)")
        if slab.dim() != 2 or slab.dtype != torch.uint8 or slab.stride(1) != 1:
            raise BackendUnavailableError(f"the staged load reads a 2-D uint8 slab of rows (allocate_slab); got "
                                          f"{slab.dtype} of shape {tuple(slab.shape)}, strides {slab.stride()}")
        self.layout = layout
        self.slab = slab
        self.staging_bytes = int(staging_bytes)
        self.buffers = check_buffers(buffers)
        self._dma_streams: dict[int, torch.cuda.Stream] = {}  # CUDA, two buffers: load stream priority -> DMA stream
        self._on_cuda = layout.device.type == "cuda"
        self._staging: torch.Tensor | None = None
        self._staging_stream: int | None = None  # CUDA: the stream the buffer was allocated on (its handle)
        self._lock = threading.Lock()  # held by a load from its buffer reservation to its last scatter
        self.allocations = 0  # buffers allocated so far (the first one, then each growth)
        self._rects: dict[tuple[int, int], list[_Rect]] = {}
        self._flats: dict[int, torch.Tensor] = {}  # tensor index -> its storage as uint8
        self._dst_views: dict[tuple, torch.Tensor] = {}  # a rectangle's blocks as words (``_scatter``)
        self._steps: dict[tuple, list[tuple]] = {}  # (tensors, columns, staging address mod 8) -> ``_scatter_steps``
        self._last: tuple | None = None  # (ids, slots, device ids, runs) of the last load (``_derived``)
        self._rect2d = None  # engine.RectMemcpy (``gather_rows``) for column-range DMAs, made at the first on CUDA
        self._batch = None  # engine.BatchMemcpy for batched DMA descriptors, made at the first on CUDA (False: none)
        self._rect_batch = None  # engine.RectBatchMemcpy for a column range's runs, likewise (False: none)
        self.scatter_kernel = scatter_kernel
        # ``scatter_table.ScatterTable`` of the layout, prepared on the device (``prepare``); None: index_put_ only
        self._table = None

    def rects(self, first: int, end: int) -> list[_Rect]:
        """The (cached) rectangles of tensors ``first..end-1``."""
        key = (first, end)
        if key not in self._rects:
            self._rects[key] = layout_rects(self.layout, first, end)
        return self._rects[key]

    def _width(self, a: int, b: int) -> int:
        """Bytes of a slot row that tensors ``a..b-1`` take (their column range)."""
        maps = self.layout.maps
        return maps[b - 1].slot_offset + maps[b - 1].nbytes - maps[a].slot_offset

    def plan(self, n: int, groups: list[tuple[int, int]]) -> tuple[int, list[int], int, int]:
        """How a load of ``n`` items in ``groups`` uses the buffer: ``(halves, rows per piece of each group,
        offset of the second half, staging bytes)``. Two halves only with ``buffers=2``, when the load has more
        than one piece and each half holds a row of every group; else one buffer of up to ``staging_bytes``."""
        widths = [self._width(a, b) for a, b in groups]
        half = self.staging_bytes // 2 // HALF_ALIGN * HALF_ALIGN
        two = (self.buffers == 2 and n > 0 and all(half >= w for w in widths)
               and sum(-(-n // (half // w)) for w in widths) > 1)
        cap = half if two else self.staging_bytes
        per = [max(1, cap // w) for w in widths]
        piece = max((min(n, p) * w for p, w in zip(per, widths)), default=0)
        if not two:
            return 1, per, 0, piece
        second = -(-piece // HALF_ALIGN) * HALF_ALIGN
        return 2, per, second, second + piece

    def need(self, n: int, groups: list[tuple[int, int]]) -> int:
        """Staging bytes a load of ``n`` items in ``groups`` uses (at most ``staging_bytes``)."""
        return self.plan(n, groups)[3]

    def reserve(self, n: int, groups: list[tuple[int, int]], stream: torch.cuda.Stream | None = None) -> None:
        """Allocate (or grow) the buffer for a load of ``n`` items in ``groups`` now, on ``stream`` (CUDA; the
        stream the loads will run on); raise ``StagingMemoryError`` when the device has no memory for it.
        Call it from the thread that runs the loads (see the module's threading contract)."""
        if not n:
            return
        with self._lock, self._stream_ctx(stream):
            self._buffer(self.need(n, groups))

    def load(self, ids: torch.Tensor, slots: torch.Tensor, groups: list[tuple[int, int]],
             stream: torch.cuda.Stream | None, on_group: Callable[[int, int], None]) -> int:
        """Copy ``slab[slots[i]]`` into blocks ``ids[i]``, group of tensors by group; return the operations enqueued.

        ``on_group(g, ops)`` runs after group ``g``'s last scatter is enqueued on ``stream`` (CUDA) or
        done (CPU). ``ids`` and ``slots`` are validated int64 CPU tensors of equal length. Raises
        ``StagingMemoryError`` before enqueuing anything when the device has no memory for the buffer.
        """
        n = int(ids.numel())
        total = 0
        if n == 0:
            for g in range(len(groups)):
                on_group(g, 0)
            return 0
        halves, per, second, need = self.plan(n, groups)
        with self._lock, self._stream_ctx(stream):
            # the whole load's buffer first: one buffer from the first DMA to the last scatter
            staging = self._buffer(need)
            current = dma = None
            if self._on_cuda:  # the load's stream: ``stream`` itself inside its context, when on the layout's device
                current = (stream if stream is not None and stream.device == self.layout.device
                           else torch.cuda.current_stream(self.layout.device))
                if current.cuda_stream != self._staging_stream:  # its memory is reused only after this stream's use
                    staging.record_stream(current)
                if halves == 2:
                    dma = self._dma_stream(current)
                    dma.wait_stream(current)  # after all the caller queued before (and the last call's scatters)
                    staging.record_stream(dma)
            dev_ids, runs = self._derived(ids, slots)
            read: list = [None, None]  # two halves on CUDA: the event after the scatter that last read each half
            k = 0  # pieces so far (over all groups): piece k uses half k % 2
            try:
                for g, (a, b) in enumerate(groups):
                    ops = 0
                    c0 = self.layout.maps[a].slot_offset
                    width = self._width(a, b)
                    for i0 in range(0, n, per[g]):
                        i1 = min(n, i0 + per[g])
                        h = k % halves
                        buf = staging[second:] if h else staging
                        if dma is None:
                            ops += self._dma(buf, runs, i0, i1, c0, c0 + width, current)
                        else:
                            with torch.cuda.stream(dma):
                                if read[h] is not None:
                                    dma.wait_event(read[h])  # the half's previous scatter has read it
                                ops += self._dma(buf, runs, i0, i1, c0, c0 + width, dma)
                                landed = torch.cuda.Event()
                                landed.record(dma)
                            current.wait_event(landed)
                        ops += self._scatter(buf, dev_ids, i1 - i0, a, b, c0, width, i0)
                        if dma is not None:
                            read[h] = torch.cuda.Event()
                            read[h].record(current)
                        k += 1
                    total += ops
                    on_group(g, ops)
            finally:
                if dma is not None:  # an error mid-load: what follows on the load stream waits for every DMA queued
                    current.wait_stream(dma)
        return total

    def _derived(self, ids: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, SlotRuns]:
        """The block ids on the device and the slots' runs of a load; the previous call's again when it passed the
        very same tensors (the layer groups of one in-step load, submitted in several calls; kept referenced, so
        their identity is theirs). Called under the lock, on the load's stream."""
        last = self._last
        if last is not None and last[0] is ids and last[1] is slots:
            return last[2], last[3]
        # pinned, so the upload is queued on the stream (a pageable one would synchronise it)
        dev_ids = ids.pin_memory().to(self.layout.device, non_blocking=True) if self._on_cuda else ids
        runs = slot_runs(slots)
        self._last = (ids, slots, dev_ids, runs)
        return dev_ids, runs

    def _dma_stream(self, load: torch.cuda.Stream) -> torch.cuda.Stream:
        """The second stream of a two-half load: same device, same priority as the load stream (cached)."""
        prio = int(load.priority)
        if prio not in self._dma_streams:
            self._dma_streams[prio] = torch.cuda.Stream(device=self.layout.device, priority=prio)
        return self._dma_streams[prio]

    def _stream_ctx(self, stream: torch.cuda.Stream | None):
        """``torch.cuda.stream(stream)`` on CUDA with a stream, else a no-op context."""
        return torch.cuda.stream(stream) if self._on_cuda and stream is not None else _nullcontext()

    # ------------------------------------------------------------------ steps
    def _dma(self, staging: torch.Tensor, runs: SlotRuns, i0: int, i1: int, c0: int, c1: int,
             stream: torch.cuda.Stream | None) -> int:
        """Items ``i0..i1-1``: columns ``c0..c1-1`` of their slot rows into staging rows 0.. (packed), on ``stream``
        (CUDA: the current stream). Returns the copies (descriptors and 2-D calls).

        A step's load may take thousands of runs, each issued on vLLM's thread: the runs are plain ints
        (``slot_runs``) and the copies reach the driver as addresses (``_dma_addresses``): no tensor view per
        run. On the CPU (and on CUDA's legacy default stream, for whole rows) torch copies a run at a time."""
        width = c1 - c0
        pitch = self.slab.stride(0)
        todo = runs.piece(i0, i1, width)  # (staging byte offset, first slot, rows)
        if not todo:
            return 0
        whole = width == pitch and self.slab.is_contiguous()
        if self._on_cuda and (self._rect2d is None or self._batch is None or self._rect_batch is None):
            self._engines()
        handle = stream.cuda_stream if stream is not None else 0
        # CUDA's batched calls refuse the legacy default stream (the copier's side streams are never it)
        batched = handle or not self._on_cuda
        batch = self._batch if self._batch and batched else None
        rect_batch = self._rect_batch if self._rect_batch and batched else None
        if batch is not None or (not whole and (self._rect2d is not None or rect_batch is not None)):
            return self._dma_addresses(staging.data_ptr(), self.slab.data_ptr() + c0, pitch, width, whole, todo,
                                       batch, rect_batch, handle)
        if whole:  # contiguous rows: one torch copy a run
            flat = self.slab.view(-1)
            for d, r, h in todo:
                staging[d:d + h * width].copy_(flat[r * pitch:(r + h) * pitch], non_blocking=True)
            return len(todo)
        for d, r, h in todo:
            staging[d:d + h * width].view(h, width).copy_(self.slab[r:r + h, c0:c1])
        return len(todo)

    def prepare(self) -> None:
        """On CUDA, bind now what the first load binds (the driver's 2-D and batched copies) and, with
        ``scatter_kernel``, put the scatter's table on the device and compile its kernel (without Triton: logged,
        the scatters stay ``index_put_``), so no engine step pays for it; nothing on the CPU. Any thread, before
        the loads start."""
        if not self._on_cuda:
            return
        self._engines()
        if self.scatter_kernel and self._table is None:
            try:
                table = self.scatter_table()
                seconds = table.prepare(self.layout.device)
            except Exception as exc:  # noqa: BLE001 - no Triton, a compile error: the scatters stay index_put_
                log.warning("staged loads: the one-launch scatter is unavailable (%r); index_put_ per layer", exc)
                return
            self._table = table
            log.info("staged loads: one-launch scatter over %d rectangle rows ready in %.1f ms (word %d bytes)",
                     table.rows, seconds * 1e3, table.word)

    def _engines(self) -> None:
        """Bind the driver's 2-D and batched copies at the first DMA on CUDA (a driver without a batched entry
        point leaves the 2-D copies and torch's)."""
        from tiered_kv.copy.engine import BatchMemcpy, RectBatchMemcpy, RectMemcpy

        if self._rect2d is None:
            self._rect2d = RectMemcpy(self.layout.device)
        if not RECT_BATCH and self._rect_batch is None:
            self._rect_batch = False  # measured slower (``RECT_BATCH``): per-run 2-D calls and 1-D descriptors
        for name, make in (("_batch", BatchMemcpy), ("_rect_batch", RectBatchMemcpy)):
            if getattr(self, name) is None:
                try:
                    setattr(self, name, make())
                except BackendUnavailableError as exc:
                    log.info("staged loads: %s unavailable (%s); per-run driver calls instead", make.__name__, exc)
                    setattr(self, name, False)

    def _dma_addresses(self, dst: int, src: int, pitch: int, width: int, whole: bool, todo: list[tuple[int, int, int]],
                       batch, rect_batch, handle: int) -> int:
        """The DMA of ``todo`` (``SlotRuns.piece``'s runs) as driver calls: row ``r`` of the slab, from column
        ``src``'s offset, sits at ``src + r * pitch``; staging offset ``d`` at ``dst + d``. Whole rows: a batched
        descriptor per run. A column range: every run in batched 2-D copies (``rect_batch``); without them a run of
        ``RECT_MIN_ROWS`` rows or more (or any, with no ``batch``) as one 2-D copy, the rows of shorter runs as a
        batched descriptor each. A batched 2-D call the driver refuses is not tried again: the runs go the other
        way (copying a run twice writes the same bytes). Returns the copies."""
        if not whole and rect_batch is not None:
            try:
                return rect_batch.gather_rows(dst, src, pitch, width, todo, handle)
            except CopyLaunchError as exc:
                log.warning("staged loads: batched 2-D copies failed (%s); per-run driver calls from now on", exc)
                self._rect_batch = False
        d_ptr, s_ptr, sizes, rects = [], [], [], []
        if whole:
            for d, r, h in todo:
                d_ptr.append(dst + d)
                s_ptr.append(src + r * pitch)
                sizes.append(h * width)
        else:
            for d, r, h in todo:
                if batch is None or h >= RECT_MIN_ROWS:
                    rects.append((d, r, h))
                    continue
                for k in range(h):
                    d_ptr.append(dst + d + k * width)
                    s_ptr.append(src + (r + k) * pitch)
                    sizes.append(width)
        if sizes:
            batch.submit(Runs(src=torch.tensor(s_ptr, dtype=torch.int64), dst=torch.tensor(d_ptr, dtype=torch.int64),
                              size=torch.tensor(sizes, dtype=torch.int64)), handle)
        if rects:
            self._rect2d.gather_rows(dst, src, pitch, width, rects, handle)
        return len(sizes) + len(rects)

    def _scatter(self, staging: torch.Tensor, dev_ids: torch.Tensor, rows: int, a: int, b: int, c0: int,
                 width: int, first: int = 0) -> int:
        """Staged rows ``0..rows-1`` (columns ``c0..`` of slots) into blocks ``dev_ids[first..first+rows-1]`` of
        tensors ``a..b-1``: one launch over the prepared table (``scatter_kernel``, ``SCATTER_KERNEL_MIN_ROWS``
        rectangle rows or more), else an ``index_put_`` per rectangle. Returns the kernels launched."""
        rects = self.rects(a, b)
        table = self._table
        if table is not None and sum(r.height for r in rects) >= SCATTER_KERNEL_MIN_ROWS \
                and table.launch(staging, dev_ids, first, rows, c0, width):
            return 1
        dev_ids = dev_ids[first:first + rows]
        views: dict[int, torch.Tensor] = {}  # the staging rows as w-byte words, one view per word width
        base = staging.storage_offset()
        for w, dst, src_off, shape, strides in self._scatter_steps(a, b, c0, width, staging.data_ptr() % 8):
            words = views.get(w)
            if words is None:
                words = views[w] = _words(staging, w)
            # as_strided's offset counts from the storage's start, not the view's: add the view's own (a half)
            dst.index_put_((dev_ids,), words.as_strided((rows, *shape), strides, (base + src_off) // w))
        return len(rects)

    def _scatter_steps(self, a: int, b: int, c0: int, width: int, align: int) -> list[tuple]:
        """Per rectangle of tensors ``a..b-1``, what ``_scatter`` needs besides the staging rows (cached): ``(w,
        the engine's blocks as w-byte words, the rectangle's byte offset in a staged row, the shape and strides of
        a staged row's words)``. ``w`` is the widest word that every offset, stride and width divides, the staging
        buffer's address included: only that address modulo 8 (``align``) decides it, so it is part of the key."""
        key = (a, b, c0, width, align)
        steps = self._steps.get(key)
        if steps is not None:
            return steps
        steps = []
        num_blocks = self.layout.num_blocks
        for r in self.rects(a, b):
            src_off = r.slot_offset - c0
            w = _word(r.offset, r.block_stride, r.pitch, r.width, src_off, width, align,
                      self._flat(r.tensor).data_ptr())
            view = (r.tensor, r.offset, r.block_stride, r.pitch, r.width, r.height, w)
            dst = self._dst_views.get(view)
            if dst is None:  # the engine's blocks as w-byte words: fixed for the layout, kept
                dst = self._dst_views[view] = _words(self._flat(r.tensor), w).as_strided(
                    (num_blocks, r.height, r.width // w), (r.block_stride // w, r.pitch // w, 1), r.offset // w)
            steps.append((w, dst, src_off, (r.height, r.width // w), (width // w, r.width // w, 1)))
        self._steps[key] = steps
        return steps

    def scatter_table(self) -> ScatterTable:
        """The layout's rectangle rows as a ``ScatterTable`` (host side; ``prepare`` puts it on the device)."""
        rows = [(r.slot_offset + k * r.width, self._flat(r.tensor).data_ptr() + r.offset + k * r.pitch,
                 r.block_stride, r.width) for r in self.rects(0, len(self.layout.tensors)) for k in range(r.height)]
        return ScatterTable(rows)

    def _flat(self, t: int) -> torch.Tensor:
        """Tensor ``t``'s whole storage as a 1-D uint8 tensor (cached)."""
        if t not in self._flats:
            tensor = self.layout.tensors[t]
            self._flats[t] = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())
        return self._flats[t]

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """The staging buffer, grown to at least ``nbytes`` on the current stream (the caller holds the lock).

        The old buffer is dropped here: on CUDA its memory returns to the caching allocator's pool of
        the stream it was allocated on (and waits for the streams recorded on it), so a new tensor
        gets it only behind the copies already queued there.
        """
        if self._staging is None or self._staging.numel() < nbytes:
            size = min(self.staging_bytes, -(-nbytes // GROW_STEP) * GROW_STEP)
            size = max(size, nbytes)
            self._staging = None  # at most one buffer alive: the old one is freed before the new one is taken
            try:
                self._staging = torch.empty(size, dtype=torch.uint8, device=self.layout.device)
            except torch.OutOfMemoryError as exc:
                raise StagingMemoryError(
                    f"no device memory for a {size >> 20} MiB staging buffer ({exc}); lower staging_bytes "
                    f"(connector key load_staging_bytes) or use the copy engine") from exc
            if self._on_cuda:
                self._staging_stream = torch.cuda.current_stream(self.layout.device).cuda_stream
            self.allocations += 1
        return self._staging


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
