"""The disk tier's index: one LMDB environment of four sub-databases in ``<disk_path>/index/``.

- ``records``: block key -> 64-byte ``RecordHeader`` (where the payload is, how long, its checksum);
- ``free``: slot numbers (``>Q``) given back by deletes, reused before the high-water mark grows;
- ``claims``: slot -> writer pid (``<I``) for slots being written, so a crash between claim and
  commit leaves a claim of a dead pid that the next open returns to the free list;
- ``meta``: ``format`` (JSON: format number, slot size), ``slots`` (slots in the payload file, the
  largest capacity this directory was ever opened with) and ``hwm`` (slots ever handed out).

``DiskIndex`` owns everything about that environment: opening it (one open per process and
directory, shared by every tier on it), checking its size and format, claiming and freeing
slots, committing and deleting records, and listing them. It knows nothing of payload bytes:
``SlotFile`` (slots.py) reads and writes them, ``DiskTier`` (tier.py) composes the two.

The free list and every slot hand-out change only inside LMDB write transactions, which LMDB
serializes across threads and processes: that is what makes one directory safe to share.

Threading contract: every method runs its own LMDB transaction, so any thread may call any
method at the same time as others (LMDB serializes the writers). ``close()`` once, after every
caller stopped.
"""
from __future__ import annotations

import json
import logging
import os
import struct
import threading
from collections.abc import Sequence
from pathlib import Path

import lmdb

from tiered_kv.errors import ConfigError, RecordError
from tiered_kv.values.record import RecordHeader

log = logging.getLogger(__name__)

FORMAT = 1
_SLOT = struct.Struct(">Q")  # big-endian, so the free list's cursor order is slot order
_CLAIM = struct.Struct("<I")

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


class DiskIndex:
    """The LMDB index of one disk-tier directory: records, free slots, claims and meta.

    ``path`` is the index directory (``<disk_path>/index``); it is created unless ``readonly``.
    ``slot_bytes`` must match the directory's format record (a read-only open adopts the
    directory's instead); ``slots`` is the payload file's size in slots wanted by this opener
    (the stored value only grows). Raises ConfigError when the index cannot be opened, is
    damaged or truncated, or holds another format.

    Public attributes for tools that read the index directly (``inspect``, tests):
    ``env`` and ``db_records``, ``db_free``, ``db_claims``, ``db_meta``.
    """

    def __init__(self, path: Path, slot_bytes: int, slots: int, readonly: bool = False, sync: bool = False) -> None:
        self.path = path
        self.root = path.parent  # the disk-tier directory, named in messages
        self.slot_bytes = slot_bytes
        self.readonly = readonly
        if not readonly:
            path.mkdir(mode=0o700, exist_ok=True)
        map_size = max(64 << 20, slots * 512 + (32 << 20))  # ~512 B of B-tree per record, plus room to grow
        try:
            self.env = _open_env(path, readonly, map_size=map_size, max_dbs=4, subdir=True, readonly=readonly,
                                 sync=sync, metasync=sync, lock=True, mode=0o600, max_readers=256,
                                 readahead=False, meminit=False)
        except lmdb.Error as exc:
            raise ConfigError(f"{str(path)!r}: cannot open the LMDB index ({type(exc).__name__}: {exc}); "
                              f"move the directory aside to start empty") from None
        try:
            self._check_size()
            self.db_records = self.env.open_db(b"records", create=not readonly)
            self.db_free = self.env.open_db(b"free", create=not readonly)
            self.db_claims = self.env.open_db(b"claims", create=not readonly)
            self.db_meta = self.env.open_db(b"meta", create=not readonly)
            self._check_format(slots)
        except lmdb.Error as exc:
            _close_env(self.env)
            raise ConfigError(f"{str(path)!r}: the LMDB index is damaged ({type(exc).__name__}: {exc}); "
                              f"move the directory aside to start empty") from None
        except ConfigError:
            _close_env(self.env)
            raise

    # ------------------------------------------------------------------ open
    def _check_size(self) -> None:
        """Refuse an index file shorter than its own meta page says (reading past EOF would SIGBUS)."""
        data = self.path / "data.mdb"
        need = (self.env.info()["last_pgno"] + 1) * self.env.stat()["psize"]
        have = data.stat().st_size
        if have < need:
            raise ConfigError(f"{str(data)!r} is truncated ({have} bytes, its meta page needs {need}); "
                              f"move the directory aside to start empty")

    def _check_format(self, slots: int) -> None:
        """Write the format record of a new index, or check an existing one (and grow ``slots``)."""
        with self.env.begin(db=self.db_meta, write=not self.readonly) as txn:
            raw = txn.get(b"format")
            if raw is None:
                if self.readonly:
                    raise ConfigError(f"{str(self.root)!r}: disk tier has no format record")
                txn.put(b"format", json.dumps({"format": FORMAT, "slot_bytes": self.slot_bytes}).encode())
                txn.put(b"slots", _SLOT.pack(slots))
                txn.put(b"hwm", _SLOT.pack(0))
                return
            try:
                fmt = json.loads(bytes(raw))
                ok = isinstance(fmt, dict) and fmt.get("format") == FORMAT
            except ValueError:
                ok = False
            if not ok:
                raise ConfigError(f"{str(self.root)!r}: unknown disk-tier format {bytes(raw)[:80]!r}; "
                                  f"use an empty directory")
            if self.readonly:
                self.slot_bytes = int(fmt["slot_bytes"])
            elif fmt.get("slot_bytes") != self.slot_bytes:
                raise ConfigError(f"{str(self.root)!r} holds blocks of {fmt.get('slot_bytes')} bytes per slot but "
                                  f"this store's blocks need {self.slot_bytes}; use another disk_path per block size")
            old = _SLOT.unpack(txn.get(b"slots"))[0]
            if slots > old and not self.readonly:
                txn.put(b"slots", _SLOT.pack(slots))

    @property
    def physical_slots(self) -> int:
        """Slots the payload file must hold (the largest capacity this directory was ever opened with)."""
        with self.env.begin(db=self.db_meta) as txn:
            return _SLOT.unpack(txn.get(b"slots"))[0]

    def recover_claims(self) -> int:
        """Return slots claimed by dead processes (crash between claim and commit) to the free list.

        Returns how many slots came back.
        """
        freed = 0
        with self.env.begin(write=True) as txn:
            cur = txn.cursor(db=self.db_claims)
            dead = [(bytes(k), bytes(v)) for k, v in cur if not _pid_alive(_CLAIM.unpack(bytes(v)[:4])[0])]
            for slot_key, _ in dead:
                txn.delete(slot_key, db=self.db_claims)
                txn.put(slot_key, b"", db=self.db_free)
                freed += 1
        if freed:
            log.warning("disk tier %s: returned %d slots claimed by crashed writers to the free list", self.root, freed)
        return freed

    # ------------------------------------------------------------------ writing
    def claim(self, keys: Sequence[bytes]) -> tuple[list[int], list[int]]:
        """In one write txn: which ``keys`` have no record yet, and a claimed slot for as many of them as fit.

        Returns ``(fresh, slots)``: ``fresh`` are indices into ``keys``; ``slots[j]`` is claimed for
        ``keys[fresh[j]]`` under this process's pid. ``len(slots) < len(fresh)`` when the payload file
        is full. Every claimed slot must end in ``commit`` or ``release``.
        """
        with self.env.begin(write=True) as txn:
            fresh = [i for i, k in enumerate(keys) if txn.get(k, db=self.db_records) is None]
            return fresh, self._claim(txn, len(fresh))

    def _claim(self, txn: lmdb.Transaction, n: int) -> list[int]:
        """Take up to ``n`` slots inside write txn ``txn``: free-listed ones first, then above the high-water mark."""
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

    def commit(self, records: Sequence[tuple[bytes, int, bytes]], failed_slots: Sequence[int]) -> bool:
        """In one write txn: store each ``(key, slot, packed_header)`` and end its claim; free ``failed_slots``.

        A key another process stored first keeps its record; this writer's slot goes back to the free
        list. Returns False when the txn failed (e.g. the file system is full and the index cannot
        grow): then no record was stored and every slot was given back.
        """
        try:
            with self.env.begin(write=True) as txn:
                lost: list[int] = []
                for key, slot, hdr in records:
                    if not txn.put(key, hdr, db=self.db_records, overwrite=False):
                        lost.append(slot)  # another process stored it first: keep theirs
                    txn.delete(_SLOT.pack(slot), db=self.db_claims)
                for slot in (*failed_slots, *lost):
                    txn.delete(_SLOT.pack(slot), db=self.db_claims)
                    txn.put(_SLOT.pack(slot), b"", db=self.db_free)
            return True
        except lmdb.Error as exc:
            log.warning("disk tier %s: index commit of %d blocks failed: %s", self.root, len(records), exc)
            self.release([slot for _, slot, _ in records] + list(failed_slots))
            return False

    def release(self, slots: Sequence[int]) -> None:
        """Give claimed slots back to the free list (best effort: a dead claim is recovered at the next open)."""
        try:
            with self.env.begin(write=True) as txn:
                for slot in slots:
                    txn.delete(_SLOT.pack(slot), db=self.db_claims)
                    txn.put(_SLOT.pack(slot), b"", db=self.db_free)
        except lmdb.Error as exc:
            log.warning("disk tier %s: could not return %d claimed slots: %s", self.root, len(slots), exc)

    def delete(self, keys: Sequence[bytes]) -> None:
        """Delete records and return their slots to the free list (one txn); keys with no record are skipped."""
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

    def drop_damaged(self, key: bytes, slot_limit: int) -> None:
        """Delete the record of ``key``; free its slot if its header still names one below ``slot_limit``.

        Best effort (a failed txn is logged): a reader calls this on a record that failed verification.
        """
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
                if slot is not None and slot < slot_limit:
                    txn.put(_SLOT.pack(slot), b"", db=self.db_free)
        except lmdb.Error as exc:
            log.warning("disk tier %s: could not delete damaged record: %s", self.root, exc)

    # ------------------------------------------------------------------ reading
    def headers(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The packed header stored under each key, or None (one read txn)."""
        with self.env.begin(db=self.db_records, buffers=False) as txn:
            return [txn.get(k) for k in keys]

    def still_same(self, key: bytes, raw: bytes) -> bool:
        """Whether ``key``'s record is still ``raw`` (False: another process deleted or replaced it meanwhile)."""
        try:
            with self.env.begin(db=self.db_records, buffers=False) as txn:
                return txn.get(key) == raw
        except lmdb.Error:
            return True

    def has(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether a record of each key exists now (one read txn)."""
        with self.env.begin(db=self.db_records, buffers=True) as txn:
            return [txn.get(k) is not None for k in keys]

    def list_keys(self, layout_fp: int, prefix: bytes = b"") -> tuple[list[bytes], list[bytes]]:
        """Keys (starting with ``prefix``) whose records were written for ``layout_fp``, oldest first.

        Returns ``(keys, damaged)``: ``damaged`` are keys (with the prefix) whose header fails to parse;
        the caller decides whether to ``drop_damaged`` them.
        """
        out: list[tuple[int, bytes]] = []
        bad: list[bytes] = []
        with self.env.begin(db=self.db_records, buffers=False) as txn:
            for key, raw in txn.cursor():
                if prefix and not key.startswith(prefix):
                    continue
                try:
                    hdr = RecordHeader.unpack(key, raw)
                except RecordError:
                    bad.append(key)
                    continue
                if hdr.layout_fp == layout_fp:
                    out.append((hdr.created_ns, key))
        out.sort()
        return [k for _, k in out], bad

    def scan(self) -> dict:
        """Summary of the index (one read txn): records, payload and raw bytes, bad headers, layouts,
        slot size, physical slots, free-listed slots, pending claims and the index file's size."""
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
        return {"records": records, "payload_bytes": stored, "raw_bytes": raw_total, "bad_headers": bad,
                "layouts": layouts, "slot_bytes": self.slot_bytes, "physical_slots": self.physical_slots,
                "free_listed": free, "pending_claims": claims,
                "index_bytes": os.path.getsize(self.path / "data.mdb")}

    # ------------------------------------------------------------------ lifetime
    def sync(self) -> None:
        """Force the index to stable storage (LMDB's ``sync(force=True)``)."""
        self.env.sync(True)

    def close(self) -> None:
        """Release this opener's share of the environment (closed when the last one in the process lets go)."""
        _close_env(self.env)
