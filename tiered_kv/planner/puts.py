"""PutPlanner: one caller item into one tier, now, later, or not at all (``TierChain.put``'s per-key path).

``TierChain.put`` handles the common case itself (every key new, room for all: one job) and duplicates;
a key it must place alone comes here: it is written at once when the tier has a free slot (collected into
one batch job per put), waits for room an eviction makes (a one-key job when room is granted), or is
refused (counted; the caller's item fails). A put a governed tier refused (full of blocks other processes
read) lands in the tier below instead (``spill``).

Threading contract: not thread-safe; the owning ``TierChain`` serializes every call.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from tiered_kv.planner.counters import ChainCounters, TierCounters
from tiered_kv.planner.index import BlockIndex, Copy, CopyState
from tiered_kv.planner.room import RoomKeeper
from tiered_kv.values.jobs import EXT, NO_SLOT, JobKind, TransferJob

Jobs = list[TransferJob]
#: ``(item, key, slot)`` of the keys a put writes at once, into one job
Batch = list[tuple[int, bytes, int]]


class PutPlanner:
    """Places single put items in a tier (see the module). ``job`` makes a job the chain tracks; ``item_done``
    reports a caller item's outcome to its handle."""

    def __init__(self, index: BlockIndex, room: RoomKeeper, counters: ChainCounters,
                 tier_counters: Sequence[TierCounters], job: Callable[..., TransferJob],
                 item_done: Callable[[int, int, bool], None]) -> None:
        self.index, self.room = index, room
        self.counters, self.tier_counters = counters, tier_counters
        self._job, self._item_done = job, item_done

    def one(self, key: bytes, i: int, handle: int, t: int, batch: Batch) -> Jobs:
        """Plan writing caller item ``i`` as ``key`` (held nowhere) into tier ``t``: into ``batch`` when ``t`` has room
        now, else wait for room (the jobs returned are the evictions that make it) or refuse."""
        room = self.room
        self.counters.blocks_in += 1
        slot = room.take(t)
        if slot is not None:  # room now: the common case, no closures
            self.index.add_new(key, t, slot, CopyState.WRITING)
            batch.append((i, key, slot))
            return []
        self.index.add_copy(key, t, Copy(CopyState.QUEUED, NO_SLOT))

        def grant(slot: int) -> Jobs:
            c = self.index.get(key).copies[t]
            c.state, c.slot = CopyState.WRITING, slot
            return [self._job(JobKind.INGRESS, EXT, t, [key], [i], [slot], handle, [(handle, i)])]

        def refuse() -> Jobs:
            out = room.remove(key, t)
            self.refuse(handle, i, t)
            return out

        status, _, jobs = room.reserve(t, grant, refuse)  # no room now: wait, or refused
        if status == "refused":
            jobs += refuse()
        return jobs

    def ingress(self, t: int, handle: int, batch: Batch) -> Jobs:
        """One INGRESS job into ``t`` for the ``(item, key, slot)`` of ``batch`` (none when it is empty)."""
        if not batch:
            return []
        return [self._job(JobKind.INGRESS, EXT, t, [k for _, k, _ in batch], [i for i, _, _ in batch],
                          [s for _, _, s in batch], handle, [(handle, i) for i, _, _ in batch])]

    def spill(self, key: bytes, item: int, handle: int, t: int) -> Jobs:
        """A governed tier refused caller item ``item`` (full of blocks other processes read, or of ours on their way
        down): the put lands in tier ``t`` below it instead, as a put there would."""
        batch: Batch = []
        jobs = self.one(key, item, handle, t, batch)
        return jobs + self.ingress(t, handle, batch)

    def refuse(self, handle: int, item: int, tier: int) -> None:
        """Caller item ``item`` could not be placed in ``tier``: count it and fail the item."""
        self.counters.puts_refused += 1
        self.tier_counters[tier].refused += 1
        self._item_done(handle, item, False)
