"""``DiskIndex`` on its own: slot claims, commits, the free list, recovery of dead claims, listing, format checks.

The disk tier's contract suite (test_contract.py) covers the two parts together; these tests pin the
index's interface, which the shared-capacity work builds on.
"""
from __future__ import annotations

import struct
import subprocess
import sys

import pytest

from tiered_kv.errors import ConfigError
from tiered_kv.tiers.disk import DiskIndex
from tiered_kv.values.record import CODEC_NONE, RecordHeader

SLOT = 4096
FP = 0x1234


def _hdr(key: bytes, slot: int, fp: int = FP, created_ns: int = 0) -> bytes:
    return RecordHeader(CODEC_NONE, fp, slot, SLOT, SLOT, 7, created_ns).pack(key)


@pytest.fixture
def index(tmp_path):
    idx = DiskIndex(tmp_path / "index", SLOT, 4)
    yield idx
    idx.close()


def _counts(idx: DiskIndex) -> dict:
    info = idx.scan()
    return {k: info[k] for k in ("records", "free_listed", "pending_claims")}


def test_claims_up_to_the_file_size_then_refuses(index):
    keys = [bytes([i]) * 8 for i in range(6)]
    fresh, slots = index.claim(keys)
    assert fresh == list(range(6)) and slots == [0, 1, 2, 3]  # 4 slots in the file
    assert _counts(index) == {"records": 0, "free_listed": 0, "pending_claims": 4}
    assert index.commit([(keys[i], s, _hdr(keys[i], s)) for i, s in zip(fresh, slots)], [])
    assert _counts(index) == {"records": 4, "free_listed": 0, "pending_claims": 0}
    assert index.claim(keys) == ([4, 5], [])  # stored keys are not fresh; nothing left to claim
    assert index.has(keys) == [True] * 4 + [False] * 2


def test_failed_and_deleted_slots_are_reused_first(index):
    keys = [bytes([i]) * 8 for i in range(3)]
    _, slots = index.claim(keys)
    assert index.commit([(keys[0], slots[0], _hdr(keys[0], slots[0]))], failed_slots=slots[1:])
    assert _counts(index) == {"records": 1, "free_listed": 2, "pending_claims": 0}
    index.delete([keys[0], b"never-stored"])  # a key with no record is skipped
    assert _counts(index) == {"records": 0, "free_listed": 3, "pending_claims": 0}
    assert index.claim([b"x" * 8, b"y" * 8])[1] == [0, 1]  # lowest free slots, before the high-water mark grows


def test_a_key_stored_first_by_another_writer_keeps_its_record(index):
    key = b"k" * 8
    _, (mine,) = index.claim([key])
    _, (theirs,) = index.claim([key])  # both saw the key as fresh
    assert index.commit([(key, theirs, _hdr(key, theirs))], [])
    assert index.commit([(key, mine, _hdr(key, mine))], [])
    assert RecordHeader.unpack(key, index.headers([key])[0]).slot == theirs
    assert _counts(index) == {"records": 1, "free_listed": 1, "pending_claims": 0}  # my slot went back


def test_release_returns_claims_to_the_free_list(index):
    _, slots = index.claim([b"a" * 8, b"b" * 8])
    index.release(slots)
    assert _counts(index) == {"records": 0, "free_listed": 2, "pending_claims": 0}


def test_claims_of_dead_processes_are_recovered(tmp_path):
    idx = DiskIndex(tmp_path / "index", SLOT, 4)
    try:
        _, slots = idx.claim([b"a" * 8, b"b" * 8])
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        with idx.env.begin(write=True) as txn:  # as if a crashed writer had claimed slot 2
            txn.put(struct.pack(">Q", 2), struct.pack("<I", dead.pid), db=idx.db_claims)
        assert idx.recover_claims() == 1  # ours stay claimed: this process is alive
        assert _counts(idx) == {"records": 0, "free_listed": 1, "pending_claims": 2}
    finally:
        idx.close()


def test_list_keys_filters_by_prefix_and_layout_oldest_first(index):
    keys = [b"ns1-" + bytes([i]) * 4 for i in range(3)] + [b"ns2-aaaa"]
    _, slots = index.claim(keys)
    created = [30, 10, 20, 5]
    records = [(k, s, _hdr(k, s, created_ns=c)) for k, s, c in zip(keys, slots, created)]
    records[2] = (keys[2], slots[2], _hdr(keys[2], slots[2], fp=FP + 1, created_ns=20))  # another layout
    assert index.commit(records, [])
    assert index.list_keys(FP, b"ns1-") == ([keys[1], keys[0]], [])
    assert index.list_keys(FP) == ([keys[3], keys[1], keys[0]], [])
    with index.env.begin(write=True) as txn:  # a header that no longer parses
        txn.put(keys[0], b"\0" * 64, db=index.db_records)
    assert index.list_keys(FP, b"ns1-") == ([keys[1]], [keys[0]])
    index.drop_damaged(keys[0], slot_limit=4)
    assert index.has([keys[0]]) == [False]
    assert index.scan()["bad_headers"] == 0


def test_format_checks_on_reopen(tmp_path):
    idx = DiskIndex(tmp_path / "index", SLOT, 4)
    idx.close()
    with pytest.raises(ConfigError, match="bytes per slot"):
        DiskIndex(tmp_path / "index", 2 * SLOT, 4)
    grown = DiskIndex(tmp_path / "index", SLOT, 8)  # the file size in slots only grows
    assert grown.physical_slots == 8
    grown.close()
    ro = DiskIndex(tmp_path / "index", 1, 0, readonly=True)  # a read-only open adopts the directory's slot size
    try:
        assert ro.slot_bytes == SLOT and ro.physical_slots == 8
    finally:
        ro.close()
    with pytest.raises(ConfigError, match="cannot open the LMDB index"):
        DiskIndex(tmp_path / "nothing-here", SLOT, 0, readonly=True)
