"""Full: a full disk tier (byte budget) or a full file system never raises into the caller.

What this proves (docs/reliability.md, "Full"):
- byte budget: a disk-only store with room for 16 blocks takes 64 puts; every put returns
  a list of bools (never raises), LRU evicts the oldest, at most 16 blocks are resident, the
  newest 16 read back bit-exact, and the slot file never grows past the budget;
- a directory another process of the namespace filled: one budget and one LRU order for both
  processes, so puts land by evicting the least recently used records, whoever wrote them
  (a block this process just read is kept); nothing is refused, nothing read wrong;
- file system full (an 8 MiB tmpfs, mounted when the test runs as root and the kernel
  allows it; skipped otherwise with the reason): puts past ENOSPC return ``False``, no
  exception, every block acknowledged earlier still reads bit-exact, and after deletes
  free slots, new puts (in small batches) land again;
- a put whose LMDB header commit fails for lack of space gives its claimed slots back.

Threading contract: single-threaded tests; one child process in the shared-slots test.
"""
from __future__ import annotations

import os
import subprocess
import uuid

import pytest

from tests.reliability._common import (blocks_of, child_env, disk_config, key_of, read_all, slot_accounting,
                                       worker_cmd)
from tiered_kv.store.tiered_store import TieredStore

SLOT = 4096


def test_byte_budget_evicts_by_policy_and_never_raises(tmp_path):
    path = tmp_path / "kv"
    keys = [key_of(i, b"budget") for i in range(64)]
    with TieredStore(disk_config(path, disk_bytes=16 * SLOT)) as store:
        for s in range(0, 64, 4):
            res = store.put(keys[s:s + 4], blocks_of(keys[s:s + 4])).wait(30)
            assert isinstance(res, list) and len(res) == 4
            assert store.stats()["tiers"]["disk"]["resident_blocks"] <= 16
        store.drain()
        st = store.stats()
        served, wrong, missing = read_all(store, keys)
        assert not wrong
        assert set(keys[-16:]) <= set(served), "the newest blocks must survive LRU eviction"
        assert len(served) <= 16 and st["tiers"]["disk"]["evictions"] >= 48, st["tiers"]["disk"]
        assert os.path.getsize(path / "payload.bin") <= 16 * SLOT
    print(f"byte budget: 64 puts into 16 slots -> {len(served)} resident, "
          f"{st['tiers']['disk']['evictions']} evictions, {st['puts_refused']} refused")


def test_a_directory_filled_by_another_process_is_one_budget_with_one_lru_order(tmp_path):
    """Issue 17: capacity is the directory's, not the process's. Another process of the namespace filled the
    budget; puts still land, by evicting the namespace's least recently used records whoever wrote them."""
    path = tmp_path / "kv"
    budget = 32 * SLOT
    mine = [key_of(i, b"mine") for i in range(8)]
    with TieredStore(disk_config(path, disk_bytes=budget)) as store:
        assert all(store.put(mine, blocks_of(mine)).wait(30))
        store.flush()
        r = subprocess.run(worker_cmd("fill_slots", path, 24, budget), capture_output=True, env=child_env(),
                           timeout=120)
        assert r.returncode == 0 and b"FILLED 24" in r.stdout, r.stderr.decode()[-2000:]
        served, wrong, _ = read_all(store, mine[:4])  # read: now the youngest in the directory's order
        assert len(served) == 4 and not wrong
        more = [key_of(i, b"more") for i in range(8)]
        res = store.put(more, blocks_of(more)).wait(30)
        assert res == [True] * 8, f"the directory's budget did not make room: {res}"
        store.drain()
        assert store.stats()["tiers"]["disk"]["evictions"] == 8
        served, wrong, missing = read_all(store, mine + more)
        assert not wrong and set(served) == set(mine[:4] + more) and set(missing) == set(mine[4:])
        acct = slot_accounting(store.tiers[-1])
        assert acct["records"] == 32 and acct["unaccounted"] == 0, acct
        assert os.path.getsize(path / "payload.bin") <= budget
        others = [key_of(i, b"other") for i in range(24)]
        served, wrong, _ = read_all(store, others)  # the other process's blocks: same namespace, readable
        assert len(served) == 20 and not wrong
        print(f"directory filled by another process: 8/8 puts landed, evicting the 4 unread blocks of this "
              f"process and the 4 oldest of the other's; {acct}")


@pytest.fixture
def small_fs(tmp_path):
    """An 8 MiB tmpfs mounted under tmp_path (root only); skips with the reason otherwise."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("file-system-full part needs root to mount an 8 MiB tmpfs; the byte-budget tests cover the rest")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", f"tkv-{uuid.uuid4().hex[:8]}",
                        str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()}); the byte-budget tests cover the rest")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill_fs(store, keys):
    acked: list[bytes] = []
    refused = 0
    for s in range(0, len(keys), 32):
        part = keys[s:s + 32]
        res = store.put(part, blocks_of(part)).wait(60)  # never raises
        acked += [k for k, ok in zip(part, res) if ok]
        refused += res.count(False)
    return acked, refused


def test_file_system_full_refuses_puts_and_keeps_reading(small_fs):
    path = small_fs / "kv"
    n = 4096  # 16 MiB of blocks for an 8 MiB file system
    keys = [key_of(i, b"fsfull") for i in range(n)]
    with TieredStore(disk_config(path, disk_bytes=n * SLOT)) as store:  # budget far above the FS size
        acked, refused = _fill_fs(store, keys)
        assert refused > 0, "the file system never filled up: the test proved nothing"
        assert len(acked) > 0
        served, wrong, missing = read_all(store, acked)
        assert not wrong
        assert len(served) == len(acked), f"{len(missing)} acknowledged blocks unreadable on a full FS"
        st = store.stats()
        store.delete(acked[: len(acked) // 2])
        store.drain()
        fresh = [k for k in keys if k not in set(acked)][:64]
        landed = []
        for s in range(0, 64, 4):  # small batches: LMDB itself has no room to grow on this FS
            res = store.put(fresh[s:s + 4], blocks_of(fresh[s:s + 4])).wait(60)
            landed += [k for k, ok in zip(fresh[s:s + 4], res) if ok]
        assert landed, "after deletes freed slots, no put succeeded on the full file system"
        served2, wrong2, _ = read_all(store, landed + acked[len(acked) // 2:])
        assert not wrong2 and len(served2) == len(landed) + len(acked) - len(acked) // 2
    print(f"8 MiB tmpfs: {len(acked)} blocks acknowledged, {refused} puts refused (no exception), "
          f"all {len(served)} acknowledged blocks read back; failed_transfers="
          f"{st['tiers']['disk']['failed_transfers']}; after deleting half, {len(landed)}/64 new puts landed")


def test_failed_index_commit_on_full_fs_returns_its_slots(small_fs):
    path = small_fs / "kv"
    keys = [key_of(i, b"fsleak") for i in range(4096)]
    with TieredStore(disk_config(path, disk_bytes=4096 * SLOT)) as store:
        acked, _ = _fill_fs(store, keys)
        store.delete(acked[: len(acked) // 2])
        store.drain()
        fresh = [k for k in keys if k not in set(acked)][:64]
        res = store.put(fresh, blocks_of(fresh)).wait(60)  # one batch: its index commit needs new LMDB pages
        assert res.count(False) > 0, "precondition: the batch's index commit should fail on the full FS"
        acct = slot_accounting(store.tiers[-1])
        print(f"after a failed 64-block commit: {acct}")
        assert acct["claims"] == 0, f"{acct['claims']} slots leaked in pending claims of a live process"
