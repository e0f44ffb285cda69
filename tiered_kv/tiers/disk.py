"""Disk tier: an LMDB index plus a preallocated payload file of fixed-size slots.

Why not payloads inside LMDB: the same-run benchmark (``benchmarks/disk_bench.py``,
numbers in docs/benchmarks.md) showed LMDB with 2 MiB values well under 90% of raw disk
speed, so LMDB keeps only what it is good at: a crash-safe, multi-process index of small
records (``record.RecordHeader`` under each key), the free-slot list and pending claims.
Payloads go to ``payload.bin`` at ``slot * slot_bytes`` with one ``pwrite``/``preadv``.

Crash safety: a write claims a free slot (LMDB txn 1), writes the payload, then commits
the header (txn 2). A crash between the two leaves a claim whose owner process is dead;
the next open returns such slots to the free list. A slot is reused only after the txn
that deleted its record committed, so a committed header never points at someone
else's bytes; a reader that races a delete in another process gets a checksum mismatch
and reports a miss (it re-reads the header to tell a race from real corruption).

Durability: with ``sync=False`` (default) committed blocks survive a process crash
(the kernel holds the page cache); ``flush()`` makes them survive power loss. With
``sync=True`` every batch is fdatasync'ed and every LMDB commit is synced.

Sharing: several processes may open one directory (LMDB serializes writers); each one's
planner knows only the records it adopted at open or wrote itself.

Security: the directory is created 0700 and files 0600; paths with ``..`` or symlinks
are refused; headers are parsed with ``struct`` and verified, never unpickled.

Threading contract: ``read``/``write``/``delete`` may run on several mover threads at
once (LMDB txns are per call; ``pwrite``/``preadv`` are positional). ``close()`` once.
"""
from __future__ import annotations

import json
import logging
import mmap
import os
import stat
import struct
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lmdb
import numpy as np
import torch
import zstandard

from tiered_kv.errors import ConfigError, RecordError, StoreClosedError
from tiered_kv.values.layout import BlockLayout
from tiered_kv.values.record import CODEC_NONE, CODEC_ZSTD, CODECS, RecordHeader, payload_checksum
from tiered_kv.tiers.base import Tier

log = logging.getLogger(__name__)

FORMAT = 1
ALIGN = 4096
_SLOT = struct.Struct(">Q")
_CLAIM = struct.Struct("<I")


def check_store_path(path: str | os.PathLike) -> Path:
    """Validate a disk-tier directory path: no ``..`` parts, not a symlink, not a file, writable parent.

    Raises ConfigError naming the path and what to do.
    """
    p = Path(path)
    if any(part == ".." for part in p.parts):
        raise ConfigError(f"disk_path {str(path)!r} contains '..'; give a normalized path")
    if p.is_symlink():
        raise ConfigError(f"disk_path {str(path)!r} is a symlink (to {os.readlink(p)!r}); give the real directory")
    if p.exists() and not p.is_dir():
        raise ConfigError(f"disk_path {str(path)!r} exists and is not a directory; choose another path")
    parent = p if p.exists() else p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"disk_path {str(path)!r} is not writable (checked {str(parent)!r}); fix permissions "
                          f"or choose another path")
    return p


def _aligned(arr, nbytes: int) -> bool:
    """True for a numpy array at a 4 KiB-aligned address with a 4 KiB-multiple length (O_DIRECT's rule)."""
    iface = getattr(arr, "__array_interface__", None)
    return iface is not None and iface["data"][0] % ALIGN == 0 and nbytes % ALIGN == 0


# py-lmdb allows one open of an environment per process; tiers of one directory in one process
# (vLLM's scheduler and worker under a single-process executor, two stores in a test) share it.
_ENVS: dict[str, list] = {}  # real path -> [env, users, read_only]
_ENVS_LOCK = threading.Lock()


def _open_env(idx: Path, read_only: bool, **kw) -> lmdb.Environment:
    key = os.path.realpath(idx)
    with _ENVS_LOCK:
        ent = _ENVS.get(key)
        if ent is not None:
            if ent[2] and not read_only:
                raise ConfigError(f"{str(idx)!r} is open read-only elsewhere in this process; close that "
                                  f"store (or tier) before opening it for writing")
            ent[1] += 1
            return ent[0]
        env = lmdb.open(str(idx), **kw)
        _ENVS[key] = [env, 1, read_only]
        return env


def _close_env(env: lmdb.Environment) -> None:
    with _ENVS_LOCK:
        for key, ent in list(_ENVS.items()):
            if ent[0] is env:
                ent[1] -= 1
                if ent[1] == 0:
                    del _ENVS[key]
                    env.close()
                return
    env.close()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DiskTier(Tier):
    """Persistent tier on local disk: LMDB index + slot file."""

    name = "disk"
    slotted = False

    def __init__(self, layout: BlockLayout, path: str | os.PathLike, capacity_bytes: int,
                 compression: str = "none", zstd_level: int = 1, sync: bool = False, readonly: bool = False,
                 key_prefix: bytes = b"", direct_io: bool = True, writer: bool = True, read_threads: int = 4) -> None:
        if compression not in CODECS:
            raise ConfigError(f"compression: unknown codec {compression!r}; valid: {sorted(CODECS)}")
        self.slot_bytes = -(-layout.nbytes // ALIGN) * ALIGN
        super().__init__(layout, capacity_bytes // self.slot_bytes)
        if capacity_bytes and self.capacity == 0 and not readonly:
            raise ConfigError(f"disk_bytes={capacity_bytes} is smaller than one block slot ({self.slot_bytes} bytes)")
        self.path = check_store_path(path)
        self.codec = CODECS[compression]
        self.zstd_level = zstd_level
        self.sync = sync
        self.readonly = readonly
        self.writer = writer and not readonly  # a reader never writes or deletes records (damaged ones aside)
        self.key_prefix = key_prefix
        self._local = threading.local()
        self._closed = False
        self.dropped_at_open = 0
        self.read_threads = read_threads
        self._executor: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        if not readonly:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.path, 0o700)
        elif not (self.path / "index").exists():
            raise ConfigError(f"{str(self.path)!r} holds no tiered_kv disk tier (no index/ inside)")
        idx = self.path / "index"
        for inner in (idx, idx / "data.mdb", idx / "lock.mdb", self.path / "payload.bin"):
            if inner.is_symlink():  # never let a planted link send our writes outside the store
                raise ConfigError(f"{str(inner)!r} is a symlink; a store directory must hold plain files only")
        if not readonly:
            idx.mkdir(mode=0o700, exist_ok=True)
        map_size = max(64 << 20, self.capacity * 512 + (32 << 20))
        try:
            self.env = _open_env(idx, readonly, map_size=map_size, max_dbs=4, subdir=True, readonly=readonly,
                                 sync=sync, metasync=sync, lock=True, mode=0o600, max_readers=256,
                                 readahead=False, meminit=False)
        except lmdb.Error as exc:
            raise ConfigError(f"{str(idx)!r}: cannot open the LMDB index ({type(exc).__name__}: {exc}); "
                              f"move the directory aside to start empty") from None
        try:
            self._check_index_size(idx)
            self.db_records = self.env.open_db(b"records", create=not readonly)
            self.db_free = self.env.open_db(b"free", create=not readonly)
            self.db_claims = self.env.open_db(b"claims", create=not readonly)
            self.db_meta = self.env.open_db(b"meta", create=not readonly)
            self._check_format()
        except lmdb.Error as exc:
            _close_env(self.env)
            raise ConfigError(f"{str(idx)!r}: the LMDB index is damaged ({type(exc).__name__}: {exc}); "
                              f"move the directory aside to start empty") from None
        except ConfigError:
            _close_env(self.env)
            raise
        payload = self.path / "payload.bin"
        flags = os.O_RDONLY if readonly else os.O_RDWR | os.O_CREAT
        try:
            self.fd = os.open(payload, flags | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0), 0o600)
        except OSError as exc:
            _close_env(self.env)
            raise ConfigError(f"cannot open {str(payload)!r}: {exc}") from None
        self.direct = False
        if direct_io and hasattr(os, "O_DIRECT"):
            try:  # bypass the page cache: one copy less, and reads measure the disk, not RAM
                dfd = os.open(payload, (flags & ~os.O_CREAT) | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
                os.close(self.fd)
                self.fd, self.direct = dfd, True
            except OSError as exc:  # tmpfs and some file systems refuse O_DIRECT
                log.info("disk tier %s: O_DIRECT unavailable (%s); using buffered I/O", self.path, exc)
        if not readonly:
            want = self.physical_slots * self.slot_bytes
            if os.fstat(self.fd).st_size < want:
                os.ftruncate(self.fd, want)
            self._recover_claims()

    # ------------------------------------------------------------------ format
    def _check_index_size(self, idx: Path) -> None:
        """Refuse an index file shorter than its own meta page says (reading past EOF would SIGBUS)."""
        data = idx / "data.mdb"
        need = (self.env.info()["last_pgno"] + 1) * self.env.stat()["psize"]
        have = data.stat().st_size
        if have < need:
            raise ConfigError(f"{str(data)!r} is truncated ({have} bytes, its meta page needs {need}); "
                              f"move the directory aside to start empty")

    def _check_format(self) -> None:
        with self.env.begin(db=self.db_meta, write=not self.readonly) as txn:
            raw = txn.get(b"format")
            if raw is None:
                if self.readonly:
                    raise ConfigError(f"{str(self.path)!r}: disk tier has no format record")
                txn.put(b"format", json.dumps({"format": FORMAT, "slot_bytes": self.slot_bytes}).encode())
                txn.put(b"slots", _SLOT.pack(self.capacity))
                txn.put(b"hwm", _SLOT.pack(0))
                return
            try:
                fmt = json.loads(bytes(raw))
                ok = isinstance(fmt, dict) and fmt.get("format") == FORMAT
            except ValueError:
                ok = False
            if not ok:
                raise ConfigError(f"{str(self.path)!r}: unknown disk-tier format {bytes(raw)[:80]!r}; "
                                  f"use an empty directory")
            if self.readonly:
                self.slot_bytes = int(fmt["slot_bytes"])
            elif fmt.get("slot_bytes") != self.slot_bytes:
                raise ConfigError(f"{str(self.path)!r} holds blocks of {fmt.get('slot_bytes')} bytes per slot but "
                                  f"this store's blocks need {self.slot_bytes}; use another disk_path per block size")
            old = _SLOT.unpack(txn.get(b"slots"))[0]
            if self.capacity > old and not self.readonly:
                txn.put(b"slots", _SLOT.pack(self.capacity))

    @property
    def physical_slots(self) -> int:
        """Slots in the payload file (the largest capacity this directory was ever opened with)."""
        with self.env.begin(db=self.db_meta) as txn:
            return _SLOT.unpack(txn.get(b"slots"))[0]

    def _recover_claims(self) -> None:
        """Return slots claimed by dead processes (crash between claim and commit) to the free list."""
        freed = 0
        with self.env.begin(write=True) as txn:
            cur = txn.cursor(db=self.db_claims)
            dead = [(bytes(k), bytes(v)) for k, v in cur if not _pid_alive(_CLAIM.unpack(bytes(v)[:4])[0])]
            for slot_key, _ in dead:
                txn.delete(slot_key, db=self.db_claims)
                txn.put(slot_key, b"", db=self.db_free)
                freed += 1
        if freed:
            log.warning("disk tier %s: returned %d slots claimed by crashed writers to the free list", self.path, freed)

    # ------------------------------------------------------------------ helpers
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"disk tier {str(self.path)!r} is closed")

    def _claim(self, txn, n: int) -> list[int]:
        """Take up to ``n`` free slots inside write txn ``txn``."""
        out: list[int] = []
        cur = txn.cursor(db=self.db_free)
        while len(out) < n and cur.first():
            out.append(_SLOT.unpack(bytes(cur.key()))[0])
            cur.delete()
        if len(out) < n:
            hwm = _SLOT.unpack(txn.get(b"hwm", db=self.db_meta))[0]
            limit = _SLOT.unpack(txn.get(b"slots", db=self.db_meta))[0]
            take = min(n - len(out), max(0, limit - hwm))
            out.extend(range(hwm, hwm + take))
            txn.put(b"hwm", _SLOT.pack(hwm + take), db=self.db_meta)
        pid = _CLAIM.pack(os.getpid())
        for s in out:
            txn.put(_SLOT.pack(s), pid, db=self.db_claims)
        return out

    def _bounce(self) -> mmap.mmap:
        """A page-aligned buffer of one slot for this thread (O_DIRECT needs aligned memory and sizes)."""
        b = getattr(self._local, "buf", None)
        if b is None:
            b = self._local.buf = mmap.mmap(-1, self.slot_bytes)
        return b

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

    # ------------------------------------------------------------------ Tier API
    def write(self, keys: Sequence[bytes], slots: Sequence[int], rows) -> list[bool]:
        """Write ``rows[i]`` under ``keys[i]``; a key already stored is kept as is (blocks are immutable).

        ``rows`` is a ``(n, block_nbytes)`` uint8 tensor or a list of ``n`` 1-D uint8 rows (views are
        fine: a page-aligned CPU row is written to disk with no copy).
        """
        self._check_open()
        if not self.writer:
            return [False] * len(keys)
        with self.env.begin(write=True) as txn:
            fresh = [i for i, k in enumerate(keys) if txn.get(k, db=self.db_records) is None]
            claimed = self._claim(txn, len(fresh))
        ok = [True] * len(keys)
        for i in fresh[len(claimed):]:
            ok[i] = False  # the file is full (other processes may hold slots this planner does not know)
        written: list[tuple[int, int, bytes]] = []  # (item, slot, header)
        failed_slots: list[int] = []
        for i, slot in zip(fresh, claimed):
            row = rows[i]
            raw = (row if row.device.type == "cpu" else row.cpu()).numpy()
            payload, codec = raw, CODEC_NONE
            if self.codec == CODEC_ZSTD:
                packed = self._compressor().compress(raw.data)
                if len(packed) < raw.nbytes:
                    payload, codec = packed, CODEC_ZSTD
            try:
                self._pwrite(payload, slot * self.slot_bytes)
            except OSError as exc:
                log.warning("disk tier %s: write of slot %d failed: %s", self.path, slot, exc)
                ok[i] = False
                failed_slots.append(slot)
                continue
            plen = len(memoryview(payload).cast("B"))
            hdr = RecordHeader(codec, self.layout.fingerprint, slot, raw.nbytes, plen, payload_checksum(payload))
            written.append((i, slot, hdr.pack(keys[i])))
        if self.sync and written:
            os.fdatasync(self.fd)
        try:
            with self.env.begin(write=True) as txn:
                for i, slot, hdr in written:
                    if not txn.put(keys[i], hdr, db=self.db_records, overwrite=False):
                        failed_slots.append(slot)  # another process stored it first: keep theirs
                    txn.delete(_SLOT.pack(slot), db=self.db_claims)
                for slot in failed_slots:
                    txn.delete(_SLOT.pack(slot), db=self.db_claims)
                    txn.put(_SLOT.pack(slot), b"", db=self.db_free)
        except lmdb.Error as exc:  # e.g. the file system is full and the index cannot grow
            log.warning("disk tier %s: index commit of %d blocks failed: %s", self.path, len(written), exc)
            for i, _, _ in written:
                ok[i] = False
            self._unclaim([slot for _, slot, _ in written] + failed_slots)
        return ok

    def _unclaim(self, slots: list[int]) -> None:
        """Give claimed slots back to the free list (best effort: a dead claim is recovered at the next open)."""
        try:
            with self.env.begin(write=True) as txn:
                for slot in slots:
                    txn.delete(_SLOT.pack(slot), db=self.db_claims)
                    txn.put(_SLOT.pack(slot), b"", db=self.db_free)
        except lmdb.Error as exc:
            log.warning("disk tier %s: could not return %d claimed slots: %s", self.path, len(slots), exc)

    def read(self, keys: Sequence[bytes], slots: Sequence[int], out) -> tuple[list[bool], list[bool]]:
        """Read and verify each block into ``out[i]``; damaged records are deleted and reported corrupt."""
        ok, corrupt, _ = self.read_ex(keys, slots, out)
        return ok, corrupt

    def read_ex(self, keys: Sequence[bytes], slots: Sequence[int], out) -> tuple[list[bool], list[bool], list[bool]]:
        """``read`` plus ``missing[i]``: no record of ``keys[i]`` at all (deleted by another process, say).

        ``out`` is a ``(n, block_nbytes)`` uint8 tensor or a list of 1-D rows, on any device. Only
        verified bytes are reported ok; a row whose read failed holds undefined bytes.
        """
        self._check_open()
        n = len(keys)
        ok, corrupt, missing = [False] * n, [False] * n, [False] * n
        with self.env.begin(db=self.db_records, buffers=False) as txn:
            raws = [txn.get(k) for k in keys]

        def one(i: int) -> None:
            key, raw = keys[i], raws[i]
            if raw is None:
                missing[i] = True
                return
            dst = out[i]
            staging = dst if dst.device.type == "cpu" else torch.empty(dst.shape, dtype=torch.uint8)
            try:
                hdr = RecordHeader.unpack(key, raw)
                if hdr.layout_fp != self.layout.fingerprint:
                    return  # written for another layout: not ours to serve, not damage either
                if hdr.raw_len != self.block_nbytes or hdr.slot >= self.physical_slots_cached():
                    raise RecordError(f"record of {hdr.raw_len} bytes at slot {hdr.slot} does not fit this tier")
                self._read_payload(hdr, staging)
                if staging is not dst:
                    dst.copy_(staging)
                ok[i] = True
            except (RecordError, OSError, zstandard.ZstdError) as exc:
                if self._still_same(key, raw):
                    log.warning("disk tier %s: dropping damaged record %s: %s", self.path, key.hex()[:16], exc)
                    self._delete_damaged(key)
                    corrupt[i] = True

        if n > 1 and self.read_threads > 1:  # several reads in flight: the disk works on a queue, not one at a time
            list(self._pool().map(one, range(n)))
        else:
            for i in range(n):
                one(i)
        return ok, corrupt, missing

    def _pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.read_threads, thread_name_prefix="tkv-disk-read")
            return self._executor

    def physical_slots_cached(self) -> int:
        """Slots in the payload file, from the file size (cheap; no txn)."""
        return os.fstat(self.fd).st_size // self.slot_bytes

    def _read_payload(self, hdr: RecordHeader, dst: torch.Tensor) -> None:
        off = hdr.slot * self.slot_bytes
        if hdr.payload_len > self.slot_bytes:
            raise RecordError(f"payload of {hdr.payload_len} bytes does not fit a {self.slot_bytes}-byte slot")
        if hdr.codec == CODEC_NONE and (not self.direct or _aligned(dst.numpy(), self.block_nbytes)):
            view = memoryview(dst.numpy()).cast("B")
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
        raw = self._decompressor().decompress(data, max_output_size=hdr.raw_len)
        if len(raw) != hdr.raw_len:
            raise RecordError(f"decompressed {len(raw)} bytes, header says {hdr.raw_len}")
        dst.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))

    def _still_same(self, key: bytes, raw: bytes) -> bool:
        try:
            with self.env.begin(db=self.db_records, buffers=False) as txn:
                return txn.get(key) == raw
        except lmdb.Error:
            return True

    def _delete_damaged(self, key: bytes) -> None:
        try:
            with self.env.begin(write=True) as txn:
                raw = txn.get(key, db=self.db_records)
                txn.delete(key, db=self.db_records)
                slot = None
                if raw is not None and len(raw) >= 24:
                    try:
                        slot = RecordHeader.unpack(key, raw).slot
                    except RecordError:
                        slot = None  # header itself damaged: its slot leaks until a rebuild (counted as lost)
                if slot is not None and slot < self.physical_slots_cached():
                    txn.put(_SLOT.pack(slot), b"", db=self.db_free)
        except lmdb.Error as exc:
            log.warning("disk tier %s: could not delete damaged record: %s", self.path, exc)

    def delete(self, keys: Sequence[bytes]) -> None:
        """Delete records and return their slots to the free list (one txn).

        Idempotent: a key with no record is skipped, so a caller may send a DELETE for a key a
        read already dropped as corrupt (e.g. on the other TP ranks of a connector).
        """
        self._check_open()
        if not self.writer:
            return
        with self.env.begin(write=True) as txn:
            for key in keys:
                raw = txn.pop(key, db=self.db_records)
                if raw is None:
                    continue
                try:
                    slot = RecordHeader.unpack(key, raw).slot
                except RecordError:
                    continue
                txn.put(_SLOT.pack(slot), b"", db=self.db_free)

    def has(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether the directory holds a record of each key now (one read txn; no payload I/O)."""
        self._check_open()
        with self.env.begin(db=self.db_records, buffers=True) as txn:
            return [txn.get(k) is not None for k in keys]

    def stored_keys(self) -> list[bytes]:
        """Keys of this layout (and key prefix, if set) stored in the directory, oldest first."""
        out: list[tuple[int, bytes]] = []
        bad: list[bytes] = []
        with self.env.begin(db=self.db_records, buffers=False) as txn:
            for key, raw in txn.cursor():
                if self.key_prefix and not key.startswith(self.key_prefix):
                    continue
                try:
                    hdr = RecordHeader.unpack(key, raw)
                except RecordError:
                    bad.append(key)
                    continue
                if hdr.layout_fp == self.layout.fingerprint:
                    out.append((hdr.created_ns, key))
        if bad and not self.readonly:
            log.warning("disk tier %s: dropping %d records with damaged headers", self.path, len(bad))
            for key in bad:
                self._delete_damaged(key)
        self.dropped_at_open = len(bad)
        out.sort()
        return [k for _, k in out]

    def scan(self) -> dict:
        """Summary of the directory for ``tiered-kv inspect``: records, bytes, layouts, bad headers."""
        layouts: dict[str, int] = {}
        records = stored = raw_total = bad = 0
        with self.env.begin(db=self.db_records, buffers=False) as txn:
            for key, raw in txn.cursor():
                records += 1
                try:
                    hdr = RecordHeader.unpack(key, raw)
                except RecordError:
                    bad += 1
                    continue
                layouts[f"{hdr.layout_fp:016x}"] = layouts.get(f"{hdr.layout_fp:016x}", 0) + 1
                stored += hdr.payload_len
                raw_total += hdr.raw_len
            free = txn.stat(self.db_free)["entries"]
            claims = txn.stat(self.db_claims)["entries"]
        return {"path": str(self.path), "records": records, "payload_bytes": stored, "raw_bytes": raw_total,
                "bad_headers": bad, "layouts": layouts, "slot_bytes": self.slot_bytes,
                "physical_slots": self.physical_slots, "free_listed": free, "pending_claims": claims,
                "index_bytes": os.path.getsize(self.path / "index" / "data.mdb")}

    def flush(self) -> None:
        """fsync the payload file and the LMDB index."""
        if self._closed or self.readonly:
            return
        os.fsync(self.fd)
        self.env.sync(True)

    def describe(self) -> dict:
        """Adds the path and slot size."""
        d = super().describe()
        d.update(path=str(self.path), slot_bytes=self.slot_bytes,
                 compression=[k for k, v in CODECS.items() if v == self.codec][0])
        return d

    def close(self) -> None:
        """Flush (when syncing), close the index and the payload file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        try:
            if self.sync and not self.readonly:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
            _close_env(self.env)


def file_mode(path: str | os.PathLike) -> int:
    """Permission bits of ``path`` (for tests and ``inspect``)."""
    return stat.S_IMODE(os.stat(path).st_mode)
