"""TierChain: the planner. Decides what moves where; never touches bytes.

``TierChain`` routes: it turns caller requests (put/get/prefetch/delete/adopt) and movers'
``Completion``s into ``TransferJob``s, and tracks the handles whose items those jobs carry.
Each call returns the jobs to run; ``complete()`` applies a completion and returns the jobs
it unblocked. Results of caller requests are collected per handle id and drained with
``take_finished()``.

Room-making is its ``RoomKeeper`` (``planner/room.py``): room and slots per tier, waiters
for a full tier, eviction by policy, copies leaving. The two share the ``BlockIndex``, one
``EvictionPolicy`` per tier and the counters; the chain asks the keeper for room and tells
it when copies land or let go, the keeper asks the chain to issue its DEMOTE/DELETE jobs.
Its other parts: ``Handles`` (``planner/handles.py``: caller requests in flight, their
results) and ``CopyPlanner`` (``planner/copies.py``: promotions, prefetch hops and
write-through copies, which keep their source).

Rules it keeps, with its keeper (DESIGN invariants 1, 2, 5):
- a copy is served only when READY; a key being written reads as a miss;
- an evicted block is copied down first and its source freed only after the copy
  committed; a failed copy frees the destination and keeps the source, except a failed
  demotion into a best-effort tier (disk, remote: ``TierSpec.best_effort``), which drops the
  source (counted) so a sick medium below never stops puts into the tiers above;
- capacity is a hard limit: a put that finds a full tier evicts by policy, waits for the
  eviction to commit, and is refused (False) if nothing can be evicted;
- a block that lands in a governed tier with a tier below it (a host pool above a disk) is copied
  one tier down at once: the medium evicts by itself and cannot demote what it drops; a put such a
  tier refuses (no room it may take) lands in the tier below instead.

Tiers are numbered 0 (fastest) .. n-1. ``EXT`` (-1) is the caller's side of a job.

Threading contract: not thread-safe. One owner serializes every call (``TieredStore``
under its lock; the vLLM scheduler thread in the connector).
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

from tiered_kv.errors import ConfigError, InvalidInputError
from tiered_kv.planner.copies import CopyPlanner
from tiered_kv.planner.puts import PutPlanner
from tiered_kv.planner.counters import ChainCounters, TierCounters, TransferCounters
from tiered_kv.planner.handles import Handles
from tiered_kv.planner.index import BlockIndex, CopyState
from tiered_kv.planner.policy import EvictionPolicy, PlacementPolicy, make_policy
from tiered_kv.planner.room import RoomKeeper, TierSpec
from tiered_kv.values.jobs import EXT, NO_SLOT, Completion, JobKind, TransferJob

# TierSpec and the counters are defined beside the room keeper; callers import them from here.
__all__ = ["ChainCounters", "TierChain", "TierCounters", "TierSpec"]

Jobs = list[TransferJob]


#: ``src_slots`` of a bulk put's one job (item i from caller index i), shared per length up to _ITEMS_MAX: immutable
_ITEMS: dict[int, tuple[int, ...]] = {}
_ITEMS_MAX = 1024


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
        if any(t >= len(specs) for t in self.placement.copy_to):
            raise ConfigError(f"copy_to={self.placement.copy_to} but the chain has only {len(specs)} tiers {names}")
        n = len(specs)
        self.index = BlockIndex(n)
        self.policies: list[EvictionPolicy] = [make_policy(eviction) for _ in specs]
        # in-flight jobs, and per job the context of each item: a list (a tuple per item, or None), or for a bulk
        # put's one job and a get's job of items 0..m-1 the handle's id, an int, whose item i is the handle's item i.
        # Two dicts, no pair per job: on vLLM's scheduler thread every object that outlives a step makes the garbage
        # collector run sooner.
        self._jobs: dict[int, TransferJob] = {}
        self._ctx: dict[int, list | int] = {}
        self._job_ids = itertools.count(1)
        self.handles = Handles()
        self._item_done = self.handles.item_done  # bound once: it runs for every item that ends
        self.tier_counters = [TierCounters() for _ in specs]
        self.counters = ChainCounters()
        self.transfers = TransferCounters(names)  # per edge and per load: for metrics only
        self.room = RoomKeeper(self.specs, self.index, self.policies, self.tier_counters, self.counters,
                               job=self._block_job, lost=self._lost)
        self.copies = CopyPlanner(self.index, self.policies, self.room, n, self.placement.copy_to, self._job,
                                  self._item_done)
        self._followers = self.copies.followers  # the copy planner's: looked up for every copy that lands
        self.puts = PutPlanner(self.index, self.room, self.counters, self.tier_counters, self._job, self._item_done)
        self.events: list[tuple[bool, int, bytes]] | None = None  # see record_events

    def record_events(self) -> None:
        """From now on append ``(stored, tier, key)`` to ``self.events`` whenever a copy this chain wrote became
        READY in a tier (``stored`` True) or a READY copy left one (False): the raw material of KV events.
        The owner drains the list; off by default (no cost)."""
        if self.events is None:
            self.events = self.room.events = []

    def take_events(self) -> list[tuple[bool, int, bytes]]:
        """Drain what ``record_events`` collected since the last call (empty when not recording)."""
        if not self.events:
            return []
        out = self.events[:]
        self.events.clear()  # the room keeper appends to this same list
        return out

    @property
    def used(self) -> list[int]:
        """Room taken per tier, in blocks (copies in any state plus room granted to waiters)."""
        return self.room.used

    @property
    def leaving(self) -> list[int]:
        """Evictions under way per tier."""
        return self.room.leaving

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
        best = self.index.best
        for key in keys:
            if best(key) is None:
                break
            n += 1
        return n

    def locate(self, keys: Sequence[bytes]) -> list[int | None]:
        """Fastest tier holding a readable copy of each key (None if none)."""
        return [self.index.best(key) for key in keys]

    def job(self, job_id: int) -> TransferJob | None:
        """The in-flight job with this id, or None once it completed."""
        return self._jobs.get(job_id)

    def for_reader(self, job_id: int) -> bool:
        """Whether the in-flight job ``job_id`` was planned for a caller (a get, a prefetch, a put's items), not only
        for placement (a promotion on hit, a demotion, a write-through copy). A prefetch that follows a promotion on
        hit already in flight waits for it, but that job stays a placement one."""
        ctx = self._ctx.get(job_id)
        return ctx is not None and (ctx.__class__ is int or any(c is not None for c in ctx))

    def inflight(self) -> int:
        """Jobs issued and not yet completed."""
        return len(self._jobs)

    def pinned(self) -> int:
        """Copies pinned by running readers."""
        return self.room.pins

    def waiting(self) -> int:
        """Reservations waiting for room."""
        return self.room.waiting()

    def resident(self, tier: int) -> int:
        """Copies (any state) in ``tier``."""
        return self.index.copies_per_tier[tier]

    def take_finished(self) -> list[tuple[int, object]]:
        """Drain results of finished handles: ``(handle_id, result)`` pairs.

        put -> list[bool] (accepted per key); get -> int (leading blocks delivered);
        prefetch -> int (leading blocks now at the target tier or faster).
        """
        return self.handles.take()

    # ------------------------------------------------------------------ requests
    def put(self, keys: Sequence[bytes], handle: int) -> Jobs:
        """Plan storing ``keys`` from the caller's buffer (item i = buffer index i) into the put tier.

        A job may keep ``keys`` itself when it is a list: the caller must not change it afterwards."""
        t = self.placement.put_tier
        n = len(keys)
        h = self.handles.open(handle, "put", n)
        room = self.room
        # the common case (new prompt blocks, room for all): one job, no per-key calls; a list of keys is kept as
        # the job's (no copy), its items are a shared tuple, and its items' context is the handle id itself
        if n and self.index.holds_none_of(keys) and len(set(keys)) == n \
                and (slots := room.take_run(t, n)) is not None:
            self.counters.blocks_in += n
            self.index.add_new_many(keys, t, slots, CopyState.WRITING)
            items = _ITEMS.get(n)
            if items is None:
                items = tuple(range(n))
                if n <= _ITEMS_MAX:
                    _ITEMS[n] = items
            keys = keys if keys.__class__ is list else list(keys)
            return [self._job(JobKind.INGRESS, EXT, t, keys, items, slots, handle, handle)]
        jobs: Jobs = []
        batch: list[tuple[int, bytes, int]] = []  # (item, key, slot) ready to write now
        index = self.index
        for i, key in enumerate(keys):
            plain = index.plain(key)
            if plain is not None:  # one plain copy (never doomed): a duplicate, read without expanding it
                self.counters.puts_deduplicated += 1
                if plain[1] is CopyState.READY:
                    self.policies[plain[0]].access(key)
                self._item_done(handle, i, True)
                continue
            e = index.get(key)
            if e is not None and any(not c.doomed for c in e.copies.values()):
                self.counters.puts_deduplicated += 1
                for u, c in e.copies.items():
                    if c.state is CopyState.READY:
                        self.policies[u].access(key)
                self._item_done(handle, i, True)
                continue
            if e is not None:  # only doomed copies remain: let them go first
                self.puts.refuse(handle, i, t)
                continue
            jobs += self.puts.one(key, i, handle, t, batch)
        jobs += self.puts.ingress(t, handle, batch)
        self.handles.maybe_finish(handle, h)
        return jobs

    def get(self, keys: Sequence[bytes], handle: int) -> tuple[int, Jobs]:
        """Plan reading the leading run of held keys into the caller's buffer (item i -> index i)."""
        pin, policies = self.index.pin_best, self.policies
        by_tier: dict[int, tuple[list[bytes], list[int], list[int]]] = {}  # tier -> its keys, slots, items
        n = 0
        for key in keys:  # one pass: pin each key's fastest readable copy, up to the first key with none
            got = pin(key)
            if got is None:
                break
            t, slot = got
            policies[t].access(key)
            group = by_tier.get(t)
            if group is None:
                group = by_tier[t] = ([], [], [])
            group[0].append(key)
            group[1].append(slot)
            group[2].append(n)
            n += 1
        self.counters.lookups += len(keys)
        self.counters.hits += n
        self.counters.misses += len(keys) - n
        h = self.handles.open(handle, "get", n)
        self.room.pins += n  # the n pins just taken, added once rather than per key
        jobs: Jobs = []
        for t, (tkeys, _, _) in by_tier.items():
            self.tier_counters[t].hits += len(tkeys)
        # promote only after every hit is pinned, so a promotion's eviction cannot take a block we read
        if self.placement.promote_on_hit:
            for t, (tkeys, _, _) in by_tier.items():
                for key in tkeys if t > 0 else ():  # the top tier has none above it
                    e = self.index.get(key)
                    if (t - 1) not in e.copies and e.copies[t].readable:
                        jobs += self.copies.promote(key, t, t - 1, None)
        for t, (tkeys, slots, items) in sorted(by_tier.items()):
            # items 0..m-1 (a one-tier hit: the usual): the context is the handle id, as for a bulk put (an int:
            # ``complete`` tells the two forms apart by that class)
            whole = handle.__class__ is int and items[-1] == len(items) - 1
            ctx = handle if whole else [(handle, i) for i in items]
            jobs.append(self._job(JobKind.EGRESS, t, EXT, tkeys, slots, items, handle, ctx))
        self.handles.maybe_finish(handle, h)
        return n, jobs

    def prefetch(self, keys: Sequence[bytes], to: int, handle: int) -> tuple[int, Jobs]:
        """Plan moving the leading run of held keys up to tier ``to`` (one hop at a time)."""
        n = self.lookup(keys)
        h = self.handles.open(handle, "prefetch", n)
        jobs: Jobs = []
        prefetch_step = self.copies.prefetch_step
        for i, key in enumerate(keys[:n]):
            jobs += prefetch_step(key, (handle, i, to))
        self.handles.maybe_finish(handle, h)
        return n, jobs

    def touch(self, keys: Iterable[bytes], tier: int = 0) -> None:
        """Order ``keys``' copies in ``tier`` as used now, in order: the last key becomes the most recently used
        (for a recency policy; this is no access, so frequency counts do not change).

        A caller whose keys form a prefix (block i needs blocks 0..i-1 to be of use) passes them deepest
        first, so that eviction takes a prefix from its end: a prefix that lost its first block is lost
        whole, one that lost its last blocks still hits the rest. Keys without a resident copy there
        (absent, still being written) are skipped."""
        reorder = self.policies[tier].reorder
        for key in keys:
            reorder(key)

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
                jobs += self.room.drop(key, t)
        return jobs

    def adopt(self, tier: int, keys: Sequence[bytes]) -> Jobs:
        """Register blocks a tier already holds (a reopened disk tier). Extra blocks beyond capacity are evicted."""
        added = 0
        for key in keys:
            if key in self.index:
                continue
            self.counters.blocks_in += 1
            self.index.add_new(key, tier, NO_SLOT, CopyState.READY)  # compact: a plain copy
            self.policies[tier].insert(key)
            added += 1
        return self.room.occupy(tier, added)

    def forget(self, tier: int, keys: Sequence[bytes], unreadable: bool = False) -> Jobs:
        """The medium of ``tier`` dropped these records by itself (a governed tier evicting, another
        process deleting): forget those copies. Keys the chain does not hold there are ignored.

        ``unreadable``: the records may still be there but could not be read (a node down), and the owner
        would rather recompute than try again; forgotten all the same, but not counted in ``vanished``."""
        jobs: Jobs = []
        index, vanished = self.index, self.room.vanished
        for key in keys:
            if key in index:
                jobs += vanished(key, tier, counted=not unreadable)
        return jobs

    # ------------------------------------------------------------------ completions
    def complete(self, done: Completion) -> Jobs:
        """Apply a job's completion; returns the jobs it unblocked."""
        job = self._jobs.pop(done.job_id)
        ctx = self._ctx.pop(done.job_id)
        whole = ctx.__class__ is int  # item i of the job is item i of handle ``ctx`` (a bulk put's, a one-tier get's)
        if job.kind is not JobKind.DELETE:
            self.transfers.record(job.src_tier, job.dst_tier, sum(map(bool, done.ok)), done.seconds, job.kind.is_load)
        if job.kind is JobKind.EGRESS and _delivered(job, done):  # a read that delivered every item: per job
            jobs = self.room.unpin_all(job.keys, job.src_tier)  # what _complete_item does for each item
            self.handles.items_done(job.handle, range(len(job.keys)) if whole else [i for _, i in ctx], True)
        else:
            jobs = []
            for i, key in enumerate(job.keys):
                ok = bool(done.ok[i]) if i < len(done.ok) else False
                bad = bool(done.corrupt[i]) if i < len(done.corrupt) else False
                gone = bool(done.missing[i]) if i < len(done.missing) else False
                jobs += self._complete_item(job, key, ok, bad, (ctx, i) if whole else ctx[i], gone and not ok)
        if done.evicted:  # a governed destination made room by dropping other records
            self.tier_counters[job.dst_tier].evictions += len(done.evicted)
            jobs += self.forget(job.dst_tier, done.evicted)
        return jobs

    def _complete_item(self, job: TransferJob, key: bytes, ok: bool, corrupt: bool, ctx, missing: bool = False) -> Jobs:
        kind, src, dst = job.kind, job.src_tier, job.dst_tier
        jobs: Jobs = []
        room = self.room
        if kind is JobKind.DELETE:
            return room.delete_done(key, src)
        if src != EXT:
            room.source_gone(key, src, corrupt, missing and not self.specs[src].slotted)
            if corrupt:
                ok = False
        if not ok:
            self.tier_counters[dst if dst != EXT else src].failed_transfers += 0 if (corrupt or missing) else 1
        if kind is JobKind.EGRESS:
            jobs += room.unpin(key, src)
            hid, item = ctx
            self._item_done(hid, item, ok)
            return jobs
        # a tier-side destination copy
        if ok and self.index.set_plain_state(key, dst, CopyState.READY):
            e = c = None  # a compact record (the store's common case): plain, so neither doomed nor deleted
        else:
            e = self.index.get(key)
            c = e.copies[dst]
        if ok:
            if c is not None:
                c.state = CopyState.READY
            if self.events is not None:
                self.events.append((True, dst, key))
            self.tier_counters[dst].blocks_in += 1
            self.policies[dst].insert(key)
            if kind is JobKind.PROMOTE:  # moved up for a reader: an access (S3-FIFO keeps it past one-time blocks)
                self.policies[dst].access(key)
            if kind is JobKind.INGRESS and self.placement.copy_to:
                jobs += self.copies.copy_to(key, dst)  # before kick: a waiter's eviction must not take it uncopied
                if c is None:  # it added a copy below: the record is an Entry now
                    e = self.index.get(key)
                    c = e.copies[dst]
            if c is not None and (c.doomed or e.deleted):
                self.policies[dst].remove(key)
                jobs += room.drop(key, dst)
            jobs += room.kick(dst)
        else:
            jobs += room.remove(key, dst)
        if src != EXT:  # only now, with the copy below settled: an eviction this starts must see how it ended
            jobs += room.unpin(key, src)
        if ok:
            for follower in self._followers.pop((key, dst), ()):
                jobs += self.copies.prefetch_step(key, follower, dst)
        if kind is JobKind.INGRESS:
            hid, item = ctx
            if not ok and self.specs[dst].governed and dst + 1 < self.num_tiers and key not in self.index:
                return jobs + self.puts.spill(key, item, hid, dst + 1)
            self._item_done(hid, item, ok)
            if ok and self.placement.write_policy == "write_through":
                jobs += self.copies.copy_down(key, dst)
        elif kind is JobKind.COPY_DOWN:
            if ok:
                jobs += self.copies.copy_down(key, dst)
        elif kind is JobKind.DEMOTE:
            jobs += room.demote_done(key, src, ok)
        elif kind is JobKind.PROMOTE:
            if ctx is not None:
                if ok:  # one hop done; the copy counts as arrived even if evicted right after
                    jobs += self.copies.prefetch_step(key, ctx, dst)
                else:
                    self._item_done(ctx[0], ctx[1], False)
        if ok and self.specs[dst].governed:  # its medium may drop it any time and demotes nothing: keep one below
            jobs += self.copies.copy_down(key, dst)
        return jobs

    # ------------------------------------------------------------------ internals
    def _job(self, kind: JobKind, src: int, dst: int, keys: list[bytes], src_slots: Sequence[int],
             dst_slots: list[int], handle: int, ctx: list | int) -> TransferJob:
        job = TransferJob(next(self._job_ids), kind, src, dst, keys, src_slots, dst_slots, handle)
        self._jobs[job.job_id] = job
        self._ctx[job.job_id] = ctx
        return job

    def _block_job(self, kind: JobKind, src: int, dst: int, key: bytes, src_slot: int, dst_slot: int) -> TransferJob:
        """A one-block job no caller waits on: the room keeper's demotions and deletes."""
        return self._job(kind, src, dst, [key], [src_slot], [dst_slot], 0, [None])

    def _lost(self, key: bytes, t: int) -> None:
        """The room keeper removed ``key``'s copy in ``t`` before it arrived."""
        self.copies.abandon_followers(key, t)


def _delivered(job: TransferJob, done: Completion) -> bool:
    """Every item of ``job`` reported ok and none corrupt (a get's job serves one handle: ``job.handle``)."""
    n = len(job.keys)
    return len(done.ok) >= n and all(done.ok[:n]) and not any(done.corrupt[:n])
