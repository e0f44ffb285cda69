"""The vLLM worker's in-step loads, driven directly (no vLLM needed): ``WorkerRuntime`` over
per-layer KV tensors, a ``StepPlan`` with one in-step load, and a "forward" that reads each layer
on the engine's stream right after ``wait_layer`` -- the order vLLM's attention layers use.

``run_in_step_load`` is shared with ``tests/gpu/test_vllm_worker_gpu.py``, which runs it on CUDA
tensors and a pinned slab (there the waits are GPU-side events and the test fails if a layer is
read before its bytes landed); here it runs on CPU tensors, where the copy is synchronous.
"""
from __future__ import annotations

import pytest
import torch

from tiered_kv.connector.vllm.config import ConnectorConfig
from tiered_kv.connector.vllm.geometry import Geometry
from tiered_kv.connector.vllm.common import CPU, StepPlan
from tiered_kv.connector.vllm.in_step import (AUTO_STAGED_MAX_CHUNK, AUTO_STAGED_MIN_DESCRIPTORS, MAX_AUTO_GROUPS,
                                               MIN_GROUP_BYTES, auto_copy, descriptor_bound, layer_groups,
                                               runs_per_block)
from tiered_kv.copy import KVLayout
from tiered_kv.connector.vllm.worker import WorkerRuntime
from tiered_kv.values.keys import Namespace
from tiered_kv.values.jobs import EXT, JobKind, TransferJob

BS, K = 16, 4


def make_runtime(device: str, layers: int, heads: int, head_dim: int, num_blocks: int, cpu_chunks: int,
                 load_mode: str = "sync", cross_layer: bool = False, **extra):
    """A rank-0 ``WorkerRuntime`` registered on fresh ``(num_blocks, H, BS, 2D)`` bf16 layer tensors.

    ``cross_layer``: the layer tensors are views of one ``(num_blocks, layers, H, BS, 2D)`` tensor
    (vLLM 0.26's cross-layer KV cache, as ``register_cross_layers_kv_cache`` binds it). ``extra``:
    more ``ConnectorConfig`` keys.
    """
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(layers))
    block_nbytes = layers * heads * BS * 2 * head_dim * 2
    geo = Geometry(BS, K, names, block_nbytes, 1, "test")
    cfg = ConnectorConfig(chunk_blocks=K, cpu_bytes=cpu_chunks * K * block_nbytes, load_mode=load_mode, **extra)
    rt = WorkerRuntime(cfg, geo, Namespace("test"), 0, cpu_chunks, 0)
    if cross_layer:
        whole = torch.zeros((num_blocks, layers, heads, BS, 2 * head_dim), dtype=torch.bfloat16, device=device)
        kv = {n: whole[:, i] for i, n in enumerate(names)}
    else:
        kv = {n: torch.zeros((num_blocks, heads, BS, 2 * head_dim), dtype=torch.bfloat16, device=device)
              for n in names}
    rt.register(kv)
    return rt, kv, names


def run_in_step_load(device: str, layers: int = 4, heads: int = 2, head_dim: int = 64, chunks: int = 3,
                     layerwise: bool = True, slow_stream: bool = False, cross_layer: bool = False,
                     step_tokens: int | None = None, **extra) -> dict:
    """Load ``chunks`` chunks from CPU slots into scattered GPU blocks in-step; check every layer as read.

    Returns the worker's stats. With ``slow_stream`` (CUDA only) the engine's stream is kept busy
    before the load starts, so a read that did not wait would see the old (zero) bytes. ``step_tokens``:
    the tokens the plan says the step schedules (``in_step_sm_max_tokens``; None: not known).
    """
    num_blocks = chunks * K * 2 + 3
    rt, kv, names = make_runtime(device, layers, heads, head_dim, num_blocks, cpu_chunks=chunks + 2,
                                 load_mode="layerwise" if layerwise else "sync", cross_layer=cross_layer, **extra)
    try:
        gen = torch.Generator().manual_seed(5)
        slab = rt.cpu.slab
        slots = [chunks + 1 - c for c in range(chunks)]  # not in order
        slab[slots] = torch.randint(0, 256, (chunks, slab.shape[1]), dtype=torch.uint8, generator=gen)
        gpu = torch.randperm(num_blocks, generator=gen)[:chunks * K].tolist()
        gpu[1] = -1  # a block held locally already: must stay untouched
        job = TransferJob(7, JobKind.EGRESS, CPU, EXT, [b"k%d" % c for c in range(chunks)], slots,
                          list(range(chunks)))
        plan = StepPlan(1, early=[job], ext={7: gpu}, sync=[7], tokens=step_tokens)
        rt.on_plan(plan)
        if slow_stream:
            a = torch.randn(4096, 4096, device=device)
            for _ in range(12):
                a = a @ a / 64.0  # the engine stream is busy: the load must queue behind this
        rt.before_forward(layerwise_ok=layerwise)
        seen = []
        for name in names:  # what vLLM's attention layers do, layer by layer, on the engine stream
            rt.wait_layer(name)
            seen.append(kv[name].clone())
        result = rt.poll()
        assert result.reports[7].ok == [True] * chunks and not result.invalid_block_ids
        assert not result.finished_recving  # vLLM never waits for an in-step load
        want_layer = rt.kv.maps[0].nbytes
        for li, name in enumerate(names):
            got = seen[li].cpu()
            for i, g in enumerate(gpu):
                block = got[g].contiguous().view(torch.uint8).reshape(-1) if g >= 0 else None
                if g < 0:
                    continue
                row = slab[slots[i // K]].view(K, -1)[i % K]
                want = row[li * want_layer:(li + 1) * want_layer]
                assert torch.equal(block, want), f"layer {li} block {g} (item {i}) read before it landed or wrong"
        assert rt.idle()
        return rt.stats()
    finally:
        rt.close()


def test_load_rows_skip_blocks_held_on_the_gpu():
    """``JobRunner.flat``: per item its GPU blocks and plane rows (slot * chunk_blocks + j), -1 blocks left out,
    whether an item has none, some or only -1s."""
    rt, _, _ = make_runtime("cpu", 2, 1, 4, 32, cpu_chunks=8)
    try:
        ext = [3, 4, 5, 6, -1, -1, 7, 8, 9, -1, 10, -1, -1, -1, -1, -1, 11, 12, 13, 14]
        job = TransferJob(5, JobKind.EGRESS, CPU, EXT, [b"a", b"b", b"c", b"d", b"e"], [6, 2, 0, 7, 1], list(range(5)))
        rt.runner.ext[5] = ext
        want = [(g, s * K + j) for i, s in enumerate(job.src_slots) for j, g in enumerate(ext[i * K:(i + 1) * K])
                if g >= 0]
        (gpu, rows), = rt.runner.flat(job, job.src_slots)
        assert list(zip(gpu, rows)) == want
        (gpu, rows), = rt.runner.flat(job, job.src_slots, [4, 3, 1])  # item 3: every block held
        assert list(zip(gpu, rows)) == [(11, 4), (12, 5), (13, 6), (14, 7), (7, 10), (8, 11)]
    finally:
        rt.close()


@pytest.mark.parametrize("in_step_copy", ["auto", "copy_engine", "staged"])
@pytest.mark.parametrize("cross_layer", [False, True], ids=["per-layer", "cross-layer"])
def test_in_step_load_on_cpu_is_bit_exact_and_reported(cross_layer, in_step_copy):
    stats = run_in_step_load("cpu", layerwise=False, cross_layer=cross_layer, in_step_copy=in_step_copy)
    assert stats["sync_loads"] == 1 and stats["bytes_loaded"] == (3 * K - 1) * 4 * 2 * BS * 128 * 2
    # "auto" stages only on CUDA (the copy engine's per-descriptor cost); on CPU tensors the copier's own path
    assert stats["sync_staged_copies"] == (1 if in_step_copy == "staged" else 0)


def test_auto_in_step_copy_is_the_default_and_its_rule():
    """``in_step_copy: auto``: staged where the copy engine would be descriptor-bound (layer-blocks of at most
    32 KiB, or at least 32,768 of them in one copy), only on CUDA."""
    assert ConnectorConfig().in_step_copy == "auto"

    def layout(heads: int, layers: int = 28) -> KVLayout:
        return KVLayout(tuple(torch.zeros((4, heads, BS, 2 * 128), dtype=torch.bfloat16) for _ in range(layers)))

    small, large = layout(4), layout(8)  # 16 tokens x (K, V) x 128 dims x 2 B: 32 KiB and 64 KiB layer-blocks
    assert small.block_nbytes == 28 * AUTO_STAGED_MAX_CHUNK and large.block_nbytes == 28 * 2 * AUTO_STAGED_MAX_CHUNK
    assert descriptor_bound(small, 1) and descriptor_bound(small, 0)
    edge = -(-AUTO_STAGED_MIN_DESCRIPTORS // 28)  # the fewest 64 KiB blocks with >= 32,768 descriptors
    assert not descriptor_bound(large, edge - 1) and descriptor_bound(large, edge)
    assert auto_copy(small, 1) is None and auto_copy(large, edge) is None  # CPU tensors: the copier chooses
    # the layers of a cross-layer tensor are adjacent in a block: one 896 KiB run, not 28 small ones
    whole = torch.zeros((4, 28, 4, BS, 2 * 128), dtype=torch.bfloat16)
    cross = KVLayout(tuple(whole[:, i] for i in range(28)))
    assert small.num_chunks == cross.num_chunks == 28 and runs_per_block(small) == 28 and runs_per_block(cross) == 1
    assert not descriptor_bound(cross, 1) and descriptor_bound(cross, AUTO_STAGED_MIN_DESCRIPTORS)


def test_async_load_mode_has_no_in_step_loader():
    """``load_mode`` "async": the planner plans no in-step loads, so the runtime builds no loader
    and vLLM's per-layer and per-step hooks stay no-ops."""
    rt, _, names = make_runtime("cpu", layers=2, heads=1, head_dim=8, num_blocks=4, cpu_chunks=1, load_mode="async")
    try:
        assert rt.in_step is None
        rt.on_plan(StepPlan(1))
        rt.before_forward(layerwise_ok=True)
        for name in names:
            rt.wait_layer(name)
        result = rt.poll()
        assert not result.reports and rt.idle()
        assert rt.stats()["sync_loads"] == 0
    finally:
        rt.close()


def test_layer_groups_follow_the_load_size_and_the_key():
    rt, _, _ = make_runtime("cpu", layers=32, heads=1, head_dim=8, num_blocks=4, cpu_chunks=1)
    try:
        assert MAX_AUTO_GROUPS == 2
        assert layer_groups(rt.kv, 1) == [(0, 32)]  # small: one piece
        assert layer_groups(rt.kv, MIN_GROUP_BYTES) == [(0, 32)]
        assert layer_groups(rt.kv, 1000 * MIN_GROUP_BYTES) == [(0, 16), (16, 32)]  # at most MAX_AUTO_GROUPS
        assert layer_groups(rt.kv, 1, wanted=3) == [(0, 11), (11, 22), (22, 32)]  # the key wins over the size
        assert layer_groups(rt.kv, 1, wanted=32) == [(i, i + 1) for i in range(32)]
        assert layer_groups(rt.kv, 1, wanted=99) == [(i, i + 1) for i in range(32)]  # at most one per layer
    finally:
        rt.close()


def test_load_groups_and_in_step_copy_keys_are_validated():
    assert ConnectorConfig(load_groups=4).load_groups == 4
    for bad in (-1, 1.5, True, 5000):
        with pytest.raises(Exception, match="load_groups"):
            ConnectorConfig(load_groups=bad)
    assert ConnectorConfig(in_step_copy="sm_kernel").in_step_copy == "sm_kernel"
    assert ConnectorConfig(in_step_copy="staged", load_staging_bytes="64MiB").load_staging_bytes == 64 << 20
    with pytest.raises(Exception, match="load_staging_bytes"):
        ConnectorConfig(load_staging_bytes=0)
    with pytest.raises(Exception, match="in_step_copy"):
        ConnectorConfig(in_step_copy="dma")
    assert ConnectorConfig().load_stream_priority == -1 and ConnectorConfig(load_stream_priority=0).load_stream_priority == 0
    for bad in (1, -17, "high", True):
        with pytest.raises(Exception, match="load_stream_priority"):
            ConnectorConfig(load_stream_priority=bad)
    assert ConnectorConfig().load_staging_buffers == 1 and ConnectorConfig(load_staging_buffers=2).load_staging_buffers == 2
    for bad in (0, 3, "2", True):
        with pytest.raises(Exception, match="load_staging_buffers"):
            ConnectorConfig(load_staging_buffers=bad)


@pytest.mark.parametrize("mode", ["layerwise", "sync", "async", "eager"])
def test_load_mode_is_validated(mode):
    if mode == "eager":
        with pytest.raises(Exception, match="load_mode"):
            ConnectorConfig(load_mode=mode)
    else:
        assert ConnectorConfig(load_mode=mode).load_mode == mode


def test_fence_cancels_a_queued_store_and_waits_for_a_started_one(caplog):
    """A fence waits for a store whose copy began and cancels one still queued behind it, and says so in a
    warning (at most one per ``DROP_WARN_INTERVAL_S``)."""
    import threading
    import time

    from tiered_kv.values.jobs import EXT as _EXT

    rt, kv, names = make_runtime("cpu", layers=2, heads=1, head_dim=8, num_blocks=16, cpu_chunks=4)
    release, entered = threading.Event(), threading.Event()
    copy = rt.runner._copy

    def held_copy(copiers, job, parts, to_cpu):  # the first store's copy waits until released
        if job.job_id == 1:
            entered.set()
            assert release.wait(10)
        return copy(copiers, job, parts, to_cpu)

    rt.runner._copy = held_copy
    try:
        for name in names:
            kv[name].copy_(torch.randint(-100, 100, kv[name].shape).to(kv[name].dtype))
        rt.cpu.slab.zero_()
        a = TransferJob(1, JobKind.INGRESS, _EXT, CPU, [b"a"], [0], [0])
        b = TransferJob(2, JobKind.INGRESS, _EXT, CPU, [b"b"], [0], [1])
        rt.on_plan(StepPlan(1, stores=[a, b], ext={1: list(range(K)), 2: list(range(K, 2 * K))}))
        rt.after_forward()
        assert entered.wait(10)  # store 1 is copying; store 2 is queued behind it on the front mover
        rt.on_plan(StepPlan(2, fences=[1, 2]))
        threading.Timer(0.2, release.set).start()
        with caplog.at_level("WARNING", logger="tiered_kv.connector.vllm.worker"):
            rt.fence()  # returns once store 1 finished; store 2 is cancelled, not waited for
        assert release.is_set()
        warned = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
        assert len(warned) == 1 and "1 stored chunk(s) dropped" in warned[0] and "cpu_bytes" in warned[0], warned
        caplog.clear()
        rt._warn_dropped(3)  # within the interval: counted, not logged
        assert not [r for r in caplog.records if "dropped" in r.getMessage()]
        rt._drops_warned_at -= 61.0
        with caplog.at_level("WARNING", logger="tiered_kv.connector.vllm.worker"):
            rt._warn_dropped(2)
        assert [r.getMessage() for r in caplog.records if "(5 since the last warning)" in r.getMessage()]
        stats = rt.stats()
        assert stats["fences_waited"] == 1 and stats["stores_cancelled"] == 1
        assert stats["fence_wait_seconds"] > 0  # vLLM's thread waited for the running store
        deadline = time.monotonic() + 10
        reports = {}
        while len(reports) < 2 and time.monotonic() < deadline:
            reports.update(rt.poll().reports)
        assert reports[1].ok == [True] and reports[2].ok == [False]
        assert torch.count_nonzero(rt.cpu.slab[1]) == 0  # the cancelled store wrote nothing
        assert torch.count_nonzero(rt.cpu.slab[0]) > 0
        assert rt.idle()
    finally:
        release.set()
        rt.close()


@pytest.mark.parametrize("priority", [-1, 0])
def test_load_stream_priority_reaches_every_load_copier(priority):
    """``load_stream_priority`` sets the load side stream of the in-step and the movers' copiers (CUDA only
    creates the stream; tests/gpu/test_staged_gpu.py checks the priority a stream gets)."""
    rt, _, _ = make_runtime("cpu", 2, 1, 8, 8, 2, load_mode="layerwise", load_stream_priority=priority,
                            load_staging_buffers=2 if priority else 1,
                            staged_scatter="kernel" if priority else "index_put")
    try:
        assert [c._lanes.load_priority for c in rt.in_step.copiers + rt.copiers] == [priority] * 2
        # load_staging_buffers and staged_scatter travel the same way (copier settings from the config)
        assert [c._staging_buffers for c in rt.in_step.copiers + rt.copiers] == [2 if priority else 1] * 2
        assert [c._scatter_kernel for c in rt.in_step.copiers + rt.copiers] == [bool(priority)] * 2
    finally:
        rt.close()


def test_a_fence_on_a_host_pool_store_waits_for_its_copy_not_its_publish(monkeypatch):
    """With a host pool (``cpu_pool``) a store's job goes on after its copy landed: ``publish`` checksums the rows
    and commits them, ~8x the copy's time on the GPU host. A fence only needs the GPU read over (GPU round 10,
    ``pool_replicas.py`` on two H200s: fences held vLLM's thread 0.75-0.79 s a run with the pool against 0.04 s
    with a private tier, the stores alike). Here a publish held for 2 s must not hold the fence; the store still
    lands whole (its checksum verifies) and reports ok."""
    import threading
    import time

    from tests._pool import assert_gone, pool_spec
    from tiered_kv.values.jobs import EXT as _EXT

    spec = pool_spec("fence")
    rt, kv, names = make_runtime("cpu", layers=2, heads=1, head_dim=8, num_blocks=16, cpu_chunks=4, cpu_pool=spec)
    try:
        for name in names:
            kv[name].copy_(torch.randint(-100, 100, kv[name].shape).to(kv[name].dtype))
        pool = rt.cpu  # the PoolTier
        publish, publishing, release = pool.publish, threading.Event(), threading.Event()

        def held_publish(res, written=None):
            publishing.set()
            assert release.wait(10)
            return publish(res, written)

        monkeypatch.setattr(pool, "publish", held_publish)
        key = Namespace("test").key(b"chunk-a")
        rt.on_plan(StepPlan(1, stores=[TransferJob(1, JobKind.INGRESS, _EXT, CPU, [key], [0], [0])],
                            ext={1: list(range(K))}))
        rt.after_forward()
        assert publishing.wait(10)  # the copy landed; the publish is held
        rt.on_plan(StepPlan(2, fences=[1]))
        threading.Timer(2.0, release.set).start()
        t0 = time.perf_counter()
        rt.fence()
        waited = time.perf_counter() - t0
        assert waited < 1.0 and not release.is_set(), f"the fence waited {waited:.2f} s for the publish"
        release.wait(10)
        deadline, reports = time.monotonic() + 10, {}
        while 1 not in reports and time.monotonic() < deadline:
            reports.update(rt.poll().reports)
        assert reports[1].ok == [True]
        with pool.lease([key], verify=True) as lease:  # published with the checksum of the bytes copied
            assert lease.hits == [True]
        assert rt.idle()
    finally:
        rt.close()
    assert_gone(spec)
