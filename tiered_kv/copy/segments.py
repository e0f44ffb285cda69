"""Turn "these blocks to those slots" into a list of byte runs, merged where adjacent.

Role: the planning step shared by the GPU mechanisms. ``ChunkTable`` flattens a
``KVLayout`` into four int64 vectors (one entry per chunk of a block, in slot
order) once; ``plan_runs`` then computes, with a few vectorised torch ops on
CPU, the absolute source address, destination address and length of every
chunk of every requested block, and merges consecutive entries whose source
and destination are both contiguous (a ``BLHNC`` block collapses to one run;
consecutive blocks into consecutive slots collapse further). Pure CPU torch:
unit-tested without CUDA.

Threading: ``ChunkTable`` is immutable after construction and may be shared;
``plan_runs`` allocates fresh tensors per call and is safe from any thread.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tiered_kv.copy.errors import BlockIndexError
from tiered_kv.copy.layouts import KVLayout

BlockIds = Sequence[int] | torch.Tensor


@dataclass(frozen=True, eq=False)
class ChunkTable:
    """One row per chunk of a block, in slot order (int64, CPU).

    ``gpu_base[c]``: address of chunk ``c`` of block 0; ``gpu_stride[c]``: bytes
    between blocks for that chunk's tensor; ``slot_offset[c]``: where the chunk
    sits in a slot; ``size[c]``: its length; ``storage[c]``: an id of the
    allocation holding it (chunks of different allocations never share a 2-D
    copy: the driver refuses a pitched range that crosses allocations).
    """

    gpu_base: torch.Tensor
    gpu_stride: torch.Tensor
    slot_offset: torch.Tensor
    size: torch.Tensor
    storage: torch.Tensor | None = None

    @staticmethod
    def from_layout(layout: KVLayout) -> ChunkTable:
        """Flatten ``layout.maps`` into the four vectors."""
        base: list[int] = []
        stride: list[int] = []
        slot: list[int] = []
        size: list[int] = []
        storage: list[int] = []
        for t, m in zip(layout.tensors, layout.maps):
            pos = m.slot_offset
            owner = t.untyped_storage().data_ptr()
            for off, n in zip(m.chunk_offsets, m.chunk_sizes):
                base.append(m.base_ptr + off)
                stride.append(m.block_stride)
                slot.append(pos)
                size.append(n)
                storage.append(owner)
                pos += n
        as64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        return ChunkTable(as64(base), as64(stride), as64(slot), as64(size), as64(storage))


@dataclass(frozen=True, eq=False)
class Runs:
    """Byte runs of one copy: ``src[i]`` -> ``dst[i]``, ``size[i]`` bytes (int64, CPU)."""

    src: torch.Tensor
    dst: torch.Tensor
    size: torch.Tensor

    @property
    def count(self) -> int:
        """Number of runs."""
        return int(self.size.numel())

    @property
    def nbytes(self) -> int:
        """Total bytes moved."""
        return int(self.size.sum()) if self.count else 0


def as_index_tensor(ids: BlockIds, what: str) -> torch.Tensor:
    """Return a private 1-D int64 CPU copy of ``ids``; raise ``BlockIndexError`` if it is not integral."""
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise BlockIndexError(f"{what} has dtype {ids.dtype}; pass integers")
        t = ids.detach().to(device="cpu", dtype=torch.int64, copy=True).reshape(-1)
    else:
        values = list(ids)
        try:  # ints through a machine array: a few times faster than torch's per-element conversion of a list
            return torch.frombuffer(array("q", values), dtype=torch.int64).clone() if values else _EMPTY.clone()
        except (TypeError, OverflowError):  # anything else (floats, ...) as torch converts it
            pass
        try:
            t = torch.as_tensor(values, dtype=torch.int64).reshape(-1)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise BlockIndexError(f"{what} must be a sequence of ints: {exc}") from exc
    return t


_EMPTY = torch.empty(0, dtype=torch.int64)


def check_indices(ids: torch.Tensor, limit: int, what: str, unique: bool) -> None:
    """Raise ``BlockIndexError`` unless every id is in ``[0, limit)`` (and distinct if ``unique``)."""
    if ids.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(ids))  # one pass, not two
    if lo < 0 or hi >= limit:
        bad = lo if lo < 0 else hi
        raise BlockIndexError(f"{what} contains {bad}, outside [0, {limit})")
    if unique and torch.unique(ids).numel() != ids.numel():
        raise BlockIndexError(f"{what} repeats an id; a copy may write each destination once")


def plan_runs(
    table: ChunkTable,
    gpu_ids: torch.Tensor,
    slots: torch.Tensor,
    slab_base: int,
    slot_stride: int,
    to_cpu: bool,
    merge: bool = True,
) -> Runs:
    """Byte runs copying blocks ``gpu_ids[i]`` <-> slots ``slots[i]``.

    ``slab_base`` is the address of slot 0 and ``slot_stride`` the bytes between
    slots. ``to_cpu`` picks the direction (GPU -> slab when True). Entries are
    ordered block by block, chunk by chunk in slot order, so adjacent chunks of
    one block and adjacent blocks in adjacent slots merge when ``merge``.
    """
    if gpu_ids.numel() != slots.numel():
        raise BlockIndexError(f"{gpu_ids.numel()} block ids but {slots.numel()} slots")
    gpu = (table.gpu_base[None, :] + gpu_ids[:, None] * table.gpu_stride[None, :]).reshape(-1)
    cpu = (slab_base + slots[:, None] * slot_stride + table.slot_offset[None, :]).reshape(-1)
    size = table.size.repeat(gpu_ids.numel())
    src, dst = (gpu, cpu) if to_cpu else (cpu, gpu)
    return merge_runs(Runs(src, dst, size)) if merge else Runs(src, dst, size)


def block_runs(table: ChunkTable) -> int:
    """Byte runs one block of ``table`` takes to copy (its chunks in slot order, adjacent ones merged).

    Counted on block 0 into slot 0: chunks adjacent there (the layers of a cross-layer KV tensor)
    are taken to be adjacent in every block, as they are when they share a block stride.
    """
    zero = torch.zeros(1, dtype=torch.int64)
    return plan_runs(table, zero, zero, 0, 0, True).count


def merge_runs(runs: Runs) -> Runs:
    """Merge each run into its predecessor when both its source and destination follow on."""
    n = runs.count
    if n <= 1:
        return runs
    src, dst, size = runs.src, runs.dst, runs.size
    follows = (src[1:] == src[:-1] + size[:-1]) & (dst[1:] == dst[:-1] + size[:-1])
    starts = torch.ones(n, dtype=torch.bool)
    starts[1:] = ~follows
    first = starts.nonzero().reshape(-1)
    if first.numel() == n:
        return runs
    run_id = torch.cumsum(starts.to(torch.int64), 0) - 1
    merged = torch.zeros(first.numel(), dtype=torch.int64).index_add_(0, run_id, size)
    return Runs(src[first], dst[first], merged)


def split_runs(runs: Runs, max_bytes: int) -> Runs:
    """Cut every run longer than ``max_bytes`` into pieces of at most ``max_bytes`` (same bytes moved)."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes={max_bytes} must be >= 1")
    if runs.count == 0 or int(runs.size.max()) <= max_bytes:
        return runs
    pieces = (runs.size + max_bytes - 1) // max_bytes
    owner = torch.repeat_interleave(torch.arange(runs.count), pieces)
    first_piece = torch.cumsum(pieces, 0) - pieces
    k = torch.arange(int(pieces.sum())) - first_piece[owner]  # piece number inside its run
    offset = k * max_bytes
    size = torch.minimum(runs.size[owner] - offset, torch.tensor(max_bytes, dtype=torch.int64))
    return Runs(runs.src[owner] + offset, runs.dst[owner] + offset, size)


@dataclass(frozen=True, eq=False)
class RectTable:
    """A block's chunks grouped into 2-D rectangles (int64, CPU), one row per rectangle.

    Rectangle ``r`` of block ``b``: ``height[r]`` rows of ``width[r]`` bytes
    starting at ``gpu_base[r] + b * gpu_stride[r]``, rows ``pitch[r]`` apart on
    the GPU and back to back in the slot from ``slot_offset[r]``. vLLM's
    per-layer views of one buffer make one rectangle per block (a row per
    layer), which the copy engine moves as one 2-D copy instead of 32 runs.
    """

    gpu_base: torch.Tensor
    gpu_stride: torch.Tensor
    pitch: torch.Tensor
    width: torch.Tensor
    height: torch.Tensor
    slot_offset: torch.Tensor

    @property
    def count(self) -> int:
        """Rectangles per block."""
        return int(self.height.numel())

    @staticmethod
    def from_chunks(table: ChunkTable) -> RectTable:
        """Group consecutive chunks of one allocation, equal size and block stride, stepping by one pitch."""
        base, stride, size = table.gpu_base.tolist(), table.gpu_stride.tolist(), table.size.tolist()
        slot = table.slot_offset.tolist()
        owner = table.storage.tolist() if table.storage is not None else list(range(len(base)))
        rects: list[list[int]] = []  # [gpu_base, gpu_stride, pitch, width, height, slot_offset]
        for i in range(len(base)):
            if rects and owner[i] == owner[i - 1]:
                r = rects[-1]
                same = size[i] == r[3] and stride[i] == r[1] and slot[i] == r[5] + r[3] * r[4]
                step = base[i] - (r[0] + (r[4] - 1) * r[2])
                if same and r[4] == 1 and step >= size[i]:
                    r[2], r[4] = step, 2
                    continue
                if same and r[4] > 1 and step == r[2]:
                    r[4] += 1
                    continue
            rects.append([base[i], stride[i], size[i], size[i], 1, slot[i]])
        cols = list(zip(*rects)) if rects else [()] * 6
        as64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        return RectTable(*(as64(list(c)) for c in cols))


@dataclass(frozen=True, eq=False)
class Rects:
    """2-D copies of one call (int64, CPU): GPU address and pitch, slab address, row width, rows."""

    gpu: torch.Tensor
    cpu: torch.Tensor
    pitch: torch.Tensor
    width: torch.Tensor
    height: torch.Tensor

    @property
    def count(self) -> int:
        """Number of 2-D copies."""
        return int(self.height.numel())


def plan_rects(table: RectTable, gpu_ids: torch.Tensor, slots: torch.Tensor, slab_base: int, slot_stride: int) -> Rects:
    """2-D copies moving blocks ``gpu_ids[i]`` <-> slots ``slots[i]`` (same bytes as ``plan_runs``)."""
    if gpu_ids.numel() != slots.numel():
        raise BlockIndexError(f"{gpu_ids.numel()} block ids but {slots.numel()} slots")
    n = gpu_ids.numel()
    gpu = (table.gpu_base[None, :] + gpu_ids[:, None] * table.gpu_stride[None, :]).reshape(-1)
    cpu = (slab_base + slots[:, None] * slot_stride + table.slot_offset[None, :]).reshape(-1)
    return Rects(gpu, cpu, table.pitch.repeat(n), table.width.repeat(n), table.height.repeat(n))
