"""Pinned-CPU tier: a slab of host memory with a hard byte budget.

The slab is allocated at once as ordinary memory and, where CUDA is available, page-locked
(pinned) in the background (``cudaHostRegister``), so opening a store with a large CPU tier
does not block for seconds; copies work before pinning ends, only slower. The slab is
registered as one range by default: the driver refuses a batched copy whose host range
spans two registrations (seen on an H200 with 1 GiB chunks). ``pin_chunk_bytes`` splits the
registration for very large slabs, for callers whose copies never cross a chunk.
Without CUDA the slab stays plain memory and everything else is the same.

Threading contract: as ``Tier``. The pinning thread (``pinning.HostPin``) only registers memory; it
never reads or writes block bytes. ``close()`` waits for it and unregisters what it pinned.
"""
from __future__ import annotations

import torch

from tiered_kv.errors import ConfigError
from tiered_kv.values.layout import BlockLayout
from tiered_kv.tiers.base import SlabTier
from tiered_kv.tiers.pinning import HostPin


def aligned_empty(rows: int, row_bytes: int, align: int = 4096) -> torch.Tensor:
    """A ``(rows, row_bytes)`` uint8 CPU tensor starting at an ``align``-byte boundary.

    With ``row_bytes`` a multiple of 4 KiB every row is page-aligned, so the disk tier can
    move it with O_DIRECT and no bounce copy.
    """
    raw = torch.empty(rows * row_bytes + align, dtype=torch.uint8)
    # No transparent-huge-page advice: on the H200 machine it left DMA rates unchanged (55 GB/s
    # either way, 1 GiB of 2 MiB or 64 KiB runs) and made pinning 42% slower (8 GiB: 6.1 s
    # against 4.3 s); benchmarks/probes/host_memory_probe.py, docs/benchmarks.md.
    skip = (-raw.data_ptr()) % align
    return raw[skip:skip + rows * row_bytes].view(rows, row_bytes)


class CpuTier(SlabTier):
    """Host-memory slab tier; pinned in the background when CUDA is present."""

    name = "cpu"

    def __init__(self, layout: BlockLayout, capacity_bytes: int, pin: bool | None = None,
                 pin_chunk_bytes: int | None = None) -> None:
        capacity = capacity_bytes // layout.nbytes
        if capacity_bytes and capacity == 0:
            raise ConfigError(f"cpu_bytes={capacity_bytes} is smaller than one block ({layout.nbytes} bytes); "
                              f"raise cpu_bytes or set it to 0 to drop the CPU tier")
        super().__init__(layout, aligned_empty(capacity, layout.nbytes))
        # Register the whole allocation, not just the aligned view: torch's is_pinned() asks about the
        # storage's first byte, which sits before the view when the slab was aligned.
        storage = self.slab.untyped_storage()
        self._pin = HostPin(storage.data_ptr(), storage.nbytes() if capacity else 0, pin, "cpu tier",
                            "tkv-cpu-pin", pin_chunk_bytes)

    @property
    def pinned_fraction(self) -> float:
        """Share of the slab already page-locked (1.0 when no pinning is wanted or possible)."""
        return self._pin.fraction

    def wait_pinned(self, timeout: float | None = None) -> bool:
        """Block until background pinning ended; True if it did."""
        return self._pin.wait(timeout)

    def describe(self) -> dict:
        """Adds the pinned fraction."""
        d = super().describe()
        d["pinned_fraction"] = round(self.pinned_fraction, 3)
        return d

    def close(self) -> None:
        """Stop pinning and unregister pinned memory."""
        self._pin.close()
