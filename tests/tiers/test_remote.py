"""The remote tier on a real 3-master Redis Cluster (tests/_redis.py): the Tier contract, records that
are checked before they are served, namespaces, faults and start-up errors."""
from __future__ import annotations

import gc
import os
import time
import uuid

import pytest
import torch

from tests._redis import PASSWORD_ENV
from tiered_kv.errors import ConfigError, RemoteUnavailableError
from tiered_kv.testing import LAYOUT, TierContract, make_keys, random_rows
from tiered_kv.tiers.remote import PresenceFeed, RemoteSettings, RemoteTier
from tiered_kv.tiers.remote.client import key_node
from tiered_kv.values.layout import BlockLayout


def settings(cluster, **over) -> RemoteSettings:
    kw = dict(url=cluster.url, password_env=PASSWORD_ENV, op_timeout_s=1.0, connect_timeout_s=0.3,
              retry_after_s=0.5)
    kw.update(over)
    return RemoteSettings(**kw)


def fresh_ns() -> bytes:
    return uuid.uuid4().bytes[:8]


def make_tier(cluster, ns: bytes | None = None, layout: BlockLayout = LAYOUT, **over) -> RemoteTier:
    return RemoteTier(layout, settings(cluster, **over), ns or fresh_ns(), 64 << 20)


@pytest.fixture(autouse=True)
def _cluster(redis_cluster):
    redis_cluster.wait_ok()
    yield


class TestRemoteTier(TierContract):
    """The shared contract; each test gets its own namespace on the session's cluster."""

    @pytest.fixture(autouse=True)
    def _keep_cluster(self, redis_cluster):
        self.cluster = redis_cluster

    def make_tier(self, tmp_path, capacity):
        self._ns = fresh_ns()
        return make_tier(self.cluster, self._ns)

    def reopen(self, tier, tmp_path, capacity):
        tier.close()
        return make_tier(self.cluster, self._ns)


def test_keys_spread_over_every_master(redis_cluster):
    tier = make_tier(redis_cluster)
    try:
        keys, rows = make_keys(60), random_rows(60)
        assert all(tier.write(keys, [-1] * 60, rows))
        per_node = [int(redis_cluster.cli(i, "dbsize").strip()) for i in range(3)]
        assert all(n > 0 for n in per_node), per_node
        assert tier.has(keys) == [True] * 60 and tier.has([b"nope" * 8]) == [False]
    finally:
        tier.close()


def test_damaged_foreign_and_moved_values_are_never_served(redis_cluster):
    tier = make_tier(redis_cluster)
    try:
        keys, rows = make_keys(4), random_rows(4, seed=7)
        tier.write(keys, [-1] * 4, rows)
        rc = tier.client.rc
        v = bytearray(rc.get(tier.redis_key(keys[0])))
        v[-1] ^= 0xFF  # flip a payload byte
        rc.set(tier.redis_key(keys[0]), bytes(v))
        rc.set(tier.redis_key(keys[1]), b"not a record at all")
        rc.set(tier.redis_key(keys[2]), rc.get(tier.redis_key(keys[3])))  # a good record under another key
        out = torch.zeros_like(rows)
        ok, corrupt, missing = tier.read_ex(keys, [-1] * 4, out)
        assert ok == [False, False, False, True] and corrupt == [True, True, True, False]
        assert torch.equal(out[3], rows[3])
        assert tier.has(keys[:3]) == [False] * 3  # damaged records were deleted
        other = make_tier(redis_cluster, tier.namespace_prefix, BlockLayout((2, 4, 32), "bfloat16"))
        try:  # same namespace prefix and key, another layout: a miss, not damage, and not deleted
            ok, corrupt, missing = other.read_ex(keys[3:], [-1], torch.zeros((1, other.block_nbytes),
                                                                              dtype=torch.uint8))
            assert (ok, corrupt, missing) == ([False], [False], [True])
            assert tier.has(keys[3:]) == [True]
        finally:
            other.close()
    finally:
        tier.close()


def test_two_namespaces_never_read_each_other(redis_cluster):
    a, b = make_tier(redis_cluster), make_tier(redis_cluster)
    try:
        keys = make_keys(8)
        a.write(keys, [-1] * 8, random_rows(8, seed=1))
        out = torch.zeros((8, LAYOUT.nbytes), dtype=torch.uint8)
        ok, corrupt, missing = b.read_ex(keys, [-1] * 8, out)
        assert ok == [False] * 8 and missing == [True] * 8 and not any(corrupt)
        assert not b.stored_keys() and sorted(a.stored_keys()) == sorted(keys)
    finally:
        a.close()
        b.close()


def test_presence_feed_sees_what_another_writer_stored_and_deleted(redis_cluster):
    ns = fresh_ns()
    writer, reader = make_tier(redis_cluster, ns), make_tier(redis_cluster, ns)
    try:
        early = make_keys(5, b"e")
        writer.write(early, [-1] * 5, random_rows(5))
        feed = reader.feed()
        assert isinstance(feed, PresenceFeed)
        late = make_keys(3, b"l")
        writer.write(late, [-1] * 3, random_rows(3))
        writer.delete(early[:1])
        stored, removed = [], []
        deadline = time.monotonic() + 10
        while (len(stored) < 8 or not removed) and time.monotonic() < deadline:
            s, r = feed.take()
            stored += s
            removed += r
            time.sleep(0.02)
        assert stored == early + late and removed == early[:1]
        assert feed.take() == ([], [])
    finally:
        writer.close()
        reader.close()


def test_key_node_finds_the_owner_from_any_seed_without_a_cluster_map(redis_cluster):
    """The standalone feed's node lookup: each seed (owner or not) leads to the stream's master; it builds far
    fewer objects than a cluster client (whose slot map the scheduler process must not keep or collect)."""
    writer = make_tier(redis_cluster)
    try:
        owner = writer.client._node_of(writer.stream).port
        for seed in redis_cluster.ports:
            conn = key_node(settings(redis_cluster, url=f"redis://127.0.0.1:{seed}"), writer.stream)
            try:
                assert conn.connection_pool.connection_kwargs["port"] == owner
            finally:
                conn.close()
        gc.collect()
        before = len(gc.get_objects())
        feed = PresenceFeed.standalone(settings(redis_cluster), writer.stream)
        try:
            made = len(gc.get_objects()) - before
            assert made < 2000, made  # a RedisCluster client makes ~20,000
            keys = make_keys(4, b"k")
            writer.write(keys, [-1] * 4, random_rows(4))
            writer.delete(keys[1:2])
            assert feed.caught_up.wait(10)
            deadline, got, gone = time.monotonic() + 10, [], []
            while (len(got) < 4 or not gone) and time.monotonic() < deadline:
                stored, removed = feed.take()  # the feed's raw replies: flat field lists, stored and removed
                got += stored
                gone += removed
                time.sleep(0.02)
            assert got == keys and gone == keys[1:2] and feed.entries == 2
        finally:
            feed.close()
    finally:
        writer.close()


def test_standalone_feed_starts_and_waits_while_its_node_is_down_then_reads_again(redis_cluster):
    """The stream's master down: finding it gives None (the cluster answered: not a start-up error), the feed
    starts without a node and retries; once the node is back, what is announced arrives."""
    ns = fresh_ns()
    writer = make_tier(redis_cluster, ns)
    victim = redis_cluster.ports.index(writer.client._node_of(writer.stream).port)
    others = [p for i, p in enumerate(redis_cluster.ports) if i != victim]
    cfg = settings(redis_cluster, url=",".join(f"redis://127.0.0.1:{p}" for p in others), retry_after_s=0.2)
    redis_cluster.stop(victim)
    feed = None
    try:
        t0 = time.monotonic()
        assert key_node(cfg, writer.stream) is None
        feed = PresenceFeed.standalone(cfg, writer.stream)
        assert time.monotonic() - t0 < 5
        assert not feed.caught_up.wait(0.5) and feed.take() == ([], [])
    finally:
        redis_cluster.start(victim)
        redis_cluster.wait_ok()
    try:
        keys = make_keys(3, b"back")
        deadline, got, written = time.monotonic() + 20, [], False
        while not set(keys) <= set(got) and time.monotonic() < deadline:
            # the writer's client finds the node again after its retry_after_s; the feed after its own
            written = written or writer.write(keys, [-1] * 3, random_rows(3)) == [True] * 3
            got += feed.take()[0]
            time.sleep(0.1)
        assert written and set(keys) <= set(got)
    finally:
        feed.close()
        writer.close()


def test_standalone_feed_start_up_errors(redis_cluster, monkeypatch):
    monkeypatch.setenv("TKV_WRONG_PW", "not-the-password")
    with pytest.raises(ConfigError, match=r"refused the credentials.*\$TKV_WRONG_PW") as info:
        PresenceFeed.standalone(settings(redis_cluster, password_env="TKV_WRONG_PW"), b"tkv:x|presence")
    assert "not-the-password" not in str(info.value)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RemoteUnavailableError, match=f"127.0.0.1:{port}"):
        PresenceFeed.standalone(settings(redis_cluster, url=f"redis://127.0.0.1:{port}"), b"tkv:x|presence")


def test_a_killed_node_gives_misses_fast_then_hits_again(redis_cluster):
    tier = make_tier(redis_cluster, retry_after_s=0.3)
    keys, rows = make_keys(30), random_rows(30, seed=9)
    try:
        assert all(tier.write(keys, [-1] * 30, rows))
        owner = [tier.client._node_of(tier.redis_key(k)).port for k in keys]
        victim = redis_cluster.ports.index(owner[0])
        on_victim = [p == owner[0] for p in owner]
        redis_cluster.stop(victim)
        try:
            out = torch.zeros_like(rows)
            for _ in range(3):  # the first read finds the node dead; later ones skip it at once
                t0 = time.monotonic()
                ok, corrupt, missing = tier.read_ex(keys, [-1] * 30, out)
                assert time.monotonic() - t0 < 3.0
                assert not any(corrupt) and not any(missing)  # down is not gone: the planner keeps its hints
                assert [not o for o in ok] == on_victim
                assert all(torch.equal(out[i], rows[i]) for i in range(30) if ok[i])
            w = tier.write(make_keys(30, b"w"), [-1] * 30, rows)  # writes to the dead node fail, others work
            assert any(w) and not all(w)
        finally:
            redis_cluster.start(victim)
            redis_cluster.wait_ok()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            out = torch.zeros_like(rows)
            ok, _, missing = tier.read_ex(keys, [-1] * 30, out)
            if all(ok) or any(missing):
                break
            time.sleep(0.2)
        # the node came back empty (no persistence in the test cluster): its blocks are misses, never errors;
        # the others still hit
        assert all(ok[i] or missing[i] for i in range(30)) and all(ok[i] for i in range(30) if not on_victim[i])
        assert all(tier.write(keys, [-1] * 30, rows))  # and it takes writes again
        ok, _, _ = tier.read_ex(keys, [-1] * 30, out)
        assert all(ok) and torch.equal(out, rows)
    finally:
        tier.close()


def test_wrong_password_fails_at_start_up_with_a_clear_message(redis_cluster, monkeypatch):
    monkeypatch.setenv("TKV_WRONG_PW", "not-the-password")
    with pytest.raises(ConfigError) as info:
        make_tier(redis_cluster, password_env="TKV_WRONG_PW")
    msg = str(info.value)
    assert "refused the credentials" in msg and "$TKV_WRONG_PW" in msg and "not-the-password" not in msg
    with pytest.raises(ConfigError, match="TKV_UNSET_PW.*not set"):
        make_tier(redis_cluster, password_env="TKV_UNSET_PW")
    with pytest.raises(ConfigError, match="refused the credentials"):
        make_tier(redis_cluster, password_env=None)  # no password at all


def test_unreachable_cluster_fails_at_start_up(redis_cluster):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(RemoteUnavailableError, match=f"127.0.0.1:{port}.*remote_url"):
        make_tier(redis_cluster, url=f"redis://127.0.0.1:{port}")
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("url, what", [
    ("redis://u:pw@127.0.0.1:1", "password"), ("http://127.0.0.1:1", "redis://"), ("", "remote_url"),
    ("redis://127.0.0.1:1/3", "database"), ("redis://a:1,rediss://b:2", "mixes"),
])
def test_bad_remote_url_is_a_config_error(url, what):
    with pytest.raises(ConfigError, match=what):
        RemoteSettings(url=url)


def test_describe_never_shows_the_password(redis_cluster):
    tier = make_tier(redis_cluster)
    try:
        text = repr(tier.describe()) + repr(tier.settings)
        assert os.environ[PASSWORD_ENV] not in text and PASSWORD_ENV in text
        assert len(tier.describe()["nodes"]) == 3
    finally:
        tier.close()


ACL_RULES = ["on", ">tkv-acl-secret", "resetkeys", "~tkv:*", "resetchannels", "-@all", "+get", "+set", "+del",
             "+exists", "+xadd", "+xread", "+scan", "+ping", "+cluster|slots", "+cluster|shards", "+command",
             "+info"]


def test_an_acl_user_limited_to_its_prefix_and_commands_is_enough(redis_cluster, monkeypatch):
    """The ACL of docs/remote.md: the tier works with it, and that user cannot touch keys outside ``tkv:``."""
    for i in range(3):
        redis_cluster.cli(i, "acl", "setuser", "tkv-test", *ACL_RULES)
    monkeypatch.setenv("TKV_ACL_PW", "tkv-acl-secret")
    tier = make_tier(redis_cluster, user="tkv-test", password_env="TKV_ACL_PW")
    try:
        keys, rows = make_keys(12), random_rows(12, seed=4)
        assert all(tier.write(keys, [-1] * 12, rows))
        out = torch.zeros_like(rows)
        assert tier.read_ex(keys, [-1] * 12, out)[0] == [True] * 12 and torch.equal(out, rows)
        feed = tier.feed()
        assert feed.caught_up.wait(10) and feed.take()[0] == keys
        tier.delete(keys[:3])
        assert tier.has(keys[:4]) == [False, False, False, True]
        with pytest.raises(Exception, match="no permissions"):
            tier.client.rc.set(b"other-app:key", b"x")
        with pytest.raises(Exception, match="no permissions"):
            tier.client.rc.flushall()
    finally:
        tier.close()
        for i in range(3):
            redis_cluster.cli(i, "acl", "deluser", "tkv-test")


def test_an_acl_user_without_a_needed_command_fails_at_start_up_not_silently(redis_cluster, monkeypatch):
    """An ACL user that may not run EXISTS (the node lookup's probe) is a clear ``ConfigError`` at once, not a feed
    that retries forever while the fleet's blocks stay invisible."""
    rules = [r for r in ACL_RULES if r != "+exists"]
    for i in range(3):
        redis_cluster.cli(i, "acl", "setuser", "tkv-noexists", *rules)
    monkeypatch.setenv("TKV_ACL_PW", "tkv-acl-secret")
    try:
        with pytest.raises(ConfigError, match="tkv-noexists.*ACL line in docs/remote.md"):
            key_node(settings(redis_cluster, user="tkv-noexists", password_env="TKV_ACL_PW"), b"tkv:any-stream")
    finally:
        for i in range(3):
            redis_cluster.cli(i, "acl", "deluser", "tkv-noexists")


def test_records_read_by_ranges_then_verified_and_damage_dropped(redis_cluster):
    """``open_ranges``: headers in one round trip per node; ``read_many`` fills the image by ``GETRANGE`` straight
    from the socket, in any order; ``verify`` checks the whole payload; a value changed under its header is found
    damaged and deleted at ``close``; a missing key is ``missing``; another layout's record is not ours."""
    tier = make_tier(redis_cluster)
    try:
        keys, rows = make_keys(3), random_rows(3)
        assert all(tier.write(keys, [-1] * 3, rows))
        r = tier.client.rc
        raw = bytearray(r.get(tier.redis_key(keys[1])))
        raw[-5] ^= 0xFF  # a payload byte changes in Redis: the header still vouches for the old one
        r.set(tier.redis_key(keys[1]), bytes(raw))
        reads = tier.open_ranges(keys + [b"absent".ljust(32, b"\0")])
        nb = LAYOUT.nbytes
        images = torch.zeros((4, nb), dtype=torch.uint8)
        ranges = [(nb // 2, nb), (0, 100), (100, nb // 2)]
        assert [reads.read_many(i, ranges, images[i]) for i in range(4)] == [True, True, True, False]
        assert reads.missing == [False, False, False, True]
        assert torch.equal(images[0], rows[0]) and torch.equal(images[2], rows[2])
        assert [reads.verify(i, images[i]) for i in range(4)] == [True, False, True, False]
        assert [reads.corrupt(i) for i in range(4)] == [False, True, False, False]
        reads.close()
        assert tier.has(keys) == [True, False, True]  # the damaged one deleted
        other = make_tier(redis_cluster, tier.namespace_prefix, BlockLayout((2, 4, 16), "float16"))
        try:
            assert other.open_ranges(keys[:1]).headers == [None]  # another layout's record: not ours to read
        finally:
            other.close()
    finally:
        tier.close()


def test_getrange_of_a_wrong_type_key_fails_that_key_only(redis_cluster):
    """An error reply to one key's ranges (a list under the key: WRONGTYPE) leaves that key unread and the replies of
    the keys after it on the same node in step."""
    tier = make_tier(redis_cluster)
    try:
        c = tier.client
        keys = [b"{tkv-same-slot}" + bytes([i]) * 8 for i in range(3)]  # one hash slot: one node, one pipeline
        c.rc.set(keys[0], b"0123456789")
        c.rc.rpush(keys[1], b"x")
        c.rc.set(keys[2], b"abcdefghij")
        bufs = [[bytearray(3), bytearray(2)] for _ in keys]
        got = c.getrange_into(keys, lambda i: [(1, 4), (8, 10)], lambda i: [memoryview(b) for b in bufs[i]],
                              unavailable="down")
        assert got[0] is True and got[2] is True and got[1] == "down", got
        assert bytes(bufs[0][0]) == b"123" and bytes(bufs[2][1]) == b"ij"
        c.rc.delete(*keys)
    finally:
        tier.close()


@pytest.mark.parametrize("chunk", [64, 1000, 4 << 20])
def test_range_replies_read_through_a_small_buffer_land_whole(redis_cluster, monkeypatch, chunk):
    """``_Wire`` takes many replies per call into its buffer and copies them out: with a buffer of 64 or 1,000 bytes
    (reply lines cut across calls, the buffer's rest moved to its front, payloads of the buffer's size or more read
    straight into their destination) and the real 4 MiB one, every range of 300 keys lands byte for byte, a short
    and a missing value come back False without putting the replies after them out of step, and whole values read by
    ``get_into`` land too."""
    from tiered_kv.tiers.remote import client as remote_client

    monkeypatch.setattr(remote_client, "READ_CHUNK", chunk)
    monkeypatch.setattr(remote_client._BUFFERS, "idle", None, raising=False)  # a buffer of this size for the next wire
    tier = make_tier(redis_cluster)
    try:
        c = tier.client
        rng = torch.Generator().manual_seed(7)
        keys = [b"tkv-wire-%d" % i for i in range(300)]
        values = [bytes(torch.randint(0, 256, (int(n),), dtype=torch.uint8, generator=rng).tolist())
                  for n in torch.randint(10, 3000, (300,), generator=rng)]
        for k, v in zip(keys[:-1], values[:-1]):
            c.rc.set(k, v)  # the last key is never written: a missing value
        ranges = lambda i: [(0, 5), (5, len(values[i]) // 2), (len(values[i]) // 2, len(values[i]))]  # noqa: E731
        bufs = [[bytearray(b - a) for a, b in ranges(i)] for i in range(300)]
        bufs[7][2] += b"x"  # one range asks one byte more than the value has: short
        got = c.getrange_into(keys, ranges, lambda i: [memoryview(b) for b in bufs[i]], unavailable="down")
        assert got[7] is False and got[-1] is False and all(got[i] is True for i in range(299) if i != 7)
        for i in range(299):
            if i != 7:
                assert b"".join(bufs[i]) == values[i], i
        whole = [bytearray(len(v) - 4) for v in values]
        heads: dict[int, bytes | None] = {}
        c.get_into(keys, 4, lambda i: memoryview(whole[i]), lambda i, h: heads.__setitem__(i, h))
        assert heads[299] is None  # the head of a value that filled its buffer comes as a 1-tuple
        assert all(heads[i] == (values[i][:4],) and whole[i] == values[i][4:] for i in range(299))
        c.rc.delete(*keys[:-1])
    finally:
        tier.close()


def test_a_nodes_small_commands_go_in_one_send():
    """``coalesced``: runs of pieces shorter than ``SEND_JOIN_BYTES`` joined (redis-py sends each piece with its own
    ``sendall``, which gives up the GIL), long pieces (a payload's view) passed through as the same object."""
    from tiered_kv.tiers.remote.client import SEND_JOIN_BYTES, SEND_JOIN_MAX, coalesced

    big = memoryview(bytearray(SEND_JOIN_BYTES))
    out = coalesced([b"a", b"bc", big, b"\r\n", b"d", big])
    assert out[0] == b"abc" and out[1] is big and out[2] == b"\r\nd" and out[3] is big and len(out) == 4
    assert coalesced([b"x"] * 128) == [b"x" * 128] and coalesced([]) == []
    many = coalesced([b"y" * 1000] * 3000)  # 3 MB of small records: joined a MiB or so at a time, nothing lost
    assert b"".join(many) == b"y" * 3_000_000 and len(many) == 3
    assert all(SEND_JOIN_MAX <= len(m) < SEND_JOIN_MAX + SEND_JOIN_BYTES for m in many[:-1])


def test_a_range_read_of_a_vanished_value_is_a_miss_not_damage(redis_cluster):
    """Redis has no lease: a value evicted between the header read and the range reads comes back short. That is a
    miss (nothing deleted, nothing reported corrupt), unlike a checksum mismatch."""
    tier = make_tier(redis_cluster)
    try:
        keys, rows = make_keys(2), random_rows(2)
        assert all(tier.write(keys, [-1] * 2, rows))
        reads = tier.open_ranges(keys)
        tier.client.rc.delete(tier.redis_key(keys[0]))  # evicted meanwhile
        images = torch.zeros((2, LAYOUT.nbytes), dtype=torch.uint8)
        assert [reads.read_many(i, [(0, LAYOUT.nbytes)], images[i]) for i in range(2)] == [False, True]
        assert reads.missing == [True, False] and not reads.corrupt(0)
        assert [reads.verify(i, images[i]) for i in range(2)] == [False, True] and not reads.corrupt(0)
        reads.close()
        assert tier.has(keys) == [False, True]
    finally:
        tier.close()
