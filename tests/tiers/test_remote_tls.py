"""The remote tier on a Redis Cluster that speaks only TLS (``rediss://``; tests/_redis.py makes a CA and the
nodes' certificates with ``openssl``, and a second CA that did not sign them): the Tier contract and the
presence feed over TLS, a store round trip, and the start-up errors of a wrong CA or a wrong scheme."""
from __future__ import annotations

import time
import uuid

import pytest
import torch

from tests._redis import PASSWORD_ENV
from tiered_kv.errors import ConfigError, RemoteUnavailableError
from tiered_kv.store.tiered_store import TieredStore
from tiered_kv.testing import LAYOUT, TierContract, make_keys, random_rows
from tiered_kv.tiers.remote import PresenceFeed, RemoteSettings, RemoteTier
from tiered_kv.tiers.remote.presence import stream_key


def settings(cluster, **over) -> RemoteSettings:
    kw = dict(url=cluster.url, password_env=PASSWORD_ENV, tls_ca=str(cluster.tls.ca), op_timeout_s=1.0,
              connect_timeout_s=0.5, retry_after_s=0.5)
    kw.update(over)
    return RemoteSettings(**kw)


class TestRemoteTierOverTls(TierContract):
    """The shared Tier contract, every byte through TLS; each test gets its own namespace."""

    @pytest.fixture(autouse=True)
    def _keep_cluster(self, redis_tls):
        self.cluster = redis_tls

    def make_tier(self, tmp_path, capacity):
        self._ns = uuid.uuid4().bytes[:8]
        return RemoteTier(LAYOUT, settings(self.cluster), self._ns, 64 << 20)

    def reopen(self, tier, tmp_path, capacity):
        tier.close()
        return RemoteTier(LAYOUT, settings(self.cluster), self._ns, 64 << 20)


def test_two_stores_share_blocks_over_tls_and_the_standalone_feed_reads_the_stream(redis_tls):
    cfg = dict(block_shape=[2, 4, 8, 64], dtype="bfloat16", cpu_bytes=2 * 8192, remote_url=redis_tls.url,
               remote_password_env=PASSWORD_ENV, remote_tls_ca=str(redis_tls.tls.ca), remote_timeout_s=1.0,
               model=f"tls-{time.monotonic_ns()}")
    keys = [bytes([3, i]) * 16 for i in range(12)]
    data = torch.randn((12, 2, 4, 8, 64)).to(torch.bfloat16)
    with TieredStore(cfg) as a:
        assert all(a.put(keys, data).wait(30)) and a.drain(30)
        assert a.locate(keys).count("remote") == 10  # the CPU tier holds 2; write-through sent all 12
        # the vLLM scheduler's feed: one plain TLS connection to the stream's node, found through a seed
        feed = PresenceFeed.standalone(settings(redis_tls), stream_key("tkv:", a.namespace.prefix))
        try:
            assert feed.caught_up.wait(10)
            assert set(feed.take()[0]) == set(keys)
        finally:
            feed.close()
        with TieredStore(cfg) as b:  # another "host": finds a's blocks in Redis, reads them over TLS
            assert b.wait_remote_sync(10) and b.locate(keys) == ["remote"] * 12
            out = torch.zeros_like(data)
            assert b.get(keys, out).wait(30) == 12 and torch.equal(out, data)


def test_a_wrong_ca_is_refused_at_start_up_with_a_clear_error(redis_tls):
    wrong = settings(redis_tls, tls_ca=str(redis_tls.wrong_ca))
    for start in (lambda: RemoteTier(LAYOUT, wrong, b"n" * 8), lambda: PresenceFeed.standalone(wrong, b"tkv:s")):
        with pytest.raises(ConfigError, match=r"did not verify against remote_tls_ca='.*other\.crt'.*"
                                              r"CERTIFICATE_VERIFY_FAILED.*Set remote_tls_ca to the CA file"):
            start()
    with pytest.raises(ConfigError, match=r"did not verify against the system's CAs \(remote_tls_ca not set\)"):
        RemoteTier(LAYOUT, settings(redis_tls, tls_ca=None), b"n" * 8)


def test_tls_setting_mistakes_fail_at_start_up_and_say_what_to_do(redis_tls, redis_cluster, tmp_path):
    plain_url = redis_tls.url.replace("rediss://", "redis://")
    with pytest.raises(ConfigError, match="remote_tls_ca is set .* but remote_url uses redis://"):
        RemoteSettings(plain_url, tls_ca=str(redis_tls.tls.ca))
    with pytest.raises(ConfigError, match="remote_tls_ca: .*missing.pem' is not a readable file"):
        RemoteSettings(redis_tls.url, tls_ca=str(tmp_path / "missing.pem"))
    with pytest.raises(RemoteUnavailableError, match="speaks only TLS .* use rediss://"):
        RemoteTier(LAYOUT, RemoteSettings(plain_url, PASSWORD_ENV, connect_timeout_s=0.5), b"n" * 8)
    tls_to_plain = RemoteSettings(redis_cluster.url.replace("redis://", "rediss://"), PASSWORD_ENV,
                                  tls_ca=str(redis_tls.tls.ca), connect_timeout_s=0.5, op_timeout_s=1.0)
    with pytest.raises(RemoteUnavailableError, match="does not speak TLS never answers a TLS handshake"):
        RemoteTier(LAYOUT, tls_to_plain, b"n" * 8)
    tier = RemoteTier(LAYOUT, settings(redis_tls), b"n" * 8)  # and the right settings work
    try:
        keys, rows = make_keys(2), random_rows(2)
        assert tier.write(keys, [0, 1], rows) == [True, True]
        out = torch.zeros_like(rows)
        assert tier.read(keys, [0, 1], out)[0] == [True, True] and torch.equal(out, rows)
    finally:
        tier.close()
