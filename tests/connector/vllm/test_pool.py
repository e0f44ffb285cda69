"""Issue 33: vLLM replicas on one host pool (``cpu_pool: "host:<name>"``), on vLLM's real Scheduler.

Two engines in this process stand for two replicas (each its own scheduler, its own worker, its own connector
on both sides); they share one pool in the real ``/dev/shm``. The harness checks before every forward that each
block a request reads holds exactly the KV of its tokens, so a wrong byte from the pool fails the test there.
"""
from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from tests._pool import assert_gone, pool_path, pool_spec  # noqa: E402
from tests.connector.vllm.harness import BS, Engine, Gate, write_model_dir  # noqa: E402
from tests.connector.vllm.models import write_model_dir as write_shaped_dir  # noqa: E402
from tiered_kv.connector.vllm.config import pool_store_config  # noqa: E402
from tiered_kv.errors import ConfigError  # noqa: E402
from tiered_kv.store.tiered_store import TieredStore  # noqa: E402

BLOCK_BYTES = 4096  # 2 layers x 2 heads x 16 tokens x 32 values x 2 bytes
K = 4  # blocks per chunk
CHUNK_BYTES = K * BLOCK_BYTES


def cfg(spec: str, chunks: int = 64, **kw) -> dict:
    return {"chunk_blocks": K, "cpu_bytes": chunks * CHUNK_BYTES, "cpu_pool": spec, **kw}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(str(tmp_path_factory.mktemp("tiny-llama")))


def prompt(seed: int, n: int) -> list[int]:
    return [100 + (seed * 7919 + i * 31) % 800 for i in range(n)]


def turn2(first) -> list[int]:
    return list(first.prompt_token_ids) + list(first.output_token_ids) + prompt(99, 40)


def serve(eng: Engine, rid: str, tokens: list[int], max_tokens: int = 2):
    req = eng.add(rid, tokens, max_tokens=max_tokens)
    eng.run()
    eng.settle()
    return req


def wait_for(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def watch(eng: Engine):
    return eng.connector._pool  # the scheduler's PoolWatch


def assert_settled(eng: Engine) -> None:
    st = eng.connector.stats()
    assert st["inflight_jobs"] == 0 and st["pinned"] == 0 and st["waiting"] == 0, st
    assert st["gpu_blocks_busy"] == 0 and st["tracked_requests"] == 0, st
    ws = eng.workers[0].connector.stats()
    assert ws["jobs_unreported"] == 0 and ws["loads_pending_requests"] == 0, ws
    assert not eng.workers[0].connector.worker.pool._leases  # every lease released
    chain = eng.connector.planner.chain
    assert chain.used[0] == chain.resident(0)


def leases(eng: Engine) -> int:
    return eng.workers[0].connector.worker.cpu.usage()["leases"]


@pytest.mark.parametrize("load_mode", ["layerwise", "async"])
@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async"])
def test_replica_b_hits_bit_exact_what_replica_a_stored(model_dir, load_mode, async_sched):
    """A conversation's turn 1 on replica A, its turn 2 on replica B: B loads A's chunks from the pool (in the
    step vLLM schedules it with ``layerwise``), every byte checked; the pool's memory exists once."""
    spec = pool_spec("vllm-ab")
    a = Engine.create(model_dir, cfg(spec, load_mode=load_mode), async_sched=async_sched)
    b = Engine.create(model_dir, cfg(spec, load_mode=load_mode), async_sched=async_sched)
    try:
        first = serve(a, "conv-turn1", prompt(1, 8 * BS + 4), max_tokens=3)
        assert a.connector.stats()["resident_cpu"] == 2  # the prompt's two whole chunks, in the pool
        wait_for(lambda: watch(b).pending(), "replica B's watch to see A's chunks")
        verified = b.verified_blocks
        sync_steps = b.sync_steps
        second = serve(b, "conv-turn2", turn2(first))
        st = b.connector.stats()
        assert st["sched_pool_adopted"] == 2, st  # A's chunks, adopted as CPU copies
        assert st["sched_hit_tokens_cpu"] == 8 * BS, st
        assert st["sched_sync_loads"] == (1 if load_mode == "layerwise" else 0), st
        assert (b.sync_steps > sync_steps) is (load_mode == "layerwise")
        assert b.verified_blocks - verified >= 8 and second.is_finished()
        ws = b.workers[0].connector.stats()
        assert ws["bytes_loaded"] == 8 * BLOCK_BYTES and ws["pool_load_misses"] == 0, ws
        assert ws["bytes_stored"] == 2 * BLOCK_BYTES, ws  # only B's own tail piece: A's chunks were not stored again
        for eng in (a, b):
            assert_settled(eng)
        assert leases(a) == 0
        pa, pb = (e.workers[0].connector.worker.cpu for e in (a, b))
        assert pa.path == pb.path == pool_path(spec)  # one pool, mapped by both
        assert (pool_path(spec) / "payload").stat().st_size == 64 * CHUNK_BYTES
    finally:
        a.close()
        b.close()
    assert_gone(spec)
