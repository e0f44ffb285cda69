"""The host pool in one process: geometry and config checks, permissions, the shared pages handed out by
``lease``/``reserve``, the budget and namespaces, and when a pool is made, joined and removed.

Several processes on one pool are tests/reliability/test_pool.py. Every pool here is real: LMDB and payload
in ``/dev/shm`` (tests/_pool.py names them).
"""
from __future__ import annotations

import os
import stat

import pytest
import torch

from tests._pool import assert_gone, pool_path, pool_spec
from tiered_kv.errors import ConfigError, InvalidInputError
from tiered_kv.testing import LAYOUT, make_keys, random_rows
from tiered_kv.tiers.pool import PoolTier, user_root
from tiered_kv.values.layout import BlockLayout

NB = LAYOUT.nbytes
A, B = b"A" * 8, b"B" * 8  # two namespaces' prefixes


def keys_of(owner: bytes, n: int, start: int = 0) -> list[bytes]:
    """``n`` keys of namespace ``owner`` (its prefix first, as the store makes them)."""
    return [owner + i.to_bytes(24, "little") for i in range(start, start + n)]


@pytest.fixture
def pools():
    """Open pools with ``pools(spec, blocks, **kw)``; every one is closed at the end of the test."""
    opened: list[PoolTier] = []

    def make(spec: str, blocks: int, **kw) -> PoolTier:
        tier = PoolTier(LAYOUT, spec, blocks * NB, **kw)
        opened.append(tier)
        return tier

    yield make
    for t in opened:
        t.close()


def test_a_joiner_of_another_size_or_block_gets_a_config_error_naming_both(pools):
    spec = pool_spec("geo")
    pools(spec, 8)
    with pytest.raises(ConfigError, match=r"is 4096 bytes \(8 blocks\).*cpu_bytes of 16 blocks"):
        pools(spec, 16)
    other = BlockLayout((2, 4, 16), "float16")
    with pytest.raises(ConfigError, match=r"blocks of 512 bytes, this store's are 256"):
        PoolTier(other, spec, 16 * other.nbytes)
    assert pool_path(spec).exists()  # a refused joiner leaves the live pool alone


@pytest.mark.parametrize("spec", ["a", "host:", "host:../x", "host:a/b", "host:.hidden", "redis://x", None])
def test_bad_pool_names_are_refused(spec):
    with pytest.raises(ConfigError, match="host:<name>"):
        PoolTier(LAYOUT, spec, 8 * NB)


def test_a_pool_smaller_than_a_block_is_refused():
    with pytest.raises(ConfigError, match="smaller than one block"):
        PoolTier(LAYOUT, pool_spec(), NB - 1)


def test_the_pool_is_private_to_its_user(pools):
    tier = pools(pool_spec("perm"), 4)
    modes = {p: stat.S_IMODE(os.stat(p).st_mode) for p in (tier.root, tier.path)}
    assert set(modes.values()) == {0o700}, modes
    files = [tier.path / "payload", tier.path / "pool.json", tier.path / "index" / "data.mdb",
             tier.path / "index" / "lock.mdb"]
    assert {f.name: stat.S_IMODE(os.stat(f).st_mode) for f in files} == {f.name: 0o600 for f in files}


def test_a_root_that_is_not_private_is_refused(tmp_path):
    root = tmp_path / f"tiered_kv-{os.getuid()}"
    root.mkdir(mode=0o755)
    root.chmod(0o755)
    with pytest.raises(ConfigError, match="mode 0700"):
        user_root(tmp_path)
    root.rmdir()
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    root.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match="a symlink"):
        user_root(tmp_path)
    if os.getuid() == 0:  # another user's directory (only root can make one here)
        root.unlink()
        root.mkdir(mode=0o700)
        os.chown(root, 65534, 65534)
        with pytest.raises(ConfigError, match="uid 65534"):
            user_root(tmp_path)


def test_a_leased_block_is_the_shared_page_and_survives_evictions_until_released(pools):
    tier = pools(pool_spec("lease"), 4)
    keys, rows = keys_of(A, 4), random_rows(4)
    assert tier.write(keys, [-1] * 4, rows) == [True] * 4
    held = tier.lease([keys[0], keys[1], b"\x07" * 32])
    assert held.hits == [True, True, False] and held.slots[2] == -1
    base, end = tier.slab.data_ptr(), tier.slab.data_ptr() + tier.slab.numel()
    for i in (0, 1):
        assert base <= held.views[i].data_ptr() < end  # a view of the pool's pages, no copy
        assert held.views[i].data_ptr() == tier.slab[held.slots[i]].data_ptr()
        assert torch.equal(held.views[i], rows[i])
    more = keys_of(A, 4, start=10)
    ok, evicted = tier.write_ex(more, [-1] * 4, random_rows(4, seed=1))
    assert ok == [True, True, False, False]  # only the two unleased records could make room
    assert sorted(evicted) == sorted(keys[2:])
    assert torch.equal(held.views[0], rows[0]) and torch.equal(held.views[1], rows[1])
    tier.release(held, used=[])  # read nothing after all: the two keep their place in the eviction order
    tier.release(held)  # idempotent
    ok, evicted = tier.write_ex(more[2:], [-1] * 2, random_rows(2, seed=2))
    assert ok == [True, True] and sorted(evicted) == sorted(keys[:2])


def test_lease_verifies_and_a_scribbled_record_is_dropped(pools):
    tier = pools(pool_spec("scribble"), 4, owner=A)
    keys, rows = keys_of(A, 2), random_rows(2)
    tier.write(keys, [-1] * 2, rows)
    with tier.lease(keys[:1]) as held:
        slot = held.slots[0]
    tier.slab[slot, 7] ^= 0xFF  # another process scribbled on the shared pages
    with tier.lease(keys) as held:
        assert held.hits == [False, True]
    out = torch.zeros_like(rows)
    assert tier.read_ex(keys, [-1] * 2, out) == ([False, True], [False, False], [True, False])  # dropped: gone
    assert torch.equal(out[1], rows[1]) and tier.usage()["spaces"][A.hex()]["used_slots"] == 1


def test_reserve_then_publish_writes_in_place_and_gives_back_what_was_not_written(pools):
    tier = pools(pool_spec("reserve"), 4, owner=A)
    keys, rows = keys_of(A, 3), random_rows(3)
    tier.write(keys[:1], [-1], rows[:1])
    res = tier.reserve(keys)
    assert res.ok == [True, True, True] and res.slots[0] == -1 and res.views[0] is None  # already stored
    assert not tier.has(keys[1:2])[0]  # reserved, not readable yet
    res.views[1].copy_(rows[1])
    assert tier.publish(res, written=[False, True, False]) == [True, True, False]
    with pytest.raises(InvalidInputError, match="published already"):
        tier.publish(res)
    assert tier.has(keys) == [True, True, False]
    assert tier.usage()["spaces"][A.hex()]["used_slots"] == 2  # the unwritten slot came back
    out = torch.zeros_like(rows)
    assert tier.read(keys[:2], [-1] * 2, out[:2])[0] == [True, True] and torch.equal(out[:2], rows[:2])


def test_namespaces_never_see_or_touch_each_other(pools):
    spec = pool_spec("ns")
    a, b = pools(spec, 8, owner=A), pools(spec, 8, owner=B)
    keys, rows = keys_of(A, 3), random_rows(3)
    assert a.write(keys, [-1] * 3, rows) == [True] * 3
    out = torch.zeros_like(rows)
    assert b.has(keys) == [False] * 3
    assert b.read_ex(keys, [-1] * 3, out) == ([False] * 3, [False] * 3, [True] * 3)
    assert b.lease(keys).hits == [False] * 3
    assert b.write(keys, [-1] * 3, random_rows(3, seed=9)) == [False] * 3  # A's records: never overwritten
    b.delete(keys)
    assert b.stored_keys() == [] and b.foreign_namespaces() == {A}
    assert sorted(a.stored_keys()) == sorted(keys)
    assert a.read(keys, [-1] * 3, out)[0] == [True] * 3 and torch.equal(out, rows)


def test_one_budget_split_in_fair_shares(pools):
    """Shared-budget rules: A may fill an idle pool, but B, below its share, then evicts A's oldest blocks."""
    spec = pool_spec("share")
    a = pools(spec, 8, owner=A)
    b = pools(spec, 8, owner=B, weight=3)
    assert a.write(keys_of(A, 8), [-1] * 8, random_rows(8)) == [True] * 8
    ok, evicted = b.write_ex(keys_of(B, 8), [-1] * 8, random_rows(8, seed=1))
    assert ok == [True] * 6 + [False] * 2  # B's share is 8 * 3/4 = 6; beyond it B may not push A below 2
    assert evicted == keys_of(A, 6)  # A's oldest first
    use = a.usage()
    assert use["budget_slots"] == 8 and use["spaces"][A.hex()]["used_slots"] == 2
    assert use["spaces"][B.hex()] == {"weight": 3, "quota_slots": 8, "used_slots": 6, "evictions": 0}


def test_a_pool_nobody_uses_is_made_anew_and_two_openers_in_one_process_share_it(pools):
    spec = pool_spec("stale")
    path = pool_path(spec)
    user_root()
    path.mkdir(mode=0o700)
    (path / "payload").write_bytes(b"left by a crashed creator")  # no index, no pool.json: nobody uses it
    first = pools(spec, 4)
    assert first.created and (path / "pool.json").exists()
    second = pools(spec, 4)
    assert not second.created
    first.write(keys_of(bytes(8), 2), [-1] * 2, random_rows(2))
    assert len(second.stored_keys()) == 2
    first.close()
    assert path.exists()  # the second opener still uses it
    second.close()
    assert_gone(spec)


def test_a_watch_reports_its_namespaces_stored_records_and_lists_them_after_evictions(pools, monkeypatch):
    """``PoolWatch`` (what a vLLM scheduler process uses): its first poll lists what the pool holds for its
    namespace; later polls report the records other openers stored (or read again), one clock read when nothing
    changed; once the pool evicted some of the namespace's records (another namespace's writes), the next poll
    lists the namespace's records again. Another namespace's records are never reported."""
    import tiered_kv.tiers.pool.watch as watch_mod
    from tiered_kv.tiers.pool import PoolWatch

    monkeypatch.setattr(watch_mod, "MIN_RESCAN_S", 0.0)
    # and no wait for the listing's own cost (50x the last listing's time: a listing that took 5 ms on a busy box
    # held the next one back 0.25 s, longer than this test's polls take, and the eviction's listing never came)
    monkeypatch.setattr(watch_mod, "RESCAN_SHARE", float("inf"))
    spec = pool_spec("watch")
    writer, other = pools(spec, 8, owner=A), pools(spec, 8, owner=B, weight=3)
    assert writer.write(keys_of(A, 2), [-1] * 2, random_rows(2)) == [True] * 2
    watch = PoolWatch(pools(spec, 8, owner=A), interval_s=3600.0, rescan_s=3600.0)  # polled by hand below
    try:
        assert watch.take() == ([], set(keys_of(A, 2)))  # the first listing
        watch.poll()
        assert not watch.pending() and watch.polls == 1  # nothing changed: one clock read
        assert writer.write(keys_of(A, 3, start=2), [-1] * 3, random_rows(3)) == [True] * 3
        assert other.write(keys_of(B, 1), [-1], random_rows(1)) == [True]
        watch.poll()
        assert watch.take() == (keys_of(A, 3, start=2), None)  # only its namespace's new records
        out = torch.zeros((1, NB), dtype=torch.uint8)
        writer.read(keys_of(A, 1), [-1], out)
        watch.poll()
        assert watch.take() == (keys_of(A, 1), None)  # read again: reported again (the owner skips what it holds)
        writer.delete(keys_of(A, 1, start=4))
        watch.poll()
        assert not watch.pending()  # a delete alone waits for the next listing (rescan_s)
        ok, evicted = other.write_ex(keys_of(B, 5, start=1), [-1] * 5, random_rows(5))
        assert ok == [True] * 5 and evicted == keys_of(A, 2, start=1)  # 3 free, then A's oldest (0 was read)
        watch.poll()
        assert watch.take() == ([], {keys_of(A, 1)[0], keys_of(A, 1, start=3)[0]})  # what is left of A's
        assert watch.listings == 2
    finally:
        watch.close()
    assert watch.tier._closed
