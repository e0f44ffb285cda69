"""RoomKeeper: the room in each tier, who waits for it, and how eviction makes more.

``TierChain`` routes requests and completions into jobs; whenever a copy needs room in a
tier, or a copy leaves one, it asks its ``RoomKeeper``. The keeper counts the room each
tier has in use, hands out slots of slab tiers, queues waiters when a tier is full, picks
victims through the tier's ``EvictionPolicy`` (demoting a victim one tier down, or dropping
it), and gives released room to the first waiter before putting it back in the pool.

The two share the ``BlockIndex``, the per-tier policies and the counters. The keeper calls
back into the chain for two things only: ``job`` to issue a one-block job no caller waits
on (a DEMOTE or a DELETE), and ``lost`` when a copy that never arrived is removed (the chain's
``CopyPlanner`` fails the prefetches that were following it).

Rules it keeps (DESIGN invariants 2, 5):
- an evicted block is copied down first; its source is freed only after the copy committed.
  A failed copy keeps the source when the tier below is a slab tier (GPU -> CPU); into a
  best-effort tier (``TierSpec.best_effort``: disk, remote) it drops the source, counted in
  ``demotions_dropped``: those tiers are a cache, and a block that cannot go down (a Redis node
  down, a disk full or failing) must never wedge the tier above and stop its puts;
- capacity is a hard limit: a full tier's waiters get room only as copies leave it, and a
  tier of capacity 0 refuses at once;
- only READY, unpinned copies that are not already leaving are evicted, and a copy that a
  waiting copy will read ("wanted") only when nothing else can be.

Threading contract: not thread-safe; the owning ``TierChain`` serializes every call.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from tiered_kv.errors import ConfigError
from tiered_kv.planner.counters import ChainCounters, TierCounters
from tiered_kv.planner.index import BlockIndex, Copy, CopyState
from tiered_kv.planner.policy import EvictionPolicy
from tiered_kv.values.jobs import NO_SLOT, JobKind, TransferJob

Jobs = list[TransferJob]


@dataclass(frozen=True)
class TierSpec:
    """What the planner needs to know of one tier: a name, a capacity in blocks, and who picks slots.

    ``slotted=True``: the planner hands out slot numbers ``0..capacity-1`` (GPU and CPU slabs).
    ``slotted=False``: the tier places records itself and is addressed by key (disk).
    ``governed=True`` (keyed tiers only): the medium keeps its own budget and evicts by itself (a disk
    directory shared by several processes, a Redis cluster). The planner then never counts room there,
    never waits for it and never picks victims; ``capacity`` is informative. Its copies are hints: the
    medium may drop one at any time, and says so through ``TierChain.forget`` or a read that finds the
    record missing. A governed tier may sit above others (a host pool shared by several processes, above
    a disk): every block that lands there is then copied one tier down at once (``TierChain``), since the
    medium's own evictions drop blocks rather than demote them.
    """

    name: str
    capacity: int
    slotted: bool = True
    governed: bool = False

    @property
    def best_effort(self) -> bool:
        """Whether copies into this tier may fail for reasons that last (a Redis node down, a disk full or failing):
        the keyed tiers, which sit below the slab tiers. A demotion into a best-effort tier that fails drops the
        block from the tier above (a miss from then on, counted) instead of keeping it there: otherwise blocks that
        cannot go down fill the tier above and every new put is refused while the medium below is sick."""
        return not self.slotted

    def __post_init__(self) -> None:
        if not isinstance(self.capacity, int) or self.capacity < 0:
            raise ConfigError(f"tier {self.name!r}: capacity must be an int >= 0 blocks, got {self.capacity!r}")
        if self.governed and self.slotted:
            raise ConfigError(f"tier {self.name!r}: a governed tier places its own records: use slotted=False")


@dataclass
class _Waiter:
    grant: Callable[[int], Jobs]
    refuse: Callable[[], Jobs]


class RoomKeeper:
    """Room accounting, waiters and eviction for every tier of one ``TierChain``.

    ``job(kind, src, dst, key, src_slot, dst_slot)`` issues a one-block job no caller waits
    on; ``lost(key, tier)`` is told when a copy that never arrived is removed.
    """

    def __init__(self, specs: Sequence[TierSpec], index: BlockIndex, policies: Sequence[EvictionPolicy],
                 tier_counters: Sequence[TierCounters], counters: ChainCounters,
                 job: Callable[[JobKind, int, int, bytes, int, int], TransferJob],
                 lost: Callable[[bytes, int], None]) -> None:
        self.specs = specs
        self.index = index
        self.policies = policies
        self.tier_counters = tier_counters
        self.counters = counters
        self._job = job
        self._lost = lost
        n = len(specs)
        self.used = [0] * n  # room taken per tier: copies in any state plus room granted to waiters
        self.leaving = [0] * n  # evictions under way per tier
        self.pins = 0  # sum of every copy's pins; whoever pins or unpins a copy keeps it in step
        # Slots of slab tiers: those given back (reused first, last in first out) and, below them, the ones never
        # handed out yet, ``_fresh[t]`` upward: the order a full list [capacity-1 .. 0] popped from the end gives,
        # without a list of every slot (a large CPU tier has ~10^5 slots; each young garbage collection walks them)
        self._free_slots: list[list[int]] = [[] for _ in specs]
        self._fresh = [0] * n
        self._waiters: list[deque[_Waiter]] = [deque() for _ in specs]
        self.events: list[tuple[bool, int, bytes]] | None = None  # TierChain.record_events

    def waiting(self) -> int:
        """Reservations waiting for room."""
        return sum(map(len, self._waiters))

    # ------------------------------------------------------------------ taking room
    def take(self, t: int) -> int | None:
        """One unit of room in ``t`` if there is some: its slot (``NO_SLOT`` for keyed tiers), else None."""
        if self.used[t] >= self.specs[t].capacity and not self.specs[t].governed:
            return None
        self.used[t] += 1
        if not self.specs[t].slotted:
            return NO_SLOT
        free = self._free_slots[t]
        if free:
            return free.pop()
        slot = self._fresh[t]
        self._fresh[t] = slot + 1
        return slot

    def take_run(self, t: int, n: int) -> list[int] | None:
        """``n`` (>= 1) units of room in ``t`` at once, as ``n`` ``take`` calls would give them, or None
        (nothing taken) if ``t`` lacks room for all of them. The bulk put path: no per-key calls."""
        spec = self.specs[t]
        if self.used[t] + n > spec.capacity and not spec.governed:
            return None
        self.used[t] += n
        if not spec.slotted:
            return [NO_SLOT] * n
        free = self._free_slots[t]
        k = min(n, len(free))
        if k:
            slots = free[:-k - 1:-1]  # what k pop()s would take, in that order
            del free[-k:]
            if k == n:
                return slots
        else:
            slots = []
        fresh = self._fresh[t]
        slots += range(fresh, fresh + n - k)
        self._fresh[t] = fresh + n - k
        return slots

    def reserve(self, t: int, grant: Callable[[int], Jobs], refuse: Callable[[], Jobs]) -> tuple[str, int, Jobs]:
        """Room for one block in tier ``t``: ("now", slot), ("wait", -1) with ``grant(slot)`` called later
        (or ``refuse()`` if a failed eviction gives up on it), or ("refused", -1) for a tier with no room
        at all. The jobs returned are the evictions started to make room.

        Waiting always ends: copies being written or read become evictable when their job
        completes, waiting promotions and copies hold no pins, and demotions only wait on
        lower tiers, the lowest of which evicts by dropping.
        """
        slot = self.take(t)
        if slot is not None:
            return "now", slot, []
        if self.specs[t].capacity == 0:  # (a governed tier always had room above)
            return "refused", NO_SLOT, []
        self._waiters[t].append(_Waiter(grant, refuse))
        return "wait", NO_SLOT, self._make_room(t)

    def occupy(self, t: int, n: int) -> Jobs:
        """``n`` blocks already on tier ``t``'s medium were indexed (adopted): count their room, and evict
        the oldest beyond capacity."""
        self.used[t] += n
        jobs: Jobs = []
        excess = self.used[t] - self.specs[t].capacity
        if excess > 0 and not self.specs[t].governed:
            for victim in self.policies[t].victims(excess, lambda k: True):
                jobs += self._evict(t, victim)
        return jobs

    # ------------------------------------------------------------------ making room
    def kick(self, t: int) -> Jobs:
        """Something in ``t`` may have become evictable: start evictions for waiters that have none yet."""
        if len(self._waiters[t]) > self.leaving[t]:
            return self._make_room(t)
        return []

    def _make_room(self, t: int) -> Jobs:
        """Start evictions in ``t`` until one is under way for each waiter (if the policy finds victims)."""
        jobs: Jobs = []
        need = len(self._waiters[t]) - self.leaving[t]
        if need <= 0:
            return jobs
        victims = self.policies[t].victims(need, lambda k: self._evictable(k, t, unwanted=True))
        if len(victims) < need:  # only sources of waiting copies are left: take them rather than stall
            chosen = set(victims)
            victims += self.policies[t].victims(need - len(victims),
                                                lambda k: k not in chosen and self._evictable(k, t))
        for key in victims:
            jobs += self._evict(t, key)
        return jobs

    def _evictable(self, key: bytes, t: int, unwanted: bool = False) -> bool:
        """READY, unpinned, not leaving or doomed (and with ``unwanted``: no waiting copy will read it)."""
        plain = self.index.plain(key)
        if plain is not None:  # a compact record: no pins, flags or readers waiting
            return plain[0] == t and plain[1] is CopyState.READY
        c = self.index.get(key).copies.get(t)
        return c is not None and c.state is CopyState.READY and c.pins == 0 and not c.leaving and not c.doomed \
            and not (unwanted and c.wanted > 0)

    def _evict(self, t: int, key: bytes) -> Jobs:
        """Start ``key``'s copy in ``t`` leaving: demote it one tier down, or drop it when a copy below or
        above makes that pointless (or ``t`` is the last tier)."""
        e = self.index.get(key)
        c = e.copies[t]
        c.leaving = True
        self.leaving[t] += 1
        self.policies[t].remove(key)
        self.tier_counters[t].evictions += 1
        lower = t + 1
        if lower >= len(self.specs) or lower in e.copies or any(u < t and d.readable for u, d in e.copies.items()):
            return self.drop(key, t)
        c.pins += 1  # the demotion reads it
        self.pins += 1
        self.index.add_copy(key, lower, Copy(CopyState.QUEUED, NO_SLOT))

        def grant(slot: int) -> Jobs:
            d = self.index.get(key).copies[lower]
            d.state, d.slot = CopyState.WRITING, slot
            return [self._job(JobKind.DEMOTE, t, lower, key, c.slot, slot)]

        def refuse() -> Jobs:  # no room below: the block leaves this tier without a copy below
            out = self.remove(key, lower)
            c.pins -= 1
            self.pins -= 1
            return out + self.drop(key, t)

        status, slot, jobs = self.reserve(lower, grant, refuse)
        if status == "now":
            jobs += grant(slot)
        elif status == "refused":
            jobs += refuse()
        return jobs

    def demote_done(self, key: bytes, src: int, ok: bool) -> Jobs:
        """A demotion out of ``src`` ended (its source already unpinned): free the source, or keep it.

        A failed demotion into a best-effort tier frees the source all the same (the block is lost to this
        store, a miss later, counted in ``demotions_dropped``); into a slab tier it keeps the source."""
        e = self.index.get(key)
        c = None if e is None else e.copies.get(src)
        if c is None:  # deleted while moving: the source was freed when its last reader let go
            return self.kick(src)
        if ok:
            return self.drop(key, src)
        if self.specs[src + 1].best_effort:  # a cache below: let the block go rather than wedge this tier
            self.tier_counters[src].demotions_dropped += 1
            return self.drop(key, src)
        c.leaving = False  # keep the source; try another victim for whoever waits
        self.leaving[src] -= 1
        if not c.doomed:
            self.policies[src].insert(key)
        return self._refuse_one(src) + self._make_room(src)

    def _refuse_one(self, t: int) -> Jobs:
        """A demotion out of ``t`` into a slab tier failed: refuse one waiter that counted on it (bounds retries on a
        bad medium)."""
        if len(self._waiters[t]) > self.leaving[t]:
            return self._waiters[t].pop().refuse()
        return []

    # ------------------------------------------------------------------ copies leaving
    def unpin(self, key: bytes, t: int) -> Jobs:
        """A reader of ``key``'s copy in ``t`` let go: free a doomed copy, or let waiters evict it."""
        c = self.index.get(key).copies[t]
        c.pins -= 1
        self.pins -= 1
        if c.pins == 0 and c.doomed:
            if c.deleting and not self.specs[t].slotted and c.state is CopyState.READY:
                return self._free(key, t)  # corrupt record: the tier already removed it
            return self.drop(key, t)
        if c.pins == 0 and not c.leaving:
            self.index.compact(key)  # a plain copy again (the usual end of a read): no tracked objects
            return self.kick(t)
        return []

    def unpin_all(self, keys: Iterable[bytes], t: int) -> Jobs:
        """``unpin`` every key of ``keys`` in ``t``, in order (a read of them ended)."""
        unpin = self.unpin
        jobs: Jobs = []
        for key in keys:
            jobs += unpin(key, t)
        return jobs

    def drop(self, key: bytes, t: int) -> Jobs:
        """Let ``key``'s copy in ``t`` go: now if unpinned, else when the last reader unpins."""
        c = self.index.get(key).copies[t]
        c.doomed = True
        if c.pins > 0 or c.deleting:
            return []
        if not self.specs[t].slotted and c.state is CopyState.READY:
            c.deleting = True
            return [self._job(JobKind.DELETE, t, t, key, NO_SLOT, NO_SLOT)]
        return self._free(key, t)

    def vanished(self, key: bytes, t: int, counted: bool = True) -> Jobs:
        """The medium of tier ``t`` dropped ``key``'s record by itself (a governed tier's own eviction, or
        another process): forget the copy without a DELETE job, now or when its last reader lets go.
        ``counted``: add it to the tier's ``vanished`` counter."""
        c = self.index.get(key).copies.get(t)
        if c is None or c.state is not CopyState.READY or c.leaving or c.deleting:
            return []  # still being written, or already on its way out: that job's completion decides
        self.tier_counters[t].vanished += counted
        c.doomed = True
        c.deleting = True  # nothing left on the medium to delete
        self.policies[t].remove(key)
        return self._free(key, t) if c.pins == 0 else []

    def source_gone(self, key: bytes, t: int, corrupt: bool, missing: bool) -> None:
        """A job that read ``key``'s copy in ``t`` found its record damaged or gone: forget it without a DELETE
        job (the caller unpins the copy once the job's destination is settled)."""
        if not (corrupt or missing):
            return
        c = self.index.get(key).copies[t]
        if corrupt:
            self.tier_counters[t].corrupt_dropped += 1
        else:
            self.tier_counters[t].vanished += 1
        c.deleting = True  # nothing left on the medium to delete
        c.doomed = True
        if not c.leaving:
            self.policies[t].remove(key)

    def delete_done(self, key: bytes, t: int) -> Jobs:
        """The DELETE job of ``key``'s record in keyed tier ``t`` ended: its room is free."""
        self.index.get(key).copies[t].deleting = False
        return self._free(key, t)

    def remove(self, key: bytes, t: int) -> Jobs:
        """Remove a copy that never became READY (or failed), releasing its room if it held any."""
        c = self.index.get(key).copies[t]
        held = c.state is not CopyState.QUEUED
        self._lost(key, t)
        self.policies[t].remove(key)
        if c.leaving:
            self.leaving[t] -= 1
        gone = self.index.remove_copy(key, t)
        if gone:
            self.counters.blocks_out += 1
        return self._release(t, c.slot) if held else []

    def _free(self, key: bytes, t: int) -> Jobs:
        """Forget ``key``'s copy in ``t`` (no reader left, nothing left to delete) and release its room."""
        c = self.index.get(key).copies[t]
        if c.leaving:
            self.leaving[t] -= 1
        if self.events is not None:
            self.events.append((False, t, key))
        self.policies[t].remove(key)
        self.tier_counters[t].blocks_out += 1
        if self.index.remove_copy(key, t):
            self.counters.blocks_out += 1
        return self._release(t, c.slot)

    def _release(self, t: int, slot: int) -> Jobs:
        """A unit of room in ``t`` is free: give it to the first waiter, else back to the pool."""
        if self._waiters[t]:
            w = self._waiters[t].popleft()
            return w.grant(slot)
        self.used[t] -= 1
        if self.specs[t].slotted:
            self._free_slots[t].append(slot)
        return []
