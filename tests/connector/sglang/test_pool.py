"""SGLang replicas on one host pool (issue 33): our CPU tier as ``cpu_pool: host:<name>`` in several processes.

Each SGLang server (a data-parallel replica, or one of several servers behind a router) has its own backend
instance and its own host pool (SGLang's L2); with ``cpu_pool`` our CPU tier below it is one pool in
``/dev/shm`` for all of them, so a page one replica wrote is a hit, bit-exact, in another replica's process.
Real SGLang objects (the dynamic factory, ``MHATokenToKVPoolHost``) on CPU tensors; the other replica is a
real second process (spawned: a forked child would inherit the parent's open LMDB environments).
"""
from __future__ import annotations

import multiprocessing
import os
import shutil
import uuid

import pytest

from tests.connector.sglang.harness import PAGE_SIZE, attached_backend, extra_config, fill_random, mha_pool, pages_bytes

torch = pytest.importorskip("torch")

from tiered_kv.errors import ConfigError  # noqa: E402
from tiered_kv.tiers.pool.place import user_root  # noqa: E402

N = 3


def _pool_extra(tmp_path, pool: str, **more) -> dict:
    extra = extra_config(tmp_path, cpu_bytes="1MiB", cpu_pool=f"host:{pool}", **more)
    del extra["disk_path"]  # the pool alone: what the other replica finds comes from shared memory only
    return extra


def replica_writer(tmp_path: str, pool: str, keys: list, seed: int) -> None:
    """Another replica's process: fill its SGLang host pool with ``seed``, write ``keys``' pages, close, exit."""
    host = mha_pool("page_first")
    be = attached_backend(_pool_extra(tmp_path, pool), host)
    fill_random(host, seed)
    ok = be.batch_set_v1(keys, host.alloc(len(keys) * PAGE_SIZE))
    be.close()
    os._exit(0 if all(ok) else 3)


def test_a_page_another_replica_process_wrote_is_a_bit_exact_hit(tmp_path):
    pool = f"sgl-{uuid.uuid4().hex[:12]}"
    host = mha_pool("page_first")
    reader = attached_backend(_pool_extra(tmp_path, pool), host)  # opened first: the pool outlives the writer
    try:
        assert [t.name for t in reader.store.tiers] == ["cpu"]
        keys = [f"dp{i}" for i in range(N)]
        assert reader.batch_exists(keys) == 0
        child = multiprocessing.get_context("spawn").Process(target=replica_writer,
                                                             args=(str(tmp_path), pool, keys, 11))
        child.start()
        try:
            child.join(120)
            assert child.exitcode == 0
        finally:
            if child.is_alive():  # hung: kill it, or multiprocessing would wait for it at exit
                child.kill()
                child.join()
        assert reader.batch_exists(keys) == N  # stored by the other process, found in the pool's index
        dst = host.alloc(N * PAGE_SIZE)
        assert reader.batch_get_v1(keys, dst) == [True] * N
        twin = mha_pool("page_first")  # the same seed and allocation: the bytes the writer stored
        fill_random(twin, 11)
        expected = pages_bytes(twin, twin.alloc(N * PAGE_SIZE), N)
        assert all(torch.equal(a, b) for a, b in zip(pages_bytes(host, dst, N), expected))
        assert reader.batch_exists([f"never{i}" for i in range(N)]) == 0  # keys nobody wrote stay misses
    finally:
        reader.close()
        shutil.rmtree(user_root() / pool, ignore_errors=True)  # every user is gone: its /dev/shm memory too


@pytest.mark.parametrize("more, match", [({"cpu_pool": "shm:kv"}, "host:<name>"),
                                         ({"cpu_bytes": 0}, "needs cpu_bytes > 0"),
                                         ({"cpu_pool_weight": 0}, "cpu_pool_weight")])
def test_a_bad_pool_setting_fails_at_start_naming_the_key(tmp_path, more, match):
    from tests.connector.sglang.harness import create_backend

    extra = {**_pool_extra(tmp_path, "sgl-bad"), "disk_path": str(tmp_path), **more}  # a disk: only the pool is wrong
    with pytest.raises(ConfigError, match=match):
        create_backend(extra)
