"""``TieredStore`` with ``cpu_pool``: the CPU tier is a host pool shared with other stores (here in one process;
several processes are tests/reliability/test_pool.py).

The pool is the put tier (chain index 0) and governed: puts never wait there, the pool evicts by itself, and
with a disk below every block that lands in the pool is copied to the disk at once, so an eviction by any
process loses nothing the disk can hold.
"""
from __future__ import annotations

import pytest
import torch

from tests._pool import assert_gone, pool_spec
from tiered_kv.errors import ConfigError
from tiered_kv.store.tiered_store import TieredStore

SHAPE = (4, 128)  # 1 KiB blocks of float16


def cfg(spec: str, blocks: int, **over) -> dict:
    c = {"block_shape": list(SHAPE), "dtype": "float16", "cpu_bytes": blocks * 1024, "cpu_pool": spec,
         "model": "pool-test", "page_size": 4}
    c.update(over)
    return c


def blocks(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *SHAPE), generator=g).to(torch.float16)


def test_two_stores_of_one_namespace_read_each_others_blocks():
    spec = pool_spec("store")
    with TieredStore(cfg(spec, 32)) as a:
        keys, data = a.keys_for_tokens(list(range(4 * 8))), blocks(8)
        assert a.put(keys[:4], data[:4]).wait(30) == [True] * 4
        with TieredStore(cfg(spec, 32)) as b:
            assert b.stats()["tiers"]["cpu"]["resident_blocks"] == 4  # adopted when it joined
            assert a.put(keys[4:], data[4:]).wait(30) == [True] * 4  # written after b joined: found on lookup
            out = torch.zeros_like(data)
            assert b.get(keys, out).wait(30) == 8 and torch.equal(out, data)
            assert b.locate(keys) == ["cpu"] * 8
            assert b.match_prefix(list(range(4 * 8)))["num_tokens"] == 32
            assert b.tiers[0].describe()["pool"] == spec
    assert_gone(spec)


def test_the_pool_at_index_0_over_a_disk_loses_nothing_to_other_processes_evictions(tmp_path):
    spec = pool_spec("disk")
    a = TieredStore(cfg(spec, 4, disk_path=str(tmp_path / "a"), disk_bytes=64 * 4096))
    other = TieredStore(cfg(spec, 4, model="another-model", cpu_pool_weight=3))  # its fair share: 3 of 4 blocks
    try:
        keys, data = a.keys_for_tokens(list(range(4 * 12))), blocks(12)
        assert a.put(keys, data).wait(30) == [True] * 12  # what the pool could not take landed on the disk
        assert a.drain(30)
        assert a.stats()["tiers"]["disk"]["resident_blocks"] == 12  # every block copied down as it landed
        filler = other.keys_for_tokens(list(range(1000, 1000 + 4 * 3)))
        assert other.put(filler, blocks(3, seed=1)).wait(30) == [True] * 3  # evicts a's blocks from the pool
        assert sum(a.pool.has(keys)) == 1
        out = torch.zeros_like(data)
        assert a.get(keys, out).wait(30) == 12 and torch.equal(out, data)  # from the disk, none a miss
        st = a.stats()
        assert st["misses"] == 0 and st["tiers"]["disk"]["hits"] == 11 and st["tiers"]["cpu"]["hits"] == 1
        assert st["tiers"]["cpu"]["vanished"] >= 3
    finally:
        a.close()
        other.close()
    assert_gone(spec)


def test_a_store_asking_another_size_is_refused_and_leaks_nothing():
    spec = pool_spec("size")
    with TieredStore(cfg(spec, 8)):
        with pytest.raises(ConfigError, match="same cpu_bytes"):
            TieredStore(cfg(spec, 16))
    assert_gone(spec)


@pytest.mark.parametrize("over, match", [({"cpu_pool": "shm:x"}, "host:<name>"),
                                         ({"cpu_bytes": 0}, "needs cpu_bytes > 0"),
                                         ({"cpu_pool_weight": 0}, "cpu_pool_weight")])
def test_bad_pool_config_is_refused(over, match):
    with pytest.raises(ConfigError, match=match):
        TieredStore(cfg(pool_spec("bad"), 8, **over))


def test_a_gpu_tier_demotes_into_the_pool_and_a_disk_below_gets_each_block(tmp_path):
    """GPU slab (a CPU tensor without CUDA) -> host pool -> disk: blocks the GPU tier evicts go into the pool
    (governed, never waited for) and on to the disk. Eight demotions at once into a pool of four: the pool keeps
    every record whose copy down is not planned yet, so a demotion it cannot take is refused and dropped, counted
    (``demotions_dropped``: the disk and remote rule of issue 29); no block is ever lost uncounted, and every
    block still held reads back bit-exact."""
    spec = pool_spec("gpu")
    with TieredStore(cfg(spec, 4, gpu_bytes=2 * 1024, disk_path=str(tmp_path / "d"), disk_bytes=64 * 4096)) as s:
        keys, data = s.keys_for_tokens(list(range(4 * 10))), blocks(10, seed=3)
        assert s.put(keys, data).wait(30) == [True] * 10 and s.drain(30)
        st = s.stats()["tiers"]
        assert st["gpu"]["resident_blocks"] == 2 and 1 <= st["cpu"]["resident_blocks"] <= 4
        dropped = st["gpu"]["demotions_dropped"]
        assert st["disk"]["resident_blocks"] + dropped == 8, st
        held = 0
        for i, k in enumerate(keys):
            out = torch.zeros_like(data[i:i + 1])
            if s.get([k], out).wait(30) == 1:
                assert torch.equal(out, data[i:i + 1])
                held += 1
        assert held == 10 - dropped
    assert_gone(spec)
