"""TierChain: the planner. Decides what moves where; never touches bytes.

``TierChain`` keeps the ``BlockIndex``, one ``EvictionPolicy`` per tier, slot
allocation for slab tiers and capacity counts for keyed tiers. Each call returns the
``TransferJob``s to run; ``complete()`` applies a ``Completion`` and returns the jobs it
unblocked. Results of caller requests (put/get/prefetch) are collected per handle id and
drained with ``take_finished()``.

Rules it keeps (DESIGN invariants 1, 2, 5):
- a copy is served only when READY; a key being written reads as a miss;
- an evicted block is copied down first and its source freed only after the copy
  committed; a failed copy frees the destination and keeps the source;
- capacity is a hard limit: a put that finds a full tier evicts by policy, waits for the
  eviction to commit, and is refused (False) if nothing can be evicted.

Tiers are numbered 0 (fastest) .. n-1. ``EXT`` (-1) is the caller's side of a job.

Threading contract: not thread-safe. One owner serializes every call (``TieredStore``
under its lock; the vLLM scheduler thread in the connector).
"""
from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tiered_kv.errors import ConfigError, InvalidInputError
from tiered_kv.planner.index import BlockIndex, Copy, CopyState
from tiered_kv.planner.policy import EvictionPolicy, PlacementPolicy, make_policy
from tiered_kv.values.jobs import EXT, NO_SLOT, Completion, JobKind, TransferJob

Jobs = list[TransferJob]


@dataclass(frozen=True)
class TierSpec:
    """What the planner needs to know of one tier: a name, a capacity in blocks, and who picks slots.

    ``slotted=True``: the planner hands out slot numbers ``0..capacity-1`` (GPU and CPU slabs).
    ``slotted=False``: the tier places records itself and is addressed by key (disk).
    """

    name: str
    capacity: int
    slotted: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.capacity, int) or self.capacity < 0:
            raise ConfigError(f"tier {self.name!r}: capacity must be an int >= 0 blocks, got {self.capacity!r}")


@dataclass
class TierCounters:
    """Per-tier counters (all monotonic except ``resident``)."""

    hits: int = 0
    blocks_in: int = 0
    blocks_out: int = 0
    evictions: int = 0
    failed_transfers: int = 0
    corrupt_dropped: int = 0
    vanished: int = 0
    refused: int = 0


@dataclass
class ChainCounters:
    """Store-level counters: lookups = hits + misses; blocks_in = blocks_out + resident."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    blocks_in: int = 0
    blocks_out: int = 0
    puts_refused: int = 0
    puts_deduplicated: int = 0


@dataclass
class _Handle:
    kind: str
    n: int
    pending: int
    ok: list[bool] = field(default_factory=list)
    hits: int = 0


@dataclass
class _Waiter:
    grant: Callable[[int], Jobs]
    refuse: Callable[[], Jobs]


class _HandleItems:
    """The ``ctx`` of a job whose item ``i`` is item ``i`` of one handle: ``(handle, i)`` on demand.

    The bulk put path's jobs use it instead of a list of n tuples: fewer objects for Python's
    garbage collector to count on vLLM's scheduler thread.
    """

    __slots__ = ("handle",)

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __getitem__(self, i: int) -> tuple[int, int]:
        return (self.handle, i)


class TierChain:
    """The planner over an ordered list of tiers."""

    def __init__(self, specs: Sequence[TierSpec], eviction: str = "lru",
                 placement: PlacementPolicy | None = None) -> None:
        if not specs:
            raise ConfigError("a tier chain needs at least one tier")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ConfigError(f"tier names must be unique, got {names}")
        self.specs = list(specs)
        self.placement = placement or PlacementPolicy()
        if self.placement.put_tier >= len(specs):
            raise ConfigError(f"put_tier={self.placement.put_tier} but the chain has only {len(specs)} tiers {names}")
        n = len(specs)
        self.index = BlockIndex(n)
        self.policies: list[EvictionPolicy] = [make_policy(eviction) for _ in specs]
        self.used = [0] * n
        self.leaving = [0] * n
        self._free_slots: list[list[int]] = [list(range(s.capacity - 1, -1, -1)) if s.slotted else [] for s in specs]
        self._waiters: list[deque[_Waiter]] = [deque() for _ in specs]
        self._jobs: dict[int, tuple[TransferJob, list]] = {}
        self._job_ids = itertools.count(1)
        self._handles: dict[int, _Handle] = {}
        self._finished: list[tuple[int, object]] = []
        self.tier_counters = [TierCounters() for _ in specs]
        self._pins = 0  # sum of every copy's pins, kept in step with them
        self._followers: dict[tuple[bytes, int], list] = {}  # prefetches waiting on a copy in flight
        self.counters = ChainCounters()

    # ------------------------------------------------------------------ queries
    @property
    def num_tiers(self) -> int:
        """Number of tiers."""
        return len(self.specs)

    def tier_index(self, name_or_index: str | int) -> int:
        """Index of a tier given its name or index; raises InvalidInputError if unknown."""
        if isinstance(name_or_index, int) and not isinstance(name_or_index, bool):
            if 0 <= name_or_index < len(self.specs):
                return name_or_index
        else:
            for i, s in enumerate(self.specs):
                if s.name == name_or_index:
                    return i
        raise InvalidInputError(f"unknown tier {name_or_index!r}; tiers: {[s.name for s in self.specs]}")

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Number of leading keys with a readable copy in some tier."""
        n = 0
        for key in keys:
            e = self.index.get(key)
            if e is None or e.best() is None:
                break
            n += 1
        return n

    def locate(self, keys: Sequence[bytes]) -> list[int | None]:
        """Fastest tier holding a readable copy of each key (None if none)."""
        out: list[int | None] = []
        for key in keys:
            e = self.index.get(key)
            out.append(None if e is None else e.best())
        return out

    def job(self, job_id: int) -> TransferJob | None:
        """The in-flight job with this id, or None once it completed."""
        entry = self._jobs.get(job_id)
        return None if entry is None else entry[0]

    def inflight(self) -> int:
        """Jobs issued and not yet completed."""
        return len(self._jobs)

    def pinned(self) -> int:
        """Copies pinned by running readers."""
        return self._pins

    def waiting(self) -> int:
        """Reservations waiting for room."""
        return sum(len(w) for w in self._waiters)

    def resident(self, tier: int) -> int:
        """Copies (any state) in ``tier``."""
        return self.index.copies_per_tier[tier]

    def take_finished(self) -> list[tuple[int, object]]:
        """Drain results of finished handles: ``(handle_id, result)`` pairs.

        put -> list[bool] (accepted per key); get -> int (leading blocks delivered);
        prefetch -> int (leading blocks now at the target tier or faster).
        """
        out, self._finished = self._finished, []
        return out

    # ------------------------------------------------------------------ requests
    def put(self, keys: Sequence[bytes], handle: int) -> Jobs:
        """Plan storing ``keys`` from the caller's buffer (item i = buffer index i) into the put tier."""
        t = self.placement.put_tier
        n = len(keys)
        h = self._open(handle, "put", n)
        if n and self.used[t] + n <= self.specs[t].capacity and self.index.holds_none_of(keys) \
                and len(set(keys)) == n:
            # the common case (new prompt blocks, room for all): one job, no per-key calls
            self.counters.blocks_in += n
            self.used[t] += n
            if self.specs[t].slotted:
                free = self._free_slots[t]
                slots = free[:-n - 1:-1]  # what n pop()s would take, in that order
                del free[-n:]
            else:
                slots = [NO_SLOT] * n
            self.index.add_new_many(keys, t, slots, CopyState.WRITING)
            items = list(range(n))
            return [self._job(JobKind.INGRESS, EXT, t, list(keys), items, slots, handle, _HandleItems(handle))]
        jobs: Jobs = []
        batch: list[tuple[int, bytes, int]] = []  # (item, key, slot) ready to write now
        for i, key in enumerate(keys):
            e = self.index.get(key)
            if e is not None and any(not c.doomed for c in e.copies.values()):
                self.counters.puts_deduplicated += 1
                for u, c in e.copies.items():
                    if c.state is CopyState.READY:
                        self.policies[u].access(key)
                self._item_done(handle, i, True)
                continue
            if e is not None:  # only doomed copies remain: let them go first
                self._refuse_put(handle, i, t)
                continue
            self.counters.blocks_in += 1
            slot = self._take_room(t)
            if slot is not None:  # room now: the common case, no closures
                self.index.add_new(key, t, Copy(CopyState.WRITING, slot))
                batch.append((i, key, slot))
                continue
            self.index.add_copy(key, t, Copy(CopyState.QUEUED, NO_SLOT))

            def grant(slot: int, key=key, i=i) -> Jobs:
                c = self.index.get(key).copies[t]
                c.state, c.slot = CopyState.WRITING, slot
                return [self._job(JobKind.INGRESS, EXT, t, [key], [i], [slot], handle, [(handle, i)])]

            def refuse(key=key, i=i) -> Jobs:
                out = self._remove(key, t)
                self._refuse_put(handle, i, t)
                return out

            status, _, more = self._reserve(t, grant, refuse)  # no room now: wait, or refused
            jobs += more
            if status == "refused":
                jobs += refuse()
        if batch:
            jobs.append(self._job(JobKind.INGRESS, EXT, t, [k for _, k, _ in batch], [i for i, _, _ in batch],
                                  [s for _, _, s in batch], handle, [(handle, i) for i, _, _ in batch]))
        self._maybe_finish(handle, h)
        return jobs

    def get(self, keys: Sequence[bytes], handle: int) -> tuple[int, Jobs]:
        """Plan reading the leading run of held keys into the caller's buffer (item i -> index i)."""
        n = self.lookup(keys)
        self.counters.lookups += len(keys)
        self.counters.hits += n
        self.counters.misses += len(keys) - n
        h = self._open(handle, "get", n)
        by_tier: dict[int, list[tuple[int, bytes, int]]] = {}
        jobs: Jobs = []
        for i, key in enumerate(keys[:n]):
            e = self.index.get(key)
            t = e.best()
            c = e.copies[t]
            c.pins += 1
            self._pins += 1
            self.policies[t].access(key)
            self.tier_counters[t].hits += 1
            by_tier.setdefault(t, []).append((i, key, c.slot))
        # promote only after every hit is pinned, so a promotion's eviction cannot take a block we read
        if self.placement.promote_on_hit:
            for t, items in by_tier.items():
                for _, key, _ in items:
                    e = self.index.get(key)
                    if t > 0 and (t - 1) not in e.copies and e.copies[t].readable:
                        jobs += self._promote(key, t, t - 1, None)
        for t, items in sorted(by_tier.items()):
            jobs.append(self._job(JobKind.EGRESS, t, EXT, [k for _, k, _ in items], [s for _, _, s in items],
                                  [i for i, _, _ in items], handle, [(handle, i) for i, _, _ in items]))
        self._maybe_finish(handle, h)
        return n, jobs

    def prefetch(self, keys: Sequence[bytes], to: int, handle: int) -> tuple[int, Jobs]:
        """Plan moving the leading run of held keys up to tier ``to`` (one hop at a time)."""
        n = self.lookup(keys)
        h = self._open(handle, "prefetch", n)
        jobs: Jobs = []
        for i, key in enumerate(keys[:n]):
            jobs += self._prefetch_step(key, (handle, i, to))
        self._maybe_finish(handle, h)
        return n, jobs

    def delete(self, keys: Sequence[bytes]) -> Jobs:
        """Drop every copy of ``keys`` (copies being read or written go once their job ends)."""
        jobs: Jobs = []
        for key in keys:
            e = self.index.get(key)
            if e is None:
                continue
            e.deleted = True
            for t in list(e.copies):
                c = e.copies.get(t)
                if c is None or c.state is not CopyState.READY:
                    continue
                if not c.leaving:
                    self.policies[t].remove(key)
                jobs += self._drop(key, t)
        return jobs

    def adopt(self, tier: int, keys: Sequence[bytes]) -> Jobs:
        """Register blocks a tier already holds (a reopened disk tier). Extra blocks beyond capacity are evicted."""
        jobs: Jobs = []
        for key in keys:
            if key in self.index:
                continue
            self.counters.blocks_in += 1
            self.index.add_copy(key, tier, Copy(CopyState.READY, NO_SLOT))
            self.used[tier] += 1
            self.policies[tier].insert(key)
        excess = self.used[tier] - self.specs[tier].capacity
        if excess > 0:
            for victim in self.policies[tier].victims(excess, lambda k: True):
                jobs += self._evict(tier, victim)
        return jobs

    # ------------------------------------------------------------------ completions
    def complete(self, done: Completion) -> Jobs:
        """Apply a job's completion; returns the jobs it unblocked."""
        job, ctx = self._jobs.pop(done.job_id)
        jobs: Jobs = []
        for i, key in enumerate(job.keys):
            ok = bool(done.ok[i]) if i < len(done.ok) else False
            bad = bool(done.corrupt[i]) if i < len(done.corrupt) else False
            gone = bool(done.missing[i]) if i < len(done.missing) else False
            jobs += self._complete_item(job, key, ok, bad, ctx[i], gone and not ok)
        return jobs

    def _complete_item(self, job: TransferJob, key: bytes, ok: bool, corrupt: bool, ctx, missing: bool = False) -> Jobs:
        kind, src, dst = job.kind, job.src_tier, job.dst_tier
        jobs: Jobs = []
        if kind is JobKind.DELETE:
            c = self.index.get(key).copies[src]
            c.deleting = False
            return self._free(key, src)
        if src != EXT:
            jobs += self._source_done(key, src, corrupt, missing and not self.specs[src].slotted)
            if corrupt:
                ok = False
        if not ok:
            self.tier_counters[dst if dst != EXT else src].failed_transfers += 0 if (corrupt or missing) else 1
        if kind is JobKind.EGRESS:
            hid, item = ctx
            self._item_done(hid, item, ok)
            return jobs
        # a tier-side destination copy
        e = self.index.get(key)
        c = e.copies[dst]
        if ok:
            c.state = CopyState.READY
            self.tier_counters[dst].blocks_in += 1
            self.policies[dst].insert(key)
            if c.doomed or e.deleted:
                self.policies[dst].remove(key)
                jobs += self._drop(key, dst)
            jobs += self._kick(dst)
        else:
            jobs += self._remove(key, dst)
        if ok:
            for follower in self._followers.pop((key, dst), ()):
                jobs += self._prefetch_step(key, follower, dst)
        if kind is JobKind.INGRESS:
            hid, item = ctx
            self._item_done(hid, item, ok)
            if ok and self.placement.write_policy == "write_through":
                jobs += self._copy_down(key, dst)
        elif kind is JobKind.COPY_DOWN:
            if ok:
                jobs += self._copy_down(key, dst)
        elif kind is JobKind.DEMOTE:
            jobs += self._demote_done(key, src, ok)
        elif kind is JobKind.PROMOTE:
            if ctx is not None:
                if ok:  # one hop done; the copy counts as arrived even if evicted right after
                    jobs += self._prefetch_step(key, ctx, dst)
                else:
                    self._item_done(ctx[0], ctx[1], False)
        return jobs

    # ------------------------------------------------------------------ internals
    def _open(self, handle: int, kind: str, n: int) -> _Handle:
        h = _Handle(kind, n, n, [False] * n)
        self._handles[handle] = h
        return h

    def _item_done(self, handle: int, item: int, ok: bool) -> None:
        h = self._handles.get(handle)
        if h is None:
            return
        h.ok[item] = ok
        h.pending -= 1
        self._maybe_finish(handle, h)

    def _maybe_finish(self, handle: int, h: _Handle) -> None:
        if h.pending > 0 or self._handles.get(handle) is not h:
            return
        del self._handles[handle]
        if h.kind == "put":
            result: object = list(h.ok)
        else:
            result = next((i for i, ok in enumerate(h.ok) if not ok), h.n)
        self._finished.append((handle, result))

    def _refuse_put(self, handle: int, item: int, tier: int) -> None:
        self.counters.puts_refused += 1
        self.tier_counters[tier].refused += 1
        self._item_done(handle, item, False)

    def _prefetch_step(self, key: bytes, ctx: tuple[int, int, int], src: int | None = None) -> Jobs:
        """Move ``key`` one hop toward ``ctx``'s target tier (from ``src``, default its fastest copy), or finish."""
        handle, item, target = ctx
        e = self.index.get(key)
        if src is None:
            src = None if e is None else e.best()
        if src is not None and src <= target:
            self._item_done(handle, item, True)
            return []
        c = None if (e is None or src is None) else e.copies.get(src)
        if c is None or not c.readable:  # gone meanwhile
            self._item_done(handle, item, False)
            return []
        above = e.copies.get(src - 1)
        if above is not None:
            if above.readable:
                return self._prefetch_step(key, ctx, src - 1)
            if above.state is not CopyState.READY:  # a copy up is on its way: follow it
                self._followers.setdefault((key, src - 1), []).append(ctx)
                return []
            self._item_done(handle, item, False)  # the copy above is leaving: give up
            return []
        return self._promote(key, src, src - 1, ctx)

    def _job(self, kind: JobKind, src: int, dst: int, keys: list[bytes], src_slots: list[int],
             dst_slots: list[int], handle: int, ctx: list) -> TransferJob:
        job = TransferJob(next(self._job_ids), kind, src, dst, keys, src_slots, dst_slots, handle)
        self._jobs[job.job_id] = (job, ctx)
        return job

    def _reserve(self, t: int, grant: Callable[[int], Jobs], refuse: Callable[[], Jobs]) -> tuple[str, int, Jobs]:
        """Room for one block in tier ``t``: ("now", slot), ("wait", -1) with ``grant(slot)`` called later,
        or ("refused", -1) for a tier with no room at all.

        Waiting always ends: copies being written or read become evictable when their job
        completes, waiting promotions and copies hold no pins, and demotions only wait on
        lower tiers, the lowest of which evicts by dropping.
        """
        slot = self._take_room(t)
        if slot is not None:
            return "now", slot, []
        if self.specs[t].capacity == 0:
            return "refused", NO_SLOT, []
        self._waiters[t].append(_Waiter(grant, refuse))
        return "wait", NO_SLOT, self._make_room(t)

    def _take_room(self, t: int) -> int | None:
        """One unit of room in ``t`` if there is some: its slot (``NO_SLOT`` for keyed tiers), else None."""
        if self.used[t] >= self.specs[t].capacity:
            return None
        self.used[t] += 1
        return self._free_slots[t].pop() if self.specs[t].slotted else NO_SLOT

    def _kick(self, t: int) -> Jobs:
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
        victims = self.policies[t].victims(need, lambda k: self._evictable(k, t) and not self._wanted(k, t))
        if len(victims) < need:  # only sources of waiting copies are left: take them rather than stall
            chosen = set(victims)
            victims += self.policies[t].victims(need - len(victims),
                                                lambda k: k not in chosen and self._evictable(k, t))
        for key in victims:
            jobs += self._evict(t, key)
        return jobs

    def _wanted(self, key: bytes, t: int) -> bool:
        return self.index.get(key).copies[t].wanted > 0

    def _evictable(self, key: bytes, t: int) -> bool:
        c = self.index.get(key).copies.get(t)
        return c is not None and c.state is CopyState.READY and c.pins == 0 and not c.leaving and not c.doomed

    def _evict(self, t: int, key: bytes) -> Jobs:
        e = self.index.get(key)
        c = e.copies[t]
        c.leaving = True
        self.leaving[t] += 1
        self.policies[t].remove(key)
        self.tier_counters[t].evictions += 1
        lower = t + 1
        if lower >= self.num_tiers or lower in e.copies or any(u < t and d.readable for u, d in e.copies.items()):
            return self._drop(key, t)
        c.pins += 1  # the demotion reads it
        self._pins += 1
        self.index.add_copy(key, lower, Copy(CopyState.QUEUED, NO_SLOT))

        def grant(slot: int) -> Jobs:
            d = self.index.get(key).copies[lower]
            d.state, d.slot = CopyState.WRITING, slot
            return [self._job(JobKind.DEMOTE, t, lower, [key], [c.slot], [slot], 0, [None])]

        def refuse() -> Jobs:  # no room below: the block leaves this tier without a copy below
            out = self._remove(key, lower)
            c.pins -= 1
            self._pins -= 1
            return out + self._drop(key, t)

        status, slot, jobs = self._reserve(lower, grant, refuse)
        if status == "now":
            jobs += grant(slot)
        elif status == "refused":
            jobs += refuse()
        return jobs

    def _demote_done(self, key: bytes, src: int, ok: bool) -> Jobs:
        e = self.index.get(key)
        c = None if e is None else e.copies.get(src)
        if c is None:  # deleted while moving: the source was freed when its last reader let go
            return self._kick(src)
        if ok:
            return self._drop(key, src)
        c.leaving = False  # keep the source; try another victim for whoever waits
        self.leaving[src] -= 1
        if not c.doomed:
            self.policies[src].insert(key)
        return self._refuse_one(src) + self._make_room(src)

    def _refuse_one(self, t: int) -> Jobs:
        """A demotion out of ``t`` failed: refuse one waiter that counted on it (bounds retries on a bad medium)."""
        if len(self._waiters[t]) > self.leaving[t]:
            return self._waiters[t].pop().refuse()
        return []

    def _copy_down(self, key: bytes, t: int) -> Jobs:
        lower = t + 1
        e = self.index.get(key)
        if lower >= self.num_tiers or e is None or lower in e.copies or not e.copies[t].readable:
            return []
        return self._copy_up_or_down(key, t, lower, JobKind.COPY_DOWN, None)

    def _promote(self, key: bytes, src: int, dst: int, ctx) -> Jobs:
        return self._copy_up_or_down(key, src, dst, JobKind.PROMOTE, ctx)

    def _copy_up_or_down(self, key: bytes, src: int, dst: int, kind: JobKind, ctx) -> Jobs:
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
                return self._remove(key, dst)
            c.pins += 1
            self._pins += 1
            return [self._job(kind, src, dst, [key], [c.slot], [slot], 0, [ctx])]

        def refuse() -> Jobs:
            unwant()
            if ctx is not None:
                self._item_done(ctx[0], ctx[1], False)
            return self._remove(key, dst)

        status, slot, jobs = self._reserve(dst, grant, refuse)
        if status == "now":
            jobs += grant(slot)
        elif status == "refused":
            jobs += refuse()
        return jobs

    def _source_done(self, key: bytes, t: int, corrupt: bool, missing: bool = False) -> Jobs:
        """A job finished reading ``key``'s copy in ``t``."""
        e = self.index.get(key)
        c = e.copies[t]
        if corrupt or missing:  # the record is gone from the medium: forget it without a DELETE job
            if corrupt:
                self.tier_counters[t].corrupt_dropped += 1
            else:
                self.tier_counters[t].vanished += 1
            c.deleting = True  # nothing left on the medium to delete
            c.doomed = True
            if not c.leaving:
                self.policies[t].remove(key)
        return self._unpin(key, t)

    def _unpin(self, key: bytes, t: int) -> Jobs:
        c = self.index.get(key).copies[t]
        c.pins -= 1
        self._pins -= 1
        if c.pins == 0 and c.doomed:
            if c.deleting and not self.specs[t].slotted and c.state is CopyState.READY:
                return self._free(key, t)  # corrupt record: the tier already removed it
            return self._drop(key, t)
        if c.pins == 0 and not c.leaving:
            return self._kick(t)
        return []

    def _drop(self, key: bytes, t: int) -> Jobs:
        """Let ``key``'s copy in ``t`` go: now if unpinned, else when the last reader unpins."""
        c = self.index.get(key).copies[t]
        c.doomed = True
        if c.pins > 0 or c.deleting:
            return []
        if not self.specs[t].slotted and c.state is CopyState.READY:
            c.deleting = True
            return [self._job(JobKind.DELETE, t, t, [key], [NO_SLOT], [NO_SLOT], 0, [None])]
        return self._free(key, t)

    def _remove(self, key: bytes, t: int) -> Jobs:
        """Remove a copy that never became READY (or failed), releasing its room if it held any."""
        c = self.index.get(key).copies[t]
        held = c.state is not CopyState.QUEUED
        for follower in self._followers.pop((key, t), ()):  # prefetches that waited for this copy
            self._item_done(follower[0], follower[1], False)
        self.policies[t].remove(key)
        if c.leaving:
            self.leaving[t] -= 1
        gone = self.index.remove_copy(key, t)
        if gone:
            self.counters.blocks_out += 1
        return self._release(t, c.slot) if held else []

    def _free(self, key: bytes, t: int) -> Jobs:
        c = self.index.get(key).copies[t]
        if c.leaving:
            self.leaving[t] -= 1
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
