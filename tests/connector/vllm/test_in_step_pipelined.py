"""``load_submit``: a step's in-step loads merged into one copy, layer group by layer group, and
(pipelined) the later groups submitted between the forward's layers, not before it.

On CPU tensors every copy is synchronous, so the schedule is visible in the KV tensors themselves:
a layer whose group has not been submitted still holds zeros. The same schedule on CUDA is checked
for ordering by ``tests/gpu/test_vllm_worker_gpu.py`` (a layer read before its bytes landed fails).
"""
from __future__ import annotations

import pytest
import torch

from tiered_kv.connector.vllm.config import ConnectorConfig
from tiered_kv.connector.vllm.in_step import MAX_AUTO_GROUPS_PIPELINED, layer_groups
from tiered_kv.connector.vllm.scheduler import CPU, StepPlan
from tiered_kv.errors import ConfigError
from tiered_kv.values.jobs import EXT, JobKind, TransferJob

from tests.connector.vllm.test_worker_in_step import K, make_runtime

LAYERS = 8


def _step(load_submit: str, groups: int = 4, loads: int = 2, mode: str = "layerwise", async_load: bool = False):
    """A runtime with ``loads`` in-step loads of one chunk each planned for one step (and, with
    ``async_load``, one asynchronous load of another request); returns
    (runtime, kv tensors, layer names, [(job, slot, gpu blocks)] of the in-step loads)."""
    rt, kv, names = make_runtime("cpu", layers=LAYERS, heads=1, head_dim=8, num_blocks=K * (loads + 1) + 2,
                                 cpu_chunks=loads + 2, load_mode=mode, load_groups=groups, load_submit=load_submit)
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


def test_pipelined_submits_later_groups_between_layers_and_every_layer_reads_its_bytes():
    rt, kv, names, items = _step("pipelined", groups=4)
    try:
        rt.before_forward(layerwise_ok=True)
        # before the forward: only the first layer group (layers 0-1) of *both* loads is in
        assert [_layer_ok(rt, kv, names, items, li) for li in range(LAYERS)] == [True] * 2 + [False] * 6
        for li, name in enumerate(names):
            assert _layer_ok(rt, kv, names, items, li), f"layer {li} read before its group was submitted"
            rt.wait_layer(name)  # the last layer of a group submits the next one
            if li == 1:
                assert _layer_ok(rt, kv, names, items, 2) and not _layer_ok(rt, kv, names, items, 4)
        result = rt.poll()
        assert all(result.reports[j.job_id].ok == [True] for j, _, _ in items)
        stats = rt.stats()
        assert stats["sync_loads"] == 2 and stats["sync_load_groups"] == 4  # one merged copy, 4 groups
        assert rt.in_step is not None and not rt.in_step.busy and rt.idle()
    finally:
        rt.close()


def test_upfront_submits_every_group_before_the_forward():
    rt, kv, names, items = _step("upfront", groups=4)
    try:
        rt.before_forward(layerwise_ok=True)
        assert all(_layer_ok(rt, kv, names, items, li) for li in range(LAYERS))
        for name in names:
            rt.wait_layer(name)
        assert all(r.ok == [True] for r in rt.poll().reports.values())
    finally:
        rt.close()


def test_without_per_layer_waits_the_load_goes_whole_before_the_forward():
    """A full CUDA graph may replay (``layerwise_ok`` False): nothing may be left for ``wait_layer``."""
    rt, kv, names, items = _step("pipelined", groups=4)
    try:
        rt.before_forward(layerwise_ok=False)
        assert all(_layer_ok(rt, kv, names, items, li) for li in range(LAYERS))
        assert not rt.in_step.busy
        assert all(r.ok == [True] for r in rt.poll().reports.values())
        assert rt.stats()["sync_load_groups"] == 1
    finally:
        rt.close()


def test_a_skipped_layer_wait_still_submits_its_group_before_the_layer_and_finish_submits_the_rest():
    rt, kv, names, items = _step("pipelined", groups=4)
    try:
        rt.before_forward(layerwise_ok=True)
        rt.wait_layer(names[4])  # layers 0-3 never waited (their triggers skipped): layer 4's group goes now
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


def test_auto_groups_pipelined_and_the_key():
    rt, _, _ = make_runtime("cpu", layers=32, heads=1, head_dim=8, num_blocks=4, cpu_chunks=1)
    try:
        big = 1000 * (32 << 20)
        assert len(layer_groups(rt.kv, big, most=MAX_AUTO_GROUPS_PIPELINED)) == MAX_AUTO_GROUPS_PIPELINED
        assert layer_groups(rt.kv, 3 * (32 << 20), most=MAX_AUTO_GROUPS_PIPELINED) == [(0, 11), (11, 22), (22, 32)]
    finally:
        rt.close()
    assert ConnectorConfig().load_submit == "pipelined"
    assert ConnectorConfig(load_submit="upfront").load_submit == "upfront"
    with pytest.raises(ConfigError, match="load_submit: unknown value 'lazy'"):
        ConnectorConfig(load_submit="lazy")
