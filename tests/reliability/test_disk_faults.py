"""The disk tier under faults: a disk that cannot take a block never stops the store from taking new ones.

Issue 29's rule for every tier below the CPU tier: a failed demotion never blocks eviction from the tier above;
the block is dropped there (a miss later, never wrong), counted (``demotions_dropped`` on the CPU tier), the
fault logged at most once per directory per interval, and puts go on. Faults are made with the real kernel on
the store's own descriptors, nothing is mocked:
- the payload file's descriptor swapped (``dup2``) for a read-only one of the same file: every write fails
  (``EBADF``) while reads still work, as on a file system remounted read-only after an I/O error;
- swapped for ``/dev/full``: every write fails with ``ENOSPC`` (a full disk) and every read returns zeros, so
  the records already there fail their checksums: misses, dropped and counted, never served;
- the whole directory removed under the running store (``rm -rf``): the open files live on unlinked, the store
  goes on serving and taking blocks, closes cleanly, and the path reopens empty.

Threading contract: single-threaded tests (plus the store's own mover threads).
"""
from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from tests.reliability._common import DTYPE, SHAPE, TORCH_DTYPE, blocks_of, key_of, matches
from tiered_kv.store.tiered_store import TieredStore

CPU_BLOCKS = 8


def cpu_disk_config(path) -> dict:
    """An 8-block CPU tier over a disk tier (4 KiB blocks)."""
    return {"block_shape": list(SHAPE), "dtype": DTYPE, "cpu_bytes": CPU_BLOCKS * 4096, "disk_path": str(path),
            "disk_bytes": 4 << 20, "model": "disk-faults"}


def put_and_read_back_one_by_one(store: TieredStore, keys: list[bytes]) -> tuple[int, int]:
    """Put each key alone and read it back at once (it is in the CPU tier then): (accepted, read back exact)."""
    accepted = readable = 0
    out = torch.empty((1, *SHAPE), dtype=TORCH_DTYPE)
    for k in keys:
        accepted += store.put([k], blocks_of([k])).wait(30)[0]
        readable += store.get([k], out).wait(30) == 1 and matches(k, out[0])
    return accepted, readable


def read_each(store: TieredStore, keys: list[bytes]) -> tuple[int, int, int]:
    """(served exact, served wrong, missed) reading each key alone."""
    served = wrong = missed = 0
    out = torch.empty((1, *SHAPE), dtype=TORCH_DTYPE)
    for k in keys:
        if store.get([k], out).wait(30) == 1:
            if matches(k, out[0]):
                served += 1
            else:
                wrong += 1
        else:
            missed += 1
    return served, wrong, missed


def swap_payload_fd(store: TieredStore, target: str, flags: int) -> None:
    """Point the disk tier's payload descriptor at ``target`` opened with ``flags`` (the kernel's own errors)."""
    fd = os.open(target, flags)
    try:
        os.dup2(fd, store.disk.slots.fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_disk_writes_failing_never_stop_puts_and_are_logged_once(tmp_path, caplog, fault):
    caplog.set_level(logging.WARNING, logger="tiered_kv.tiers.disk")
    path = tmp_path / "kv"
    old = [key_of(i, b"old") for i in range(64)]
    new = [key_of(i, b"new") for i in range(64)]
    with TieredStore(cpu_disk_config(path)) as store:
        assert all(store.put(old, blocks_of(old)).wait(30)) and store.drain(30)
        assert store.locate(old).count("disk") == 64 - CPU_BLOCKS
        payload = str(path / "payload.bin")
        if fault == "read-only":
            swap_payload_fd(store, payload, os.O_RDONLY)
        else:
            swap_payload_fd(store, "/dev/full", os.O_RDWR)
        caplog.clear()
        accepted, readable = put_and_read_back_one_by_one(store, new)
        assert store.drain(30)
        st = store.stats()
        faults = store.disk.faults.counts()[str(path)]
        lines = [r for r in caplog.records if "write of slot" in r.getMessage()]
        served, wrong, missed = read_each(store, old)
        print(f"\n[disk writes fail: {fault}] new puts {accepted}/64 accepted, {readable}/64 read back; "
              f"{st['tiers']['cpu']['demotions_dropped']} dropped after a failed demotion, {faults} faults, "
              f"{len(lines)} log line(s); old blocks: {served} served, {wrong} wrong, {missed} missed")
        assert accepted == 64 and readable == 64 and st["puts_refused"] == 0
        # 64 evicted from the CPU tier (its 8 old blocks, then 56 new ones): each demotion failed, each dropped
        assert st["tiers"]["cpu"]["demotions_dropped"] == 64 == faults
        assert len(lines) == 1  # the first fault; the next ones within the interval are only counted
        assert wrong == 0
        if fault == "read-only":  # reads still work: the old blocks on disk are served
            assert (served, missed) == (64 - CPU_BLOCKS, CPU_BLOCKS)
        else:  # every read returns zeros: the records fail their checks, are dropped and counted, never served
            assert (served, missed) == (0, 64)
            assert store.stats()["tiers"]["disk"]["corrupt_dropped"] >= 64 - CPU_BLOCKS  # (a get and its promotion may both see one)
        # the disk is well again: demotions land there again
        swap_payload_fd(store, payload, os.O_RDWR)
        again = [key_of(i, b"again") for i in range(32)]
        assert all(store.put(again, blocks_of(again)).wait(30)) and store.drain(30)
        assert store.locate(again).count("disk") == 32 - CPU_BLOCKS
        assert read_each(store, again) == (32, 0, 0)


def test_a_directory_removed_under_a_running_store(tmp_path):
    path = tmp_path / "kv"
    first = [key_of(i, b"first") for i in range(48)]
    later = [key_of(i, b"later") for i in range(48)]
    with TieredStore(cpu_disk_config(path)) as store:
        assert all(store.put(first, blocks_of(first)).wait(30)) and store.drain(30)
        shutil.rmtree(path)  # the open files live on, unlinked
        accepted, readable = put_and_read_back_one_by_one(store, later)
        assert store.drain(30)
        served, wrong, missed = read_each(store, first + later)
        print(f"\n[disk directory removed while running] new puts {accepted}/48 accepted, {readable}/48 read back; "
              f"all blocks: {served} served, {wrong} wrong, {missed} missed")
        assert accepted == 48 and readable == 48 and wrong == 0 and store.stats()["puts_refused"] == 0
    with TieredStore(cpu_disk_config(path)) as store:  # the path starts empty: nothing stale, nothing wrong
        assert store.contains(first + later) == [False] * 96
        assert all(store.put(first, blocks_of(first)).wait(30)) and store.drain(30)
        assert read_each(store, first) == (48, 0, 0)
