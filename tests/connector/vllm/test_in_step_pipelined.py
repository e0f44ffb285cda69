"""``load_submit``: a step's in-step loads merged into one copy, layer group by layer group, and
(pipelined) the later groups submitted between the forward's layers, not before it.

On CPU tensors every copy is synchronous, so the schedule is visible in the KV tensors themselves:
a layer whose group has not been submitted still holds zeros. The same schedule on CUDA is checked
for ordering by ``tests/gpu/test_vllm_worker_gpu.py`` (a layer read before its bytes landed fails).
"""
from __future__ import annotations

import json

import pytest
import torch

from tiered_kv.connector.vllm.config import ConnectorConfig
from tiered_kv.connector.vllm.common import CPU, StepPlan
from tiered_kv.copy import Mechanism
from tiered_kv.errors import ConfigError
from tiered_kv.values.jobs import EXT, JobKind, TransferJob

from tests.connector.vllm.test_worker_in_step import K, make_runtime

LAYERS = 8
#: one layer of one block: 1 head x 16 tokens x 16 (K and V of 8 dims) x 2 bytes
LAYER_BLOCK = 16 * 16 * 2
#: a layer group of the tests' 2 loads (one chunk each) with 4 groups: 2 layers x 2 x K blocks
GROUP = 2 * 2 * K * LAYER_BLOCK


def _step(load_submit: str, groups: int = 4, loads: int = 2, mode: str = "layerwise", async_load: bool = False,
          ahead: int = GROUP, **extra):
    """A runtime with ``loads`` in-step loads of one chunk each planned for one step (and, with
    ``async_load``, one asynchronous load of another request); returns
    (runtime, kv tensors, layer names, [(job, slot, gpu blocks)] of the in-step loads)."""
    rt, kv, names = make_runtime("cpu", layers=LAYERS, heads=1, head_dim=8, num_blocks=K * (loads + 1) + 2,
                                 cpu_chunks=loads + 2, load_mode=mode, load_groups=groups, load_submit=load_submit,
                                 load_ahead_bytes=ahead, **extra)
    gen = torch.Generator().manual_seed(11)
    slab = rt.cpu.slab
    jobs, items = [], []
    for i in range(loads + 1):
        slot = loads - i + 1  # not in order
        slab[slot] = torch.randint(1, 256, (slab.shape[1],), dtype=torch.uint8, generator=gen)  # never zero
        gpu = list(range(i * K, (i + 1) * K))
        job = TransferJob(20 + i, JobKind.EGRESS, CPU, EXT, [b"c%d" % i], [slot], [0])
        jobs.append(job)
        items.append((job, slot, gpu))
    later = items.pop()  # the asynchronous one, if any
    plan = StepPlan(1, early=[j for j, _, _ in items], ext={j.job_id: g for j, _, g in items},
                    sync=[j.job_id for j, _, _ in items])
    if async_load:
        job, _, gpu = later
        plan.early.append(job)
        plan.ext[job.job_id] = gpu
        plan.loads = {"r-async": [job.job_id]}
    rt.on_plan(plan)
    return rt, kv, names, items


def _layer_ok(rt, kv, names, items, li: int) -> bool:
    """True when layer ``li`` of every load's blocks holds its CPU bytes."""
    per = rt.kv.maps[0].nbytes
    for _, slot, gpu in items:
        rows = rt.cpu.slab[slot].view(K, -1)
        for i, g in enumerate(gpu):
            got = kv[names[li]][g].contiguous().view(torch.uint8).reshape(-1)
            if not torch.equal(got, rows[i][li * per:(li + 1) * per]):
                return False
    return True


def _loaded(rt, kv, names, items) -> list[bool]:
    return [_layer_ok(rt, kv, names, items, li) for li in range(LAYERS)]


def test_pipelined_keeps_load_ahead_bytes_in_flight_and_every_layer_reads_its_bytes():
    """``load_ahead_bytes`` = one group: one group before the forward, one more per layer as the
    previous lands (on CPU a copy has landed when its call returns)."""
    rt, kv, names, items = _step("pipelined", groups=4, ahead=GROUP)
    try:
        rt.before_forward(layerwise_ok=True)
        # before the forward: only the first layer group (layers 0-1) of *both* loads is in
        assert _loaded(rt, kv, names, items) == [True] * 2 + [False] * 6
        rt.wait_layer(names[0])
        assert _loaded(rt, kv, names, items) == [True] * 4 + [False] * 4
        for li, name in enumerate(names[1:], 1):
            rt.wait_layer(name)
            assert _layer_ok(rt, kv, names, items, li), f"layer {li} read before its group was submitted"
        result = rt.poll()
        assert all(result.reports[j.job_id].ok == [True] for j, _, _ in items)
        stats = rt.stats()
        assert stats["sync_loads"] == 2 and stats["sync_load_groups"] == 4  # one merged copy, 4 groups
        assert rt.in_step is not None and not rt.in_step.busy and rt.idle()
    finally:
        rt.close()


def test_pipelined_submits_a_group_at_its_first_layer_at_the_latest():
    """``load_ahead_bytes`` below one group: nothing goes ahead; each group at the first layer that reads it."""
    rt, kv, names, items = _step("pipelined", groups=4, ahead=GROUP // 2)
    try:
        rt.before_forward(layerwise_ok=True)
        assert _loaded(rt, kv, names, items) == [True] * 2 + [False] * 6  # at least one group goes before
        rt.wait_layer(names[0])
        rt.wait_layer(names[1])
        assert _loaded(rt, kv, names, items) == [True] * 2 + [False] * 6
        rt.wait_layer(names[2])
        assert _loaded(rt, kv, names, items) == [True] * 4 + [False] * 4
        for name in names[3:]:
            rt.wait_layer(name)
        assert all(r.ok == [True] for r in rt.poll().reports.values())
    finally:
        rt.close()


@pytest.mark.parametrize("load_submit,groups,ahead,layerwise_ok,want_groups", [
    ("pipelined", 0, 256 << 20, True, 1),  # 32 KiB, within load_ahead_bytes: one group, as upfront
    ("upfront", 4, GROUP, True, 4),  # every group before the forward whatever its size
    ("pipelined", 4, GROUP, False, 1),  # a full CUDA graph may replay: nothing may be left for wait_layer
], ids=["within-ahead", "upfront", "no-layer-waits"])
def test_the_whole_copy_goes_before_the_forward(load_submit, groups, ahead, layerwise_ok, want_groups):
    rt, kv, names, items = _step(load_submit, groups=groups, ahead=ahead)
    try:
        rt.before_forward(layerwise_ok=layerwise_ok)
        assert all(_loaded(rt, kv, names, items)) and not rt.in_step.busy
        for name in names:
            rt.wait_layer(name)
        assert all(r.ok == [True] for r in rt.poll().reports.values())
        assert rt.stats()["sync_load_groups"] == want_groups
    finally:
        rt.close()


def test_a_skipped_layer_wait_still_submits_its_group_before_the_layer_and_finish_submits_the_rest():
    rt, kv, names, items = _step("pipelined", groups=4, ahead=1)
    try:
        rt.before_forward(layerwise_ok=True)
        rt.wait_layer(names[4])  # layers 0-3 never waited: layer 4's group (and all before it) goes now
        assert all(_layer_ok(rt, kv, names, items, li) for li in range(6))
        assert not _layer_ok(rt, kv, names, items, 6)
        result = rt.poll()  # vLLM never reached layers 5-7: finish submits group 3 before waiting
        assert all(_layer_ok(rt, kv, names, items, li) for li in range(LAYERS))
        assert all(r.ok == [True] for r in result.reports.values())
    finally:
        rt.close()


def test_a_step_with_asynchronous_loads_submits_its_in_step_copies_upfront():
    """``adaptive`` past its budget: the asynchronous loads wait on the in-step copies, which must all
    exist when ``start_load_kv`` returns (else vLLM's thread would wait for a copy only it can submit)."""
    rt, kv, names, items = _step("pipelined", groups=4, mode="adaptive", async_load=True)
    try:
        rt.before_forward(layerwise_ok=True)
        assert not rt.in_step.busy  # every group submitted before the forward (CPU: nothing left to wait on)
        assert all(_layer_ok(rt, kv, names, items, li) for li in range(LAYERS))
        assert rt.stats()["async_loads"] == 1
        for name in names:
            rt.wait_layer(name)
        result = rt.poll()
        assert all(result.reports[j.job_id].ok == [True] for j, _, _ in items)
    finally:
        rt.close()


@pytest.mark.parametrize("ahead,want", [(GROUP, LAYERS), (2 * GROUP, 4)], ids=["groups-of-4KiB", "groups-of-8KiB"])
def test_auto_groups_pipelined(ahead, want):
    """Past ``load_ahead_bytes``, a copy (32 KiB here) is cut into groups of about half of it, at most one per layer."""
    rt, kv, names, items = _step("pipelined", groups=0, ahead=ahead)
    try:
        rt.before_forward(layerwise_ok=True)
        for name in names:
            rt.wait_layer(name)
        rt.poll()
        assert rt.stats()["sync_load_groups"] == want
    finally:
        rt.close()


def test_load_submit_keys():
    assert ConnectorConfig().load_submit == "pipelined" and ConnectorConfig().load_ahead_bytes == 256 << 20
    assert ConnectorConfig(load_submit="upfront", load_ahead_bytes="1GiB").load_ahead_bytes == 1 << 30
    with pytest.raises(ConfigError, match="load_submit: unknown value 'lazy'"):
        ConnectorConfig(load_submit="lazy")
    with pytest.raises(ConfigError, match="load_ahead_bytes: must be > 0"):
        ConnectorConfig(load_ahead_bytes=0)


def test_the_trace_records_the_time_spent_submitting_between_layers(tmp_path):
    rt, kv, names, items = _step("pipelined", groups=4, ahead=1, trace_path=str(tmp_path / "t"))
    try:
        rt.before_forward(layerwise_ok=True)
        for name in names:
            rt.wait_layer(name)
        rt.poll()
    finally:
        rt.close()
    lines = [json.loads(x) for x in open(tmp_path / "t.rank0.jsonl")]
    step = lines[0]["in_step"]
    assert len(lines) == 1 and {k: step[k] for k in ("loads", "bytes", "staged", "sm", "staging_allocs")} == {
        "loads": 2, "bytes": 4 * GROUP, "staged": 0, "sm": 0, "staging_allocs": 0}
    assert lines[0]["front_jobs"] == 0  # no store queued on the front mover when start_load_kv began
    # one copy-engine run per layer and block: a CPU slot holds a block's layers together, so no two of one
    # layer's blocks are adjacent on the CPU side, however vLLM's blocks lie
    assert step["descriptors"] == LAYERS * len(items) * K
    assert lines[0]["forward_submit_ms"] > 0 and lines[0]["start_load_ms"] > 0


@pytest.mark.parametrize("buffers", [1, 2])
def test_the_trace_counts_staged_copies(tmp_path, buffers):
    """Staged in-step copies, layer group by group; with ``load_staging_buffers: 2`` and a 4 KiB cap each group
    goes in pieces that alternate the two halves (the bytes are checked layer by layer all the same)."""
    rt, kv, names, items = _step("pipelined", groups=4, ahead=1, trace_path=str(tmp_path / "t"), in_step_copy="staged",
                                 load_staging_buffers=buffers, load_staging_bytes=4096)
    if buffers == 2:
        loader = rt.in_step.copiers[0]._staged_loader()
        n = sum(len(g) for _, _, g in items)
        assert loader.plan(n, [(0, 2), (2, 4)])[0] == 2  # this load is cut in pieces over two halves
    try:
        rt.before_forward(layerwise_ok=True)
        for li, name in enumerate(names):
            rt.wait_layer(name)
            assert _layer_ok(rt, kv, names, items, li), f"layer {li} read before its staged group landed"
        rt.poll()
        assert rt.stats()["sync_staged_copies"] == 1  # the step's two loads, merged: one copy (one KV cache group)
    finally:
        rt.close()
    lines = [json.loads(x) for x in open(tmp_path / "t.rank0.jsonl")]
    assert len(lines) == 1 and lines[0]["in_step"]["staged"] == 1
    # the step's first staged load allocated the staging buffer (inside the step); the copier counted it
    allocs = rt.in_step.copiers[0].staging_allocations()
    assert allocs >= 1 and lines[0]["in_step"]["staging_allocs"] == allocs


def test_finish_copies_loads_that_were_started_but_never_submitted():
    """``start`` without ``submit`` (a caller that never reached the step's submission): ``finish`` submits
    them as one piece before it waits, so every layer holds its bytes and every load reports success."""
    rt, kv, names, items = _step("pipelined", groups=4, ahead=1)
    try:
        loader = rt.in_step
        for job, slot, gpu in items:
            loader.start(job, rt.runner.flat(job, job.src_slots))
        assert not any(_loaded(rt, kv, names, items)) and not loader.busy  # nothing copied yet
        done = loader.finish()
        assert sorted(job.job_id for job, _ in done) == sorted(job.job_id for job, _, _ in items)
        assert all(c.ok == [True] for _, c in done)
        assert _loaded(rt, kv, names, items) == [True] * LAYERS
        assert not loader.loads and not loader.busy
    finally:
        rt.close()


def test_auto_stages_the_copies_its_rule_picks(monkeypatch):
    """``in_step_copy: auto`` (default) takes ``auto_copy``'s choice per copy. On CPU tensors the rule never
    stages (no descriptor cost), so here it is made to decide as on CUDA: these 8-layer, 256 B layer-blocks
    are descriptor-bound, so the merged copy goes through the staging buffer, layer group by layer group."""
    import tiered_kv.connector.vllm.in_step as in_step_mod

    calls = []

    def as_on_cuda(kv, blocks, runs=None, small_step=False, staged_min=in_step_mod.AUTO_STAGED_STEP_DESCRIPTORS):
        calls.append((blocks, runs))
        return in_step_mod.auto_rule(kv, blocks, runs, small_step, staged_min)

    monkeypatch.setattr(in_step_mod, "auto_copy", as_on_cuda)
    rt, kv, names, items = _step("pipelined", groups=4, ahead=GROUP)
    try:
        rt.before_forward(layerwise_ok=True)
        assert _loaded(rt, kv, names, items) == [True] * 2 + [False] * 6  # pipelined as before: one group ahead
        for li, name in enumerate(names):
            rt.wait_layer(name)
            assert _layer_ok(rt, kv, names, items, li), f"layer {li} read before its staged group landed"
        rt.poll()
        assert rt.stats()["sync_staged_copies"] == 1
        assert calls == [(2 * K, LAYERS)]  # one decision per merged copy: both loads' blocks, 8 runs a block
    finally:
        rt.close()
