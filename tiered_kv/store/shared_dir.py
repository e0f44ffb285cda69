"""The store's side of its disk directory, which other processes and namespaces may share.

The disk tier is *governed*: the directory keeps one budget and one eviction order for every process and
namespace on it, and the planner learns of evictions through ``Completion.evicted`` or a read that finds a
record gone. ``SharedDirectory`` keeps the planner and the directory agreeing on three things:

- another process of this namespace may have written keys since this store opened the directory:
  ``discover`` adopts the ones a lookup asks for (one read txn, no payload I/O);
- this process's own evictions: the directory asks ``keep(key)`` inside its claim txn before evicting a
  record; one the planner reads (or a promotion waits for) is kept, any other is forgotten by the planner
  first, so no read is planned against a record on its way out (``released`` when the txn ended);
- a key carrying another namespace's prefix (one registered in the directory) is refused
  (``check_namespace``); a record another namespace owns is a miss whatever its key.

Threading contract: any thread. Planner work happens under the store's lock; no path holds that lock while
waiting on LMDB (the directory calls ``keep`` and ``released`` from its claim txn, on a mover thread).
"""
from __future__ import annotations

import threading
from collections.abc import Callable

from tiered_kv.errors import InvalidInputError
from tiered_kv.planner.chain import TierChain
from tiered_kv.tiers.disk import DiskTier
from tiered_kv.values.jobs import TransferJob


class SharedDirectory:
    """The planner's view of the disk directory of tier ``tier`` (see the module); installs the disk tier's
    ``keep`` and ``released`` callbacks."""

    def __init__(self, disk: DiskTier, tier: int, chain: TierChain, lock: threading.RLock,
                 submit: Callable[[list[TransferJob]], None], prefix: bytes) -> None:
        self.disk, self.tier, self.chain = disk, tier, chain
        self._lock = lock
        self._submit = submit
        self._prefix = prefix  # this store's namespace prefix
        self._evicting: dict[bytes, int] = {}  # disk records an eviction of ours is deleting right now
        self._evict_epoch = 0  # changes whenever an eviction of ours starts or ends (see discover)
        disk.keep = self.keep
        disk.released = self.released

    def check_namespace(self, keys: list[bytes]) -> None:
        """Refuse keys carrying the prefix of another namespace registered in the disk directory."""
        own = self._prefix
        n = len(own)
        if all(k[:n] == own for k in keys):
            return
        foreign = self.disk.foreign_namespaces()
        for i, k in enumerate(keys):
            if k[:n] != own and k[:n] in foreign:
                raise InvalidInputError(f"keys[{i}] ({k.hex()[:16]}...) belongs to namespace {k[:n].hex()} of the "
                                        f"shared disk directory, not this store's ({own.hex()}); make keys with "
                                        f"store.key(...) or store.keys_for_tokens(...)")

    def keep(self, key: bytes) -> bool:
        """The directory is about to evict ``key``'s record: True keeps it (the planner has a read of it planned
        or running); else the planner forgets the copy now, so no read is planned against a record on its way
        out. Called by the disk tier inside its claim txn; no path holds this lock while waiting on LMDB."""
        t = self.tier
        with self._lock:
            e = self.chain.index.get(key)
            c = None if e is None else e.copies.get(t)
            if c is not None and (c.pins > 0 or c.wanted > 0):  # read, or waited for by a promotion
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
        """Adopt keys the planner does not know but the disk directory holds for this namespace (written by
        another process since this one opened it). One read txn, no payload I/O.

        An eviction of ours forgets its victim before its txn commits, so a read txn may still see a record
        on its way out: keys being evicted are skipped, and if an eviction started or ended while we looked,
        we look again (up to 3 times; a hint not adopted is only a miss)."""
        if not keys:
            return 0
        for _ in range(3):
            with self._lock:
                unknown = [k for k in keys if k not in self.chain.index and k not in self._evicting]
                epoch = self._evict_epoch
            if not unknown:
                return 0
            present = [k for k, held in zip(unknown, self.disk.has(unknown)) if held]
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
