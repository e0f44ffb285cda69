"""Shared capacity of one disk-tier directory: kept in its LMDB index, changed only in write transactions.

Every process that opens the directory sees one budget and one eviction order, because both live
in the directory itself (docs/reliability.md, "Sharing one directory"):

- ``owners``: record key -> owner namespace prefix (8 bytes) + age tick (``>Q``). The owner is the
  namespace of the store that wrote the record; only that namespace reads, lists or adopts it.
- ``order``: owner + tick + key -> empty. The eviction order of each namespace, oldest first (a read
  moves its record to the young end: least recently used across every process).
- ``spaces``: owner -> weight, quota (slots), used (slots: records plus claims in flight), evictions.
- ``leases``: key + pid + sequence -> expiry (wall-clock ns). A reader holds one while it reads a
  record's payload; eviction skips leased records, so no slot is reused under a reader.
- ``meta``: ``budget_mode`` ("namespace" or "shared"), ``budget`` (shared mode: slots for every
  namespace together), ``tick`` (the age clock), ``acct`` (present once the accounting was built).

Modes. ``namespace`` (default): each namespace's ``disk_bytes`` is its own quota inside the
directory; a full namespace evicts its own oldest records, never another's. ``shared``: ``disk_bytes``
is one budget for the directory; each namespace's fair share is ``budget * weight / sum(weights)``
over the namespaces that registered; a writer at or above its share evicts its own oldest records,
one below its share evicts the oldest of the namespace furthest above its share. So one tenant can
use idle room but cannot push another below its share.

Why leases rather than only checksums: a record's payload checksum already turns a slot reused under
a reader into a miss (never wrong bytes), but the reader would then lose a block the planner had
promised; a lease keeps the block until the read ends. Leases expire (``LEASE_TTL_S``) and die with
their process, so a crashed reader blocks nothing for long.

Threading contract: ``Budget`` holds no state of its own beyond the database handles and this
process's identity; every method runs inside a write (or read) transaction its caller passes in,
so callers on any thread may use it at once (LMDB serializes the writers).
"""
from __future__ import annotations

import itertools
import logging
import os
import struct
import time
from collections.abc import Callable, Iterable

import lmdb

from tiered_kv.errors import ConfigError, RecordError
from tiered_kv.values.record import RecordHeader

log = logging.getLogger(__name__)

OWNER_LEN = 8
ANON = bytes(OWNER_LEN)  # the owner of records written by a tier opened without a namespace
MODES = ("namespace", "shared")
LEASE_TTL_S = 60.0
_U64 = struct.Struct(">Q")
_SPACE = struct.Struct("<IQQQ")  # weight, quota slots, used slots, evictions
_LEASE = struct.Struct("<IQ")  # pid, sequence (appended to the key)
_EXPIRY = struct.Struct("<Q")
_CLAIM = struct.Struct("<I")
_SCAN_LIMIT = 512  # leased records skipped per victim search before giving up
_seq = itertools.count(1)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a permission error means it does)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Space:
    """One namespace's entry in ``spaces`` (mutable while a transaction works on it)."""

    __slots__ = ("weight", "quota", "used", "evictions")

    def __init__(self, weight: int = 1, quota: int = 0, used: int = 0, evictions: int = 0) -> None:
        self.weight, self.quota, self.used, self.evictions = weight, quota, used, evictions

    def pack(self) -> bytes:
        """Serialized form."""
        return _SPACE.pack(self.weight, self.quota, max(0, self.used), self.evictions)

    @classmethod
    def unpack(cls, raw: bytes) -> "Space":
        """Inverse of ``pack``."""
        return cls(*_SPACE.unpack(bytes(raw)))


class Budget:
    """The budget rules over one index's databases, for one opener (``owner``, ``mode``, ``weight``).

    ``_budget`` (shared mode's slots) is re-read at the start of every write txn that claims or trims
    (``begin_claim``, ``_trim``); LMDB serializes those txns, so it never changes under one.
    """

    def __init__(self, dbs: dict, owner: bytes, mode: str, weight: int) -> None:
        if mode not in MODES:
            raise ConfigError(f"disk_budget: unknown value {mode!r}; valid: {list(MODES)}")
        if len(owner) != OWNER_LEN:
            raise ConfigError(f"disk tier owner must be a {OWNER_LEN}-byte namespace prefix, got {len(owner)} bytes")
        self.db = dbs
        self.owner, self.mode, self.weight = owner, mode, weight

    # ------------------------------------------------------------------ spaces
    def spaces(self, txn: lmdb.Transaction) -> dict[bytes, Space]:
        """Every namespace registered in the directory."""
        return {bytes(k): Space.unpack(v) for k, v in txn.cursor(db=self.db["spaces"])}

    def save(self, txn: lmdb.Transaction, spaces: dict[bytes, Space]) -> None:
        """Write back the spaces a transaction changed."""
        for owner, sp in spaces.items():
            txn.put(owner, sp.pack(), db=self.db["spaces"])

    def clock(self, txn: lmdb.Transaction) -> int:
        """The age clock now (``meta`` ``tick``): every commit or read of a record sets a tick past it."""
        raw = txn.get(b"tick", db=self.db["meta"])
        return _U64.unpack(raw)[0] if raw else 0

    def evictions(self, txn: lmdb.Transaction, owner: bytes) -> int:
        """How many of ``owner``'s records were evicted so far (by any process's writes)."""
        raw = txn.get(owner, db=self.db["spaces"])
        return Space.unpack(raw).evictions if raw is not None else 0

    def keys_since(self, txn: lmdb.Transaction, owner: bytes, tick: int = 0) -> list[bytes]:
        """``owner``'s records committed or read after clock ``tick``, least recently used first (``tick`` 0: all of
        them). A walk of ``order`` from ``owner + tick``: its cost is what changed, not the records held."""
        cur = txn.cursor(db=self.db["order"])
        out: list[bytes] = []
        if not cur.set_range(owner + _U64.pack(tick + 1)):
            return out
        skip = OWNER_LEN + 8
        for k in cur.iternext(values=False):
            k = bytes(k)
            if not k.startswith(owner):
                break
            out.append(k[skip:])
        return out

    def _tick(self, txn: lmdb.Transaction) -> int:
        raw = txn.get(b"tick", db=self.db["meta"])
        t = (_U64.unpack(raw)[0] if raw else 0) + 1
        txn.put(b"tick", _U64.pack(t), db=self.db["meta"])
        return t

    def budget_slots(self, txn: lmdb.Transaction) -> int:
        """Shared mode: the directory's budget in slots."""
        raw = txn.get(b"budget", db=self.db["meta"])
        return _U64.unpack(raw)[0] if raw else 0

    def register(self, txn: lmdb.Transaction, quota: int, slot_limit: int) -> tuple[int, list[bytes]]:
        """At a writable open: check the mode, record this namespace (weight, quota) and, in shared mode,
        the directory's budget; trim what is over budget. Returns (physical slots wanted, evicted keys)."""
        meta = self.db["meta"]
        raw = txn.get(b"budget_mode", db=meta)
        if raw is None:
            txn.put(b"budget_mode", self.mode.encode(), db=meta)
        elif bytes(raw).decode() != self.mode:
            raise ConfigError(f"disk_budget={self.mode!r} but this directory is shared with disk_budget="
                              f"{bytes(raw).decode()!r}; use the same value in every process on it")
        if txn.get(b"acct", db=meta) is None:
            self._build_accounting(txn)
        spaces = self.spaces(txn)
        sp = spaces.setdefault(self.owner, Space())
        sp.weight, sp.quota = self.weight, quota
        if self.mode == "shared":
            old = self.budget_slots(txn)
            if old and old != quota:  # the last opener's disk_bytes wins: say so, it changes every tenant's share
                log.warning("disk tier: the shared budget changes from %d to %d slots (this process's disk_bytes); "
                            "give every process on the directory the same disk_bytes", old, quota)
            txn.put(b"budget", _U64.pack(quota), db=meta)
            want = quota
        else:
            want = sum(s.quota for s in spaces.values())
        evicted = self._trim(txn, spaces, slot_limit)
        self.save(txn, spaces)
        return want, evicted

    def _build_accounting(self, txn: lmdb.Transaction) -> None:
        """A directory written before the budget existed: its records become this opener's, oldest first."""
        db = self.db
        aged: list[tuple[int, bytes]] = []
        for key, raw in txn.cursor(db=db["records"]):
            key = bytes(key)
            if txn.get(key, db=db["owners"]) is not None:
                continue
            try:
                aged.append((RecordHeader.unpack(key, bytes(raw)).created_ns, key))
            except RecordError:
                aged.append((0, key))
        aged.sort()
        base = self._tick(txn)
        for i, (_, key) in enumerate(aged):
            self._place(txn, key, self.owner, base + i)
        txn.put(b"tick", _U64.pack(base + len(aged)), db=db["meta"])
        spaces = self.spaces(txn)
        for sp in spaces.values():
            sp.used = 0
        for _, val in txn.cursor(db=db["owners"]):
            spaces.setdefault(bytes(val[:OWNER_LEN]), Space()).used += 1
        for _, val in txn.cursor(db=db["claims"]):
            spaces.setdefault(claim_owner(val), Space()).used += 1
        self.save(txn, spaces)
        txn.put(b"acct", b"1", db=db["meta"])

    # ------------------------------------------------------------------ records
    def _place(self, txn: lmdb.Transaction, key: bytes, owner: bytes, tick: int) -> None:
        txn.put(key, owner + _U64.pack(tick), db=self.db["owners"])
        txn.put(owner + _U64.pack(tick) + key, b"", db=self.db["order"])

    def owner_of(self, txn: lmdb.Transaction, key: bytes) -> bytes | None:
        """The namespace that owns ``key``'s record (None: no accounting entry)."""
        raw = txn.get(key, db=self.db["owners"])
        return None if raw is None else bytes(raw[:OWNER_LEN])

    def committed(self, txn: lmdb.Transaction, keys: Iterable[bytes]) -> None:
        """Records of this opener were stored: give them owners and the young end of the order."""
        tick = self._tick(txn)
        for key in keys:
            self._place(txn, key, self.owner, tick)

    def touch(self, txn: lmdb.Transaction, keys: Iterable[bytes]) -> None:
        """Records were read: move them to the young end of their namespace's order."""
        tick = None
        for key in keys:
            raw = txn.get(key, db=self.db["owners"])
            if raw is None:
                continue
            raw = bytes(raw)
            owner = raw[:OWNER_LEN]
            txn.delete(raw + key, db=self.db["order"])
            tick = tick or self._tick(txn)
            self._place(txn, key, owner, tick)

    def forget(self, txn: lmdb.Transaction, key: bytes, spaces: dict[bytes, Space] | None = None) -> None:
        """A record was removed: drop its accounting entries and count its slot out of its owner's use."""
        raw = txn.pop(key, db=self.db["owners"])
        if raw is None:
            return
        raw = bytes(raw)
        txn.delete(raw + key, db=self.db["order"])
        self.release(txn, raw[:OWNER_LEN], 1, spaces)

    def release(self, txn: lmdb.Transaction, owner: bytes, n: int, spaces: dict[bytes, Space] | None = None) -> None:
        """``n`` slots of ``owner`` went back (failed writes, released claims, deleted records)."""
        if n <= 0:
            return
        if spaces is not None:
            sp = spaces.setdefault(owner, Space())
            sp.used = max(0, sp.used - n)
            return
        raw = txn.get(owner, db=self.db["spaces"])
        sp = Space.unpack(raw) if raw is not None else Space()
        sp.used = max(0, sp.used - n)
        txn.put(owner, sp.pack(), db=self.db["spaces"])

    # ------------------------------------------------------------------ claiming with eviction
    def may_grow(self, spaces: dict[bytes, Space]) -> bool:
        """Whether this opener may take one more slot without evicting."""
        if self.mode == "shared":
            return sum(s.used for s in spaces.values()) < self._budget
        sp = spaces[self.owner]
        return sp.used < sp.quota

    def begin_claim(self, txn: lmdb.Transaction) -> dict[bytes, Space]:
        """Load what a claim needs; call ``save`` when it is done."""
        spaces = self.spaces(txn)
        spaces.setdefault(self.owner, Space(self.weight))
        self._budget = self.budget_slots(txn)
        return spaces

    def share(self, spaces: dict[bytes, Space], owner: bytes) -> int:
        """Shared mode: ``owner``'s fair share of the budget in slots."""
        total = sum(s.weight for s in spaces.values()) or 1
        return self._budget * spaces[owner].weight // total

    def victim(self, txn: lmdb.Transaction, spaces: dict[bytes, Space], now_ns: int,
               keep: Callable[[bytes], bool] | None = None) -> bytes | None:
        """The record to evict for one more slot of this opener, or None (nothing may go). ``keep(key)``:
        this process still needs the record (its planner has a read of it planned)."""
        if self.mode == "namespace":
            return self.oldest(txn, self.owner, now_ns, keep)
        mine = spaces[self.owner]
        if mine.used >= self.share(spaces, self.owner):
            order = [self.owner]
        else:
            order = []
        over = sorted(((s.used - self.share(spaces, o), o) for o, s in spaces.items()
                       if o != self.owner and s.used > self.share(spaces, o)), reverse=True)
        order += [o for _, o in over]
        if not order:
            order = [self.owner]  # rounding left nobody above a share: take our own oldest
        for owner in order:
            key = self.oldest(txn, owner, now_ns, keep)
            if key is not None:
                return key
        return None

    def oldest(self, txn: lmdb.Transaction, owner: bytes, now_ns: int,
               keep: Callable[[bytes], bool] | None = None) -> bytes | None:
        """``owner``'s least recently used record that no live reader holds a lease on (nor ``keep`` keeps)."""
        cur = txn.cursor(db=self.db["order"])
        if not cur.set_range(owner):
            return None
        for scanned, (k, _) in enumerate(cur):
            k = bytes(k)
            if not k.startswith(owner) or scanned > _SCAN_LIMIT:
                return None
            key = k[OWNER_LEN + 8:]
            if not self.leased(txn, key, now_ns) and not (keep is not None and keep(key)):
                return key
        return None

    def evict(self, txn: lmdb.Transaction, key: bytes, spaces: dict[bytes, Space], slot_limit: int) -> int | None:
        """Remove ``key``'s record for room; returns its slot for the caller to reuse (None: header damaged)."""
        raw = txn.pop(key, db=self.db["records"])
        owner = self.owner_of(txn, key) or ANON
        self.forget(txn, key, spaces)
        spaces.setdefault(owner, Space()).evictions += 1
        if raw is None:
            return None
        try:
            slot = RecordHeader.unpack(key, bytes(raw)).slot
        except RecordError:
            return None
        return slot if slot < slot_limit else None

    def _trim(self, txn: lmdb.Transaction, spaces: dict[bytes, Space], slot_limit: int) -> list[bytes]:
        """Evict until this opener's namespace (namespace mode) or the directory (shared) fits its budget."""
        self._budget = self.budget_slots(txn)
        now = time.time_ns()
        out: list[bytes] = []
        while True:
            if self.mode == "shared":
                over = sum(s.used for s in spaces.values()) > self._budget
            else:
                over = spaces[self.owner].used > spaces[self.owner].quota
            if not over:
                return out
            key = self.victim(txn, spaces, now) if self.mode == "shared" else self.oldest(txn, self.owner, now)
            if key is None:
                return out
            slot = self.evict(txn, key, spaces, slot_limit)
            if slot is not None:
                txn.put(_U64.pack(slot), b"", db=self.db["free"])
            out.append(key)

    # ------------------------------------------------------------------ leases
    def lease(self, txn: lmdb.Transaction, key: bytes) -> bytes:
        """Hold ``key``'s record for a read; returns the lease's database key (give it to ``unlease``)."""
        lk = key + _LEASE.pack(os.getpid(), next(_seq))
        txn.put(lk, _EXPIRY.pack(time.time_ns() + int(LEASE_TTL_S * 1e9)), db=self.db["leases"])
        return lk

    def unlease(self, txn: lmdb.Transaction, lease_keys: Iterable[bytes]) -> None:
        """End leases."""
        for lk in lease_keys:
            txn.delete(lk, db=self.db["leases"])

    def drop_stale_leases(self, txn: lmdb.Transaction) -> int:
        """Delete every lease that expired or whose process is gone (at open); returns how many went."""
        now = time.time_ns()
        stale = []
        for k, v in txn.cursor(db=self.db["leases"]):
            k = bytes(k)
            if len(k) < _LEASE.size:
                stale.append(k)
                continue
            if not _lease_live(k[-_LEASE.size:], v, now):
                stale.append(k)
        for k in stale:
            txn.delete(k, db=self.db["leases"])
        return len(stale)

    def leased(self, txn: lmdb.Transaction, key: bytes, now_ns: int) -> bool:
        """Whether a live reader holds ``key``; expired leases and leases of dead processes are dropped
        (when ``txn`` is a write transaction)."""
        cur = txn.cursor(db=self.db["leases"])
        if not cur.set_range(key):
            return False
        want = len(key) + _LEASE.size
        stale: list[bytes] = []
        live = False
        for k, v in cur:
            k = bytes(k)
            if not k.startswith(key):
                break
            if len(k) != want:
                continue
            if _lease_live(k[len(key):], v, now_ns):
                live = True
                break
            stale.append(k)
        for k in stale:
            try:
                txn.delete(k, db=self.db["leases"])
            except lmdb.ReadonlyError:
                break
        return live


def _lease_live(tail: bytes, value: bytes, now_ns: int) -> bool:
    """Whether the lease whose key ends in ``tail`` (pid, sequence) and holds ``value`` (its expiry) still holds:
    not expired at ``now_ns`` and its process alive."""
    pid, _ = _LEASE.unpack(tail)
    return _EXPIRY.unpack(bytes(value))[0] > now_ns and pid_alive(pid)


def claim_value(owner: bytes) -> bytes:
    """The ``claims`` value of a slot this process claims for ``owner``: pid + owner."""
    return _CLAIM.pack(os.getpid()) + owner


def claim_owner(raw: bytes) -> bytes:
    """The owner named by a ``claims`` value (claims of older writers name none)."""
    raw = bytes(raw)
    return raw[4:4 + OWNER_LEN] if len(raw) >= 4 + OWNER_LEN else ANON
