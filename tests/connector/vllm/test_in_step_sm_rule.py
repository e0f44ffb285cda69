"""``in_step_copy: auto``'s SM-kernel rule: a large in-step copy in a step with few tokens goes through the SM kernel.

The rule itself (``auto_rule``) is pure arithmetic on the copy's descriptors; the step's token count comes from
vLLM's own ``SchedulerOutput`` through the plan (``StepPlan.tokens``), checked here on vLLM's real Scheduler. The
SM kernel itself needs CUDA and Triton: its copies are checked bit for bit in tests/gpu/test_vllm_worker_gpu.py.
"""
from __future__ import annotations

import pytest
import torch

from tiered_kv.connector.vllm.config import ConnectorConfig
from tiered_kv.connector.vllm.in_step import (AUTO_SM_MIN_DESCRIPTORS, AUTO_STAGED_MIN_DESCRIPTORS,
                                              AUTO_STAGED_STEP_DESCRIPTORS, auto_copy, auto_rule)
from tiered_kv.copy import BlockCopier, KVLayout, Mechanism
from tiered_kv.errors import ConfigError

BS = 16


def _layout(heads: int, layers: int = 32) -> KVLayout:
    return KVLayout(tuple(torch.zeros((4, heads, BS, 2 * 128), dtype=torch.bfloat16) for _ in range(layers)))


def test_the_rule_sends_large_copies_of_small_steps_to_the_sm_kernel():
    """64 KiB layer-blocks (8 KV heads), 32 layers: 32 descriptors a block on the copy engine."""
    kv = _layout(8)
    edge = AUTO_SM_MIN_DESCRIPTORS // 32  # 128 blocks: 4,096 descriptors, 256 MiB of 64 KiB layer-blocks
    assert kv.block_nbytes == 32 * (64 << 10) and edge * kv.block_nbytes == 256 << 20
    assert auto_rule(kv, edge, small_step=True) is Mechanism.SM_KERNEL
    assert auto_rule(kv, edge - 1, small_step=True) is None  # too few descriptors to be worth the SMs
    assert auto_rule(kv, edge, small_step=False) is None  # a large step keeps the SMs for its forward
    assert auto_rule(kv, 255, small_step=False) is None
    assert auto_rule(kv, 256, small_step=False) is Mechanism.STAGED  # ... and stages 8,192 descriptors (below)
    # a step of very many descriptors stays staged, small step or not (the rule measured under load)
    many = AUTO_STAGED_MIN_DESCRIPTORS // 32
    assert auto_rule(kv, many, small_step=True) is Mechanism.STAGED
    # small layer-blocks (4 KV heads: 32 KiB) stay staged too
    assert auto_rule(_layout(4), edge, small_step=True) is Mechanism.STAGED
    # a cross-layer tensor: one run a block, so a 1 GiB copy is 512 descriptors: the copy engine
    whole = torch.zeros((4, 32, 8, BS, 2 * 128), dtype=torch.bfloat16)
    cross = KVLayout(tuple(whole[:, i] for i in range(32)))
    assert auto_rule(cross, 512, small_step=True) is None
    assert auto_copy(kv, edge, small_step=True) is None  # CPU tensors: the copier's own path, always


def test_large_steps_stage_copies_of_many_descriptors():
    """``in_step_staged_min_descriptors`` (default 8,192): a copy of that many descriptors the SM rule leaves is staged;
    below it, or with the key 0, the copy engine's (the fixed 32,768 rule still stages, key or not)."""
    kv = _layout(8)  # 32 descriptors a block
    assert ConnectorConfig().in_step_staged_min_descriptors == AUTO_STAGED_STEP_DESCRIPTORS == 8192
    edge = AUTO_STAGED_STEP_DESCRIPTORS // 32  # 256 blocks: 512 MiB of 64 KiB layer-blocks
    assert auto_rule(kv, edge) is Mechanism.STAGED and auto_rule(kv, edge - 1) is None
    assert auto_rule(kv, 574) is Mechanism.STAGED  # round 23's c8 wave: 7 loads x 82 blocks, 18,368 descriptors
    # round 26: waves of 4-6 loads (9.2k-15.7k descriptors) sat under the old 16,384 on the copy engine
    assert auto_rule(kv, 4 * 82) is Mechanism.STAGED and auto_rule(kv, 4 * 82, staged_min=16384) is None
    assert auto_rule(kv, 82) is None and auto_rule(kv, 2 * 82) is None  # one or two loads: the copy engine
    assert auto_rule(kv, 574, staged_min=0) is None and auto_rule(kv, 574, staged_min=20000) is None
    assert auto_rule(kv, AUTO_STAGED_MIN_DESCRIPTORS // 32, staged_min=0) is Mechanism.STAGED
    # a small step keeps the SM kernel for these (the measured turn-2 load: 16,384 descriptors, 66 new tokens)
    assert auto_rule(kv, edge, small_step=True) is Mechanism.SM_KERNEL
    assert auto_rule(kv, 512, small_step=True) is Mechanism.SM_KERNEL
    assert auto_copy(kv, edge) is None  # CPU tensors: the copier's own path, always
    with pytest.raises(ConfigError, match="in_step_staged_min_descriptors: expected an int >= 0, got -1"):
        ConnectorConfig(in_step_staged_min_descriptors=-1)


def test_the_key_and_its_errors():
    assert ConnectorConfig().in_step_sm_max_tokens == 512
    assert ConnectorConfig(in_step_sm_max_tokens=0).in_step_sm_max_tokens == 0
    with pytest.raises(ConfigError, match="in_step_sm_max_tokens: expected an int >= 0, got -1"):
        ConnectorConfig(in_step_sm_max_tokens=-1)


@pytest.mark.parametrize("max_tokens,small", [(64, True), (32, False), (0, False)])
def test_the_step_tokens_come_from_vllms_scheduler(tmp_path, monkeypatch, max_tokens, small):
    """Turn 2 on vLLM's real Scheduler: 175 prompt tokens, 128 of them loaded in-step, so the step computes 47.
    The worker hands the rule the small-step flag from the plan's token count and `in_step_staged_min_descriptors`
    (the SM kernel is made to look available: on CPU tensors it never is, and the copy then goes the copier's way,
    bit-exact as the harness checks)."""
    pytest.importorskip("vllm")
    import tiered_kv.connector.vllm.in_step as in_step_mod
    from tests.connector.vllm.harness import Engine, write_model_dir

    seen, tokens = [], []
    real_submit = in_step_mod.InStepLoader.submit

    def submit(self, layerwise_ok, mechanism, pipelined=True, step_tokens=None):
        tokens.append(step_tokens)
        return real_submit(self, layerwise_ok, mechanism, pipelined, step_tokens)

    mins = []

    def rule(kv, blocks, runs=None, small_step=False, staged_min=0):
        seen.append(small_step)
        mins.append(staged_min)  # the key's value reaches the rule
        return None

    monkeypatch.setattr(in_step_mod.InStepLoader, "submit", submit)
    monkeypatch.setattr(in_step_mod, "auto_copy", rule)
    monkeypatch.setattr(BlockCopier, "sm_kernel_available", lambda self: True)
    eng = Engine.create(write_model_dir(str(tmp_path)), {"chunk_blocks": 4, "cpu_bytes": 64 * 4 * 4096,
                                                         "in_step_sm_max_tokens": max_tokens,
                                                         "in_step_staged_min_descriptors": max_tokens * 100})
    try:
        first_prompt = [100 + (i * 31) % 800 for i in range(8 * BS + 4)]
        a = eng.add("t1", first_prompt, max_tokens=3)
        eng.run()
        eng.settle()
        assert eng.sched.reset_prefix_cache()
        verified = eng.verified_blocks
        b = eng.add("t2", list(a.prompt_token_ids) + list(a.output_token_ids) + [300 + i for i in range(40)],
                    max_tokens=2)
        eng.run()
        eng.settle()
        assert b.is_finished() and eng.verified_blocks - verified >= 8
        assert eng.workers[0].connector.worker.stats()["sync_loads"] == 1
        assert tokens == [175 - 8 * BS]  # the one step with an in-step load computed the prompt's unloaded tail
        assert seen == [small] and mins == [max_tokens * 100]
    finally:
        eng.close()
