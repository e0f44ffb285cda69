"""Hybrid models (sliding window + full attention, Mamba + attention) through vLLM's real Scheduler.

vLLM's hybrid KV cache manager is on (the connector is ``SupportsHMA``), the KV cache groups
come from vLLM's own grouping code and every worker's KV tensors from vLLM's own allocation
(groups alias the same bytes). Before every forward the harness checks what the forward reads:
every block of a full-attention layer, the window's blocks of a sliding-window layer, the
recurrent state of a Mamba layer, on every rank. A wrong byte from a load fails the test there;
with several groups the connector may never report a block as a load error, so ``discarded_reads``
must stay 0.

Shapes (``models.py``): ``gptoss`` (2 groups; a 4-block chunk, a 2-block window), ``gemma3`` (6 groups;
a 3-block window), ``mamba`` (Mamba "align" + full attention). Each group's share of a chunk is a record
of its own (a part, one slot): full attention for every chunk, a window only before a stored prefix's
end, a Mamba state only where one was kept.
"""
from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: E402

from tests.connector.vllm import models  # noqa: E402
from tests.connector.vllm.harness import BS, Engine, Gate  # noqa: E402
from tiered_kv.errors import ConfigError  # noqa: E402

#: vLLM >= 0.32 (CI); the tests also run on vLLM 0.26's scheduler code (docs/vllm.md, "Tests")
VLLM_032 = "supports_divergent_local_hybrid_hits" in vars(KVConnectorBase_V1)
mamba_032 = pytest.mark.skipif(not VLLM_032,
                               reason="vLLM 0.26 refuses Mamba hybrids (test_mamba_on_vllm_026_is_refused)")

K = 4  # blocks per chunk
NUM_BLOCKS = {"gptoss": 96, "gemma3": 200, "mamba": 96}
#: bytes of one slot (any group's part of a chunk): gptoss 4 blocks of 2 layers x 2048 B; gemma3 4 blocks of
#: one 2048 B layer
SLOT_BYTES = {"gptoss": 4 * 4096, "gemma3": 4 * 2048}
#: a hit's (and a prefix's stored) bytes beyond its full-attention blocks: the window at its end
WINDOW_BYTES = {"gptoss": 2 * 4096, "gemma3": 5 * 3 * 2048}
#: parts a prefix of whole chunks keeps beside its full-attention ones: the windows' chunks at its end
WINDOW_PARTS = {"gptoss": 1, "gemma3": 5}
FULL_BLOCK = {"gptoss": 4096, "gemma3": 2048}


def prefix_bytes(shape: str, chunks: int) -> int:
    """Bytes a stored prefix of ``chunks`` whole chunks takes (and a hit on it loads)."""
    return chunks * K * FULL_BLOCK[shape] + WINDOW_BYTES[shape]


def cfg(**kw) -> dict:
    return {"chunk_blocks": K, "cpu_bytes": "4MiB", **kw}


@pytest.fixture(autouse=True)
def patient_fences(monkeypatch):
    """Give a queued store a second to start before a fence cancels it (2 ms by default).

    vLLM hands a request's out-of-window blocks on a step after it stored them; on this shared
    2-core box the worker's mover thread may not start a store within 2 ms of the next step, and a
    cancelled store makes hit counts vary. Cancelling is tested with the gate (and in
    ``test_worker_in_step.py``); here every store should land.
    """
    import tiered_kv.connector.vllm.worker as worker

    monkeypatch.setattr(worker, "FENCE_PATIENCE_S", 1.0)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid-models")
    return {name: models.write_model_dir(str(root / name), name) for name in models.HF_CONFIGS}


def make(model_dirs, shape: str, extra: dict, **kw) -> Engine:
    kw.setdefault("num_blocks", NUM_BLOCKS.get(shape, 96))
    kw.setdefault("max_model_len", 512)
    return Engine.create(model_dirs[shape], extra, shape=shape, **kw)


def prompt(seed: int, n: int) -> list[int]:
    return [100 + (seed * 7919 + i * 31) % 800 for i in range(n)]


def turn2(first, seed: int = 99) -> list[int]:
    return list(first.prompt_token_ids) + list(first.output_token_ids) + prompt(seed, 40)


def assert_clean(eng: Engine) -> None:
    """Nothing in flight, pinned or tracked; no block was ever reported as a load error."""
    st = eng.connector.stats()
    for key in ("inflight_jobs", "pinned", "waiting", "gpu_blocks_busy", "open_puts", "open_gets",
                "tracked_requests", "tracked_window_blocks", "promotions_pending"):
        assert st[key] == 0, (key, st)
    for w in eng.workers:
        ws = w.connector.stats()
        assert ws["jobs_unreported"] == 0 and ws["loads_pending_requests"] == 0, ws
    assert eng.discarded_reads == 0  # several KV cache groups: vLLM takes no block errors
    chain = eng.connector.planner.chain
    assert chain.used[0] == chain.resident(0)


def test_geometry_keeps_one_part_per_group(model_dirs):
    eng = make(model_dirs, "gptoss", cfg())
    try:
        geo = eng.connector.geo
        assert geo.parts and [(g.kind, g.chunk_blocks, g.stored, g.window_blocks) for g in geo.groups] == [
            ("swa", 4, 4, 2), ("full", 4, 4, 0)]
        assert geo.rank_chunk_nbytes == SLOT_BYTES["gptoss"] and not geo.block_level_errors
        assert geo.slot_blocks == 8 and geo.plane_rows == [4, 4]
    finally:
        eng.close()


@pytest.mark.parametrize("swa_store,window_parts", [("window", 1), ("all", 5)])
def test_window_parts_are_kept_at_the_prefix_end_or_everywhere(model_dirs, swa_store, window_parts):
    """``window``: the window's part only for the last chunk (the window is 2 blocks); ``all``: every chunk's."""
    eng = make(model_dirs, "gptoss", cfg(swa_store=swa_store))
    try:
        eng.add("a", prompt(30, 20 * BS + 5), max_tokens=2)
        eng.run()
        eng.settle()
        st = eng.connector.stats()
        assert st["resident_cpu"] == 5 + window_parts, st
        assert st["sched_bytes_stored"] == 5 * K * 4096 + window_parts * 2 * 4096  # the window's 2 blocks a chunk
    finally:
        eng.close()


@pytest.mark.parametrize("shape", ["gptoss", "gemma3"])
@pytest.mark.parametrize("load_mode", ["layerwise", "async"])
@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async"])
def test_multiturn_loads_every_group_bit_exact(model_dirs, shape, load_mode, async_sched):
    """Turn 2 hits turn 1's prefix in the CPU tier: every group's blocks a hit reads, and only those, load."""
    _multiturn(model_dirs, shape, cfg(load_mode=load_mode), async_sched)


@pytest.mark.parametrize("shape", ["gptoss", "gemma3"])
def test_staged_in_step_loads_every_group_bit_exact(model_dirs, shape):
    """``in_step_copy: staged`` (one staging copy per run of slots, then a scatter per group's layers)."""
    eng = _multiturn(model_dirs, shape, cfg(in_step_copy="staged"), False)
    for w in eng.workers:
        assert all(c._staged is not None for c in w.connector.worker.in_step.copiers)  # every group went staged


def _multiturn(model_dirs, shape: str, extra: dict, async_sched: bool) -> Engine:
    load_mode = extra.get("load_mode", "layerwise")
    eng = make(model_dirs, shape, extra, async_sched=async_sched)
    try:
        a = eng.add("t1", prompt(1, 12 * BS + 5), max_tokens=3)
        eng.run()
        eng.settle()
        st = eng.connector.stats()
        assert st["resident_cpu"] == 3 + WINDOW_PARTS[shape], st
        assert st["sched_bytes_stored"] == prefix_bytes(shape, 3), st
        assert eng.sched.reset_prefix_cache()  # the GPU forgets turn 1
        verified = eng.verified_blocks
        b = eng.add("t2", turn2(a), max_tokens=2)
        eng.run()
        eng.settle()
        st = eng.connector.stats()
        assert st["sched_hit_tokens_cpu"] == 12 * BS, st
        assert st["sched_sync_loads"] == (1 if load_mode != "async" else 0), st
        assert eng.verified_blocks - verified >= 12
        geo = eng.connector.geo
        # bytes per hit: every full-attention block, and each window group's window at the boundary only
        window = sum(g.window_blocks * g.block_nbytes for g in geo.groups if g.kind == "swa")
        full = sum(g.chunk_blocks * g.block_nbytes for g in geo.groups if g.kind == "full")
        assert window == WINDOW_BYTES[shape]
        assert eng.workers[0].connector.stats()["bytes_loaded"] == 3 * full + window
        assert b.is_finished()
        assert_clean(eng)
    finally:
        eng.close()
    return eng


@pytest.mark.parametrize("tails,hit1,hit2", [(True, 6, 11), (False, 4, 8)], ids=["tails", "no-tails"])
def test_three_turns_extend_the_stored_prefix(model_dirs, tails, hit1, hit2):
    """Each turn loads the previous turns' chunks (and, with tail pieces, the full blocks after them) and stores
    its own new ones after them."""
    eng = make(model_dirs, "gptoss", cfg(tail_chunks=tails))
    try:
        conv = prompt(2, 6 * BS + 1)
        hits = []
        for turn in range(3):
            r = eng.add(f"turn{turn}", conv, max_tokens=2)
            eng.run()
            eng.settle()
            hits.append(eng.connector.stats()["sched_hit_tokens_cpu"])
            assert eng.sched.reset_prefix_cache()
            conv = list(r.prompt_token_ids) + list(r.output_token_ids) + prompt(10 + turn, 5 * BS)
        assert hits[0] == 0 and hits[1] == hit1 * BS and hits[2] - hits[1] == hit2 * BS, hits
        assert_clean(eng)
    finally:
        eng.close()


@pytest.mark.parametrize("async_sched", [False, True])
def test_a_hit_gets_its_first_token_after_as_many_steps_as_a_miss(model_dirs, async_sched):
    """A CPU-tier hit adds no engine step before the first token (an in-step load runs inside the step that
    computes the rest): the c1 cells of 2026-11-29's serving runs were slower than recompute, and this rules out
    the scheduler side as the cause."""
    eng = make(model_dirs, "gptoss", cfg(), async_sched=async_sched)

    def steps_to_first_token(rid: str, ids: list[int]) -> int:
        r = eng.add(rid, ids, max_tokens=4)
        n0 = eng.steps
        while not r.output_token_ids:
            eng.step()
            assert eng.steps - n0 < 20, rid
        return eng.steps - n0

    try:
        a = eng.add("t1", prompt(1, 12 * BS + 5), max_tokens=3)
        eng.run()
        eng.settle()
        assert eng.sched.reset_prefix_cache()
        t2 = turn2(a)
        hit = steps_to_first_token("t2", t2)
        eng.run()
        eng.settle()
        assert eng.connector.stats()["sched_hit_tokens_cpu"] == 12 * BS
        miss = steps_to_first_token("miss", prompt(7, len(t2)))
        eng.run()
        eng.settle()
        assert eng.connector.stats()["sched_hit_tokens_cpu"] == 12 * BS  # the second prompt found nothing
        assert hit == miss == (2 if async_sched else 1), (hit, miss)  # async: outputs land one step late
        assert_clean(eng)
    finally:
        eng.close()


def test_full_prompt_hit_leaves_one_token(model_dirs):
    """n-1 rule before the lookup: a prompt of exactly two chunks hits one, so the window at the hit
    boundary is the window the stored chunk was stored for."""
    eng = make(model_dirs, "gemma3", cfg())
    try:
        eng.add("a", prompt(3, 8 * BS), max_tokens=1)
        eng.run()
        eng.settle()
        # 2 full-attention parts; the windows before both possible hit ends (2, and 1 for a re-sent prompt)
        assert eng.connector.stats()["resident_cpu"] == 2 + 2 * 5
        assert eng.sched.reset_prefix_cache()
        eng.add("b", prompt(3, 8 * BS), max_tokens=2)
        eng.run()
        eng.settle()
        assert eng.connector.stats()["sched_hit_tokens_cpu"] == K * BS
        assert_clean(eng)
    finally:
        eng.close()


def test_local_prefix_hit_extends_with_loaded_chunks(model_dirs):
    """vLLM's own prefix cache holds the start of the prompt (full attention up to L, the window at L);
    the connector loads from L on: the rest of the chunk L falls in, then whole chunks."""
    eng = make(model_dirs, "gptoss", cfg())
    try:
        a = eng.add("x", prompt(4, 20 * BS + 3), max_tokens=1)
        eng.run()
        eng.settle()
        assert eng.sched.reset_prefix_cache()
        eng.add("y", prompt(4, 6 * BS + 5), max_tokens=1)  # vLLM caches 6 blocks of x's prefix itself
        eng.run()
        eng.settle()
        before = eng.connector.stats()["sched_hit_tokens_cpu"]
        verified = eng.verified_blocks
        z = eng.add("z", turn2(a), max_tokens=2)
        eng.run()
        eng.settle()
        loaded = eng.connector.stats()["sched_hit_tokens_cpu"] - before
        assert loaded == 20 * BS - 6 * BS, loaded  # from the local hit L = 6 blocks to the last chunk
        assert z.is_finished() and eng.verified_blocks > verified
        assert_clean(eng)
    finally:
        eng.close()


def _disk_engine(model_dirs, tmp_path, shape="gptoss", cpu_slots=3, **kw):
    extra = cfg(cpu_bytes=cpu_slots * SLOT_BYTES[shape], disk_path=str(tmp_path / "kv"), disk_bytes="4MiB",
                disk_load_policy="always")
    extra.update(kw.pop("extra", {}))
    return make(model_dirs, shape, extra, max_batched=64, **kw)


@pytest.mark.parametrize("shape", ["gptoss", "gemma3"])
def test_disk_hits_are_promoted_to_cpu_then_loaded(model_dirs, tmp_path, shape):
    """With several groups a disk hit moves up to the CPU tier first (vLLM is told to ask again), then
    loads from there: a bad disk record can only shorten the hit, never fail a load."""
    parts = 5 + WINDOW_PARTS[shape]  # a 5-chunk prefix
    eng = _disk_engine(model_dirs, tmp_path, shape, cpu_slots=parts + 2)
    try:
        a = eng.add("big", prompt(6, 20 * BS + 5), max_tokens=2)
        eng.run()
        eng.add("filler", prompt(7, 20 * BS + 5), max_tokens=2)  # pushes most of big's parts down to disk
        eng.run()
        eng.settle()
        st = eng.connector.stats()
        assert st["resident_cpu"] == parts + 2 and st["resident_disk"] >= parts, st
        assert eng.sched.reset_prefix_cache()
        verified = eng.verified_blocks
        b = eng.add("big-2", turn2(a), max_tokens=2)
        eng.run()
        eng.settle()
        st = eng.connector.stats()
        assert st["sched_promotions"] == 1, st
        # that promotion's read fed the split's disk rate as a read into the CPU tier
        assert st["sched_rate_reads_cpu"] >= 1 and st["sched_rate_read_bytes_cpu"] > 0, st  # its jobs
        assert st["sched_rate_read_seconds_cpu"] > 0 and st["sched_rate_reads_gpu"] == 0, st
        # no disk->GPU load: the whole hit moved up, then loaded from the CPU tier
        assert st["sched_hit_tokens_disk"] == 0 and st["sched_hit_tokens_cpu"] == 20 * BS, sorted(st.items())
        # the split counts the plan that started the promotion: its disk part was read from disk
        assert st["split_disk_loaded_tokens"] > 0, st
        # (how much of it was still in the CPU tier depends on which of big's parts the filler pushed down first:
        # all of them at times, and then the CPU counter is 0)
        assert st["split_cpu_loaded_tokens"] + st["split_disk_loaded_tokens"] == 20 * BS, st
        assert eng.workers[0].connector.stats()["bytes_from_disk"] > 0  # the promotions
        assert eng.verified_blocks - verified >= 20 and b.is_finished()
        assert_clean(eng)
    finally:
        eng.close()


def test_a_hit_larger_than_the_cpu_tier_is_no_hit(model_dirs, tmp_path):
    """Several groups load only from the CPU tier, and a hit ends only where its window was kept: a disk hit
    with more parts than the CPU tier holds is recomputed (promoting its first parts would buy nothing)."""
    eng = _disk_engine(model_dirs, tmp_path, "gptoss", cpu_slots=3)
    try:
        a = eng.add("big", prompt(6, 20 * BS + 5), max_tokens=2)
        eng.run()
        eng.settle()
        assert eng.connector.stats()["resident_disk"] >= 3
        assert eng.sched.reset_prefix_cache()
        b = eng.add("big-2", turn2(a), max_tokens=2)
        eng.run()
        eng.settle()
        st = eng.connector.stats()
        assert st["sched_promotions"] == 0 and st["sched_hit_tokens_cpu"] == 0, st
        assert b.is_finished()
        assert_clean(eng)
    finally:
        eng.close()


def test_corrupt_disk_record_is_a_miss_not_a_load_error(model_dirs, tmp_path):
    eng = _disk_engine(model_dirs, tmp_path, cpu_slots=5, extra={"write_policy": "write_through"})
    try:
        a = eng.add("victim", prompt(7, 12 * BS + 1), max_tokens=2)
        eng.run()
        eng.settle()
        disk = eng.workers[0].connector.worker.disk
        with open(os.path.join(disk.path, "payload.bin"), "r+b") as f:
            size = f.seek(0, 2)
            f.seek(0)
            f.write(bytes([0xA5]) * size)
        eng.add("filler", prompt(8, 10 * BS + 1), max_tokens=1)  # pushes the victim out of the CPU tier
        eng.run()
        eng.settle()
        assert eng.sched.reset_prefix_cache()
        b = eng.add("victim-2", turn2(a), max_tokens=2)
        eng.run()
        eng.settle()
        assert b.is_finished() and b.status.name == "FINISHED_LENGTH_CAPPED"
        assert eng.workers[0].connector.stats()["corrupt_items"] >= 1
        assert_clean(eng)  # discarded_reads == 0: nothing was reported, nothing wrong was read
    finally:
        eng.close()


def test_restart_hits_chunks_written_by_the_previous_engine(model_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    extra = {"write_policy": "write_through"}
    first = _disk_engine(model_dirs, tmp_path, "gemma3", cpu_slots=19, extra=extra)
    try:
        a = first.add("old", prompt(9, 12 * BS + 3), max_tokens=2)
        first.run()
        first.settle()
        assert first.connector.stats()["resident_disk"] == 3 + WINDOW_PARTS["gemma3"]
        conv = turn2(a)
    finally:
        first.close()
    second = _disk_engine(model_dirs, tmp_path, "gemma3", cpu_slots=19, extra=extra)  # same disk path
    try:
        assert second.connector.stats()["resident_disk"] == 3 + WINDOW_PARTS["gemma3"]  # adopted at start-up
        second.add("new", conv, max_tokens=2)
        second.run()
        second.settle()
        st = second.connector.stats()
        assert st["sched_hit_tokens_cpu"] == 12 * BS and st["sched_promotions"] == 1, st
        assert second.verified_blocks >= 12
        assert_clean(second)
    finally:
        second.close()


@pytest.mark.parametrize("gated", [False, True], ids=["free", "gated"])
@pytest.mark.parametrize("swa_store", ["window", "all"])
def test_window_blocks_freed_mid_request_are_never_stored_after_reuse(model_dirs, swa_store, gated):
    """Chunked prefill of two requests at once: vLLM frees each one's out-of-window blocks while it
    runs and hands them to the other. Stores read only blocks still theirs (the harness checks the
    next turn's loads byte for byte). ``gated``: every store is held until vLLM re-allocates one of
    its blocks, so the fence (wait, or cancel a store not started) is what keeps the bytes right."""
    eng = make(model_dirs, "gptoss", cfg(swa_store=swa_store, load_mode="async"), max_batched=48, num_blocks=80,
               max_model_len=384)
    gate = Gate(eng.workers[0].connector.worker, open_on_fence=True) if gated else None
    try:
        a = eng.add("a", prompt(11, 20 * BS + 1), max_tokens=2)
        b = eng.add("b", prompt(12, 20 * BS + 1), max_tokens=2)
        eng.run()
        if gate is not None:
            gate.open()
        eng.settle()
        st = eng.connector.stats()
        ws = eng.workers[0].connector.stats()
        # every part is stored, or its store was dropped (blocks handed on before it was handed out)
        # or cancelled by a fence (still queued when vLLM handed a block on): a shorter prefix, never wrong KV
        parts = 2 * (5 + (5 if swa_store == "all" else 1))
        assert st["resident_cpu"] + st["sched_stores_dropped_reused"] + ws["stores_cancelled"] == parts, (st, ws)
        if gated and swa_store == "all":
            # a window block was handed on while a store still had to read it (with "window" the stores read only
            # the window at the prompt's end, which the request holds until it finishes)
            assert gate.fenced
        if swa_store == "all" and VLLM_032:  # (0.26 hands the freed blocks on later in this workload)
            assert st["sched_stale_blocks_dropped"] > 0, st  # re-used window blocks were taken out of the tables
        assert eng.sched.reset_prefix_cache()
        verified = eng.verified_blocks
        for r in (a, b):
            eng.add(r.request_id + "-2", turn2(r), max_tokens=2)
            eng.run()
            eng.settle()
        if st["resident_cpu"] == parts:
            assert eng.connector.stats()["sched_hit_tokens_cpu"] == 2 * 20 * BS
        assert eng.verified_blocks - verified >= 2 * 20
        assert_clean(eng)
    finally:
        if gate is not None:
            gate.open()
        eng.close()


@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async"])
def test_preemption_with_stores_in_flight_leaks_nothing(model_dirs, async_sched):
    eng = make(model_dirs, "gptoss", cfg(), num_blocks=40, max_model_len=288, async_sched=async_sched)
    gate = Gate(eng.workers[0].connector.worker, open_on_fence=True)
    try:
        p1 = eng.add("p1", prompt(13, 160), max_tokens=120)
        p2 = eng.add("p2", prompt(14, 160), max_tokens=120)
        eng.run(max_steps=3000)
        gate.open()
        eng.settle()
        assert p1.num_preemptions + p2.num_preemptions >= 1
        assert p1.is_finished() and p2.is_finished()
        assert_clean(eng)
    finally:
        gate.open()
        eng.close()


def test_abort_mid_load_frees_everything(model_dirs):
    eng = make(model_dirs, "gemma3", cfg(load_mode="async"))
    try:
        a = eng.add("a", prompt(15, 8 * BS + 3), max_tokens=2)
        eng.run()
        eng.settle()
        assert eng.sched.reset_prefix_cache()
        gate = Gate(eng.workers[0].connector.worker)
        b = eng.add("b", turn2(a), max_tokens=2)
        eng.run(until=lambda: gate.started > 0)
        assert b.status.name == "WAITING_FOR_REMOTE_KVS"
        eng.abort("b")
        eng.step()
        gate.open()
        eng.settle()
        assert not eng.sched.has_requests()
        assert eng.sched.kv_cache_manager.block_pool.get_num_free_blocks() == eng.num_blocks - 1
        assert_clean(eng)
    finally:
        eng.close()


def test_abort_mid_store_then_block_reuse_is_fenced(model_dirs):
    eng = make(model_dirs, "gptoss", cfg(), num_blocks=40, max_model_len=256)
    gate = Gate(eng.workers[0].connector.worker, open_on_fence=True)
    try:
        eng.add("s", prompt(20, 12 * BS), max_tokens=50)
        eng.step()  # prefill: its chunk stores are held by the gate
        eng.abort("s")
        eng.add("t", prompt(21, 14 * BS), max_tokens=2)  # needs the aborted request's blocks
        eng.run()
        gate.open()
        eng.settle()
        st = eng.workers[0].connector.stats()
        assert gate.fenced and st["fences_waited"] + st["stores_cancelled"] >= 1
        assert eng.requests["t"].is_finished()
        assert_clean(eng)
    finally:
        gate.open()
        eng.close()


def test_on_finish_stores_the_window_vllm_still_holds(model_dirs):
    """``on_finish``: vLLM hands back 0 for window blocks it freed; the window before the prompt's end is
    still held when the request finishes (it is the one its decode reads), so the prefix is stored whole."""
    eng = make(model_dirs, "gptoss", cfg(store_policy="on_finish"))
    try:
        a = eng.add("f1", prompt(16, 12 * BS + 3), max_tokens=2)
        eng.run()
        eng.settle()
        st = eng.connector.stats()
        assert st["resident_cpu"] == 3 + 1 and st["sched_chunks_not_storable"] == 0, st
        assert eng.sched.reset_prefix_cache()
        eng.add("f2", turn2(a), max_tokens=2)
        eng.run()
        eng.settle()
        assert eng.connector.stats()["sched_hit_tokens_cpu"] == 12 * BS
        assert_clean(eng)
    finally:
        eng.close()


def test_copy_that_cannot_start_falls_back_to_a_plain_copy(model_dirs):
    """Several groups: an in-step load whose batched copy cannot start (even as one copy) is done with
    plain torch copies; nothing is reported to vLLM and every byte is right."""
    from tiered_kv.copy import CopyLaunchError

    eng = make(model_dirs, "gptoss", cfg())
    try:
        a = eng.add("t1", prompt(17, 8 * BS + 3), max_tokens=2)
        eng.run()
        eng.settle()
        assert eng.sched.reset_prefix_cache()
        loader = eng.workers[0].connector.worker.in_step

        def broken(*args, **kw):
            raise CopyLaunchError("injected: cuMemcpyBatchAsync returned CUDA_ERROR_INVALID_VALUE")

        for copier in loader.copiers:
            copier.cpu_to_gpu_grouped = broken
            copier.cpu_to_gpu = broken
        verified = eng.verified_blocks
        eng.add("t2", turn2(a), max_tokens=2)
        eng.run()
        eng.settle()
        assert loader.plain_copies == 2  # both groups
        ws = eng.workers[0].connector.stats()
        assert ws["failed_items"] == 0 and ws["sync_loads"] == 1, ws
        assert eng.verified_blocks - verified >= 8
        assert_clean(eng)
    finally:
        eng.close()


# ---------------------------------------------------------------------------------------------- Mamba
@mamba_032
def test_mamba_align_hits_end_where_a_state_was_kept(model_dirs):
    """vLLM 0.32 "align" mode keeps a recurrent state where a step ends on a block boundary (the
    prompt's last full block); a chunk is one block, and a hit ends at the last chunk stored with
    its state, which is loaded with the attention blocks before it."""
    eng = make(model_dirs, "mamba", cfg())
    try:
        geo = eng.connector.geo
        assert geo.chunk_blocks == 1 and geo.has_mamba
        a = eng.add("m1", prompt(18, 12 * BS + 5), max_tokens=3)
        eng.run()
        eng.settle()
        st = eng.connector.stats()
        state_bytes = 2 * models.state_nbytes()
        # 12 chunks of full attention; the state only at 192 (where the step ended)
        assert st["resident_cpu"] == 12 + 1 and st["sched_bytes_stored"] == 12 * 4096 + state_bytes, st
        assert eng.sched.reset_prefix_cache()
        verified = eng.verified_blocks
        b = eng.add("m2", turn2(a), max_tokens=2)
        eng.run()
        eng.settle()
        st = eng.connector.stats()
        assert st["sched_hit_tokens_cpu"] == 12 * BS, st
        assert eng.workers[0].connector.stats()["bytes_loaded"] == 12 * 4096 + state_bytes
        assert eng.verified_blocks - verified >= 12 and b.is_finished()
        assert_clean(eng)
    finally:
        eng.close()


@mamba_032
def test_mamba_without_a_state_at_a_chunk_end_is_no_hit(model_dirs):
    """A prompt whose only kept state is not stored (a turn shorter than one step end): no hit."""
    eng = make(model_dirs, "mamba", cfg(store_decode_tokens=False))
    try:
        a = eng.add("m1", prompt(19, 12 * BS + 5), max_tokens=2)
        eng.run()
        eng.settle()
        assert eng.sched.reset_prefix_cache()
        planner = eng.connector.planner
        parts = planner._parts
        chunk_key = planner.key(bytes(a.block_hashes[11]))
        # drop the part that holds the state: the attention chunks alone cannot serve a hit
        planner._router.route(planner.chain.delete([parts.part_key(a.block_hashes, 11, parts.mamba[0], chunk_key)]))
        eng.settle()
        eng.add("m2", turn2(a), max_tokens=2)
        eng.run()
        eng.settle()
        assert eng.connector.stats()["sched_hit_tokens_cpu"] == 0
        assert_clean(eng)
    finally:
        eng.close()


@mamba_032
def test_mamba_without_align_mode_is_refused(model_dirs):
    def none_mode(cfg):
        cfg.cache_config.mamba_cache_mode = "none"

    import tests.connector.vllm.models as m

    real = m.layer_specs
    try:
        m.layer_specs = lambda *a, **k: real(*a, **{**k, "mamba_cache_mode": "none"})
        with pytest.raises(ConfigError, match="keeps no recurrent state.*--enable-prefix-caching"):
            make(model_dirs, "mamba", cfg(), tweak=none_mode)
    finally:
        m.layer_specs = real


def test_mamba_on_vllm_026_is_refused(model_dirs, monkeypatch):
    """vLLM 0.26 hands connectors a per-group-max local hit for Mamba hybrids: refused there (on 0.32 the
    0.32-only property is removed to stand for 0.26)."""
    monkeypatch.delattr(KVConnectorBase_V1, "supports_divergent_local_hybrid_hits", raising=False)
    with pytest.raises(ConfigError, match="need vLLM >= 0.32"):
        make(model_dirs, "mamba", cfg())


def test_a_hybrid_in_step_hit_is_priced_as_the_cpu_copy_it_is(model_dirs, tmp_path):
    """A hybrid model's disk parts reach the CPU tier before they load (promotions), while its plan still names the
    disk: the step's in-step bytes that price the load floor are the CPU tier's, all of them, not the disk's (whose
    overlap cost would take them, wrongly)."""
    from tiered_kv.planner.split import Segment, split_at

    eng = _disk_engine(model_dirs, tmp_path)
    try:
        loads = eng.connector.planner._loads
        model = eng.connector.planner.steps.estimator.model()
        segs = [Segment("cpu", 64, 1000.0, 50.0), Segment("disk", 128, 1000.0, 1.0)]
        plan = split_at(segs, 192, 16, 0, model, overlap=False)
        assert plan.loaded_bytes() == {"cpu": 64000.0, "disk": 128000.0}
        loads._note_in_step(plan)
        got, exposed = loads.take_in_step()
        assert got == {"cpu": 192000.0} and exposed == pytest.approx(plan.seconds_exposed)
        assert loads.take_in_step() is None  # taken: the next step starts empty
    finally:
        eng.close()
