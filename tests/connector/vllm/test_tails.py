"""Tail pieces: the full blocks after a prompt's last whole chunk are stored and hit by the next turn.

vLLM's real Scheduler/AsyncScheduler with the harness of ``harness.py`` (every block a forward
reads is checked byte for byte against its token prefix), as in ``test_connector.py``. Hybrid models' tail
pieces (per KV cache group): ``test_hybrid_tails.py``.
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tests.connector.vllm.harness import BS, Engine, write_model_dir  # noqa: E402
from tests.connector.vllm.test_connector import (  # noqa: E402
    BLOCK_BYTES,
    CHUNK_BYTES,
    K,
    assert_no_leaks,
    cfg,
    prompt,
    turn2,
)
from tiered_kv.connector.vllm.state import TAIL_MARK  # noqa: E402

#: turn 1: two whole chunks, a 3-block tail and 4 tokens of a partial block
TURN1 = 2 * K * BS + 3 * BS + 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(str(tmp_path_factory.mktemp("tiny-llama-tails")))


def _tail_keys(eng: Engine) -> list[bytes]:
    """The tail-piece keys the planner holds: the namespace, TAIL_MARK, then a 32-byte block hash (a chunk key is the
    namespace and the hash: its ninth byte is TAIL_MARK one time in 256, so the length tells them apart)."""
    ns = eng.connector.ns.prefix
    return [k for k, _ in eng.connector.planner.chain.index.items()
            if k[len(ns):len(ns) + 1] == TAIL_MARK and len(k) == len(ns) + 1 + 32]


def _turn1(eng: Engine, seed: int, n: int = TURN1, rid: str = "t1"):
    a = eng.add(rid, prompt(seed, n), max_tokens=3)
    eng.run()
    eng.settle()
    return a


@pytest.mark.parametrize("load_mode", ["layerwise", "async"])
@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async"])
def test_turn2_hits_whole_chunks_and_the_tail_bit_exact(model_dir, async_sched, load_mode):
    eng = Engine.create(model_dir, cfg(load_mode=load_mode), async_sched=async_sched)
    try:
        a = _turn1(eng, 31)
        st = eng.connector.stats()
        assert st["resident_cpu"] == 3 and st["sched_tail_stores"] == 1, st  # 2 chunks + the tail piece
        tail_keys = _tail_keys(eng)
        ns_prefix = eng.connector.ns.prefix
        assert len(tail_keys) == 1 and tail_keys[0].startswith(ns_prefix + TAIL_MARK)
        assert tail_keys[0] == ns_prefix + TAIL_MARK + a.block_hashes[2 * K + 3 - 1]  # names the whole prefix
        assert eng.sched.reset_prefix_cache()
        verified = eng.verified_blocks
        b = eng.add("t2", turn2(eng, a), max_tokens=2)
        eng.run()
        eng.settle()
        st = eng.connector.stats()
        assert st["sched_hit_tokens_cpu"] == (2 * K + 3) * BS, st
        assert st["sched_tail_hits"] == 1 and st["sched_hit_tokens_tail"] == 3 * BS, st
        assert eng.cached_at_start[b.request_id] == (2 * K + 3) * BS  # what vLLM counted as not computed
        assert eng.workers[0].connector.stats()["bytes_loaded"] == (2 * K + 3) * BLOCK_BYTES
        assert eng.verified_blocks - verified >= 2 * K + 3  # every loaded block checked byte for byte
        assert b.is_finished()
        # turn 2 stored its own whole chunk 2 (the tail's chunk, now complete) and its own 1-block tail; turn 1's
        # tail piece, covered by that chunk now, is dropped rather than left to the LRU
        assert st["sched_tail_stores"] == 2 and st["sched_tails_superseded"] == 1, st
        assert tail_keys[0] not in eng.connector.planner.chain.index
        assert st["resident_cpu"] == 3 + 1, st
        assert_no_leaks(eng)
    finally:
        eng.close()


def test_tail_chunks_off_stores_and_hits_whole_chunks_only(model_dir):
    eng = Engine.create(model_dir, cfg(tail_chunks=False))
    try:
        a = _turn1(eng, 32)
        assert eng.connector.stats()["resident_cpu"] == 2
        eng.sched.reset_prefix_cache()
        b = eng.add("t2", turn2(eng, a), max_tokens=2)
        eng.run()
        eng.settle()
        st = eng.connector.stats()
        assert st["sched_hit_tokens_cpu"] == 2 * K * BS and st["sched_tail_hits"] == 0, st
        assert eng.cached_at_start[b.request_id] == 2 * K * BS
        assert_no_leaks(eng)
    finally:
        eng.close()


def test_prompt_shorter_than_a_chunk_is_stored_as_a_tail(model_dir):
    eng = Engine.create(model_dir, cfg())
    try:
        a = _turn1(eng, 33, n=(K - 1) * BS + 5)
        assert eng.connector.stats()["resident_cpu"] == 1
        eng.sched.reset_prefix_cache()
        b = eng.add("t2", turn2(eng, a), max_tokens=2)
        eng.run()
        eng.settle()
        assert eng.connector.stats()["sched_hit_tokens_cpu"] == (K - 1) * BS
        assert eng.cached_at_start[b.request_id] == (K - 1) * BS
        assert_no_leaks(eng)
    finally:
        eng.close()


def test_n_minus_1_rule_holds_for_a_tail(model_dir):
    """The same prompt again: its last full block may not come from the tail (one token is computed)."""
    eng = Engine.create(model_dir, cfg())
    try:
        p = prompt(34, 2 * K * BS + 3 * BS)  # ends on a block boundary inside chunk 2
        eng.add("a", p, max_tokens=1)
        eng.run()
        eng.settle()
        eng.sched.reset_prefix_cache()
        b = eng.add("b", p, max_tokens=1)
        eng.run()
        eng.settle()
        # the 3-block tail cannot load (its last block holds the last prompt token); no 2-block tail exists
        assert eng.connector.stats()["sched_hit_tokens_cpu"] == 2 * K * BS
        assert eng.cached_at_start[b.request_id] == 2 * K * BS
        assert_no_leaks(eng)
    finally:
        eng.close()


def test_on_finish_stores_the_tail_too(model_dir):
    eng = Engine.create(model_dir, cfg(store_policy="on_finish"))
    try:
        a = _turn1(eng, 35)
        assert eng.connector.stats()["resident_cpu"] == 3
        eng.sched.reset_prefix_cache()
        verified = eng.verified_blocks
        eng.add("t2", turn2(eng, a), max_tokens=2)
        eng.run()
        eng.settle()
        assert eng.connector.stats()["sched_hit_tokens_cpu"] == (2 * K + 3) * BS
        assert eng.verified_blocks - verified >= 2 * K + 3
        assert_no_leaks(eng)
    finally:
        eng.close()


def test_local_hit_inside_the_tail_chunk_loads_only_the_rest_of_the_tail(model_dir):
    eng = Engine.create(model_dir, cfg())
    try:
        a = _turn1(eng, 36)
        eng.sched.reset_prefix_cache()
        # a shorter request puts the first 2*K + 1 blocks of turn 1's prefix back on the GPU
        eng.add("short", list(a.prompt_token_ids[:(2 * K + 1) * BS + 2]), max_tokens=1)
        eng.run()
        eng.settle()
        before = eng.connector.stats()["sched_hit_tokens_cpu"]
        verified = eng.verified_blocks
        b = eng.add("t2", turn2(eng, a), max_tokens=1)
        eng.run()
        eng.settle()
        st = eng.connector.stats()
        assert st["sched_hit_tokens_cpu"] - before == 2 * BS, st  # blocks 2K+1 and 2K+2 of the 3-block tail
        assert eng.cached_at_start[b.request_id] == (2 * K + 3) * BS
        assert eng.verified_blocks - verified >= 2 * K + 3
        assert_no_leaks(eng)
    finally:
        eng.close()


def test_tail_on_disk_is_hit_after_a_restart(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    extra = cfg(cpu_bytes=2 * CHUNK_BYTES, disk_path=str(tmp_path / "kv"), disk_bytes="4MiB",
                write_policy="write_through", disk_load_policy="always")
    first = Engine.create(model_dir, extra, max_batched=64)
    try:
        a = _turn1(first, 37)
        assert first.connector.stats()["resident_disk"] == 3
        conv = turn2(first, a)
    finally:
        first.close()
    second = Engine.create(model_dir, extra, max_batched=64)  # new connectors, same disk path
    try:
        assert second.connector.stats()["resident_disk"] == 3  # the tail record is adopted like a chunk
        b = second.add("t2", conv, max_tokens=2)
        second.run()
        second.settle()
        st = second.connector.stats()
        assert st["sched_hit_tokens_disk"] == (2 * K + 3) * BS and st["sched_tail_hits"] == 1, st
        assert second.cached_at_start[b.request_id] == (2 * K + 3) * BS
        assert second.verified_blocks >= 2 * K + 3
        assert_no_leaks(second)
    finally:
        second.close()


def test_tail_slot_rows_past_the_piece_are_neither_written_nor_read(model_dir):
    """A tail's store writes only its m rows of the slot (the rest of the slot keeps what it held)."""
    eng = Engine.create(model_dir, cfg())
    try:
        runtime = eng.workers[0].connector.worker
        runtime.cpu.slab.fill_(0xAB)  # a sentinel in every slab row
        _turn1(eng, 38)
        planner = eng.connector.planner
        (tail_key,) = _tail_keys(eng)
        slot = planner.chain.index.get(tail_key).copies[0].slot
        rows = runtime.planes[0][slot * K:(slot + 1) * K]
        assert not (rows[:3] == 0xAB).all(dim=1).any()  # the 3 piece rows were written
        assert (rows[3:] == 0xAB).all()  # the rest of the slot was not
    finally:
        eng.close()


def test_a_longer_tail_in_the_same_chunk_supersedes_the_shorter_one(model_dir):
    """Turn 2 ends inside the same chunk as turn 1: its longer tail replaces turn 1's (one slot, not two)."""
    eng = Engine.create(model_dir, cfg())
    try:
        a = _turn1(eng, 40, n=2 * K * BS + BS + 4)  # a 1-block tail in chunk 2
        (old,) = _tail_keys(eng)
        eng.sched.reset_prefix_cache()
        conv = list(a.prompt_token_ids) + list(a.output_token_ids) + prompt(41, 20)  # ends in chunk 2 again
        eng.add("t2", conv, max_tokens=2)
        eng.run()
        eng.settle()
        st = eng.connector.stats()
        assert st["sched_hit_tokens_cpu"] == (2 * K + 1) * BS and st["sched_tails_superseded"] == 1, st
        tails = _tail_keys(eng)
        assert len(tails) == 1 and tails[0] != old and st["resident_cpu"] == 2 + 1, st
        assert_no_leaks(eng)
    finally:
        eng.close()


def test_kv_events_name_tail_blocks_and_never_retract_a_superseded_piece(model_dir):
    """A tail piece is reported like a chunk (its own block hashes); when a later turn's chunk covers it,
    it is deleted without a removal event (the covering chunk holds the same hashes)."""
    eng = Engine.create(model_dir, cfg())
    try:
        planner = eng.connector.planner
        planner.enable_events()  # what --kv-events-config turns on; records read here, not through vLLM
        a = _turn1(eng, 42)
        first = planner.take_events()
        stored = sorted(len(m[0]) for ok, tier, m in first if ok and tier == "cpu")
        assert stored == [3, K, K], first  # two chunks and the 3-block tail piece
        tail_hashes = next(m[0] for ok, tier, m in first if len(m[0]) == 3)
        assert tail_hashes == list(a.block_hashes[2 * K:2 * K + 3])
        eng.sched.reset_prefix_cache()
        eng.add("t2", turn2(eng, a), max_tokens=2)
        eng.run()
        eng.settle()
        assert planner.counters.tails_superseded == 1
        second = planner.take_events()
        assert not [r for r in second if not r[0]], second  # nothing removed
        assert sorted(len(m[0]) for ok, tier, m in second if ok) == [1, K], second  # chunk 2 and the new tail
        assert_no_leaks(eng)
    finally:
        eng.close()
