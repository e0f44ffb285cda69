"""Shared-directory readers (MLA): pick up records another process wrote to our disk tier.

For MLA models SGLang lets only one TP rank write L3, and every rank reads it. Each rank
runs its own ``TieredStore`` on the same disk directory, and a store's index knows only
the records it adopted at open or wrote itself. A reader rank therefore re-adopts the
directory's records when it misses (throttled by the caller).

This is a WORKAROUND that reaches into ``TieredStore`` internals (``chain``, ``_lock``,
``_submit``); the requested core change is a public ``TieredStore.refresh() -> int``
(see docs/notes/sglang-core-requests.md). It is the only place that does so.

Threading contract: safe from any thread; holds the store's planner lock only for the
in-memory adoption, not for the directory scan.
"""
from __future__ import annotations

from ..store import TieredStore
from ..tiers.disk import DiskTier


def adopt_new_records(store: TieredStore) -> int:
    """Register records in the store's disk tier that its index does not know yet. Returns how many."""
    disk_index = len(store.tiers) - 1
    disk = store.tiers[disk_index]
    if not isinstance(disk, DiskTier):
        return 0
    keys = disk.stored_keys()  # one LMDB cursor pass over headers, outside the planner lock
    with store._lock:
        fresh = [k for k in keys if k not in store.chain.index]
        jobs = store.chain.adopt(disk_index, fresh)
    store._submit(jobs)
    return len(fresh)
