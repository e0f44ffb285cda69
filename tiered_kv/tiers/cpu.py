"""Pinned-CPU tier: a slab of host memory with a hard byte budget.

The slab is allocated at once as ordinary memory and, where CUDA is available, page-locked
(pinned) in the background (``cudaHostRegister``), so opening a store with a large CPU tier
does not block for seconds; copies work before pinning ends, only slower. The slab is
registered as one range by default: the driver refuses a batched copy whose host range
spans two registrations (seen on an H200 with 1 GiB chunks). ``pin_chunk_bytes`` splits the
registration for very large slabs, for callers whose copies never cross a chunk.
Without CUDA the slab stays plain memory and everything else is the same.

Threading contract: as ``Tier``. The pinning thread only registers memory; it never
reads or writes block bytes. ``close()`` waits for it and unregisters what it pinned.
"""
from __future__ import annotations

import logging
import threading

import torch

from tiered_kv.errors import ConfigError
from tiered_kv.values.layout import BlockLayout
from tiered_kv.tiers.base import SlabTier

log = logging.getLogger(__name__)


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
        self._pin = torch.cuda.is_available() if pin is None else bool(pin and torch.cuda.is_available())
        self._pinned_bytes = 0
        self._registered: list[tuple[int, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._pin and capacity:
            # One registration by default: the driver rejects a copy whose host range spans two
            # registrations, and batched copies merge neighbouring slots into one range.
            chunk = self.slab.untyped_storage().nbytes() if pin_chunk_bytes is None else max(pin_chunk_bytes, 1 << 20)
            self._thread = threading.Thread(target=self._pin_in_chunks, args=(chunk,),
                                            name="tkv-cpu-pin", daemon=True)
            self._thread.start()

    @property
    def pinned_fraction(self) -> float:
        """Share of the slab already page-locked (1.0 when no pinning is wanted or possible)."""
        total = self.slab.untyped_storage().nbytes()
        if not self._pin or total == 0:
            return 1.0
        return self._pinned_bytes / total

    def wait_pinned(self, timeout: float | None = None) -> bool:
        """Block until background pinning ended; True if it did."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def _pin_in_chunks(self, chunk: int) -> None:
        cudart = torch.cuda.cudart()
        # Register the whole allocation, not just the aligned view: torch's is_pinned() asks about
        # the storage's first byte, which sits before the view when the slab was aligned.
        storage = self.slab.untyped_storage()
        base, total = storage.data_ptr(), storage.nbytes()
        off = 0
        while off < total and not self._stop.is_set():
            n = min(chunk, total - off)
            err = cudart.cudaHostRegister(base + off, n, 1)  # 1 = portable: pinned for every device's context
            if int(err) != 0:
                log.warning("cpu tier: pinning %d bytes at offset %d failed (cuda error %s); "
                            "the rest stays pageable", n, off, err)
                return
            self._registered.append((base + off, n))
            off += n
            self._pinned_bytes = off
        log.info("cpu tier: pinned %.1f GiB", off / 2**30)

    def describe(self) -> dict:
        """Adds the pinned fraction."""
        d = super().describe()
        d["pinned_fraction"] = round(self.pinned_fraction, 3)
        return d

    def close(self) -> None:
        """Stop pinning and unregister pinned memory."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._registered:
            cudart = torch.cuda.cudart()
            for ptr, _ in self._registered:
                cudart.cudaHostUnregister(ptr)
            self._registered.clear()
