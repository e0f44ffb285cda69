"""CopyPlanner: the ``TierChain``'s copies that keep their source, one hop at a time.

- promotions: a prefetch moves a block up toward its target tier one hop at a time (``prefetch_step``);
  a hit may promote its block one tier up (``promote``); a prefetch that finds a copy already on its way
  up follows it (``followers``) instead of asking for a second one;
- copies down: write-through copies of a new block to the tier below (``copy_down``) and straight to the
  ``PlacementPolicy.copy_to`` tiers (``copy_to``).

Each copy reserves room in its destination through the ``RoomKeeper`` (waiting while the tier is full);
its source is pinned only once the room is granted, and marked ``wanted`` until then, so an eviction
takes it only when nothing else can go. A copy whose source left meanwhile gives the room back.

Threading contract: not thread-safe; the owning ``TierChain`` serializes every call.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from tiered_kv.planner.index import BlockIndex, Copy, CopyState
from tiered_kv.planner.policy import EvictionPolicy
from tiered_kv.planner.room import RoomKeeper
from tiered_kv.values.jobs import NO_SLOT, JobKind, TransferJob

Jobs = list[TransferJob]
#: ``TierChain._job``: (kind, src, dst, keys, src_slots, dst_slots, handle, per-item context) -> an in-flight job
MakeJob = Callable[[JobKind, int, int, list[bytes], Sequence[int], list[int], int, list], TransferJob]


class CopyPlanner:
    """Promotions, prefetch hops and copies down (see the module); ``followers`` are prefetches waiting on a
    copy in flight, by ``(key, tier)``."""

    def __init__(self, index: BlockIndex, policies: list[EvictionPolicy], room: RoomKeeper, num_tiers: int,
                 copy_to: Sequence[int], job: MakeJob, item_done: Callable[[int, int, bool], None]) -> None:
        self.index = index
        self.policies = policies
        self.room = room
        self.num_tiers = num_tiers
        self.copy_to_tiers = tuple(copy_to)
        self._job = job
        self._item_done = item_done
        self.followers: dict[tuple[bytes, int], list] = {}  # prefetches waiting on a copy in flight

    def prefetch_step(self, key: bytes, ctx: tuple[int, int, int], src: int | None = None) -> Jobs:
        """Move ``key`` one hop toward ``ctx``'s target tier (from ``src``, default its fastest copy), or finish."""
        handle, item, target = ctx
        e = self.index.get(key)
        if src is None:
            src = None if e is None else e.best()
        if src is not None and src <= target:
            if src == target:  # already there: the reader comes for it with the rest, keep it past one-time blocks
                self.policies[src].access(key)
            self._item_done(handle, item, True)
            return []
        c = None if (e is None or src is None) else e.copies.get(src)
        if c is None or not c.readable:  # gone meanwhile
            self._item_done(handle, item, False)
            return []
        above = e.copies.get(src - 1)
        if above is not None:
            if above.readable:
                return self.prefetch_step(key, ctx, src - 1)
            if above.state is not CopyState.READY:  # a copy up is on its way: follow it
                self.followers.setdefault((key, src - 1), []).append(ctx)
                return []
            self._item_done(handle, item, False)  # the copy above is leaving: give up
            return []
        return self.promote(key, src, src - 1, ctx)

    def abandon_followers(self, key: bytes, t: int) -> None:
        """``key``'s copy in ``t`` will not arrive: fail the prefetches that waited for it."""
        for follower in self.followers.pop((key, t), ()):
            self._item_done(follower[0], follower[1], False)

    def copy_down(self, key: bytes, t: int) -> Jobs:
        """A write-through copy of ``key``'s copy in ``t`` to the tier below, unless it has one (or is leaving)."""
        lower = t + 1
        e = self.index.get(key)
        # The copy may already be gone or leaving: a waiter's eviction can take it the moment it lands
        # (its demotion then writes it below, so a write-through copy has nothing left to do).
        c = None if e is None else e.copies.get(t)
        if lower >= self.num_tiers or c is None or lower in e.copies or not c.readable or c.leaving:
            return []
        return self._copy(key, t, lower, JobKind.COPY_DOWN, None)

    def copy_to(self, key: bytes, t: int) -> Jobs:
        """Write-through copies of a new block in ``t`` straight to each ``placement.copy_to`` tier lacking one."""
        jobs: Jobs = []
        for lower in self.copy_to_tiers:
            e = self.index.get(key)
            c = None if e is None else e.copies.get(t)
            if c is None or lower in e.copies or not c.readable:
                continue
            jobs += self._copy(key, t, lower, JobKind.COPY_DOWN, None)
        return jobs

    def promote(self, key: bytes, src: int, dst: int, ctx) -> Jobs:
        """Copy ``key`` up from ``src`` to ``dst`` (``ctx``: the prefetch item it serves, or None)."""
        return self._copy(key, src, dst, JobKind.PROMOTE, ctx)

    def _copy(self, key: bytes, src: int, dst: int, kind: JobKind, ctx) -> Jobs:
        """Copy ``key`` from ``src`` to ``dst`` keeping the source; the source is pinned only once room is granted."""
        self.index.add_copy(key, dst, Copy(CopyState.QUEUED, NO_SLOT))
        self.index.get(key).copies[src].wanted += 1

        def unwant() -> Copy | None:
            c = self.index.get(key).copies.get(src)
            if c is not None:
                c.wanted -= 1
            return c

        def grant(slot: int) -> Jobs:
            e = self.index.get(key)
            d = e.copies[dst]
            d.state, d.slot = CopyState.WRITING, slot
            c = unwant()
            if c is None or not c.readable:  # the source left while we waited: give the room back
                if ctx is not None:
                    self._item_done(ctx[0], ctx[1], False)
                return self.room.remove(key, dst)
            c.pins += 1
            self.room.pins += 1
            return [self._job(kind, src, dst, [key], [c.slot], [slot], 0, [ctx])]

        def refuse() -> Jobs:
            unwant()
            if ctx is not None:
                self._item_done(ctx[0], ctx[1], False)
            return self.room.remove(key, dst)

        status, slot, jobs = self.room.reserve(dst, grant, refuse)
        if status == "now":
            jobs += grant(slot)
        elif status == "refused":
            jobs += refuse()
        return jobs
