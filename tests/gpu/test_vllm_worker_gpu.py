"""The vLLM worker's in-step loads on CUDA: per-layer events, the engine stream waits per layer.

Runs ``tests/connector/vllm/test_worker_in_step.run_in_step_load`` on CUDA tensors and a pinned slab,
with the engine's stream kept busy before the load starts: a layer read without waiting for its
event would see zeros, not the slab's bytes. Sizes make the load cut into several layer groups.
"""
from __future__ import annotations

import pytest

from tests.connector.vllm.test_worker_in_step import run_in_step_load
from tiered_kv.connector.vllm.in_step import AUTO_SM_MIN_DESCRIPTORS, MAX_AUTO_GROUPS, MIN_GROUP_BYTES


@pytest.mark.parametrize("load_submit", ["pipelined", "upfront"])
@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "whole"])
def test_in_step_load_layer_by_layer_on_cuda(layerwise, load_submit):
    # 8 layers x 8 heads x 128 dims: 512 KiB a block; 96 chunks of 4 blocks (one held locally) = 191.5 MiB.
    # pipelined with 64 MiB ahead: groups after the first are submitted from wait_layer, ordered only
    # behind the first (which waited for the busy stream): a layer read before its group landed sees zeros
    stats = run_in_step_load("cuda", layers=8, heads=8, head_dim=128, chunks=96, layerwise=layerwise,
                             slow_stream=True, load_submit=load_submit, load_ahead_bytes="64MiB")
    assert stats["sync_loads"] == 1 and stats["failed_items"] == 0
    nbytes = (96 * 4 - 1) * 8 * 8 * 16 * 256 * 2
    assert stats["bytes_loaded"] == nbytes
    # layer by layer: pipelined, groups of <= 32 MiB (half of load_ahead_bytes): 6 wanted, 4 of 2 layers;
    # upfront, MAX_AUTO_GROUPS (the load is >= 4 x MIN_GROUP_BYTES); whole: one group, merged runs
    assert nbytes // MIN_GROUP_BYTES == 5
    want = (4 if load_submit == "pipelined" else MAX_AUTO_GROUPS) if layerwise else 1
    assert stats["sync_load_groups"] == want
    # in_step_copy auto (default): 64 KiB layer-blocks, 3,064 descriptors: the copy engine, not staged
    assert stats["sync_staged_copies"] == 0


@pytest.mark.parametrize("cross_layer", [False, True], ids=["per-layer", "cross-layer"])
@pytest.mark.parametrize("groups", [0, 11], ids=["auto", "11-groups"])
@pytest.mark.parametrize("copy", ["copy_engine", "sm_kernel", "staged", "auto"])
def test_in_step_load_groups_on_cuda(cross_layer, groups, copy):
    # 32 layers x 2 heads x 128 dims: 512 KiB a block; 192 chunks of 4 blocks (one held locally) = 383.5 MiB
    stats = run_in_step_load("cuda", layers=32, heads=2, head_dim=128, chunks=192, layerwise=True,
                             slow_stream=True, cross_layer=cross_layer, load_groups=groups, in_step_copy=copy)
    nbytes = (192 * 4 - 1) * 32 * 2 * 16 * 256 * 2
    assert stats["bytes_loaded"] == nbytes and nbytes // MIN_GROUP_BYTES == 11
    # load_submit pipelined, 383.5 MiB > load_ahead_bytes (256 MiB): groups of <= 128 MiB, 3 of 11/11/10 layers
    assert stats["sync_load_groups"] == (groups or 3)
    # auto: 16 KiB layer-blocks (2 heads) are descriptor-bound on the copy engine: staged; a cross-layer
    # tensor's block is one 512 KiB run: the copy engine
    assert stats["sync_staged_copies"] == (1 if copy == "staged" or (copy == "auto" and not cross_layer) else 0)


@pytest.mark.parametrize("step_tokens", [66, 4096, None], ids=["small-step", "large-step", "unknown"])
def test_auto_takes_the_sm_kernel_for_a_large_copy_in_a_small_step(step_tokens):
    # 32 layers x 8 heads x 128 dims: 64 KiB layer-blocks; 40 chunks of 4 blocks (one held locally): 159 blocks,
    # 5,088 descriptors on the copy engine (>= AUTO_SM_MIN_DESCRIPTORS), 318 MiB: past load_ahead_bytes, so the
    # SM kernel's later layer groups are submitted from wait_layer, each read checked against the slab
    stats = run_in_step_load("cuda", layers=32, heads=8, head_dim=128, chunks=40, layerwise=True,
                             slow_stream=True, step_tokens=step_tokens)
    assert 159 * 32 >= AUTO_SM_MIN_DESCRIPTORS
    assert stats["sync_loads"] == 1 and stats["failed_items"] == 0
    assert stats["bytes_loaded"] == 159 * 32 * 8 * 16 * 256 * 2
    assert stats["sync_sm_copies"] == (1 if step_tokens == 66 else 0)
    assert stats["sync_staged_copies"] == 0
