"""MLA (DeepSeek-V2-like latent KV) through vLLM's real Scheduler: stored once for all TP ranks.

Every TP rank holds the same latent bytes, so with ``mla_store_once`` (default) rank 0 alone
copies a store into one shared-memory CPU slab and one disk directory, and every rank loads
from them into its own GPU. The harness simulates the ranks in one process (each its own KV
tensors, its own worker connector) and checks every rank's loaded blocks byte for byte.
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("vllm")

from tests.connector.vllm import models  # noqa: E402
from tests.connector.vllm.harness import BS, Engine  # noqa: E402
from tests.connector.vllm.test_hybrid import assert_clean, patient_fences, prompt, turn2  # noqa: E402,F401

K = 4
LAYERS = 3
BLOCK_BYTES = LAYERS * BS * 576 * 2  # one latent of 512 + 64 per token, bf16
CHUNK_BYTES = K * BLOCK_BYTES


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return models.write_model_dir(str(tmp_path_factory.mktemp("dsv2")), "dsv2")


def make(model_dir, tp: int, **extra) -> Engine:
    return Engine.create(model_dir, {"chunk_blocks": K, "cpu_bytes": 8 * CHUNK_BYTES, **extra}, shape="dsv2",
                         tp=tp, num_blocks=96, max_model_len=512, max_batched=64)


@pytest.mark.parametrize("in_step_copy", ["copy_engine", "staged"])
def test_tp2_stores_once_and_every_rank_loads_it_bit_exact(model_dir, in_step_copy):
    eng = make(model_dir, 2, in_step_copy=in_step_copy)
    try:
        conn = eng.connector
        assert conn.geo.replicated and conn.geo.chunk_nbytes == CHUNK_BYTES  # one copy, not one per rank
        assert ("tp", "replicated") in conn.ns.extra
        assert conn.planner.chain.specs[0].capacity == 8  # cpu_bytes buys 8 chunks, not 4 per rank
        w0, w1 = (w.connector.worker for w in eng.workers)
        a = eng.add("t1", prompt(1, 12 * BS + 5), max_tokens=3)
        eng.run()
        eng.settle()
        assert not os.path.exists(w0.cpu.path)  # every rank mapped it: the name is gone, the memory stays
        s0, s1 = w0.stats(), w1.stats()
        # two mappings of the same pages: rank 1 never copied a byte, yet its slab holds rank 0's stores
        assert w0.cpu.slab.data_ptr() != w1.cpu.slab.data_ptr()
        assert torch.count_nonzero(w1.cpu.slab) > 0 and torch.equal(w0.cpu.slab, w1.cpu.slab)
        assert s0["bytes_stored"] == 3 * CHUNK_BYTES and s1["bytes_stored"] == 0, (s0, s1)  # stored once
        assert s1["acked_for_rank0"] >= 1
        assert conn.stats()["sched_bytes_stored"] == 3 * CHUNK_BYTES
        assert eng.sched.reset_prefix_cache()
        verified = eng.verified_blocks
        eng.add("t2", turn2(a), max_tokens=2)
        eng.run()
        eng.settle()
        assert conn.stats()["sched_hit_tokens_cpu"] == 12 * BS
        assert eng.verified_blocks - verified >= 2 * 12  # both ranks' loaded blocks checked
        for w in (w0, w1):
            assert w.stats()["bytes_loaded"] == 3 * CHUNK_BYTES
            assert (w.in_step.copiers[0]._staged is not None) == (in_step_copy == "staged")
        assert_clean(eng)
    finally:
        eng.close()


def test_tp2_disk_tier_is_one_directory_read_by_every_rank_and_survives_restart(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    extra = dict(cpu_bytes=2 * CHUNK_BYTES, disk_path=str(tmp_path / "kv"), disk_bytes="16MiB",
                 write_policy="write_through", disk_load_policy="always")
    first = make(model_dir, 2, **extra)
    try:
        a = first.add("big", prompt(2, 20 * BS + 5), max_tokens=2)
        first.run()
        first.settle()
        paths = {str(w.connector.worker.disk.path) for w in first.workers}
        assert len(paths) == 1 and paths.pop().endswith("/replicated")
        assert first.workers[1].connector.stats()["bytes_to_disk"] == 0  # rank 0 wrote the one copy
        rank0 = first.workers[0].connector.stats()["bytes_to_disk"]
        # the scheduler's view (vLLM sums the ranks' flow stats): what a TP=1 engine writes, not twice that
        assert rank0 >= 5 * CHUNK_BYTES and first.connector.stats()["workers_bytes_to_disk"] == rank0
        assert first.sched.reset_prefix_cache()
        verified = first.verified_blocks
        first.add("big-2", turn2(a), max_tokens=2)
        first.run()
        first.settle()
        st = first.connector.stats()
        assert st["sched_hit_tokens_disk"] > 0 and st["sched_hit_tokens_cpu"] + st["sched_hit_tokens_disk"] == 20 * BS
        assert all(w.connector.stats()["bytes_from_disk"] > 0 for w in first.workers)  # each rank read it
        # the split's disk rate counts one copy of what it read (the gate prices one copy), not every rank's
        disk = first.connector.planner._gate.rates["disk"]
        one_copy = st["sched_hit_tokens_disk"] // BS // K * CHUNK_BYTES
        assert disk.reads >= 1 and 0 < disk.largest <= one_copy, (disk.largest, one_copy)
        assert first.verified_blocks - verified >= 2 * 20
        assert_clean(first)
        conv = turn2(a, seed=98)
    finally:
        first.close()
    second = make(model_dir, 2, **extra)  # a new engine on the same disk path
    try:
        assert second.connector.stats()["resident_disk"] == 6  # 5 chunks + the tail piece turn 2 stored
        second.add("again", conv, max_tokens=2)
        second.run()
        second.settle()
        st = second.connector.stats()
        assert st["sched_hit_tokens_cpu"] + st["sched_hit_tokens_disk"] == 20 * BS, st
        assert_clean(second)
    finally:
        second.close()


def test_tp1_mla_keeps_the_single_group_geometry(model_dir):
    eng = make(model_dir, 1)
    try:
        geo = eng.connector.geo
        assert not geo.replicated and geo.tag.startswith("vllm|MLAAttentionSpec|")
        assert ("tp", "1") in eng.connector.ns.extra
    finally:
        eng.close()


def test_store_once_off_keeps_one_copy_per_rank(model_dir):
    eng = make(model_dir, 2, mla_store_once=False)
    try:
        assert not eng.connector.geo.replicated
        a = eng.add("t1", prompt(3, 8 * BS + 1), max_tokens=2)
        eng.run()
        eng.settle()
        assert all(w.connector.stats()["bytes_stored"] == 2 * CHUNK_BYTES for w in eng.workers)
        assert eng.sched.reset_prefix_cache()
        eng.add("t2", turn2(a), max_tokens=2)
        eng.run()
        eng.settle()
        assert eng.connector.stats()["sched_hit_tokens_cpu"] == 8 * BS
        assert_clean(eng)
    finally:
        eng.close()
