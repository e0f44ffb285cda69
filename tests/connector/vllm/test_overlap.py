"""Disk hits read under the forward (``disk_overlap_bytes``, issue 32 item 2) on vLLM's real Scheduler.

The harness's forward checks every byte a request reads against the tokens that produced it, and calls
``wait_for_layer_load`` for every layer before it reads, as vLLM's attention layers do. With the overlap on, the
split may load the first part of a disk run and recompute the rest: the CPU part, the disk part read layer group by
layer group into the staging slab, and the recomputed rest are all bit-exact; a damaged record fails its blocks in
the step that read it (vLLM recomputes them) and is dropped; a hit larger than the staging loads what fits.
At the end, the loader alone (``InStepDiskLoader`` on CPU tensors) over a disk tier in /dev/shm: its AIO lanes.
"""
from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from tests.connector.vllm.harness import Engine, write_model_dir  # noqa: E402
from tests.connector.vllm.test_split import CHUNK, CHUNK_BYTES, K, chunk_keys, hold_on_disk_only, prompt  # noqa: E402
from tiered_kv.connector.vllm.config import (OVERLAP_GROUPS, ConnectorConfig, overlap_fill_layers,  # noqa: E402
                                             overlap_possible, overlap_spans)
from tiered_kv.planner.rates import PrefillModel  # noqa: E402
from tiered_kv.planner.split import Segment, split_at  # noqa: E402
from tiered_kv.errors import ConfigError  # noqa: E402
from tiered_kv.tiers.disk.aio import aio_available  # noqa: E402
from tiered_kv.values.record import RecordHeader  # noqa: E402
from tiered_kv.connector.vllm.common import CPU, DISK, JobReport  # noqa: E402
from tiered_kv.connector.vllm import in_step_disk  # noqa: E402
from tiered_kv.connector.vllm.in_step_disk import InStepDiskLoader  # noqa: E402
from tiered_kv.copy import cpu, vllm_layer_layout  # noqa: E402
from tiered_kv.copy.testing import Shape, vllm026_tensors  # noqa: E402
from tiered_kv.tiers.disk import DiskTier  # noqa: E402
from tiered_kv.values.jobs import NO_SLOT, JobKind, TransferJob  # noqa: E402
from tiered_kv.values.layout import BlockLayout  # noqa: E402
from tests.tiers.test_disk_slots import memory_mount  # noqa: E402

HELD = 8  # chunks of the prefix: 512 tokens
#: recompute 50k tokens/s, the disk 10 MB/s (256 B a token): loading all 8 chunks (13.2 ms by the planner) and
#: recomputing them (10.4 ms, two steps: the harness computes at most 256 tokens a step, and only the first step's
#: compute hides the load) both lose to loading about 3 while the rest computes (9.0 ms), with the fill of the
#: harness's 2 layers (half the shorter side: ``config.overlap_fill_layers``)
SLOW_SPLIT = {"disk_read_gbps": 0.01, "prefill_tokens_per_s": 50000.0, "prefill_learn": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(str(tmp_path_factory.mktemp("tiny-llama")))


def cfg(tmp_path, **kw) -> dict:
    return {"chunk_blocks": K, "cpu_bytes": 16 * CHUNK_BYTES, "disk_path": str(tmp_path / "kv"), "disk_bytes": "4MiB",
            "write_policy": "write_through", "disk_probe_every": 0, "disk_overlap_bytes": HELD * CHUNK_BYTES, **kw}


def _turn(eng: Engine, rid: str, tokens: list[int]):
    req = eng.add(rid, tokens, max_tokens=1)
    eng.run()
    eng.settle()
    eng.sched.reset_prefix_cache()
    return req


def _on_disk(eng: Engine, rid: str, tokens: list[int]) -> list[bytes]:
    """Serve ``tokens`` once, then forget the CPU copies of its chunks (write-through kept them on disk)."""
    req = _turn(eng, rid, tokens)
    keys = chunk_keys(eng, req, HELD)
    hold_on_disk_only(eng, keys)
    return keys


@pytest.mark.parametrize("tp,async_sched,aio", [(1, False, True), (1, True, True), (2, False, True), (1, False, False)],
                         ids=["tp1", "tp1-async", "tp2", "tp1-threads"])
def test_a_slow_disk_run_is_split_read_under_the_forward_and_bit_exact(model_dir, tmp_path, tp, async_sched, aio):
    """Part of the run loaded in-step from disk, the rest recomputed, every byte checked (each TP rank reads its
    own disk directory); the records read were promoted from their staged images, not read twice, so the next turn
    finds them in the CPU tier. The reads go through Linux AIO where this file system takes O_DIRECT and the kernel
    allows AIO, else (and with ``disk_overlap_aio: false``) through reader threads."""
    # the rate is the whole engine's: each of 2 ranks reads a chunk of its own, so twice the bytes at TP=2
    eng = Engine.create(model_dir, cfg(tmp_path, **{**SLOW_SPLIT, "disk_read_gbps": 0.01 * tp},
                                       disk_overlap_aio=aio), tp=tp, async_sched=async_sched)
    try:
        tokens = prompt(11, HELD * CHUNK + 4)
        _on_disk(eng, "a", tokens)
        before = [w.connector.stats().get("bytes_from_disk", 0) for w in eng.workers]
        _turn(eng, "a2", tokens)
        got = eng.cached_at_start["a2"]
        assert 0 < got < HELD * CHUNK and got % CHUNK == 0, got  # part of the run loaded, the rest recomputed
        st = eng.connector.stats()
        assert st["sched_sync_loads"] >= 1 and st["sched_hit_tokens_disk"] == got, st
        assert st["split_disk_loaded_tokens"] == got and st["split_disk_recomputed_tokens"] == HELD * CHUNK - got, st
        # the split's disk rate was fed by that in-step read (into GPU blocks), not by the promotions it served
        chunk_bytes = eng.workers[0].connector.worker.geo.rank_chunk_nbytes * tp
        assert st["sched_rate_reads_gpu"] == 1 and st["sched_rate_read_bytes_gpu"] == got // CHUNK * chunk_bytes, st
        assert st["sched_rate_read_seconds_gpu"] > 0 and st["sched_rate_reads_cpu"] == 0, st
        for w, b in zip(eng.workers, before):
            disk = w.connector.worker.in_step.disk
            assert disk is not None and not disk.busy
            ws = w.connector.stats()
            assert ws["overlap_loads"] == 1 and ws["overlap_promotions"] >= 1 and ws["overlap_read_seconds"] > 0, ws
            by_aio = aio and w.connector.worker.disk.slots.direct and aio_available()
            assert (ws["overlap_aio_reads"] > 0) == by_aio, ws
            rank_chunk = w.connector.worker.geo.rank_chunk_nbytes
            assert ws["failed_items"] == 0 and ws["bytes_from_disk"] - b == got // CHUNK * rank_chunk, ws
        _turn(eng, "a3", tokens)
        st = eng.connector.stats()
        assert st["sched_hit_tokens_cpu"] >= got, st  # the promoted part, from the CPU tier now
    finally:
        eng.close()


def test_without_the_overlap_the_same_hit_is_all_or_nothing(model_dir, tmp_path):
    """The same rates with ``disk_overlap_bytes: 0``: the disk run is declined whole (recompute is faster than a
    load that runs before the forward)."""
    eng = Engine.create(model_dir, cfg(tmp_path, disk_overlap_bytes=0, **SLOW_SPLIT))
    try:
        tokens = prompt(12, HELD * CHUNK + 4)
        _on_disk(eng, "a", tokens)
        _turn(eng, "a2", tokens)
        assert eng.cached_at_start["a2"] == 0
        assert eng.workers[0].connector.worker.in_step.disk is None
    finally:
        eng.close()


def test_the_first_overlapped_hit_on_the_built_in_rate_loads_one_chunk(model_dir, tmp_path):
    """No ``disk_read_gbps`` set: the split's 3 GB/s is a guess, so the first overlapped disk hit loads one chunk
    (bit-exact, the rest recomputed) and that read replaces the guess in the estimate the next hit plans with.
    Before it, the scheduler's completed write-throughs reach the guess: this tiny model's (a few KiB, latency more
    than rate) leave it alone, a 64 MiB one (its report fed to the real planner) bounds it by its rate."""
    eng = Engine.create(model_dir, cfg(tmp_path, prefill_learn=False))
    try:
        tokens = prompt(17, HELD * CHUNK + 4)
        keys = _on_disk(eng, "a", tokens)
        assert eng.connector.stats()["disk_gbps_source"] == "guess"  # every write under HINT_MIN_BYTES
        big = TransferJob(10 ** 6, JobKind.COPY_DOWN, CPU, DISK, keys[:1], [0], [0])
        eng.connector.planner._loads.write_done(big, JobReport(1, [True], [False], 64 << 20, (64 << 20) / 0.9e9))
        st0 = eng.connector.stats()
        assert st0["disk_gbps_source"] == "writes" and st0["disk_gbps_estimate"] == 0.9, st0
        _turn(eng, "a2", tokens)
        assert eng.cached_at_start["a2"] == CHUNK
        st = eng.connector.stats()
        assert st["split_disk_loaded_tokens"] == CHUNK and st["disk_gbps_source"] == "reads", st
        assert eng.workers[0].connector.stats()["failed_items"] == 0
    finally:
        eng.close()


@pytest.mark.parametrize("slowdown", [0.0, 0.05], ids=["as-priced", "slowed"])
def test_overlapped_reads_that_slow_the_step_are_measured_and_the_next_hit_recomputes(model_dir, tmp_path, monkeypatch,
                                                                                      slowdown):
    """The first hit splits as the rates say. Its step's forward (timed by the workers) comes back ``slowdown``
    longer than the model's compute of its tokens: as with the remote tier on the H200, where reader threads slowed
    the forward they ran under. The gate learns that cost from the step, and the next conversation's hit on the same
    rates recomputes instead; a step that ran as priced leaves the cost near 0 and the next hit loads again."""
    from tiered_kv.connector.vllm.forward_clock import ForwardClock

    take = ForwardClock.take
    monkeypatch.setattr(ForwardClock, "take", lambda self: {s: (t + slowdown if loaded else t, loaded)
                                                            for s, (t, loaded) in take(self).items()})
    eng = Engine.create(model_dir, cfg(tmp_path, **{**SLOW_SPLIT, "prefill_learn": True}))
    try:
        a, b = prompt(31, HELD * CHUNK + 4), prompt(32, HELD * CHUNK + 4)
        _on_disk(eng, "a", a)
        _turn(eng, "a2", a)
        assert 0 < eng.cached_at_start["a2"] < HELD * CHUNK  # split: part loaded under the forward
        st = eng.connector.stats()
        assert st["prefill_steps_priced"] == 1, st
        assert (st["disk_overlap_s_per_gb"] > 1.0) == (slowdown > 0), st  # 50 ms for a few 16 KiB chunks: huge
        _on_disk(eng, "b", b)
        _turn(eng, "b2", b)
        assert (eng.cached_at_start["b2"] == 0) == (slowdown > 0), eng.connector.stats()
    finally:
        eng.close()


def test_a_damaged_record_fails_its_blocks_in_the_step_that_read_it(model_dir, tmp_path):
    """A fast disk loads the whole run in-step; one record's payload changed on disk: the forward read wrong bytes
    only in blocks the connector reported failed in that step (the harness checks), vLLM recomputed them, the
    record was dropped, and the next turn reads the others again."""
    eng = Engine.create(model_dir, cfg(tmp_path, disk_read_gbps=100.0, prefill_learn=False))
    try:
        tokens = prompt(13, HELD * CHUNK + 4)
        keys = _on_disk(eng, "a", tokens)
        worker = eng.workers[0].connector.worker
        disk = worker.disk
        raw = disk.index.headers([keys[3]])[0]
        hdr = RecordHeader.unpack(keys[3], raw)
        with open(disk.path / "payload.bin", "r+b") as fh:
            fh.seek(hdr.slot * disk.slots.slot_bytes + 100)
            byte = fh.read(1)
            fh.seek(hdr.slot * disk.slots.slot_bytes + 100)
            fh.write(bytes([(byte[0] + 1) % 256]))
        _turn(eng, "a2", tokens)
        assert eng.cached_at_start["a2"] == HELD * CHUNK  # planned whole: the damage shows only when read
        ws = eng.workers[0].connector.stats()
        assert ws["corrupt_items"] == 1 and eng.discarded_reads > 0, ws
        assert disk.index.headers([keys[3]]) == [None]  # dropped
        assert disk.index.headers([keys[4]])[0] is not None
    finally:
        eng.close()


def test_a_hit_larger_than_the_staging_loads_what_fits(model_dir, tmp_path):
    eng = Engine.create(model_dir, cfg(tmp_path, disk_read_gbps=100.0, prefill_learn=False,
                                       disk_overlap_bytes=3 * CHUNK_BYTES))
    try:
        tokens = prompt(14, HELD * CHUNK + 4)
        _on_disk(eng, "a", tokens)
        _turn(eng, "a2", tokens)
        assert eng.cached_at_start["a2"] == 3 * CHUNK
        assert eng.connector.stats()["sched_sync_loads"] >= 1
    finally:
        eng.close()


def _pipeline_seconds(spans, n: int, load_s: float, compute_s: float) -> float:
    """Groups read in order, each computed once read and after the one before: ``max_g (L * end_g + C * (n -
    start_g)) / n`` (the time until group g is in, then every layer from its start on)."""
    return max(load_s * b / n + compute_s * (n - a) / n for a, b in spans)


def test_overlap_spans_and_the_fill_the_split_prices():
    """The read and copy order of an overlapped load: every tensor once, in order, at most ``OVERLAP_GROUPS`` groups;
    the split's pipeline model with ``overlap_fill_layers`` is never below the pipeline's real time for those
    groups (exact for equal ones), whatever load and compute times, down to a 2-layer model (fill 1/2, not 1/8)."""
    for n in range(0, 130):
        spans = overlap_spans(n)
        assert [t for a, b in spans for t in range(a, b)] == list(range(n)), n
        assert len(spans) <= OVERLAP_GROUPS and all(b > a for a, b in spans)
        fill = overlap_fill_layers(n)
        for load_s, compute_s in [(1.0, 1.0), (2.0, 1.0), (1.0, 3.0), (0.1, 1.0)]:
            if n:
                modelled = max(load_s, compute_s) + min(load_s, compute_s) / fill
                real = _pipeline_seconds(spans, n, load_s, compute_s)
                assert modelled >= real - 1e-9, (n, load_s, compute_s)
                if len({b - a for a, b in spans}) == 1:
                    assert modelled == pytest.approx(real)
    assert overlap_fill_layers(32) == 8 and overlap_fill_layers(2) == 2 and overlap_fill_layers(27) == 6
    # the split uses it: the same half-loaded plan costs more with the 2-layer fill than with an assumed 8 groups
    seg = [Segment("disk", 512, 256, 0.01)]
    model = PrefillModel.from_rate(50000.0, 32768)
    two = split_at(seg, 256, 4, 0, model, overlap=True, layers=overlap_fill_layers(2), step_tokens=256).seconds
    eight = split_at(seg, 256, 4, 0, model, overlap=True, layers=OVERLAP_GROUPS, step_tokens=256).seconds
    assert two > eight


def test_overlap_needs_raw_records_a_disk_and_in_step_loads(tmp_path):
    base = {"disk_path": str(tmp_path / "kv"), "disk_overlap_bytes": "64MiB"}
    ConnectorConfig(**base)
    for bad, why in (({"compression": "zstd"}, "compression: zstd"), ({"load_mode": "async"}, "load_mode: async"),
                     ({"disk_path": None}, "no disk_path or remote_url")):
        with pytest.raises(ConfigError, match=why):
            ConnectorConfig(**{**base, **bad})
    c = ConnectorConfig(**base)
    assert overlap_possible(c, 1, 32 << 20) is None
    assert "KV cache groups" in overlap_possible(c, 2, 32 << 20)
    assert "4 KiB" in overlap_possible(c, 1, (32 << 20) + 512)
    assert "less than one chunk" in overlap_possible(ConnectorConfig(**{**base, "disk_overlap_bytes": 4096}), 1, 8192)


def test_a_hit_split_across_cpu_disk_and_recompute(model_dir, tmp_path):
    """The CPU tier holds the first 2 chunks, the disk the other 6: the CPU part always loads, the disk part is split
    (its first chunks read under the forward), the rest recomputed; all in one step's in-step loads, bit-exact."""
    eng = Engine.create(model_dir, cfg(tmp_path, **SLOW_SPLIT))
    try:
        tokens = prompt(15, HELD * CHUNK + 4)
        a = _turn(eng, "a", tokens)
        hold_on_disk_only(eng, chunk_keys(eng, a, HELD)[2:])
        _turn(eng, "a2", tokens)
        got = eng.cached_at_start["a2"]
        assert 2 * CHUNK < got < HELD * CHUNK, got
        st = eng.connector.stats()
        assert st["split_cpu_loaded_tokens"] == 2 * CHUNK and st["split_disk_loaded_tokens"] == got - 2 * CHUNK, st
        assert st["split_disk_recomputed_tokens"] == HELD * CHUNK - got and st["sched_sync_loads"] == 2, st
    finally:
        eng.close()


def test_an_unreadable_disk_tier_fails_the_chunks_and_vllm_recomputes(model_dir, tmp_path):
    """The disk tier cannot be read when the step starts (its index refuses): the in-step disk load fails all its
    chunks in that step, the forward's reads of them are reported (the harness checks), and the request completes
    by recomputing; nothing is raised into vLLM."""
    eng = Engine.create(model_dir, cfg(tmp_path, disk_read_gbps=100.0, prefill_learn=False))
    try:
        tokens = prompt(16, HELD * CHUNK + 4)
        _on_disk(eng, "a", tokens)
        disk = eng.workers[0].connector.worker.disk

        def refuse(keys):
            raise OSError(5, "Input/output error (injected)")

        disk.open_ranges = refuse
        _turn(eng, "a2", tokens)
        assert eng.cached_at_start["a2"] == HELD * CHUNK  # planned as a hit; the failure shows in the step
        ws = eng.workers[0].connector.stats()
        assert ws["failed_items"] >= HELD and eng.discarded_reads > 0, ws
    finally:
        eng.close()


def test_a_rank_without_the_loader_fails_the_load_and_vllm_recomputes(model_dir, tmp_path):
    """The scheduler plans a read under the forward, but the rank has no in-step disk loader (its disk tier did not
    open there): the load fails in its step instead of raising, and the request completes by recomputing."""
    eng = Engine.create(model_dir, cfg(tmp_path, disk_read_gbps=100.0, prefill_learn=False))
    try:
        tokens = prompt(17, HELD * CHUNK + 4)
        _on_disk(eng, "a", tokens)
        eng.workers[0].connector.worker.in_step.disk = None
        _turn(eng, "a2", tokens)
        ws = eng.workers[0].connector.stats()
        assert ws["failed_items"] >= HELD and eng.discarded_reads > 0, ws
    finally:
        eng.close()


def test_a_hit_that_cannot_load_in_step_is_planned_without_the_overlap(model_dir, tmp_path):
    """Over ``sync_max_tokens`` a hit loads between steps, where a split inside the disk run would only add the
    load to the recompute: the plan falls back to all or nothing (here: recompute the slow disk run)."""
    eng = Engine.create(model_dir, cfg(tmp_path, sync_max_tokens=CHUNK // 2, **SLOW_SPLIT))
    try:
        tokens = prompt(18, HELD * CHUNK + 4)
        _on_disk(eng, "a", tokens)
        _turn(eng, "a2", tokens)
        assert eng.cached_at_start["a2"] == 0
        st = eng.connector.stats()
        assert st["split_disk_loaded_tokens"] == 0 and st["split_disk_recomputed_tokens"] == HELD * CHUNK, st
        assert eng.workers[0].connector.stats()["overlap_loads"] == 0
    finally:
        eng.close()


def _two_turn2_in_one_step(model_dir, tmp_path, staging_chunks: int, seeds: tuple[int, int]) -> Engine:
    """An engine (a fast disk, ``staging_chunks`` of overlap staging) that served two conversations of 4 chunks,
    held them on disk only, then ran both turn 2s together: both whole hits (checked), the engine left open."""
    eng = Engine.create(model_dir, cfg(tmp_path, disk_read_gbps=100.0, prefill_learn=False,
                                       disk_overlap_bytes=staging_chunks * CHUNK_BYTES, cpu_bytes=32 * CHUNK_BYTES,
                                       disk_bytes="8MiB"), num_blocks=160)
    try:
        convs = [prompt(seed, 4 * CHUNK + 4) for seed in seeds]
        for rid, tokens in zip(("a", "b"), convs):
            req = _turn(eng, rid, tokens)
            hold_on_disk_only(eng, chunk_keys(eng, req, 4))
        for rid, tokens in zip(("a2", "b2"), convs):
            eng.add(rid, tokens, max_tokens=1)
        eng.run()
        eng.settle()
        assert eng.cached_at_start["a2"] == 4 * CHUNK and eng.cached_at_start["b2"] == 4 * CHUNK
    except BaseException:
        eng.close()
        raise
    return eng


def test_two_requests_with_disk_hits_in_one_step(model_dir, tmp_path):
    """Two conversations' turn 2 arrive together: both hits' disk chunks are read under the same step's forward into
    one staging slab (rows taken in turn), each request's bytes checked by the forward."""
    eng = _two_turn2_in_one_step(model_dir, tmp_path, 16, (19, 20))
    try:
        ws = eng.workers[0].connector.stats()
        assert ws["overlap_loads"] == 2 and ws["failed_items"] == 0, ws
        assert eng.connector.stats()["sched_sync_loads"] == 2
    finally:
        eng.close()


def test_the_staging_is_shared_by_the_hits_of_one_step(model_dir, tmp_path):
    """Staging for 4 chunks, two requests with 4 disk chunks each in one step: the first takes the rows in-step,
    the second is planned without the overlap (a fast disk: loaded between steps); nothing fails."""
    eng = _two_turn2_in_one_step(model_dir, tmp_path, 4, (25, 26))
    try:
        ws = eng.workers[0].connector.stats()
        assert ws["overlap_loads"] == 1 and ws["failed_items"] == 0 and eng.discarded_reads == 0, ws
        assert eng.connector.stats()["sched_sync_loads"] == 1
    finally:
        eng.close()


def test_a_step_whose_in_step_load_failed_stores_nothing_it_computed(model_dir, tmp_path):
    """The forward of a step whose in-step load failed computed its new KV from wrong bytes (the harness's fake
    forward cannot show that, so this checks the mechanism): the step's stores are held until the loads are known,
    then dropped; in a step whose loads were good they are written (the next turn hits them in the CPU tier)."""
    eng = Engine.create(model_dir, cfg(tmp_path, disk_read_gbps=100.0, prefill_learn=False))
    try:
        tokens = prompt(21, HELD * CHUNK)
        keys = _on_disk(eng, "a", tokens + [7, 8, 9, 10])
        disk = eng.workers[0].connector.worker.disk
        hdr = RecordHeader.unpack(keys[5], disk.index.headers([keys[5]])[0])
        with open(disk.path / "payload.bin", "r+b") as fh:
            fh.seek(hdr.slot * disk.slots.slot_bytes + 9)
            b = fh.read(1)
            fh.seek(hdr.slot * disk.slots.slot_bytes + 9)
            fh.write(bytes([(b[0] + 1) % 256]))
        longer = tokens + prompt(22, 2 * CHUNK + 4)  # two new whole chunks, computed in the step of the load
        _turn(eng, "a2", longer)
        ws = eng.workers[0].connector.stats()
        assert ws["corrupt_items"] == 1 and ws["stores_dropped_after_failed_load"] >= 1, ws
        good = prompt(23, HELD * CHUNK)
        _on_disk(eng, "b", good + [7, 8, 9, 10])
        _turn(eng, "b2", good + prompt(24, 2 * CHUNK + 4))
        dropped = eng.workers[0].connector.stats()["stores_dropped_after_failed_load"]
        assert dropped == ws["stores_dropped_after_failed_load"]  # the good step's stores went through
        _turn(eng, "b3", good + prompt(24, 2 * CHUNK + 4) + [5, 6])
        assert eng.cached_at_start["b3"] >= (HELD + 2) * CHUNK  # its new chunks were stored
    finally:
        eng.close()


# ---------------------------------------------------------------- the loader alone: AIO lanes on a memory file system
LANES_SHAPE = Shape(layers=8, heads=8, block_size=16, head_dim=128, num_blocks=64)  # 64 KiB a layer-block
LANE_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LANES_SHAPE.layers)]
LANE_RECORDS = 5  # 5 records x 4 blocks x 8 groups: 160 reads, not a multiple of 3 lanes


@pytest.fixture(params=["memory-fs", "disk"])
def lane_dir(request, tmp_path):
    """A disk tier directory in /dev/shm (tmpfs) or in ``tmp_path`` (a disk); skips where AIO is unavailable, where
    that directory is not of its kind, or where its file system refuses O_DIRECT."""
    if not aio_available():
        pytest.skip("this kernel or sandbox refuses io_setup: no AIO lanes")
    if request.param == "disk":
        if memory_mount(str(tmp_path)):
            pytest.skip(f"{tmp_path} is on a memory file system")
        yield tmp_path / "disk", False
        return
    if not os.path.isdir("/dev/shm") or not memory_mount("/dev/shm"):
        pytest.skip("no tmpfs at /dev/shm")
    path = Path(f"/dev/shm/tkv-test-lanes-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        yield path, True
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _lane_loader(path: Path, seed: int):
    """A CPU ``InStepDiskLoader`` (as ``tests/gpu/test_in_step_disk_gpu.py`` builds one on CUDA) over a real disk
    tier at ``path`` holding ``LANE_RECORDS`` records of 4 blocks: (loader, tier, job, records' bytes, GPU blocks)."""
    gen = torch.Generator().manual_seed(seed)
    layout = vllm_layer_layout(vllm026_tensors("NHD", LANES_SHAPE, torch.bfloat16, "cpu"))
    chunk = K * layout.block_nbytes
    disk = DiskTier(BlockLayout((chunk,), "uint8"), path, 2 * LANE_RECORDS * chunk)
    if not disk.slots.direct:
        disk.close()
        pytest.skip(f"{path.parent} refuses O_DIRECT: no AIO reads")
    keys = [bytes([seed, i]) * 8 for i in range(LANE_RECORDS)]
    rows = torch.randint(0, 256, (LANE_RECORDS, chunk), dtype=torch.uint8, generator=gen)
    assert all(disk.write(keys, [NO_SLOT] * LANE_RECORDS, rows))
    blocks = torch.randperm(LANES_SHAPE.num_blocks, generator=gen)[:LANE_RECORDS * K].view(LANE_RECORDS, K).tolist()

    def flat(job, slots, items):
        return [([b for i in items for b in blocks[i]], [slots[i] * K + j for i in items for j in range(K)])]

    cfg = ConnectorConfig(disk_path=str(path), disk_overlap_bytes=LANE_RECORDS * chunk)
    cpu_slab = torch.empty((LANE_RECORDS, chunk), dtype=torch.uint8)
    loader = InStepDiskLoader(layout, LANE_NAMES, cfg, 0, {DISK: disk}, chunk, K, flat, False, cpu_slab)
    job = TransferJob(7, JobKind.EGRESS, DISK, DISK + 1, keys, [NO_SLOT] * LANE_RECORDS, [NO_SLOT] * LANE_RECORDS)
    return loader, disk, job, rows, blocks


def _lane_forward(loader, job):
    """One step as vLLM's attention layers drive it: submit, each layer's wait, finish."""
    loader.start(job)
    loader.submit(layerwise_ok=True)
    for name in LANE_NAMES:
        loader.wait_layer(name)
    return loader.finish()


def _watch_lanes(loader) -> dict:
    """Wrap each lane's ``run``: which threads ran each lane, how many lanes run now, each lane's requests' layer groups
    in the order given, and the completions reported per group (counted before the loader hears of each)."""
    spans = overlap_spans(LANES_SHAPE.layers)
    bn, base = loader.chunk_nbytes // K, loader.staging.data_ptr()
    seen = {"threads": [set() for _ in loader._lanes], "groups": [[] for _ in loader._lanes],
            "batches": [[] for _ in loader._lanes], "active": 0, "ended": 0, "reported": [0] * len(spans)}
    lock = threading.Lock()

    def group_of(req) -> int:  # the staging address says the byte of the block, so the tensor, so the group
        start = (req[1] - base) % bn
        tensor = max(t for t in range(len(loader._offsets) - 1) if loader._offsets[t] <= start)
        return next(g for g, (a, b) in enumerate(spans) if a <= tensor < b)

    for k, lane in enumerate(loader._lanes):
        def run(reqs, done, batch=None, *, real=lane.run, k=k):
            groups = [group_of(r) for r in reqs]

            def counted(i, res):
                with lock:
                    seen["reported"][groups[i]] += 1
                done(i, res)

            with lock:
                seen["active"] += 1
                seen["threads"][k].add(threading.current_thread().name)
                seen["groups"][k].extend(groups)
                seen["batches"][k].append(batch)
            try:
                real(reqs, counted, batch)
            finally:
                with lock:
                    seen["active"] -= 1
                    seen["ended"] += 1
        lane.run = run
    return seen


@pytest.mark.parametrize("lanes", [3, 1], ids=["3-lanes", "1-lane"])
def test_lanes_read_the_same_bytes_and_publish_groups_in_order(lane_dir, monkeypatch, lanes):
    """On a memory file system the step's AIO reads go on ``AIO_LANES_MEMORY_FS`` lanes (3 here; 1: a group's 20
    reads a submit, more than ``AIO_MIN_SUBMIT``), each on its own thread; on a disk, on one. Either way: each group
    is published (``read_upto``) in order, only once every lane read its part (when ``ready`` returns, those tensors
    of every block of every record are in the staging), group 0 while later groups' reads are still due; the copied
    blocks equal the records; the readers serve the next step."""
    path, in_memory = lane_dir
    if lanes == 1 and not in_memory:
        pytest.skip("a disk has one lane whatever AIO_LANES_MEMORY_FS says: the 3-lanes case shows it")
    monkeypatch.setattr(in_step_disk, "AIO_LANES_MEMORY_FS", lanes)
    loader, disk, job, rows, blocks = _lane_loader(path, seed=41)
    try:
        assert len(loader._lanes) == (lanes if in_memory else 1)
        seen = _watch_lanes(loader)
        bn, off = loader.chunk_nbytes // K, loader._offsets
        spans = overlap_spans(LANES_SHAPE.layers)
        published, early = [], []
        advance = loader._advance

        def watched_advance(step):
            before = step.read_upto
            advance(step)
            if step.read_upto != before:
                published.append((step.read_upto, sum(step.left)))
                upto = next(g for g, (_, b) in enumerate(spans) if b == step.read_upto)
                # every lane reported every read of the groups published so far (a lane's thread: noted, not raised)
                if any(seen["reported"][g] != LANE_RECORDS * K for g in range(upto + 1)):
                    early.append((upto, list(seen["reported"])))

        def checked_ready(upto):
            loader.ready(upto)
            for i in range(LANE_RECORDS):  # record i is in staging row i (one job, rows taken in turn)
                for b in range(K):
                    a, e = b * bn, b * bn + off[upto]
                    assert torch.equal(loader.staging[i][a:e], rows[i][a:e]), (upto, i, b)

        loader._advance = watched_advance
        loader.loader.span_ready = checked_ready
        (got, done), = _lane_forward(loader, job)
        assert not early, early  # no group published before every lane read its part
        assert got is job and all(done.ok) and not any(done.corrupt), done
        assert [u for u, _ in published] == [b for _, b in spans]  # every group, in order, once
        assert published[0][1] > 0  # group 0 ready while later groups' reads were still due
        assert seen["ended"] == len(loader._lanes) and seen["active"] == 0
        # lane 0 on the step's thread, the others on reader threads (one may serve two lanes in turn on a busy box)
        assert seen["threads"][0] == {"tkv-overlap-step-r0"}, seen["threads"]
        assert all(t <= {"tkv-overlap-r0_%d" % n for n in range(in_step_disk.READERS)} for t in seen["threads"][1:])
        reads = [len(g) for g in seen["groups"]]
        assert sum(reads) == len(spans) * LANE_RECORDS * K and max(reads) - min(reads) <= 1, reads  # dealt in turn
        assert all(g == sorted(g) for g in seen["groups"])  # each lane: group 0's reads, then group 1's, ...
        assert loader.counters.overlap_aio_reads == sum(reads)
        # a layer group's share of a lane's reads a submit on a memory file system (at least 16); a disk: the depth
        share = -(-sum(reads) // (len(reads) * len(spans)))
        assert seen["batches"] == [[max(16, share) if in_memory else in_step_disk.AIO_DEPTH]] * len(reads)
        ref = vllm_layer_layout([t.clone().zero_() for t in loader.kv.tensors])
        for i in range(LANE_RECORDS):
            cpu.slab_to_blocks(ref, rows[i].view(K, -1), torch.arange(K), torch.tensor(blocks[i]))
        ids = torch.tensor([b for bs in blocks for b in bs])
        for t, r in zip(loader.kv.tensors, ref.tensors):
            assert torch.equal(t.view(torch.int16)[ids], r.view(torch.int16)[ids])
        lanes = list(loader._lanes)
        loader._advance, loader.loader.span_ready = advance, loader.ready  # the counts above were per step
        (_, again), = _lane_forward(loader, job)  # the same readers, reused
        assert all(again.ok) and loader._lanes == lanes and seen["ended"] == 2 * len(lanes)
    finally:
        loader.close()
        disk.close()


def test_a_failing_lane_fails_the_step_after_every_lane_stopped_reading(lane_dir, monkeypatch):
    """Lane 0's reads (on the step's own thread) raise at their first completion while lane 1 is still busy: the
    step fails (every
    chunk reported failed, nothing raised into vLLM's thread), ``finish`` returns only after every lane returned
    (none left writing into the staging), and the next step on the same lanes reads well."""
    path, in_memory = lane_dir
    if not in_memory:
        pytest.skip("one lane on a disk: the failure path of a single lane is test_disk_aio's")
    monkeypatch.setattr(in_step_disk, "AIO_LANES_MEMORY_FS", 3)
    loader, disk, job, rows, _ = _lane_loader(path, seed=42)
    try:
        seen = _watch_lanes(loader)
        watched = [lane.run for lane in loader._lanes]
        slow_done = threading.Event()

        def failing(reqs, done, batch=None):
            def boom(i, res):
                raise RuntimeError("lane 0 failed")
            watched[0](reqs, boom, batch)

        def slow(reqs, done, batch=None):
            watched[1](reqs, done, batch)
            time.sleep(0.2)  # still "reading" when lane 0 has long failed
            slow_done.set()

        loader._lanes[0].run, loader._lanes[1].run = failing, slow
        (got, failed), = _lane_forward(loader, job)
        assert got is job and not any(failed.ok), failed
        assert slow_done.is_set() and seen["active"] == 0 and seen["ended"] == 3
        loader._lanes[0].run, loader._lanes[1].run = watched[0], watched[1]
        (_, again), = _lane_forward(loader, job)
        assert all(again.ok) and not any(again.corrupt), again
        assert torch.equal(loader.staging[:LANE_RECORDS], rows)
    finally:
        loader.close()
        disk.close()


def test_promotions_on_hit_do_not_feed_the_split_read_rate(model_dir, tmp_path):
    """The split prices the reads it plans: loads into GPU blocks (here in-step, under the forward). A full CPU tier
    makes ``promote_on_hit``'s copies of the hits wait for room, so many are read from disk again later, one chunk
    each beside the engine (not served from the step's staged images): on the CPU box those ran at a seventh of the
    loads' rate. Before 2026-11-30 they fed the disk's rate too (round 20's 8k /dev/shm row on the H200 learned 2.27
    GB/s while its overlapped reads ran ~10 GB/s); now only reads for a reader do."""
    extra = cfg(tmp_path, cpu_bytes=6 * CHUNK_BYTES, disk_bytes="8MiB", write_policy="write_back",
                disk_load_policy="always", prefill_tokens_per_s=5000.0, prefill_learn=False)
    eng = Engine.create(model_dir, extra, num_blocks=256, max_model_len=2048, max_batched=1024)
    try:
        first = [_turn(eng, f"c{c}", prompt(60 + c, HELD * CHUNK + 4)) for c in range(6)]
        for c, a in enumerate(first):
            _turn(eng, f"c{c}-2", list(a.prompt_token_ids) + prompt(80 + c, 20))
        st = eng.connector.stats()
        ws = eng.workers[0].connector.stats()
        assert st["sched_hit_tokens_disk"] > 0 and st["sched_rate_reads_gpu"] >= 1, st
        assert ws["bytes_from_disk"] > st["sched_rate_read_bytes_gpu"], (ws, st)  # promotions read from disk too
        assert st["sched_rate_reads_cpu"] == 0, st  # and did not price the split's loads
    finally:
        eng.close()
