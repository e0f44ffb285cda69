"""A damaged-looking disk directory is not moved aside while other processes have its index open.

Several engines may share one disk directory (issue 17). Before this, a process whose integrity check
called the index damaged renamed the directory although other processes were serving from it: they kept
their handles and went on writing into the moved copy, while every new process started an empty one (the
directory split in two). ``quarantine`` now asks Linux which processes hold LMDB's liveness lock on
``index/lock.mdb`` (``/proc/locks``) and leaves the directory in place while any does. Real LMDB, real
processes, real file locks; no mocks.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from tests.reliability._common import SHAPE, blocks_of, child_env, disk_config, key_of
from tiered_kv.connector.vllm.worker import open_disk_tier
from tiered_kv.errors import DamagedIndexError
from tiered_kv.store.tiered_store import TieredStore
from tiered_kv.tiers.disk import DiskTier, index_users, quarantine
from tiered_kv.values.layout import BlockLayout

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/locks"), reason="needs Linux's /proc/locks")

PAGE = 4096
# holds the directory's LMDB environment open (as a serving engine does) until its stdin closes
HOLDER = """
import sys, lmdb
env = lmdb.open(sys.argv[1], max_dbs=16, readonly=True, lock=True)
print("open", flush=True)
sys.stdin.read()
env.close()
"""


def _filled(path) -> list[bytes]:
    keys = [key_of(i, b"live") for i in range(4)]
    with TieredStore(disk_config(path, disk_bytes=4 << 20)) as store:
        assert all(store.put(keys, blocks_of(keys)).wait(60))
        store.flush()
    return keys


class _Holder:
    """A child process with the index of ``path`` open."""

    def __init__(self, path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path / "index")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)
        assert self.proc.stdout.readline().strip() == b"open"

    def close(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(30) == 0


def _zero_meta_pages(path) -> None:
    with open(path / "index" / "data.mdb", "r+b") as f:
        f.write(bytes(2 * PAGE))


def test_index_users_lists_the_processes_with_the_index_open(tmp_path):
    path = tmp_path / "kv"
    _filled(path)
    assert index_users(path) == []  # the store closed it
    holder = _Holder(path)
    try:
        assert index_users(path) == [holder.proc.pid]
        tier = DiskTier(BlockLayout(SHAPE, "bfloat16"), path, 4 << 20)  # this process too
        try:
            assert index_users(path) == sorted([holder.proc.pid, os.getpid()])
        finally:
            tier.close()
        assert index_users(path) == [holder.proc.pid]
    finally:
        holder.close()
    assert index_users(path) == []
    assert index_users(tmp_path / "nothing-here") == []


def test_index_users_reads_the_lock_list_format(tmp_path):
    path = tmp_path / "kv"
    _filled(path)
    ino = os.stat(path / "index" / "lock.mdb").st_ino
    locks = tmp_path / "locks"
    locks.write_text(f"1: POSIX  ADVISORY  READ 4242 fe:00:{ino} 0 0\n"
                     f"2: -> POSIX  ADVISORY  WRITE 4343 fe:00:{ino} 0 0\n"  # a process waiting for the lock
                     f"3: POSIX  ADVISORY  READ 4444 fe:00:{ino + 1} 0 0\n"  # another file
                     f"4: OFDLCK ADVISORY  READ -1 fe:00:{ino} 0 EOF\n")  # no process to name
    assert index_users(path, str(locks)) == [4242, 4343]
    assert index_users(path, str(tmp_path / "no-such-list")) is None  # cannot tell: not Linux


def test_a_damaged_index_other_processes_have_open_is_left_in_place(tmp_path, caplog):
    path = tmp_path / "kv"
    keys = _filled(path)
    holder = _Holder(path)
    try:
        _zero_meta_pages(path)
        with caplog.at_level(logging.ERROR):
            assert quarantine(path, "zeroed meta pages") is None
        assert path.is_dir() and not list(tmp_path.glob("kv.damaged-*"))
        assert any(str(holder.proc.pid) in r.getMessage() and "left in place" in r.getMessage()
                   for r in caplog.records)
        # the store runs without its disk tier and says the directory stayed where it was
        with TieredStore(disk_config(path, disk_bytes=4 << 20, cpu_bytes=1 << 20)) as store:
            q = store.stats()["disk_quarantined"]
            assert q is not None and q["moved_to"] is None and "disk" not in store.stats()["tiers"]
            assert store.lookup(keys) == 0
        assert path.is_dir() and not list(tmp_path.glob("kv.damaged-*"))
        # a vLLM worker rank cannot run on it and must not split it: a typed error that says what to do
        make = lambda: DiskTier(BlockLayout(SHAPE, "bfloat16"), path, 4 << 20)  # noqa: E731
        with pytest.raises(DamagedIndexError, match="left in place") as info:
            open_disk_tier(make)
        assert str(path) in str(info.value) and "tiered-kv repair" in str(info.value)
    finally:
        holder.close()
    # once nobody has it open, it is moved aside as before and the rank starts an empty directory
    tier = open_disk_tier(lambda: DiskTier(BlockLayout(SHAPE, "bfloat16"), path, 4 << 20))
    try:
        assert len(list(tmp_path.glob("kv.damaged-*"))) == 1 and tier.stored_keys() == []
    finally:
        tier.close()


# the first rank of test_a_rank_that_finds_...: moves the damaged directory aside, opens a fresh one, holds it
FIRST_RANK = """
import sys
from tiered_kv.connector.vllm.worker import open_disk_tier
from tiered_kv.tiers.disk import DiskTier
from tiered_kv.values.layout import BlockLayout
tier = open_disk_tier(lambda: DiskTier(BlockLayout(tuple(map(int, sys.argv[2].split(","))), "bfloat16"), sys.argv[1],
                                       4 << 20))
print("open", flush=True)
sys.stdin.read()
tier.close()
"""


def test_a_rank_that_finds_a_fresh_directory_after_the_move_opens_it(tmp_path):
    """Two ranks sharing a directory (a replicated MLA cache) find it damaged at once: the first (another
    process) moves it and opens a fresh one, so the second's move is refused (the first has the new index
    open) and the second opens the fresh directory, instead of moving it aside as well (which split it)."""
    path = tmp_path / "kv"
    _filled(path)
    _zero_meta_pages(path)
    layout = BlockLayout(SHAPE, "bfloat16")
    calls = []

    def make_second():
        calls.append(1)
        if len(calls) == 1:  # its check ran before the first rank moved the directory
            with pytest.raises(DamagedIndexError) as info:
                DiskTier(layout, path, 4 << 20)
            first = subprocess.Popen([sys.executable, "-c", FIRST_RANK, str(path), ",".join(map(str, SHAPE))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=child_env())
            assert first.stdout.readline().strip() == b"open"
            procs.append(first)
            raise info.value
        return DiskTier(layout, path, 4 << 20)

    procs: list[subprocess.Popen] = []
    try:
        second = open_disk_tier(make_second)
        try:
            assert len(calls) == 2 and len(list(tmp_path.glob("kv.damaged-*"))) == 1
            assert index_users(path) == sorted([procs[0].pid, os.getpid()])
        finally:
            second.close()
    finally:
        for p in procs:
            p.stdin.close()
            assert p.wait(30) == 0
