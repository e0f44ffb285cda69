"""Disk tier: an LMDB index plus a preallocated payload file of fixed-size slots.

Why not payloads inside LMDB: the same-run benchmark (``benchmarks/disk_bench.py``,
numbers in docs/benchmarks.md) showed LMDB with 2 MiB values well under 90% of raw disk
speed, so LMDB keeps only what it is good at: a crash-safe, multi-process index of small
records (``record.RecordHeader`` under each key), the free-slot list and pending claims
(``DiskIndex``, index.py). Payloads go to ``payload.bin`` at ``slot * slot_bytes`` with one
``pwrite``/``preadv`` (``SlotFile``, slots.py). ``DiskTier`` owns the directory (its path
checks, its two entries) and opens the two; the ``Tier`` protocol over them (claim, write,
commit; lease, read, verify; list, delete) is ``IndexedTier``'s (indexed.py), which the host
pool (``tiers/pool/``) shares with a payload in shared memory instead of a file.

Crash safety: a write claims a free slot (LMDB txn 1), writes the payload, then commits
the header (txn 2). A crash between the two leaves a claim whose owner process is dead;
the next open returns such slots to the free list. A slot is reused only after the txn
that deleted its record committed, so a committed header never points at someone
else's bytes; a reader that races a delete in another process gets a checksum mismatch
and reports a miss (it re-reads the header to tell a race from real corruption).

Durability: with ``sync=False`` (default) committed blocks survive a process crash
(the kernel holds the page cache); ``flush()`` makes them survive power loss. With
``sync=True`` every batch is fdatasync'ed and every LMDB commit is synced.

Sharing: several processes (and namespaces) may open one directory (LMDB serializes writers).
The directory keeps one budget and one eviction order for all of them (budget.py): a write that
finds no room evicts by the budget's rules inside its claim transaction and reports the evicted
keys (``write_ex``); a read holds a lease on each record it reads, so no slot is reused under
it. Each record belongs to the namespace that wrote it (``owner``): another namespace never
reads, lists, adopts or deletes it.

Damage: a writable open of an existing index first walks it in a child process (check.py), because
LMDB can kill the process on a damaged B-tree page; a damaged index raises ``DamagedIndexError``
(the store quarantines the directory and runs without it).

Security: the directory is created 0700 and files 0600; paths with ``..`` or symlinks
are refused; headers are parsed with ``struct`` and verified, never unpickled.

Threading contract: ``read``/``write``/``delete`` may run on several mover threads at
once (LMDB txns are per call; ``pwrite``/``preadv`` are positional). ``close()`` once.
"""
from __future__ import annotations

import logging
import os
import stat
import time
from pathlib import Path

from tiered_kv.errors import ConfigError, DamagedIndexError
from tiered_kv.tiers.disk.budget import ANON
from tiered_kv.tiers.disk.check import check_index
from tiered_kv.tiers.disk.index import DiskIndex, env_open_here
from tiered_kv.tiers.disk.indexed import IndexedTier
from tiered_kv.tiers.disk.slots import ALIGN, SlotFile
from tiered_kv.values.layout import BlockLayout
from tiered_kv.values.record import CODECS

log = logging.getLogger(__name__)


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


#: where Linux lists every file lock of the system (``index_users`` reads it; elsewhere there is none)
PROC_LOCKS = "/proc/locks"


def index_users(path: str | os.PathLike, proc_locks: str = PROC_LOCKS) -> list[int] | None:
    """PIDs of the processes that have the LMDB index of the disk-tier directory ``path`` open.

    Every process with an LMDB environment open holds a POSIX read lock on its ``lock.mdb`` for as long
    as it is open (LMDB's own liveness lock); Linux lists those locks, with the file's inode, in
    ``/proc/locks``. Reading that list takes no lock and opens nothing under ``path`` (opening and
    closing ``lock.mdb`` here would drop this process's own POSIX locks on it). Matches the inode only
    (an overlay file system may report another device for the same file). Returns ``[]`` when nobody
    has it open (or there is no ``lock.mdb``), None when the list cannot be read (not Linux).
    """
    try:
        ino = str(os.stat(Path(path) / "index" / "lock.mdb").st_ino)
    except OSError:
        return []
    try:
        with open(proc_locks, encoding="ascii", errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return None
    pids = set()
    for line in lines:
        parts = line.split()
        if "->" in parts:  # a waiter blocked on the lock: a user too
            parts.remove("->")
        # "<n>: POSIX ADVISORY READ <pid> <maj>:<min>:<inode> <start> <end>"
        if len(parts) >= 6 and parts[1] in ("POSIX", "OFDLCK", "FLOCK") and parts[5].rsplit(":", 1)[-1] == ino:
            try:
                pid = int(parts[4])
            except ValueError:
                continue
            if pid > 0:
                pids.add(pid)
    return sorted(pids)


def quarantine(path: str | os.PathLike, reason: str) -> str | None:
    """Move a damaged disk-tier directory aside (``<path>.damaged-<UTC time>-<pid>``) with a note of why.

    Returns the new path, or None when it was not moved (the caller goes on without it, or stops). It is
    left in place while other processes have its index open (``index_users``): they keep serving from it,
    and moving it under them would split the directory in two (they would go on writing into the moved
    copy while new processes start an empty one). The check is not atomic with the move: a process that
    opens the index in between keeps its handle on the moved copy, as before this check existed.
    """
    src = Path(path)
    users = index_users(src)
    if users:
        log.error("disk tier %s: the index looks damaged (%s) but processes %s have it open; left in place. "
                  "Stop them, then run `tiered-kv repair %s`", src, reason, ", ".join(map(str, users)), src)
        return None
    dst = src.with_name(f"{src.name}.damaged-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}")
    try:
        os.rename(src, dst)
    except OSError as exc:
        log.error("disk tier %s: could not move the damaged directory aside: %s", src, exc)
        return None
    try:
        (dst / "DAMAGED.txt").write_text(f"moved aside by pid {os.getpid()} at {time.ctime()}: {reason}\n"
                                         f"salvage with: tiered-kv repair {dst}\n")
    except OSError:
        pass
    return str(dst)


def file_mode(path: str | os.PathLike) -> int:
    """Permission bits of ``path`` (for tests and ``inspect``)."""
    return stat.S_IMODE(os.stat(path).st_mode)


class DiskTier(IndexedTier):
    """Persistent tier on local disk: LMDB index (``self.index``) + slot file (``self.slots``).

    ``owner`` is the 8-byte namespace prefix whose records this tier reads, lists and writes;
    ``budget`` ("namespace": ``capacity_bytes`` is this namespace's quota in the directory; "shared":
    it is the directory's one budget) and ``weight`` (fair share under a shared budget) place it in
    the directory's budget; ``evicts``: a write that finds no room evicts by the budget's rules (the
    planner then treats this tier as governed) instead of being refused. ``check``: walk an existing
    index in a child process before opening it (raises ``DamagedIndexError`` when damaged).
    Reading, writing and listing are ``IndexedTier``'s (indexed.py).
    """

    name = "disk"

    def __init__(self, layout: BlockLayout, path: str | os.PathLike, capacity_bytes: int,
                 compression: str = "none", zstd_level: int = 1, sync: bool = False, readonly: bool = False,
                 key_prefix: bytes = b"", direct_io: bool = True, writer: bool = True, read_threads: int = 4,
                 owner: bytes = ANON, budget: str = "namespace", weight: int = 1, evicts: bool = False,
                 check: bool = True) -> None:
        if compression not in CODECS:
            raise ConfigError(f"compression: unknown codec {compression!r}; valid: {sorted(CODECS)}")
        self.slot_bytes = -(-layout.nbytes // ALIGN) * ALIGN
        capacity = capacity_bytes // self.slot_bytes
        if capacity_bytes and capacity == 0 and not readonly:
            raise ConfigError(f"disk_bytes={capacity_bytes} is smaller than one block slot ({self.slot_bytes} bytes)")
        self.path = check_store_path(path)
        super().__init__(layout, capacity, "disk tier", str(self.path), owner, evicts, writer=writer,
                         readonly=readonly, sync=sync, read_threads=read_threads)
        self.key_prefix = key_prefix
        if not readonly:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.path, 0o700)
        elif not (self.path / "index").exists():
            raise ConfigError(f"{str(self.path)!r} holds no tiered_kv disk tier (no index/ inside)")
        idx, payload = self.path / "index", self.path / "payload.bin"
        for inner in (idx, idx / "data.mdb", idx / "lock.mdb", payload):
            if inner.is_symlink():  # never let a planted link send our writes outside the store
                raise ConfigError(f"{str(inner)!r} is a symlink; a store directory must hold plain files only")
        orphans: list[bytes] = []
        if check and not readonly and (idx / "data.mdb").exists() and not env_open_here(idx):
            report = check_index(idx)  # out of process: LMDB may abort on a damaged page
            orphans = [bytes.fromhex(k) for k in report.get("orphans", [])]
            if not report["ok"]:
                raise DamagedIndexError(f"{str(self.path)!r}: the LMDB index is damaged ({report['error']}); "
                                        f"move it aside (the store does) and run `tiered-kv repair` on it",
                                        str(self.path), report["error"])
        self.index = DiskIndex(idx, self.slot_bytes, self.capacity, readonly=readonly, sync=sync, owner=owner,
                               budget=budget, weight=weight)
        self.slot_bytes = self.index.slot_bytes  # a read-only open takes the directory's slot size
        try:
            self.slots = SlotFile(payload, self.slot_bytes, readonly=readonly, direct_io=direct_io,
                                  codec=CODECS[compression], zstd_level=zstd_level)
        except ConfigError:
            self.index.close()
            raise
        if not readonly:
            self.slots.ensure_slots(self.index.physical_slots)
            self.index.recover_claims()
            if orphans:  # ownership entries damaged: drop those records rather than guess whose they are
                log.warning("disk tier %s: dropping %d records whose ownership entries are damaged", self.path,
                            len(orphans))
                for key in orphans:
                    self.index.drop_damaged(key, self.slots.slot_count())
                self.orphans_dropped = len(orphans)

    @property
    def physical_slots(self) -> int:
        """Slots in the payload file (the largest capacity this directory was ever opened with)."""
        return self.index.physical_slots

    def physical_slots_cached(self) -> int:
        """Slots in the payload file, from the file size (cheap; no txn)."""
        return self.slots.slot_count()

    def scan(self) -> dict:
        """Summary of the directory for ``tiered-kv inspect``: records, bytes, layouts, bad headers."""
        return {"path": str(self.path), **self.index.scan()}

    def flush(self) -> None:
        """fsync the payload file and the LMDB index."""
        if self._closed or self.readonly:
            return
        self.slots.flush()
        self.index.sync()

    def describe(self) -> dict:
        """Adds the path and slot size."""
        d = super().describe()
        d.update(path=str(self.path), slot_bytes=self.slot_bytes,
                 compression=[k for k, v in CODECS.items() if v == self.slots.codec][0])
        return d
