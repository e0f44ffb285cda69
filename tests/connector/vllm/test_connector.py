"""TieredKVConnector driven by vLLM's real Scheduler/AsyncScheduler; worker side on CPU tensors.

Every test runs the harness in ``harness.py``, which checks before each forward that every
block a request reads holds exactly the KV of its token prefix, on every rank: a wrong byte
from a load (or a recompute that did not happen) fails the test there.
"""
from __future__ import annotations

import logging
import os

import pytest

pytest.importorskip("vllm")

from tests.connector.vllm.harness import BS, Engine, Gate, write_model_dir  # noqa: E402
from tiered_kv.errors import ConfigError  # noqa: E402

BLOCK_BYTES = 4096  # 2 layers x 2 heads x 16 tokens x 32 values x 2 bytes
K = 4  # blocks per chunk (one key, one CPU slot, one disk record)
CHUNK_BYTES = K * BLOCK_BYTES


def cfg(**kw) -> dict:
    return {"chunk_blocks": K, "cpu_bytes": 64 * CHUNK_BYTES, **kw}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(str(tmp_path_factory.mktemp("tiny-llama")))


def prompt(seed: int, n: int) -> list[int]:
    return [100 + (seed * 7919 + i * 31) % 800 for i in range(n)]


def assert_no_leaks(eng: Engine) -> None:
    st = eng.connector.stats()
    assert st["inflight_jobs"] == 0, st
    assert st["pinned"] == 0, st
    assert st["waiting"] == 0, st
    assert st["gpu_blocks_busy"] == 0, st
    assert st["open_puts"] == 0 and st["open_gets"] == 0, st
    assert st["tracked_requests"] == 0, st
    for w in eng.workers:
        ws = w.connector.stats()
        assert ws["jobs_unreported"] == 0 and ws["loads_pending_requests"] == 0, ws
    chain = eng.connector.planner.chain
    assert chain.used[0] == chain.resident(0), (chain.used, chain.resident(0))


def turn2(eng: Engine, first) -> list[int]:
    """Turn 2 of a conversation: turn 1's prompt and answer plus a new user message."""
    return list(first.prompt_token_ids) + list(first.output_token_ids) + prompt(99, 40)


@pytest.mark.parametrize("load_mode", ["layerwise", "sync", "async"])
@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async"])
def test_multiturn_turn2_loads_turn1_prefix_bit_exact(model_dir, async_sched, load_mode):
    """Turn 2 hits turn 1's prefix in the CPU tier; in-step modes load it in the step vLLM schedules it."""
    eng = Engine.create(model_dir, cfg(load_mode=load_mode), async_sched=async_sched)
    try:
        a = eng.add("conv0-turn1", prompt(1, 8 * BS + 4), max_tokens=3)
        eng.run()
        eng.settle()
        assert eng.connector.stats()["resident_cpu"] == 2  # the two full chunks of the prompt
        assert eng.sched.reset_prefix_cache()  # the GPU forgets turn 1
        verified = eng.verified_blocks
        b = eng.add("conv0-turn2", turn2(eng, a), max_tokens=2)
        sync_steps = eng.sync_steps
        eng.step()
        in_step = load_mode != "async"
        # in-step: scheduled with its 8 loaded blocks counted as computed; async: parked until loaded
        assert (b.status.name == "WAITING_FOR_REMOTE_KVS") is not in_step, b.status
        assert (b.status.name == "RUNNING") is in_step, b.status
        eng.run()
        eng.settle()
        st = eng.connector.stats()
        assert st["sched_hit_tokens_cpu"] == 8 * BS, st
        assert st["sched_sync_loads"] == (1 if in_step else 0), st
        assert (eng.sync_steps > sync_steps) is in_step  # vLLM itself flagged the step (has_sync_kv_loads)
        assert eng.verified_blocks - verified >= 8  # the loaded blocks were checked byte for byte
        ws = eng.workers[0].connector.stats()
        assert ws["bytes_loaded"] == 8 * BLOCK_BYTES
        assert ws["sync_loads"] == (1 if in_step else 0), ws
        assert b.is_finished()
        assert_no_leaks(eng)
    finally:
        eng.close()


@pytest.mark.parametrize("load_mode", ["sync", "async"])
def test_cross_layer_registration_hits_bit_exact_and_merges_layers(model_dir, load_mode):
    """vLLM 0.26's cross-layer KV tensor: a block is one copy run (layers merged), loads are bit-exact."""
    eng = Engine.create(model_dir, cfg(load_mode=load_mode), cross_layer=True)
    try:
        runtime = eng.workers[0].connector.worker
        assert runtime.copier.plan([3, 4], [0, 5], to_cpu=True).count == 2  # 2 blocks, 2 runs (not 2 x LAYERS)
        a = eng.add("x1", prompt(23, 8 * BS + 4), max_tokens=3)
        eng.run()
        eng.settle()
        eng.sched.reset_prefix_cache()
        verified = eng.verified_blocks
        b = eng.add("x2", turn2(eng, a), max_tokens=2)
        eng.run()
        eng.settle()
        assert eng.connector.stats()["sched_hit_tokens_cpu"] == 8 * BS
        assert eng.verified_blocks - verified >= 8 and b.is_finished()
        assert_no_leaks(eng)
    finally:
        eng.close()


def _turn1_then_forget_on_gpu(eng: Engine, seed: int):
    """Serve a turn 1 (its prompt chunks go to the CPU tier), then empty vLLM's GPU prefix cache."""
    a = eng.add("t1", prompt(seed, 8 * BS + 4), max_tokens=2)
    eng.run()
    eng.settle()
    assert eng.sched.reset_prefix_cache()
    return a


def _break_in_step_copies(runtime, fail_calls: int):
    """Make the worker's in-step copier raise what a failed driver submission raises, for its first
    ``fail_calls`` calls (either entry point). Fault injection into our own ``BlockCopier``; no
    vLLM class is faked."""
    from tiered_kv.copy import CopyLaunchError

    copier = runtime.in_step.copier
    calls = []

    def wrap(real):
        def call(*args, **kw):
            calls.append(real.__name__)
            if len(calls) <= fail_calls:
                raise CopyLaunchError("injected: cuMemcpyBatchAsync returned CUDA_ERROR_INVALID_VALUE")
            return real(*args, **kw)
        return call

    copier.cpu_to_gpu_grouped = wrap(copier.cpu_to_gpu_grouped)
    copier.cpu_to_gpu = wrap(copier.cpu_to_gpu)
    return calls


@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async"])
def test_in_step_load_that_cannot_start_layerwise_retries_as_one_copy(model_dir, async_sched):
    eng = Engine.create(model_dir, cfg(), async_sched=async_sched)
    try:
        a = _turn1_then_forget_on_gpu(eng, 22)
        runtime = eng.workers[0].connector.worker
        calls = _break_in_step_copies(runtime, fail_calls=1)
        verified = eng.verified_blocks
        b = eng.add("t2", turn2(eng, a), max_tokens=2)
        eng.run()
        eng.settle()
        assert calls == ["cpu_to_gpu_grouped", "cpu_to_gpu"], calls
        assert eng.discarded_reads == 0 and eng.verified_blocks - verified >= 8
        assert b.is_finished()
        ws = runtime.stats()
        assert ws["failed_items"] == 0 and ws["sync_loads"] == 1 and ws["bytes_loaded"] == 8 * BLOCK_BYTES, ws
        assert_no_leaks(eng)
    finally:
        eng.close()


def test_failed_in_step_load_is_reported_in_its_step_and_recomputed(model_dir):
    """An in-step load that cannot start even as one copy: its blocks are load errors of that very
    step, vLLM discards the step's output for the request and recomputes; nothing leaks.

    Synchronous scheduling only: under async scheduling vLLM has already scheduled the request's
    next step when the error arrives; what it does with that in-flight step is vLLM's recovery.
    """
    eng = Engine.create(model_dir, cfg())
    try:
        a = _turn1_then_forget_on_gpu(eng, 21)
        runtime = eng.workers[0].connector.worker
        calls = _break_in_step_copies(runtime, fail_calls=2)
        b = eng.add("t2", turn2(eng, a), max_tokens=2)
        eng.run()
        eng.settle()
        assert calls[:2] == ["cpu_to_gpu_grouped", "cpu_to_gpu"], calls
        assert eng.discarded_reads >= 8  # the step that read the unfilled blocks reported them
        assert b.is_finished() and b.output_token_ids
        ws = runtime.stats()
        assert ws["failed_items"] >= 1 and ws["sync_loads"] == 0, ws
        assert_no_leaks(eng)
    finally:
        eng.close()


def test_full_prompt_hit_leaves_one_token(model_dir):
    eng = Engine.create(model_dir, cfg())
    try:
        eng.add("a", prompt(2, 8 * BS), max_tokens=1)
        eng.run()
        eng.settle()
        eng.sched.reset_prefix_cache()
        eng.add("b", prompt(2, 8 * BS), max_tokens=1)  # same 2 full chunks: the last one may not load
        eng.run()
        eng.settle()
        assert eng.connector.stats()["sched_hit_tokens_cpu"] == K * BS
        assert_no_leaks(eng)
    finally:
        eng.close()


def test_prompt_of_exactly_one_chunk_is_stored(model_dir):
    """Too short to hit anything itself (n-1), but its one chunk serves the next, longer prompt."""
    eng = Engine.create(model_dir, cfg())
    try:
        eng.add("one", prompt(25, K * BS), max_tokens=1)
        eng.run()
        eng.settle()
        assert eng.connector.stats()["resident_cpu"] == 1
        assert_no_leaks(eng)
    finally:
        eng.close()


def test_a_lookup_names_one_chunk_on_a_miss_and_the_rest_in_one_call_on_a_hit(model_dir, monkeypatch):
    """``LookupPlanner._walk``: a new prompt's miss hashes only its first chunk's key; once that chunk is held, the
    other usable chunks are named in one call (not one call per chunk), and the hit loads them all."""
    eng = Engine.create(model_dir, cfg(), num_blocks=64)
    try:
        requests = eng.connector.planner._requests
        calls: list[int] = []
        keys = requests._keys
        monkeypatch.setattr(requests, "_keys", lambda hashes: calls.append(len(hashes)) or keys(hashes))
        first = prompt(31, 6 * K * BS + 5)
        eng.add("a", first, max_tokens=1)
        eng.step()  # the lookup (a miss), then the stores of the chunks this step computed
        assert calls[0] == 1
        eng.run()
        eng.settle()
        assert eng.sched.reset_prefix_cache()
        calls.clear()
        eng.add("b", first + prompt(32, 40), max_tokens=3)
        eng.step()
        assert calls[:2] == [1, 5]  # chunk 0 alone, then chunks 1-5
        assert len(requests.reqs["b"].hit_keys) >= 6  # the six chunks (and a tail piece)
        eng.run()
        eng.settle()
        assert eng.connector.stats()["sched_hit_tokens_cpu"] >= 6 * K * BS
        assert_no_leaks(eng)
    finally:
        eng.close()


def test_local_hit_inside_a_chunk_loads_only_the_missing_blocks(model_dir):
    # 16 GPU blocks: a filler evicts the tail of turn 1's cached blocks (vLLM evicts tails first),
    # so turn 2 has a local prefix hit that ends inside a chunk.
    eng = Engine.create(model_dir, cfg(), num_blocks=16)
    try:
        a = eng.add("p1", prompt(19, 8 * BS + 3), max_tokens=1)
        eng.run()
        eng.settle()  # p1's chunks are stored before the filler re-allocates its blocks (else a fence may cancel them)
        eng.add("filler", prompt(20, 10 * BS - 1), max_tokens=1)
        eng.run()
        eng.settle()
        verified = eng.verified_blocks
        eng.add("p2", turn2(eng, a), max_tokens=1)
        eng.run()
        eng.settle()
        st = eng.connector.stats()
        loaded_blocks = st["sched_hit_tokens_cpu"] // BS
        assert 0 < loaded_blocks < 2 * K and loaded_blocks % K, st  # part of a chunk, not whole chunks
        assert eng.verified_blocks - verified >= 8  # local and loaded blocks all checked
        assert_no_leaks(eng)
    finally:
        eng.close()


def _disk_engine(model_dir, tmp_path, **kw):
    extra = cfg(cpu_bytes=2 * CHUNK_BYTES, disk_path=str(tmp_path / "kv"), disk_bytes="4MiB")
    extra.update(kw.pop("extra", {}))
    return Engine.create(model_dir, extra, max_batched=64, **kw)


def _first_engine(model_dir, tmp_path, extra, name, seed):
    """A first engine on the disk path runs one 12-block (+3 tokens) prompt and closes. Returns the request's turn-2
    prompt, the scheduler's ``resident_disk`` before the close, and rank 0's disk directory."""
    first = _disk_engine(model_dir, tmp_path, extra=extra)
    try:
        a = first.add(name, prompt(seed, 12 * BS + 3), max_tokens=2)
        first.run()
        first.settle()
        return turn2(first, a), first.connector.stats()["resident_disk"], first.workers[0].connector.worker.disk.path
    finally:
        first.close()


@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async"])
def test_working_set_larger_than_cpu_comes_back_from_disk(model_dir, tmp_path, async_sched):
    eng = _disk_engine(model_dir, tmp_path, async_sched=async_sched)
    try:
        a = eng.add("big", prompt(3, 20 * BS + 5), max_tokens=2)
        eng.run()
        eng.settle()
        st = eng.connector.stats()
        assert st["resident_cpu"] <= 2 and st["resident_disk"] >= 3, st
        eng.sched.reset_prefix_cache()
        verified = eng.verified_blocks
        eng.add("big-2", turn2(eng, a), max_tokens=2)
        eng.run()
        eng.settle()
        st = eng.connector.stats()
        assert st["sched_hit_tokens_disk"] >= 3 * K * BS, st
        assert eng.workers[0].connector.stats()["bytes_from_disk"] >= 12 * BLOCK_BYTES
        assert eng.verified_blocks - verified >= 20
        assert_no_leaks(eng)
    finally:
        eng.close()


def test_restart_hits_blocks_written_by_previous_engine(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")  # what makes vLLM 0.26's block hashes stable across starts
    extra = {"write_policy": "write_through"}
    conv, resident, _ = _first_engine(model_dir, tmp_path, extra, "old", 4)
    assert resident == 3
    second = _disk_engine(model_dir, tmp_path, extra=extra)  # new connectors, same disk path
    try:
        assert second.connector.stats()["resident_disk"] == 3  # adopted at start-up
        second.add("new", conv, max_tokens=2)
        second.run()
        second.settle()
        st = second.connector.stats()
        assert st["sched_hit_tokens_disk"] == 12 * BS, st
        assert second.verified_blocks >= 12
        assert_no_leaks(second)
    finally:
        second.close()


def test_shared_disk_budget_keeps_two_models_apart(model_dir, tmp_path, monkeypatch):
    """Issue 17: two models (namespaces) on one disk_path with ``disk_budget: shared`` write into one
    directory under one budget; the second never adopts nor hits the first one's chunks for the very same
    tokens (a foreign namespace's block is a miss), and the first one's chunks survive the second's run."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    extra = {"write_policy": "write_through", "disk_budget": "shared"}
    conv, resident, _ = _first_engine(model_dir, tmp_path, {**extra, "model_id": "model-a"}, "a", 4)
    assert resident == 3
    other = _disk_engine(model_dir, tmp_path, extra={**extra, "model_id": "model-b"})
    try:
        assert other.connector.stats()["resident_disk"] == 0  # model-a's chunks are not adopted
        other.add("b", conv, max_tokens=2)
        other.run()
        other.settle()
        st = other.connector.stats()
        assert st["sched_hit_tokens_disk"] == 0 and st["sched_hit_tokens_cpu"] == 0, st  # same tokens: a miss
        disk = other.workers[0].connector.worker.disk
        assert disk.path == tmp_path / "kv" / "shared" / "rank0-of-1"
        spaces = disk.usage()["spaces"]
        assert len(spaces) == 2 and all(sp["used_slots"] >= 3 for sp in spaces.values()), spaces
        assert_no_leaks(other)
    finally:
        other.close()
    again = _disk_engine(model_dir, tmp_path, extra={**extra, "model_id": "model-a"})
    try:
        assert again.connector.stats()["resident_disk"] == 3
        again.add("a2", conv, max_tokens=2)
        again.run()
        again.settle()
        assert again.connector.stats()["sched_hit_tokens_disk"] == 12 * BS
        assert_no_leaks(again)
    finally:
        again.close()


def test_shared_disk_budget_evictions_reach_the_scheduler(model_dir, tmp_path):
    """Issue 17: under ``disk_budget: shared`` the directory evicts by itself; the workers report the evicted
    chunks and the scheduler forgets them, so it never plans a load of a chunk that is gone (no failed load),
    and its count of disk chunks stays within the budget."""
    extra = {"write_policy": "write_through", "disk_budget": "shared", "disk_bytes": 3 * CHUNK_BYTES}
    eng = _disk_engine(model_dir, tmp_path, extra=extra)
    try:
        a = eng.add("a", prompt(11, 12 * BS + 3), max_tokens=2)  # 3 chunks: the whole budget
        eng.run()
        eng.settle()
        assert eng.connector.stats()["resident_disk"] == 3
        eng.add("b", prompt(12, 12 * BS + 3), max_tokens=2)  # 3 more: the directory evicts a's 3
        eng.run()
        eng.settle()
        st = eng.connector.stats()
        assert st["resident_disk"] == 3, st  # the scheduler heard of the evictions
        assert eng.workers[0].connector.worker.disk.usage()["spaces"][eng.connector.ns.prefix.hex()][
            "evictions"] == 3
        eng.sched.reset_prefix_cache()
        verified = eng.verified_blocks
        eng.add("a2", turn2(eng, a), max_tokens=2)  # a's chunks are gone: a plain miss, not a failed load
        eng.run()
        eng.settle()
        st = eng.connector.stats()
        assert st["sched_hit_tokens_disk"] == 0 and eng.verified_blocks > verified, st
        assert all(w.connector.stats()["failed_items"] == 0 for w in eng.workers)  # no load planned into a hole
        assert_no_leaks(eng)
    finally:
        eng.close()


def test_damaged_disk_index_is_moved_aside_and_the_engine_serves_on(model_dir, tmp_path, monkeypatch, caplog):
    """Issue 17: an index LMDB cannot read (both meta pages zeroed) neither stops nor kills the engine: the
    scheduler adopts nothing from it, the worker moves it aside loudly and starts an empty one, the same
    prompt is recomputed (verified bit-exact by the harness) and stored again."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    extra = {"write_policy": "write_through"}
    conv, _, rank_dir = _first_engine(model_dir, tmp_path, extra, "old", 6)
    with open(rank_dir / "index" / "data.mdb", "r+b") as f:
        f.write(bytes(2 * 4096))
    with caplog.at_level(logging.ERROR):
        second = _disk_engine(model_dir, tmp_path, extra=extra)
    try:
        assert second.connector.stats()["resident_disk"] == 0
        assert any("damaged" in r.message for r in caplog.records)
        assert list(rank_dir.parent.glob(f"{rank_dir.name}.damaged-*")), "the damaged directory was not moved aside"
        verified = second.verified_blocks
        second.add("new", conv, max_tokens=2)
        second.run()
        second.settle()
        st = second.connector.stats()
        assert st["sched_hit_tokens_disk"] == 0 and second.verified_blocks > verified
        assert st["resident_disk"] >= 3, st  # stored again, in the fresh directory
        assert_no_leaks(second)
    finally:
        second.close()


def test_unstable_block_hashes_warn_and_never_adopt(model_dir, tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)  # xxhash without a seed: random per process
    caplog.set_level(logging.WARNING, logger="tiered_kv.connector")
    extra = {"write_policy": "write_through"}
    first = _disk_engine(model_dir, tmp_path, extra=extra, hash_algo="xxhash")
    try:
        first.add("old", prompt(13, 8 * BS + 1), max_tokens=1)
        first.run()
        first.settle()
        assert first.connector.stats()["resident_disk"] == 2
    finally:
        first.close()
    assert "PYTHONHASHSEED" in caplog.text  # the loud start-up warning
    second = _disk_engine(model_dir, tmp_path, extra=extra, hash_algo="xxhash")
    try:
        assert second.connector.stats()["resident_disk"] == 0  # nothing it could name is adopted
        assert second.workers[0].connector.worker.disk.stored_keys() == []  # and the old records are gone
    finally:
        second.close()


def test_corrupt_disk_record_is_recomputed_not_served(model_dir, tmp_path):
    eng = _disk_engine(model_dir, tmp_path, extra={"write_policy": "write_through"})
    try:
        a = eng.add("victim", prompt(5, 12 * BS + 1), max_tokens=2)
        eng.run()
        eng.settle()
        eng.sched.reset_prefix_cache()
        # Damage every payload on disk and push the blocks out of the CPU tier.
        disk = eng.workers[0].connector.worker.disk
        with open(os.path.join(disk.path, "payload.bin"), "r+b") as f:
            size = f.seek(0, 2)
            f.seek(0)
            f.write(bytes([0xA5]) * size)
        filler = eng.add("filler", prompt(6, 10 * BS + 1), max_tokens=1)
        eng.run()
        eng.settle()
        assert filler.is_finished()
        eng.sched.reset_prefix_cache()
        verified = eng.verified_blocks
        b = eng.add("victim-2", turn2(eng, a), max_tokens=2)
        eng.run()
        eng.settle()
        ws = eng.workers[0].connector.stats()
        assert ws["corrupt_items"] >= 1, ws
        assert b.is_finished() and b.status.name == "FINISHED_LENGTH_CAPPED"
        assert eng.verified_blocks > verified  # what was read back was checked, and was right
        assert eng.connector.stats()["disk_corrupt_dropped"] >= 1
        assert_no_leaks(eng)
    finally:
        eng.close()


@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async"])
def test_preemption_with_stores_in_flight_leaks_nothing(model_dir, async_sched):
    # 24 GPU blocks; two requests of 10 blocks decoding 100 tokens each cannot both fit.
    eng = Engine.create(model_dir, cfg(), num_blocks=24, async_sched=async_sched)
    gate = Gate(eng.workers[0].connector.worker, open_on_fence=True)  # stores stay in flight until fenced
    try:
        p1 = eng.add("p1", prompt(7, 160), max_tokens=100)
        p2 = eng.add("p2", prompt(8, 160), max_tokens=100)
        eng.run(max_steps=3000)
        gate.open()
        eng.settle()
        assert p1.num_preemptions + p2.num_preemptions >= 1
        assert p1.is_finished() and p2.is_finished()
        st = eng.workers[0].connector.stats()
        assert gate.fenced and st["fences_waited"] + st["stores_cancelled"] >= 1  # waited for, or cancelled
        assert_no_leaks(eng)
    finally:
        gate.open()
        eng.close()


@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async"])
def test_store_in_flight_at_preemption_is_fenced_and_stored_bytes_are_exact(model_dir, async_sched, monkeypatch):
    """A preempted request's blocks can be re-allocated in the very step it is preempted: its store still in
    flight is fenced then (the planner publishes its blocks on ``preempted_req_ids``), so what the store
    copied is the prompt's KV; a later request loads it and every loaded block is checked byte for byte."""
    import tiered_kv.connector.vllm.worker as worker

    monkeypatch.setattr(worker, "FENCE_PATIENCE_S", 1.0)  # a fenced store is waited for, not cancelled
    eng = Engine.create(model_dir, cfg(), num_blocks=24, async_sched=async_sched)
    gate = Gate(eng.workers[0].connector.worker, open_on_fence=True)  # stores stay in flight until fenced
    try:
        p1 = eng.add("p1", prompt(7, 160), max_tokens=100)
        p2 = eng.add("p2", prompt(8, 160), max_tokens=100)
        eng.run(max_steps=3000)
        gate.open()
        eng.settle()
        assert p1.num_preemptions + p2.num_preemptions >= 1 and gate.fenced
        assert eng.sched.reset_prefix_cache()
        verified = eng.verified_blocks
        hits = eng.connector.stats()["sched_hit_tokens_cpu"]  # a resumed victim may have loaded its own chunks
        for i, p in enumerate((p1, p2)):
            eng.add(f"again{i}", list(p.prompt_token_ids) + prompt(30 + i, 20), max_tokens=1)
        eng.run()
        eng.settle()
        hits = eng.connector.stats()["sched_hit_tokens_cpu"] - hits
        assert hits == 2 * 10 * BS  # 2 chunks + a 2-block tail each
        assert eng.verified_blocks - verified >= 2 * 10
        assert_no_leaks(eng)
    finally:
        gate.open()
        eng.close()


def test_on_finish_stores_serve_the_next_turn(model_dir):
    eng = Engine.create(model_dir, cfg(store_policy="on_finish"))
    try:
        a = eng.add("f1", prompt(14, 8 * BS + 3), max_tokens=2)
        eng.run()
        eng.settle()
        assert eng.connector.stats()["resident_cpu"] == 2
        eng.sched.reset_prefix_cache()
        eng.add("f2", turn2(eng, a), max_tokens=2)
        eng.run()
        eng.settle()
        assert eng.connector.stats()["sched_hit_tokens_cpu"] == 8 * BS
        assert_no_leaks(eng)
    finally:
        eng.close()


def test_on_finish_store_of_reallocated_blocks_is_dropped_not_copied(model_dir):
    # 16 GPU blocks: the next request needs the finished one's blocks in the very next step.
    eng = Engine.create(model_dir, cfg(store_policy="on_finish"), num_blocks=16)
    try:
        eng.add("g1", prompt(15, 12 * BS), max_tokens=1)
        eng.run(until=lambda: eng.requests["g1"].is_finished())
        eng.add("g2", prompt(16, 14 * BS), max_tokens=1)  # allocated before g1's store could start
        eng.run()
        eng.settle()
        st = eng.connector.stats()
        assert st["sched_stores_dropped_reused"] >= 1, st
        eng.sched.reset_prefix_cache()
        eng.add("g1-again", prompt(15, 12 * BS) + prompt(17, 20), max_tokens=1)
        eng.run()  # the harness checks every block it reads: a chunk copied from re-used blocks would fail here
        eng.settle()
        assert_no_leaks(eng)
    finally:
        eng.close()


@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async"])
def test_abort_mid_load_frees_everything(model_dir, async_sched):
    eng = Engine.create(model_dir, cfg(load_mode="async"), async_sched=async_sched)  # a load between steps
    try:
        a = eng.add("a", prompt(9, 8 * BS + 3), max_tokens=2)
        eng.run()
        eng.settle()
        eng.sched.reset_prefix_cache()
        gate = Gate(eng.workers[0].connector.worker)
        b = eng.add("b", turn2(eng, a), max_tokens=2)
        eng.run(until=lambda: gate.started > 0)  # the load has started and is held
        assert b.status.name == "WAITING_FOR_REMOTE_KVS"
        eng.abort("b")
        eng.step()
        gate.open()
        eng.settle()
        assert not eng.sched.has_requests()
        pool = eng.sched.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == eng.num_blocks - 1  # vLLM got every block back
        assert_no_leaks(eng)
    finally:
        eng.close()


@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async"])
def test_abort_mid_store_then_block_reuse_is_fenced(model_dir, async_sched):
    eng = Engine.create(model_dir, cfg(), num_blocks=16, async_sched=async_sched)
    gate = Gate(eng.workers[0].connector.worker, open_on_fence=True)
    try:
        eng.add("s", prompt(10, 12 * BS), max_tokens=50)
        eng.step()  # prefill: 12 blocks computed, their stores are held by the gate
        eng.abort("s")
        eng.add("t", prompt(11, 14 * BS), max_tokens=2)  # needs the aborted request's blocks
        eng.run()
        gate.open()
        eng.settle()
        st = eng.workers[0].connector.stats()
        assert gate.fenced and st["fences_waited"] + st["stores_cancelled"] >= 1  # waited for, or cancelled
        assert eng.requests["t"].is_finished()
        assert_no_leaks(eng)
    finally:
        gate.open()
        eng.close()


def test_tensor_parallel_ranks_each_hold_their_share(model_dir, tmp_path):
    eng = _disk_engine(model_dir, tmp_path, tp=2)
    try:
        a = eng.add("tp", prompt(12, 12 * BS + 2), max_tokens=2)
        eng.run()
        eng.settle()
        eng.sched.reset_prefix_cache()
        eng.add("tp-2", turn2(eng, a), max_tokens=2)
        eng.run()
        eng.settle()
        st = eng.connector.stats()
        assert st["sched_hit_tokens_cpu"] + st["sched_hit_tokens_disk"] == 12 * BS, st
        dirs = {str(w.connector.worker.disk.path) for w in eng.workers}
        assert len(dirs) == 2  # one namespace directory per rank
        assert all(w.connector.stats()["bytes_loaded"] == 12 * BLOCK_BYTES for w in eng.workers)
        assert_no_leaks(eng)
    finally:
        eng.close()


@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async"])
def test_tensor_parallel_in_step_load_runs_on_every_rank(model_dir, async_sched):
    eng = Engine.create(model_dir, cfg(), tp=2, async_sched=async_sched)
    try:
        a = _turn1_then_forget_on_gpu(eng, 24)
        verified = eng.verified_blocks
        eng.add("tp-in-step", turn2(eng, a), max_tokens=2)
        eng.run()
        eng.settle()
        assert eng.connector.stats()["sched_sync_loads"] == 1
        assert eng.verified_blocks - verified >= 2 * 8  # both ranks' loaded blocks checked byte for byte
        for w in eng.workers:
            ws = w.connector.stats()
            assert ws["sync_loads"] == 1 and ws["bytes_loaded"] == 8 * BLOCK_BYTES, ws
        assert_no_leaks(eng)
    finally:
        eng.close()


def test_prometheus_metrics_show_hits_per_tier(model_dir):
    import socket
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    eng = Engine.create(model_dir, cfg(metrics_port=port))
    try:
        a = eng.add("m1", prompt(18, 8 * BS + 1), max_tokens=1)
        eng.run()
        eng.settle()
        eng.sched.reset_prefix_cache()
        eng.add("m2", turn2(eng, a), max_tokens=1)
        eng.run()
        eng.connector._prom_at = 0.0  # the snapshot refreshes at most once a second
        eng.settle()
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        line = next(x for x in text.splitlines() if x.startswith('tiered_kv_tier_hits_total{') and 'tier="cpu"' in x)
        assert float(line.split()[-1]) == 2  # the two chunks turn 2 loaded
        assert "tiered_kv_inflight_jobs" in text
        # the worker's own counters, shipped through vLLM's kv_connector_stats and summed by the scheduler
        sample = lambda fam, what: float(next(  # noqa: E731
            x for x in text.splitlines() if x.startswith(f'{fam}{{store="vllm",what="{what}"}}')).split()[-1])
        w = eng.workers[0].connector.stats()
        assert w["sync_loads"] == 1 and sample("tiered_kv_worker_events_total", "sync_loads") == 1
        assert sample("tiered_kv_worker_bytes_total", "loaded") == w["bytes_loaded"] == 2 * CHUNK_BYTES
        # the movers' CPU: turn 1's stores ran on them (the in-step load ran on vLLM's thread: not counted there)
        assert 0 < w["store_cpu_seconds"] <= w["mover_cpu_seconds"]
        hooks = {k: v for k, v in eng.connector.stats().items() if k.startswith("workers_hook_")}
        assert {"workers_hook_start_load_kv_seconds", "workers_hook_wait_for_save_seconds",
                "workers_hook_get_finished_seconds", "workers_hook_handle_preemptions_seconds",
                "workers_hook_bind_connector_metadata_seconds"} <= set(hooks), hooks
        # what the rank timed, less only what it has not shipped yet (a step that moved nothing waits up to 1 s)
        mine = eng.workers[0].connector._hook_s["hook_start_load_kv_seconds"]
        assert 0 < hooks["workers_hook_start_load_kv_seconds"] <= mine
        # the scrape reads the snapshot of the last build_connector_meta (the workers' sums at that step)
        assert 0 < sample("tiered_kv_worker_seconds_total", "hook_start_load_kv") <= mine
    finally:
        eng.close()


def test_unknown_extra_config_key_fails_at_start_naming_it(model_dir):
    with pytest.raises(ConfigError, match="cpu_byts"):
        Engine.create(model_dir, {"cpu_byts": "1GiB"})


def test_connector_stats_log_line_keeps_the_flow_and_fence_waits():
    """``TieredKVStats``: ranks' numbers sum; vLLM's log line (``reduce``) shows bytes, GB/s, failures and fence
    waits, not every counter (nor hook time); an interval with hook time alone is empty (vLLM logs nothing for it)."""
    from tiered_kv.connector.vllm.connector import TieredKVStats

    a = TieredKVStats(data={"bytes_loaded": 2 << 30, "load_seconds": 0.5, "hook_start_load_kv_seconds": 0.002,
                            "layer_submit_seconds": 0.001, "sync_loads": 3, "fence_wait_seconds": 0.004})
    b = TieredKVStats(data={"bytes_loaded": 2 << 30, "load_seconds": 0.5, "hook_get_finished_seconds": 0.001})
    out = a.aggregate(b).reduce()
    assert out["bytes_loaded"] == 4 << 30 and out["load_gbps"] == round((4 << 30) / 1.0 / 1e9, 3)
    assert out["fence_wait_seconds"] == 0.004 and not a.is_empty()
    assert not {"sync_loads", "hook_start_load_kv_seconds", "layer_submit_seconds", "hook_seconds"} & set(out)
    assert TieredKVStats(data={"hook_get_finished_seconds": 0.001, "sync_loads": 1}).is_empty()


def test_a_step_that_moved_nothing_ships_nothing_until_a_second_passed(model_dir, monkeypatch):
    """``get_kv_connector_stats``: a step with no bytes moved returns None (its hook time and other counters wait);
    the next shipment carries them whole; a second after the last one, a quiet step ships them too."""
    import tiered_kv.connector.vllm.connector as conn_mod

    eng = Engine.create(model_dir, cfg())
    try:
        eng.add("q1", prompt(31, 4 * BS + 1), max_tokens=1)
        eng.run()
        eng.settle()
        w = eng.workers[0].connector
        w.get_kv_connector_stats()  # ship what the run moved
        before = dict(w._hook_s)
        w.wait_for_save()  # a hook call that moves nothing
        w.worker.counters.fences_waited += 2  # a counter that is not a flow
        assert w.get_kv_connector_stats() is None
        monkeypatch.setattr(conn_mod, "STATS_EVERY_S", 0.0)
        shipped = w.get_kv_connector_stats()
        assert shipped is not None and shipped.data["fences_waited"] == 2
        assert shipped.data["hook_wait_for_save_seconds"] == pytest.approx(
            w._hook_s["hook_wait_for_save_seconds"] - before.get("hook_wait_for_save_seconds", 0.0))
        assert shipped.is_empty() and w.get_kv_connector_stats() is None  # nothing new since: nothing at all
    finally:
        eng.close()
