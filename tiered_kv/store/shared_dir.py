"""The store's side of a shared medium: a disk directory or a host pool that other processes and namespaces use.

Both are ``IndexedTier``s and *governed*: the medium keeps one budget and one eviction order for every process
and namespace on it, and the planner learns of evictions through ``Completion.evicted`` or a read that finds a
record gone. ``SharedMedium`` keeps the planner and one such medium agreeing:

- at open, the store adopts the blocks the medium holds for its namespace (``join``);
- another process of this namespace may have written keys since: ``discover`` adopts the ones a lookup asks
  for (one read txn, no payload I/O);
- this process's own evictions: the medium asks ``keep(key)`` inside its claim txn before evicting a record;
  one the planner reads, a promotion or copy waits for, or whose write the planner has not seen complete yet
  (its copy down is still to be planned) is kept; any other is forgotten by the planner first, so no read is
  planned against a record on its way out (``released`` when the txn ended);
- a key carrying another namespace's prefix (one registered in the medium) is refused (``check_namespace``);
  a record another namespace owns is a miss whatever its key.

Threading contract: any thread. Planner work happens under the store's lock; no path holds that lock while
waiting on LMDB (the medium calls ``keep`` and ``released`` from its claim txn, on a mover thread).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from tiered_kv.errors import InvalidInputError
from tiered_kv.planner.chain import TierChain
from tiered_kv.planner.index import CopyState
from tiered_kv.tiers.disk.indexed import IndexedTier
from tiered_kv.values.jobs import TransferJob

log = logging.getLogger(__name__)


class SharedMedium:
    """The planner's view of the shared medium of tier ``tier`` (see the module); installs the tier's ``keep`` and
    ``released`` callbacks."""

    def __init__(self, medium: IndexedTier, tier: int, chain: TierChain, lock: threading.RLock,
                 submit: Callable[[list[TransferJob]], None], prefix: bytes) -> None:
        self.medium, self.tier, self.chain = medium, tier, chain
        self._lock = lock
        self._submit = submit
        self._prefix = prefix  # this store's namespace prefix
        self._evicting: dict[bytes, int] = {}  # records an eviction of ours is deleting right now
        self._evict_epoch = 0  # changes whenever an eviction of ours starts or ends (see discover)
        medium.keep = self.keep
        medium.released = self.released

    def join(self) -> None:
        """Adopt the blocks the medium holds for this namespace (written by an earlier run or another process)."""
        medium, t = self.medium, self.tier
        keys = medium.stored_keys()
        with self._lock:
            jobs = self.chain.adopt(t, keys)
            self.chain.tier_counters[t].corrupt_dropped += medium.dropped_at_open
        self._submit(jobs)
        if keys:
            log.info("tiered_kv: %s holds %d blocks of this namespace", medium.where, len(keys))

    def check_namespace(self, keys: list[bytes]) -> None:
        """Refuse keys carrying the prefix of another namespace registered in the medium."""
        own = self._prefix
        n = len(own)
        if all(k[:n] == own for k in keys):
            return
        foreign = self.medium.foreign_namespaces()
        for i, k in enumerate(keys):
            if k[:n] != own and k[:n] in foreign:
                raise InvalidInputError(f"keys[{i}] ({k.hex()[:16]}...) belongs to namespace {k[:n].hex()} of the "
                                        f"{self.medium.where}, not this store's ({own.hex()}); make keys with "
                                        f"store.key(...) or store.keys_for_tokens(...)")

    def keep(self, key: bytes) -> bool:
        """The medium is about to evict ``key``'s record: True keeps it (the planner has a read of it planned or
        running); else the planner forgets the copy now, so no read is planned against a record on its way out.
        Called by the tier inside its claim txn; no path holds this lock while waiting on LMDB."""
        t = self.tier
        with self._lock:
            e = self.chain.index.get(key)
            c = None if e is None else e.copies.get(t)
            # read, waited for by a promotion or a copy down, or landed with its completion not applied yet (the
            # planner then copies it down before anything may evict it: a governed medium demotes nothing)
            if c is not None and (c.pins > 0 or c.wanted > 0 or c.state is not CopyState.READY):
                return True
            jobs = self.chain.forget(t, [key]) if c is not None else []
            self._evicting[key] = self._evicting.get(key, 0) + 1
            self._evict_epoch += 1
        self._submit(jobs)
        return False

    def released(self, keys: list[bytes]) -> None:
        """The claim txn that evicted ``keys`` ended: their records are gone (or, if it failed, still there)."""
        with self._lock:
            for k in keys:
                n = self._evicting.get(k, 0) - 1
                if n > 0:
                    self._evicting[k] = n
                else:
                    self._evicting.pop(k, None)
            self._evict_epoch += 1

    def discover(self, keys: list[bytes]) -> int:
        """Adopt keys the planner does not know but the medium holds for this namespace (written by another process
        since this one opened it). One read txn, no payload I/O.

        An eviction of ours forgets its victim before its txn commits, so a read txn may still see a record on its
        way out: keys being evicted are skipped, and if an eviction started or ended while we looked, we look again
        (up to 3 times; a hint not adopted is only a miss)."""
        if not keys:
            return 0
        for _ in range(3):
            with self._lock:
                unknown = [k for k in keys if k not in self.chain.index and k not in self._evicting]
                epoch = self._evict_epoch
            if not unknown:
                return 0
            present = [k for k, held in zip(unknown, self.medium.has(unknown)) if held]
            if not present:
                return 0
            with self._lock:
                if self._evict_epoch != epoch:
                    continue
                fresh = [k for k in present if k not in self.chain.index]
                jobs = self.chain.adopt(self.tier, fresh)
            self._submit(jobs)
            return len(fresh)
        return 0
