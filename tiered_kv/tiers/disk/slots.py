"""The disk tier's payload file: ``payload.bin``, fixed slots of ``slot_bytes`` (a 4 KiB multiple).

``SlotFile`` moves the bytes of one block into or out of one slot at ``slot * slot_bytes`` with
one positional ``pwrite``/``preadv``: with O_DIRECT where the file system allows (no page-cache
copy; reads measure the disk, not RAM), else buffered. O_DIRECT needs page-aligned memory and
sizes, so an unaligned row goes through a page-aligned bounce buffer of one slot per thread.
It applies the codec (zstd, kept only when it makes the payload smaller: it saves I/O bytes, not
slot space) and verifies what it reads against the record header (length, xxh3 checksum) before
the bytes count as read. Which slot holds which key is the index's business (index.py), not this
file's.

``memory_fs`` says whether the file lives on a memory file system (tmpfs, ramfs: ``DISK_PATH=/dev/shm/...``),
found once at open from ``/proc/self/mountinfo`` (False where that cannot tell). O_DIRECT is used there all the
same where the kernel accepts it (Linux 6.6 on tmpfs), but AIO submits on such a file copy each read inside
``io_submit`` on the submitting thread (``tiers/disk/aio.py``), so the in-step disk load reads it on several
AIO lanes (``connector/vllm/in_step_disk.py``).

Threading contract: ``write`` and ``read`` may run on several threads at once for different
slots (positional I/O; the bounce buffer and the zstd contexts are per thread). ``close()``
once, after every caller stopped.
"""
from __future__ import annotations

import logging
import mmap
import os
import threading
from pathlib import Path

import numpy as np
import torch
import zstandard

from tiered_kv.errors import ConfigError, RecordError
from tiered_kv.values.record import CODEC_NONE, CODEC_ZSTD, RecordHeader, payload_checksum

log = logging.getLogger(__name__)

ALIGN = 4096
#: File systems whose files live in memory (their reads are memory copies on the reading thread)
MEMORY_FS_TYPES = frozenset({"tmpfs", "ramfs"})


def file_system_type(fd: int) -> str | None:
    """The type (``ext4``, ``tmpfs``, ...) of the file system holding the file open at ``fd``: the mount in
    ``/proc/self/mountinfo`` whose ``major:minor`` is the file's ``st_dev``; None where that cannot tell (no
    /proc, no such line: e.g. a btrfs subvolume's anonymous device)."""
    try:
        st = os.fstat(fd)
        dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                # "36 35 98:0 /root /mnt opts [optional fields...] - fstype source superopts"
                fields = line.split()
                if len(fields) > 2 and fields[2] == dev and "-" in fields:
                    sep = fields.index("-")
                    return fields[sep + 1] if sep + 1 < len(fields) else None
    except (OSError, ValueError):
        return None
    return None


def _aligned(arr, nbytes: int) -> bool:
    """True for a numpy array at a 4 KiB-aligned address with a 4 KiB-multiple length (O_DIRECT's rule)."""
    iface = getattr(arr, "__array_interface__", None)
    return iface is not None and iface["data"][0] % ALIGN == 0 and nbytes % ALIGN == 0


class SlotFile:
    """The payload file of one disk-tier directory: fixed-size slots, O_DIRECT where possible.

    Opens (or, unless ``readonly``, creates with mode 0600) ``path``, never following a symlink.
    ``codec`` (``CODEC_NONE`` or ``CODEC_ZSTD``) and ``zstd_level`` apply to writes; reads follow
    each record's header. Raises ConfigError when the file cannot be opened.
    """

    def __init__(self, path: Path, slot_bytes: int, readonly: bool = False, direct_io: bool = True,
                 codec: int = CODEC_NONE, zstd_level: int = 1) -> None:
        self.path = path
        self.slot_bytes = slot_bytes
        self.codec = codec
        self.zstd_level = zstd_level
        self._local = threading.local()
        flags = os.O_RDONLY if readonly else os.O_RDWR | os.O_CREAT
        try:
            self.fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0), 0o600)
        except OSError as exc:
            raise ConfigError(f"cannot open {str(path)!r}: {exc}") from None
        self.direct = False
        o_direct = getattr(os, "O_DIRECT", 0)  # Linux; absent on macOS
        if direct_io and o_direct:
            try:  # bypass the page cache: one copy less, and reads measure the disk, not RAM
                dfd = os.open(path, (flags & ~os.O_CREAT) | o_direct | getattr(os, "O_CLOEXEC", 0))
                os.close(self.fd)
                self.fd, self.direct = dfd, True
            except OSError as exc:  # tmpfs and some file systems refuse O_DIRECT
                log.info("disk tier %s: O_DIRECT unavailable (%s); using buffered I/O", path.parent, exc)
        fs_type = file_system_type(self.fd)
        #: on a memory file system (tmpfs, ramfs): reads are memory copies on the reading thread (the module)
        self.memory_fs = fs_type in MEMORY_FS_TYPES
        log.info("disk tier %s: payload file on %s (%s), %s I/O", path.parent, fs_type or "an unknown file system",
                 "a memory file system" if self.memory_fs else "not in memory",
                 "O_DIRECT" if self.direct else "buffered")

    # ------------------------------------------------------------------ size
    def ensure_slots(self, n: int) -> None:
        """Grow the file to hold at least ``n`` slots (sparse; never shrinks)."""
        want = n * self.slot_bytes
        if os.fstat(self.fd).st_size < want:
            os.ftruncate(self.fd, want)

    def slot_count(self) -> int:
        """Slots in the file, from its size (cheap: one ``fstat``, no index txn)."""
        return os.fstat(self.fd).st_size // self.slot_bytes

    # ------------------------------------------------------------------ per-thread state
    def _bounce(self) -> mmap.mmap:
        """A page-aligned buffer of one slot for this thread (O_DIRECT needs aligned memory and sizes)."""
        b = getattr(self._local, "buf", None)
        if b is None:
            b = self._local.buf = mmap.mmap(-1, self.slot_bytes)
        return b

    def _compressor(self) -> zstandard.ZstdCompressor:
        c = getattr(self._local, "zc", None)
        if c is None:
            c = self._local.zc = zstandard.ZstdCompressor(level=self.zstd_level)
        return c

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        d = getattr(self._local, "zd", None)
        if d is None:
            d = self._local.zd = zstandard.ZstdDecompressor()
        return d

    # ------------------------------------------------------------------ raw I/O
    def _pwrite(self, payload, off: int) -> None:
        data = memoryview(payload).cast("B")
        if self.direct and _aligned(payload, len(data)):  # O_DIRECT straight from the caller's memory
            got = os.pwrite(self.fd, data, off)
            if got != len(data):
                raise OSError(f"short write {got} of {len(data)}")
            return
        if self.direct:
            buf = self._bounce()
            buf[:len(data)] = data
            n = -(-len(data) // ALIGN) * ALIGN
            got = os.pwrite(self.fd, memoryview(buf)[:n], off)
            if got != n:
                raise OSError(f"short write {got} of {n}")
            return
        got = os.pwrite(self.fd, data, off)
        if got != len(data):
            raise OSError(f"short write {got} of {len(data)}")

    def _pread(self, n: int, off: int) -> memoryview:
        """``n`` bytes at ``off`` (a view valid until this thread's next read)."""
        if self.direct:
            buf = self._bounce()
            m = -(-n // ALIGN) * ALIGN
            got = os.preadv(self.fd, [memoryview(buf)[:m]], off)
            return memoryview(buf)[:min(got, n)]
        return memoryview(os.pread(self.fd, n, off))

    # ------------------------------------------------------------------ blocks
    def write(self, slot: int, raw: np.ndarray, layout_fp: int) -> RecordHeader:
        """Write one block's bytes ``raw`` (1-D uint8) into ``slot``; return the header that describes them.

        The header (codec, lengths, payload checksum) is what ``read`` verifies against; the caller
        stores it in the index. Raises OSError when the write fails or is short.
        """
        payload, codec = raw, CODEC_NONE
        if self.codec == CODEC_ZSTD:
            packed = self._compressor().compress(raw.data)
            if len(packed) < raw.nbytes:
                payload, codec = packed, CODEC_ZSTD
        self._pwrite(payload, slot * self.slot_bytes)
        plen = len(memoryview(payload).cast("B"))
        return RecordHeader(codec, layout_fp, slot, raw.nbytes, plen, payload_checksum(payload))

    def read(self, hdr: RecordHeader, dst: torch.Tensor) -> None:
        """Read the payload ``hdr`` describes into ``dst`` (a 1-D uint8 CPU tensor of ``hdr.raw_len``), verified.

        Raises RecordError when the bytes do not match the header (short read, checksum mismatch,
        undecodable or wrong-sized zstd frame), OSError when the read itself fails. ``dst`` holds
        undefined bytes after a failure.
        """
        off = hdr.slot * self.slot_bytes
        if hdr.payload_len > self.slot_bytes:
            raise RecordError(f"payload of {hdr.payload_len} bytes does not fit a {self.slot_bytes}-byte slot")
        if hdr.codec == CODEC_NONE and (not self.direct or _aligned(dst.numpy(), hdr.raw_len)):
            view = memoryview(dst.numpy()).cast("B")  # straight into the caller's memory: no bounce copy
            got = os.preadv(self.fd, [view], off)
            if got != hdr.payload_len or payload_checksum(view) != hdr.payload_xxh:
                raise RecordError("payload checksum mismatch" if got == hdr.payload_len else f"short read {got}")
            return
        data = self._pread(hdr.payload_len, off)
        if len(data) != hdr.payload_len or payload_checksum(data) != hdr.payload_xxh:
            raise RecordError("payload checksum mismatch" if len(data) == hdr.payload_len else "short read")
        if hdr.codec == CODEC_NONE:
            dst.numpy()[:] = np.frombuffer(data, dtype=np.uint8)  # verified bytes from the aligned buffer
            return
        try:
            raw = self._decompressor().decompress(data, max_output_size=hdr.raw_len)
        except zstandard.ZstdError as exc:  # checksum matched but the frame does not decode: damage all the same
            raise RecordError(f"zstd: {exc}") from None
        if len(raw) != hdr.raw_len:
            raise RecordError(f"decompressed {len(raw)} bytes, header says {hdr.raw_len}")
        dst.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))

    def read_range(self, hdr: RecordHeader, start: int, end: int, image: torch.Tensor) -> None:
        """Bytes ``[start, end)`` of the raw record ``hdr`` describes into the same bytes of ``image`` (1-D uint8,
        CPU, the record's whole image: ``hdr.raw_len`` bytes), unverified: ``verify`` checks the image once every
        range is in (the in-step disk load reads a record layer group by layer group). With O_DIRECT the range is
        rounded out to 4 KiB within the record (the same file bytes land on the same image bytes: harmless), read
        straight into an aligned image, else through this thread's bounce buffer. Raises RecordError for a
        compressed record, OSError when the read fails or is short."""
        start, end, off = self._range(hdr, start, end)
        n = end - start
        arr = image.numpy()
        if not self.direct or (_aligned(arr[start:], n) and n % ALIGN == 0):
            got = os.preadv(self.fd, [memoryview(arr[start:end]).cast("B")], off)
        else:
            data = self._pread(n, off)
            got = len(data)
            arr[start:start + got] = np.frombuffer(data, dtype=np.uint8)
        if got != n:
            raise OSError(f"short read {got} of {n} at byte {start} of slot {hdr.slot}")

    def range_request(self, hdr: RecordHeader, start: int, end: int,
                      image: torch.Tensor) -> tuple[int, int, int, int] | None:
        """``read_range``'s read as ``(fd, buffer address, nbytes, file offset)`` for ``tiers.disk.aio.AioReader``,
        or None where it cannot go straight into ``image`` with O_DIRECT (buffered file, unaligned memory): the
        caller then uses ``read_range``. Raises RecordError as ``read_range`` does."""
        start, end, off = self._range(hdr, start, end)
        n = end - start
        if end > image.numel() * image.element_size():
            raise RecordError(f"range [{start}, {end}) ends past the {image.numel()}-byte image")
        addr = image.data_ptr() + start
        if not self.direct or addr % ALIGN or n % ALIGN:
            return None
        return self.fd, addr, n, off

    def _range(self, hdr: RecordHeader, start: int, end: int) -> tuple[int, int, int]:
        """A range's ``(start, end)`` in the record (rounded out to 4 KiB with O_DIRECT) and its file offset."""
        if hdr.codec != CODEC_NONE:
            raise RecordError("a compressed record cannot be read by range")
        if not 0 <= start < end <= hdr.payload_len:
            raise RecordError(f"range [{start}, {end}) outside the record's {hdr.payload_len} bytes")
        if self.direct:
            start -= start % ALIGN
            end = min(-(-end // ALIGN) * ALIGN, hdr.payload_len)
        return start, end, hdr.slot * self.slot_bytes + start

    @staticmethod
    def verify(hdr: RecordHeader, image: torch.Tensor) -> bool:
        """Whether ``image`` (filled by ``read_range``) holds the payload ``hdr`` describes (its xxh3)."""
        return hdr.payload_matches(image.numpy())

    # ------------------------------------------------------------------ lifetime
    def datasync(self) -> None:
        """``fdatasync`` the file (after a batch of writes, before their headers commit)."""
        os.fdatasync(self.fd)

    def flush(self) -> None:
        """``fsync`` the file."""
        os.fsync(self.fd)

    def close(self) -> None:
        """Close the file descriptor."""
        os.close(self.fd)
