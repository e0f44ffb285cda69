"""Shared-directory readers (MLA): pick up pages another process wrote to our disk tier.

For MLA models SGLang lets only one TP rank write L3, and every rank reads it. Each rank
runs its own ``TieredStore`` on the same disk directory, and a store's index knows only
the records it adopted at open or wrote itself. So when a reader rank misses, it looks
the missing keys up in the directory's LMDB index (one read transaction, no payload I/O,
no scan) and adopts the ones the writer has committed.

This is a WORKAROUND that reaches into ``TieredStore`` and ``DiskTier`` internals
(``store._lock``, ``store._submit``, ``store.chain``, ``disk.env``, ``disk.db_records``);
the requested core change is a public ``TieredStore.refresh(keys) -> int`` (see
docs/notes/sglang-core-requests.md). It is the only place in the adapter that does so.

Threading contract: safe from any thread; the LMDB probe runs outside the store's
planner lock, the adoption inside it.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..store import TieredStore
from ..tiers.disk import DiskTier


def adopt_committed(store: TieredStore, keys: Sequence[bytes]) -> int:
    """Adopt those of ``keys`` that the disk directory holds but this store's index does not. Returns how many."""
    disk_index = len(store.tiers) - 1
    disk = store.tiers[disk_index]
    if not isinstance(disk, DiskTier) or not keys:
        return 0
    with disk.env.begin(db=disk.db_records, buffers=True) as txn:
        present = [k for k in keys if txn.get(k) is not None]
    if not present:
        return 0
    with store._lock:
        fresh = [k for k in present if k not in store.chain.index]
        jobs = store.chain.adopt(disk_index, fresh)
    store._submit(jobs)
    return len(fresh)


def open_as_reader(store: TieredStore) -> None:
    """Make this store's disk tier read-only: a reader's evictions then only forget, never delete the writer's pages.

    Also a workaround (the disk tier's ``readonly`` flag is not a ``StoreConfig`` key yet).
    Damaged records are still removed when read, as on any rank.
    """
    disk = store.tiers[-1]
    if isinstance(disk, DiskTier):
        disk.readonly = True
