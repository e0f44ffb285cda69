"""Load or recompute (issue 32) on vLLM's real Scheduler: the split per request, its counters, the prefill model.

A disk hit is loaded or left to vLLM to recompute as the configured rates say; a hit held partly in the CPU tier
and partly on disk always loads its CPU part and loads its disk part by the decision; the per-tier token counters
and the ``tiered_kv_split_*`` metrics say what was loaded and what recomputed; the prefill model learned from the
harness's steps (timed by a clock the test controls, ``Engine.step_truth``) converges on the truth, with vLLM's
synchronous and asynchronous scheduler, and then drives the decision. The ``StepMeter`` pieces without vLLM too.
"""
from __future__ import annotations

import random
import time

import pytest

pytest.importorskip("vllm")

from tests.connector.vllm.harness import BS, Engine, step_output, write_model_dir  # noqa: E402
from tiered_kv.connector.vllm.common import CPU, DISK  # noqa: E402
from tiered_kv.connector.vllm.connector import TieredKVWorkerMeta  # noqa: E402
from tiered_kv.connector.vllm.prefill import StepMeter, step_parts  # noqa: E402
from tiered_kv.planner.rates import (MIN_SAMPLES, REFIT_EVERY, SCALE_SAMPLES, PrefillEstimator,  # noqa: E402
                                     PrefillModel)
from tiered_kv.store.metrics import make_registry  # noqa: E402

K = 4  # blocks per chunk
CHUNK = K * BS  # tokens per chunk
CHUNK_BYTES = K * 4096  # 2 layers x 2 heads x 16 tokens x 32 values x 2 bytes per block
SLOW, FAST = 1e-4, 100.0  # GB/s: 16 KiB chunks read in 164 ms / 0.2 us; recomputing 64 tokens takes ~2 ms


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(str(tmp_path_factory.mktemp("tiny-llama")))


def prompt(seed: int, n: int) -> list[int]:
    return [100 + (seed * 7919 + i * 31) % 800 for i in range(n)]


def cfg(tmp_path, **kw) -> dict:
    return {"chunk_blocks": K, "cpu_bytes": 16 * CHUNK_BYTES, "disk_path": str(tmp_path / "kv"), "disk_bytes": "4MiB",
            "write_policy": "write_through", "disk_probe_every": 0, **kw}


def chunk_keys(eng: Engine, req, n: int) -> list[bytes]:
    """The keys of the first ``n`` chunks of ``req`` (the hash at each chunk's last block, namespaced)."""
    return eng.connector.ns.keys(req.block_hashes[K - 1::K][:n])


def hold_on_disk_only(eng: Engine, keys: list[bytes]) -> None:
    """Forget the CPU copies of ``keys`` (write-through kept them on disk too), as a CPU tier's eviction would."""
    planner = eng.connector.planner
    planner._router.route(planner.chain.forget(CPU, keys))


def split_samples(eng: Engine) -> dict[tuple[str, str], float]:
    """``tiered_kv_split_tokens_total`` of the planner's stats as a scrape shows them: (tier, action) -> tokens."""
    reg = make_registry(eng.connector.planner.store_stats, "vllm")
    out = {}
    for metric in reg.collect():
        for s in metric.samples:
            if s.name == "tiered_kv_split_tokens_total":
                out[(s.labels["tier"], s.labels["action"])] = s.value
    return out


def _turn(eng: Engine, rid: str, tokens: list[int]):
    req = eng.add(rid, tokens, max_tokens=1)
    eng.run()
    eng.settle()
    eng.sched.reset_prefix_cache()  # the GPU forgets it: the next turn's hit comes from the tiers
    return req


@pytest.mark.parametrize("gbps,loaded", [(SLOW, False), (FAST, True)], ids=["recompute", "load"])
def test_disk_hit_follows_the_configured_rates(model_dir, tmp_path, gbps, loaded):
    """A prefix held only on disk: loaded when reading it beats recomputing it, else vLLM recomputes it."""
    eng = Engine.create(model_dir, cfg(tmp_path, disk_read_gbps=gbps))
    try:
        tokens = prompt(1, 2 * CHUNK + 4)
        a = _turn(eng, "a", tokens)
        hold_on_disk_only(eng, chunk_keys(eng, a, 2))
        assert eng.connector.planner.chain.locate(chunk_keys(eng, a, 2)) == [DISK, DISK]
        _turn(eng, "a2", tokens)
        assert eng.cached_at_start["a2"] == (2 * CHUNK if loaded else 0)
        st = eng.connector.stats()
        assert st["split_disk_loaded_tokens"] == (2 * CHUNK if loaded else 0), st
        assert st["split_disk_recomputed_tokens"] == (0 if loaded else 2 * CHUNK), st
        assert st["sched_disk_hits_declined"] == (0 if loaded else 1) and st["sched_hit_tokens_disk"] == (
            2 * CHUNK if loaded else 0), st
        decisions = eng.connector.planner.store_stats()["gate"]["decisions"]
        assert decisions["beats" if loaded else "declined"] == 1, decisions
        # what the decision weighed: the plan taken is the faster of the two estimates
        chosen, recompute, load_all = (st[f"split_est_{k}_s"] for k in ("chosen", "recompute", "load_all"))
        assert chosen == min(recompute, load_all) > 0 and (chosen == load_all) is loaded, st
    finally:
        eng.close()


@pytest.mark.parametrize("gbps,loaded", [(SLOW, False), (FAST, True)], ids=["recompute", "load"])
@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async"])
def test_hit_split_across_tiers_loads_the_cpu_part_and_the_disk_part_by_the_decision(model_dir, tmp_path, gbps,
                                                                                       loaded, async_sched):
    """Chunks 0-1 in the CPU tier, 2-7 only on disk: the CPU part always loads; the disk part as the rates say.
    The counters and the metrics say so per tier, each hit counted once."""
    eng = Engine.create(model_dir, cfg(tmp_path, disk_read_gbps=gbps), async_sched=async_sched)
    try:
        tokens = prompt(2, 8 * CHUNK + 4)
        a = _turn(eng, "a", tokens)
        keys = chunk_keys(eng, a, 8)
        hold_on_disk_only(eng, keys[2:])
        assert eng.connector.planner.chain.locate(keys) == [CPU] * 2 + [DISK] * 6
        before = split_samples(eng)
        _turn(eng, "a2", tokens)
        assert eng.cached_at_start["a2"] == (8 if loaded else 2) * CHUNK
        got = {k: v - before.get(k, 0) for k, v in split_samples(eng).items()}
        assert got[("cpu", "loaded")] == 2 * CHUNK and got[("cpu", "recomputed")] == 0, got
        assert got[("disk", "loaded")] == (6 * CHUNK if loaded else 0), got
        assert got[("disk", "recomputed")] == (0 if loaded else 6 * CHUNK), got
        st = eng.connector.stats()
        assert st["sched_hit_tokens_cpu"] == 2 * CHUNK, st
        assert st["sched_hit_tokens_disk"] == (6 * CHUNK if loaded else 0), st
        assert st["disk_gbps_estimate"] > 0 and st["prefill_source"] in ("start", "scaled", "online"), st
    finally:
        eng.close()


def test_cpu_tier_hits_always_load_even_when_recompute_looks_free(model_dir, tmp_path):
    """A recompute priced at almost nothing (a huge prefill rate) never declines CPU-tier chunks."""
    eng = Engine.create(model_dir, cfg(tmp_path, prefill_tokens_per_s=1e12, prefill_learn=False))
    try:
        tokens = prompt(3, 4 * CHUNK + 4)
        _turn(eng, "a", tokens)
        _turn(eng, "a2", tokens)
        assert eng.cached_at_start["a2"] == 4 * CHUNK
        st = eng.connector.stats()
        assert st["split_cpu_loaded_tokens"] == 4 * CHUNK and st["prefill_steps_timed"] == 0, st
    finally:
        eng.close()


@pytest.mark.parametrize("slowdown", [0.0, 0.05], ids=["as-priced", "launch-bound"])
def test_cpu_hits_recompute_where_loading_steps_have_a_floor(model_dir, tmp_path, monkeypatch, slowdown):
    """An engine whose loading step costs more than recomputing (an eager launch: H200, 2026-11-30): the workers
    time every loading step ``slowdown`` longer than its price; once ``FLOOR_MIN_SAMPLES`` such steps measured the
    floor and the prefill model is fitted, the next conversation's CPU hit is recomputed whole, as vLLM alone would;
    steps as priced keep CPU hits loading. The forwards are timed by the workers' clock, as on the GPU."""
    from tiered_kv.connector.vllm.forward_clock import ForwardClock
    from tiered_kv.planner.gate import FLOOR_MIN_SAMPLES, RECENT_STEPS

    take = ForwardClock.take
    monkeypatch.setattr(ForwardClock, "take", lambda self: {s: (t + slowdown if loaded else t, loaded)
                                                            for s, (t, loaded) in take(self).items()})
    eng = Engine.create(model_dir, cfg(tmp_path, disk_path=None, disk_bytes=0, write_policy="write_back",
                                       cpu_bytes=64 * CHUNK_BYTES), num_blocks=NUM_BLOCKS)
    try:
        more = prompt(23, 40)  # a turn 2 computes 40 new tokens: a prefill step (4 would be a decode-sized one)
        _serve_mixed_prompts(eng, 16, seed=8)  # the prefill model is fitted from these steps
        _wait_fitted(eng)
        for k in range(FLOOR_MIN_SAMPLES):
            a = prompt(40 + k, 4 * CHUNK + 4)
            _turn(eng, f"a{k}", a)
            _turn(eng, f"a{k}-2", a + more)
            assert eng.cached_at_start[f"a{k}-2"] == 4 * CHUNK  # the floor not measured yet (or none): loads
        st = eng.connector.stats()
        assert st["prefill_steps_priced"] == FLOOR_MIN_SAMPLES, st
        b = prompt(22, 4 * CHUNK + 4)
        _turn(eng, "b", b)
        _turn(eng, "b2", b + more)
        recomputed = slowdown > 0
        assert eng.cached_at_start["b2"] == (0 if recomputed else 4 * CHUNK), eng.connector.stats()
        st = eng.connector.stats()
        assert st["sched_cpu_hits_recomputed"] == int(recomputed), st
        assert (st["cpu_load_floor_s"] > 0.04) == recomputed, st
        decisions = eng.connector.planner.store_stats()["gate"]["decisions"]
        assert decisions["recompute"] == int(recomputed), decisions
        # the workers' times of the unloaded prefill steps reached the gate's recent speed, near the model's (the
        # harness's steps run at its truth; only the loaded ones are slowed)
        gate = eng.connector.planner._gate
        assert len(gate._recent) == RECENT_STEPS and 0.8 < gate.recompute_scale < 1.25, list(gate._recent)
        assert st["cpu_recompute_scale"] == pytest.approx(gate.recompute_scale, abs=1e-4)
    finally:
        eng.close()


def test_a_cold_first_loading_step_leaves_cpu_hits_loading_until_slow_steps_fill_the_window(model_dir, tmp_path,
                                                                                              monkeypatch):
    """H200, uncompiled Llama-3-8B c1, round 21: the engine's first loading step ran 54 ms, the next ones 19-36; an
    averaged floor stayed over the hits' recompute and 12 of 16 hits recomputed. On vLLM's real Scheduler, the
    workers time the first loading step 100 ms over its price and the next ones 4 ms over (a loading step here is
    priced ~1.5 ms, the hit's recompute ~10 ms): the next hits keep loading; once ``FLOOR_WINDOW`` loading steps in a
    row ran 50 ms over, the next hit recomputes."""
    from tiered_kv.connector.vllm.forward_clock import ForwardClock
    from tiered_kv.planner.gate import FLOOR_MIN_SAMPLES
    from tiered_kv.planner.rates import FLOOR_WINDOW

    loaded_steps = []

    def slowdown() -> float:
        n = len(loaded_steps)
        loaded_steps.append(n)
        return 0.100 if n == 0 else 0.004 if n <= FLOOR_MIN_SAMPLES else 0.050

    take = ForwardClock.take
    monkeypatch.setattr(ForwardClock, "take", lambda self: {s: (t + slowdown() if loaded else t, loaded)
                                                            for s, (t, loaded) in take(self).items()})
    eng = Engine.create(model_dir, cfg(tmp_path, disk_path=None, disk_bytes=0, write_policy="write_back",
                                       cpu_bytes=64 * CHUNK_BYTES), num_blocks=NUM_BLOCKS)
    try:
        more = prompt(23, 40)
        _serve_mixed_prompts(eng, 16, seed=8)
        _wait_fitted(eng)
        for k in range(FLOOR_MIN_SAMPLES + 1 + FLOOR_WINDOW):  # the first, three fast, then slow loading steps
            a = prompt(60 + k, 4 * CHUNK + 4)
            _turn(eng, f"a{k}", a)
            _turn(eng, f"a{k}-2", a + more)
            assert eng.cached_at_start[f"a{k}-2"] == 4 * CHUNK, (k, eng.connector.stats())
        st = eng.connector.stats()
        assert st["prefill_steps_priced"] == len(loaded_steps) == FLOOR_MIN_SAMPLES + 1 + FLOOR_WINDOW, st
        assert st["sched_cpu_hits_recomputed"] == 0 and st["cpu_load_floor_s"] > 0.04, st
        b = prompt(22, 4 * CHUNK + 4)
        _turn(eng, "b", b)
        _turn(eng, "b2", b + more)
        assert eng.cached_at_start["b2"] == 0, eng.connector.stats()
        assert eng.connector.stats()["sched_cpu_hits_recomputed"] == 1
    finally:
        eng.close()


# ---------------------------------------------------------------------------------------------- the learned model

#: the harness's "GPU": 1 ms a step, 50k tokens/s at short context, attention doubling a token's cost at 3k
TRUTH = PrefillModel(0.001, 1 / 50000, 1 / 50000 / 3000, 5e-9)
#: GPU blocks: room for a few of the longest prompts at once
NUM_BLOCKS = 512
#: what the model is checked at: prefill chunks the harness's steps hold (256 tokens a step at most)
GRID = [(256, 0), (256, 1024), (128, 1792), (64, 512), (256, 1536)]


def _worst_error(model: PrefillModel) -> float:
    return max(abs(model.seconds(n, c) / TRUTH.seconds(n, c) - 1) for n, c in GRID)


def _serve_mixed_prompts(eng: Engine, n: int, seed: int) -> None:
    """``n`` prompts of 40 to 1,900 tokens arriving a few steps apart: steps of a whole token budget (256) and of
    less (a prompt's last chunk with others' decodes), at contexts up to 1.9k. (Had they all queued at once, every
    step would hold 256 tokens, and a step's fixed cost could not be told from its per-token cost.)"""
    rng = random.Random(seed)
    for i in range(n):
        eng.add(f"p{i}", prompt(1000 + i, rng.randrange(40, 1900)), max_tokens=rng.randrange(1, 6))
        for _ in range(rng.randrange(2, 10)):
            eng.step()
    eng.run(timeout=120.0)


def _wait_fitted(eng: Engine, timeout: float = 30.0) -> None:
    meter = eng.connector.planner.steps
    deadline = time.monotonic() + timeout
    while not meter.idle() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert meter.idle(), "the fit thread did not catch up"


@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async"])
def test_learned_prefill_rate_converges_on_the_harness_steps(model_dir, async_sched):
    """Prompts of 80 to 1,900 tokens through vLLM's scheduler (chunked prefill, mixed with decodes), each step timed
    by the truth on the test's clock: the fitted model is within 10% of the truth where the steps were (the start,
    30k tokens/s and half rate at 32k, is 40-80% off), and the metrics show it online."""
    eng = Engine.create(model_dir, {"chunk_blocks": K, "cpu_bytes": 16 * CHUNK_BYTES}, async_sched=async_sched,
                        num_blocks=NUM_BLOCKS)
    eng.step_truth = TRUTH
    echoed = _record_echoed_steps(eng)
    try:
        planner = eng.connector.planner
        assert _worst_error(planner.steps.estimator.model()) > 0.3
        _serve_mixed_prompts(eng, 48, seed=5)
        eng.flush()
        assert echoed == list(range(1, planner._step + 1))  # every step's output came back with its number, in order
        _wait_fitted(eng)
        st = eng.connector.stats()
        assert st["prefill_source"] == "online" and st["prefill_fits"] >= 1 and st["prefill_samples"] >= 64, st
        assert st["prefill_steps_timed"] > st["prefill_samples"], st  # decode-only steps timed too, then skipped
        model = planner.steps.estimator.model()
        assert _worst_error(model) < 0.10, (model, TRUTH)
        reg = make_registry(planner.store_stats, "vllm")
        rate = reg.get_sample_value("tiered_kv_split_prefill_tokens_per_s",
                                    {"store": "vllm", "context": "0", "source": "online"})
        assert rate == pytest.approx(TRUTH.tokens_per_s(2048, 0), rel=0.10)
        assert reg.get_sample_value("tiered_kv_split_prefill_samples_total", {"store": "vllm"}) >= 64
    finally:
        eng.close()
    assert planner.steps._thread is not None and not planner.steps._thread.is_alive()  # shutdown stopped it


def test_the_model_learns_the_workers_forward_times_not_the_schedulers_clock(model_dir):
    """The workers time each forward (``ForwardClock``) and the meter fits those: with the scheduler's own clock
    running at half speed (as it runs short when vLLM applies a step's output late), the model still converges on
    the truth, and ``recent`` shows both clocks."""
    eng = Engine.create(model_dir, {"chunk_blocks": K, "cpu_bytes": 16 * CHUNK_BYTES}, async_sched=True,
                        num_blocks=NUM_BLOCKS)
    eng.step_truth = TRUTH
    meter = eng.connector.planner.steps
    meter.clock = lambda: 0.5 * eng.step_clock
    try:
        _serve_mixed_prompts(eng, 48, seed=8)
        eng.flush()
        _wait_fitted(eng)
        st = eng.connector.stats()
        assert st["prefill_clock"] == "workers" and st["prefill_samples"] >= 64, st
        assert _worst_error(meter.estimator.model()) < 0.10, meter.estimator.model()
        both = [(sched, fwd) for _, tokens, sched, fwd, _ in meter.recent if sched is not None and tokens > 16]
        assert both and all(sched < 0.75 * fwd for sched, fwd in both), list(meter.recent)
    finally:
        eng.close()


def test_steps_that_wait_for_in_step_loads_are_timed_but_not_fitted(model_dir, tmp_path):
    """A turn 2 whose prefix the CPU tier holds loads it in the step that computes the rest: that forward waits for
    the load, so its time is not a recompute's and stays out of the fit."""
    eng = Engine.create(model_dir, cfg(tmp_path, disk_path=None, disk_bytes=0, write_policy="write_back"))
    try:
        tokens = prompt(5, 4 * CHUNK)
        _turn(eng, "a", tokens + [7, 8, 9, 10])
        before = eng.connector.planner.steps.estimator.report()["samples"]
        _turn(eng, "a2", tokens + prompt(6, 40))  # 40 new tokens: a prefill step, were it not for the load
        assert eng.cached_at_start["a2"] == 4 * CHUNK
        st = eng.connector.stats()
        assert st["sched_sync_loads"] >= 1 and st["prefill_steps_loaded"] >= 1, st
        loaded = [r for r in eng.connector.planner.steps.recent if r[4]]
        assert [r[1] for r in loaded] == [40], list(eng.connector.planner.steps.recent)
        assert eng.connector.planner.steps.estimator.report()["samples"] == before  # its step is not a sample
    finally:
        eng.close()


def test_the_learned_model_drives_the_decision(model_dir, tmp_path):
    """Configured as if recomputing were free (1e9 tokens/s), a disk hit at 0.05 GB/s is declined; once the model
    has learned the engine's real (harness) rate, the same hit loads."""
    eng = Engine.create(model_dir, cfg(tmp_path, disk_read_gbps=0.05, prefill_tokens_per_s=1e9, disk_bytes="16MiB"),
                        num_blocks=NUM_BLOCKS)
    eng.step_truth = TRUTH
    try:
        tokens = prompt(4, 4 * CHUNK + 4)
        a = _turn(eng, "a", tokens)
        keys = chunk_keys(eng, a, 4)
        hold_on_disk_only(eng, keys)
        _turn(eng, "a2", tokens)
        assert eng.cached_at_start["a2"] == 0  # declined: recompute looked free
        hold_on_disk_only(eng, keys)  # a2 stored them in the CPU tier again
        _serve_mixed_prompts(eng, 24, seed=6)
        _wait_fitted(eng)
        hold_on_disk_only(eng, keys)
        _turn(eng, "a3", tokens)
        # 4 chunks of 16 KiB at 0.05 GB/s: 1.3 ms; recomputing 256 tokens at the truth: 6.3 ms
        assert eng.cached_at_start["a3"] == 4 * CHUNK, eng.connector.stats()
    finally:
        eng.close()


def test_prefill_learn_false_pins_the_model_and_sends_no_step_numbers(model_dir):
    eng = Engine.create(model_dir, {"chunk_blocks": K, "cpu_bytes": 16 * CHUNK_BYTES, "prefill_learn": False},
                        num_blocks=NUM_BLOCKS)
    echoed = _record_echoed_steps(eng)
    try:
        _serve_mixed_prompts(eng, 8, seed=7)
        st = eng.connector.stats()
        assert st["prefill_steps_timed"] == 0 and st["prefill_source"] == "fixed", st
        assert set(echoed) <= {-1}  # reports only, never a step number
    finally:
        eng.close()


def _record_echoed_steps(eng: Engine) -> list[int]:
    """The step numbers the workers' outputs carry, in the order the scheduler applies them."""
    seen: list[int] = []
    conn = eng.connector
    original = conn.update_connector_output

    def recording(output):
        wm = output.kv_connector_worker_meta
        if isinstance(wm, TieredKVWorkerMeta):
            seen.append(wm.step)
        original(output)

    conn.update_connector_output = recording
    return seen


# ---------------------------------------------------------------------------------------------- without vLLM

def test_step_parts_of_prefill_and_decode_steps():
    assert step_parts(step_output([], [("a", 1, 900), ("b", 4, 50)])) == []  # decode (and a speculative verify) only
    assert step_parts(step_output([], [("a", 16, 900)] + [(f"d{i}", 1, 10) for i in range(40)])) == []
    parts = step_parts(step_output([("n", 256, 64)], [("a", 1, 900), ("b", 17, 20)]))
    assert sorted(parts) == [(1, 900), (17, 20), (256, 64)]
    assert step_parts(step_output([], [])) == []


def test_step_meter_times_steps_and_fits_on_its_thread():
    clock = [0.0]
    meter = StepMeter(PrefillEstimator(PrefillModel.from_rate(30000, 32768), fit_on_read=False), lambda: clock[0])
    for step in range(1, 4 * REFIT_EVERY + 1):
        out = step_output([(f"r{step}", 64 * (1 + step % 4), 128 * (step % 5))], [("d", 1, 1000)]) if step % 3 else \
            step_output([], [("d", 1, 1000)])
        meter.scheduled(step, out)
        clock[0] += TRUTH.step_seconds(step_parts(out) or [(1, 1000)])
        meter.finished(step)
    deadline = time.monotonic() + 10
    while not meter.idle() and time.monotonic() < deadline:
        time.sleep(0.005)
    meter.drain(pause=lambda: None)  # what the thread may not have reached yet
    rep = meter.estimator.report()
    decode_steps = sum(1 for step in range(1, 4 * REFIT_EVERY + 1) if step % 3 == 0)
    assert meter.timed == 4 * REFIT_EVERY and rep["skipped_decode_steps"] == decode_steps, rep
    assert meter.fits >= 1 and rep["source"] == "online", rep
    assert meter.estimator.model().seconds(256, 256) == pytest.approx(TRUTH.seconds(256, 256), rel=0.05)
    meter.close()
    assert not meter._thread.is_alive()


def test_step_meter_fits_as_soon_as_the_estimator_can():
    """GPU round 17's 32k run: 7 prefill steps before the first loaded one, all of them long prompts. The first
    estimate (the start model scaled) comes after ``SCALE_SAMPLES`` (4) steps and the first fit after
    ``MIN_SAMPLES`` (8), not after ``REFIT_EVERY`` steps past them: the next loads are planned with the engine's own
    times, not a start model 10% high."""
    clock = [0.0]
    meter = StepMeter(PrefillEstimator(PrefillModel.from_rate(37000, 32768), fit_on_read=False), lambda: clock[0])

    def steps(first: int, last: int) -> None:
        for step in range(first, last + 1):
            out = step_output([(f"r{step}", 32768 - 64 * (step % 2), 0)], [])
            meter.scheduled(step, out)
            clock[0] += TRUTH.step_seconds(step_parts(out))
            meter.finished(step)
        deadline = time.monotonic() + 10
        while (meter._queue or not meter.idle()) and time.monotonic() < deadline:
            time.sleep(0.005)

    steps(1, SCALE_SAMPLES)
    assert meter.fits == 1 and meter.estimator.report()["source"] == "scaled"
    start_error = abs(meter.estimator.start.seconds(32768, 0) / TRUTH.seconds(32768, 0) - 1)
    assert start_error > 0.05  # the start is off at this size ...
    assert meter.estimator.model().seconds(32768, 0) == pytest.approx(TRUTH.seconds(32768, 0), rel=0.02)  # ... not this
    steps(SCALE_SAMPLES + 1, MIN_SAMPLES)
    assert meter.fits == 2 and meter.estimator.report()["source"] == "online"
    meter.close()


def test_worker_meta_carries_the_step_over_ranks():
    a, b = TieredKVWorkerMeta({}, 7), TieredKVWorkerMeta({}, 7)
    assert bool(a) and not bool(TieredKVWorkerMeta()) and a.aggregate(b).step == 7
    assert TieredKVWorkerMeta().aggregate(b).step == 7


def test_worker_meta_merges_forward_times_over_ranks_slowest_wins():
    a = TieredKVWorkerMeta({}, 7, {5: (0.010, False), 6: (0.020, False)})
    b = TieredKVWorkerMeta({}, 7, {5: (0.012, True), 4: (0.001, False)})
    assert a.aggregate(b).forward == {4: (0.001, False), 5: (0.012, True), 6: (0.020, False)}
    assert TieredKVWorkerMeta().aggregate(TieredKVWorkerMeta({}, -1, {})).forward == {}  # a clock with nothing yet
    assert TieredKVWorkerMeta().aggregate(TieredKVWorkerMeta()).forward is None  # no clock on any rank
    assert bool(TieredKVWorkerMeta({}, -1, {3: (0.1, False)})) and not bool(TieredKVWorkerMeta({}, -1, {}))


def test_step_meter_fits_the_workers_times_once_they_come():
    """Before any worker reports forwards, the scheduler's clock times steps; once one does, only the workers'
    times count, matched to the steps they name (which come back a step or two late), and steps with in-step loads
    are counted but not fitted."""
    clock = [0.0]
    meter = StepMeter(PrefillEstimator(PrefillModel.from_rate(30000, 32768), fit_on_read=False), lambda: clock[0])
    out = step_output([("n", 256, 0)], [])
    meter.scheduled(1, out)
    clock[0] = 1.0
    meter.finished(1)  # no forward: the scheduler clock's 1 s
    assert meter.timed == 1 and not meter.worker_clock and meter._queue[-1][1] == pytest.approx(1.0)
    meter.scheduled(2, out)
    meter.scheduled(3, out)
    meter.finished(2, {})  # a worker clock, nothing done yet
    assert meter.worker_clock and meter.timed == 1
    meter.finished(3, {2: (0.01, False), 3: (0.02, True)})
    assert meter.timed == 3 and meter.loaded_steps == 1 and meter._queue[-1] == ([(256, 0)], 0.01)
    meter.finished(3, {2: (0.5, False)})  # another rank's report of a step already timed: ignored
    assert meter.timed == 3 and len(meter._queue) == 2
    assert [r[0] for r in meter.recent] == [1, 2, 3] and meter.recent[1][3] == 0.01 and meter.recent[2][4]
    for step in range(4, 4 + 2 * 256):
        meter.scheduled(step, out)  # never timed by any worker: the meter keeps a bounded number
    assert len(meter._parts) <= 256


def test_step_meter_prices_the_loaded_steps_for_the_gate():
    """A step scheduled with in-step loads and timed by the workers as loaded hands the gate its bytes, its forward
    time and its price: the model's compute of its tokens plus the exposure its plans priced. A loaded step without
    such a record, an unloaded step, and a step only the scheduler's clock timed hand nothing."""
    model = PrefillModel.from_rate(30000, 32768)
    got: list[tuple[dict, float, float]] = []
    meter = StepMeter(PrefillEstimator(model, fit_on_read=False), lambda: 0.0,
                      on_loaded=lambda nbytes, seconds, priced: got.append((nbytes, seconds, priced)))
    out = step_output([("n", 256, 512)], [])
    meter.scheduled(1, out, ({"disk": 1e8}, 0.002))
    meter.finished(1)  # the scheduler's clock: it cannot tell a forward that waited
    assert got == [] and meter._in_step == {}
    meter.scheduled(2, out, ({"disk": 1e8}, 0.002))
    meter.scheduled(3, out, ({"cpu": 5e7}, 0.0))
    meter.scheduled(4, out)
    meter.finished(4, {2: (0.050, True), 3: (0.020, False), 4: (0.030, True)})
    compute = model.step_seconds([(256, 512)])
    assert got == [({"disk": 1e8}, 0.050, pytest.approx(compute + 0.002))]
    assert meter.priced_steps == 1 and meter.loaded_steps == 2 and meter._in_step == {}


def test_step_meter_hands_the_gate_each_unloaded_prefill_steps_time_and_price():
    """The gate's recent speed (``SplitGate.recompute_scale``) comes from the workers' times of prefill steps without
    in-step loads, each with the model's price of its tokens: not from loaded steps, decode-only steps, or steps only
    the scheduler's clock timed (it cannot tell a loaded forward from another)."""
    model = PrefillModel.from_rate(30000, 32768)
    got: list[tuple[float, float]] = []
    meter = StepMeter(PrefillEstimator(model, fit_on_read=False), lambda: 0.0,
                      on_unloaded=lambda seconds, priced: got.append((seconds, priced)))
    prefill, decode = step_output([("n", 256, 512)], []), step_output([("d", 1, 900)], [])
    meter.scheduled(1, prefill)
    meter.finished(1)  # the scheduler's clock
    assert got == []
    for step, out in ((2, prefill), (3, prefill), (4, decode)):
        meter.scheduled(step, out)
    meter.finished(4, {2: (0.030, False), 3: (0.050, True), 4: (0.004, False)})
    assert got == [(0.030, pytest.approx(model.step_seconds([(256, 512)])))]


def test_step_meter_gives_up_when_no_output_carries_a_step_number(caplog):
    """Something between the workers and the scheduler drops the worker metadata: the meter stops timing (no
    pending steps pile up) and says so once; the start model stays."""
    from tiered_kv.connector.vllm.prefill import UNANSWERED_STEPS

    meter = StepMeter(PrefillEstimator(PrefillModel.from_rate(30000, 32768), fit_on_read=False), lambda: 0.0)
    out = step_output([("n", 256, 0)], [])
    caplog.set_level("WARNING", logger="tiered_kv.connector")
    for step in range(1, UNANSWERED_STEPS + 10):
        meter.scheduled(step, out)
    assert not meter.on and not meter._timer._pending
    assert sum("no output came back" in r.message for r in caplog.records) == 1
    assert meter.estimator.report()["source"] == "start"
