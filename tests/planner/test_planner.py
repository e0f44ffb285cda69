"""Planner unit tests: TierChain, policies, radix index, keys, config. Pure Python, no bytes moved.

Jobs are 'executed' by a tiny driver that only reports success/failure, which is exactly
what the planner sees from real movers.
"""
from __future__ import annotations

import pytest

from tiered_kv.planner.chain import TierChain, TierSpec
from tiered_kv.store.config import StoreConfig
from tiered_kv.errors import ConfigError, InvalidInputError
from tiered_kv.values.keys import Namespace, chain_keys, check_key
from tiered_kv.planner.policy import LRUPolicy, PlacementPolicy, S3FIFOPolicy, make_policy
from tiered_kv.planner.radix import RadixIndex
from tiered_kv.values.record import HEADER_LEN, RecordHeader
from tiered_kv.errors import RecordError
from tiered_kv.values.jobs import Completion, JobKind, TransferJob
from tiered_kv.values.units import format_size, parse_size


def run_all(chain: TierChain, jobs, fail=lambda job: False, corrupt=lambda job, key: False):
    """Complete jobs (and what they unblock) until none are left; returns every job run."""
    seen = []
    while jobs:
        job = jobs.pop(0)
        seen.append(job)
        n = len(job)
        bad = fail(job)
        cor = [corrupt(job, k) for k in job.keys]
        jobs += chain.complete(Completion(job.job_id, [not bad and not c for c in cor], cor))
    return seen


def K(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def three_tier(gpu=2, cpu=3, disk=5, **kw) -> TierChain:
    return TierChain([TierSpec("gpu", gpu), TierSpec("cpu", cpu), TierSpec("disk", disk, slotted=False)], **kw)


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


def test_zero_capacity_refuses():
    c = TierChain([TierSpec("cpu", 0)])
    assert c.put([K(0)], 1) == []
    assert dict(c.take_finished())[1] == [False]
    assert c.counters.puts_refused == 1


def test_jobs_roundtrip_as_plain_data():
    job = TransferJob(7, JobKind.DEMOTE, 0, 1, [K(1)], [3], [4], 9)
    assert TransferJob.from_dict(job.to_dict()) == job
    done = Completion(7, [True], [False], 10, 0.5, "")
    assert Completion.from_dict(done.to_dict()) == done


@pytest.mark.parametrize("cls", [LRUPolicy, S3FIFOPolicy])
def test_policies_respect_evictable(cls):
    p = cls()
    for i in range(10):
        p.insert(K(i))
    v = p.victims(3, lambda k: k != K(0))
    assert len(v) == 3 and K(0) not in v and len(set(v)) == 3
    for k in v:
        p.remove(k)
    assert len(p) == 7


def test_lru_order():
    p = LRUPolicy()
    for i in range(4):
        p.insert(K(i))
    p.access(K(0))
    assert p.victims(2, lambda k: True) == [K(1), K(2)]


def test_s3fifo_is_scan_resistant():
    p = S3FIFOPolicy()
    hot = [K(i) for i in range(5)]
    for k in hot:
        p.insert(k)
    for k in hot:
        p.access(k)
    resident = set(hot)
    for i in range(100, 200):  # a one-pass scan of new blocks, capacity 10
        p.insert(K(i))
        resident.add(K(i))
        while len(resident) > 10:
            v = p.victims(1, lambda k: True)[0]
            p.remove(v)
            resident.discard(v)
    assert sum(k in resident for k in hot) == 5  # the hot set survived the scan


def test_make_policy_rejects_unknown():
    with pytest.raises(ConfigError, match="'lfu'"):
        make_policy("lfu")


def test_radix_match_insert_evict():
    r = RadixIndex(page_size=2, max_pages=3)
    r.insert([1, 2, 3, 4, 5], [K(1), K(2)])
    assert r.match([1, 2, 3, 4, 9, 9]) == [K(1), K(2)]
    assert r.match([1, 2, 7, 7]) == [K(1)]
    assert r.match([9]) == []
    r.insert([7, 7, 8, 8], [K(7), K(8)])
    assert len(r) <= 3
    with pytest.raises(InvalidInputError):
        r.insert([1, 2], [K(1), K(2)])


def test_chain_keys_prefix_property_and_namespaces():
    ns = Namespace("m", 1)
    a = chain_keys(ns, list(range(40)), 16)
    b = chain_keys(ns, list(range(32)) + [99] * 16, 16)
    assert len(a) == 2 and a == b[:2] and len(b) == 3
    other = chain_keys(Namespace("m", 1, salt="tenant-b"), list(range(40)), 16)
    assert not set(a) & set(other)
    assert all(len(k) == 32 and k[:8] == ns.prefix for k in a)
    assert ns.key(b"x") != Namespace("m2", 1).key(b"x")
    with pytest.raises(InvalidInputError):
        check_key("not-bytes")
    with pytest.raises(InvalidInputError):
        check_key(b"")


def test_sizes():
    assert parse_size("64GiB") == 64 << 30 and parse_size("1.5 KB") == 1500 and parse_size(7) == 7
    for bad in ("12 parsecs", -1, True, "x"):
        with pytest.raises(ConfigError):
            parse_size(bad, "cpu_bytes")
    assert format_size(3 << 30) == "3.0 GiB"


def test_config_strict():
    with pytest.raises(ConfigError, match="cpu_byte") as e:
        StoreConfig.from_dict({"cpu_byte": "1GiB"})
    assert "cpu_bytes" in str(e.value)  # lists the valid keys
    cfg = StoreConfig.from_dict({"cpu_bytes": "2MiB", "block_shape": [2, 8], "dtype": "bf16"})
    assert cfg.cpu_bytes == 2 << 20 and cfg.dtype == "bfloat16" and cfg.block_shape == (2, 8)
    for bad in ({"eviction": "mru"}, {"dtype": "float64"}, {"block_shape": [0, 2]}, {"page_size": 0},
                {"cpu_bytes": 0, "gpu_bytes": 0}, {"promote_on_hit": "yes"}):
        with pytest.raises(ConfigError):
            StoreConfig.from_dict(bad)


def test_config_from_yaml_and_json(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("cpu_bytes: 4MiB\neviction: s3fifo\n")
    assert StoreConfig.from_file(y).eviction == "s3fifo"
    j = tmp_path / "c.json"
    j.write_text('{"cpu_bytes": "1MiB", "nope": 1}')
    with pytest.raises(ConfigError, match="nope"):
        StoreConfig.from_file(j)


def test_record_header_roundtrip_and_tamper():
    h = RecordHeader(0, 42, 3, 100, 100, 12345)
    raw = h.pack(K(1))
    assert len(raw) == HEADER_LEN
    back = RecordHeader.unpack(K(1), raw)
    assert (back.slot, back.raw_len, back.payload_xxh, back.layout_fp) == (3, 100, 12345, 42)
    with pytest.raises(RecordError):
        RecordHeader.unpack(K(2), raw)  # moved to another key
    flipped = bytearray(raw)
    flipped[20] ^= 1
    with pytest.raises(RecordError):
        RecordHeader.unpack(K(1), bytes(flipped))


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
