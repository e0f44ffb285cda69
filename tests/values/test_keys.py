"""Block keys: chained prefix keys and namespaces."""
from __future__ import annotations

import pytest

from tiered_kv.errors import InvalidInputError
from tiered_kv.values.keys import Namespace, chain_keys, check_key


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


def test_namespace_keys_equal_key_per_hash_and_reject_non_bytes():
    ns = Namespace("m", 1, salt="s")
    hashes = [bytes([i]) * 32 for i in range(40)] + [bytearray(b"ba"), memoryview(b"mv")]
    assert ns.keys(hashes) == [ns.key(h) for h in hashes]
    assert len(set(ns.keys(hashes))) == len(hashes) and ns.keys([]) == []
    with pytest.raises(InvalidInputError, match="engine hash must be bytes, got int"):
        ns.keys([b"ok", 7])
