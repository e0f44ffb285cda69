"""``IndexedTier``: the ``Tier`` protocol over a ``DiskIndex`` and a medium of fixed payload slots.

Two tiers share this machinery and differ only in where the payload slots live:

- ``DiskTier`` (tier.py): ``payload.bin`` on a file system, moved with O_DIRECT (``SlotFile``, slots.py);
- ``PoolTier`` (``tiers/pool/``): a file in ``/dev/shm`` every process on the host maps (``ShmSlots``).

What they share is everything that makes one medium safe to share between processes (docs/design.md,
"One disk directory, many processes and namespaces"): a write claims slots in one LMDB write txn (evicting
by the shared budget's rules when ``evicts``), writes the payloads, then commits headers in a second txn,
so a record never points at a torn slot and a crash between the two leaves a claim of a dead pid that
``recover_claims`` returns to the free list; a read holds a lease on each record it reads, so no slot is
reused under it, and verifies the payload against its header's checksum; every record belongs to the
namespace (``owner``) that wrote it and no other namespace reads, lists, adopts or deletes it.

A payload medium (``SlotPayload``) is anything with ``write(slot, raw, layout_fp) -> RecordHeader``,
``read(hdr, dst)`` (raising ``RecordError`` on a mismatch), ``slot_count()``, ``datasync()``, ``flush()``
and ``close()``.

Threading contract: ``read``/``write``/``delete``/``has`` may run on several mover threads at once (each
index call is its own LMDB txn; payload slots are disjoint); so may a ``RangeReads``'s ``read`` and ``verify``
(its failure set under its own lock), opened and closed by one thread. ``keep`` is called inside this process's
claim txn, ``released`` right after it, both on the writing thread. ``close()`` once.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import lmdb
import numpy as np
import torch

from tiered_kv.errors import RecordError, StoreClosedError
from tiered_kv.tiers.base import Tier
from tiered_kv.tiers.disk.index import DiskIndex
from tiered_kv.tiers.faults import FaultLog
from tiered_kv.values.layout import BlockLayout
from tiered_kv.values.record import CODEC_NONE, RecordHeader

log = logging.getLogger(__name__)


class SlotPayload(Protocol):
    """Where an ``IndexedTier`` keeps payload bytes: fixed slots, addressed by number."""

    def write(self, slot: int, raw: np.ndarray, layout_fp: int) -> RecordHeader:
        """Write one block into ``slot``; return the header describing it."""

    def read(self, hdr: RecordHeader, dst: torch.Tensor) -> None:
        """Read and verify the payload ``hdr`` describes into ``dst``; RecordError when it does not match."""

    def slot_count(self) -> int:
        """Slots the medium holds."""

    def datasync(self) -> None:
        """Make written payloads durable before their headers commit (when syncing)."""

    def flush(self) -> None:
        """Make the medium durable."""

    def close(self) -> None:
        """Release the medium."""


class IndexedTier(Tier):
    """A keyed tier: records in ``self.index`` (a ``DiskIndex``), payloads in ``self.slots`` (a ``SlotPayload``).

    A subclass opens both (after calling this ``__init__``). ``kind`` and ``source`` name the tier in
    messages ("disk tier", path; "cpu pool", name). ``owner`` is this opener's namespace prefix; ``evicts``:
    a write that finds no room evicts by the budget's rules (the planner then treats the tier as governed)
    instead of being refused; ``writer`` False never writes or deletes; ``recover_every_s``: how often a
    writer returns dead processes' claims to the free list while running (None: only at open).
    """

    slotted = False

    def __init__(self, layout: BlockLayout, capacity: int, kind: str, source: str, owner: bytes, evicts: bool,
                 writer: bool = True, readonly: bool = False, sync: bool = False, read_threads: int = 1,
                 recover_every_s: float | None = None) -> None:
        super().__init__(layout, capacity)
        self.where = f"{kind} {source}"  # in messages
        self.owner = owner
        self.evicts = evicts
        self.governed = evicts  # the planner neither counts room nor picks victims here (planner.room.TierSpec)
        self.readonly = readonly
        self.writer = writer and not readonly  # a reader never writes or deletes records (damaged ones aside)
        self.sync = sync
        self.key_prefix = b""
        #: ``keep(key)`` -> True spares a record from this process's evictions (set by the owner of the
        #: planner: a read of it is planned but has not taken its lease yet). Called inside a write txn.
        self.keep: Callable[[bytes], bool] | None = None
        #: ``released(keys)``: the claim txn that evicted ``keys`` (``keep`` said False) has ended (committed or
        #: not); called outside the txn. Lets the planner's owner tell a stale snapshot from a live record.
        self.released: Callable[[list[bytes]], None] | None = None
        self.faults = FaultLog(log, kind)  # write faults (full, read-only, failing): one line per interval
        self._source = source
        self.dropped_at_open = 0
        self.orphans_dropped = 0
        self.read_threads = read_threads
        self.recover_every_s = recover_every_s
        self._recovered_at = time.monotonic()
        self._closed = False
        self._executor: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self.index: DiskIndex
        self.slots: SlotPayload

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"{self.where} is closed")

    # ------------------------------------------------------------------ writing
    def write(self, keys: Sequence[bytes], slots: Sequence[int], rows) -> list[bool]:
        """Write ``rows[i]`` under ``keys[i]``; a key already stored is kept as is (blocks are immutable).

        ``rows`` is a ``(n, block_nbytes)`` uint8 tensor or a list of ``n`` 1-D uint8 rows (views are
        fine: a page-aligned CPU row is written to disk with no copy).
        """
        return self.write_ex(keys, slots, rows)[0]

    def write_ex(self, keys: Sequence[bytes], slots: Sequence[int], rows) -> tuple[list[bool], list[bytes]]:
        """``write``, plus the keys whose records the medium evicted to make room (any namespace's).

        A key whose record another namespace owns is refused (False), never overwritten or shared.
        """
        ok, fresh, claimed, evicted = self._claim(keys)
        headers: dict[int, RecordHeader | None] = {}
        fp = self.layout.fingerprint
        for i, slot in zip(fresh, claimed):
            row = rows[i]
            try:
                headers[i] = self.slots.write(slot, (row if row.device.type == "cpu" else row.cpu()).numpy(), fp)
            except OSError as exc:
                self.faults.fault(self._source, f"write of slot {slot} failed: {exc}")
                headers[i] = None
        if self.sync and any(h is not None for h in headers.values()):
            self.slots.datasync()  # payloads on stable storage before any header that points at them
        return self._commit(keys, ok, list(zip(fresh, claimed)), headers), evicted

    def _claim(self, keys: Sequence[bytes]) -> tuple[list[bool], list[int], list[int], list[bytes]]:
        """Claim slots for the ``keys`` that have no record yet, in one write txn (evicting when ``evicts``).

        Returns ``(ok, fresh, claimed, evicted)``: ``ok[i]`` False for keys refused already (another
        namespace's record, no room, a failed txn, not a writer); ``claimed[j]`` is the slot claimed for
        ``keys[fresh[j]]`` (``fresh`` may be longer: the rest found no room). Every claimed slot must end
        in ``self.index.commit`` or ``release``.
        """
        self._check_open()
        if not self.writer:
            return [False] * len(keys), [], [], []
        self._recover_if_due()
        going: list[bytes] = []

        def keep(key: bytes) -> bool:
            if self.keep is not None and self.keep(key):
                return True
            going.append(key)
            return False

        try:
            fresh, claimed, evicted, foreign = self.index.claim_ex(keys, evict=self.evicts, keep=keep)
        except lmdb.Error as exc:  # the index cannot take a write txn (file system full, I/O error): refused
            self.faults.fault(self._source, f"claiming slots for {len(keys)} blocks failed: {exc}")
            return [False] * len(keys), [], [], []
        finally:
            if going and self.released is not None:
                self.released(going)
        ok = [True] * len(keys)
        for i in foreign:
            ok[i] = False  # another namespace's record: not ours to share
        for i in fresh[len(claimed):]:
            ok[i] = False  # no room within the budget (or the medium is full)
        return ok, fresh, claimed, evicted

    def _commit(self, keys: Sequence[bytes], ok: list[bool], items: list[tuple[int, int]],
                headers: dict[int, RecordHeader | None]) -> list[bool]:
        """End the claims ``items`` (``(i, slot)``: ``keys[i]`` claimed ``slot``) in one write txn: a slot whose
        ``headers[i]`` is a header becomes ``keys[i]``'s record, one whose header is None (its write failed)
        goes back to the free list. Returns ``ok`` with every item that did not become a record set False."""
        written: list[tuple[bytes, int, bytes]] = []  # (key, slot, packed header)
        written_items: list[int] = []
        failed_slots: list[int] = []
        for i, slot in items:
            hdr = headers.get(i)
            if hdr is None:
                ok[i] = False
                failed_slots.append(slot)
            else:
                written.append((keys[i], slot, hdr.pack(keys[i])))
                written_items.append(i)
        if not self.index.commit(written, failed_slots):
            for i in written_items:
                ok[i] = False
        return ok

    def _recover_if_due(self) -> None:
        """Every ``recover_every_s``: give dead writers' claims back and drop dead readers' leases."""
        if self.recover_every_s is None or time.monotonic() - self._recovered_at < self.recover_every_s:
            return
        self._recovered_at = time.monotonic()
        try:
            self.index.recover_claims()
        except lmdb.Error as exc:
            self.faults.fault(self._source, f"recovering dead claims failed: {exc}")

    # ------------------------------------------------------------------ reading
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
        if self.readonly:
            raws, leases = self.index.headers(keys), []
        else:
            raws, leases = self.index.lease(keys)  # eviction skips leased records until we let go

        def one(i: int) -> None:
            if raws[i] is None:
                missing[i] = True
                return
            dst = out[i]
            staging = dst if dst.device.type == "cpu" else torch.empty(dst.shape, dtype=torch.uint8)
            verdict = self._read_one(keys[i], raws[i], staging)
            if verdict is True:
                if staging is not dst:
                    dst.copy_(staging)
                ok[i] = True
            elif verdict is False:
                corrupt[i] = True

        try:
            if n > 1 and self.read_threads > 1:  # several reads in flight: the medium works on a queue
                list(self._pool().map(one, range(n)))
            else:
                for i in range(n):
                    one(i)
        finally:
            if leases:
                self.index.unlease(leases, [k for k, good in zip(keys, ok) if good])
        return ok, corrupt, missing

    def open_ranges(self, keys: Sequence[bytes]) -> "RangeReads":
        """Lease ``keys``' records for reads by byte range (``RangeReads``); close the result when done. Needs a
        payload medium with ``read_range`` and ``verify`` (``SlotFile``: the disk tier; not the host pool's)."""
        self._check_open()
        if self.readonly:
            raws, leases = self.index.headers(keys), []
        else:
            raws, leases = self.index.lease(keys)
        return RangeReads(self, list(keys), raws, leases)

    def _read_one(self, key: bytes, raw: bytes, dst: torch.Tensor) -> bool | None:
        """Read ``key``'s record (header ``raw``) into ``dst``: True when verified, False when damaged (dropped),
        None for a record that is not ours to serve (another layout) or that another process removed meanwhile."""
        try:
            hdr = self.header(key, raw)
            if hdr is None:
                return None
            self.slots.read(hdr, dst)
            return True
        except (RecordError, OSError) as exc:
            return False if self._drop_damaged(key, raw, exc) else None

    def _drop_damaged(self, key: bytes, raw: bytes, exc: Exception) -> bool:
        """``key``'s record (header ``raw``) failed its checks: drop it and say True, or say False when another
        process deleted or replaced it meanwhile (a plain miss, not damage)."""
        if not self.index.still_same(key, raw):
            return False
        log.warning("%s: dropping damaged record %s: %s", self.where, key.hex()[:16], exc)
        self.index.drop_damaged(key, self.slots.slot_count())
        return True

    def header(self, key: bytes, raw: bytes) -> RecordHeader | None:
        """Parse ``key``'s stored header ``raw`` and check it fits this tier; None when it was written for another
        layout (not ours to serve, not damage either). Raises RecordError when it is damaged or does not fit."""
        hdr = RecordHeader.unpack(key, raw)
        if hdr.layout_fp != self.layout.fingerprint:
            return None
        if hdr.raw_len != self.block_nbytes or hdr.slot >= self.slots.slot_count():
            raise RecordError(f"record of {hdr.raw_len} bytes at slot {hdr.slot} does not fit this tier")
        return hdr

    def _pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.read_threads, thread_name_prefix="tkv-disk-read")
            return self._executor

    # ------------------------------------------------------------------ keys
    def delete(self, keys: Sequence[bytes]) -> None:
        """Delete records and return their slots to the free list (one txn).

        Idempotent: a key with no record is skipped, so a caller may send a DELETE for a key a
        read already dropped as corrupt (e.g. on the other TP ranks of a connector).
        """
        self._check_open()
        if not self.writer:
            return
        self.index.delete(keys)

    def has(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether the medium holds a record of each key for this namespace now (one read txn; no payload I/O)."""
        self._check_open()
        return self.index.has(keys)

    def stored_keys(self) -> list[bytes]:
        """Keys of this tier's namespace and layout (and key prefix, if set) on the medium, least recently
        used first. Another namespace's records are never listed."""
        keys, bad = self.index.owned_keys(self.layout.fingerprint)
        if self.key_prefix:
            keys = [k for k in keys if k.startswith(self.key_prefix)]
            bad = [k for k in bad if k.startswith(self.key_prefix)]
        if bad and not self.readonly:
            log.warning("%s: dropping %d records with damaged headers", self.where, len(bad))
            limit = self.slots.slot_count()
            for key in bad:
                self.index.drop_damaged(key, limit)
        self.dropped_at_open = len(bad) + self.orphans_dropped
        return keys

    def foreign_namespaces(self) -> set[bytes]:
        """Prefixes of the other namespaces registered on this medium (one read txn)."""
        if not self.index.accounted:
            return set()
        with self.index.env.begin() as txn:
            return {o for o in self.index.budget.spaces(txn) if o != self.owner}

    def usage(self) -> dict:
        """The medium's budget: mode, budget and per-namespace use (``DiskIndex.space_usage``)."""
        return self.index.space_usage()

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Close the read threads, the payload medium and the index (flushing first when syncing). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        try:
            if self.sync and not self.readonly:
                self.slots.flush()
        finally:
            try:
                self.slots.close()
            finally:
                self.index.close()


class RangeReads:
    """Records read by byte range, then verified whole (the in-step disk load's reads, layer group by group).

    ``headers[i]`` is record i's header, or None when there is nothing of ours to read (``missing[i]``: no record
    at all; else another layout's, or a compressed record, which cannot be read by range). ``read(i, start, end,
    image)`` may run on several threads at once for different ranges; ``verify(i, image)`` once every range of
    record i is in; ``close()`` once, after the reads: it lets go of the leases and drops the records found
    damaged (a bad header, a failed read, a checksum mismatch), as a whole-record read does.
    """

    def __init__(self, tier: IndexedTier, keys: list[bytes], raws: list[bytes | None], leases: list[bytes]) -> None:
        self.tier, self.keys, self._raws, self._leases = tier, keys, raws, leases
        self.missing = [raw is None for raw in raws]
        self.headers: list[RecordHeader | None] = []
        self._bad: dict[int, Exception] = {}  # damaged: dropped at close
        for i, raw in enumerate(raws):
            hdr = None
            if raw is not None:
                try:
                    hdr = tier.header(keys[i], raw)
                except RecordError as exc:
                    self._bad[i] = exc
                if hdr is not None and hdr.codec != CODEC_NONE:
                    hdr = None  # not damage: read whole by the next load that is not in-step
            self.headers.append(hdr)
        self._ok: set[int] = set()
        self._lock = threading.Lock()

    def read(self, i: int, start: int, end: int, image: torch.Tensor) -> bool:
        """Bytes ``[start, end)`` of record i into the same bytes of ``image``; False when it has no header of ours
        or the read fails (the record then counts as damaged)."""
        hdr = self.headers[i]
        if hdr is None or i in self._bad:
            return False
        try:
            self.tier.slots.read_range(hdr, start, end, image)
            return True
        except (RecordError, OSError) as exc:
            self._damaged(i, exc)
            return False

    def requests(self, i: int, ranges: Sequence[tuple[int, int]], image: torch.Tensor
                 ) -> list[tuple[int, int, int, int]] | None:
        """Record i's ranges as ``AioReader`` requests (``SlotFile.range_request``); ``[]`` when the record has
        nothing to read (``read`` would return False); None when a range cannot go by AIO (buffered file,
        unaligned image: read them with ``read_many``)."""
        hdr = self.headers[i]
        if hdr is None or i in self._bad:
            return []
        try:
            reqs = [self.tier.slots.range_request(hdr, a, b, image) for a, b in ranges]
        except RecordError as exc:
            self._damaged(i, exc)
            return []
        return None if any(r is None for r in reqs) else reqs

    def landed(self, i: int, result: int, nbytes: int) -> bool:
        """An AIO read of record i ended with ``result`` (bytes, or -errno) of ``nbytes`` asked: False, and the
        record counts as damaged, unless it read them all."""
        if result == nbytes:
            return True
        exc = OSError(-result, f"AIO read failed: {os.strerror(-result)}") if result < 0 else \
            OSError(f"short AIO read {result} of {nbytes}")
        self._damaged(i, exc)
        return False

    def _damaged(self, i: int, exc: Exception) -> None:
        """Record i counts as damaged from now on; the first cause is the one kept (any reader thread)."""
        with self._lock:
            self._bad.setdefault(i, exc)

    def read_many(self, i: int, ranges: Sequence[tuple[int, int]], image: torch.Tensor) -> bool:
        """``read`` of each range in turn; False at the first that fails."""
        return all(self.read(i, a, b, image) for a, b in ranges)

    def verify(self, i: int, image: torch.Tensor) -> bool:
        """Whether record i's ``image`` is the record its header describes (every range of it read)."""
        hdr = self.headers[i]
        if hdr is None or i in self._bad:
            return False
        if not self.tier.slots.verify(hdr, image):
            with self._lock:
                self._bad[i] = RecordError("payload checksum mismatch")
            return False
        with self._lock:
            self._ok.add(i)
        return True

    def corrupt(self, i: int) -> bool:
        """Record i was there and found damaged."""
        return i in self._bad

    def close(self) -> None:
        """Let go of the leases (the verified records count as read) and drop the damaged records."""
        try:
            for i, exc in self._bad.items():
                self.tier._drop_damaged(self.keys[i], self._raws[i], exc)
        finally:
            if self._leases:
                self.tier.index.unlease(self._leases, [self.keys[i] for i in sorted(self._ok)])
