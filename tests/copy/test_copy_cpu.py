"""CPU tests of tiered_kv.copy: layout geometry, run planning, and the CPU fallback copier.

Every layout of tiered_kv.copy.testing.all_cases() x bf16/fp16/fp8, both
directions, random data, destination poisoned, checked bit-exact against a
reference that sorts element addresses (shares no code with the planner).
"""

from __future__ import annotations

import pytest
import torch

from tiered_kv.copy import (
    BlockCopier,
    BlockIndexError,
    ChunkTable,
    KVLayout,
    RectTable,
    LayoutError,
    Mechanism,
    Runs,
    SelectionPolicy,
    allocate_slab,
    block_geometry,
    choose_mechanism,
    merge_runs,
    plan_rects,
    plan_runs,
    split_runs,
    vllm_layer_layout,
)
from tiered_kv.copy.testing import (
    Shape,
    all_cases,
    fill_random,
    reference_slot,
    reference_write,
    storages,
    vllm033_views,
)

SHAPE = Shape(layers=3, heads=2, block_size=4, head_dim=8, num_blocks=7)
DTYPES = [torch.bfloat16, torch.float16, getattr(torch, "float8_e4m3fn", torch.uint8)]
CASES = all_cases()


def _pick(gen: torch.Generator, n: int, limit: int) -> list[int]:
    return torch.randperm(limit, generator=gen)[:n].tolist()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gpu_to_cpu_matches_reference(case, dtype):
    gen = torch.Generator().manual_seed(1)
    layout = case.build(SHAPE, dtype, "cpu")
    fill_random(layout, gen)
    slab = allocate_slab(9, layout.block_nbytes, pin=False)
    slab.copy_(torch.randint(0, 256, slab.shape, dtype=torch.uint8, generator=gen))
    poison = slab.clone()
    blocks, slots = _pick(gen, 5, SHAPE.num_blocks), _pick(gen, 5, 9)
    result = BlockCopier(layout, slab).gpu_to_cpu(blocks, slots)
    assert result.mechanism is Mechanism.CPU and result.done() and result.nbytes == 5 * layout.block_nbytes
    for b, s in zip(blocks, slots):
        assert torch.equal(slab[s], reference_slot(layout, b)), (b, s)
    untouched = [s for s in range(9) if s not in slots]
    assert torch.equal(slab[untouched], poison[untouched])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_cpu_to_gpu_matches_reference(case, dtype):
    gen = torch.Generator().manual_seed(2)
    layout = case.build(SHAPE, dtype, "cpu")
    fill_random(layout, gen)  # poison: random bytes everywhere
    expected = {flat.untyped_storage().data_ptr(): flat.clone() for flat in storages(layout)}
    slab = allocate_slab(9, layout.block_nbytes, pin=False)
    slab.copy_(torch.randint(0, 256, slab.shape, dtype=torch.uint8, generator=gen))
    slab_before = slab.clone()
    blocks, slots = _pick(gen, 4, SHAPE.num_blocks), _pick(gen, 4, 9)
    BlockCopier(layout, slab).cpu_to_gpu(slots, blocks)
    for b, s in zip(blocks, slots):
        reference_write(layout, b, slab[s], expected)
    for flat in storages(layout):
        assert torch.equal(flat, expected[flat.untyped_storage().data_ptr()])
    assert torch.equal(slab, slab_before)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_planned_runs_move_the_same_bytes(case):
    """The runs the GPU mechanisms would enqueue, applied byte by byte, equal the CPU copier."""
    gen = torch.Generator().manual_seed(3)
    layout = case.build(SHAPE, torch.float16, "cpu")
    fill_random(layout, gen)
    slab = allocate_slab(8, layout.block_nbytes, pin=False).fill_(0xA5)
    blocks, slots = _pick(gen, 6, SHAPE.num_blocks), _pick(gen, 6, 8)
    copier = BlockCopier(layout, slab)
    runs = copier.plan(blocks, slots, to_cpu=True)
    assert runs.nbytes == 6 * layout.block_nbytes
    spans = [(flat.data_ptr(), flat.numel(), flat) for flat in storages(layout)]
    slab_flat = slab.view(-1)
    for src, dst, size in zip(runs.src.tolist(), runs.dst.tolist(), runs.size.tolist()):
        base, _, flat = next(sp for sp in spans if sp[0] <= src and src + size <= sp[0] + sp[1])
        off = dst - slab.data_ptr()
        slab_flat[off : off + size] = flat[src - base : src - base + size]
    for b, s in zip(blocks, slots):
        assert torch.equal(slab[s], reference_slot(layout, b))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_planned_rects_move_the_same_bytes(case):
    """The 2-D copies the copy engine may use, applied row by row, equal the CPU copier (both directions)."""
    gen = torch.Generator().manual_seed(4)
    layout = case.build(SHAPE, torch.bfloat16, "cpu")
    fill_random(layout, gen)
    table = RectTable.from_chunks(ChunkTable.from_layout(layout))
    assert int((table.width * table.height).sum()) == layout.block_nbytes
    slab = allocate_slab(8, layout.block_nbytes, pin=False).fill_(0x3C)
    blocks, slots = _pick(gen, 5, SHAPE.num_blocks), _pick(gen, 5, 8)
    rects = plan_rects(table, torch.tensor(blocks), torch.tensor(slots), slab.data_ptr(), slab.stride(0))
    spans = [(flat.data_ptr(), flat.numel(), flat) for flat in storages(layout)]
    slab_flat = slab.view(-1)
    cols = zip(rects.gpu.tolist(), rects.cpu.tolist(), rects.pitch.tolist(), rects.width.tolist(), rects.height.tolist())
    for gpu, cpu, pitch, width, height in cols:
        for row in range(height):
            src = gpu + row * pitch
            base, _, flat = next(sp for sp in spans if sp[0] <= src and src + width <= sp[0] + sp[1])
            off = cpu - slab.data_ptr() + row * width
            slab_flat[off : off + width] = flat[src - base : src - base + width]
    for b, s in zip(blocks, slots):
        assert torch.equal(slab[s], reference_slot(layout, b))


def test_rects_of_vllm_per_layer_views():
    table = RectTable.from_chunks(ChunkTable.from_layout(vllm_layer_layout(vllm033_views("LBNHC", SHAPE, torch.bfloat16, "cpu"))))
    per_layer = SHAPE.heads * SHAPE.block_size * 2 * SHAPE.head_dim * 2
    assert table.height.tolist() == [SHAPE.layers] and table.width.tolist() == [per_layer]
    assert table.pitch.tolist() == [SHAPE.num_blocks * per_layer]


def test_block_geometry_per_layer_and_interleaved():
    # LBNHC view (B, H, N, C) with physical (B, N, H, C): one 2*4*16-element chunk per block
    n, stride, offs, sizes = block_geometry((7, 2, 4, 16), (128, 16, 32, 1), 2, 0)
    assert (n, stride, offs, sizes) == (7, 256, (0,), (256,))
    # LHBNC view: physical (H, B, N, C): one chunk per head, heads B*N*C elements apart
    n, stride, offs, sizes = block_geometry((7, 2, 4, 16), (64, 448, 16, 1), 2, 0)
    assert (n, stride, offs, sizes) == (7, 128, (0, 896), (128, 128))
    # SGLang page of 4 tokens in (size=12, H=2, D=8)
    assert block_geometry((12, 2, 8), (16, 8, 1), 1, 0, rows_per_block=4) == (3, 64, (0,), (64,))


@pytest.mark.parametrize(
    "args, message",
    [
        (((4, 8), (0, 1), 2, 0), "broadcast"),
        (((4, 8), (8, 1), 2, 2), "block_dim=2"),
        (((6, 8), (8, 1), 2, 0, 4), "rows_per_block=4"),
        (((4, 8), (8, 1), 0, 0), "itemsize=0"),
        (((4, 3, 4), (12, 2, 1), 2, 0), "overlaps"),
    ],
)
def test_block_geometry_rejects(args, message):
    with pytest.raises(LayoutError, match=message):
        block_geometry(*args)


def test_merge_collapses_block_outermost_and_consecutive_blocks():
    views = vllm033_views("BLHNC", SHAPE, torch.bfloat16, "cpu")
    layout = vllm_layer_layout(views)
    slab = allocate_slab(8, layout.block_nbytes, pin=False)
    copier = BlockCopier(layout, slab)
    assert copier.plan([1, 5], [6, 0], True).count == 2  # one run per block
    assert copier.plan([2, 3, 4], [4, 5, 6], True).count == 1  # consecutive blocks and slots
    per_layer = BlockCopier(vllm_layer_layout(vllm033_views("LBNHC", SHAPE, torch.bfloat16, "cpu")), slab)
    assert per_layer.plan([2, 3], [4, 5], False).count == 2 * SHAPE.layers


def test_merge_and_split_runs_are_inverse_in_bytes():
    runs = Runs(torch.tensor([0, 10, 30, 40]), torch.tensor([100, 110, 200, 210]), torch.tensor([10, 10, 10, 25]))
    merged = merge_runs(runs)
    assert merged.src.tolist() == [0, 30] and merged.dst.tolist() == [100, 200] and merged.size.tolist() == [20, 35]
    pieces = split_runs(merged, 8)
    assert pieces.nbytes == merged.nbytes == 55
    assert pieces.size.max() <= 8
    assert merge_runs(pieces).size.tolist() == merged.size.tolist()


def test_plan_runs_addresses():
    table = ChunkTable(torch.tensor([1000, 5000]), torch.tensor([100, 100]), torch.tensor([0, 40]), torch.tensor([40, 40]))
    runs = plan_runs(table, torch.tensor([2]), torch.tensor([3]), slab_base=0, slot_stride=80, to_cpu=True, merge=False)
    assert runs.src.tolist() == [1200, 5200] and runs.dst.tolist() == [240, 280] and runs.size.tolist() == [40, 40]
    back = plan_runs(table, torch.tensor([2]), torch.tensor([3]), 0, 80, to_cpu=False)
    assert back.src.tolist() == [240, 280] and back.dst.tolist() == [1200, 5200]  # GPU side not adjacent
    adjacent = ChunkTable(torch.tensor([1000, 1040]), torch.tensor([80, 80]), torch.tensor([0, 40]), torch.tensor([40, 40]))
    one = plan_runs(adjacent, torch.tensor([2, 3]), torch.tensor([3, 4]), 0, 80, to_cpu=False)
    assert one.src.tolist() == [240] and one.dst.tolist() == [1160] and one.size.tolist() == [160]


def test_index_validation():
    layout = vllm_layer_layout(vllm033_views("LBHNC", SHAPE, torch.float16, "cpu"))
    copier = BlockCopier(layout, allocate_slab(4, layout.block_nbytes, pin=False))
    with pytest.raises(BlockIndexError, match="outside"):
        copier.gpu_to_cpu([SHAPE.num_blocks], [0])
    with pytest.raises(BlockIndexError, match="outside"):
        copier.gpu_to_cpu([0], [4])
    with pytest.raises(BlockIndexError, match="repeats"):
        copier.gpu_to_cpu([0, 1], [2, 2])
    with pytest.raises(BlockIndexError, match="repeats"):
        copier.cpu_to_gpu([0, 1], [3, 3])
    with pytest.raises(BlockIndexError, match="slots"):
        copier.gpu_to_cpu([0, 1], [2])
    with pytest.raises(BlockIndexError, match="integers"):
        copier.gpu_to_cpu(torch.tensor([0.0]), [1])
    assert copier.gpu_to_cpu([], []).num_blocks == 0
    copier.gpu_to_cpu([0, 0], [1, 2])  # one source to two slots is fine


def test_slab_and_layout_validation():
    layout = vllm_layer_layout(vllm033_views("LBHNC", SHAPE, torch.float16, "cpu"))
    with pytest.raises(LayoutError, match="needs"):
        BlockCopier(layout, allocate_slab(4, layout.block_nbytes - 1, pin=False))
    with pytest.raises(LayoutError, match="uint8"):
        BlockCopier(layout, torch.empty((4, layout.block_nbytes), dtype=torch.float16))
    with pytest.raises(LayoutError, match="one device|holds"):
        KVLayout((torch.empty(4, 8), torch.empty(5, 8)))
    with pytest.raises(LayoutError, match="at least one"):
        KVLayout(())
    wide = allocate_slab(4, layout.block_nbytes + 64, pin=False).fill_(7)
    BlockCopier(layout, wide).gpu_to_cpu([1], [2])
    assert bool((wide[:, layout.block_nbytes :] == 7).all())  # bytes past the block untouched


def test_fingerprint_tells_slot_formats_apart():
    fp = {o: vllm_layer_layout(vllm033_views(o, SHAPE, torch.bfloat16, "cpu"), "vllm").fingerprint() for o in ("LBNHC", "LBHNC", "BLHNC")}
    assert fp["LBNHC"] != fp["LBHNC"]
    assert fp["LBHNC"] == fp["BLHNC"]  # byte-identical slots
    fp8 = vllm_layer_layout(vllm033_views("LBHNC", SHAPE, torch.uint8, "cpu"), "vllm").fingerprint()
    assert fp8 != fp["LBHNC"]


def test_selection_rule():
    policy = SelectionPolicy(sm_max_mean_run_bytes=16384, sm_min_runs=100)
    assert choose_mechanism(1000, 1000 * 4096, True, policy) is Mechanism.SM_KERNEL
    assert choose_mechanism(1000, 1000 * 4096, False, policy) is Mechanism.COPY_ENGINE
    assert choose_mechanism(1000, 1000 * 65536, True, policy) is Mechanism.COPY_ENGINE
    assert choose_mechanism(10, 10 * 4096, True, policy) is Mechanism.COPY_ENGINE
    no_sm = SelectionPolicy(sm_max_mean_run_bytes=16384, sm_min_runs=100, allow_sm_kernel=False)
    assert choose_mechanism(1000, 1000 * 4096, True, no_sm) is Mechanism.COPY_ENGINE
    with pytest.raises(ValueError):
        SelectionPolicy(sm_min_runs=-1)


def test_forcing_a_gpu_mechanism_on_cpu_tensors_is_refused():
    from tiered_kv.copy import BackendUnavailableError

    layout = vllm_layer_layout(vllm033_views("LBHNC", SHAPE, torch.float16, "cpu"))
    slab = allocate_slab(2, layout.block_nbytes, pin=False)
    with pytest.raises(BackendUnavailableError):
        BlockCopier(layout, slab, mechanism="copy_engine")
    with pytest.raises(BackendUnavailableError):
        BlockCopier(layout, slab).gpu_to_cpu([0], [0], mechanism="sm_kernel")


def test_index_lists_convert_as_torch_converts_them():
    """A list of ints goes through a machine array (fast); anything else as ``torch.as_tensor`` takes it."""
    from tiered_kv.copy.errors import BlockIndexError
    from tiered_kv.copy.segments import as_index_tensor

    for ids in ([3, 1, 2], (4, 5), range(3), [], [True, 0], [-1, 7], [1.0, 2.7], [[1, 2]], [2 ** 62]):
        got = as_index_tensor(ids, "ids")
        assert got.dtype == torch.int64 and got.dim() == 1 and got.is_contiguous()
        assert torch.equal(got, torch.as_tensor(list(ids), dtype=torch.int64).reshape(-1))
    for bad in ([2 ** 63], ["a"], [None]):
        with pytest.raises(BlockIndexError):
            as_index_tensor(bad, "ids")
    first, again = as_index_tensor([1, 2], "ids"), as_index_tensor([1, 2], "ids")
    first[0] = 9
    assert again.tolist() == [1, 2] and as_index_tensor([], "ids").numel() == 0  # private tensors


def test_index_tensors_are_copied_at_the_call():
    from tiered_kv.copy.segments import as_index_tensor

    ids = torch.tensor([3, 1, 2])
    private = as_index_tensor(ids, "ids")
    ids[0] = 0
    assert private.tolist() == [3, 1, 2]


@pytest.mark.parametrize("case", [c for c in CASES if c.name.startswith("vllm")], ids=lambda c: c.name)
def test_grouped_load_touches_only_each_groups_tensors(case):
    """cpu_to_gpu_grouped: one result per group; after the first group only its tensors changed; all = cpu_to_gpu."""
    gen = torch.Generator().manual_seed(8)
    layout = case.build(SHAPE, torch.bfloat16, "cpu")
    fill_random(layout, gen)
    slab = allocate_slab(9, layout.block_nbytes, pin=False)
    slab.copy_(torch.randint(0, 256, slab.shape, dtype=torch.uint8, generator=gen))
    blocks, slots = _pick(gen, 4, SHAPE.num_blocks), _pick(gen, 4, 9)
    as_bytes = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731 - random bytes hold NaNs: compare bits
    before = [as_bytes(t).clone() for t in layout.tensors]
    copier = BlockCopier(layout, slab)
    t = len(layout.tensors)
    first = copier.cpu_to_gpu_grouped(slots, blocks, [(0, 1)])
    assert len(first) == 1 and first[0].done() and first[0].nbytes == 4 * layout.maps[0].nbytes
    for i in range(1, t):
        assert torch.equal(as_bytes(layout.tensors[i]), before[i]), f"tensor {i} changed by group (0, 1)"
    results = copier.cpu_to_gpu_grouped(slots, blocks, [(i, i + 1) for i in range(t)])
    assert len(results) == t and all(r.done() for r in results)
    expected = {flat.untyped_storage().data_ptr(): flat.clone() for flat in storages(layout)}
    for b, s in zip(blocks, slots):
        reference_write(layout, b, slab[s], expected)
    for flat in storages(layout):
        assert torch.equal(flat, expected[flat.untyped_storage().data_ptr()])


@pytest.mark.parametrize("groups", [[], [(1, 1)], [(0, 2), (1, 3)], [(0, 4)], [(2, 3), (0, 1)]], ids=str)
def test_grouped_load_refuses_bad_groups(groups):
    layout = vllm_layer_layout(vllm033_views("LBNHC", SHAPE, torch.float16, "cpu"))
    copier = BlockCopier(layout, allocate_slab(4, layout.block_nbytes, pin=False))
    with pytest.raises(LayoutError, match="group"):
        copier.cpu_to_gpu_grouped([0], [1], groups)


def test_sm_kernel_specializations_are_what_a_launch_compiles():
    """``triton_kernel.variant`` (pure arithmetic, no Triton): the word is the widest dividing every address and
    length, the loop step the typical piece's words rounded up to a power of two in [128, 1024]. On every test
    layout (the dispatcher's arithmetic on CPU tensors here), what random and contiguous loads and stores of 1 to
    40 blocks launch, whole and a tensor at a time, is among its ``sm_variants``; a CPU copier has none to warm, and
    ``warm_sm_kernel`` of CPU copiers compiles nothing."""
    from tiered_kv.copy import triton_kernel, warm_sm_kernel
    from tiered_kv.copy.dispatch import GpuDispatcher

    def runs(src, dst, size):
        return Runs(torch.tensor(src), torch.tensor(dst), torch.tensor(size))

    assert triton_kernel.variant(runs([4096, 8192], [0, 65536], [32768, 32768])) == (8, 1024)
    assert triton_kernel.variant(runs([4100], [8], [1024])) == (4, 256)
    assert triton_kernel.variant(runs([4096], [64], [15])) == (1, 128)
    assert triton_kernel.variant(runs([0], [0], [1 << 20])) == (8, 1024)  # split into 64 KiB pieces first
    gen = torch.Generator().manual_seed(9)
    for case in CASES:  # every layout: what random loads and stores launch is among the variants warmed
        for heads in (1, 2, 8):
            layout = case.build(Shape(layers=3, heads=heads, block_size=16, head_dim=64, num_blocks=48),
                                torch.bfloat16, "cpu")
            slab = allocate_slab(48, layout.block_nbytes, pin=False)
            disp = GpuDispatcher(layout, slab, SelectionPolicy(), True, 2048, 32, None)
            got = disp.sm_variants()
            assert got and all(w in (1, 2, 4, 8) and 128 <= b <= 1024 for w, b in got), (case.name, got)
            base, pitch = slab.data_ptr(), slab.stride(0)
            n_tensors = len(layout.tensors)
            for n in (1, 3, 17, 40):
                ids, slots = torch.randperm(48, generator=gen)[:n], torch.randperm(48, generator=gen)[:n]
                if n == 17:
                    ids, slots = torch.arange(n), torch.arange(5, 5 + n)  # contiguous: merged runs
                for to_cpu in (False, True):
                    launched = triton_kernel.variant(plan_runs(disp.table, ids, slots, base, pitch, to_cpu))
                    assert launched in got, (case.name, heads, n, to_cpu, launched, got)
                for runs in disp.plan_groups(ids, slots, False, [(t, t + 1) for t in range(n_tensors)]):
                    assert triton_kernel.variant(runs) in got, (case.name, heads, n)
    copier = BlockCopier(layout, slab)
    assert copier.sm_variants() == set() and warm_sm_kernel([copier], "test") == set()
