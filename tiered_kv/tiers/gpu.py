"""GPU tier: a library-owned slab on CUDA, or a borrowed engine-owned tensor.

On a machine without CUDA the same code runs on a CPU tensor (``device="cpu"``), so CI
exercises every line. ``GpuTier.borrow(tensor)`` wraps an existing ``(num_blocks,
block_nbytes)`` uint8 view (an engine's KV cache viewed block-major); only the layout
description differs from an owned slab.

Threading contract: as ``Tier``. Copies into and out of the slab are issued by the
mover of the GPU edge on its own CUDA stream.
"""
from __future__ import annotations

import torch

from tiered_kv.errors import ConfigError, InvalidInputError
from tiered_kv.values.layout import BlockLayout
from tiered_kv.tiers.base import SlabTier


def resolve_device(device: str) -> torch.device:
    """``"auto"`` -> cuda if available else cpu; otherwise ``torch.device(device)``, checked to exist."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device: cannot parse {device!r} ({exc}); use 'auto', 'cpu' or 'cuda[:N]'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r} but torch sees no CUDA device; use 'auto' or 'cpu'")
    return dev


class GpuTier(SlabTier):
    """The fastest tier: a slab on the GPU (or on the CPU where there is no GPU)."""

    name = "gpu"

    def __init__(self, layout: BlockLayout, capacity_bytes: int, device: str = "auto",
                 slab: torch.Tensor | None = None) -> None:
        if slab is None:
            capacity = capacity_bytes // layout.nbytes
            if capacity_bytes and capacity == 0:
                raise ConfigError(f"gpu_bytes={capacity_bytes} is smaller than one block ({layout.nbytes} bytes)")
            slab = torch.empty((capacity, layout.nbytes), dtype=torch.uint8, device=resolve_device(device))
        super().__init__(layout, slab)

    @classmethod
    def borrow(cls, layout: BlockLayout, tensor: torch.Tensor) -> "GpuTier":
        """Wrap an engine-owned tensor whose rows are blocks (viewed as uint8, row = one block)."""
        if tensor.dim() < 1 or tensor.shape[0] == 0:
            raise InvalidInputError(f"borrowed KV tensor must have a leading block dim, got shape {tuple(tensor.shape)}")
        if not tensor.is_contiguous():
            raise InvalidInputError("borrowed KV tensor must be contiguous with blocks outermost (e.g. vLLM BLHNC)")
        rows = tensor.view(torch.uint8).reshape(tensor.shape[0], -1)
        if rows.shape[1] != layout.nbytes:
            raise InvalidInputError(f"borrowed KV tensor has {rows.shape[1]} bytes per block, layout says {layout.nbytes}")
        return cls(layout, 0, slab=rows)
