"""Tail pieces of sliding-window hybrids: the full blocks after a prompt's last whole chunk, stored per group.

vLLM's real Scheduler with the harness of ``harness.py`` (every block a forward reads is checked byte for byte
against its token prefix: every full-attention block, the window's blocks of a sliding-window layer), on the
``gptoss`` (2 groups, a 2-block window) and ``gemma3`` (6 groups, 3-block windows) shapes of ``models.py``, 4-block
chunks of 16-token blocks. A hit ending at block ``T`` inside chunk ``e`` reads every full-attention block below
``T`` and each window's blocks ``[T - window, T)``: the window parts kept for boundary ``e`` and the tail piece's
parts. Mamba hybrids keep no tail pieces (a state at a tail's end is not kept).
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tests.connector.vllm.harness import BS, Gate  # noqa: E402
from tests.connector.vllm.test_hybrid import (  # noqa: E402
    FULL_BLOCK,
    K,
    VLLM_032,
    WINDOW_BYTES,
    WINDOW_PARTS,
    _disk_engine,
    assert_clean,
    make,
    model_dirs,  # noqa: F401  (the fixture)
    patient_fences,  # noqa: F401  (autouse fixture)
    prompt,
    turn2,
)
from tests.connector.vllm.test_hybrid import cfg as hybrid_cfg  # noqa: E402
from tiered_kv.connector.vllm.geometry import Geometry, GroupGeo  # noqa: E402
from tiered_kv.connector.vllm.parts import PartHit, PartPlanner  # noqa: E402
from tiered_kv.connector.vllm.state import TAIL_MARK  # noqa: E402


def cfg(**kw) -> dict:
    """The hybrid tests' config with tail pieces on for sliding-window hybrids (``tail_chunks: true``; the default
    ``auto`` leaves them off there, ``test_tail_chunks_off_hits_whole_chunks_only``)."""
    return hybrid_cfg(**{"tail_chunks": True, **kw})


#: turn 1: two whole chunks, a 3-block tail and 4 tokens of a partial block
TURN1 = 2 * K * BS + 3 * BS + 4
GROUPS = {"gptoss": 2, "gemma3": 6}
NUM_BLOCKS_TIGHT = {"gptoss": 80, "gemma3": 200}  # GPU blocks where two prefills re-use each other's freed blocks


def _tail_parts(eng) -> list[bytes]:
    """The tail pieces' part keys the planner holds (namespace, TAIL_MARK, a 32-byte block hash[, group suffix])."""
    ns = eng.connector.ns.prefix
    return [k for k, _ in eng.connector.planner.chain.index.items()
            if k[len(ns):len(ns) + 1] == TAIL_MARK and len(k) >= len(ns) + 1 + 32]


def _turn(eng, rid: str, ids: list[int], max_tokens: int = 3):
    r = eng.add(rid, ids, max_tokens=max_tokens)
    eng.run()
    eng.settle()
    return r


def _hit_bytes(eng, blocks: int) -> int:
    """Bytes a hit ending at block ``blocks`` loads into one rank: every full-attention block, each window."""
    geo = eng.connector.geo
    return sum((blocks if g.kind == "full" else g.window_blocks) * g.block_nbytes for g in geo.groups)


def _turn2(eng, a, blocks: int, tails: int = 1):
    """Turn 2 over ``a``'s prefix after vLLM's GPU cache was emptied: it hits ``blocks`` blocks from the CPU tier
    (``tails`` of the hits with a tail piece), vLLM computes only what follows, the bytes loaded are those of a hit
    ending there and every block the forwards read was checked byte for byte. Returns (the request, the
    connector's stats)."""
    assert eng.sched.reset_prefix_cache()  # vLLM's GPU cache holds nothing of turn 1
    verified = eng.verified_blocks
    b = _turn(eng, "t2", turn2(a), max_tokens=2)
    st = eng.connector.stats()
    assert st["sched_hit_tokens_cpu"] == blocks * BS and st["sched_tail_hits"] == tails, st
    assert eng.cached_at_start[b.request_id] == blocks * BS  # vLLM computes only what follows the hit
    assert eng.workers[0].connector.stats()["bytes_loaded"] == _hit_bytes(eng, blocks)
    assert eng.verified_blocks - verified >= blocks
    return b, st


@pytest.mark.parametrize("shape", ["gptoss", "gemma3"])
@pytest.mark.parametrize("load_mode", ["layerwise", "async"])
@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async"])
def test_turn2_hits_whole_chunks_and_the_tail_bit_exact(model_dirs, shape, load_mode, async_sched):
    eng = make(model_dirs, shape, cfg(load_mode=load_mode), async_sched=async_sched)
    try:
        assert eng.connector.planner._tails
        a = _turn(eng, "t1", prompt(51, TURN1))
        st = eng.connector.stats()
        groups = GROUPS[shape]
        # 2 full-attention parts, the window parts before boundary 2, one part of the tail per group
        assert st["resident_cpu"] == 2 + WINDOW_PARTS[shape] + groups and st["sched_tail_stores"] == 1, st
        tails = _tail_parts(eng)
        key = eng.connector.ns.prefix + TAIL_MARK + a.block_hashes[2 * K + 3 - 1]
        assert len(tails) == groups and key in tails  # the main group's part is named by the tail key itself
        # the tail parts: every full-attention block of the piece, each window's blocks in the window before its end
        window = sum(min(3, g.window_blocks) * g.block_nbytes for g in eng.connector.geo.groups if g.kind == "swa")
        full = sum(g.chunk_blocks * g.block_nbytes for g in eng.connector.geo.groups if g.kind == "full")
        assert st["sched_bytes_stored"] == 2 * full + WINDOW_BYTES[shape] + 3 * FULL_BLOCK[shape] + window, st
        assert eng.sched.reset_prefix_cache()  # vLLM's GPU cache holds nothing of turn 1
        verified = eng.verified_blocks
        b = _turn(eng, "t2", turn2(a), max_tokens=2)
        st = eng.connector.stats()
        assert st["sched_hit_tokens_cpu"] == (2 * K + 3) * BS, st
        assert st["sched_tail_hits"] == 1 and st["sched_hit_tokens_tail"] == 3 * BS, st
        assert eng.cached_at_start[b.request_id] == (2 * K + 3) * BS  # vLLM computes only what follows it
        assert eng.workers[0].connector.stats()["bytes_loaded"] == _hit_bytes(eng, 2 * K + 3)
        assert eng.verified_blocks - verified >= 2 * K + 3  # every block the forwards read, byte for byte
        assert b.is_finished()
        # turn 2 stored chunk 2 (the tail's chunk, complete now) and its own 1-block tail: turn 1's tail piece, covered
        # by that chunk, is dropped with every group's part
        assert st["sched_tail_stores"] == 2 and st["sched_tails_superseded"] == 1, st
        assert not set(tails) & set(_tail_parts(eng)) and len(_tail_parts(eng)) == groups
        assert_clean(eng)
    finally:
        eng.close()


@pytest.mark.parametrize("shape", ["gptoss", "gemma3"])
def test_staged_in_step_copy_loads_the_tail_bit_exact(model_dirs, shape):
    """``in_step_copy: staged`` (one staging copy per run of slots, then a scatter per group's layers)."""
    eng = make(model_dirs, shape, cfg(in_step_copy="staged"))
    try:
        a = _turn(eng, "t1", prompt(61, TURN1))
        _turn2(eng, a, 2 * K + 3)
        for w in eng.workers:
            assert all(c._staged is not None for c in w.connector.worker.in_step.copiers)
        assert_clean(eng)
    finally:
        eng.close()


@pytest.mark.parametrize("shape", ["gptoss", "gemma3"])
def test_a_one_block_tail_reads_the_window_before_its_chunk(model_dirs, shape):
    """A 1-block tail: the window before its end reaches into the previous chunk, whose window part was kept for
    the prompt's whole-chunk boundary."""
    eng = make(model_dirs, shape, cfg())
    try:
        a = _turn(eng, "t1", prompt(52, 2 * K * BS + BS + 4))
        assert eng.connector.stats()["sched_tail_stores"] == 1
        _turn2(eng, a, 2 * K + 1)
        assert_clean(eng)
    finally:
        eng.close()


def test_a_window_of_several_chunks_before_the_tail(model_dirs):
    """``gemma2``: a 16-block window over 4-block chunks; a 1-block tail after 6 chunks reads the window parts of
    chunks 2 to 5 (from block 9 on) and both groups' parts of the tail."""
    eng = make(model_dirs, "gemma2", cfg())
    try:
        a = _turn(eng, "t1", prompt(60, 6 * K * BS + BS + 4))
        st = eng.connector.stats()
        assert st["resident_cpu"] == 6 + 4 + 2 and st["sched_tail_stores"] == 1, st
        _turn2(eng, a, 6 * K + 1)
        assert_clean(eng)
    finally:
        eng.close()


@pytest.mark.parametrize("value", [False, "auto"], ids=["off", "auto"])
@pytest.mark.parametrize("shape", ["gptoss", "gemma3"])
def test_tail_chunks_off_hits_whole_chunks_only(model_dirs, shape, value):
    """``false``, and the default ``auto`` on a sliding-window hybrid: no tail piece stored or hit (``auto`` keeps
    them for one full-attention or MLA group: ``test_tails.py``)."""
    eng = make(model_dirs, shape, hybrid_cfg() if value == "auto" else cfg(tail_chunks=value))
    try:
        assert not eng.connector.planner._tails
        a = _turn(eng, "t1", prompt(53, TURN1))
        st = eng.connector.stats()
        assert st["resident_cpu"] == 2 + WINDOW_PARTS[shape] and st["sched_tail_stores"] == 0, st
        _turn2(eng, a, 2 * K, tails=0)
        assert_clean(eng)
    finally:
        eng.close()


def test_prompt_shorter_than_a_chunk_is_stored_as_a_tail(model_dirs):
    eng = make(model_dirs, "gptoss", cfg())
    try:
        a = _turn(eng, "t1", prompt(54, (K - 1) * BS + 5))
        st = eng.connector.stats()
        assert st["resident_cpu"] == 2 and st["sched_tail_stores"] == 1, st  # one tail part per group
        _turn2(eng, a, K - 1)
        assert_clean(eng)
    finally:
        eng.close()


def test_n_minus_1_rule_holds_for_a_tail(model_dirs):
    """The same prompt again, ending on a block boundary: its last full block may not come from the tail."""
    eng = make(model_dirs, "gemma3", cfg())
    try:
        p = prompt(55, 2 * K * BS + 3 * BS)
        _turn(eng, "a", p, max_tokens=1)
        assert eng.sched.reset_prefix_cache()
        b = _turn(eng, "b", p, max_tokens=1)
        st = eng.connector.stats()
        # the 3-block tail cannot load (its last block holds the last prompt token); no 2-block tail exists
        assert st["sched_hit_tokens_cpu"] == 2 * K * BS and st["sched_tail_hits"] == 0, st
        assert eng.cached_at_start[b.request_id] == 2 * K * BS
        assert_clean(eng)
    finally:
        eng.close()


def test_on_finish_stores_the_tail_too(model_dirs):
    eng = make(model_dirs, "gptoss", cfg(store_policy="on_finish"))
    try:
        a = _turn(eng, "t1", prompt(56, TURN1))
        assert eng.connector.stats()["sched_tail_stores"] == 1
        _turn2(eng, a, 2 * K + 3)
        assert_clean(eng)
    finally:
        eng.close()


def test_local_hit_inside_the_tail_chunk_loads_only_the_rest(model_dirs):
    """vLLM's own cache holds the start of turn 1's prefix, into the tail's chunk: the connector loads from there."""
    eng = make(model_dirs, "gptoss", cfg())
    try:
        a = _turn(eng, "t1", prompt(57, TURN1))
        assert eng.sched.reset_prefix_cache()
        _turn(eng, "short", list(a.prompt_token_ids[:(2 * K + 1) * BS + 2]), max_tokens=1)
        before = eng.connector.stats()["sched_hit_tokens_cpu"]
        verified = eng.verified_blocks
        b = _turn(eng, "t2", turn2(a), max_tokens=2)
        st = eng.connector.stats()
        local = eng.cached_at_start[b.request_id] - (st["sched_hit_tokens_cpu"] - before)
        assert eng.cached_at_start[b.request_id] == (2 * K + 3) * BS, (local, st)
        # vLLM holds blocks 0..8 (the short request's full blocks): the connector loads blocks 9 and 10 of the tail
        assert local == (2 * K + 1) * BS and st["sched_tail_hits"] == 1 and st["sched_hit_tokens_tail"] == 2 * BS, (
            local, st)
        assert eng.verified_blocks - verified >= 2
        assert_clean(eng)
    finally:
        eng.close()


def test_tail_on_disk_is_promoted_and_hit_after_a_restart(model_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    extra = {"write_policy": "write_through", "tail_chunks": True}
    parts = 2 + WINDOW_PARTS["gptoss"] + GROUPS["gptoss"]
    first = _disk_engine(model_dirs, tmp_path, "gptoss", cpu_slots=parts + 2, extra=extra)
    try:
        a = _turn(first, "t1", prompt(58, TURN1))
        assert first.connector.stats()["resident_disk"] == parts
        conv = turn2(a)
    finally:
        first.close()
    second = _disk_engine(model_dirs, tmp_path, "gptoss", cpu_slots=parts + 2, extra=extra)  # same disk path
    try:
        assert second.connector.stats()["resident_disk"] == parts  # tail parts are adopted like any other part
        b = _turn(second, "t2", conv, max_tokens=2)
        st = second.connector.stats()
        assert st["sched_promotions"] == 1 and st["sched_tail_hits"] == 1, st
        assert st["sched_hit_tokens_cpu"] == (2 * K + 3) * BS and st["sched_hit_tokens_disk"] == 0, st
        assert second.cached_at_start[b.request_id] == (2 * K + 3) * BS
        assert second.verified_blocks >= 2 * K + 3
        assert_clean(second)
    finally:
        second.close()


@pytest.mark.skipif(not VLLM_032, reason="vLLM 0.26 refuses Mamba hybrids")
def test_mamba_hybrids_keep_no_tails(model_dirs):
    eng = make(model_dirs, "mamba", cfg())
    try:
        assert not eng.connector.planner._tails  # a Mamba state at a tail's end is not kept
        _turn(eng, "t1", prompt(59, 6 * BS + 5), max_tokens=2)
        assert eng.connector.stats()["sched_tail_stores"] == 0
    finally:
        eng.close()


def _planner(window_blocks: int = 2) -> PartPlanner:
    """A PartPlanner over a sliding-window group and a full-attention group, 4-block chunks of 16-token blocks."""
    groups = (GroupGeo("swa", BS, ("w",), 64, K, K, window_blocks, "swa", index=0),
              GroupGeo("full", BS, ("f",), 64, K, K, 0, "full", index=1))
    geo = Geometry(BS, K, ("w", "f"), 128, 1, "test", groups, BS)
    return PartPlanner(geo, lambda b: b"k" + b)


def test_a_tail_is_not_stored_when_a_block_a_hit_reads_is_gone():
    parts = _planner()
    full = list(range(1, 12))  # blocks 0..10: two chunks and a 3-block tail
    window = [0] * 9 + [20, 21]  # vLLM freed the window's blocks before 9
    stored = parts.store_tail(b"T", [window, full], 11)
    assert stored is not None
    (wkey, wids), (fkey, fids) = stored
    assert fkey == b"T" and wkey == b"T|part0"  # the main group's part is named by the tail key itself
    assert fids == [-1] * K + [9, 10, 11, -1] and wids == [-1, 20, 21, -1] + [-1] * K  # the window before block 11
    assert parts.store_tail(b"T", [window[:10] + [0], full], 11) is None  # a window block gone: nothing stored
    assert parts.store_tail(b"T", [window, full[:9] + [0, 11]], 11) is None  # a full-attention block gone


def test_vllm_allocating_where_a_tail_hit_holds_nothing_raises():
    """A hit ending at block 9 (two chunks and a 1-block tail) reads the window's blocks 7 and 8 only: a block vLLM
    allocated at position 6 would be computed on garbage."""
    parts = _planner()
    hit = PartHit(2, [b"a"] * 5, [(0, 1), (1, 0), (1, 1), (2, 0), (2, 1)], [0] * 5, tail=1, tail_key=b"T")
    full = list(range(1, 13))
    ok = [0] * 7 + [30, 31, 32, 33, 34]  # null blocks before the window, then its blocks and those to compute
    none = [-1] * K
    assert parts.load_ids([ok, full], hit, 0, 0) == (
        none + [1, 2, 3, 4]  # chunk 0: full attention only
        + [-1, -1, -1, 30] + none + none + [5, 6, 7, 8]  # chunk 1: the window's block 7, full attention
        + [31, -1, -1, -1] + none + none + [9, -1, -1, -1])  # the tail: block 8 in both groups, nothing past it
    with pytest.raises(RuntimeError, match="position 6"):
        parts.load_ids([[0] * 6 + [29] + ok[7:], full], hit, 0, 0)


@pytest.mark.parametrize("gated", [False, True], ids=["free", "gated"])
@pytest.mark.parametrize("shape", ["gptoss", "gemma3"])
def test_tails_of_two_chunked_prefills_sharing_freed_blocks_are_bit_exact(model_dirs, shape, gated):
    """Two prompts prefilled at once in 32-token steps: vLLM frees each one's out-of-window blocks while it runs and
    hands them to the other. Each tail is stored from blocks still its own (``gated``: every store is held until
    vLLM re-allocates one of its blocks, so the fence keeps the bytes right); turn 2 of both hits it bit-exact."""
    eng = make(model_dirs, shape, cfg(load_mode="async"), max_batched=32, num_blocks=NUM_BLOCKS_TIGHT[shape],
               max_model_len=384)
    gate = Gate(eng.workers[0].connector.worker, open_on_fence=True) if gated else None
    try:
        firsts = [eng.add(rid, prompt(80 + i, TURN1), max_tokens=2) for i, rid in enumerate(("a", "b"))]
        eng.run()
        if gate is not None:
            gate.open()
        eng.settle()
        assert eng.connector.stats()["sched_tail_stores"] == 2
        assert eng.sched.reset_prefix_cache()
        seconds = [eng.add(f"{r.request_id}2", turn2(r), max_tokens=2) for r in firsts]
        eng.run()
        eng.settle()
        st = eng.connector.stats()
        assert st["sched_tail_hits"] == 2, st
        if VLLM_032:  # re-used window blocks were taken out of the tables (0.26 hands freed blocks on later)
            assert st["sched_stale_blocks_dropped"] > 0, st
        assert all(eng.cached_at_start[r.request_id] == (2 * K + 3) * BS for r in seconds)
        assert_clean(eng)
    finally:
        if gate is not None:
            gate.open()
        eng.close()
