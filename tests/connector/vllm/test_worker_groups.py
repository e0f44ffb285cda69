"""The vLLM worker with several KV cache groups, driven directly (no vLLM): stores, in-step loads,
disk round trips and the plain-copy fallback over parts.

Two groups like a gpt-oss layer pair: a sliding-window group (2 layers, a 2-block window) and a
full-attention group (3 layers), over KV tensors that alias the way vLLM's hybrid allocation does
(layer j of every group is one tensor; the groups use disjoint blocks of it). Each group's share of
a chunk is its own record, a *part*, in one slot: the slot is 12 layer-blocks (the full group's 4
blocks of 3 layers; the window group's plane sees it as 6 blocks of 2 layers). ``run_group_round_trip``
is shared with ``tests/gpu/test_vllm_groups_gpu.py``, which runs it on CUDA with the engine's stream
kept busy before the in-step load.
"""
from __future__ import annotations

import time

import pytest
import torch

from tiered_kv.connector.vllm.config import ConnectorConfig
from tiered_kv.connector.vllm.geometry import Geometry, GroupGeo
from tiered_kv.connector.vllm.common import CPU, DISK, StepPlan
from tiered_kv.connector.vllm.worker import WorkerRuntime, slab_planes
from tiered_kv.copy import CopyLaunchError
from tiered_kv.values.jobs import EXT, JobKind, TransferJob
from tiered_kv.values.keys import Namespace

BS, K = 16, 4
WINDOW = 2  # blocks of the window before a hit boundary


def make_group_runtime(device: str, heads: int, head_dim: int, num_blocks: int, cpu_slots: int,
                       layers: tuple[int, int] = (2, 3), disk_path=None, **extra):
    """A rank-0 runtime over two groups (window: ``layers[0]`` layers, full: ``layers[1]``) on aliased bf16 tensors."""
    block = heads * BS * 2 * head_dim * 2
    names = [[f"model.layers.{2 * j}.attn" for j in range(layers[0])],
             [f"model.layers.{2 * j + 1}.attn" for j in range(layers[1])]]
    groups = (GroupGeo("swa", BS, tuple(names[0]), layers[0] * block, K, K, WINDOW, index=0),
              GroupGeo("full", BS, tuple(names[1]), layers[1] * block, K, K, index=1))
    geo = Geometry(BS, K, tuple(names[0] + names[1]), sum(g.block_nbytes for g in groups), 1, "test|groups", groups)
    cfg = ConnectorConfig(chunk_blocks=K, cpu_bytes=cpu_slots * geo.rank_chunk_nbytes, disk_path=disk_path,
                          **extra)
    disk_slots = 16 if disk_path else 0
    rt = WorkerRuntime(cfg, geo, Namespace("test-groups"), 0, cpu_slots, disk_slots)
    shared = [torch.zeros((num_blocks, heads, BS, 2 * head_dim), dtype=torch.bfloat16, device=device)
              for _ in range(max(layers))]
    kv = {n: shared[j] for g in names for j, n in enumerate(g)}
    rt.register(kv)
    return rt, kv, names


def _block_bytes(kv, names, block) -> torch.Tensor:
    """One block of a group, layer after layer, as the slot holds it."""
    return torch.cat([kv[n][block].contiguous().view(torch.uint8).reshape(-1).cpu() for n in names])


def _run(rt, plan, layerwise_ok=False, names=()):
    rt.on_plan(plan)
    rt.before_forward(layerwise_ok=layerwise_ok)
    for n in names:
        rt.wait_layer(n)
    rt.after_forward()
    reports = {}
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        res = rt.poll()
        reports.update(res.reports)
        assert not res.invalid_block_ids
        if rt.idle():
            break
        time.sleep(0.001)
    return reports


def _item(group: int, blocks: list[int]) -> list[int]:
    """A job item's GPU ids: ``K`` per group in group order, the item's group's blocks in its section."""
    ids = [-1] * (2 * K)
    ids[group * K:group * K + len(blocks)] = blocks
    return ids


def run_group_round_trip(device: str, heads: int = 2, head_dim: int = 16, chunks: int = 3, slow_stream=False,
                         break_copies: bool = False, tmp_path=None, **extra) -> dict:
    """Store the full-attention parts of ``chunks`` chunks and the window part of the last (its last 2 blocks),
    load them in-step into other blocks, check every layer. Returns the stats. ``extra``: more
    ``ConnectorConfig`` keys."""
    num_blocks = chunks * 2 * K * 2 + 4
    rt, kv, names = make_group_runtime(device, heads, head_dim, num_blocks, cpu_slots=chunks + 2,
                                       disk_path=str(tmp_path / "kv") if tmp_path else None,
                                       load_mode="layerwise", **extra)
    try:
        gen = torch.Generator().manual_seed(3)
        for t in {id(t): t for t in kv.values()}.values():
            t.copy_(torch.randint(-300, 300, t.shape, generator=gen).to(t.dtype))
        ids = torch.randperm(num_blocks - 1, generator=gen)[:4 * chunks * K].add(1).tolist()
        src_swa, src_full = ids[:chunks * K], ids[chunks * K:2 * chunks * K]
        dst_swa, dst_full = ids[2 * chunks * K:3 * chunks * K], ids[3 * chunks * K:]
        n = chunks + 1  # the full parts, then the window part of the last chunk
        slots = [n - i for i in range(n)]  # not in order
        keys = [b"full%d" % c for c in range(chunks)] + [b"window"]

        def ext(swa, full):
            out = []
            for c in range(chunks):
                out += _item(1, full[c * K:(c + 1) * K])
            last = chunks - 1
            return out + _item(0, [-1] * (K - WINDOW) + swa[last * K + K - WINDOW:(last + 1) * K])

        store = TransferJob(1, JobKind.INGRESS, EXT, CPU, keys, list(range(n)), slots)
        reports = _run(rt, StepPlan(1, stores=[store], ext={1: ext(src_swa, src_full)}))
        assert reports[1].ok == [True] * n
        # each part starts at its slot's first byte, in its group's block rows (the planes overlay the slab)
        planes = slab_planes(rt.cpu.slab, rt.geo.sections)
        rows = rt.geo.plane_rows
        assert rows == [6, 4]  # the slot is 12 layer-blocks: 6 window blocks of 2 layers, 4 full blocks of 3
        for c in range(chunks):
            for j in range(K):
                assert torch.equal(planes[1][slots[c] * rows[1] + j], _block_bytes(kv, names[1], src_full[c * K + j]))
        for j in range(K - WINDOW, K):
            want = _block_bytes(kv, names[0], src_swa[(chunks - 1) * K + j])
            assert torch.equal(planes[0][slots[-1] * rows[0] + j], want)
        if tmp_path is not None:  # through the disk and back: a record is its slot's row
            records = rt.cpu.slab[slots].clone()
            demote = TransferJob(2, JobKind.DEMOTE, CPU, DISK, keys, slots, [0] * n)
            assert _run(rt, StepPlan(2, early=[demote]))[2].ok == [True] * n
            rt.cpu.slab.zero_()
            promote = TransferJob(3, JobKind.PROMOTE, DISK, CPU, keys, [0] * n, slots)
            assert _run(rt, StepPlan(3, early=[promote]))[3].ok == [True] * n
            assert torch.equal(rt.cpu.slab[slots], records)
        if break_copies:
            def broken(*a, **k):
                raise CopyLaunchError("injected: cuMemcpyBatchAsync returned CUDA_ERROR_INVALID_VALUE")

            for copier in rt.in_step.copiers:
                copier.cpu_to_gpu_grouped = broken
                copier.cpu_to_gpu = broken
        if slow_stream:
            a = torch.randn(4096, 4096, device=device)
            for _ in range(12):
                a = a @ a / 64.0  # the engine stream is busy: the load must queue behind this
        load = TransferJob(4, JobKind.EGRESS, CPU, EXT, keys, slots, list(range(n)))
        rt.on_plan(StepPlan(4, early=[load], ext={4: ext(dst_swa, dst_full)}, sync=[4]))
        rt.before_forward(layerwise_ok=True)
        seen = {}
        for layer in sorted(n for g in names for n in g):  # vLLM's attention layers, in model order
            rt.wait_layer(layer)
            seen[layer] = kv[layer].clone()
        res = rt.poll()
        assert res.reports[4].ok == [True] * n and not res.invalid_block_ids
        for c in range(chunks):
            for j in range(K):
                for gi, (src, dst) in enumerate(((src_swa, dst_swa), (src_full, dst_full))):
                    if gi == 0 and (c != chunks - 1 or j < K - WINDOW):
                        continue  # not loaded
                    for name in names[gi]:
                        assert torch.equal(seen[name][dst[c * K + j]], kv[name][src[c * K + j]]), (name, c, j)
        assert rt.idle()
        return rt.stats()
    finally:
        rt.close()


def test_group_stores_and_in_step_loads_are_bit_exact():
    stats = run_group_round_trip("cpu")
    # window: 2 blocks x 2 layers (the last chunk only); full: 4 blocks x 3 layers; 2 KiB per block and layer
    assert stats["bytes_stored"] == (3 * 4 * 3 + 2 * 2) * 2048
    assert stats["bytes_loaded"] == (3 * 4 * 3 + 2 * 2) * 2048 and stats["sync_loads"] == 1


def test_group_records_go_to_disk_and_back(tmp_path):
    run_group_round_trip("cpu", tmp_path=tmp_path)


def test_group_in_step_loads_staged_are_bit_exact():
    stats = run_group_round_trip("cpu", in_step_copy="staged")
    assert stats["bytes_loaded"] == (3 * 4 * 3 + 2 * 2) * 2048 and stats["sync_loads"] == 1


def test_group_in_step_load_that_cannot_start_is_copied_plainly():
    stats = run_group_round_trip("cpu", break_copies=True)
    assert stats["failed_items"] == 0 and stats["sync_loads"] == 1


@pytest.mark.parametrize("extra", [{}, {"in_step_copy": "staged"}, {"break_copies": True}],
                         ids=["copy-engine", "staged", "plain-fallback"])
def test_group_in_step_loads_pipelined_layer_group_by_layer_group(extra):
    """``load_submit: pipelined`` past ``load_ahead_bytes``: each KV cache group's copy is submitted a
    layer at a time from ``wait_layer`` (every layer is checked as it is read), the plain fallback too."""
    stats = run_group_round_trip("cpu", load_ahead_bytes=1, load_groups=3, **extra)
    assert stats["failed_items"] == 0 and stats["sync_loads"] == 1
    assert stats["sync_load_groups"] == 2 + 3  # one group per layer: window 2 layers, full 3


def test_planes_view_the_whole_slab_in_each_groups_block_rows():
    slab = torch.arange(3 * 12, dtype=torch.uint8).view(3, 12)
    (plane,) = slab_planes(slab, [(4, 3)])
    assert plane.data_ptr() == slab.data_ptr() and plane.shape == (12, 3)
    a, b = slab_planes(slab, [(4, 2), (4, 3)])
    assert a.shape == (18, 2) and b.shape == (12, 3)
    assert a.data_ptr() == b.data_ptr() == slab.data_ptr()
    assert torch.equal(a[6 + 1], slab[1, 2:4]) and torch.equal(b[4 + 1], slab[1, 3:6])  # slot 1, block 1


@pytest.mark.parametrize("rows", [1, 5])
def test_failed_load_with_several_groups_stops_rather_than_reports(rows):
    """A load that failed after every fallback: with several groups vLLM cannot recompute blocks, so
    the worker raises instead of reporting them."""
    rt, _, _ = make_group_runtime("cpu", 1, 8, 40, cpu_slots=rows + 1, load_mode="async")
    try:
        from tiered_kv.values.jobs import Completion

        job = TransferJob(9, JobKind.EGRESS, CPU, EXT, [b"x"] * rows, list(range(rows)), list(range(rows)))
        rt.on_plan(StepPlan(1, ext={9: [1] * (rows * 2 * K)}))
        rt.runner.ext[9] = [1] * (rows * 2 * K)
        rt._on_done(job, Completion(9, [False] * rows, [False] * rows, 0, 0.0))
        with pytest.raises(RuntimeError, match="cannot recompute blocks of a model with 2 KV cache groups"):
            rt.poll()
    finally:
        rt.close()


def test_kernel_blocks_are_joined_into_vllm_blocks():
    """vLLM may cut a block into kernel blocks for its attention backend (``r`` rows per block): a
    block here is then ``r`` adjacent rows, and its bytes are those of the uncut block."""
    from tiered_kv.connector.vllm.config import ConnectorConfig as Cfg

    block = 2 * BS * 2 * 8 * 2  # 2 heads, 8 dims, bf16
    geo = Geometry(BS, K, ("l0",), block, 1, "test|kernel")
    rt = WorkerRuntime(Cfg(chunk_blocks=K, cpu_bytes=2 * K * block, load_mode="async"), geo, Namespace("kb"), 0, 2, 0)
    try:
        whole = torch.arange(10 * block // 2, dtype=torch.int16).view(torch.bfloat16).view(10, BS, 2, 16)
        split = whole.view(40, BS // 4, 2, 16)  # 4 kernel blocks of 4 tokens per block (LBNHC)
        rt.register({"l0": split})
        assert rt.kv.rows_per_block == 4 and rt.kv.num_blocks == 10
        job = TransferJob(1, JobKind.INGRESS, EXT, CPU, [b"k"], [0], [1])
        _run(rt, StepPlan(1, stores=[job], ext={1: [3, 4, 5, 6]}))
        want = torch.cat([whole[b].contiguous().view(torch.uint8).reshape(-1) for b in (3, 4, 5, 6)])
        assert torch.equal(rt.cpu.slab[1], want)
    finally:
        rt.close()
