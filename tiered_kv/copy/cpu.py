"""CPU fallback: the same block <-> slot copies with plain torch indexing.

Role: the mechanism used when the layout's tensors are on the CPU (CI, tests,
CPU-only development). Semantics are identical to the GPU mechanisms: slot
bytes follow ``KVLayout``'s canonical format, and only the listed blocks and
slots are touched. For each chunk of a block it builds one strided byte view of
the tensor's storage (``num_blocks`` rows of ``chunk`` bytes, ``block_stride``
apart) and moves all requested blocks with one gather or one ``index_put_``.

Threading: stateless functions; the copy is synchronous and finished on return.
Callers must not run two copies that write the same blocks or slots at once.
"""

from __future__ import annotations

import torch

from tiered_kv.copy.layouts import KVLayout, TensorBlockMap


def _chunk_views(t: torch.Tensor, m: TensorBlockMap, num_blocks: int) -> list[tuple[torch.Tensor, int]]:
    """``(view, slot_offset)`` per chunk; ``view[b]`` is that chunk of block ``b`` as bytes."""
    storage = t.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
    base = t.data_ptr() - storage.data_ptr()
    views = []
    pos = m.slot_offset
    for off, size in zip(m.chunk_offsets, m.chunk_sizes):
        views.append((flat.as_strided((num_blocks, size), (m.block_stride, 1), base + off), pos))
        pos += size
    return views


def blocks_to_slab(layout: KVLayout, gpu_ids: torch.Tensor, slab: torch.Tensor, slots: torch.Tensor) -> None:
    """Copy blocks ``gpu_ids[i]`` of ``layout`` into ``slab[slots[i]]`` (ids already validated)."""
    ids = gpu_ids.to(layout.device)
    dst_slots = slots.to(slab.device)
    for t, m in zip(layout.tensors, layout.maps):
        for view, pos in _chunk_views(t, m, layout.num_blocks):
            slab[dst_slots, pos : pos + view.shape[1]] = view[ids].to(slab.device)


def slab_to_blocks(layout: KVLayout, slab: torch.Tensor, slots: torch.Tensor, gpu_ids: torch.Tensor,
                   tensors: range | None = None) -> None:
    """Copy ``slab[slots[i]]`` into blocks ``gpu_ids[i]`` of ``layout`` (ids already validated).

    ``tensors``: only those tensors of the layout; default all.
    """
    ids = gpu_ids.to(layout.device)
    src_slots = slots.to(slab.device)
    pairs = list(zip(layout.tensors, layout.maps))
    for t, m in (pairs if tensors is None else [pairs[i] for i in tensors]):
        for view, pos in _chunk_views(t, m, layout.num_blocks):
            view[ids] = slab[src_slots, pos : pos + view.shape[1]].to(layout.device)
