"""The disk tier's index: one LMDB environment of four sub-databases in ``<disk_path>/index/``.

- ``records``: block key -> 64-byte ``RecordHeader`` (where the payload is, how long, its checksum);
- ``free``: slot numbers (``>Q``) given back by deletes, reused before the high-water mark grows;
- ``claims``: slot -> writer pid (``<I``) for slots being written, so a crash between claim and
  commit leaves a claim of a dead pid that the next open returns to the free list;
- ``meta``: ``format`` (JSON: format number, slot size), ``slots`` (slots in the payload file, the
  largest capacity this directory was ever opened with) and ``hwm`` (slots ever handed out);
- ``owners``, ``order``, ``spaces``, ``leases``: the directory's shared budget, eviction order,
  per-namespace use and readers' leases (budget.py says what each holds and the rules).

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
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import lmdb

from tiered_kv.errors import ConfigError, RecordError
from tiered_kv.tiers.disk.budget import ANON, Budget, claim_owner, claim_value, pid_alive
from tiered_kv.values.record import RecordHeader

log = logging.getLogger(__name__)

FORMAT = 1
_SLOT = struct.Struct(">Q")  # big-endian, so the free list's cursor order is slot order
_CLAIM = struct.Struct("<I")
_BUDGET_DBS = ("owners", "order", "spaces", "leases")

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


def env_open_here(idx: Path) -> bool:
    """Whether this process already has the LMDB environment at ``idx`` open (then it was checked)."""
    with _ENVS_LOCK:
        return os.path.realpath(idx) in _ENVS


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


def _check_size(env: lmdb.Environment, path: Path) -> None:
    """Refuse an index file shorter than its own meta page says (reading past EOF would SIGBUS)."""
    data = path / "data.mdb"
    need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    have = data.stat().st_size
    if have < need:
        raise ConfigError(f"{str(data)!r} is truncated ({have} bytes, its meta page needs {need}); "
                          f"move the directory aside to start empty")


def _check_format(env: lmdb.Environment, db_meta, root: Path, slot_bytes: int, slots: int, readonly: bool) -> int:
    """Write the format record of a new index, or check an existing one (and grow ``slots``); returns the slot
    size (a read-only open adopts the directory's)."""
    with env.begin(db=db_meta, write=not readonly) as txn:
        raw = txn.get(b"format")
        if raw is None:
            if readonly:
                raise ConfigError(f"{str(root)!r}: disk tier has no format record")
            txn.put(b"format", json.dumps({"format": FORMAT, "slot_bytes": slot_bytes}).encode())
            txn.put(b"slots", _SLOT.pack(slots))
            txn.put(b"hwm", _SLOT.pack(0))
            return slot_bytes
        try:
            fmt = json.loads(bytes(raw))
            ok = isinstance(fmt, dict) and fmt.get("format") == FORMAT
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError(f"{str(root)!r}: unknown disk-tier format {bytes(raw)[:80]!r}; use an empty directory")
        if readonly:
            slot_bytes = int(fmt["slot_bytes"])
        elif fmt.get("slot_bytes") != slot_bytes:
            raise ConfigError(f"{str(root)!r} holds blocks of {fmt.get('slot_bytes')} bytes per slot but "
                              f"this store's blocks need {slot_bytes}; use another disk_path per block size")
        old = _SLOT.unpack(txn.get(b"slots"))[0]
        if slots > old and not readonly:
            txn.put(b"slots", _SLOT.pack(slots))
    return slot_bytes


_pid_alive = pid_alive


class DiskIndex:
    """The LMDB index of one disk-tier directory: records, free slots, claims and meta.

    ``path`` is the index directory (``<disk_path>/index``); it is created unless ``readonly``.
    ``slot_bytes`` must match the directory's format record (a read-only open adopts the
    directory's instead); ``slots`` is the payload file's size in slots wanted by this opener
    (the stored value only grows). Raises ConfigError when the index cannot be opened, is
    damaged or truncated, or holds another format.

    ``owner`` (an 8-byte namespace prefix), ``budget`` ("namespace" or "shared") and ``weight`` are this
    opener's place in the directory's shared budget (budget.py): a writable open registers them, with
    ``slots`` as the namespace's quota (namespace mode) or the directory's budget (shared mode).
    ``label`` names the medium in log lines ("disk tier"; the host pool's index says "cpu pool").

    Public attributes for tools that read the index directly (``inspect``, tests):
    ``env`` and ``db_records``, ``db_free``, ``db_claims``, ``db_meta``.
    """

    def __init__(self, path: Path, slot_bytes: int, slots: int, readonly: bool = False, sync: bool = False,
                 owner: bytes = ANON, budget: str = "namespace", weight: int = 1, label: str = "disk tier") -> None:
        self.path = path
        self.root = path.parent  # the disk-tier directory, named in messages
        self.label = label  # what messages call the medium ("disk tier", "cpu pool")
        self.slot_bytes = slot_bytes
        self.readonly = readonly
        if not readonly:
            path.mkdir(mode=0o700, exist_ok=True)
        map_size = max(64 << 20, slots * 512 + (32 << 20))  # ~512 B of B-tree per record, plus room to grow
        try:
            self.env = _open_env(path, readonly, map_size=map_size, max_dbs=10, subdir=True, readonly=readonly,
                                 sync=sync, metasync=sync, lock=True, mode=0o600, max_readers=256,
                                 readahead=False, meminit=False)
        except lmdb.Error as exc:
            raise ConfigError(f"{str(path)!r}: cannot open the LMDB index ({type(exc).__name__}: {exc}); "
                              f"move the directory aside to start empty") from None
        try:
            _check_size(self.env, path)
            self.db_records = self.env.open_db(b"records", create=not readonly)
            self.db_free = self.env.open_db(b"free", create=not readonly)
            self.db_claims = self.env.open_db(b"claims", create=not readonly)
            self.db_meta = self.env.open_db(b"meta", create=not readonly)
            dbs = {"records": self.db_records, "free": self.db_free, "claims": self.db_claims, "meta": self.db_meta}
            self.accounted = True
            for name in _BUDGET_DBS:
                try:
                    dbs[name] = self.env.open_db(name.encode(), create=not readonly)
                except lmdb.NotFoundError:  # read-only open of a directory written before the budget existed
                    self.accounted = False
            self.owner = owner
            self.budget = Budget(dbs, owner, budget, weight)
            self.slot_bytes = _check_format(self.env, self.db_meta, self.root, slot_bytes, slots, readonly)
            self.evicted_at_open: list[bytes] = []
            if not readonly:
                self._register(slots)
        except lmdb.Error as exc:
            _close_env(self.env)
            raise ConfigError(f"{str(path)!r}: the LMDB index is damaged ({type(exc).__name__}: {exc}); "
                              f"move the directory aside to start empty") from None
        except ConfigError:
            _close_env(self.env)
            raise

    # ------------------------------------------------------------------ open
    def _register(self, slots: int) -> None:
        """Register this opener in the directory's budget; grow the payload file's slot count to match."""
        with self.env.begin(write=True) as txn:
            limit = _SLOT.unpack(txn.get(b"slots", db=self.db_meta))[0]
            want, self.evicted_at_open = self.budget.register(txn, slots, limit)
            if want > limit:
                txn.put(b"slots", _SLOT.pack(want), db=self.db_meta)
        if self.evicted_at_open:
            log.info("%s %s: evicted %d records to fit the budget at open", self.label, self.root,
                     len(self.evicted_at_open))

    @property
    def physical_slots(self) -> int:
        """Slots the payload file must hold (the largest capacity this directory was ever opened with)."""
        with self.env.begin(db=self.db_meta) as txn:
            return _SLOT.unpack(txn.get(b"slots"))[0]

    def recover_claims(self) -> int:
        """Return slots claimed by dead processes (crash between claim and commit) to the free list, drop read
        leases that expired or whose process is gone, and free LMDB's reader slots of dead processes (one killed
        inside a read transaction keeps its slot in ``lock.mdb`` until then; 256 of them stop every reader).

        Returns how many slots came back.
        """
        freed = 0
        self.env.reader_check()
        with self.env.begin(write=True) as txn:
            self.budget.drop_stale_leases(txn)
            cur = txn.cursor(db=self.db_claims)
            dead = [(bytes(k), bytes(v)) for k, v in cur if not _pid_alive(_CLAIM.unpack(bytes(v)[:4])[0])]
            for slot_key, val in dead:
                txn.delete(slot_key, db=self.db_claims)
                txn.put(slot_key, b"", db=self.db_free)
                self.budget.release(txn, claim_owner(val), 1)
                freed += 1
        if freed:
            log.warning("%s %s: returned %d slots claimed by crashed writers to the free list", self.label, self.root,
                        freed)
        return freed

    # ------------------------------------------------------------------ writing
    def claim(self, keys: Sequence[bytes]) -> tuple[list[int], list[int]]:
        """In one write txn: which ``keys`` have no record yet, and a claimed slot for as many of them as fit.

        Returns ``(fresh, slots)``: ``fresh`` are indices into ``keys``; ``slots[j]`` is claimed for
        ``keys[fresh[j]]`` under this process's pid. ``len(slots) < len(fresh)`` when the payload file
        is full. Every claimed slot must end in ``commit`` or ``release``.
        """
        fresh, slots, _, _ = self.claim_ex(keys, evict=False)
        return fresh, slots

    def claim_ex(self, keys: Sequence[bytes], evict: bool = True, keep: Callable[[bytes], bool] | None = None
                 ) -> tuple[list[int], list[int], list[bytes], list[int]]:
        """``claim`` under the directory's budget, in one write txn.

        Returns ``(fresh, slots, evicted, foreign)``: as ``claim``, plus the keys whose records were
        evicted to make room (any namespace's, as the budget's rules allow; only with ``evict``) and
        ``foreign``, indices of keys another namespace holds a record of (neither fresh nor ours:
        a put of those is refused). ``keep(key)`` spares records this process still needs.
        """
        with self.env.begin(write=True) as txn:
            fresh: list[int] = []
            foreign: list[int] = []
            for i, k in enumerate(keys):
                if txn.get(k, db=self.db_records) is None:
                    fresh.append(i)
                elif self.accounted and self.budget.owner_of(txn, k) not in (None, self.owner):
                    foreign.append(i)
            slots, evicted = self._claim(txn, len(fresh), evict, keep)
            return fresh, slots, evicted, foreign

    def _claim(self, txn: lmdb.Transaction, n: int, evict: bool, keep: Callable[[bytes], bool] | None = None
               ) -> tuple[list[int], list[bytes]]:
        """Take up to ``n`` slots inside write txn ``txn`` within the budget: free-listed ones first, then
        above the high-water mark, then (``evict``) slots of records the budget's rules let go."""
        out: list[int] = []
        evicted: list[bytes] = []
        budget = self.budget
        spaces = budget.begin_claim(txn)
        mine = spaces[self.owner]
        cur = txn.cursor(db=self.db_free)
        hwm = _SLOT.unpack(txn.get(b"hwm", db=self.db_meta))[0]
        limit = _SLOT.unpack(txn.get(b"slots", db=self.db_meta))[0]
        now = 0
        while len(out) < n:
            if budget.may_grow(spaces):
                if cur.first():
                    out.append(_SLOT.unpack(bytes(cur.key()))[0])
                    cur.delete()
                    mine.used += 1
                    continue
                if hwm < limit:
                    out.append(hwm)
                    hwm += 1
                    mine.used += 1
                    continue
            if not evict:
                break
            now = now or time.time_ns()
            victim = budget.victim(txn, spaces, now, keep)
            if victim is None:
                break
            slot = budget.evict(txn, victim, spaces, limit)
            evicted.append(victim)
            if slot is not None:
                txn.put(_SLOT.pack(slot), b"", db=self.db_free)  # taken by the next turn of the loop
        txn.put(b"hwm", _SLOT.pack(hwm), db=self.db_meta)
        budget.save(txn, spaces)
        val = claim_value(self.owner)
        for s in out:
            txn.put(_SLOT.pack(s), val, db=self.db_claims)
        return out, evicted

    def commit(self, records: Sequence[tuple[bytes, int, bytes]], failed_slots: Sequence[int]) -> bool:
        """In one write txn: store each ``(key, slot, packed_header)`` and end its claim; free ``failed_slots``.

        A key another process stored first keeps its record; this writer's slot goes back to the free
        list. Returns False when the txn failed (e.g. the file system is full and the index cannot
        grow): then no record was stored and every slot was given back.
        """
        try:
            with self.env.begin(write=True) as txn:
                lost: list[int] = []
                stored: list[bytes] = []
                for key, slot, hdr in records:
                    if not txn.put(key, hdr, db=self.db_records, overwrite=False):
                        lost.append(slot)  # another process stored it first: keep theirs
                    else:
                        stored.append(key)
                    txn.delete(_SLOT.pack(slot), db=self.db_claims)
                for slot in (*failed_slots, *lost):
                    txn.delete(_SLOT.pack(slot), db=self.db_claims)
                    txn.put(_SLOT.pack(slot), b"", db=self.db_free)
                self.budget.committed(txn, stored)
                self.budget.release(txn, self.owner, len(failed_slots) + len(lost))
            return True
        except lmdb.Error as exc:
            log.warning("%s %s: index commit of %d blocks failed: %s", self.label, self.root, len(records), exc)
            self.release([slot for _, slot, _ in records] + list(failed_slots))
            return False

    def release(self, slots: Sequence[int]) -> None:
        """Give claimed slots back to the free list (best effort: a dead claim is recovered at the next open)."""
        try:
            with self.env.begin(write=True) as txn:
                n = 0
                for slot in slots:
                    if txn.delete(_SLOT.pack(slot), db=self.db_claims):
                        n += 1
                    txn.put(_SLOT.pack(slot), b"", db=self.db_free)
                self.budget.release(txn, self.owner, n)
        except lmdb.Error as exc:
            log.warning("%s %s: could not return %d claimed slots: %s", self.label, self.root, len(slots), exc)

    def delete(self, keys: Sequence[bytes]) -> None:
        """Delete records and return their slots to the free list (one txn); keys with no record, and
        records another namespace owns, are skipped."""
        with self.env.begin(write=True) as txn:
            for key in keys:
                if self.budget.owner_of(txn, key) not in (None, self.owner):
                    continue
                raw = txn.pop(key, db=self.db_records)
                if raw is None:
                    continue
                self.budget.forget(txn, key)
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
                self.budget.forget(txn, key)
                slot = None
                if raw is not None and len(raw) >= 24:
                    try:
                        slot = RecordHeader.unpack(key, raw).slot
                    except RecordError:
                        slot = None  # header itself damaged: its slot leaks until a rebuild (counted as lost)
                if slot is not None and slot < slot_limit:
                    txn.put(_SLOT.pack(slot), b"", db=self.db_free)
        except lmdb.Error as exc:
            log.warning("%s %s: could not delete damaged record: %s", self.label, self.root, exc)

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
        """Whether a record of each key that this opener's namespace may read exists now (one read txn)."""
        with self.env.begin(db=self.db_records, buffers=True) as txn:
            return [txn.get(k) is not None and self._mine(txn, k) for k in keys]

    def _mine(self, txn: lmdb.Transaction, key: bytes) -> bool:
        return not self.accounted or self.budget.owner_of(txn, key) in (None, self.owner)

    def lease(self, keys: Sequence[bytes]) -> tuple[list[bytes | None], list[bytes]]:
        """In one write txn: the header of each key this namespace may read (None: no such record, or
        another namespace's), each held by a lease until ``unlease``. Returns (headers, lease keys)."""
        raws: list[bytes | None] = []
        leases: list[bytes] = []
        with self.env.begin(write=True, buffers=False) as txn:
            for k in keys:
                raw = txn.get(k, db=self.db_records)
                if raw is not None and not self._mine(txn, k):
                    raw = None
                raws.append(raw)
                if raw is not None:
                    leases.append(self.budget.lease(txn, k))
        return raws, leases

    def unlease(self, leases: Sequence[bytes], read: Sequence[bytes]) -> None:
        """End leases; the records in ``read`` were read and move to the young end of the eviction order."""
        if not leases and not read:
            return
        try:
            with self.env.begin(write=True) as txn:
                self.budget.unlease(txn, leases)
                self.budget.touch(txn, read)
        except lmdb.Error as exc:  # leases expire by themselves
            log.warning("%s %s: could not end %d read leases: %s", self.label, self.root, len(leases), exc)

    def owned_keys(self, layout_fp: int) -> tuple[list[bytes], list[bytes]]:
        """This namespace's keys whose records were written for ``layout_fp``, least recently used first.

        Returns ``(keys, damaged)`` as ``list_keys`` does.
        """
        if not self.accounted:
            return self.list_keys(layout_fp)
        out: list[bytes] = []
        bad: list[bytes] = []
        owner = self.owner
        with self.env.begin(buffers=False) as txn:
            cur = txn.cursor(db=self.budget.db["order"])
            if cur.set_range(owner):
                for k, _ in cur:
                    if not k.startswith(owner):
                        break
                    key = k[len(owner) + 8:]
                    raw = txn.get(key, db=self.db_records)
                    if raw is None:
                        continue
                    try:
                        hdr = RecordHeader.unpack(key, raw)
                    except RecordError:
                        bad.append(key)
                        continue
                    if hdr.layout_fp == layout_fp:
                        out.append(key)
        return out, bad

    def space_usage(self) -> dict:
        """The directory's budget as this opener sees it: mode, budget (slots), and per namespace (hex
        prefix) its weight, quota, used slots and evictions."""
        if not self.accounted:
            return {"mode": None, "budget_slots": 0, "spaces": {}}
        with self.env.begin() as txn:
            spaces = self.budget.spaces(txn)
            raw = txn.get(b"budget_mode", db=self.db_meta)
            budget = self.budget.budget_slots(txn)
            leases = txn.stat(self.budget.db["leases"])["entries"]
        return {"mode": None if raw is None else bytes(raw).decode(), "budget_slots": budget, "leases": leases,
                "spaces": {o.hex(): {"weight": s.weight, "quota_slots": s.quota, "used_slots": s.used,
                                     "evictions": s.evictions} for o, s in spaces.items()}}

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
                "index_bytes": os.path.getsize(self.path / "data.mdb"), "budget": self.space_usage()}

    # ------------------------------------------------------------------ lifetime
    def sync(self) -> None:
        """Force the index to stable storage (LMDB's ``sync(force=True)``)."""
        self.env.sync(True)

    def close(self) -> None:
        """Release this opener's share of the environment (closed when the last one in the process lets go)."""
        _close_env(self.env)
