"""The movers layer on its own: ``JobExecutor`` runs each kind of job between slab tiers, keyed tiers
and a caller's buffer; ``EdgeMovers`` runs each job on the edge it crosses.

No planner here: the tests build ``TransferJob`` records by hand, as the planner would.

Threading contract: single-threaded tests; ``EdgeMovers`` runs jobs on its own threads.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import torch

from tiered_kv.errors import ConfigError
from tiered_kv.movers import EdgeMovers, JobExecutor
from tiered_kv.testing import LAYOUT, make_keys, random_rows
from tiered_kv.tiers.base import Tier
from tiered_kv.tiers.cpu import CpuTier
from tiered_kv.tiers.disk import DiskTier
from tiered_kv.tiers.gpu import GpuTier
from tiered_kv.values.jobs import EXT, NO_SLOT, Completion, JobKind, TransferJob

NB = LAYOUT.nbytes


class DictTier(Tier):
    """A keyed tier in memory: stands in for a new keyed medium (say a remote one) the executor has never seen."""

    name = "dict"
    slotted = False

    def __init__(self, capacity: int) -> None:
        super().__init__(LAYOUT, capacity)
        self.records: dict[bytes, bytes] = {}

    def write(self, keys: Sequence[bytes], slots: Sequence[int], rows) -> list[bool]:
        """Keep a copy of each row, up to ``capacity`` records."""
        ok = []
        for k, row in zip(keys, rows):
            fits = k in self.records or len(self.records) < self.capacity
            if fits:
                self.records.setdefault(k, row.cpu().numpy().tobytes())
            ok.append(fits)
        return ok

    def read(self, keys: Sequence[bytes], slots: Sequence[int], out):
        """Copy each held record into ``out[i]``."""
        ok, corrupt, _ = self.read_ex(keys, slots, out)
        return ok, corrupt

    def read_ex(self, keys: Sequence[bytes], slots: Sequence[int], out):
        """``read``, with a key it does not hold reported missing."""
        ok, missing = [], []
        for i, k in enumerate(keys):
            raw = self.records.get(k)
            if raw is not None:
                out[i].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
            ok.append(raw is not None)
            missing.append(raw is None)
        return ok, [False] * len(keys), missing

    def delete(self, keys: Sequence[bytes]) -> None:
        """Forget ``keys``."""
        for k in keys:
            self.records.pop(k, None)


def job(kind: JobKind, src: int, dst: int, keys, src_slots, dst_slots, handle: int = 0, job_id: int = 1) -> TransferJob:
    return TransferJob(job_id, kind, src, dst, list(keys), list(src_slots), list(dst_slots), handle)


@pytest.fixture
def chain(tmp_path):
    """GPU (CUDA where present) -> CPU -> disk -> an in-memory keyed tier, and a buffer registry."""
    tiers = [GpuTier(LAYOUT, 8 * NB, device="auto"), CpuTier(LAYOUT, 8 * NB),
             DiskTier(LAYOUT, tmp_path / "disk", 16 * 4096), DictTier(8)]
    buffers: dict[int, torch.Tensor] = {}
    yield JobExecutor(tiers, buffers), tiers, buffers
    for t in tiers:
        t.close()


def test_blocks_go_down_the_chain_and_back_bit_exact(chain):
    """Caller -> gpu -> cpu -> disk -> dict (keyed to keyed) -> cpu -> caller: every edge kind, same bytes."""
    ex, tiers, buffers = chain
    keys, rows = make_keys(4), random_rows(4)
    buffers[7] = rows
    steps = [
        job(JobKind.INGRESS, EXT, 0, keys, range(4), [3, 1, 0, 2], handle=7),
        job(JobKind.DEMOTE, 0, 1, keys, [3, 1, 0, 2], [4, 5, 6, 7]),
        job(JobKind.COPY_DOWN, 1, 2, keys, [4, 5, 6, 7], [NO_SLOT] * 4),
        job(JobKind.DEMOTE, 2, 3, keys, [NO_SLOT] * 4, [NO_SLOT] * 4),
    ]
    for j in steps:
        done = ex.execute(j)
        assert done.ok == [True] * 4 and done.nbytes == 4 * NB, j.kind
    tiers[1].slab.zero_()
    done = ex.execute(job(JobKind.PROMOTE, 3, 1, keys, [NO_SLOT] * 4, [0, 1, 2, 3]))
    assert done.ok == [True] * 4 and done.missing == [False] * 4
    out = torch.zeros_like(rows)
    buffers[8] = out
    assert ex.execute(job(JobKind.EGRESS, 1, EXT, keys, [0, 1, 2, 3], range(4), handle=8)).ok == [True] * 4
    assert torch.equal(out, rows)


def test_keyed_source_into_gpu_rows_and_from_disk_to_caller(chain):
    """A keyed read lands in GPU rows (staged) or straight in the caller's host rows."""
    ex, tiers, buffers = chain
    keys, rows = make_keys(3), random_rows(3, seed=1)
    buffers[1] = rows
    assert ex.execute(job(JobKind.INGRESS, EXT, 2, keys, range(3), [NO_SLOT] * 3, handle=1)).ok == [True] * 3
    assert ex.execute(job(JobKind.PROMOTE, 2, 1, keys, [NO_SLOT] * 3, [5, 6, 7])).ok == [True] * 3
    assert ex.execute(job(JobKind.PROMOTE, 1, 0, keys, [5, 6, 7], [2, 0, 1])).ok == [True] * 3
    assert torch.equal(tiers[0].slab[[2, 0, 1]].cpu(), rows)
    assert ex.execute(job(JobKind.DEMOTE, 0, 3, keys, [2, 0, 1], [NO_SLOT] * 3)).ok == [True] * 3
    tiers[0].slab.zero_()
    assert ex.execute(job(JobKind.PROMOTE, 3, 0, keys, [NO_SLOT] * 3, [4, 5, 6])).ok == [True] * 3
    assert torch.equal(tiers[0].slab[4:7].cpu(), rows)
    out = torch.zeros_like(rows)
    buffers[2] = out
    assert ex.execute(job(JobKind.EGRESS, 2, EXT, keys, [NO_SLOT] * 3, range(3), handle=2)).ok == [True] * 3
    assert torch.equal(out, rows)


def test_keyed_to_keyed_reports_missing_and_writes_only_what_it_read(chain):
    """A record the source lacks is missing and not written below; the others move."""
    ex, tiers, buffers = chain
    keys, rows = make_keys(3, b"m"), random_rows(3, seed=2)
    buffers[1] = rows[[0, 2]]
    ex.execute(job(JobKind.INGRESS, EXT, 2, [keys[0], keys[2]], range(2), [NO_SLOT] * 2, handle=1))
    done = ex.execute(job(JobKind.DEMOTE, 2, 3, keys, [NO_SLOT] * 3, [NO_SLOT] * 3))
    assert done.ok == [True, False, True] and done.missing == [False, True, False]
    assert done.nbytes == 2 * NB and set(tiers[3].records) == {keys[0], keys[2]}


def test_keyed_to_keyed_reports_a_refused_write(chain):
    """A destination that refuses an item (full) fails that item only."""
    ex, tiers, buffers = chain
    keys, rows = make_keys(10, b"f"), random_rows(10, seed=3)
    buffers[1] = rows
    ex.execute(job(JobKind.INGRESS, EXT, 2, keys, range(10), [NO_SLOT] * 10, handle=1))
    done = ex.execute(job(JobKind.DEMOTE, 2, 3, keys, [NO_SLOT] * 10, [NO_SLOT] * 10))
    assert done.ok == [True] * 8 + [False] * 2 and done.missing == [False] * 10


def test_delete_reaches_the_keyed_tier(chain):
    ex, tiers, buffers = chain
    keys = make_keys(2, b"d")
    buffers[1] = random_rows(2)
    ex.execute(job(JobKind.INGRESS, EXT, 3, keys, range(2), [NO_SLOT] * 2, handle=1))
    done = ex.execute(job(JobKind.DELETE, 3, EXT, keys[:1], [NO_SLOT], [NO_SLOT]))
    assert done.ok == [True] and set(tiers[3].records) == {keys[1]}


# ---------------------------------------------------------------------- EdgeMovers
def test_each_job_runs_on_the_edge_it_crosses():
    seen: dict[int, str] = {}
    done = threading.Event()

    def execute(j: TransferJob) -> Completion:
        seen[j.job_id] = threading.current_thread().name.rsplit("-", 1)[0].removeprefix("tkv-mover-")
        return Completion(j.job_id, [True] * len(j))

    def on_done(j: TransferJob, c: Completion) -> None:
        if len(seen) == 8:
            done.set()

    edges = EdgeMovers(["gpu", "cpu", "disk"], [1, 3], execute, on_done)
    jobs = [job(JobKind.INGRESS, EXT, 0, [b"k"], [0], [0], job_id=1),
            job(JobKind.EGRESS, 1, EXT, [b"k"], [0], [0], job_id=2),
            job(JobKind.DEMOTE, 0, 1, [b"k"], [0], [0], job_id=3),
            job(JobKind.PROMOTE, 2, 1, [b"k"], [0], [0], job_id=4),
            job(JobKind.COPY_DOWN, 1, 2, [b"k"], [0], [0], job_id=5),
            job(JobKind.DELETE, 2, EXT, [b"k"], [0], [0], job_id=6),
            job(JobKind.INGRESS, EXT, 2, [b"k"], [0], [0], job_id=7),
            job(JobKind.EGRESS, 0, EXT, [b"k"], [0], [0], job_id=8)]
    edges.submit(jobs)
    assert done.wait(10)
    edges.close()
    assert seen == {1: "front", 2: "gpu-cpu", 3: "gpu-cpu", 4: "cpu-disk", 5: "cpu-disk", 6: "cpu-disk",
                    7: "cpu-disk", 8: "front"}
    assert [edges.depth(t) for t in range(3)] == [0, 0, 0]


def test_edge_worker_counts_must_match_the_edges():
    with pytest.raises(ConfigError, match="3 tiers have 2 edges"):
        EdgeMovers(["gpu", "cpu", "disk"], [1], lambda j: Completion(j.job_id, []), lambda j, c: None)
