"""Governed tiers: the medium keeps its own budget (a shared disk directory, a Redis cluster).

The planner never waits for room there and never picks victims there; copies there are hints the
medium may drop at any time (``TierChain.forget``, ``Completion.evicted``, or a read that finds the
record missing). Pure Python, no bytes moved.
"""
from __future__ import annotations

import pytest

from tests.planner._driver import K, run_all
from tiered_kv.errors import ConfigError
from tiered_kv.planner.chain import TierChain, TierSpec
from tiered_kv.values.jobs import Completion, JobKind


def chain(cpu=2, remote=1, **kw) -> TierChain:
    return TierChain([TierSpec("cpu", cpu), TierSpec("remote", remote, slotted=False, governed=True)], **kw)


def test_a_governed_tier_must_be_keyed():
    with pytest.raises(ConfigError, match="governed"):
        TierSpec("x", 4, slotted=True, governed=True)


def test_writes_into_a_governed_tier_never_wait_or_evict_there():
    c = chain(cpu=2, remote=1)
    jobs = run_all(c, c.put([K(i) for i in range(6)], 1))
    # 6 blocks through a 2-block cpu tier: 4 demoted into the governed tier, although its informative
    # capacity is 1; the planner issued no DELETE there (the medium evicts by itself)
    assert sum(len(j) for j in jobs if j.kind is JobKind.DEMOTE) == 4
    assert not any(j.kind is JobKind.DELETE for j in jobs)
    assert c.locate([K(i) for i in range(6)]) == [1, 1, 1, 1, 0, 0]
    assert c.resident(1) == 4 and c.waiting() == 0 and c.inflight() == 0


def test_forget_drops_hints_and_a_pinned_copy_goes_when_its_reader_ends():
    c = chain(cpu=2)
    run_all(c, c.put([K(i) for i in range(4)], 1))
    assert c.locate([K(0), K(1)]) == [1, 1]
    assert c.forget(1, [K(0), b"\x00" * 32]) == []  # unknown keys are ignored
    assert c.locate([K(0), K(1)]) == [None, 1] and c.resident(1) == 1
    n, jobs = c.get([K(1)], 2)  # a read pins K(1) in the governed tier (and promotes it)
    assert n == 1
    c.forget(1, [K(1)])  # the medium dropped it while the read runs: forgotten when the read ends
    run_all(c, jobs)
    assert c.tier_counters[1].vanished == 2 and c.pinned() == 0
    e = c.index.get(K(1))
    assert e is None or 1 not in e.copies  # the governed copy is forgotten once the read let go


def test_completion_evicted_forgets_what_the_medium_dropped_for_room():
    c = chain(cpu=1)
    first = c.put([K(0)], 1)
    run_all(c, first)
    demote = c.put([K(1)], 2)  # cpu full: K(0) is demoted into the governed tier
    assert [j.kind for j in demote] == [JobKind.INGRESS, JobKind.DEMOTE] or demote
    jobs = list(demote)
    seen = []
    while jobs:
        job = jobs.pop(0)
        seen.append(job)
        done = Completion(job.job_id, [True] * len(job))
        jobs += c.complete(done)
    assert c.locate([K(0)]) == [1]
    third = c.put([K(2)], 3)  # demotes K(1); the medium makes room by dropping K(0)
    jobs = list(third)
    while jobs:
        job = jobs.pop(0)
        evicted = [K(0)] if job.kind is JobKind.DEMOTE else []
        jobs += c.complete(Completion(job.job_id, [True] * len(job), evicted=evicted))
    assert c.locate([K(0), K(1), K(2)]) == [None, 1, 0]
    assert c.tier_counters[1].vanished == 1


def test_a_read_of_a_vanished_record_is_a_miss_not_an_error():
    c = chain(cpu=1)
    run_all(c, c.put([K(0), K(1)], 1))
    assert c.locate([K(0)]) == [1]
    n, jobs = c.get([K(0)], 2)
    assert n == 1
    while jobs:  # the medium says of every read of it: not there any more
        job = jobs.pop(0)
        missing = [job.src_tier == 1 and k == K(0) for k in job.keys]
        jobs += c.complete(Completion(job.job_id, [not m for m in missing], missing=missing))
    assert c.locate([K(0)]) == [None] and c.tier_counters[1].vanished >= 1  # counted per read that found it gone
    assert c.tier_counters[1].failed_transfers == 0 and c.pinned() == 0


def test_copy_to_writes_new_blocks_straight_to_the_governed_tier():
    from tiered_kv.planner.policy import PlacementPolicy

    c = TierChain([TierSpec("cpu", 4), TierSpec("disk", 8, slotted=False),
                   TierSpec("remote", 0, slotted=False, governed=True)],
                  placement=PlacementPolicy("write_back", copy_to=(2,)))
    jobs = run_all(c, c.put([K(0), K(1)], 1))
    downs = [j for j in jobs if j.kind is JobKind.COPY_DOWN]
    assert [(j.src_tier, j.dst_tier) for j in downs] == [(0, 2), (0, 2)]  # cpu -> remote, disk skipped
    assert c.locate([K(0), K(1)]) == [0, 0] and c.resident(2) == 2 and c.resident(1) == 0
    with pytest.raises(ConfigError, match="copy_to"):
        PlacementPolicy(copy_to=(0,))


def test_a_dead_remote_node_never_wedges_the_cpu_tier():
    """Issue 29, planner side: every write to the keys of one "dead node" fails (write-through and demotion alike).
    Before, those blocks could not leave the CPU tier, filled it, and then every put was refused; now a block whose
    demotion failed is dropped (counted) and each new put is accepted."""
    from tiered_kv.planner.policy import PlacementPolicy

    c = TierChain([TierSpec("cpu", 8), TierSpec("remote", 0, slotted=False, governed=True)],
                  placement=PlacementPolicy("write_back", copy_to=(1,)))
    dead = {K(i) for i in range(200) if i % 3 == 0}  # a third of the keys live on the dead node

    def fails(job):  # a job into the remote tier with a dead node's key fails (one key per job here)
        return job.dst_tier == 1 and job.keys[0] in dead

    accepted = []
    for i in range(200):
        run_all(c, c.put([K(i)], i + 1), fail=fails)
        accepted += dict(c.take_finished())[i + 1]
    assert all(accepted) and c.counters.puts_refused == 0
    assert c.tier_counters[0].demotions_dropped == len(dead) - sum(1 for i in range(192, 200) if K(i) in dead)
    assert c.locate([K(i) for i in range(192, 200)]) == [0] * 8  # the newest are in the CPU tier, readable
    assert all(c.locate([k]) == [None] for k in dead if k not in {K(i) for i in range(192, 200)})  # lost: misses
    assert c.waiting() == 0 and c.inflight() == 0 and c.pinned() == 0 and c.leaving == [0, 0]


def test_a_failed_demotion_out_of_disk_frees_disk_room_for_the_cpu_tier_s_demotion():
    """cpu -> disk (planner-managed, as with a remote tier below) -> remote: when disk -> remote fails, the disk
    copy is deleted and its room goes to the CPU's waiting demotion; puts are accepted throughout."""
    c = TierChain([TierSpec("cpu", 2), TierSpec("disk", 2, slotted=False),
                   TierSpec("remote", 0, slotted=False, governed=True)])
    accepted = []
    for i in range(10):
        jobs = run_all(c, c.put([K(i)], i + 1), fail=lambda j: j.dst_tier == 2)
        accepted += dict(c.take_finished())[i + 1]
        assert not any(j.kind is JobKind.DEMOTE and j.dst_tier == 2 and j.src_tier != 1 for j in jobs)
    assert all(accepted)
    assert c.locate([K(i) for i in range(10)]) == [None] * 6 + [1, 1, 0, 0]
    assert c.tier_counters[1].demotions_dropped == 6 and c.tier_counters[2].failed_transfers == 6
    assert c.tier_counters[0].demotions_dropped == 0 and c.resident(2) == 0
    assert c.waiting() == 0 and c.inflight() == 0 and c.pinned() == 0


def test_a_copy_down_settles_before_its_source_can_be_evicted():
    """A put waits for the CPU tier's only block while that block's write-through copy runs. When the copy ends,
    its outcome is applied before the source is let go: a copy that landed lets the source drop for free; a copy
    that failed leaves the block to be demoted (and, failing again, dropped and counted), never dropped on the
    strength of a copy below that was still being written (found by the vLLM fault test)."""
    from tiered_kv.planner.policy import PlacementPolicy

    for landed in (True, False):
        c = TierChain([TierSpec("cpu", 1), TierSpec("remote", 0, slotted=False, governed=True)],
                      placement=PlacementPolicy("write_back", copy_to=(1,)))
        (ingress,) = c.put([K(0)], 1)
        (copy_down,) = c.complete(Completion(ingress.job_id, [True]))
        assert copy_down.kind is JobKind.COPY_DOWN
        assert c.put([K(1)], 2) == [] and c.waiting() == 1  # K(0) is pinned by its copy down: K(1) waits
        jobs = c.complete(Completion(copy_down.job_id, [landed]))
        if landed:
            assert [j.kind for j in jobs] == [JobKind.INGRESS]  # K(0) dropped from the CPU: its copy is in Redis
            assert c.locate([K(0)]) == [1]
        else:
            assert [j.kind for j in jobs] == [JobKind.DEMOTE]  # one more try to copy it down
            jobs = c.complete(Completion(jobs[0].job_id, [False]))
            assert [j.kind for j in jobs] == [JobKind.INGRESS]
            assert c.locate([K(0)]) == [None] and c.tier_counters[0].demotions_dropped == 1
        run_all(c, jobs)
        assert dict(c.take_finished())[2] == [True] and c.locate([K(1)]) == [0]
        assert c.waiting() == 0 and c.inflight() == 0 and c.pinned() == 0


def test_forget_unreadable_copies_is_not_counted_as_vanished():
    c = chain(cpu=1)
    run_all(c, c.put([K(0), K(1)], 1))
    assert c.locate([K(0)]) == [1]
    run_all(c, c.forget(1, [K(0)], unreadable=True))  # a node down: the owner chose to recompute instead
    assert c.locate([K(0)]) == [None] and c.tier_counters[1].vanished == 0 and c.resident(1) == 0


def pool_chain(*above: TierSpec) -> TierChain:
    """``above`` (a GPU slab, or nothing) -> a governed host pool -> a disk the planner manages."""
    return TierChain([*above, TierSpec("cpu", 2, slotted=False, governed=True), TierSpec("disk", 64, slotted=False)])


def test_a_governed_tier_at_index_0_takes_every_put_and_copies_each_block_down_at_once():
    """A host pool as the fastest tier (the Python API with ``cpu_pool`` and no GPU tier): its capacity is
    informative (the pool is shared), puts never wait there, and every block that lands is copied to the disk
    at once, so the pool's own evictions (``Completion.evicted``) lose nothing."""
    c = pool_chain()
    jobs = run_all(c, c.put([K(i) for i in range(6)], 1))
    assert dict(c.take_finished())[1] == [True] * 6 and c.counters.puts_refused == 0
    downs = [(j.src_tier, j.dst_tier, k) for j in jobs if j.kind is JobKind.COPY_DOWN for k in j.keys]
    assert sorted(downs) == sorted((0, 1, K(i)) for i in range(6))
    assert not any(j.kind in (JobKind.DEMOTE, JobKind.DELETE) for j in jobs)  # the pool evicts by itself
    assert c.locate([K(i) for i in range(6)]) == [0] * 6 and c.resident(1) == 6
    c.forget(0, [K(0), K(1)])  # the pool dropped two for another process's writes: the disk still has them
    n, jobs = c.get([K(0), K(1), K(2)], 2)
    assert n == 3 and c.locate([K(0)]) == [1]
    jobs = run_all(c, jobs)
    promoted = [k for j in jobs if j.kind is JobKind.PROMOTE and (j.src_tier, j.dst_tier) == (1, 0) for k in j.keys]
    assert sorted(promoted) == sorted([K(0), K(1)])
    assert not any(j.kind is JobKind.COPY_DOWN for j in jobs)  # promoted copies have theirs below already
    assert c.locate([K(0), K(1)]) == [0, 0] and c.waiting() == 0 and c.inflight() == 0 and c.pinned() == 0


def test_demotions_into_a_governed_middle_tier_are_copied_down_too():
    """GPU slab -> host pool -> disk: a block the GPU tier demotes into the pool goes on to the disk."""
    c = pool_chain(TierSpec("gpu", 1))
    jobs = run_all(c, c.put([K(i) for i in range(3)], 1))
    assert [(j.kind, j.src_tier, j.dst_tier) for j in jobs if j.kind is not JobKind.INGRESS].count(
        (JobKind.COPY_DOWN, 1, 2)) == 2
    assert c.locate([K(0), K(1), K(2)]) == [1, 1, 0] and c.resident(2) == 2
    assert c.waiting() == 0 and c.inflight() == 0


def test_a_governed_tier_at_the_bottom_copies_nothing():
    c = chain(cpu=1)
    jobs = run_all(c, c.put([K(0), K(1), K(2)], 1))
    assert not any(j.kind is JobKind.COPY_DOWN for j in jobs)


def test_a_put_the_governed_tier_refuses_lands_in_the_tier_below():
    """The pool had no room it may take (every slot read by other processes, or ours on their way down): the put
    goes to the disk instead of being refused; refused only when the disk refuses too."""
    c = pool_chain()
    jobs = run_all(c, c.put([K(i) for i in range(4)], 1), fail=lambda j: j.kind is JobKind.INGRESS and j.dst_tier == 0)
    assert dict(c.take_finished())[1] == [True] * 4 and c.counters.puts_refused == 0
    assert [(j.dst_tier, len(j)) for j in jobs if j.kind is JobKind.INGRESS] == [(0, 4)] + [(1, 1)] * 4
    assert c.locate([K(i) for i in range(4)]) == [1] * 4 and c.resident(0) == 0
    run_all(c, c.put([K(9)], 2), fail=lambda j: j.kind is JobKind.INGRESS)
    assert dict(c.take_finished())[2] == [False] and c.locate([K(9)]) == [None]
    assert c.waiting() == 0 and c.inflight() == 0 and c.used == [0, 4]
