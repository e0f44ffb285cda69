"""``ShmSlots``: a host pool's payload, one file in ``/dev/shm`` that every process of the pool maps.

The file holds ``slots`` rows of ``slot_bytes`` (the block size itself: no rounding, so ``slab`` has the
shape of a private CPU tier's slab and a copier that takes a slab and slot numbers works on it as is).
Every process maps the same pages (``MAP_SHARED``), so the pool's memory exists once on the host however
many processes use it, and each process page-locks its own mapping for DMA (``HostPin``: the pages are
the same, the registration is per process). The creator reserves every page with ``posix_fallocate``
before anyone maps it: a write into a ``/dev/shm`` that ran out of room would otherwise kill the writer
with SIGBUS; reserving turns that into a ``ConfigError`` at creation (about 0.5 s per GiB on the CI box).

It moves one block's bytes into or out of one slot and checks them against the record header's
checksum (the second line of defence: a record is committed only after its payload is written, and a
slot is never reused under a lease, so a reader never meets a torn slot; a process that scribbles on
the shared pages is caught here). Which slot holds which key is the index's business.

Threading contract: ``write``, ``read``, ``header_of`` and ``verify`` may run on several threads at once
for different slots; ``close()`` once, after every caller stopped (views handed out keep the mapping
alive until they are dropped).
"""
from __future__ import annotations

import errno
import mmap
import os
import stat
from pathlib import Path

import numpy as np
import torch

from tiered_kv.errors import ConfigError, RecordError
from tiered_kv.tiers.pinning import HostPin
from tiered_kv.tiers.pool.place import Geometry
from tiered_kv.values.record import CODEC_NONE, RecordHeader, payload_checksum


def create_payload(path: Path, nbytes: int) -> int:
    """Make the payload file (0600, never through a symlink) with all its ``nbytes`` reserved; return its fd."""
    st = os.statvfs(path.parent)
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        raise ConfigError(f"cpu pool: {str(path.parent.parent.parent)!r} has {free} bytes free, the pool needs "
                          f"{nbytes} (cpu_bytes): enlarge it (docker: --shm-size) or lower cpu_bytes")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            os.close(fd)
            os.unlink(path)
            raise ConfigError(f"cpu pool: cannot reserve {nbytes} bytes in {str(path.parent)!r} ({exc}): enlarge "
                              f"/dev/shm (docker: --shm-size) or lower cpu_bytes") from None
        os.ftruncate(fd, nbytes)  # a file system without fallocate: pages come on first touch
    return fd


def open_payload(path: Path, nbytes: int) -> int:
    """Open an existing payload file; ConfigError unless it is this user's regular file of ``nbytes`` bytes."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"cpu pool: cannot open {str(path)!r}: {exc}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size != nbytes:
        os.close(fd)
        raise ConfigError(f"cpu pool: {str(path)!r} is not this user's payload of {nbytes} bytes (size "
                          f"{st.st_size}, uid {st.st_uid}); stop the pool's processes and remove its directory")
    return fd


class ShmSlots:
    """The payload of a pool: ``slab`` is a ``(slots, slot_bytes)`` uint8 tensor over the shared mapping.

    ``create``: make the file (the caller holds the pool lock); else open the one there. ``pin`` as for the
    CPU tier (None: when CUDA is present); ``what`` names the pool in log lines.
    """

    def __init__(self, path: Path, geo: Geometry, create: bool, pin: bool | None, what: str) -> None:
        self.path = path
        self.slot_bytes = geo.slot_bytes
        self.slots = geo.slots
        fd = create_payload(path, geo.nbytes) if create else open_payload(path, geo.nbytes)
        try:
            self._mm = mmap.mmap(fd, geo.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.slab = torch.frombuffer(self._mm, dtype=torch.uint8).view(geo.slots, geo.slot_bytes)
        self._rows = self.slab.numpy()
        self.pin = HostPin(self.slab.data_ptr(), geo.nbytes, pin, what, "tkv-pool-pin")

    # ------------------------------------------------------------------ bytes
    def view(self, slot: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of ``slot``: a 1-D uint8 view of the shared pages (no copy)."""
        return self.slab[slot, :nbytes]

    def header_of(self, slot: int, nbytes: int, layout_fp: int) -> RecordHeader:
        """The header describing the ``nbytes`` now in ``slot`` (their checksum; the record's version of truth)."""
        return RecordHeader(CODEC_NONE, layout_fp, slot, nbytes, nbytes, payload_checksum(self._rows[slot, :nbytes]))

    def write(self, slot: int, raw: np.ndarray, layout_fp: int) -> RecordHeader:
        """Copy one block's bytes ``raw`` (1-D uint8, at most ``slot_bytes``) into ``slot``; return its header."""
        self._rows[slot, :raw.nbytes] = raw
        return self.header_of(slot, raw.nbytes, layout_fp)

    def read(self, hdr: RecordHeader, dst: torch.Tensor) -> None:
        """Copy the payload ``hdr`` describes into ``dst`` (1-D uint8, CPU) and verify the copy; RecordError when
        it does not match (``dst`` then holds undefined bytes)."""
        self._check(hdr)
        dst.copy_(self.slab[hdr.slot, :hdr.raw_len])
        if payload_checksum(dst.numpy()) != hdr.payload_xxh:
            raise RecordError("payload checksum mismatch")

    def verify(self, hdr: RecordHeader) -> bool:
        """Whether the bytes in ``hdr``'s slot match its checksum (read in place, no copy)."""
        self._check(hdr)
        return payload_checksum(self._rows[hdr.slot, :hdr.raw_len]) == hdr.payload_xxh

    def _check(self, hdr: RecordHeader) -> None:
        if hdr.codec != CODEC_NONE or hdr.payload_len != hdr.raw_len or hdr.raw_len > self.slot_bytes:
            raise RecordError(f"record (codec {hdr.codec}, {hdr.payload_len} of {hdr.raw_len} bytes) does not fit a "
                              f"{self.slot_bytes}-byte pool slot")

    # ------------------------------------------------------------------ the SlotPayload rest
    def slot_count(self) -> int:
        """Slots in the pool."""
        return self.slots

    def datasync(self) -> None:
        """Nothing to do: the pages are the memory."""

    def flush(self) -> None:
        """Nothing to do: a pool is volatile."""

    def close(self) -> None:
        """Unpin and unmap (the mapping outlives this while views handed out are alive)."""
        self.pin.close()
        self.slab = self._rows = None
        try:
            self._mm.close()
        except BufferError:  # views of it still alive elsewhere: the mapping goes with them
            pass
