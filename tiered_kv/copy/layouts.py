"""Describe where an engine's KV blocks live, byte by byte, and how a slab slot holds one.

Role: the pure-descriptor half of the copy path. ``KVLayout`` wraps the engine's
KV tensors (one per layer, a K and a V per layer, or one cross-layer tensor),
names the dimension that indexes blocks, and derives, once, for every tensor the
byte extents of one block (``TensorBlockMap``): a stride between blocks and a
list of contiguous chunks inside a block. Everything here is torch metadata
arithmetic; no bytes move and no CUDA is needed, so it is unit-tested on CPU.

Canonical slot format (the bytes of one engine block in a slab slot)::

    slot = tensor[0] bytes | tensor[1] bytes | ... | tensor[T-1] bytes
    tensor[t] bytes = the block's elements of that tensor in ascending address order

With vLLM's per-layer tensors this is layer-major (layer 0 first); each layer's
part is the block's bytes in the engine's physical order (``LBNHC`` and
``LBHNC`` therefore give different slot bytes for the same KV: the layout
fingerprint, ``KVLayout.fingerprint()``, must be part of the key namespace).
For block-outermost ``BLHNC`` the slot equals the engine block byte for byte.
For SGLang's MHA pools the slot is SGLang's flat page, ``[K all layers][V all
layers]``.

Threading: ``KVLayout`` and ``TensorBlockMap`` are immutable after construction
and may be shared between threads. Building a layout reads tensor metadata only.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tiered_kv.copy.errors import LayoutError

#: A block split into more chunks than this is refused: copying it would cost one
#: descriptor per chunk and such a layout is a bug in the caller's view, not a cache.
MAX_CHUNKS_PER_BLOCK = 1 << 16


@dataclass(frozen=True)
class TensorBlockMap:
    """Byte extents of one block inside one tensor, plus its place in a slot.

    Block ``b`` of the tensor occupies, for each ``i``, the bytes
    ``[base_ptr + b*block_stride + chunk_offsets[i], ... + chunk_sizes[i])``,
    and those bytes go to ``slot_offset + sum(chunk_sizes[:i])`` in a slot.
    """

    base_ptr: int
    block_stride: int
    chunk_offsets: tuple[int, ...]
    chunk_sizes: tuple[int, ...]
    slot_offset: int

    @property
    def nbytes(self) -> int:
        """Bytes of one block in this tensor."""
        return sum(self.chunk_sizes)


def block_geometry(
    shape: Sequence[int],
    strides: Sequence[int],
    itemsize: int,
    block_dim: int,
    rows_per_block: int = 1,
) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
    """Return ``(num_blocks, block_stride, chunk_offsets, chunk_sizes)`` in bytes.

    ``shape``/``strides`` are a tensor's (strides in elements); ``rows_per_block``
    consecutive indices of ``block_dim`` form one block (1 for vLLM, the page
    size for SGLang's token-indexed pools). Chunks are the maximal contiguous
    byte runs of one block, sorted by address. Raises ``LayoutError`` for a
    broadcast (zero-stride) or self-overlapping block, or a block dim that
    ``rows_per_block`` does not divide.
    """
    ndim = len(shape)
    if len(strides) != ndim:
        raise LayoutError(f"shape {tuple(shape)} and strides {tuple(strides)} differ in length")
    if not 0 <= block_dim < ndim:
        raise LayoutError(f"block_dim={block_dim} is not a dimension of shape {tuple(shape)}")
    if rows_per_block < 1 or shape[block_dim] % rows_per_block:
        raise LayoutError(
            f"rows_per_block={rows_per_block} does not divide dim {block_dim} of shape {tuple(shape)}"
        )
    if itemsize < 1:
        raise LayoutError(f"itemsize={itemsize} must be >= 1")
    num_blocks = shape[block_dim] // rows_per_block
    block_stride = rows_per_block * strides[block_dim] * itemsize
    if num_blocks > 1 and block_stride <= 0:
        raise LayoutError(f"block dim {block_dim} has stride {strides[block_dim]}: broadcast views hold no blocks")
    dims = [
        (rows_per_block if i == block_dim else shape[i], strides[i])
        for i in range(ndim)
    ]
    dims = [(size, stride) for size, stride in dims if size > 1]
    for size, stride in dims:
        if stride <= 0:
            raise LayoutError(f"stride {stride} (size {size}) in {tuple(strides)}: broadcast views hold no blocks")
    dims.sort(key=lambda d: d[1])  # innermost (smallest stride) first
    merged: list[tuple[int, int]] = []
    for size, stride in dims:
        if merged and merged[-1][0] * merged[-1][1] == stride:
            merged[-1] = (merged[-1][0] * size, merged[-1][1])
        else:
            merged.append((size, stride))
    if merged and merged[0][1] == 1:
        chunk_bytes = merged[0][0] * itemsize
        outer = merged[1:]
    else:
        chunk_bytes = itemsize
        outer = merged
    num_chunks = math.prod(size for size, _ in outer)
    if num_chunks > MAX_CHUNKS_PER_BLOCK:
        raise LayoutError(
            f"one block of shape {tuple(shape)} strides {tuple(strides)} splits into {num_chunks} chunks"
            f" (> {MAX_CHUNKS_PER_BLOCK}); pass a view whose innermost dims are contiguous"
        )
    offsets = torch.zeros(1, dtype=torch.int64)
    for size, stride in outer:
        steps = torch.arange(size, dtype=torch.int64) * (stride * itemsize)
        offsets = (steps[:, None] + offsets[None, :]).reshape(-1)
    offsets, _ = torch.sort(offsets)
    if offsets.numel() > 1 and bool((offsets[1:] - offsets[:-1] < chunk_bytes).any()):
        raise LayoutError(f"one block of shape {tuple(shape)} strides {tuple(strides)} overlaps itself")
    offs = tuple(int(o) for o in offsets.tolist())
    return num_blocks, block_stride, offs, (chunk_bytes,) * len(offs)


@dataclass(frozen=True, eq=False)
class KVLayout:
    """An engine's KV tensors and the dimension that indexes blocks.

    ``tensors``: per-layer tensors (vLLM), K tensors then V tensors (SGLang's
    device pool), or one cross-layer / host-pool tensor. All on one device and
    with the same number of blocks. ``block_dim`` indexes blocks in every
    tensor; ``rows_per_block`` indices along it make one block. ``name`` is a
    free label that goes into the fingerprint (e.g. ``"vllm:LBNHC"``).

    Derived at construction: ``maps`` (one ``TensorBlockMap`` per tensor),
    ``num_blocks`` and ``block_nbytes`` (bytes of one slot).
    """

    tensors: tuple[torch.Tensor, ...]
    block_dim: int = 0
    rows_per_block: int = 1
    name: str = "custom"
    maps: tuple[TensorBlockMap, ...] = field(init=False)
    num_blocks: int = field(init=False)
    block_nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        tensors = tuple(self.tensors)
        if not tensors:
            raise LayoutError("KVLayout needs at least one tensor, got none")
        device = tensors[0].device
        maps: list[TensorBlockMap] = []
        num_blocks = -1
        slot_offset = 0
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise LayoutError(f"tensors[{i}] is a {type(t).__name__}, not a torch.Tensor")
            if t.device != device:
                raise LayoutError(f"tensors[{i}] is on {t.device}, tensors[0] on {device}: one device per layout")
            n, stride, offs, sizes = block_geometry(
                t.shape, t.stride(), t.element_size(), self.block_dim, self.rows_per_block
            )
            if num_blocks not in (-1, n):
                raise LayoutError(f"tensors[{i}] holds {n} blocks, tensors[0] holds {num_blocks}")
            num_blocks = n
            maps.append(TensorBlockMap(t.data_ptr(), stride, offs, sizes, slot_offset))
            slot_offset += sum(sizes)
        object.__setattr__(self, "tensors", tensors)
        object.__setattr__(self, "maps", tuple(maps))
        object.__setattr__(self, "num_blocks", num_blocks)
        object.__setattr__(self, "block_nbytes", slot_offset)

    @property
    def device(self) -> torch.device:
        """The device every tensor of the layout lives on."""
        return self.tensors[0].device

    @property
    def num_chunks(self) -> int:
        """Contiguous chunks per block over all tensors, before any merging."""
        return sum(len(m.chunk_offsets) for m in self.maps)

    def fingerprint(self) -> str:
        """A stable string naming the slot byte format (no pointers, no device).

        It records, per tensor, the dtype and the order in which a block's
        elements are laid out (logical dims from outermost to innermost, with
        sizes), so ``LBNHC`` and ``LBHNC`` differ while ``LBHNC`` and ``BLHNC``
        (whose slots are byte-identical) agree. Two layouts with equal
        fingerprints produce interchangeable slots: put it in the key namespace
        of every tier below the GPU.
        """
        sigs = [
            f"{str(t.dtype).removeprefix('torch.')}[{_element_order(t, self.block_dim, self.rows_per_block)}]"
            for t in self.tensors
        ]
        # collapse the usual 32 identical layers into one entry
        body = ";".join(f"{sig}x{len(list(group))}" for sig, group in itertools.groupby(sigs))
        return f"{self.name}|bytes={self.block_nbytes}|{body}"


def _element_order(t: torch.Tensor, block_dim: int, rows_per_block: int) -> str:
    """Logical dims of one block of ``t`` from outermost to innermost, as ``dim:size``."""
    dims = [
        (t.stride(i), i, rows_per_block if i == block_dim else t.shape[i])
        for i in range(t.dim())
    ]
    dims = sorted((d for d in dims if d[2] > 1), reverse=True)
    return ",".join(f"{i}:{size}" for _, i, size in dims)


def vllm_layer_layout(kv_caches: Sequence[torch.Tensor], name: str = "vllm") -> KVLayout:
    """Layout of vLLM's per-layer KV views, block index first (0.26 and 0.33).

    Accepts ``(num_blocks, H, N, 2*D)`` MHA views in any physical order
    (``LBNHC``, ``LBHNC``, ``BLHNC``, ...: the strides say which) and MLA's
    ``(num_blocks, N, latent)``. Pass layers in model order; the slot is then
    layer-major.
    """
    return KVLayout(tuple(kv_caches), block_dim=0, rows_per_block=1, name=name)


def vllm_cross_layer_layout(kv_cache: torch.Tensor, block_dim: int, name: str = "vllm-xl") -> KVLayout:
    """Layout of vLLM 0.26's single cross-layer KV tensor.

    ``block_dim`` is the dimension of ``kv_cache`` that indexes blocks (1 for the
    logical ``(L, B, H, N, 2D)`` view, 0 for the physical ``(B, L, ...)`` one).
    Every block is one contiguous run, so the slot equals the engine block.
    """
    return KVLayout((kv_cache,), block_dim=block_dim, rows_per_block=1, name=name)


_SGLANG_HOST_BLOCK_DIM = {
    ("layer_first", False): 2,  # MHA (2, L, size, H, D)
    ("page_first", False): 1,  # MHA (2, size, L, H, D)
    ("layer_first", True): 1,  # MLA (L, size, 1, kv_dim)
    ("page_first", True): 0,  # MLA (size, L, 1, kv_dim)
}


def sglang_host_layout(kv_buffer: torch.Tensor, layout: str, page_size: int, mla: bool = False) -> KVLayout:
    """Layout of an SGLang host-pool ``kv_buffer`` (``layer_first`` or ``page_first``).

    Blocks are pages of ``page_size`` tokens; block id = first token index //
    page_size. The slot holds the page's bytes in the buffer's address order,
    which is SGLang's flat page of that layout: ``[K all layers][V all layers]``
    for MHA (layer-major inside K for ``layer_first``, token-major for
    ``page_first``), all layers for MLA.
    """
    key = (layout, bool(mla))
    if key not in _SGLANG_HOST_BLOCK_DIM:
        raise LayoutError(f"sglang layout {layout!r} is not one of 'layer_first', 'page_first'")
    return KVLayout(
        (kv_buffer,), block_dim=_SGLANG_HOST_BLOCK_DIM[key], rows_per_block=page_size,
        name=f"sglang:{layout}:{'mla' if mla else 'mha'}",
    )


def sglang_device_layout(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor] | None,
    page_size: int,
) -> KVLayout:
    """Layout of SGLang's device pool: per-layer ``(size, H, D)`` K and V buffers.

    MLA pools pass their per-layer ``(size, 1, kv_dim)`` buffers as
    ``k_buffers`` and ``v_buffers=None``. The slot is K of every layer, then V
    of every layer, which is byte-identical to the ``layer_first`` host page.
    """
    tensors = list(k_buffers) + list(v_buffers or ())
    kind = "mha" if v_buffers else "mla"
    return KVLayout(tuple(tensors), block_dim=0, rows_per_block=page_size, name=f"sglang:device:{kind}")
