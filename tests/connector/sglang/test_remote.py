"""The SGLang backend with the remote tier: two backends ("two hosts", each its own host pool and no disk)
share pages through a real Redis Cluster (tests/_redis.py), bit-exact, through SGLang's own page helpers."""
from __future__ import annotations

import time

import pytest

from tests._redis import PASSWORD_ENV
from tests.connector.sglang.harness import (PAGE_SIZE, attached_backend, controller_stub, fill_random, live_op,
                                            mha_pool, page_helpers, pages_bytes)
from tiered_kv.errors import ConfigError

torch = pytest.importorskip("torch")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo  # noqa: E402


def remote_extra(cluster, salt: str, **kw) -> dict:
    return {"backend_name": "dynamic", "module_path": "tiered_kv.connector.sglang", "class_name":
            "TieredHiCacheStorage", "interface_v1": 1, "cpu_bytes": "1MiB", "remote_url": cluster.url,
            "remote_password_env": PASSWORD_ENV, "remote_timeout_s": 1.0, "tenant_salt": salt, **kw}


def test_two_hosts_share_pages_through_the_remote_tier(redis_cluster):
    salt = f"sg-{time.monotonic_ns()}"
    pool_a, pool_b = mha_pool("page_first"), mha_pool("page_first")
    a = attached_backend(remote_extra(redis_cluster, salt), pool_a)
    b = attached_backend(remote_extra(redis_cluster, salt), pool_b)
    try:
        set_page, get_page = page_helpers("zero_copy", "zero_copy")
        fill_random(pool_a, 11)
        src = pool_a.alloc(4 * PAGE_SIZE)
        want = pages_bytes(pool_a, src, 4)
        keys = [f"shared-page{i}" for i in range(4)]
        assert set_page(controller_stub(a, pool_a), keys, src, HiCacheStorageExtraInfo(prefix_keys=[]))
        assert a.store.drain(30) and a.store.stats()["tiers"]["remote"]["resident_blocks"] == 4
        deadline = time.monotonic() + 10
        while b.batch_exists(keys) < 4 and time.monotonic() < deadline:  # B learns of them from the feed
            time.sleep(0.05)
        assert b.batch_exists(keys) == 4
        dst = pool_b.alloc(4 * PAGE_SIZE)
        pool_b.kv_buffer.zero_()
        assert get_page(controller_stub(b, pool_b), live_op(), keys, dst, HiCacheStorageExtraInfo(prefix_keys=[])) == 4
        got = pages_bytes(pool_b, dst, 4)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert b.store.stats()["tiers"]["remote"]["hits"] == 4
    finally:
        a.close()
        b.close()


def test_remote_keys_are_checked_at_start():
    from tiered_kv.connector.sglang.config import SGLangBackendConfig

    with pytest.raises(ConfigError, match="remote_write"):
        SGLangBackendConfig(remote_url="redis://127.0.0.1:1", remote_write="never")
    with pytest.raises(ConfigError, match="remote_password_env"):
        SGLangBackendConfig(remote_url="redis://:pw@127.0.0.1:1")
    assert SGLangBackendConfig(remote_url="redis://127.0.0.1:1").cpu_bytes == 0  # remote alone is a store
