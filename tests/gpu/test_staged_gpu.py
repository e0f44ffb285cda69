"""GPU tests of the staged load (``Mechanism.STAGED``): bit-exact against the copy engine and the CPU twin.

Cases: every layout of ``all_cases()``; the two shapes the mechanism is for, at full size
(DeepSeek-V2-Lite MLA: 27 layers x 18 KiB per layer-block; Qwen2.5-7B: 28 layers x 32 KiB) with
512 blocks from slots in chunk runs; a staging buffer smaller than the load (pieces); slab rows
wider than a block (the 2-D DMA); and ordering: a load issued behind work on the caller's stream
that writes the destination blocks lands after it.
"""

from __future__ import annotations

import warnings
import zlib

import pytest
import torch

from tiered_kv.copy import BlockCopier, Mechanism, allocate_slab, vllm_layer_layout
from tiered_kv.copy.testing import Shape, all_cases, fill_random, storages, vllm026_tensors

SHAPE = Shape(layers=3, heads=2, block_size=16, head_dim=64, num_blocks=40)
SLOTS = 48
MLA = Shape(layers=27, heads=1, block_size=16, head_dim=576, num_blocks=1100)  # 18 KiB per layer-block
QWEN = Shape(layers=28, heads=4, block_size=16, head_dim=128, num_blocks=1100)  # 32 KiB per layer-block


def _twins(case, shape, dtype, gen):
    gpu = case.build(shape, dtype, "cuda")
    cpu = case.build(shape, dtype, "cpu")
    fill_random(cpu, gen)
    for g, c in zip(storages(gpu), storages(cpu)):
        g.copy_(c)
    return gpu, cpu


def _random_slab(num_slots, nbytes, gen):
    slab = allocate_slab(num_slots, nbytes, pin=True)
    slab.copy_(torch.randint(0, 256, slab.shape, dtype=torch.uint8, generator=gen))
    return slab


def _check_storages_equal(a, b):
    for x, y in zip(storages(a), storages(b)):
        assert torch.equal(x.cpu(), y.cpu())


def _twin_layer_caches(shape, mla=False):
    """Two vLLM 0.26 per-layer caches on the GPU holding the same random bytes (one per mechanism compared)."""
    a = vllm_layer_layout(vllm026_tensors("NHD", shape, torch.bfloat16, "cuda", mla=mla))
    b = vllm_layer_layout(vllm026_tensors("NHD", shape, torch.bfloat16, "cuda", mla=mla))
    for x, y in zip(storages(a), storages(b)):
        x.random_(0, 256)
        y.copy_(x)
    return a, b


def _chunk_slots(n: int, chunk: int, num_slots: int, gen) -> torch.Tensor:
    """``n`` slots as runs of ``chunk`` adjacent rows, the runs in random order (how chunk slots lie)."""
    starts = torch.randperm(num_slots // chunk, generator=gen)[: -(-n // chunk)] * chunk
    return (starts[:, None] + torch.arange(chunk)[None, :]).reshape(-1)[:n]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("case", all_cases(), ids=lambda c: c.name)
def test_staged_load_bit_exact_every_layout(case, dtype):
    gen = torch.Generator().manual_seed(zlib.crc32(f"staged/{case.name}/{dtype}".encode()))
    gpu, cpu = _twins(case, SHAPE, dtype, gen)
    src = _random_slab(SLOTS, gpu.block_nbytes, gen)
    slots = torch.cat([torch.arange(8, 16), torch.randperm(8, generator=gen)[:5], torch.tensor([40, 41])])
    blocks = torch.randperm(SHAPE.num_blocks, generator=gen)[: slots.numel()]
    BlockCopier(cpu, src.clone()).cpu_to_gpu(slots, blocks)
    res = BlockCopier(gpu, src, mechanism="staged").cpu_to_gpu(slots, blocks)
    res.wait()
    assert res.mechanism is Mechanism.STAGED and res.done() and res.error is None
    _check_storages_equal(gpu, cpu)


@pytest.mark.parametrize("buffers", [1, 2], ids=["one-buffer", "two-halves"])
@pytest.mark.parametrize("shape", [MLA, QWEN], ids=["dsv2-mla-18KiB", "qwen7b-32KiB"])
@pytest.mark.parametrize("staging_mib", [256, 40], ids=["256MiB", "40MiB"])
def test_staged_matches_copy_engine_at_model_size(shape, staging_mib, buffers):
    """512 blocks from chunk runs of 16 slots: staged and copy engine write the same bytes (dest poisoned alike);
    with two halves, the pieces' DMAs run on a second stream beside the scatters."""
    gen = torch.Generator().manual_seed(11)
    mla = shape is MLA
    a, b = _twin_layer_caches(shape, mla)
    assert a.maps[0].nbytes == (18 if mla else 32) * 1024
    src = _random_slab(1024, a.block_nbytes, gen)
    slots = _chunk_slots(512, 16, 1024, gen)
    blocks = torch.randperm(shape.num_blocks, generator=gen)[:512]
    ce = BlockCopier(a, src, mechanism="copy_engine").cpu_to_gpu(slots, blocks)
    staged = BlockCopier(b, src, mechanism="staged", staging_bytes=staging_mib << 20, staging_buffers=buffers)
    st = staged.cpu_to_gpu(slots, blocks)
    ce.wait()
    st.wait()
    assert bool(staged._staged._dma_streams) == (buffers == 2)  # 512 blocks never fit one half of either cap
    loader = staged._staged
    whole = [(0, len(b.tensors))]
    pieces = -(-512 // loader.plan(512, whole)[1][0])
    # at most one DMA per run of 16 slots plus one per piece boundary, and one scatter per layer and piece,
    # against ~13.8k/14.3k copy-engine descriptors
    assert st.num_runs <= 32 + pieces + pieces * len(loader.rects(*whole[0]))
    assert st.num_runs < ce.num_runs / 15
    _check_storages_equal(a, b)


def test_staged_padded_rows_use_2d_dma_and_groups_are_exact():
    """Slab rows 4 KiB wider than a block: each run is one 2-D copy; layer groups load column ranges."""
    gen = torch.Generator().manual_seed(12)
    case = next(c for c in all_cases() if c.name == "vllm026-mla")
    gpu, cpu = _twins(case, Shape(layers=6, heads=1, block_size=16, head_dim=576, num_blocks=64), torch.bfloat16, gen)
    src = _random_slab(80, gpu.block_nbytes + 4096, gen)
    slots = _chunk_slots(40, 8, 80, gen)
    blocks = torch.randperm(64, generator=gen)[:40]
    BlockCopier(cpu, src.clone()).cpu_to_gpu(slots, blocks)
    copier = BlockCopier(gpu, src, staging_bytes=10 * gpu.block_nbytes)
    results = copier.cpu_to_gpu_grouped(slots, blocks, [(0, 2), (2, 3), (3, 6)], mechanism="staged")
    for r in results:
        r.wait()
    assert all(r.mechanism is Mechanism.STAGED for r in results)
    _check_storages_equal(gpu, cpu)


def test_staged_short_runs_go_batched_and_are_exact(monkeypatch):
    """Scattered slots (runs of one row) on rows wider than a block, in layer groups (batched 2-D copies,
    ``cuMemcpy3DBatchAsync``), and on rows a block wide (batched descriptors, ``cuMemcpyBatchAsync``): the driver
    takes both batched forms (no fallback) and the bytes equal the CPU copier's. The batched 2-D copies are off by
    default (``staged.RECT_BATCH``, measured slower): turned on here."""
    import tiered_kv.copy.staged as staged_mod

    monkeypatch.setattr(staged_mod, "RECT_BATCH", True)
    gen = torch.Generator().manual_seed(13)
    case = next(c for c in all_cases() if c.name == "vllm026-mla")
    shape = Shape(layers=6, heads=1, block_size=16, head_dim=576, num_blocks=64)
    for extra in (4096, 0):
        gpu, cpu = _twins(case, shape, torch.bfloat16, gen)
        src = _random_slab(80, gpu.block_nbytes + extra, gen)
        slots = torch.randperm(80, generator=gen)[:40]
        blocks = torch.randperm(64, generator=gen)[:40]
        BlockCopier(cpu, src.clone()).cpu_to_gpu(slots, blocks)
        copier = BlockCopier(gpu, src, staging_bytes=10 * gpu.block_nbytes)
        spans = [(0, 2), (2, 3), (3, 6)] if extra else [(0, 6)]
        for r in copier.cpu_to_gpu_grouped(slots, blocks, spans, mechanism="staged"):
            r.wait()
        assert type(copier._staged._batch).__name__ == "BatchMemcpy"
        if extra:
            assert type(copier._staged._rect_batch).__name__ == "RectBatchMemcpy"  # not refused: False after a refusal
        _check_storages_equal(gpu, cpu)


def _compiled(kernel) -> int | None:
    """Specializations Triton holds for ``kernel`` (its per-device caches; None where this Triton keeps them
    elsewhere)."""
    try:
        caches = getattr(kernel, "device_caches", None)
        if isinstance(caches, dict):  # Triton 3.x: device -> (kernel cache, ...)
            return sum(len(c[0]) if isinstance(c, tuple) else len(c) for c in caches.values())
        cache = getattr(kernel, "cache", None)  # older: device -> kernel cache
        return sum(len(c) for c in cache.values()) if isinstance(cache, dict) else None
    except TypeError:
        return None


@pytest.mark.parametrize("buffers", [1, 2])
@pytest.mark.parametrize("kernel", [True, False], ids=["one-launch", "index-put"])
def test_staged_scatter_one_launch_and_index_put_are_exact(kernel, buffers, monkeypatch):
    """The scatter as one Triton launch over the layout's table of rectangle rows on the device (``staged_scatter:
    kernel``, prepared as the connector's start-up does), and as an ``index_put_`` per rectangle: whole rows and
    layer groups, slots in runs and scattered, pieces, one buffer and two halves; the bytes equal the CPU copier's,
    the one-launch path took every scatter (none refused), and no launch compiled after ``prepare``."""
    import tiered_kv.copy.staged as staged_mod
    from tiered_kv.copy import prepare_copier, scatter_table

    monkeypatch.setattr(staged_mod, "SCATTER_KERNEL_MIN_ROWS", 1)
    gen = torch.Generator().manual_seed(14)
    for case in [c for c in all_cases() if c.name.startswith("vllm")]:
        gpu, cpu = _twins(case, Shape(layers=6, heads=2, block_size=16, head_dim=64, num_blocks=64), torch.bfloat16,
                          gen)
        src = _random_slab(80, gpu.block_nbytes, gen)
        slots = torch.cat([_chunk_slots(24, 8, 40, gen), 40 + torch.randperm(40, generator=gen)[:16]])
        blocks = torch.randperm(64, generator=gen)[:40]
        BlockCopier(cpu, src.clone()).cpu_to_gpu(slots, blocks)
        copier = BlockCopier(gpu, src, staging_bytes=12 * gpu.block_nbytes, staging_buffers=buffers,
                             scatter_kernel=kernel)
        assert prepare_copier(copier, [Mechanism.STAGED]) == {Mechanism.STAGED}
        table = copier._staged._table
        assert (table is not None) == kernel  # Triton is on the GPU machine: the table is on the device
        refused, taken = [], []
        if kernel:
            def counted(*a, _launch=table.launch):
                ok = _launch(*a)
                (taken if ok else refused).append(a)
                return ok

            monkeypatch.setattr(table, "launch", counted)
        compiled = _compiled(scatter_table._kernel())
        n = len(gpu.tensors)  # a cross-layer layout has one tensor: no second group to split off
        for spans in [[(0, n)]] + ([[(0, 1), (1, n)]] if n > 1 else []):
            for r in copier.cpu_to_gpu_grouped(slots, blocks, spans, mechanism="staged"):
                r.wait()
            _check_storages_equal(gpu, cpu)
        assert not refused and bool(taken) == kernel
        if compiled is None:
            warnings.warn("this Triton keeps its compiled kernels where _compiled does not look: not checked")
        else:
            assert _compiled(scatter_table._kernel()) == compiled


@pytest.mark.parametrize("threaded", [True, False], ids=["threaded", "inline"])
def test_staged_load_lands_after_work_on_the_callers_stream(threaded):
    """The engine zeroes the destination blocks (behind a busy stream), then loads: the load's bytes win."""
    layout = vllm_layer_layout(vllm026_tensors("NHD", MLA, torch.bfloat16, "cuda", mla=True))
    gen = torch.Generator().manual_seed(13)
    src = _random_slab(64, layout.block_nbytes, gen)
    blocks = torch.arange(100, 164)
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    for _ in range(8):
        a = a @ a / 64.0
    for t in layout.tensors:
        t[blocks.cuda()] = 0  # enqueued behind the matmuls, like vLLM's block zeroing
    copier = BlockCopier(layout, src, mechanism="staged", threaded_submit=threaded)
    res = copier.cpu_to_gpu(torch.arange(64), blocks)
    consumer = torch.cuda.Stream()
    res.wait_on(consumer)
    with torch.cuda.stream(consumer):
        got = [t[blocks.cuda()].contiguous().view(torch.uint8).reshape(64, -1) for t in layout.tensors]
    consumer.synchronize()
    row = layout.maps[0].nbytes
    for li, g in enumerate(got):
        assert torch.equal(g.cpu(), src[:, li * row:(li + 1) * row]), f"layer {li}"
    copier.close()


def test_no_device_memory_for_the_buffer_falls_back_to_the_copy_engine(monkeypatch):
    """A staging buffer that cannot be allocated: the load goes as under "auto", bytes still exact."""
    from tiered_kv.copy.staged import StagedLoader, StagingMemoryError

    def no_memory(self, nbytes):
        raise StagingMemoryError(f"injected: no device memory for {nbytes} bytes")

    monkeypatch.setattr(StagedLoader, "_buffer", no_memory)
    gen = torch.Generator().manual_seed(14)
    case = next(c for c in all_cases() if c.name == "vllm026-mla")
    gpu, cpu = _twins(case, SHAPE, torch.bfloat16, gen)
    src = _random_slab(SLOTS, gpu.block_nbytes, gen)
    slots, blocks = torch.arange(4, 20), torch.randperm(SHAPE.num_blocks, generator=gen)[:16]
    BlockCopier(cpu, src.clone()).cpu_to_gpu(slots, blocks)
    copier = BlockCopier(gpu, src, mechanism="staged")
    res = copier.cpu_to_gpu(slots, blocks)
    res.wait()
    assert res.mechanism is not Mechanism.STAGED
    grouped = copier.cpu_to_gpu_grouped(slots, blocks, [(0, 1), (1, 3)])
    for r in grouped:
        r.wait()
    assert all(r.mechanism is not Mechanism.STAGED for r in grouped)
    many = copier.cpu_to_gpu_many([(slots[:6], blocks[:6]), (slots[6:], blocks[6:])], timing=True)
    for r in many:
        r.wait()
    assert all(r.mechanism is not Mechanism.STAGED and r.start is not None for r in many)
    _check_storages_equal(gpu, cpu)
    copier.close()


def test_threaded_staged_buffer_is_grown_on_the_submitter_only(monkeypatch):
    """While the submitter is in the middle of a staged batch, the caller asks for a larger staged load: the
    buffer is allocated and grown on the submitter thread only (never on the caller's), each load uses one
    buffer from its first DMA to its last scatter, and both land bit-exact."""
    import threading

    from tiered_kv.copy import staged
    from tiered_kv.copy.staged import StagedLoader

    monkeypatch.setattr(staged, "GROW_STEP", 1)  # buffers exactly as large as a load needs: the second must grow
    gen = torch.Generator().manual_seed(15)
    case = next(c for c in all_cases() if c.name == "vllm026-mla")
    gpu, cpu = _twins(case, SHAPE, torch.bfloat16, gen)
    src = _random_slab(SLOTS, gpu.block_nbytes, gen)
    perm = torch.randperm(SHAPE.num_blocks, generator=gen)
    slots1, blocks1 = torch.arange(4, 6), perm[:2]
    slots2, blocks2 = torch.arange(20, 32), perm[2:14]
    twin = BlockCopier(cpu, src.clone())
    twin.cpu_to_gpu(slots1, blocks1)
    twin.cpu_to_gpu(slots2, blocks2)
    grown_on: list[str] = []
    used: list[tuple[str, torch.Tensor]] = []
    first_in_flight, second_called = threading.Event(), threading.Event()
    real_buffer, real_dma, real_scatter = StagedLoader._buffer, StagedLoader._dma, StagedLoader._scatter

    def buffer(self, nbytes):
        grown_on.append(threading.current_thread().name)
        return real_buffer(self, nbytes)

    def dma(self, staging, *args):
        used.append(("dma", staging))
        out = real_dma(self, staging, *args)
        if not first_in_flight.is_set():  # the first load's DMA is queued: hold the submitter here
            first_in_flight.set()
            assert second_called.wait(10)
        return out

    def scatter(self, staging, *args):
        used.append(("scatter", staging))
        return real_scatter(self, staging, *args)

    monkeypatch.setattr(StagedLoader, "_buffer", buffer)
    monkeypatch.setattr(StagedLoader, "_dma", dma)
    monkeypatch.setattr(StagedLoader, "_scatter", scatter)
    copier = BlockCopier(gpu, src, mechanism="staged")  # threaded: loads run on its h2d submitter
    first = copier.cpu_to_gpu_many([(slots1, blocks1)], timing=True)[0]
    assert first_in_flight.wait(10)
    second = copier.cpu_to_gpu(slots2, blocks2)  # needs a larger buffer than the one the first load is using
    second_called.set()
    first.wait(30)
    second.wait(30)
    assert grown_on and set(grown_on) == {"tkv-copy-h2d"}, grown_on
    assert copier._staged.allocations == 2
    assert [k for k, _ in used] == ["dma", "scatter", "dma", "scatter"]  # one piece each, in order
    assert used[0][1] is used[1][1] and used[2][1] is used[3][1] and used[2][1].numel() > used[0][1].numel()
    assert first.mechanism is Mechanism.STAGED and second.mechanism is Mechanism.STAGED
    _check_storages_equal(gpu, cpu)
    copier.close()


def test_loads_run_on_a_higher_priority_stream_than_stores():
    """The load side stream outranks the store one (and the default), so a staged scatter or SM-kernel
    load is not queued behind the forward's pending blocks; copies on it stay exact (the same bytes as
    a copy-engine load of the same slots into a twin cache)."""
    a, b = _twin_layer_caches(QWEN)
    gen = torch.Generator().manual_seed(17)
    src = _random_slab(64, a.block_nbytes, gen)
    copier = BlockCopier(b, src, mechanism="staged", threaded_submit=False)
    load, store = copier._lanes.stream(False), copier._lanes.stream(True)
    least, greatest = load.priority_range()  # (0, -N) on CUDA; equal on a device without priorities
    assert store.priority == 0
    if least != greatest:  # a device with stream priorities
        assert load.priority < store.priority == torch.cuda.current_stream().priority
    slots, blocks = torch.randperm(64, generator=gen), torch.arange(200, 264)
    BlockCopier(a, src, mechanism="copy_engine").cpu_to_gpu(slots, blocks).wait()
    res = copier.cpu_to_gpu(slots, blocks)
    res.wait()
    assert res.mechanism is Mechanism.STAGED
    _check_storages_equal(a, b)
    copier.close()


def test_two_halves_never_overtake_work_queued_before_the_load():
    """A two-half load's DMAs run on a second stream; they start only after what the caller queued before the
    load. Here the caller's stream sleeps, then writes new bytes into the slab rows the load reads: the load
    must deliver the new bytes (the same as a copy-engine load of the rows afterwards), not the old ones."""
    a, b = _twin_layer_caches(QWEN)
    gen = torch.Generator().manual_seed(23)
    src = _random_slab(64, a.block_nbytes, gen)
    fresh = torch.randint(0, 256, tuple(src.shape), dtype=torch.uint8, generator=gen).cuda()
    # 8 MiB: halves of 4 MiB hold 4 rows of 896 KiB, so 64 rows go in 16 pieces over both halves
    copier = BlockCopier(b, src, mechanism="staged", staging_bytes=8 << 20, staging_buffers=2, threaded_submit=False)
    assert copier._staged_loader().plan(64, [(0, len(b.tensors))])[0] == 2
    slots, blocks = torch.randperm(64, generator=gen), torch.arange(300, 364)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on the caller's stream
    src.copy_(fresh, non_blocking=True)  # then the new bytes land in the pinned rows
    res = copier.cpu_to_gpu(slots, blocks)
    res.wait()
    assert res.mechanism is Mechanism.STAGED
    torch.cuda.synchronize()
    assert torch.equal(src, fresh.cpu())
    BlockCopier(a, src, mechanism="copy_engine").cpu_to_gpu(slots, blocks).wait()
    _check_storages_equal(a, b)
    copier.close()
