"""Eviction policies (LRU, S3-FIFO) and make_policy. Pure Python."""
from __future__ import annotations

import pytest

from tests.planner._driver import K
from tiered_kv.errors import ConfigError
from tiered_kv.planner.policy import LRUPolicy, S3FIFOPolicy, make_policy


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
