"""TierChain routing: puts, gets, prefetches and their completions, driven with no bytes moved.

Room-making (waiters, eviction, refusals) is tested in test_room.py.
"""
from __future__ import annotations

import random

import pytest

import tiered_kv.planner.chain as chain_mod
from tests.planner._driver import K, run_all, three_tier
from tiered_kv.planner.chain import TierChain, TierSpec
from tiered_kv.planner.handles import Handles
from tiered_kv.planner.policy import PlacementPolicy
from tiered_kv.values.jobs import Completion, JobKind


def test_put_cascades_and_counts_add_up():
    c = three_tier()
    jobs = c.put([K(i) for i in range(2)], 1)
    run_all(c, jobs)
    for i in range(2, 10):
        run_all(c, c.put([K(i)], 10 + i))
    res = dict(c.take_finished())
    assert all(res[h] == [True] for h in range(12, 20))
    # 10 blocks into 2+3+5: all held, cascaded by LRU
    assert [c.resident(t) for t in range(3)] == [2, 3, 5]
    assert c.locate([K(0), K(9)]) == [2, 0]
    assert c.counters.blocks_in == c.counters.blocks_out + len(c.index)
    assert c.inflight() == 0 and c.pinned() == 0 and c.waiting() == 0


def test_overflow_drops_from_bottom_and_get_is_prefix():
    c = three_tier(1, 1, 2)
    for i in range(6):
        run_all(c, c.put([K(i)], i + 1))
    assert len(c.index) == 4
    assert c.lookup([K(0)]) == 0 and c.lookup([K(5), K(4), K(0), K(3)]) == 2
    n, jobs = c.get([K(5), K(4), K(0), K(3)], 99)
    assert n == 2
    assert all(j.kind in (JobKind.EGRESS, JobKind.PROMOTE, JobKind.DEMOTE, JobKind.DELETE) for j in jobs)
    run_all(c, jobs)
    assert dict(c.take_finished())[99] == 2
    assert c.counters.hits == 2 and c.counters.misses == 2 and c.counters.lookups == 4


def test_bulk_put_matches_the_per_key_path():
    """New keys with room for all take the bulk path; a repeated key or a full tier the per-key one.
    Both give the same slots, copies and outcome."""
    bulk, per_key = three_tier(gpu=8), three_tier(gpu=8)
    jobs_b = bulk.put([K(1), K(2), K(3)], 1)
    # a key repeated inside one call: per-key path (the second one deduplicates against the first)
    jobs_p = per_key.put([K(1), K(2), K(3), K(1)], 1)
    assert [j.dst_slots for j in jobs_b] == [[0, 1, 2]] and [j.dst_slots for j in jobs_p] == [[0, 1, 2]]
    assert per_key.counters.puts_deduplicated == 1 and bulk.counters.puts_deduplicated == 0
    run_all(bulk, jobs_b)
    run_all(per_key, jobs_p)
    assert bulk.take_finished() == [(1, [True, True, True])]
    assert per_key.take_finished() == [(1, [True, True, True, True])]
    assert bulk.resident(0) == per_key.resident(0) == 3 and bulk.used == per_key.used
    # more keys than room: per-key path with waits and evictions, every key still stored
    jobs = bulk.put([K(i) for i in range(10, 17)], 2)
    run_all(bulk, jobs)
    assert bulk.take_finished() == [(2, [True] * 7)] and bulk.resident(0) == 8


def test_corrupt_read_is_a_miss_and_dropped():
    c = TierChain([TierSpec("disk", 4, slotted=False)])
    run_all(c, c.put([K(0), K(1)], 1))
    n, jobs = c.get([K(0), K(1)], 2)
    assert n == 2
    run_all(c, jobs, corrupt=lambda job, key: key == K(0))
    assert dict(c.take_finished())[2] == 0
    assert c.lookup([K(0)]) == 0 and c.lookup([K(1)]) == 1
    assert c.tier_counters[0].corrupt_dropped == 1
    assert c.used[0] == 1


def test_write_through_copies_down():
    c = three_tier(placement=PlacementPolicy(write_policy="write_through"))
    run_all(c, c.put([K(0)], 1))
    e = c.index.get(K(0))
    assert sorted(e.copies) == [0, 1, 2]


def test_prefetch_moves_up_hop_by_hop():
    c = three_tier(1, 2, 4, placement=PlacementPolicy(promote_on_hit=False))
    for i in range(5):
        run_all(c, c.put([K(i)], i + 1))
    assert c.locate([K(0)]) == [2]
    n, jobs = c.prefetch([K(0)], 0, 50)
    ran = run_all(c, jobs)
    assert [(j.src_tier, j.dst_tier) for j in ran if j.kind is JobKind.PROMOTE] == [(2, 1), (1, 0)]
    assert dict(c.take_finished())[50] == 1 and c.locate([K(0)]) == [0]


def test_prefetch_follows_a_promotion_already_in_flight():
    c = three_tier(1, 2, 4)
    for i in range(5):
        run_all(c, c.put([K(i)], i + 1))
    assert c.locate([K(0)]) == [2]
    n, get_jobs = c.get([K(0)], 10)  # the hit also starts a disk -> cpu promotion (waiting for room)
    assert 1 in c.index.get(K(0)).copies
    n, pf_jobs = c.prefetch([K(0)], 0, 11)  # follows that promotion instead of failing or starting another
    assert n == 1 and pf_jobs == []
    ran = run_all(c, get_jobs)
    assert [(j.src_tier, j.dst_tier) for j in ran if j.kind is JobKind.PROMOTE] == [(2, 1), (1, 0)]
    res = dict(c.take_finished())
    assert res[10] == 1 and res[11] == 1
    assert c.locate([K(0)]) == [0]
    assert c.inflight() == 0 and c.pinned() == 0 and c.waiting() == 0


def test_write_through_copy_lands_where_a_waiter_evicts_it_at_once():
    """A copy-down that lands in a full middle tier with waiters is evicted at once (demoted below):
    the write-through step after it must see the copy gone, not fail (found by a randomized A/B run)."""
    from tiered_kv.values.jobs import Completion

    c = TierChain([TierSpec("gpu", 4), TierSpec("cpu", 1), TierSpec("disk", 4, slotted=False)],
                  placement=PlacementPolicy(write_policy="write_through"))
    ingress = c.put([K(0), K(1)], 1)
    down = c.complete(Completion(ingress[0].job_id, [True, True]))
    assert [j.kind for j in down] == [JobKind.COPY_DOWN]  # K(0) got the cpu slot, K(1) waits for room
    jobs = c.complete(Completion(down[0].job_id, [True]))
    run_all(c, jobs)
    assert c.locate([K(0), K(1)]) == [0, 0]
    assert c.inflight() == 0 and c.waiting() == 0 and c.pinned() == 0
    assert c.resident(1) + c.resident(2) >= 2  # both blocks reached a lower tier (write-through holds)


def test_index_entry_deleted_defaults_false_and_is_per_entry():
    from tiered_kv.planner.index import BlockIndex, Copy, CopyState, Entry

    idx = BlockIndex(2)
    idx.compact_records = False  # Entries from the start (compact records: tests/planner/test_index.py)
    idx.add_new_many([b"a", b"b"], 0, [3, 4], CopyState.WRITING)
    a, b = idx.get(b"a"), idx.get(b"b")
    assert not a.deleted and not b.deleted and a.copies[0].slot == 3 and b.copies[0].slot == 4
    a.deleted = True
    assert a.deleted and not b.deleted and not Entry({1: Copy(CopyState.READY, 0)}).deleted
    assert Entry({1: Copy(CopyState.READY, 0)}).best() == 1
    with pytest.raises(AttributeError, match="no attribute 'bogus'"):
        a.bogus  # noqa: B018


def _readers(c: TierChain, jobs) -> list[tuple[str, int, int, bool]]:
    """Run ``jobs`` to the end; each job's kind, tiers and ``for_reader`` just before it completed."""
    seen = []
    run_all(c, jobs, fail=lambda job: seen.append((job.kind.name, job.src_tier, job.dst_tier,
                                                    c.for_reader(job.job_id))) or False)
    return seen


def test_for_reader_tells_a_readers_jobs_from_placement_copies():
    """What the vLLM connector feeds its split's read rates from (connector/vllm/loads.py ``load_done``)."""
    c = three_tier(1, 2, 4)  # promote_on_hit
    for i in range(5):
        run_all(c, c.put([K(i)], i + 1))
    _, jobs = c.get([K(0)], 10)
    seen = _readers(c, jobs)
    assert ("EGRESS", 2, -1, True) in seen  # the reader's load
    assert ("PROMOTE", 2, 1, False) in seen  # the promotion on the hit, one tier up
    assert all(not r for kind, *_, r in seen if kind == "DEMOTE")  # the room they made
    c = three_tier(1, 2, 4, placement=PlacementPolicy(promote_on_hit=False))
    for i in range(5):
        run_all(c, c.put([K(i)], i + 1))
    _, jobs = c.prefetch([K(0)], 0, 50)
    seen = _readers(c, jobs)
    assert [s for s in seen if s[0] == "PROMOTE"] == [("PROMOTE", 2, 1, True), ("PROMOTE", 1, 0, True)]
    assert c.for_reader(10**9) is False  # not (or no longer) in flight


def test_handles_items_done_reports_many_items_at_once():
    h = Handles()
    h.open(1, "get", 3)
    h.items_done(1, [0, 2], True)
    assert h.take() == []  # item 1 is pending
    h.item_done(1, 1, False)
    assert h.take() == [(1, 1)]  # a get's result: its leading items delivered
    h.open(2, "put", 2)
    h.items_done(2, range(2), True)
    assert h.take() == [(2, [True, True])]
    h.items_done(3, [0], True)  # an unknown (or finished) handle: nothing
    assert h.take() == []


def _view(jobs) -> list[tuple]:
    return [(j.job_id, j.kind, j.src_tier, j.dst_tier, list(j.keys), list(j.src_slots), list(j.dst_slots), j.handle)
            for j in jobs]


@pytest.mark.parametrize("seed", range(8))
def test_a_delivered_read_completes_per_job_as_it_would_per_item(seed):
    """``complete`` takes a read (EGRESS) that delivered every item in one pass (``RoomKeeper.unpin_all``,
    ``Handles.items_done``); a chain made to take every read item by item plans the same jobs and results. Gets
    over two tiers (a job's context per item) and one (the handle id), with reads failed, corrupt and missing."""
    rng = random.Random(seed)
    a, b = three_tier(gpu=3, cpu=4, disk=6), three_tier(gpu=3, cpu=4, disk=6)
    b_delivered, delivered = [], chain_mod._delivered

    def per_item(job, done):  # b never takes the per-job path; the reads it would have taken are counted
        b_delivered.append(job.kind is JobKind.EGRESS and delivered(job, done))
        return False

    pending, handle = [], 0
    contexts = {"list": 0, "handle": 0}
    with pytest.MonkeyPatch.context() as mp:
        for _ in range(400):
            handle += 1
            op = rng.random()
            keys = [K(rng.randrange(12)) for _ in range(rng.randrange(1, 6))]
            if op < 0.35:
                ja, jb = a.put(keys, handle), b.put(keys, handle)
            elif op < 0.6:
                first = rng.randrange(12)
                run = [K((first + i) % 12) for i in range(rng.randrange(1, 6))]
                (na, ja), (nb, jb) = a.get(run, handle), b.get(run, handle)
                assert na == nb
                for j in ja:
                    if j.kind is JobKind.EGRESS:
                        contexts["handle" if a._ctx[j.job_id] == handle else "list"] += 1
            else:
                ja = jb = []
                if pending:
                    job = pending.pop(rng.randrange(len(pending)))
                    ok = [rng.random() > 0.1 for _ in job.keys]
                    bad = [not o and rng.random() < 0.3 for o in ok]
                    gone = [not o and not c and rng.random() < 0.3 for o, c in zip(ok, bad)]
                    done = Completion(job.job_id, ok, bad, missing=gone)
                    ja = a.complete(done)
                    mp.setattr(chain_mod, "_delivered", per_item)
                    jb = b.complete(done)
                    mp.undo()
            assert _view(ja) == _view(jb)
            pending += ja
            assert a.take_finished() == b.take_finished()
            universe = [K(i) for i in range(12)]
            assert a.locate(universe) == b.locate(universe)
            assert a.used == b.used and a.pinned() == b.pinned() and a.waiting() == b.waiting()
    assert vars(a.counters) == vars(b.counters)
    assert [vars(t) for t in a.tier_counters] == [vars(t) for t in b.tier_counters]
    assert sum(b_delivered) > 20  # the per-job path was taken on a's side, many times
    assert contexts["list"] and contexts["handle"]  # reads over several tiers and over one


@pytest.mark.parametrize("handle", [7, True, "h7"], ids=["int", "bool", "str"])
def test_a_one_tier_get_keeps_the_handle_id_as_context_only_when_it_is_an_int(handle):
    """``complete`` tells a job whose item i is the handle's item i by its context's class (``int``): a handle of
    another class (a bool, a string) gets a tuple per item, and its get completes all the same."""
    c = three_tier()
    run_all(c, c.put([K(1), K(2)], 1))
    c.take_finished()
    n, jobs = c.get([K(1), K(2)], handle)
    assert n == 2 and [j.kind for j in jobs] == [JobKind.EGRESS]
    assert (c._ctx[jobs[0].job_id] == handle) == (handle.__class__ is int)
    run_all(c, jobs)
    assert c.take_finished() == [(handle, 2)] and c.pinned() == 0
