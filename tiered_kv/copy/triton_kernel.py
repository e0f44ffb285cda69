"""SM-kernel mechanism: one persistent Triton launch that copies every run through UVA.

Role: for copies split into many small runs, where the copy engine pays a
per-descriptor cost, one kernel reads and writes pinned host memory directly
(pinned memory is mapped into the GPU's address space, so a host pointer is a
valid device pointer). Runs are cut into pieces of at most ``PIECE_BYTES``;
a fixed grid of ``programs`` programs walks the pieces (grid-stride), so the
kernel holds at most that many CTAs however many runs there are: the knob that
trades copy rate against SMs taken from the model (measured in
docs/gpu_copy.md).

The piece table (src, dst, length) is staged in pinned memory and uploaded on
the copy's stream; torch's caching allocators keep both buffers alive until
the stream has used them.

Triton compiles the kernel once per specialization, at its first launch: per
word width (``ELEM``) and loop step (``BLOCK``), the two constants a copy's
runs decide (``variant``); the piece count is not specialized on. A first
launch inside a serving step would stall that step while it compiles (H200,
2026-11-30: one per phase in the SM-kernel serving runs), so the worker
compiles its layouts' variants at start-up (``warm``).

Threading: the compiled kernel is shared; ``launch`` may be called from any
thread, each with its own stream; ``warm`` from any thread (it synchronizes
the device). Triton is imported on first use only.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable

import torch

from tiered_kv.copy.errors import BackendUnavailableError
from tiered_kv.copy.segments import Runs, split_runs

PIECE_BYTES = 64 * 1024  # longest piece one program copies before moving to its next piece
DEFAULT_PROGRAMS = 32  # CTAs of one launch: 8 KiB runs copy as fast as with 132, a quarter of the harm
NUM_WARPS = 4


def triton_available() -> bool:
    """True when Triton imports and CUDA is present."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=1)
def _kernel() -> Callable[..., object]:
    try:
        import triton
        import triton.language as tl
    except ImportError as exc:
        raise BackendUnavailableError(f"the SM-kernel copy needs Triton: {exc}") from exc

    @triton.jit(do_not_specialize=["num_pieces"])  # one compilation per (ELEM, BLOCK), whatever the count
    def copy_pieces(desc, num_pieces, ELEM: tl.constexpr, BLOCK: tl.constexpr):
        """Grid-stride over pieces; ``desc`` rows: src addresses, dst addresses, lengths in ELEM words."""
        first = tl.program_id(0)
        step = tl.num_programs(0)
        for p in range(first, num_pieces, step):
            src = tl.load(desc + p).to(tl.pointer_type(ELEM))
            dst = tl.load(desc + num_pieces + p).to(tl.pointer_type(ELEM))
            n = tl.load(desc + 2 * num_pieces + p)
            for off in range(0, n, BLOCK):
                idx = off + tl.arange(0, BLOCK)
                mask = idx < n
                tl.store(dst + idx, tl.load(src + idx, mask=mask), mask=mask)

    return copy_pieces


def _elem_width(runs: Runs) -> int:
    """Widest power-of-two word (<= 8 bytes) dividing every address and length."""
    bits = runs.src | runs.dst | runs.size
    for width in (8, 4, 2):
        if bool((bits % width == 0).all()):
            return width
    return 1


def loop_step(typical: int) -> int:
    """Elements per loop step of a kernel whose typical copy is ``typical`` elements: rounded up to a power of two,
    in [128, 1024] (this kernel's and the staged scatter's, ``scatter_table.py``)."""
    block = 128
    while block < typical and block < 1024:
        block *= 2
    return block


def _block_elems(pieces: Runs, width: int) -> int:
    """Elements per loop step: the typical piece (``loop_step``)."""
    return loop_step(int(pieces.size.median()) // width)


def variant(runs: Runs) -> tuple[int, int]:
    """The specialization a launch over ``runs`` compiles: ``(word width in bytes, elements per loop step)``.
    Pure CPU arithmetic (tests, the start-up warm-up)."""
    width = _elem_width(runs)
    return width, _block_elems(split_runs(runs, PIECE_BYTES), width)


def elem_type(width: int):
    """Triton's integer type of ``width`` bytes (a kernel's ``ELEM``: its word); imports Triton."""
    import triton.language as tl

    return {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}[width]


def launch(runs: Runs, device: torch.device, stream: torch.cuda.Stream, programs: int = DEFAULT_PROGRAMS) -> None:
    """Enqueue one kernel copying every run of ``runs`` on ``stream`` with at most ``programs`` CTAs."""
    if runs.count == 0:
        return
    if programs < 1:
        raise ValueError(f"programs={programs} must be >= 1")
    width = _elem_width(runs)
    pieces = split_runs(runs, PIECE_BYTES)
    n = pieces.count
    table = torch.empty((3, n), dtype=torch.int64, pin_memory=True)
    table[0].copy_(pieces.src)
    table[1].copy_(pieces.dst)
    torch.div(pieces.size, width, rounding_mode="floor", out=table[2])
    block = _block_elems(pieces, width)
    kernel = _kernel()
    with torch.cuda.stream(stream):
        desc = table.to(device, non_blocking=True)
        kernel[(min(n, programs),)](desc, n, ELEM=elem_type(width), BLOCK=block, num_warps=NUM_WARPS)


def warm(device: torch.device, variants: Iterable[tuple[int, int]]) -> float:
    """Compile (or load from Triton's cache on disk) each ``(width, block)`` specialization of the kernel on
    ``device`` by running it once over a scratch copy on the device, so no later launch compiles on its caller's
    thread. Returns the seconds it took (the device synchronized). Raises ``BackendUnavailableError`` without
    Triton."""
    kernel = _kernel()
    t0 = time.perf_counter()
    for width, block in sorted(set(variants)):
        nbytes = 2 * block * width
        src = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        desc = torch.tensor([src.data_ptr(), dst.data_ptr(), nbytes // width], dtype=torch.int64, device=device)
        kernel[(1,)](desc, 1, ELEM=elem_type(width), BLOCK=block, num_warps=NUM_WARPS)
    torch.cuda.synchronize(device)
    return time.perf_counter() - t0
