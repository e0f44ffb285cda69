"""The disk directory's budget (budget.py) with two namespaces in one process: quotas, fair shares,
leases, ownership. Deterministic; the 4-process run is tests/reliability/test_shared_budget.py."""
from __future__ import annotations

import struct
import time

import pytest
import torch

from tiered_kv.errors import ConfigError
from tiered_kv.testing import LAYOUT, make_keys, random_rows
from tiered_kv.tiers.disk import DiskTier

SLOT = 4096  # one slot: LAYOUT's block rounded up to 4 KiB
A, B = b"A" * 8, b"B" * 8


def tier(path, owner, blocks, budget="namespace", weight=1):
    return DiskTier(LAYOUT, path, blocks * SLOT, owner=owner, budget=budget, weight=weight, evicts=True)


def put(t, keys, batch=4):
    """Write in batches (a batch's own records are not committed yet, so one batch never exceeds the room)."""
    ok, evicted = [], []
    for s in range(0, len(keys), batch):
        part = keys[s:s + batch]
        o, e = t.write_ex(part, [-1] * len(part), random_rows(len(part)))
        ok += o
        evicted += e
    return ok, evicted


def used(t, owner):
    return t.usage()["spaces"][owner.hex()]["used_slots"]


def test_namespace_quotas_never_evict_another_namespace(tmp_path):
    a, b = tier(tmp_path / "d", A, 8), tier(tmp_path / "d", B, 4)
    try:
        ka, kb = make_keys(8, b"a"), make_keys(20, b"b")
        assert put(a, ka)[0] == [True] * 8
        ok, evicted = put(b, kb)
        assert all(ok) and set(evicted) <= set(kb) and len(evicted) == 16  # b recycles its own 4 slots
        assert used(a, A) == 8 and used(b, B) == 4
        assert sorted(a.stored_keys()) == sorted(ka) and b.stored_keys() == kb[-4:]
        assert a.physical_slots == 12  # the file holds the sum of the quotas
    finally:
        a.close(), b.close()


def test_shared_budget_gives_each_namespace_its_fair_share(tmp_path):
    a, b = tier(tmp_path / "d", A, 12, "shared"), tier(tmp_path / "d", B, 12, "shared", weight=2)
    try:
        put(a, make_keys(12, b"a"))  # alone, a may use the whole budget
        assert used(a, A) == 12
        ok, evicted = put(b, make_keys(30, b"b"))  # b takes back its share (8 of 12), then recycles its own
        assert all(ok)
        assert used(a, A) == 4 and used(b, B) == 8
        assert len([k for k in evicted if k.startswith(b"a")]) == 8
        ok, evicted = put(a, make_keys(6, b"x"))  # a is at its share: it evicts only its own
        assert all(ok) and all(not k.startswith(b"b") for k in evicted)
        assert used(a, A) == 4 and used(b, B) == 8
        assert a.usage()["budget_slots"] == 12
    finally:
        a.close(), b.close()


def test_a_leased_record_is_not_evicted(tmp_path):
    a = tier(tmp_path / "d", A, 2)
    try:
        keys = make_keys(3, b"a")
        put(a, keys[:2])
        raws, leases = a.index.lease(keys[:1])  # a reader holds the oldest record
        assert raws[0] is not None and len(leases) == 1
        ok, evicted = put(a, keys[2:])
        assert ok == [True] and evicted == [keys[1]]  # the next oldest went instead
        a.index.unlease(leases, [])
        ok, evicted = put(a, make_keys(1, b"z"))
        assert evicted == [keys[0]]
    finally:
        a.close()


def test_leases_of_dead_readers_never_block_eviction_and_are_dropped_at_open(tmp_path):
    import subprocess
    import sys

    a = tier(tmp_path / "d", A, 2)
    keys = make_keys(3, b"a")
    put(a, keys[:2])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with a.index.env.begin(write=True) as txn:  # a reader that crashed while it held the oldest record
        txn.put(keys[0] + struct.pack("<IQ", dead.pid, 1), struct.pack("<Q", time.time_ns() + 10**12),
                db=a.index.budget.db["leases"])
    assert a.usage()["leases"] == 1
    a.close()
    a = tier(tmp_path / "d", A, 2)
    try:
        assert a.usage()["leases"] == 0  # dropped at open
        ok, evicted = put(a, keys[2:])
        assert ok == [True] and evicted == [keys[0]]
    finally:
        a.close()


def test_records_of_another_namespace_are_never_read_listed_deleted_or_overwritten(tmp_path):
    a, b = tier(tmp_path / "d", A, 4), tier(tmp_path / "d", B, 4)
    try:
        keys = make_keys(2, b"same")
        rows = random_rows(2)
        assert a.write(keys, [-1, -1], rows) == [True, True]
        assert b.write(keys, [-1, -1], random_rows(2, seed=1)) == [False, False]  # refused, not shared
        assert b.has(keys) == [False, False] and b.stored_keys() == []
        out = torch.empty_like(rows)
        ok, corrupt, missing = b.read_ex(keys, [-1, -1], out)
        assert ok == [False, False] and missing == [True, True] and corrupt == [False, False]
        b.delete(keys)
        assert a.has(keys) == [True, True]
        ok, _, _ = a.read_ex(keys, [-1, -1], out)
        assert ok == [True, True] and torch.equal(out, rows)
        assert b.foreign_namespaces() == {A} and a.foreign_namespaces() == {B}
    finally:
        a.close(), b.close()


def test_modes_cannot_be_mixed_on_one_directory(tmp_path):
    a = tier(tmp_path / "d", A, 4, "shared")
    try:
        with pytest.raises(ConfigError, match="disk_budget"):
            tier(tmp_path / "d", B, 4, "namespace")
    finally:
        a.close()


def test_a_directory_from_before_the_budget_is_adopted_by_its_first_opener(tmp_path):
    import lmdb

    a = tier(tmp_path / "d", A, 4)
    keys = make_keys(3, b"old")
    put(a, keys)
    a.close()
    env = lmdb.open(str(tmp_path / "d" / "index"), max_dbs=16)  # strip the accounting, as an old writer left it
    with env.begin(write=True) as txn:
        for name in (b"owners", b"order", b"spaces"):
            txn.drop(env.open_db(name, txn=txn), delete=True)
        txn.delete(b"acct", db=env.open_db(b"meta", txn=txn))
    env.close()
    a = tier(tmp_path / "d", A, 4)
    try:
        assert sorted(a.stored_keys()) == sorted(keys) and used(a, A) == 3
    finally:
        a.close()
