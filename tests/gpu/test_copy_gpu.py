"""GPU tests of tiered_kv.copy: both mechanisms, every layout and dtype, bit-exact.

The oracle is the CPU fallback run on a CPU twin of the same layout holding the
same bytes (tests/copy checks the fallback against an address-sorting
reference). Destinations are poisoned with fresh random bytes before each run
and compared whole, so a byte written out of place fails too.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from tiered_kv.copy import BlockCopier, Mechanism, allocate_slab, vllm_layer_layout
from tiered_kv.copy.testing import Shape, all_cases, fill_random, storages, vllm033_views

SHAPE = Shape(layers=3, heads=2, block_size=16, head_dim=64, num_blocks=40)
ODD = Shape(layers=2, heads=1, block_size=3, head_dim=5, num_blocks=9)
DTYPES = [torch.bfloat16, torch.float16, torch.float8_e4m3fn]
# copy engine with batched 1-D runs, copy engine with 2-D copies, SM kernel
VARIANTS = [
    (Mechanism.COPY_ENGINE, {"rect_copies": False}),
    (Mechanism.COPY_ENGINE, {"rect_copies": True}),
    (Mechanism.SM_KERNEL, {}),
]
VARIANT_IDS = ["copy_engine_1d", "copy_engine_2d", "sm_kernel"]
SLOTS = 48


def _twins(case, shape, dtype, gen):
    """The case on CUDA and on CPU, storages filled with the same random bytes."""
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


def _check_storages_equal(gpu_layout, cpu_layout):
    for g, c in zip(storages(gpu_layout), storages(cpu_layout)):
        assert torch.equal(g.cpu(), c)


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", all_cases(), ids=lambda c: c.name)
def test_round_trip_bit_exact(case, dtype, variant):
    mech, opts = variant
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case.name}/{dtype}/{mech.value}/{opts}".encode()))
    gpu, cpu = _twins(case, SHAPE, dtype, gen)
    n = 17
    blocks = torch.randperm(SHAPE.num_blocks, generator=gen)[:n]
    slots = torch.randperm(SLOTS, generator=gen)[:n]
    # GPU -> CPU into a poisoned slab
    slab = _random_slab(SLOTS, gpu.block_nbytes, gen)
    want = slab.clone()
    BlockCopier(cpu, want).gpu_to_cpu(blocks, slots)
    res = BlockCopier(gpu, slab, mechanism=mech, **opts).gpu_to_cpu(blocks, slots)
    res.wait()
    assert res.mechanism is mech and res.done()
    assert res.num_runs <= n * gpu.num_chunks
    assert torch.equal(slab, want)
    # CPU -> GPU into poisoned KV: fresh random slab, fresh random KV on both twins
    fill_random(cpu, gen)
    for g, c in zip(storages(gpu), storages(cpu)):
        g.copy_(c)
    src = _random_slab(SLOTS, gpu.block_nbytes, gen)
    dst_blocks = torch.randperm(SHAPE.num_blocks, generator=gen)[:n]
    BlockCopier(cpu, src.clone()).cpu_to_gpu(slots, dst_blocks)
    BlockCopier(gpu, src, mechanism=mech, **opts).cpu_to_gpu(slots, dst_blocks).wait()
    _check_storages_equal(gpu, cpu)


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_odd_sizes_use_narrow_words(variant):
    mech, opts = variant
    gen = torch.Generator().manual_seed(5)
    case = next(c for c in all_cases() if c.name == "vllm033-mla-LBNHC")
    gpu, cpu = _twins(case, ODD, torch.uint8, gen)  # 15-byte chunks: byte-wide copies
    slab = _random_slab(12, gpu.block_nbytes, gen)
    want = slab.clone()
    BlockCopier(cpu, want).gpu_to_cpu([8, 0, 3], [11, 2, 5])
    BlockCopier(gpu, slab, mechanism=mech, **opts).gpu_to_cpu([8, 0, 3], [11, 2, 5]).wait()
    assert torch.equal(slab, want)


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_long_merged_runs_are_split_and_exact(variant):
    """16 consecutive 512 KiB BLHNC blocks into 16 consecutive slots: one 8 MiB run."""
    gen = torch.Generator().manual_seed(6)
    big = Shape(layers=8, heads=8, block_size=16, head_dim=128, num_blocks=24)
    case = next(c for c in all_cases() if c.name == "vllm033-BLHNC")
    gpu, cpu = _twins(case, big, torch.bfloat16, gen)
    slab = _random_slab(20, gpu.block_nbytes, gen)
    want = slab.clone()
    mech, opts = variant
    copier = BlockCopier(gpu, slab, mechanism=mech, **opts)
    assert copier.plan(range(4, 20), range(2, 18), True).count == 1
    BlockCopier(cpu, want).gpu_to_cpu(range(4, 20), range(2, 18))
    copier.gpu_to_cpu(range(4, 20), range(2, 18)).wait()
    assert torch.equal(slab, want)
    fill_random(cpu, gen)
    for g, c in zip(storages(gpu), storages(cpu)):
        g.copy_(c)
    BlockCopier(cpu, slab.clone()).cpu_to_gpu(range(2, 18), range(5, 21))
    copier.cpu_to_gpu(range(2, 18), range(5, 21)).wait()
    _check_storages_equal(gpu, cpu)


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_copy_follows_work_already_on_the_callers_stream(variant):
    mech, opts = variant
    """A store issued right after a kernel that writes the KV copies the new bytes."""
    views = vllm033_views("LBHNC", SHAPE, torch.bfloat16, "cuda")
    layout = vllm_layer_layout(views)
    slab = allocate_slab(8, layout.block_nbytes).fill_(0)
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    for _ in range(8):  # keep the current stream busy for a while
        a = a @ a / 64.0
    for v in views:
        v.fill_(3.0)  # enqueued behind the matmuls
    BlockCopier(layout, slab, mechanism=mech, **opts).gpu_to_cpu([5], [2]).wait()
    assert bool((slab[2].view(torch.bfloat16) == 3.0).all())


def test_both_directions_concurrently_and_auto_choice():
    gen = torch.Generator().manual_seed(7)
    case = next(c for c in all_cases() if c.name == "vllm033-LBNHC")
    gpu, cpu = _twins(case, SHAPE, torch.float16, gen)
    slab = _random_slab(SLOTS, gpu.block_nbytes, gen)
    want = slab.clone()
    cpu_copier, gpu_copier = BlockCopier(cpu, want), BlockCopier(gpu, slab)
    out = gpu_copier.gpu_to_cpu(range(0, 20), range(0, 20))  # store blocks 0..19
    inn = gpu_copier.cpu_to_gpu(range(20, 40), range(20, 40))  # load into blocks 20..39 at once
    cpu_copier.gpu_to_cpu(range(0, 20), range(0, 20))
    cpu_copier.cpu_to_gpu(range(20, 40), range(20, 40))
    out.wait()
    inn.wait()
    assert out.mechanism in (Mechanism.COPY_ENGINE, Mechanism.SM_KERNEL)
    assert torch.equal(slab, want)
    _check_storages_equal(gpu, cpu)


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("name", ["vllm033-LBNHC", "vllm033-BLHNC", "sglang-host-layer_first-mha"])
def test_inline_submission_and_close(name, variant):
    mech, opts = variant
    gen = torch.Generator().manual_seed(zlib.crc32(f"inline/{name}/{mech.value}".encode()))
    case = next(c for c in all_cases() if c.name == name)
    gpu, cpu = _twins(case, SHAPE, torch.bfloat16, gen)
    slab = _random_slab(SLOTS, gpu.block_nbytes, gen)
    want = slab.clone()
    blocks = torch.randperm(SHAPE.num_blocks, generator=gen)[:9]
    slots = torch.randperm(SLOTS, generator=gen)[:9]
    BlockCopier(cpu, want).gpu_to_cpu(blocks, slots)
    with BlockCopier(gpu, slab, mechanism=mech, threaded_submit=False, **opts) as copier:
        res = copier.gpu_to_cpu(blocks, slots)
        res.wait()
    assert torch.equal(slab, want)
    with BlockCopier(gpu, slab, mechanism=mech, **opts) as copier:  # threaded; close() drains the queue
        res = copier.cpu_to_gpu(slots, blocks)
    stream = torch.cuda.Stream()
    res.wait_on(stream)
    stream.synchronize()
    assert res.done() and res.error is None
    BlockCopier(cpu, want).cpu_to_gpu(slots, blocks)
    _check_storages_equal(gpu, cpu)


@pytest.mark.parametrize("mech", [Mechanism.COPY_ENGINE, Mechanism.SM_KERNEL, Mechanism.STAGED], ids=lambda m: m.value)
@pytest.mark.parametrize("name", ["vllm033-LBNHC", "vllm033-BLHNC", "vllm033-mla-LBNHC", "vllm026-HND"])
def test_grouped_load_layer_by_layer_bit_exact(name, mech):
    """cpu_to_gpu_grouped per layer into poisoned KV; a stream that waits on group g reads layer g's new bytes."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"grouped/{name}/{mech.value}".encode()))
    case = next(c for c in all_cases() if c.name == name)
    big = Shape(layers=4, heads=2, block_size=16, head_dim=64, num_blocks=64)
    gpu, cpu = _twins(case, big, torch.bfloat16, gen)
    src = _random_slab(SLOTS, gpu.block_nbytes, gen)
    slots = torch.randperm(SLOTS, generator=gen)[:40]
    blocks = torch.randperm(big.num_blocks, generator=gen)[:40]
    groups = [(i, i + 1) for i in range(len(gpu.tensors))]
    BlockCopier(cpu, src.clone()).cpu_to_gpu(slots, blocks)
    consumer = torch.cuda.Stream()
    results = BlockCopier(gpu, src, mechanism=mech).cpu_to_gpu_grouped(slots, blocks, groups)
    assert len(results) == len(groups)
    seen = []
    for g, res in enumerate(results):
        res.wait_on(consumer)
        with torch.cuda.stream(consumer):
            seen.append(gpu.tensors[g].contiguous().view(torch.uint8).clone())
    consumer.synchronize()
    for g in range(len(groups)):
        assert torch.equal(seen[g].cpu(), cpu.tensors[g].contiguous().view(torch.uint8)), f"group {g}"
    assert all(r.done() for r in results)
    _check_storages_equal(gpu, cpu)


def _compiled_kernels() -> int:
    """Specializations of the SM kernel Triton holds compiled (its per-device caches; the attribute moved in 3.x)."""
    from tiered_kv.copy import triton_kernel

    kernel = triton_kernel._kernel()
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:
        return sum(len(v[0]) for v in caches.values())
    return sum(len(v) for v in kernel.cache.values())


def test_warmed_sm_kernel_compiles_nothing_at_the_first_load():
    """``warm_sm_kernel`` compiles what a copier of this layout launches: a first SM-kernel load and store of 13
    blocks, and a layer-by-layer load, compile nothing more (as the worker's start-up warm-up promises), and the
    bytes are exact. The piece count is not specialized on."""
    from tiered_kv.copy import warm_sm_kernel

    gen = torch.Generator().manual_seed(21)
    case = next(c for c in all_cases() if c.name == "vllm026-NHD")
    gpu, cpu = _twins(case, SHAPE, torch.bfloat16, gen)
    slab = _random_slab(SLOTS, gpu.block_nbytes, gen)
    copier = BlockCopier(gpu, slab, mechanism=Mechanism.SM_KERNEL)
    assert warm_sm_kernel([copier], "test")
    before = _compiled_kernels()
    ids, slots = torch.randperm(SHAPE.num_blocks, generator=gen)[:13], torch.randperm(SLOTS, generator=gen)[:13]
    BlockCopier(cpu, slab.clone()).cpu_to_gpu(slots, ids)
    copier.cpu_to_gpu(slots, ids).wait()
    for r in copier.cpu_to_gpu_grouped(slots, ids, [(t, t + 1) for t in range(len(gpu.tensors))]):
        r.wait()
    copier.gpu_to_cpu(ids[:5], slots[:5]).wait()
    _check_storages_equal(gpu, cpu)
    assert _compiled_kernels() == before
    copier.close()


@pytest.mark.parametrize("case", all_cases(), ids=lambda c: c.name)
@pytest.mark.parametrize("choice", ["auto", "copy_engine", "staged"])
def test_warm_copy_paths_binds_the_first_loads_costs_and_keeps_the_kv(case, choice, caplog):
    """``warm_copy_paths`` on CUDA: every byte of the engine's KV and of the CPU tier's slab unchanged; the copier
    holds its streams, submitter threads and the chosen mechanisms' driver entry points before any load; the round
    trip ran by each chosen mechanism (the log says which) and left the scratch copier no staging buffer."""
    import logging

    from tiered_kv.copy import warm_copy_paths

    gen = torch.Generator().manual_seed(11)
    gpu, _ = _twins(case, SHAPE, torch.bfloat16, gen)
    before = [flat.clone() for flat in storages(gpu)]
    tier = _random_slab(8, gpu.block_nbytes, gen)
    tier_before = tier.clone()
    copier = BlockCopier(gpu, tier)
    scratch = BlockCopier(gpu, allocate_slab(1, gpu.block_nbytes, pin=True))
    try:
        with caplog.at_level(logging.INFO, logger="tiered_kv.copy.copier"):
            assert warm_copy_paths([copier], [scratch], choice, "test") is not None
        torch.cuda.synchronize()
        assert all(torch.equal(f, b) for f, b in zip(storages(gpu), before))
        assert torch.equal(tier, tier_before)
        back = {"auto": "copy_engine, staged", "copy_engine": "copy_engine", "staged": "staged"}[choice]
        assert any(f"round trip by {back})" in r.message for r in caplog.records)
        assert set(copier._lanes._streams) == {False, True} and set(copier._lanes._submitters) == {False, True}
        assert all(s._thread is not None and s._thread.is_alive() for s in copier._lanes._submitters.values())
        assert (copier._gpu._batch is not None) == (choice in ("auto", "copy_engine"))
        assert (copier._staged is not None and copier._staged._rect2d is not None) == (choice in ("auto", "staged"))
        assert scratch._staged is None
    finally:
        copier.close()
        scratch.close()
