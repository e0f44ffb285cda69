"""Room-making: room per tier, waiters for a full tier, eviction by policy, copies leaving.

The first tests drive a ``RoomKeeper`` alone, over its own ``BlockIndex`` and policies, with
the chain's two callbacks recorded; the last ones see the same rules through ``TierChain``.
Pure Python, no bytes moved.
"""
from __future__ import annotations

import random

from tests.planner._driver import K, run_all, three_tier
from tiered_kv.planner.chain import TierChain
from tiered_kv.planner.counters import ChainCounters, TierCounters
from tiered_kv.planner.index import BlockIndex, Copy, CopyState
from tiered_kv.planner.policy import LRUPolicy
from tiered_kv.planner.room import RoomKeeper, TierSpec
from tiered_kv.values.jobs import NO_SLOT, Completion, JobKind, TransferJob


class Keeper:
    """A RoomKeeper with what it shares with a chain, recording the jobs and losses it reports."""

    def __init__(self, *specs: TierSpec) -> None:
        self.index = BlockIndex(len(specs))
        self.policies = [LRUPolicy() for _ in specs]
        self.tier_counters = [TierCounters() for _ in specs]
        self.counters = ChainCounters()
        self.jobs: list[TransferJob] = []
        self.lost: list[tuple[bytes, int]] = []
        self.room = RoomKeeper(list(specs), self.index, self.policies, self.tier_counters, self.counters,
                               job=self._job, lost=lambda key, t: self.lost.append((key, t)))

    def _job(self, kind, src, dst, key, src_slot, dst_slot) -> TransferJob:
        job = TransferJob(len(self.jobs) + 1, kind, src, dst, [key], [src_slot], [dst_slot])
        self.jobs.append(job)
        return job

    def land(self, key: bytes, t: int) -> Copy:
        """Put a READY copy of ``key`` in ``t`` (room taken now), as a finished put would."""
        c = Copy(CopyState.READY, self.room.take(t))
        self.index.add_copy(key, t, c)
        self.policies[t].insert(key)
        return c


class Waiter:
    """Records what the room keeper does with one reservation."""

    def __init__(self) -> None:
        self.granted: list[int] = []
        self.refused = 0

    def grant(self, slot: int) -> list:
        self.granted.append(slot)
        return []

    def refuse(self) -> list:
        self.refused += 1
        return []


def test_take_hands_out_slots_and_take_run_takes_all_or_nothing():
    k = Keeper(TierSpec("cpu", 4), TierSpec("disk", 3, slotted=False))
    assert k.room.take_run(0, 3) == [0, 1, 2]  # what three take() calls would give
    assert k.room.take_run(0, 2) is None and k.room.used[0] == 3  # short of room: nothing taken
    assert k.room.take(0) == 3 and k.room.take(0) is None
    assert k.room.take_run(1, 3) == [NO_SLOT] * 3 and k.room.take(1) is None
    assert k.room.used == [4, 3]


def test_slots_come_in_the_order_of_a_full_free_list():
    """The keeper keeps only given-back slots in a list (never-used ones are a counter): every take, take_run and
    release must hand out exactly what a list of every slot, [capacity-1 .. 0] popped from the end, would."""
    rng = random.Random(7)
    for _ in range(200):
        cap = rng.randrange(1, 40)
        k = Keeper(TierSpec("cpu", cap))
        model = list(range(cap - 1, -1, -1))
        held: list[int] = []
        for _ in range(150):
            r = rng.random()
            if r < 0.35:
                got = k.room.take(0)
                assert got == (model.pop() if model else None)
                if got is not None:
                    held.append(got)
            elif r < 0.65:
                n = rng.randrange(1, 9)
                got = k.room.take_run(0, n)
                if len(model) < n:
                    assert got is None
                else:
                    want = [model.pop() for _ in range(n)]
                    assert got == want
                    held += got
            elif held:
                slot = held.pop(rng.randrange(len(held)))
                assert k.room._release(0, slot) == []
                model.append(slot)
        assert k.room.used[0] == len(held) == cap - len(model)


def test_a_waiter_gets_the_room_its_eviction_frees():
    k = Keeper(TierSpec("cpu", 2), TierSpec("disk", 4, slotted=False))
    src = k.land(K(0), 0)
    k.land(K(1), 0)
    w = Waiter()
    status, slot, jobs = k.room.reserve(0, w.grant, w.refuse)
    assert (status, slot) == ("wait", NO_SLOT) and k.room.waiting() == 1
    # the least recently used block is demoted; disk had room, so the copy down starts now
    assert [(j.kind, j.src_tier, j.dst_tier, j.keys) for j in jobs] == [(JobKind.DEMOTE, 0, 1, [K(0)])]
    assert src.leaving and src.pins == 1 and k.room.pins == 1 and k.room.leaving == [1, 0]
    assert k.tier_counters[0].evictions == 1
    # the demotion commits: the mover lets go of the source, the copy below is READY, the source goes
    assert k.room.unpin(K(0), 0) == []
    k.index.get(K(0)).copies[1].state = CopyState.READY
    assert k.room.demote_done(K(0), 0, True) == []
    assert w.granted == [src.slot] and k.room.waiting() == 0
    assert k.room.used == [2, 1] and k.room.leaving == [0, 0] and k.room.pins == 0
    assert sorted(k.index.get(K(0)).copies) == [1]


def test_a_tier_of_no_room_refuses_at_once():
    k = Keeper(TierSpec("cpu", 0))
    w = Waiter()
    assert k.room.reserve(0, w.grant, w.refuse) == ("refused", NO_SLOT, [])
    assert k.room.waiting() == 0 and not w.granted and not w.refused


def test_a_wanted_copy_is_evicted_only_when_nothing_else_can_be():
    k = Keeper(TierSpec("cpu", 2))
    k.land(K(0), 0).wanted = 1  # a waiting copy up will read it
    k.land(K(1), 0)
    w1, w2 = Waiter(), Waiter()
    k.room.reserve(0, w1.grant, w1.refuse)  # the last tier drops its victim: room at once
    assert w1.granted and K(1) not in k.index and K(0) in k.index
    k.room.reserve(0, w2.grant, w2.refuse)  # only the wanted copy is left: taken rather than stall
    assert w2.granted and K(0) not in k.index


def test_a_pinned_copy_is_evicted_once_its_reader_lets_go():
    k = Keeper(TierSpec("cpu", 1))
    c = k.land(K(0), 0)
    c.pins += 1  # a reader
    k.room.pins += 1
    w = Waiter()
    assert k.room.reserve(0, w.grant, w.refuse) == ("wait", NO_SLOT, [])  # nothing evictable yet
    assert k.room.waiting() == 1 and k.room.leaving == [0]
    k.room.unpin(K(0), 0)
    assert w.granted == [c.slot] and K(0) not in k.index and k.room.pins == 0


def test_a_failed_demotion_into_a_slab_tier_keeps_its_source_and_refuses_one_waiter():
    k = Keeper(TierSpec("gpu", 1), TierSpec("cpu", 2))
    src = k.land(K(0), 0)
    w = Waiter()
    _, _, jobs = k.room.reserve(0, w.grant, w.refuse)
    assert [j.kind for j in jobs] == [JobKind.DEMOTE]
    # the copy down failed: the chain unpins the source, removes the destination, then reports
    k.room.unpin(K(0), 0)
    k.room.remove(K(0), 1)
    assert k.lost == [(K(0), 1)] and k.room.used == [1, 0]
    assert k.room.demote_done(K(0), 0, False) == []
    assert w.refused == 1 and not w.granted and k.room.waiting() == 0
    assert not src.leaving and k.room.leaving == [0, 0] and k.index.get(K(0)).copies[0] is src
    assert k.policies[0].victims(1, lambda key: True) == [K(0)]  # evictable again
    assert k.tier_counters[0].demotions_dropped == 0


def test_a_failed_demotion_into_a_best_effort_tier_drops_its_source_and_grants_the_waiter():
    assert TierSpec("disk", 2, slotted=False).best_effort and not TierSpec("cpu", 2).best_effort
    k = Keeper(TierSpec("cpu", 1), TierSpec("disk", 2, slotted=False))
    src = k.land(K(0), 0)
    w = Waiter()
    _, _, jobs = k.room.reserve(0, w.grant, w.refuse)
    assert [j.kind for j in jobs] == [JobKind.DEMOTE]
    k.room.unpin(K(0), 0)  # the copy down failed (a dead node, a full disk): as above ...
    k.room.remove(K(0), 1)
    assert k.room.demote_done(K(0), 0, False) == []
    # ... but the block is let go: its room goes to the waiter, nothing is refused, the drop is counted
    assert w.granted == [src.slot] and w.refused == 0 and k.room.waiting() == 0
    assert K(0) not in k.index and k.room.leaving == [0, 0] and k.room.used == [1, 0]
    assert k.tier_counters[0].demotions_dropped == 1 and k.counters.blocks_out == 1


def test_dropping_a_keyed_copy_deletes_its_record_before_freeing_the_room():
    k = Keeper(TierSpec("disk", 2, slotted=False))
    k.land(K(0), 0)
    jobs = k.room.drop(K(0), 0)
    assert [(j.kind, j.keys) for j in jobs] == [(JobKind.DELETE, [K(0)])]
    assert k.room.drop(K(0), 0) == []  # already being deleted
    assert k.room.used == [1] and K(0) in k.index
    assert k.room.delete_done(K(0), 0) == []
    assert k.room.used == [0] and K(0) not in k.index
    assert k.counters.blocks_out == 1 and k.tier_counters[0].blocks_out == 1


def test_removing_a_queued_copy_releases_no_room_and_reports_it_lost():
    k = Keeper(TierSpec("cpu", 1))
    k.index.add_copy(K(0), 0, Copy(CopyState.QUEUED, NO_SLOT))
    assert k.room.remove(K(0), 0) == []
    assert k.lost == [(K(0), 0)] and k.room.used == [0] and K(0) not in k.index
    assert k.counters.blocks_out == 1


def test_occupy_counts_adopted_blocks_and_evicts_beyond_capacity():
    k = Keeper(TierSpec("disk", 2, slotted=False))
    for i in range(3):
        k.index.add_copy(K(i), 0, Copy(CopyState.READY, NO_SLOT))
        k.policies[0].insert(K(i))
    jobs = k.room.occupy(0, 3)
    assert [(j.kind, j.keys) for j in jobs] == [(JobKind.DELETE, [K(0)])]
    assert k.room.used == [3] and k.tier_counters[0].evictions == 1
    k.room.delete_done(K(0), 0)
    assert k.room.used == [2]


# ---------------------------------------------------------------- the same rules, through TierChain


def test_failed_demotion_keeps_source_and_counts():
    c = three_tier(1, 1, 2)
    run_all(c, c.put([K(0)], 1))
    jobs = c.put([K(1)], 2)
    ran = run_all(c, jobs, fail=lambda j: j.kind is JobKind.DEMOTE)
    assert any(j.kind is JobKind.DEMOTE for j in ran)
    assert c.locate([K(0)]) == [0]  # source kept after the failed copy
    assert dict(c.take_finished())[2] == [False]  # the put that needed the room was refused
    assert c.tier_counters[1].failed_transfers == 1
    assert c.inflight() == 0 and c.pinned() == 0


def test_reader_pin_blocks_slot_reuse():
    c = TierChain([TierSpec("cpu", 1)])
    run_all(c, c.put([K(0)], 1))
    n, get_jobs = c.get([K(0)], 2)  # pinned until its job completes
    assert c.pinned() == 1 == sum(cp.pins for _, e in c.index.items() for cp in e.copies.values())
    put_jobs = c.put([K(1)], 3)
    assert not put_jobs and c.waiting() == 1  # K(1) waits: the only slot is being read
    more = c.complete(Completion(get_jobs[0].job_id, [True]))
    assert [j.kind for j in more] == [JobKind.INGRESS] and more[0].dst_slots == get_jobs[0].src_slots
    run_all(c, more)
    assert c.lookup([K(1)]) == 1 and c.lookup([K(0)]) == 0
    assert c.pinned() == 0 and c.job(get_jobs[0].job_id) is None


def test_zero_capacity_refuses():
    c = TierChain([TierSpec("cpu", 0)])
    assert c.put([K(0)], 1) == []
    assert dict(c.take_finished())[1] == [False]
    assert c.counters.puts_refused == 1
