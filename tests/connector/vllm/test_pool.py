"""Issue 33: vLLM replicas on one host pool (``cpu_pool: "host:<name>"``), on vLLM's real Scheduler.

Two engines in this process stand for two replicas (each its own scheduler, its own worker, its own connector
on both sides); they share one pool in the real ``/dev/shm``. The harness checks before every forward that each
block a request reads holds exactly the KV of its tokens, so a wrong byte from the pool fails the test there.
"""
from __future__ import annotations

import contextlib
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


@pytest.fixture(autouse=True)
def patient_fences(monkeypatch):
    """Every store here should land: give a queued store a second to start before a fence cancels it (as
    test_hybrid.py does; cancelling is tested elsewhere)."""
    import tiered_kv.connector.vllm.worker as worker

    monkeypatch.setattr(worker, "FENCE_PATIENCE_S", 1.0)


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


def chunk_keys(eng: Engine, req, n: int) -> list[bytes]:
    """The keys of the first ``n`` whole chunks of ``req`` (vLLM's hash at each chunk's last block, namespaced)."""
    return eng.connector.ns.keys(req.block_hashes[K - 1::K][:n])


def held_in_pool(eng: Engine, keys: list[bytes]) -> list[bool]:
    return eng.workers[0].connector.worker.cpu.has(keys)


def view(eng: Engine) -> set[bytes]:
    """The chunks the engine's planner lists in its CPU tier (the pool)."""
    return set(eng.connector.planner.chain.index.keys())


def pooled(eng: Engine) -> set[bytes]:
    """The chunks of the engine's namespace the pool holds."""
    return set(eng.workers[0].connector.worker.cpu.stored_keys())


def step_until(eng: Engine, cond, what: str, timeout: float = 10.0) -> None:
    """Idle engine steps (each takes what its pool watch found) until ``cond()``."""
    wait_for(lambda: (eng.step(), cond())[1], what, timeout)


@contextlib.contextmanager
def replicas(model_dir: str, tag: str, *engines: tuple[dict, dict]):
    """Engines on one new pool, each ``(cfg keys, Engine.create keys)``. Once the body ran through, each must have
    settled (nothing in flight, every lease released); once they closed, the pool must be gone."""
    spec = pool_spec(tag)
    made: list[Engine] = []
    try:
        for keys, create in engines:
            made.append(Engine.create(model_dir, cfg(spec, **keys), **create))
        yield spec, made
        for eng in made:
            assert_settled(eng)
    finally:
        for eng in made:
            eng.close()
    assert_gone(spec)


@pytest.mark.parametrize("load_mode", ["layerwise", "async"])
@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async"])
def test_replica_b_hits_bit_exact_what_replica_a_stored(model_dir, load_mode, async_sched):
    """A conversation's turn 1 on replica A, its turn 2 on replica B: B loads A's chunks from the pool (in the
    step vLLM schedules it with ``layerwise``), every byte checked; the pool's memory exists once."""
    one = ({"load_mode": load_mode}, {"async_sched": async_sched})
    with replicas(model_dir, "vllm-ab", one, one) as (spec, (a, b)):
        first = serve(a, "conv-turn1", prompt(1, 8 * BS + 4), max_tokens=3)
        assert a.connector.stats()["resident_cpu"] == 2  # the prompt's two whole chunks, in the pool
        theirs = chunk_keys(a, first, 2)
        step_until(b, lambda: all(k in b.connector.planner.chain.index for k in theirs), "B to adopt A's chunks")
        verified = b.verified_blocks
        second = serve(b, "conv-turn2", turn2(first))
        st = b.connector.stats()
        assert st["sched_pool_adopted"] == 2, st  # A's chunks, adopted as CPU copies
        assert st["sched_hit_tokens_cpu"] == 8 * BS, st
        assert st["sched_sync_loads"] == (1 if load_mode == "layerwise" else 0), st
        assert b.verified_blocks - verified >= 8 and second.is_finished()
        ws = b.workers[0].connector.stats()
        assert ws["bytes_loaded"] == 8 * BLOCK_BYTES and ws["pool_load_misses"] == 0, ws
        assert ws["sync_loads"] == (1 if load_mode == "layerwise" else 0), ws  # copied inside vLLM's step
        assert ws["bytes_stored"] == 2 * BLOCK_BYTES, ws  # only B's own tail piece: A's chunks were not stored again
        assert leases(a) == 0
        pa, pb = (e.workers[0].connector.worker.cpu for e in (a, b))
        assert pa.path == pb.path == pool_path(spec)  # one pool, mapped by both
        assert (pool_path(spec) / "payload").stat().st_size == 64 * CHUNK_BYTES


def test_one_budget_the_pool_evicts_a_replicas_chunks_and_its_planner_learns_it(model_dir):
    """Replicas of one model share one budget: B's stores evict A's oldest chunks from a full pool. B hears of those
    evictions in its store job's report, A through its pool watch: A's planner stops listing them, so its next
    turn misses them (a recompute, checked bit for bit) instead of planning a load of a chunk that is gone."""
    small = ({"chunks": 4}, {"max_batched": 64})  # 64 tokens a step: one chunk per store job
    with replicas(model_dir, "vllm-budget", small, small) as (_, (a, b)):
        first = serve(a, "a1", prompt(11, 12 * BS + 3))  # 3 chunks of the pool's 4
        mine = chunk_keys(a, first, 3)
        assert held_in_pool(a, mine) == [True] * 3
        serve(b, "b1", prompt(12, 12 * BS + 3))  # 3 more: 1 free slot, then A's 2 oldest go
        assert sum(held_in_pool(a, mine)) == 1
        for eng in (a, b):  # each planner's view becomes the pool's: B's 3 chunks and A's last one
            step_until(eng, lambda e=eng: view(e) == pooled(e), "the planner's view to match the pool")
        assert len(view(a)) == 4 and sum(k in view(a) for k in mine) == 1
        st = a.connector.stats()
        assert st["sched_pool_forgotten"] == 2 and st["sched_pool_adopted"] == 3, st
        verified = a.verified_blocks
        serve(a, "a2", turn2(first))
        assert a.verified_blocks > verified
        ws = a.workers[0].connector.stats()
        assert ws["failed_items"] == 0 and ws["pool_load_misses"] == 0, ws  # no load planned into a hole


@pytest.mark.parametrize("load_mode", ["layerwise", "async"])
def test_a_load_whose_chunks_another_replica_evicted_is_recomputed_not_served(model_dir, load_mode, monkeypatch):
    """A's planner still lists chunks B's stores evicted (its watch has not listed the pool since): the load's lease
    misses them, their GPU blocks are reported as load errors in the step that reads them (in-step) or with the
    load (asynchronous), vLLM recomputes them (checked bit for bit), and A's planner forgets them."""
    with replicas(model_dir, "vllm-stale", ({"chunks": 4, "load_mode": load_mode}, {"max_batched": 64}),
                  ({"chunks": 4}, {"max_batched": 64})) as (_, (a, b)):
        monkeypatch.setattr(watch(a), "_list_cost", 1e6)  # A's watch never lists the pool again: a stale view
        first = serve(a, "a1", prompt(21, 12 * BS + 3))
        mine = chunk_keys(a, first, 3)
        serve(b, "b1", prompt(22, 12 * BS + 3))  # evicts 2 of A's 3 chunks
        gone = 3 - sum(held_in_pool(a, mine))
        assert gone == 2 and all(k in a.connector.planner.chain.index for k in mine)
        assert a.sched.reset_prefix_cache()
        verified = a.verified_blocks
        second = serve(a, "a2", turn2(first))
        assert a.verified_blocks > verified and second.is_finished()
        ws = a.workers[0].connector.stats()
        assert ws["pool_load_misses"] == gone, ws
        st = a.connector.stats()
        assert st["cpu_vanished"] >= gone, st  # forgotten when the load reported them missing (and A's re-stores evict)
        assert [k in a.connector.planner.chain.index for k in mine] == held_in_pool(a, mine)


def test_a_lease_held_across_an_eviction_attempt_keeps_the_block(model_dir):
    """While A's asynchronous load holds its lease (its copy not landed: the worker's loader is gated), B's stores
    into the full pool cannot evict the leased chunks (they take what is free and the rest is refused); once the
    load lands, A's turn reads them bit-exact and the lease is gone."""
    with replicas(model_dir, "vllm-lease", ({"chunks": 4, "load_mode": "async"}, {"max_batched": 64}),
                  ({"chunks": 4}, {})) as (_, (a, b)):  # B: 256 tokens a step, 4 chunks in one store job
        first = serve(a, "a1", prompt(31, 8 * BS + 4))  # 2 chunks
        mine = chunk_keys(a, first, 2)
        assert a.sched.reset_prefix_cache()
        gate = Gate(a.workers[0].connector.worker)
        try:
            second = a.add("a2", turn2(first))
            a.run(until=lambda: gate.started >= 1)  # the load started: its lease is held until it is seen landed
            assert leases(a) == 2
            serve(b, "b1", prompt(32, 16 * BS + 3))  # 4 chunks in one store into 2 free slots: 2 stored, 2 refused
            assert held_in_pool(a, mine) == [True, True]
            wst = b.workers[0].connector.stats()
            assert wst["failed_items"] == 2, wst
        finally:
            gate.open()  # (a failed assertion must not leave A's close waiting on the gate)
        verified = a.verified_blocks
        a.run()
        a.settle()
        assert second.is_finished() and a.verified_blocks - verified >= 8
        assert a.connector.stats()["sched_hit_tokens_cpu"] == 8 * BS
        assert leases(a) == 0
        last = serve(b, "b2", prompt(33, 16 * BS + 3))  # the lease gone, A's chunks go for a store of 4
        assert held_in_pool(a, mine) == [False, False] and held_in_pool(b, chunk_keys(b, last, 4)) == [True] * 4


def test_an_engine_and_a_python_api_store_share_the_pool_bit_exact(model_dir):
    """A ``TieredStore`` opened with ``pool_store_config`` is in the engine's namespace: it reads the chunks replica A
    stored (equal to the bytes a private-CPU engine C made for the same tokens), and replica B hits, bit-exact,
    chunks the store put (C's bytes for another prompt)."""
    with replicas(model_dir, "vllm-api", ({}, {}), ({}, {})) as (_, (a, b)), contextlib.ExitStack() as stack:
        c = Engine.create(model_dir, {"chunk_blocks": K, "cpu_bytes": 64 * CHUNK_BYTES})  # a private CPU tier
        stack.callback(c.close)
        assert c.connector.ns == a.connector.ns  # cpu_pool is no part of the namespace
        on_a = serve(a, "p", prompt(41, 8 * BS + 4))
        on_c, q_c = serve(c, "p", prompt(41, 8 * BS + 4)), serve(c, "q", prompt(42, 8 * BS + 4))

        def rows_of(req) -> torch.Tensor:  # C's CPU slab rows of a request's two chunks
            index, slab = c.connector.planner.chain.index, c.workers[0].connector.worker.cpu.slab
            return torch.stack([slab[index.entry(k).copies[0].slot] for k in chunk_keys(c, req, 2)])

        conf = pool_store_config(a.connector.cfg, a.connector.geo, a.connector.ns)
        store = stack.enter_context(TieredStore(conf))
        assert store.namespace.prefix == a.connector.ns.prefix
        keys = [store.key(h) for h in on_a.block_hashes[K - 1::K][:2]]
        assert keys == chunk_keys(a, on_a, 2)
        out = torch.zeros((2, conf["block_shape"][0]), dtype=torch.uint8)
        assert store.get(keys, out).wait(30) == 2 and torch.equal(out, rows_of(on_c))
        q_keys = chunk_keys(c, q_c, 2)
        assert store.put(q_keys, rows_of(q_c)).wait(30) == [True, True]
        step_until(b, lambda: all(k in b.connector.planner.chain.index for k in q_keys), "B to adopt the store's chunks")
        verified = b.verified_blocks
        serve(b, "q2", turn2(q_c))
        st = b.connector.stats()
        assert st["sched_hit_tokens_cpu"] == 8 * BS and b.verified_blocks - verified >= 8, st


@pytest.mark.parametrize("extra, match", [
    ({"cpu_pool": "shm:kv"}, "host:<name>"),
    ({"disk_path": "/tmp/x"}, "disk_path"),
    ({"remote_url": "redis://127.0.0.1:7000"}, "remote_url"),
    ({"cpu_pool_weight": 0}, "cpu_pool_weight"),
    ({"cpu_pool_poll_s": 0}, "cpu_pool_poll_s"),
])
def test_bad_pool_config_is_refused_naming_the_key(extra, match):
    from tiered_kv.connector.vllm.config import ConnectorConfig

    with pytest.raises(ConfigError, match=match):
        ConnectorConfig.from_extra_config({"cpu_pool": "host:kv", **extra})


def test_unsupported_engines_and_other_geometries_are_refused_at_start(model_dir, tmp_path):
    """TP>1 and several KV cache groups are refused naming the setting; a replica whose chunks or pool size differ
    from the pool's gets the pool's ConfigError naming both, and the pool serves on."""
    spec = pool_spec("vllm-refuse")
    with pytest.raises(ConfigError, match="tensor_parallel_size=2"):
        Engine.create(model_dir, cfg(spec), tp=2)
    with pytest.raises(ConfigError, match="KV cache groups"):
        Engine.create(write_shaped_dir(str(tmp_path / "gemma3"), "gemma3"), cfg(spec), shape="gemma3", num_blocks=200,
                      max_model_len=512)
    a = Engine.create(model_dir, cfg(spec))
    try:
        with pytest.raises(ConfigError, match="same block shape"):
            Engine.create(model_dir, cfg(spec, chunk_blocks=2))
        with pytest.raises(ConfigError, match="same cpu_bytes"):
            Engine.create(model_dir, cfg(spec, chunks=32))
        serve(a, "after", prompt(51, 4 * BS + 1))
        assert a.connector.stats()["resident_cpu"] == 1
    finally:
        a.close()
    assert_gone(spec)


def test_unstable_block_hashes_on_a_pool_warn_at_start(model_dir, monkeypatch, caplog):
    """Replicas must hash the same tokens alike to share chunks: xxhash without PYTHONHASHSEED does not, and says so."""
    import logging

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    caplog.set_level(logging.WARNING, logger="tiered_kv.connector")
    spec = pool_spec("vllm-hash")
    eng = Engine.create(model_dir, cfg(spec), hash_algo="xxhash")
    eng.close()
    assert "never hit each other's chunks" in caplog.text and spec in caplog.text
    assert_gone(spec)
