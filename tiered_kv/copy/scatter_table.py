"""The staged load's scatter in one kernel launch, its address table kept on the device.

Role: the second step of a staged load (``staged.py``) copies each staged row's chunks into the engine's blocks.
As one ``index_put_`` per rectangle (a layer's tensor) it costs the caller's thread tens of microseconds a
rectangle: vLLM's, before the forward. Round 25 (H200, Qwen2.5-7B c8 compiled, docs/notes/2026-12-01-gpu-round25.md)
found the engine's prefill steps bound by the host (GPU forward about as long as the worker's part of the step) and
``start_load_kv`` of a one-load step at 1.7-2.0 ms; about 40% of a staged group call is its scatters (a cProfile of the
same round). Here the scatter of a call is one Triton launch:

- ``ScatterTable``: every *rectangle row* of the layout (one chunk of one tensor per block: its offset in a slot,
  the address of block 0's chunk, the bytes between two blocks' chunks, its length) sorted by slot offset, built
  once per layout and uploaded once (``prepare``, at start-up) as a ``(4, rows)`` int64 tensor on the device. A
  call's tensors ``a..b-1`` are the column range ``c0 .. c0 + width`` of a slot, so their rows are one run of the
  table (``span``): nothing is built or uploaded per call;
- ``launch``: one kernel over (item, rectangle row) pairs, grid-stride over at most ``PROGRAMS`` programs: staged
  row ``item`` of the buffer, at the row's slot offset less ``c0``, to the row's address plus ``block id x
  stride``. The block ids are the ones the staged load already uploaded for its DMA (``StagedLoader._derived``).

Measured (H200, 2026-12-01, ``benchmarks/probes/scatter_probe.py``, Qwen2.5-7B's 28 per-layer tensors, slots in runs
of 16, two layer groups of 14 tensors): host ms of a load 0.94 against 0.92 with ``index_put_`` (82 blocks), 1.42
against 1.93 (574 blocks); GPU time until landed 8% / 4% longer; bytes equal. The launch holds the thread about as long
as 14 ``index_put_`` do, so it pays only where a call has many blocks; the rest of a call's ~0.36 ms (stream and event
calls, the DMA's address lists) stays. Groups of fewer than ``staged.SCATTER_KERNEL_MIN_ROWS`` rows keep
``index_put_`` (the probe's 7-group rows ran it both ways: 2.53 / 2.63 and 3.48 / 3.46 ms, its spread). Off by default
(the connector key ``staged_scatter``).

Triton compiles the kernel per word width (``ELEM``) and loop step (``BLOCK``), both fixed by the table, at its
first launch, and it specializes a pointer argument on whether its address is a multiple of 16; ``prepare``
compiles it with an empty launch (nothing read or written) on 16-byte aligned tensors, and ``launch`` returns False
instead of compiling anything: a table not prepared, a call whose offsets the table's word does not divide, a staging
row range or block-id tensor not 16-byte aligned (the staged load's halves start at multiples of 256 bytes, torch's
allocations at 512). Every integer argument is left unspecialized. The caller then scatters with ``index_put_``.

Threading: a table is built and prepared by one thread (the copier's ``prepare`` at start-up); after that ``launch``
may be called from any thread, on that thread's current CUDA stream. Its only write is ``span``'s cache of column
ranges (a dict entry, set under the GIL: two threads at worst compute one entry twice, with the same value).
"""
from __future__ import annotations

import functools
import time
from bisect import bisect_left

import torch

from tiered_kv.copy.errors import BackendUnavailableError
from tiered_kv.copy.triton_kernel import elem_type, loop_step

#: programs of one launch at most (grid-stride over the pairs), so the forward keeps most of the H200's 132 SMs;
#: the probe's 527 MB load landed 4% later than with ``index_put_`` at this count (not tuned further)
PROGRAMS = 64
NUM_WARPS = 4
WORD_TYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
#: Triton specializes a pointer argument on this alignment: ``launch`` takes only what ``prepare`` compiled for
ALIGN = 16


def words(flat: torch.Tensor, w: int) -> torch.Tensor:
    """A 1-D uint8 tensor viewed as ``w``-byte words (its tail of fewer than ``w`` bytes dropped)."""
    return flat[: flat.numel() // w * w].view(WORD_TYPES[w])


def word_of(*values: int) -> int:
    """The widest word (8, 4, 2, 1 bytes) dividing every value."""
    bits = 0
    for v in values:
        bits |= int(v)
    for width in (8, 4, 2):
        if bits % width == 0:
            return width
    return 1


class ScatterTable:
    """A layout's rectangle rows sorted by slot offset (see the module); the device copy made by ``prepare``."""

    def __init__(self, rows: list[tuple[int, int, int, int]]) -> None:
        """``rows``: ``(slot offset, address of block 0's chunk, bytes between blocks, length)`` per rectangle row,
        covering a slot without overlap (``StagedLoader.scatter_table`` builds them from ``layout_rects``)."""
        rows = sorted(rows)
        for (s0, _, _, n0), (s1, _, _, _) in zip(rows, rows[1:]):
            if s0 + n0 > s1:
                raise ValueError(f"rectangle rows overlap in the slot: [{s0}, {s0 + n0}) and one at {s1}: the layout "
                                 f"maps one slot byte twice (a bug to report); use staged_scatter: index_put meanwhile")
        self.src = [r[0] for r in rows]
        self.dst = [r[1] for r in rows]
        self.stride = [r[2] for r in rows]
        self.size = [r[3] for r in rows]
        self.word = word_of(*self.src, *self.dst, *self.stride, *self.size) if rows else 1
        self.block = loop_step(sorted(self.size)[len(rows) // 2] // self.word if rows else 0)
        self._spans: dict[tuple[int, int], tuple[int, int] | None] = {}
        self.device: torch.Tensor | None = None  # ``columns()`` on the device, once prepared

    @property
    def rows(self) -> int:
        """Rectangle rows in the table."""
        return len(self.src)

    def span(self, c0: int, width: int) -> tuple[int, int] | None:
        """``(first row, rows)`` of the table inside slot bytes ``c0 .. c0 + width`` (a call's column range), or None
        when a row straddles an end of it (not a range of whole tensors). Cached per range."""
        key = (c0, width)
        if key not in self._spans:
            i = bisect_left(self.src, c0)
            j = bisect_left(self.src, c0 + width)
            whole = i == len(self.src) or self.src[i] == c0
            whole = whole and (j == i or self.src[j - 1] + self.size[j - 1] <= c0 + width)
            self._spans[key] = (i, j - i) if whole and j > i else None
        return self._spans[key]

    def columns(self) -> list[list[int]]:
        """The table as the kernel reads it, one list per column: slot offsets, strides and lengths in words, the
        addresses of block 0's chunks in bytes."""
        w = self.word
        return [[s // w for s in self.src], list(self.dst), [s // w for s in self.stride], [s // w for s in self.size]]

    def prepare(self, device: torch.device) -> float:
        """Upload the table to ``device`` and compile the kernel with an empty launch (no byte read or written);
        returns the seconds taken (the device synchronized). ``BackendUnavailableError`` without Triton. Call it
        once, before any ``launch`` (at start-up: the upload and the compile would stall an engine step)."""
        kernel = _kernel()
        t0 = time.perf_counter()
        with torch.cuda.device(device):
            table = torch.tensor(self.columns(), dtype=torch.int64, device=device)
            staging = torch.zeros(64, dtype=WORD_TYPES[self.word], device=device)
            ids = torch.zeros(8, dtype=torch.int64, device=device)
            kernel[(1,)](staging, ids, table, self.rows, 0, 0, 0, 0, 0, 0, ELEM=elem_type(self.word),
                         BLOCK=self.block, num_warps=NUM_WARPS)
            torch.cuda.synchronize(device)
        self.device = table
        return time.perf_counter() - t0

    def launch(self, staging: torch.Tensor, ids: torch.Tensor, first: int, items: int, c0: int, width: int) -> bool:
        """Enqueue on the current stream the scatter of staged rows ``0 .. items-1`` of ``staging`` (a uint8 device
        buffer of rows of ``width`` bytes, slot bytes ``c0 ..``) into blocks ``ids[first .. first+items-1]`` (int64,
        on the device). Returns False, with nothing enqueued, when the table was not prepared or cannot take this
        call (a word the offsets do not divide, a column range that is not whole rows, a pointer the compiled kernel
        was not specialized for): scatter another way."""
        w = self.word
        if self.device is None or items <= 0 or (c0 | width) % w or (staging.data_ptr() | ids.data_ptr()) % ALIGN:
            return False
        span = self.span(c0, width)
        if span is None:
            return False
        self._enqueue(staging, ids, first, items, span[0], span[1], c0, width)
        return True

    def _enqueue(self, staging: torch.Tensor, ids: torch.Tensor, first: int, items: int, col0: int, cols: int,
                 c0: int, width: int) -> None:
        """The kernel over rows ``col0 .. col0+cols-1`` of the table (``launch`` checked the call)."""
        w = self.word
        grid = (min(items * cols, PROGRAMS),)
        _kernel()[grid](words(staging, w), ids, self.device, self.rows, first, items, col0, cols, width // w, c0 // w,
                        ELEM=elem_type(w), BLOCK=self.block, num_warps=NUM_WARPS)


@functools.lru_cache(maxsize=1)
def _kernel():
    try:
        import triton
        import triton.language as tl
    except ImportError as exc:
        raise BackendUnavailableError(f"the one-launch scatter needs Triton: {exc}") from exc

    @triton.jit(do_not_specialize=["n_table", "first", "items", "col0", "cols", "row_words", "c0_words"])
    def scatter_rows(staging, ids, table, n_table, first, items, col0, cols, row_words, c0_words,
                     ELEM: tl.constexpr, BLOCK: tl.constexpr):
        """Pair p = (item, rectangle row): ``row_words`` words a staged row; table rows: slot offsets (words),
        addresses of block 0's chunks (bytes), strides and lengths (words)."""
        pid = tl.program_id(0)
        step = tl.num_programs(0)
        for p in range(pid, items * cols, step):
            item = p // cols
            col = col0 + p - item * cols
            blk = tl.load(ids + first + item)
            off = tl.load(table + col)
            dst = tl.load(table + n_table + col).to(tl.pointer_type(ELEM)) + blk * tl.load(table + 2 * n_table + col)
            n = tl.load(table + 3 * n_table + col)
            src = staging + item.to(tl.int64) * row_words + (off - c0_words)
            for k in range(0, n, BLOCK):
                idx = k + tl.arange(0, BLOCK)
                mask = idx < n
                tl.store(dst + idx, tl.load(src + idx, mask=mask), mask=mask)

    return scatter_rows
