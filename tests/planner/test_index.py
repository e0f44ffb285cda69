"""BlockIndex's compact records: a key with one plain copy is one int, expanded to an Entry on demand.

The unit tests pin the record's round trip (slots, NO_SLOT, every tier, every state) and when a
record expands and compacts again; the randomized test drives two chains, one storing plain
copies compactly and one keeping every key an Entry, through the same puts, reads, prefetches,
deletes and completions (ok, failed, corrupt), and requires the same jobs and outcomes.
"""
from __future__ import annotations

import gc
import random

import pytest

from tests.planner._driver import K, three_tier
from tiered_kv.planner.index import BlockIndex, Copy, CopyState, Entry
from tiered_kv.values.jobs import NO_SLOT, Completion, JobKind


@pytest.mark.parametrize("tier,slot", [(0, 0), (1, 7), (2, NO_SLOT), (7, 123_456_789)])
@pytest.mark.parametrize("state", list(CopyState))
def test_a_compact_record_round_trips(tier, slot, state):
    idx = BlockIndex(8)
    idx.add_new(b"k", tier, slot, state)
    assert idx.plain(b"k") == (tier, state) and b"k" in idx and len(idx) == 1
    assert idx.best(b"k") == (tier if state is CopyState.READY else None)
    assert idx.copies_per_tier[tier] == 1
    e = idx.get(b"k")  # expands, for good
    assert type(e) is Entry and list(e.copies) == [tier] and not e.deleted
    c = e.copies[tier]
    assert (c.state, c.slot, c.pins, c.leaving, c.doomed, c.deleting, c.wanted) == (state, slot, 0, False, False,
                                                                                     False, 0)
    assert idx.plain(b"k") is None and idx.get(b"k") is e


def test_compact_records_are_not_tracked_by_the_garbage_collector():
    idx = BlockIndex(2)
    idx.add_new_many([K(i) for i in range(100)], 0, list(range(100)), CopyState.WRITING)
    assert not any(gc.is_tracked(v) for v in idx._entries.values())
    idx.compact_records = False
    idx.add_new_many([K(i) for i in range(100, 110)], 0, list(range(100, 110)), CopyState.WRITING)
    assert all(gc.is_tracked(idx._entries[K(i)]) for i in range(100, 110))


def test_set_plain_state_touches_only_a_compact_record_in_that_tier():
    idx = BlockIndex(3)
    idx.add_new_many([b"a", b"b"], 1, [4, 5], CopyState.WRITING)
    assert not idx.set_plain_state(b"a", 0, CopyState.READY)  # another tier: unchanged
    assert idx.plain(b"a") == (1, CopyState.WRITING)
    assert idx.set_plain_state(b"a", 1, CopyState.READY) and idx.best(b"a") == 1
    assert idx.get(b"a").copies[1].slot == 4  # the slot survived the state change
    assert not idx.set_plain_state(b"a", 1, CopyState.WRITING)  # an Entry now: the caller goes through get
    assert not idx.set_plain_state(b"zz", 1, CopyState.READY) and b"zz" not in idx


def test_compact_again_only_when_plain():
    idx = BlockIndex(3)
    idx.add_new(b"a", 0, 3, CopyState.READY)
    c = idx.get(b"a").copies[0]
    c.pins = 1
    idx.compact(b"a")
    assert idx.plain(b"a") is None  # pinned: stays an Entry
    c.pins = 0
    idx.get(b"a").deleted = True
    idx.compact(b"a")
    assert idx.plain(b"a") is None  # deleted: stays an Entry
    idx.add_new(b"b", 0, 4, CopyState.READY)
    idx.add_copy(b"b", 1, Copy(CopyState.QUEUED, NO_SLOT))
    idx.compact(b"b")
    assert idx.plain(b"b") is None  # two copies
    assert not idx.remove_copy(b"b", 1)
    idx.compact(b"b")
    assert idx.plain(b"b") == (0, CopyState.READY) and idx.copies_per_tier == [2, 0, 0]
    assert idx.remove_copy(b"b", 0) and b"b" not in idx and idx.copies_per_tier == [1, 0, 0]


def test_pin_best_pins_the_fastest_readable_copy():
    idx = BlockIndex(3)
    idx.add_new(b"a", 1, 7, CopyState.READY)
    assert idx.pin_best(b"a") == (1, 7)  # a compact record: an Entry now, holding the pinned copy
    e = idx.get(b"a")
    assert type(e) is Entry and e.copies[1].pins == 1 and e.copies[1].state is CopyState.READY and not e.deleted
    assert idx.pin_best(b"a") == (1, 7) and e.copies[1].pins == 2  # a second reader
    idx.add_new(b"w", 0, 3, CopyState.WRITING)
    assert idx.pin_best(b"w") is None and idx.plain(b"w") == (0, CopyState.WRITING)  # not readable: untouched
    assert idx.pin_best(b"zz") is None and b"zz" not in idx
    idx.add_copy(b"a", 0, Copy(CopyState.READY, 2))
    assert idx.pin_best(b"a") == (0, 2) and e.copies[0].pins == 1 and e.copies[1].pins == 2  # the fastest tier
    e.copies[0].doomed = True
    assert idx.pin_best(b"a") == (1, 7) and e.copies[1].pins == 3  # a doomed copy is not readable
    e.copies[1].doomed = True
    assert idx.pin_best(b"a") is None and (e.copies[0].pins, e.copies[1].pins) == (1, 3)
    idx.add_new(b"c", 2, NO_SLOT, CopyState.READY)
    assert idx.pin_best(b"c") == (2, NO_SLOT)
    c = idx.get(b"c").copies[2]
    c.pins = 0
    idx.compact(b"c")
    assert idx.plain(b"c") == (2, CopyState.READY)  # let go: compact again


def test_a_store_stays_compact_from_put_to_ready_and_after_a_read():
    c = three_tier(gpu=4)
    (job,) = c.put([K(1), K(2)], 1)
    assert c.index.plain(K(1)) == (0, CopyState.WRITING)
    assert c.complete(Completion(job.job_id, [True, True])) == []
    assert c.index.plain(K(1)) == (0, CopyState.READY) and c.locate([K(1), K(2), K(3)]) == [0, 0, None]
    n, jobs = c.get([K(1)], 2)
    assert n == 1 and c.index.plain(K(1)) is None and c.pinned() == 1  # a reader pins it: an Entry
    (load,) = jobs
    assert load.kind is JobKind.EGRESS and c.complete(Completion(load.job_id, [True])) == []
    assert c.index.plain(K(1)) == (0, CopyState.READY) and c.pinned() == 0  # let go: compact again
    assert c.put([K(1)], 3) == [] and c.counters.puts_deduplicated == 1  # a duplicate, read compactly


def _jobs_view(jobs):
    return [(j.job_id, j.kind, j.src_tier, j.dst_tier, list(j.keys), list(j.src_slots), list(j.dst_slots), j.handle)
            for j in jobs]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kw", [{}, {"eviction": "s3fifo"}])
def test_compact_and_entry_only_chains_plan_the_same(seed, kw):
    """Randomized A/B: the compact records change no decision of the planner."""
    rng = random.Random(seed)
    a, b = three_tier(gpu=3, cpu=4, disk=6, **kw), three_tier(gpu=3, cpu=4, disk=6, **kw)
    b.index.compact_records = False
    pending: list = []
    handle = compact_seen = 0
    for _ in range(400):
        op = rng.random()
        keys = [K(rng.randrange(14)) for _ in range(rng.randrange(1, 5))]
        handle += 1
        if op < 0.3:
            ja, jb = a.put(keys, handle), b.put(keys, handle)
        elif op < 0.45:
            (na, ja), (nb, jb) = a.get(keys, handle), b.get(keys, handle)
            assert na == nb
        elif op < 0.52:
            to = rng.randrange(2)
            (na, ja), (nb, jb) = a.prefetch(keys, to, handle), b.prefetch(keys, to, handle)
            assert na == nb
        elif op < 0.57:
            ja, jb = a.delete(keys), b.delete(keys)
        else:
            ja = jb = []
            if pending:
                job = pending.pop(rng.randrange(len(pending)))
                ok = [rng.random() > 0.15 for _ in job.keys]
                bad = [not o and rng.random() < 0.3 for o in ok]
                ja = a.complete(Completion(job.job_id, ok, bad))
                jb = b.complete(Completion(job.job_id, ok, bad))
        assert _jobs_view(ja) == _jobs_view(jb)
        pending += ja
        assert a.take_finished() == b.take_finished()
        universe = [K(i) for i in range(14)]
        assert a.locate(universe) == b.locate(universe)
        assert a.used == b.used and a.pinned() == b.pinned() and a.waiting() == b.waiting()
        compact_seen += sum(type(v) is int for v in a.index._entries.values())
    assert vars(a.counters) == vars(b.counters)
    assert [vars(t) for t in a.tier_counters] == [vars(t) for t in b.tier_counters]
    assert compact_seen > 0  # the compact side did hold compact records along the way
    assert not any(type(v) is int for v in b.index._entries.values())
