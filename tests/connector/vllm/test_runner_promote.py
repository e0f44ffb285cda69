"""The worker's promotions (disk -> CPU tier) and demotions (CPU tier -> disk) over the slab's own rows, on real LMDB.

A promotion reads each record straight into the CPU slot the planner reserved for it (no temporary rows, no second
copy); a demotion writes from the source slots themselves. What must hold: the promoted slots are bit-exact, no other
slot changes, a damaged record is reported corrupt (and dropped) and a deleted one missing while the rest land, and a
round trip through the disk returns the bytes stored.
"""
from __future__ import annotations

import time

import torch

from tiered_kv.connector.vllm.common import CPU, DISK, StepPlan
from tiered_kv.values.record import RecordHeader
from tiered_kv.values.jobs import EXT, JobKind, TransferJob

from tests.connector.vllm.test_worker_groups import _item, _run, make_group_runtime


def _stored(tmp_path, n: int = 4):
    """A two-group runtime whose CPU tier holds ``n`` random chunks (slots 0..n-1), demoted to its disk tier."""
    K = 4
    num_blocks = 2 * n * K + 4
    rt, kv, _ = make_group_runtime("cpu", 2, 16, num_blocks, cpu_slots=2 * n + 2, disk_path=str(tmp_path / "kv"))
    gen = torch.Generator().manual_seed(11)
    for t in {id(t): t for t in kv.values()}.values():
        t.copy_(torch.randint(-300, 300, t.shape, generator=gen).to(t.dtype))
    keys = [b"chunk%d" % i for i in range(n)]
    ext = []
    for i in range(n):
        ext += _item(1, list(range(1 + i * K, 1 + (i + 1) * K)))
    store = TransferJob(1, JobKind.INGRESS, EXT, CPU, keys, list(range(n)), list(range(n)))
    assert _run(rt, StepPlan(1, stores=[store], ext={1: ext}))[1].ok == [True] * n
    demote = TransferJob(2, JobKind.DEMOTE, CPU, DISK, keys, list(range(n)), [0] * n)
    assert _run(rt, StepPlan(2, early=[demote]))[2].ok == [True] * n
    return rt, keys, rt.cpu.slab[:n].clone()


def test_a_promotion_lands_in_its_reserved_slots_and_nowhere_else(tmp_path):
    rt, keys, records = _stored(tmp_path)
    try:
        n = len(keys)
        rt.cpu.slab.fill_(0xAB)  # every slot a sentinel
        dst = [n + 1 + i for i in range(n)][::-1]  # fresh slots, not in order
        promote = TransferJob(3, JobKind.PROMOTE, DISK, CPU, keys, [0] * n, dst)
        rep = _run(rt, StepPlan(3, early=[promote]))[3]
        assert rep.ok == [True] * n
        for i, s in enumerate(dst):
            assert torch.equal(rt.cpu.slab[s], records[i]), i
        others = [s for s in range(rt.cpu.slab.shape[0]) if s not in dst]
        assert bool((rt.cpu.slab[others] == 0xAB).all())
    finally:
        rt.close()


def test_a_damaged_and_a_deleted_record_fail_alone(tmp_path):
    rt, keys, records = _stored(tmp_path)
    try:
        n = len(keys)
        disk = rt.disk
        raw = disk.index.headers([keys[1]])[0]
        hdr = RecordHeader.unpack(keys[1], raw)
        with open(disk.path / "payload.bin", "r+b") as fh:  # one payload byte changed on disk
            fh.seek(hdr.slot * disk.slots.slot_bytes + 64)
            byte = fh.read(1)
            fh.seek(hdr.slot * disk.slots.slot_bytes + 64)
            fh.write(bytes([(byte[0] + 1) % 256]))
        disk.delete([keys[2]])
        rt.cpu.slab.zero_()
        dst = [n + 1 + i for i in range(n)]
        rep = _run(rt, StepPlan(3, early=[TransferJob(3, JobKind.PROMOTE, DISK, CPU, keys, [0] * n, dst)]))[3]
        assert rep.ok == [True, False, False, True]
        assert rep.corrupt == [False, True, False, False]
        assert rep.missing == [False, False, True, False]
        assert torch.equal(rt.cpu.slab[dst[0]], records[0]) and torch.equal(rt.cpu.slab[dst[3]], records[3])
        assert disk.index.headers([keys[1]]) == [None]  # the damaged record was dropped
    finally:
        rt.close()


def test_a_round_trip_returns_the_bytes_while_the_source_slots_are_read_in_place(tmp_path):
    """Demote again from other slots (the rows themselves, no snapshot), promote back: the same bytes."""
    rt, keys, records = _stored(tmp_path, n=3)
    try:
        n = len(keys)
        rt.cpu.slab[n + 1:2 * n + 1] = records
        again = [b"again%d" % i for i in range(n)]
        demote = TransferJob(4, JobKind.DEMOTE, CPU, DISK, again, list(range(n + 1, 2 * n + 1)), [0] * n)
        assert _run(rt, StepPlan(4, early=[demote]))[4].ok == [True] * n
        rt.cpu.slab.zero_()
        t0 = time.monotonic()
        promote = TransferJob(5, JobKind.PROMOTE, DISK, CPU, again, [0] * n, [0, 1, 2])
        assert _run(rt, StepPlan(5, early=[promote]))[5].ok == [True] * n
        assert time.monotonic() - t0 < 20
        assert torch.equal(rt.cpu.slab[:n], records)
    finally:
        rt.close()
