"""CPU tests of the staged load mechanism (tiered_kv.copy.staged, ``Mechanism.STAGED``).

The staged path runs the same code on CPU tensors (a CPU staging buffer, torch copies in place
of the DMA), so these check its bytes: every layout of ``all_cases()`` x dtypes, random data,
destinations poisoned, bit-exact against the address-sorting reference and against the
default CPU copier; slots in runs and scattered; loads cut into pieces by a small staging
buffer; layer groups; slab rows wider than a block (the column-range copy); rectangles merged
across layer views of one buffer.
"""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch

import tiered_kv.copy.staged as staged_mod
from tiered_kv.copy import BackendUnavailableError, BlockCopier, Mechanism, allocate_slab, vllm_layer_layout
from tiered_kv.copy.errors import CopyLaunchError
from tiered_kv.copy import scatter_table
from tiered_kv.copy.scatter_table import ScatterTable
from tiered_kv.copy.staged import StagedLoader, layout_rects, slot_runs
from tiered_kv.copy.testing import (
    Shape,
    all_cases,
    fill_random,
    reference_write,
    storages,
    vllm026_tensors,
    vllm033_views,
)

SHAPE = Shape(layers=3, heads=2, block_size=4, head_dim=8, num_blocks=9)
DTYPES = [torch.bfloat16, getattr(torch, "float8_e4m3fn", torch.uint8)]
CASES = all_cases()
SLOTS = 12


def _setup(case, dtype, seed, slot_bytes=None):
    gen = torch.Generator().manual_seed(seed)
    layout = case.build(SHAPE, dtype, "cpu")
    fill_random(layout, gen)  # poison: random bytes everywhere
    slab = allocate_slab(SLOTS, slot_bytes or layout.block_nbytes, pin=False)
    slab.copy_(torch.randint(0, 256, slab.shape, dtype=torch.uint8, generator=gen))
    return gen, layout, slab


def _expected(layout, slab, blocks, slots):
    expected = {flat.untyped_storage().data_ptr(): flat.clone() for flat in storages(layout)}
    for b, s in zip(blocks, slots):
        reference_write(layout, b, slab[s, :layout.block_nbytes], expected)
    return expected


def _assert_equal(layout, expected):
    for flat in storages(layout):
        assert torch.equal(flat, expected[flat.untyped_storage().data_ptr()])


def _wide_setup(case, pattern, seed):
    """A layout, a slab whose rows are 40 bytes wider than a block (random bytes), the pattern's slots, random
    distinct blocks and the bytes the load must leave."""
    gen, layout, _ = _setup(case, torch.bfloat16, seed)
    wide = allocate_slab(SLOTS, layout.block_nbytes + 40, pin=False)
    wide.copy_(torch.randint(0, 256, wide.shape, dtype=torch.uint8, generator=gen))
    slots = SLOT_PATTERNS[pattern]
    blocks = torch.randperm(SHAPE.num_blocks, generator=gen)[:len(slots)].tolist()
    return gen, layout, wide, slots, blocks, _expected(layout, wide, blocks, slots)


def _load_wide(case, pattern, seed, **doubles):
    """A load from a wide slab (``_wide_setup``) in two layer groups (one for a one-tensor layout) through a loader
    with a two-block buffer, its ``doubles`` set (loader attributes: host doubles of the driver paths); checks the
    bytes against the reference and returns the loader, the slots and the groups."""
    gen, layout, wide, slots, blocks, expected = _wide_setup(case, pattern, seed)
    loader = StagedLoader(layout, wide, staging_bytes=2 * layout.block_nbytes)
    for name, double in doubles.items():
        setattr(loader, name, double)
    t = len(layout.tensors)
    groups = [(0, 1), (1, t)] if t > 1 else [(0, 1)]
    loader.load(torch.tensor(blocks), torch.tensor(slots), groups, None, lambda g, ops: None)
    _assert_equal(layout, expected)
    return loader, slots, groups


# blocks in an order unrelated to slots; slots as one run, two runs, and scattered
SLOT_PATTERNS = {
    "one-run": [3, 4, 5, 6, 7],
    "two-runs": [8, 9, 10, 0, 1],
    "scattered": [11, 2, 7, 0, 5],
}


@pytest.mark.parametrize("pattern", sorted(SLOT_PATTERNS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_staged_load_matches_reference(case, dtype, pattern):
    gen, layout, slab = _setup(case, dtype, 3)
    slots = SLOT_PATTERNS[pattern]
    blocks = torch.randperm(SHAPE.num_blocks, generator=gen)[:len(slots)].tolist()
    expected = _expected(layout, slab, blocks, slots)
    slab_before = slab.clone()
    res = BlockCopier(layout, slab).cpu_to_gpu(slots, blocks, mechanism="staged")
    res.wait()
    assert res.mechanism is Mechanism.STAGED and res.done() and res.nbytes == len(slots) * layout.block_nbytes
    _assert_equal(layout, expected)
    assert torch.equal(slab, slab_before)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_staged_equals_default_copier_in_pieces_and_padded_rows(case):
    """A staging buffer of 2 blocks cuts the load into pieces; slab rows 40 bytes wider than a block."""
    gen, layout, slab = _setup(case, torch.float16, 4, slot_bytes=None)
    wide = allocate_slab(SLOTS, layout.block_nbytes + 40, pin=False)
    wide.copy_(torch.randint(0, 256, wide.shape, dtype=torch.uint8, generator=gen))
    slots = [5, 6, 7, 8, 1, 2, 0]
    blocks = torch.randperm(SHAPE.num_blocks, generator=gen)[:len(slots)].tolist()
    expected = _expected(layout, wide, blocks, slots)
    staged = BlockCopier(layout, wide, mechanism="staged", staging_bytes=2 * layout.block_nbytes)
    staged.cpu_to_gpu(slots, blocks).wait()
    _assert_equal(layout, expected)
    # the default (CPU) copier writes the same bytes
    fill_random(layout, gen)
    expected = _expected(layout, wide, blocks, slots)
    BlockCopier(layout, wide).cpu_to_gpu(slots, blocks).wait()
    _assert_equal(layout, expected)


@pytest.mark.parametrize("case", [c for c in CASES if c.name.startswith("vllm")], ids=lambda c: c.name)
def test_staged_grouped_load(case):
    """Layer groups (column ranges of the slot rows): group 0 touches only its tensors; all groups = reference."""
    gen, layout, slab = _setup(case, torch.bfloat16, 5)
    slots, blocks = [2, 3, 4, 9], [8, 0, 3, 5]
    as_bytes = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731 - random bytes hold NaNs: compare bits
    before = [as_bytes(t).clone() for t in layout.tensors]
    copier = BlockCopier(layout, slab, staging_bytes=3 * layout.block_nbytes)
    t = len(layout.tensors)
    first = copier.cpu_to_gpu_grouped(slots, blocks, [(0, 1)], mechanism=Mechanism.STAGED)
    assert len(first) == 1 and first[0].done() and first[0].nbytes == 4 * layout.maps[0].nbytes
    for i in range(1, t):
        assert torch.equal(as_bytes(layout.tensors[i]), before[i]), f"tensor {i} changed by group (0, 1)"
    spans = [(0, 1), (1, t)] if t > 1 else [(0, 1)]
    results = copier.cpu_to_gpu_grouped(slots, blocks, spans, mechanism=Mechanism.STAGED)
    assert len(results) == len(spans) and all(r.done() and r.num_runs > 0 for r in results)
    _assert_equal(layout, _expected(layout, slab, blocks, slots))


def test_staged_store_falls_back_and_tiny_staging_is_refused():
    layout = vllm_layer_layout(vllm026_tensors("NHD", SHAPE, torch.float16, "cpu", mla=True))
    slab = allocate_slab(4, layout.block_nbytes, pin=False)
    fill_random(layout, torch.Generator().manual_seed(6))
    copier = BlockCopier(layout, slab, mechanism="staged")
    res = copier.gpu_to_cpu([1, 2], [0, 3])  # a store: chosen as under "auto" (the CPU copy here)
    assert res.mechanism is Mechanism.CPU
    assert torch.equal(slab[0], layout_bytes(layout, 1)) and torch.equal(slab[3], layout_bytes(layout, 2))
    with pytest.raises(BackendUnavailableError, match="staging_bytes"):
        StagedLoader(layout, slab, staging_bytes=layout.block_nbytes - 1)
    with pytest.raises(BackendUnavailableError, match="staging_bytes"):
        BlockCopier(layout, slab, staging_bytes=8).cpu_to_gpu([0], [1], mechanism="staged")


def layout_bytes(layout, block):
    """A block's slot bytes, from its per-layer tensors (contiguous per layer in these layouts)."""
    return torch.cat([t[block].contiguous().view(-1).view(torch.uint8) for t in layout.tensors])


def test_rects_merge_layer_views_of_one_buffer():
    """vLLM 0.33 per-layer views of one LBNHC buffer: one scatter for all layers; 0.26 separate tensors: one each."""
    one_buffer = vllm_layer_layout(vllm033_views("LBNHC", SHAPE, torch.float16, "cpu"))
    rects = layout_rects(one_buffer, 0, SHAPE.layers)
    assert len(rects) == 1 and rects[0].height == SHAPE.layers
    assert rects[0].width == one_buffer.maps[0].nbytes
    assert len(layout_rects(one_buffer, 1, 3)) == 1 and layout_rects(one_buffer, 1, 3)[0].slot_offset == \
        one_buffer.maps[1].slot_offset
    separate = vllm_layer_layout(vllm026_tensors("NHD", SHAPE, torch.float16, "cpu"))
    assert len(layout_rects(separate, 0, SHAPE.layers)) == SHAPE.layers
    # LHBNC: a layer's block is H chunks one head plane apart, and layers follow at the same step
    lhbnc = vllm_layer_layout(vllm033_views("LHBNC", SHAPE, torch.float16, "cpu"))
    assert [r.height for r in layout_rects(lhbnc, 0, SHAPE.layers)] == [SHAPE.heads * SHAPE.layers]
    assert [r.height for r in layout_rects(lhbnc, 1, 2)] == [SHAPE.heads]


@pytest.mark.parametrize("mechanism", [None, Mechanism.STAGED], ids=["default", "staged"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_many_loads_in_one_call_each_bit_exact(case, mechanism):
    """``cpu_to_gpu_many``: several loads (one per request) in one call, one result each, same bytes as one
    ``cpu_to_gpu`` per load; an empty load is a done result of 0 bytes; a staging buffer smaller than a load."""
    gen, layout, slab = _setup(case, torch.bfloat16, 6)
    perm = torch.randperm(SHAPE.num_blocks, generator=gen).tolist()
    loads = [([3, 4, 5], perm[0:3]), ([], []), ([11, 0], perm[3:5]), ([7, 8, 9, 10], perm[5:9])]
    expected = _expected(layout, slab, [b for _, bs in loads for b in bs], [s for ss, _ in loads for s in ss])
    copier = BlockCopier(layout, slab, staging_bytes=2 * layout.block_nbytes)
    results = copier.cpu_to_gpu_many(loads, mechanism=mechanism)
    assert len(results) == len(loads)
    for res, (slots, _) in zip(results, loads):
        res.wait()
        assert res.done() and res.nbytes == len(slots) * layout.block_nbytes and res.start is None
        assert res.mechanism is (mechanism or Mechanism.CPU)
    _assert_equal(layout, expected)


def test_many_loads_validate_every_load_before_copying_any():
    gen, layout, slab = _setup(CASES[0], torch.float16, 7)
    before = [t.clone() for t in layout.tensors]
    with pytest.raises(Exception, match="cpu_slots|gpu_block_ids"):
        BlockCopier(layout, slab).cpu_to_gpu_many([([1], [2]), ([SLOTS + 5], [3])])
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(layout.tensors, before))


def test_two_threads_never_swap_the_staging_buffer_under_a_load(monkeypatch):
    """The in-step path (``cpu_to_gpu_grouped``, layer by layer) and an asynchronous batch (``cpu_to_gpu_many``)
    share one loader; the batch needs a larger buffer while the in-step load is between its layer groups.

    On CUDA the two are vLLM's thread and the copier's submitter thread; here (the CPU fallback runs copies on
    the caller's thread) two threads stand in for them. Events force the interleaving: the in-step load pauses
    after its first group until the batch has either staged its rows (the batch grew the buffer under it: the
    in-step load's next groups then write into the batch's staged rows) or is blocked waiting for the in-step
    load to finish (the fix: a load holds the loader from its buffer reservation to its last scatter). Both
    loads must be bit-exact and each must have used one buffer from its first DMA to its last scatter.
    """
    from tiered_kv.copy import staged

    monkeypatch.setattr(staged, "GROW_STEP", 1)  # buffers exactly as large as a load needs: the batch must grow it
    gen = torch.Generator().manual_seed(21)
    layout = vllm_layer_layout(vllm026_tensors("NHD", SHAPE, torch.bfloat16, "cpu", mla=True))
    fill_random(layout, gen)
    slab = allocate_slab(SLOTS, layout.block_nbytes, pin=False)
    slab.copy_(torch.randint(0, 256, slab.shape, dtype=torch.uint8, generator=gen))
    groups = [(t, t + 1) for t in range(len(layout.tensors))]  # one layer per group, as in-step loads go
    assert len(groups) >= 2 and len({m.nbytes for m in layout.maps}) == 1
    slots_a, blocks_a = [3, 4], [0, 1]  # in-step: 2 blocks x one layer per group
    slots_b, blocks_b = [8, 9, 10, 0, 1], [2, 3, 4, 5, 6]  # the batch: 5 whole blocks, a larger buffer
    expected = _expected(layout, slab, blocks_a + blocks_b, slots_a + slots_b)
    copier = BlockCopier(layout, slab, mechanism="staged")
    loader = copier._staged_loader()

    a_paused, progress, a_wrote = threading.Event(), threading.Event(), threading.Event()
    used: dict[str, list[torch.Tensor]] = {"in-step": [], "batch": []}
    timeouts: list[str] = []
    blocked: list[str] = []

    def wait(ev: threading.Event, what: str) -> None:
        if not ev.wait(10):
            timeouts.append(what)

    real_dma, real_scatter = StagedLoader._dma, StagedLoader._scatter

    def dma(self, staging, *args):
        who = threading.current_thread().name
        used[who].append(staging)
        out = real_dma(self, staging, *args)
        if who == "in-step" and a_paused.is_set():
            a_wrote.set()  # the in-step load's DMA after its pause has landed
        if who == "batch" and not progress.is_set():  # the batch staged its rows inside the in-step load
            progress.set()
            wait(a_wrote, "the in-step load's next DMA")
        return out

    def scatter(self, staging, *args):
        who = threading.current_thread().name
        used[who].append(staging)
        out = real_scatter(self, staging, *args)
        if who == "in-step" and not a_paused.is_set():  # its first group landed: pause mid-load
            a_paused.set()
            wait(progress, "the batch to stage its rows or to wait for the in-step load")
        return out

    monkeypatch.setattr(StagedLoader, "_dma", dma)
    monkeypatch.setattr(StagedLoader, "_scatter", scatter)

    class Probe:  # the loader's lock, reporting a thread that has to wait for it
        def __init__(self, lock) -> None:
            self.lock = lock

        def __enter__(self):
            if not self.lock.acquire(blocking=False):
                blocked.append(threading.current_thread().name)
                progress.set()
                self.lock.acquire()
            return self

        def __exit__(self, *exc) -> None:
            self.lock.release()

    if getattr(loader, "_lock", None) is not None:
        loader._lock = Probe(loader._lock)
    results: dict[str, list] = {}
    errors: list[BaseException] = []

    def run(name, call):
        try:
            results[name] = call()
        except BaseException as exc:  # noqa: BLE001 - re-raised by the assertion below
            errors.append(exc)

    in_step = threading.Thread(target=run, name="in-step", args=("in-step", lambda: copier.cpu_to_gpu_grouped(
        slots_a, blocks_a, groups, mechanism=Mechanism.STAGED)))
    batch = threading.Thread(target=run, name="batch", args=("batch", lambda: copier.cpu_to_gpu_many(
        [(slots_b, blocks_b)], mechanism=Mechanism.STAGED)))
    in_step.start()
    assert a_paused.wait(10), "the in-step load never reached its first group"
    batch.start()
    in_step.join(30)
    batch.join(30)
    assert not errors, errors
    assert not timeouts, timeouts
    assert all(r.done() and r.mechanism is Mechanism.STAGED for rs in results.values() for r in rs)
    _assert_equal(layout, expected)  # without the fix the batch's first block holds the in-step load's bytes
    for name, steps in used.items():
        assert steps and all(s is steps[0] for s in steps), f"{name}: the staging buffer was swapped mid-load"
    assert used["batch"][0].numel() > used["in-step"][0].numel() and loader.allocations == 2
    assert blocked == ["batch"]  # the batch waited for the in-step load instead of growing the buffer under it


# ============================================================================ two halves (staging_buffers=2)
def test_two_halves_only_when_a_load_has_several_pieces_and_they_fit_the_cap():
    """``plan``: one buffer for a one-piece load or with ``buffers=1``; two halves, each within half the cap and
    the second aligned, when the load has several pieces (rows past half the cap, or several layer groups)."""
    layout = vllm_layer_layout(vllm026_tensors("NHD", SHAPE, torch.bfloat16, "cpu"))
    slab = allocate_slab(SLOTS, layout.block_nbytes, pin=False)
    nb, t = layout.block_nbytes, len(layout.tensors)
    whole = [(0, t)]
    cap = 8 * nb
    one, two = StagedLoader(layout, slab, cap, buffers=1), StagedLoader(layout, slab, cap, buffers=2)
    assert one.plan(6, whole) == (1, [8], 0, 6 * nb)
    assert two.plan(3, whole) == (1, [8], 0, 3 * nb)  # fits one half and the whole cap: one piece, no halves
    halves, per, second, need = two.plan(6, whole)  # 6 rows > half the cap (4): 2 pieces
    assert (halves, per) == (2, [cap // 2 // nb])
    assert second % 256 == 0 and second >= per[0] * nb and need == second + per[0] * nb <= cap
    groups = [(0, 1), (1, t)]  # several groups, each one piece: still alternates
    halves, per, second, need = two.plan(2, groups)
    assert halves == 2 and need <= cap and second >= 2 * layout.maps[0].nbytes
    assert two.need(6, whole) == two.plan(6, whole)[3] and two.need(0, whole) == 0
    # a half that cannot hold one row falls back to one buffer
    assert StagedLoader(layout, slab, nb, buffers=2).plan(6, whole)[0] == 1
    with pytest.raises(BackendUnavailableError, match="buffers=3"):
        StagedLoader(layout, slab, cap, buffers=3)
    with pytest.raises(BackendUnavailableError, match="staging_buffers=0"):
        BlockCopier(layout, slab, staging_buffers=0)


@pytest.mark.parametrize("pattern", sorted(SLOT_PATTERNS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_two_halves_bit_exact_in_many_pieces_and_groups(case, pattern):
    """Pieces of one row alternate the halves (the second at an aligned offset): the bytes equal the reference,
    whole and in layer groups, with slab rows wider than a block."""
    gen, layout, wide, slots, blocks, expected = _wide_setup(case, pattern, 21)
    copier = BlockCopier(layout, wide, mechanism="staged", staging_bytes=2 * layout.block_nbytes + 256,
                         staging_buffers=2)
    assert copier._staged_loader().plan(len(slots), [(0, len(layout.tensors))])[:2] == (2, [1])
    copier.cpu_to_gpu(slots, blocks).wait()
    _assert_equal(layout, expected)
    t = len(layout.tensors)
    if t > 1:
        fill_random(layout, gen)
        expected = _expected(layout, wide, blocks, slots)
        results = copier.cpu_to_gpu_grouped(slots, blocks, [(0, 1), (1, t)], mechanism=Mechanism.STAGED)
        assert [r.mechanism for r in results] == [Mechanism.STAGED] * 2
        _assert_equal(layout, expected)


def test_slot_runs_match_a_plain_loop():
    """``slot_runs`` (a run starts at item 0 and wherever a slot does not follow the one before) against a loop."""
    gen = torch.Generator().manual_seed(31)
    for n in [0, 1, 2, 3, 17, 82]:
        for hi in (3, 40):
            slots = torch.randint(0, hi, (n,), generator=gen)
            values = slots.tolist()
            first = [i for i in range(n) if i == 0 or values[i] != values[i - 1] + 1]
            runs = slot_runs(slots)
            assert (runs.first, runs.slot) == (first + [n], [values[i] for i in first])


@pytest.mark.parametrize("shift", range(8))
def test_scatter_words_follow_the_staging_address(shift):
    """The scatter's word width divides the staging rows' address too (a buffer at any byte): bit-exact, and the
    per-rectangle steps are kept per (tensors, columns, address modulo 8), not rebuilt each call."""
    case = next(c for c in CASES if c.name.startswith("vllm"))
    gen, layout, slab = _setup(case, torch.bfloat16, 30 + shift)
    loader = StagedLoader(layout, slab)
    slots, blocks = [3, 7, 1], [4, 0, 8]
    t, width = len(layout.tensors), loader._width(0, len(layout.tensors))
    staging = torch.empty(len(slots) * width + 8, dtype=torch.uint8)[shift:shift + len(slots) * width]
    staging.view(len(slots), width).copy_(slab[slots, :width])
    expected = _expected(layout, slab, blocks, slots)
    assert loader._scatter(staging, torch.tensor(blocks), len(slots), 0, t, 0, width) == len(loader.rects(0, t))
    _assert_equal(layout, expected)
    steps = loader._scatter_steps(0, t, 0, width, staging.data_ptr() % 8)
    assert all(staging.data_ptr() % w == 0 and width % w == 0 for w, *_ in steps)
    assert loader._scatter_steps(0, t, 0, width, staging.data_ptr() % 8) is steps


def test_slot_runs_cut_at_each_piece():
    """Runs of adjacent slots as ints; a piece takes the runs it overlaps, cut at its ends, packed from row 0."""
    runs = slot_runs(torch.tensor([4, 5, 6, 9, 1, 2], dtype=torch.int64))
    assert (runs.first, runs.slot) == ([0, 3, 4, 6], [4, 9, 1])
    assert runs.piece(0, 6, 10) == [(0, 4, 3), (30, 9, 1), (40, 1, 2)]
    assert runs.piece(1, 5, 10) == [(0, 5, 2), (20, 9, 1), (30, 1, 1)]  # cut inside the first and last runs
    assert runs.piece(5, 6, 7) == [(0, 2, 1)] and runs.piece(3, 3, 7) == []


class _HostRows:
    """``RectMemcpy.gather_rows`` done with memmove between host addresses: the CUDA driver cannot run here, and
    this checks the addresses the staged load computes for its column-range DMA (the path it takes on CUDA)."""

    def __init__(self) -> None:
        self.calls = 0

    def gather_rows(self, dst, src, src_pitch, width, runs, stream_handle):
        for d, r, h in runs:
            for i in range(h):
                ctypes.memmove(dst + d + i * width, src + (r + i) * src_pitch, width)
        self.calls += len(runs)
        return len(runs)


@pytest.mark.parametrize("pattern", sorted(SLOT_PATTERNS))
@pytest.mark.parametrize("case", [c for c in CASES if c.name.startswith("vllm")], ids=lambda c: c.name)
def test_column_range_dma_addresses_are_bit_exact(case, pattern):
    """The address path of the column-range DMA (one call per run of adjacent slots, addresses from the slab's
    base): layer groups of slab rows wider than a block, a buffer of two rows (pieces cut the runs), = reference."""
    loader, slots, groups = _load_wide(case, pattern, 31, _rect2d=(rows := _HostRows()))
    runs = len(slot_runs(torch.tensor(slots)).slot)
    assert rows.calls >= runs * len(groups)  # every group's columns went through the address path


class _HostBatch:
    """``BatchMemcpy.submit`` done with memmove between host addresses (the CUDA driver cannot run here): checks
    the descriptors the staged load builds for its batched DMA (the path it takes on CUDA)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def submit(self, runs, stream_handle):
        for s, d, n in zip(runs.src.tolist(), runs.dst.tolist(), runs.size.tolist()):
            ctypes.memmove(d, s, n)
        self.sizes += runs.size.tolist()
        return 1


def _short_and_long(slots, per, width):
    """(rows of runs shorter than RECT_MIN_ROWS, runs of at least that many) over pieces of ``per`` items."""
    runs = slot_runs(torch.tensor(slots))
    pieces = [runs.piece(i, min(len(slots), i + per), width) for i in range(0, len(slots), per)]
    todo = [t for p in pieces for t in p]
    return (sum(h for _, _, h in todo if h < staged_mod.RECT_MIN_ROWS),
            sum(1 for _, _, h in todo if h >= staged_mod.RECT_MIN_ROWS))


@pytest.mark.parametrize("pattern", sorted(SLOT_PATTERNS))
@pytest.mark.parametrize("case", [c for c in CASES if c.name.startswith("vllm")], ids=lambda c: c.name)
def test_batched_dma_descriptors_are_bit_exact(case, pattern):
    """The batched DMA's descriptors: a column range sends the rows of runs shorter than ``RECT_MIN_ROWS`` as one
    descriptor each and longer runs as one 2-D copy (pieces of two rows cut the runs); = reference."""
    rows, batch = _HostRows(), _HostBatch()
    loader, slots, groups = _load_wide(case, pattern, 37, _rect2d=rows, _batch=batch)
    want_rows, want_rects = 0, 0
    for g, (a, b) in enumerate(groups):
        width = loader._width(a, b)
        short, long_ = _short_and_long(slots, loader.plan(len(slots), groups)[1][g], width)
        want_rows, want_rects = want_rows + short, want_rects + long_
    assert (len(batch.sizes), rows.calls) == (want_rows, want_rects)


@pytest.mark.parametrize("pattern", sorted(SLOT_PATTERNS))
@pytest.mark.parametrize("case", [c for c in CASES if c.name.startswith("vllm")], ids=lambda c: c.name)
def test_batched_dma_of_whole_rows_is_one_descriptor_a_run(case, pattern):
    """Whole slot rows (a slab exactly a block wide, every tensor in one group): one batched descriptor per run of
    adjacent slots, its size the run's rows, no 2-D copy; = reference."""
    gen, layout, slab = _setup(case, torch.bfloat16, 43)
    slots = SLOT_PATTERNS[pattern]
    blocks = torch.randperm(SHAPE.num_blocks, generator=gen)[:len(slots)].tolist()
    expected = _expected(layout, slab, blocks, slots)
    loader = StagedLoader(layout, slab)
    loader._rect2d, loader._batch = rows, batch = _HostRows(), _HostBatch()
    loader.load(torch.tensor(blocks), torch.tensor(slots), [(0, len(layout.tensors))], None, lambda g, ops: None)
    _assert_equal(layout, expected)
    runs = slot_runs(torch.tensor(slots))
    assert batch.sizes == [(b - a) * layout.block_nbytes for a, b in zip(runs.first, runs.first[1:])]
    assert rows.calls == 0


def test_staged_loader_refuses_a_slab_that_is_not_byte_rows():
    layout = CASES[0].build(SHAPE, torch.bfloat16, "cpu")
    with pytest.raises(BackendUnavailableError, match="2-D uint8 slab"):
        StagedLoader(layout, torch.zeros(SLOTS, layout.block_nbytes // 2, dtype=torch.int16))


@pytest.mark.parametrize("case", [c for c in CASES if c.name.startswith("vllm")], ids=lambda c: c.name)
def test_checked_pair_is_derived_once_across_layer_group_calls(case, monkeypatch):
    """An in-step load's layer groups come in several calls with the pair ``load_indices`` checked once: the staged
    loader derives the slots' runs once for them, and every group's bytes equal the reference."""
    gen, layout, slab = _setup(case, torch.bfloat16, 41)
    slots, blocks = [2, 3, 4, 9, 0], [8, 0, 3, 5, 6]
    expected = _expected(layout, slab, blocks, slots)
    copier = BlockCopier(layout, slab)
    pair = copier.load_indices(slots, blocks)
    assert [t.tolist() for t in pair] == [slots, blocks]
    derived = []
    real = staged_mod.slot_runs
    monkeypatch.setattr(staged_mod, "slot_runs", lambda s: derived.append(1) or real(s))
    for a in range(len(layout.tensors)):
        copier.cpu_to_gpu_grouped(*pair, [(a, a + 1)], mechanism=Mechanism.STAGED, checked=True)
    _assert_equal(layout, expected)
    assert len(derived) == 1
    copier.cpu_to_gpu_grouped(slots, blocks, [(0, 1)], mechanism=Mechanism.STAGED)  # unchecked lists: new tensors
    assert len(derived) == 2


def test_load_indices_refuses_bad_ids_and_checked_takes_only_its_tensors():
    layout = CASES[0].build(SHAPE, torch.bfloat16, "cpu")
    copier = BlockCopier(layout, allocate_slab(SLOTS, layout.block_nbytes, pin=False))
    from tiered_kv.copy import BlockIndexError
    with pytest.raises(BlockIndexError, match="repeats an id"):
        copier.load_indices([0, 1], [3, 3])
    with pytest.raises(BlockIndexError, match="outside"):
        copier.load_indices([0, SLOTS], [1, 2])
    with pytest.raises(BlockIndexError, match="load_indices"):
        copier.cpu_to_gpu_grouped([0, 1], [1, 2], [(0, 1)], checked=True)


class _HostRectBatch(_HostRows):
    """``RectBatchMemcpy.gather_rows`` done with memmove (the driver cannot run here); ``fail_after`` runs it raises
    ``CopyLaunchError`` once, after copying them, as a driver refusing a run in the middle of a batch would."""

    def __init__(self, fail_after: int | None = None) -> None:
        super().__init__()
        self.fail_after = fail_after

    def gather_rows(self, dst, src, src_pitch, width, runs, stream_handle):
        if self.fail_after is not None:
            super().gather_rows(dst, src, src_pitch, width, runs[:self.fail_after], stream_handle)
            raise CopyLaunchError("cuMemcpy3DBatchAsync returned CUresult 1 (a host double)")
        return super().gather_rows(dst, src, src_pitch, width, runs, stream_handle)


@pytest.mark.parametrize("pattern", sorted(SLOT_PATTERNS))
@pytest.mark.parametrize("case", [c for c in CASES if c.name.startswith("vllm")], ids=lambda c: c.name)
def test_batched_2d_copies_take_every_run_of_a_column_range(case, pattern):
    """With the driver's batched 2-D copies a column range's runs all go in them (short and long), none as 1-D
    descriptors or single 2-D calls; = reference."""
    rows, batch, rect = _HostRows(), _HostBatch(), _HostRectBatch()
    loader, slots, groups = _load_wide(case, pattern, 47, _rect2d=rows, _batch=batch, _rect_batch=rect)
    runs, per = slot_runs(torch.tensor(slots)), loader.plan(len(slots), groups)[1]
    want = sum(len(runs.piece(i, min(len(slots), i + per[g]), loader._width(a, b)))
               for g, (a, b) in enumerate(groups) for i in range(0, len(slots), per[g]))
    assert (rect.calls, rows.calls, batch.sizes) == (want, 0, [])


@pytest.mark.parametrize("case", [c for c in CASES if c.name.startswith("vllm")], ids=lambda c: c.name)
def test_a_refused_batched_2d_call_falls_back_for_good(case):
    """The driver refuses the batched 2-D copies after queuing part of them: the call's runs go again by the other
    path (the same bytes), the loader stops using them, and the load is bit-exact."""
    rows, batch, rect = _HostRows(), _HostBatch(), _HostRectBatch(fail_after=1)
    loader, _, _ = _load_wide(case, "two-runs", 53, _rect2d=rows, _batch=batch, _rect_batch=rect)
    assert loader._rect_batch is False and rect.calls == 1 and (rows.calls or batch.sizes)


class _HostTable(ScatterTable):
    """A ``ScatterTable`` whose ``_enqueue`` copies on the host, pair by pair with the kernel's arithmetic over
    ``columns()`` in words (what ``prepare`` uploads), each pair's words moved with memmove: fast, for every layout
    and slot pattern. It checks the table, its spans and ``launch``'s refusals; the kernel itself and the arguments
    ``_enqueue`` passes it run under Triton's interpreter (``test_the_kernel_itself_scatters_bit_exact``)."""

    def __init__(self, table: ScatterTable) -> None:
        super().__init__(list(zip(table.src, table.dst, table.stride, table.size)))
        self.device = torch.empty(0)  # "prepared"
        self.launches = 0

    def _enqueue(self, staging, ids, first, items, col0, cols, c0, width):
        w = self.word
        off, dst0, stride, n = self.columns()
        row_words, c0_words = width // w, c0 // w
        for p in range(items * cols):  # the kernel's pairs, as its programs walk them
            item = p // cols
            col = col0 + p - item * cols
            blk = int(ids[first + item])
            src = staging.data_ptr() + (item * row_words + off[col] - c0_words) * w
            ctypes.memmove(dst0[col] + blk * stride[col] * w, src, n[col] * w)
        self.launches += 1


def _groups(layout) -> list[tuple[int, int]]:
    t = len(layout.tensors)
    return [(0, 1), (1, t)] if t > 1 else [(0, 1)]


@pytest.mark.parametrize("buffers", [1, 2])
@pytest.mark.parametrize("pattern", sorted(SLOT_PATTERNS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_one_launch_scatter_is_bit_exact(case, pattern, buffers, monkeypatch):
    """The scatter as one launch over the layout's table of rectangle rows: whole rows and layer groups (a span of
    the table each), pieces of two rows (the staging offsets restart each piece), both halves of a two-buffer load,
    slab rows wider than a block; = reference, one launch per piece and group."""
    monkeypatch.setattr(staged_mod, "SCATTER_KERNEL_MIN_ROWS", 1)
    _, layout, wide, slots, blocks, expected = _wide_setup(case, pattern, 59)
    loader = StagedLoader(layout, wide, staging_bytes=2 * buffers * layout.block_nbytes, buffers=buffers,
                          scatter_kernel=True)
    loader._table = table = _HostTable(loader.scatter_table())
    groups = _groups(layout)
    loader.load(torch.tensor(blocks), torch.tensor(slots), groups, None, lambda g, ops: None)
    _assert_equal(layout, expected)
    halves, per, second, _ = loader.plan(len(slots), groups)
    assert halves == buffers and (second > 0) == (buffers == 2)
    assert table.launches == sum(-(-len(slots) // p) for p in per)


@pytest.fixture
def interpreted_kernel(monkeypatch):
    """The scatter kernel built under Triton's interpreter (``TRITON_INTERPRET=1``: the real kernel, run by Triton on
    the CPU): rebuilt for the test and again after it."""
    pytest.importorskip("triton", reason="the vLLM venv brings Triton; without it only the host double runs")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    scatter_table._kernel.cache_clear()
    yield
    scatter_table._kernel.cache_clear()


@pytest.mark.parametrize("buffers", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_kernel_itself_scatters_bit_exact(case, buffers, interpreted_kernel, monkeypatch):
    """``ScatterTable.launch`` and ``_enqueue`` with the real kernel (interpreted, on the CPU): the table as
    ``prepare`` uploads it (``columns()``), every argument as ``_enqueue`` passes it, whole rows and layer groups,
    pieces, both halves of a two-buffer load; = reference, every scatter through the kernel."""
    monkeypatch.setattr(staged_mod, "SCATTER_KERNEL_MIN_ROWS", 1)
    _, layout, wide, slots, blocks, expected = _wide_setup(case, "two-runs", 67)
    loader = StagedLoader(layout, wide, staging_bytes=2 * buffers * layout.block_nbytes, buffers=buffers,
                          scatter_kernel=True)
    table = loader.scatter_table()
    table.device = torch.tensor(table.columns(), dtype=torch.int64)  # what prepare uploads, here in host memory
    took = []

    def counted(*args, _launch=table.launch):
        ok = _launch(*args)
        took.append(ok)
        return ok

    table.launch = counted
    loader._table = table
    loader.load(torch.tensor(blocks), torch.tensor(slots), _groups(layout), None, lambda g, ops: None)
    _assert_equal(layout, expected)
    assert took and all(took)


def test_few_rectangle_rows_scatter_with_index_put():
    """Below ``SCATTER_KERNEL_MIN_ROWS`` rectangle rows a prepared table is not used: ``index_put_`` per rectangle.
    Without a table (``staged_scatter: index_put``, no Triton, or the CPU, where ``prepare`` builds none) the bytes
    go the same way."""
    case = next(c for c in CASES if c.name.startswith("vllm"))
    gen, layout, slab = _setup(case, torch.bfloat16, 61)
    slots, blocks = [2, 3, 4], [5, 0, 7]
    expected = _expected(layout, slab, blocks, slots)
    loader = StagedLoader(layout, slab, scatter_kernel=True)
    loader.prepare()  # CPU: nothing to prepare, no table
    assert loader._table is None
    loader._table = host = _HostTable(loader.scatter_table())
    assert sum(r.height for r in loader.rects(0, 1)) < staged_mod.SCATTER_KERNEL_MIN_ROWS
    loader.load(torch.tensor(blocks), torch.tensor(slots), [(a, a + 1) for a in range(len(layout.tensors))], None,
                lambda g, ops: None)
    _assert_equal(layout, expected)
    assert host.launches == 0


def test_scatter_table_spans_words_and_refusals():
    """The table: rows sorted by slot offset; a column range maps to a run of whole rows, or None when a row
    straddles its ends; overlapping rows are refused; the word divides every offset; ``launch`` enqueues nothing
    unprepared, for a range of partial rows, or for offsets its word does not divide."""
    table = ScatterTable([(64, 1 << 20, 4096, 64), (0, 2 << 20, 4096, 64), (128, 3 << 20, 4096, 32)])
    assert (table.src, table.word, table.rows) == ([0, 64, 128], 8, 3)
    assert ScatterTable([(0, 1 << 20, 4096, 36), (36, 2 << 20, 4096, 28)]).word == 4
    assert table.span(0, 160) == (0, 3) and table.span(64, 96) == (1, 2) and table.span(64, 64) == (1, 1)
    assert table.span(0, 100) is None and table.span(32, 64) is None and table.span(200, 16) is None
    with pytest.raises(ValueError, match="overlap"):
        ScatterTable([(0, 0, 64, 64), (32, 0, 64, 64)])
    host = _HostTable(table)
    staging = torch.zeros(1024, dtype=torch.uint8)
    ids = torch.zeros(4, dtype=torch.int64)
    assert not ScatterTable([(0, 0, 64, 64)]).launch(staging, ids, 0, 1, 0, 64)  # not prepared
    assert not host.launch(staging, ids, 0, 1, 0, 100)  # partial rows
    assert not host.launch(staging, ids, 0, 1, 4, 64)  # c0 not a multiple of the 8-byte word
    assert not host.launch(staging[8:], ids, 0, 1, 0, 64)  # a pointer the kernel was not compiled for (8 mod 16)
    assert not host.launch(staging, ids[1:], 0, 1, 0, 64)
    assert host.columns() == [[0, 8, 16], [2 << 20, 1 << 20, 3 << 20], [512] * 3, [8, 8, 4]]
    assert not host.launch(staging, ids, 0, 0, 0, 160) and host.launches == 0  # nothing to scatter
