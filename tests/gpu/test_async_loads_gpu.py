"""Batched asynchronous loads on CUDA (``BlockCopier.cpu_to_gpu_many``, the vLLM worker's ``AsyncLoader``).

Llama-3-8B-like per-layer tensors (32 layers x 64 KiB per block): 12 loads of 9 blocks each go in
one call behind a busy engine stream. Checked: every load bit-exact; they land in submission order
(no later load's event fires before an earlier one's); each has its own GPU time (timing events);
the AsyncLoader reports each load as soon as its bytes landed, in order, and waits for named ones.
"""
from __future__ import annotations

import pytest
import torch

from tiered_kv.copy import BlockCopier, Mechanism, allocate_slab, cpu, vllm_layer_layout
from tiered_kv.copy.testing import Shape, vllm026_tensors
from tiered_kv.values.jobs import JobKind, TransferJob

LOADS, PER = 12, 9
LLAMA = Shape(layers=32, heads=8, block_size=16, head_dim=128, num_blocks=256)


def _setup(gen):
    layout = vllm_layer_layout(vllm026_tensors("NHD", LLAMA, torch.bfloat16, "cuda"))
    slab = allocate_slab(LOADS * PER, layout.block_nbytes, pin=True)
    slab.copy_(torch.randint(0, 256, slab.shape, dtype=torch.uint8, generator=gen))
    blocks = torch.randperm(LLAMA.num_blocks, generator=gen)[:LOADS * PER].view(LOADS, PER).tolist()
    loads = [(list(range(i * PER, (i + 1) * PER)), blocks[i]) for i in range(LOADS)]
    return layout, slab, loads


def _busy_stream():
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(6):
        a = a @ a / 64.0
    return a


def _check(layout, slab, loads):
    """Every loaded block equals what the reference copy (``cpu.slab_to_blocks``, torch indexing) puts there.

    The reference writes into clones that keep the views' strides (vLLM's physical order), so the
    comparison does not depend on how a slot row orders a block's bytes (the old check compared the
    logical order of ``contiguous()`` with the slot's physical bytes).
    """
    ref = vllm_layer_layout([t.clone() for t in layout.tensors])
    assert all(r.stride() == t.stride() for r, t in zip(ref.tensors, layout.tensors))
    for slots, blocks in loads:
        ids = torch.tensor(blocks)
        cpu.slab_to_blocks(ref, slab, torch.tensor(slots), ids)
        for li, (t, r) in enumerate(zip(layout.tensors, ref.tensors)):
            dev = ids.to(t.device)  # bits, not values: random bytes make NaNs, and NaN != NaN
            assert torch.equal(t.view(torch.int16)[dev], r.view(torch.int16)[dev]), f"layer {li}, blocks {blocks}"


@pytest.mark.parametrize("mechanism", [None, Mechanism.STAGED], ids=["copy_engine", "staged"])
def test_many_loads_land_in_order_each_with_its_time(mechanism):
    gen = torch.Generator().manual_seed(21)
    layout, slab, loads = _setup(gen)
    copier = BlockCopier(layout, slab)
    _busy_stream()
    results = copier.cpu_to_gpu_many(loads, mechanism=mechanism, timing=True)
    seen: list[int] = []
    while len(seen) < LOADS:  # poll like get_finished does: a later load is never done before an earlier one
        done = [i for i, r in enumerate(results) if r.done()]
        assert done == list(range(len(done))), done
        seen = done
    torch.cuda.synchronize()
    times = [r.start.elapsed_time(r.event) for r in results]
    assert all(t > 0 for t in times), times
    _check(layout, slab, loads)
    copier.close()


def test_async_loader_reports_each_load_once_landed_and_waits_for_named_ones():
    from tiered_kv.connector.vllm.async_loads import AsyncLoader

    gen = torch.Generator().manual_seed(22)
    layout, slab, loads = _setup(gen)
    copier = BlockCopier(layout, slab)
    loader = AsyncLoader(copier)
    jobs = [TransferJob(i + 1, JobKind.EGRESS, 0, -1, [b"k%d" % i], [i], [0], handle=i + 1) for i in range(LOADS)]
    _busy_stream()
    loader.start([(job, blocks, slots) for job, (slots, blocks) in zip(jobs, loads)])
    order: list[int] = []
    got = loader.wait({jobs[1].job_id})  # a fence on the second load
    assert [j.job_id for j, _ in got] == [jobs[1].job_id]
    order += [j.job_id for j, _ in got]
    while loader.pending:
        order += [j.job_id for j, c in loader.landed()]
    assert order[0] == jobs[1].job_id and order[1:] == [j.job_id for j in jobs if j is not jobs[1]]
    _check(layout, slab, loads)
    copier.close()
