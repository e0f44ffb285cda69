"""A hybrid sliding-window model under GPU-cache pressure, through vLLM's real Scheduler (issue 28).

The workload of the Gemma-2 cliff measured on an H200 (2026-11-28), scaled down: ten conversations
whose prefixes are three windows long; turn 2 of each one at a time; three unrelated prompts of the
same length; then turn 3 of all ten in one batch, on a GPU block pool that holds fewer than two of
them, so the batch's prefixes can only come from the CPU tier.

The CPU tier is sized by what a later hit can use: every full-attention block of a prefix and the
sliding-window blocks of the last window before its end (``needed_bytes``), for all thirteen prompts,
with 5% to spare; the batch's new chunks then overflow it a little. Before issue 28 the connector
stored every sliding-window block of every chunk (1.5x those bytes): the tier overflowed at turn 1,
LRU evicted each conversation's first chunks, every recompute evicted the next conversation's, and
the batch loaded nothing (turn 2 hit 4 of 10). With the window kept only at a prefix's end it fits,
and the default policy (S3-FIFO) makes room from the prompts seen once, not from conversations that
were hit (LRU evicts the least recently used conversation, whose recompute evicts the next: 6 of 10).

Shape ``gemma2`` (``models.py``): 4 layers alternating a 256-token window and full attention, 2 KV
cache groups of 2 layers, 2 KV heads of 16 (2,048 B per layer-block), 4-block (64-token) chunks.
"""
from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

from tests.connector.vllm import models  # noqa: E402
from tests.connector.vllm.harness import BS, Engine  # noqa: E402
from tests.connector.vllm.test_hybrid import assert_clean, prompt  # noqa: E402

K = 4  # blocks per chunk
CHUNK = K * BS  # 64 tokens
PREFIX_CHUNKS = 12  # a prefix is 768 tokens: three 256-token windows
WINDOW_CHUNKS = 256 // CHUNK
LAYER_BLOCK = 2 * BS * 2 * 16 * 2  # 2 KV heads x 16 tokens x (K and V) x 16 dims x 2 bytes
GROUP_BLOCK = 2 * LAYER_BLOCK  # two layers per group
CONVERSATIONS, UNRELATED = 10, 3


#: a conversation's tail piece after turn 2 (its last 3 full blocks past the 12 chunks): one slot per group
TAIL_SLOTS = 2
TAIL_BLOCKS = 3


def needed_bytes(prompts: int, tails: int = 0) -> int:
    """What ``prompts`` stored prefixes (``tails`` of them with a tail piece) give a later hit: full attention
    everywhere, the window at the end, a slot per group of each tail piece."""
    return (prompts * (PREFIX_CHUNKS + WINDOW_CHUNKS) + tails * TAIL_SLOTS) * K * GROUP_BLOCK


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return models.write_model_dir(str(tmp_path_factory.mktemp("gemma2") / "gemma2"), "gemma2")


def _engine(model_dir: str, **extra) -> Engine:
    # 120 blocks: a 12-chunk prefill holds 48 full + up to 48 window blocks at once, fewer than two of them fit;
    # the CPU tier: what every prompt stores (and each conversation's tail piece, with them on), 5% to spare
    tails = CONVERSATIONS if extra.get("tail_chunks") is True else 0
    cpu = needed_bytes(CONVERSATIONS + UNRELATED, tails) * 21 // 20
    return Engine.create(model_dir, {"chunk_blocks": K, "cpu_bytes": cpu, **extra}, shape="gemma2",
                         num_blocks=120, max_model_len=900, max_batched=1024)


def _follow(req, seed: int) -> list[int]:
    return list(req.prompt_token_ids) + list(req.output_token_ids) + prompt(seed, 40)


@pytest.mark.parametrize("tail_chunks", ["auto", True], ids=["default", "tails"])
def test_batch_of_cpu_hits_under_gpu_pressure_loads_every_prefix(model_dir, tail_chunks):
    """The cliff of 2026-11-28 (issue 28): the batch's prefixes all load from the CPU tier under GPU pressure; with
    the default (``auto``: no tail pieces on a sliding-window hybrid) and with ``tail_chunks: true``."""
    eng = _engine(model_dir, tail_chunks=tail_chunks)
    try:
        geo = eng.connector.geo
        assert [g.kind for g in geo.groups] == ["swa", "full"]
        firsts = []
        for i in range(CONVERSATIONS):  # turn 1, one at a time
            firsts.append(eng.add(f"c{i}-t1", prompt(100 + i, PREFIX_CHUNKS * CHUNK + 7), max_tokens=2))
            eng.run()
        eng.settle()
        seconds = []
        for i, a in enumerate(firsts):  # turn 2, one at a time: each hits its prefix in the CPU tier
            seconds.append(eng.add(f"c{i}-t2", _follow(a, 200 + i), max_tokens=2))
            eng.run()
        eng.settle()
        turn2_hits = eng.connector.stats()["sched_hit_tokens_cpu"]
        for j in range(UNRELATED):  # pressure: prompts nobody asks for again
            eng.add(f"u{j}", prompt(300 + j, PREFIX_CHUNKS * CHUNK + 7), max_tokens=2)
            eng.run()
        eng.settle()
        before = eng.connector.stats()["sched_hit_tokens_cpu"]
        verified = eng.verified_blocks
        batch = [eng.add(f"c{i}-t3", _follow(b, 400 + i), max_tokens=2) for i, b in enumerate(seconds)]
        eng.run(max_steps=4000)
        eng.settle()
        st = eng.connector.stats()
        loaded = st["sched_hit_tokens_cpu"] - before
        # every conversation's stored prefix (its turn-1 chunks; turn 2 added no whole chunk) comes from the CPU tier,
        # and turn 2's tail piece where the tier still holds it: stored once and not hit yet, a piece is among the
        # first the batch's new chunks evict (S3-FIFO's small queue), before the later unrelated prompts
        tails = st["sched_tail_hits"]
        assert (0 < tails <= CONVERSATIONS) if tail_chunks is True else tails == 0, st
        assert loaded == CONVERSATIONS * PREFIX_CHUNKS * CHUNK + tails * TAIL_BLOCKS * BS, (loaded, turn2_hits,
                                                                                              sorted(st.items()))
        assert all(r.is_finished() for r in batch)
        assert eng.verified_blocks - verified >= CONVERSATIONS * PREFIX_CHUNKS * K  # the harness read them bit-exact
        # the batch's new chunks made room by evicting the unrelated prompts (seen once), never a conversation
        assert 0 < st["cpu_evictions"] <= UNRELATED * (PREFIX_CHUNKS + WINDOW_CHUNKS), st
        assert_clean(eng)
    finally:
        eng.close()


def _run_with_movers_caught_up(eng: Engine, timeout: float = 30.0) -> None:
    """Step until no request is left, each step only once the workers' movers ran every job handed to them: a window
    block vLLM frees mid-prefill goes to the same request's next chunk a step later, and a store not begun by then
    is cancelled (never copied from someone else's KV); on a loaded 2-core box that lost turn-1 chunks at random."""
    deadline = time.monotonic() + timeout
    while eng.sched.has_requests():
        eng.step()
        while any(w.connector.worker.front.depth for w in eng.workers):
            assert time.monotonic() < deadline, "movers did not catch up"
            time.sleep(0.001)
    eng.flush()


@pytest.fixture(scope="module")
def padded_dir(tmp_path_factory):
    return models.write_model_dir(str(tmp_path_factory.mktemp("gemma3pad") / "gemma3pad"), "gemma3pad")


@pytest.mark.parametrize("load_mode,async_sched", [("async", False), ("async", True), ("layerwise", False)],
                         ids=["async", "async-sched", "layerwise"])
def test_hybrid_loads_between_steps_never_deadlock_a_full_pool(padded_dir, load_mode, async_sched):
    """Ten hits loaded between steps on a pool where few fit: vLLM admits such a load if the whole request fits
    the free blocks, but for window groups the rest needs more than it counted, so five admitted loads held 60
    blocks each and waited for 144 more with 99 free: no request ran again (before the fix). With at most one
    such hybrid load waiting for its first step, every request finishes, every load bit-exact."""
    eng = Engine.create(padded_dir, {"chunk_blocks": K, "cpu_bytes": 1 << 30, "load_mode": load_mode},
                        shape="gemma3pad", num_blocks=400, max_model_len=1000, max_batched=256,
                        async_sched=async_sched)
    try:
        groups = eng.sched.kv_cache_manager.kv_cache_config.kv_cache_groups
        assert [len(g.layer_names) for g in groups].count(1) == 1 and len(groups) == 9  # vLLM padded one group
        prefix = 8 * CHUNK
        firsts = []
        for i in range(CONVERSATIONS):
            firsts.append(eng.add(f"c{i}-t1", prompt(100 + i, prefix), max_tokens=4))
            _run_with_movers_caught_up(eng)
        eng.settle()
        assert eng.sched.reset_prefix_cache()  # every hit now comes from the CPU tier
        before, verified = eng.connector.stats()["sched_hit_tokens_cpu"], eng.verified_blocks
        batch = [eng.add(f"c{i}-t2", _follow(a, 400 + i) + prompt(500 + i, 260), max_tokens=4)
                 for i, a in enumerate(firsts)]
        eng.run(max_steps=3000, timeout=60)
        eng.settle()
        st = eng.connector.stats()
        assert all(r.is_finished() for r in batch)
        assert st["sched_hit_tokens_cpu"] - before == CONVERSATIONS * prefix, st  # every turn-1 chunk loads
        assert eng.verified_blocks - verified >= CONVERSATIONS * 8 * K
        if load_mode == "async":
            assert st["sched_async_hybrid_deferred"] > 0, st
        else:  # loads inside the step allocate the whole request at once: nothing held back
            assert st["sched_async_hybrid_deferred"] == 0, st
        assert_clean(eng)
    finally:
        eng.close()
