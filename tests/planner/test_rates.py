"""The online estimates (``tiered_kv.planner.rates``): a tier's read rate, the prefill model and its fit.

The fit is checked against a synthetic truth: steps of a prefill chunk (512 to 8192 tokens after 0 to 32k cached
ones) plus up to 20 other requests' decodes, timed by the truth with 5% log-normal noise, one step in ten an
outlier (3x or 10x slower, or 5x faster). "Within 10%" means the predicted seconds of every point of ``GRID``
(prefills from 512 tokens at context 0 to 8192 after 24k) are within 10% of the truth's.
"""
from __future__ import annotations

import random

import pytest

from tiered_kv.errors import ConfigError
from tiered_kv.planner.rates import (DECODE_TOKENS, FLOOR_WINDOW, MIN_SAMPLES, SCALE_SAMPLES, LoadFloor,
                                     OverlapCost, PrefillEstimator, PrefillModel, ReadRate, StepTimer, features)

#: Llama-3-8B-like on one GPU: 4 ms a step, 40k tokens/s at short context, attention doubling the cost at 20k
TRUTH = PrefillModel(0.004, 1 / 40000, 1 / 40000 / 20000, 2e-9)
START = PrefillModel.from_rate(30000, 32768)  # the configured start: 25% slow, and attention's share off by 40%
GRID = [(512, 0), (2048, 4096), (8192, 0), (8192, 24576), (4096, 16384)]


def _worst_error(model: PrefillModel, truth: PrefillModel) -> float:
    return max(abs(model.seconds(n, c) / truth.seconds(n, c) - 1) for n, c in GRID)


def _step(rng: random.Random, truth: PrefillModel, outliers: float = 0.1,
          noise: float = 0.05) -> tuple[list[tuple[int, int]], float]:
    parts = [(rng.choice([512, 1024, 2048, 4096, 8192]), rng.randrange(0, 32768, 64))]
    parts += [(1, rng.randrange(100, 20000)) for _ in range(rng.randrange(0, 20))]
    seconds = truth.step_seconds(parts) * rng.lognormvariate(0, noise)
    if rng.random() < outliers:
        seconds *= rng.choice([3.0, 10.0, 0.2])
    return parts, seconds


def _feed(est: PrefillEstimator, rng: random.Random, truth: PrefillModel, n: int, outliers: float = 0.1,
          noise: float = 0.05) -> None:
    for _ in range(n):
        est.observe_step(*_step(rng, truth, outliers, noise))


# ---------------------------------------------------------------------------------------------- overlap cost

@pytest.mark.parametrize("seed", range(3))
def test_overlap_cost_converges_on_a_noisy_truth_and_follows_a_change(seed):
    """Steps that read 50-200 MB under the forward, each slowed 1 ns a byte with +-5 ms of noise in the step: the
    cost converges within 10% of the truth, then follows a change to 0.2 ns (a tier that got faster), and never
    reads below 0 even when the samples go negative."""
    rng = random.Random(seed)
    cost = OverlapCost()
    assert cost.s_per_byte == 0.0 and cost.samples == 0

    def steps(truth: float, n: int) -> None:
        for _ in range(n):
            nbytes = rng.randrange(50, 200) * 10**6
            cost.observe(nbytes, truth * nbytes + rng.uniform(-5e-3, 5e-3))

    steps(1e-9, 40)
    assert cost.s_per_byte == pytest.approx(1e-9, rel=0.10) and cost.samples == 40
    steps(0.2e-9, 40)
    assert cost.s_per_byte == pytest.approx(0.2e-9, rel=0.10)
    for _ in range(40):
        cost.observe(10**8, -0.05)  # steps that ran faster than priced
    assert cost.s_per_byte == 0.0
    cost.observe(0, 1.0)  # nothing read: ignored
    assert cost.samples == 120


def test_overlap_cost_weighs_each_step_by_the_bytes_it_read():
    """GPU round 17, 32k-token Llama steps: one that read one chunk (33 MB) ran 0.13 s under a start model 10% high
    (a per-byte sample of -3.9 s/GB), the next read 1.32 GB and ran 1.14 s over its price. An average of per-step
    ratios stayed below 0 (a cost of 0: the split kept loading); weighted by bytes the cost is clearly positive,
    and the small step moves it by what it read."""
    cost = OverlapCost()
    cost.observe(33_554_432, -0.13)
    assert cost.s_per_byte == 0.0  # below 0 on its own
    cost.observe(1_321_205_760, 1.14)
    assert cost.s_per_byte * 1e9 == pytest.approx((0.8 * -0.13 + 0.2 * 1.14) / (0.8 * 0.0336 + 0.2 * 1.3212), rel=0.01)
    assert cost.s_per_byte * 1e9 > 0.4
    big = OverlapCost()
    big.observe(1_321_205_760, 1.14)
    alone = big.s_per_byte
    big.observe(33_554_432, -0.13)  # one small step after it barely moves it
    assert big.s_per_byte == pytest.approx(alone, rel=0.25) and big.s_per_byte > 0.6e-9


def test_load_floor_follows_steps_on_the_floor_and_is_bounded_by_steps_as_priced():
    """Steps well over their price (an eager launch of 22-32 ms against ~6 ms priced) are samples of the floor, the
    least of the latest few follows a slower host; large steps bound by their compute leave it alone; a step that ran
    as priced bounds it by its time; a compiled engine's steps (all as priced) never make one."""
    rng = random.Random(4)
    floor = LoadFloor()
    for _ in range(30):
        floor.observe(rng.uniform(0.022, 0.026), 0.006)
    assert floor.seconds == pytest.approx(0.024, rel=0.10) and floor.samples == 30
    for _ in range(30):
        floor.observe(rng.uniform(0.028, 0.032), 0.006)
    assert floor.seconds == pytest.approx(0.030, rel=0.10)
    for _ in range(20):
        floor.observe(0.40, 0.38)  # a c32 step, bound by its compute: no news about the floor
    assert floor.seconds == pytest.approx(0.030, rel=0.10) and floor.samples == 60
    floor.observe(0.0195, 0.019)  # a step as priced under the floor: the floor is at most its time
    assert floor.seconds == 0.0195 and floor.samples == 60
    for _ in range(FLOOR_WINDOW):
        floor.observe(0.030, 0.006)  # the bound lasts until as many samples replaced the ones it lowered
    assert floor.seconds == 0.030 and floor.samples == 60 + FLOOR_WINDOW
    compiled = LoadFloor()
    for _ in range(20):
        compiled.observe(rng.uniform(0.009, 0.0105), 0.009)  # within 1.2x of its price
    assert compiled.seconds == 0.0 and compiled.samples == 0


def test_load_floor_is_the_least_of_the_latest_samples_not_their_average():
    """H200, uncompiled Llama-3-8B c1, round 21 (r10): the first loading steps ran 54 ms (the engine's first: one-time
    costs), 36 ms (a slow phase of the host's launches) and 19 ms; an average kept 42 ms, above the hits' 31 ms
    recompute, and 12 of 16 hits recomputed. The floor is the least of the last ``FLOOR_WINDOW``: 19 ms; a phase
    that lasts (every loading step at 34 ms) raises it once it fills the window."""
    floor = LoadFloor()
    for ms in (54.2, 36.3, 18.6):
        floor.observe(ms / 1e3, 0.006)
    assert floor.seconds == pytest.approx(0.0186) and floor.samples == 3
    for k in range(FLOOR_WINDOW):
        floor.observe(0.034, 0.006)
        assert floor.seconds == pytest.approx(0.034 if k == FLOOR_WINDOW - 1 else 0.0186)


# ---------------------------------------------------------------------------------------------- read rate

def test_read_rate_starts_at_its_start_and_follows_reads():
    r = ReadRate(1.0)
    assert r.gbps == 1.0 and r.seconds(2e9) == pytest.approx(2.0)
    for _ in range(20):
        r.observe(10**9, 0.2)  # 5 GB/s
    assert r.gbps == pytest.approx(5.0, rel=0.05) and r.reads == 20
    r.observe(0, 1.0)
    r.observe(10**9, 0.0)  # nothing moved / no time: ignored
    assert r.reads == 20


def test_fixed_read_rate_ignores_reads_and_a_bad_start_names_itself():
    r = ReadRate(2.0, fixed=True)
    r.observe(10**9, 0.01)
    assert r.gbps == 2.0 and r.reads == 0
    with pytest.raises(ConfigError, match="read rate"):
        ReadRate(0)


def test_a_guess_waits_for_a_large_read_to_replace_it_when_told_to():
    """``replace_min_bytes`` (the SGLang gate: pages may be tiny): a small first read is averaged into the guess,
    the first read of at least that size replaces it, and later reads average as usual. Without it (vLLM's chunks)
    the first read of any size replaces the guess."""
    r = ReadRate(3.0, guess=True, replace_min_bytes=4 << 20)
    r.observe(512, 512 / 1e6)  # 512 B at 1 MB/s: latency, not a rate
    assert r.gbps == pytest.approx(0.8 * 3.0 + 0.2 * 0.001)
    assert r.source == "guess" and not r.replaced and r.reads == 1  # still the guess, mostly
    r.hint(64 << 20, (64 << 20) / 1.0e9)  # so the tier's writes still bound it
    assert r.gbps == pytest.approx(1.0) and r.source == "writes"
    r.observe(8 << 20, (8 << 20) / 0.5e9)  # 8 MiB at 0.5 GB/s: replaces
    assert r.gbps == pytest.approx(0.5) and r.replaced and r.source == "reads"
    r.hint(64 << 20, (64 << 20) / 0.1e9)  # a measured rate ignores writes
    assert r.gbps == pytest.approx(0.5)
    r.observe(8 << 20, (8 << 20) / 1.5e9)  # then an average
    assert r.gbps == pytest.approx(0.8 * 0.5 + 0.2 * 1.5)
    plain = ReadRate(3.0, guess=True)
    plain.observe(512, 512 / 1e6)
    assert plain.gbps == pytest.approx(0.001)


def test_a_guessed_tiers_read_twice_its_largest_replaces_the_estimate():
    """GPU round 17 at 32k: the first read (one chunk, 33 MB) ran about twice the rate of the 1.3 GB read after it. A
    young tier's reads grow (the ramp: 4x a plan): a read of at least twice the largest before it replaces the
    estimate, a smaller one averages in as usual; a rate a user set always averages."""
    mb = 1 << 20
    r = ReadRate(3.0, guess=True)
    r.observe(32 * mb, 32 * mb / 1.2e9)
    assert r.gbps == pytest.approx(1.2)  # the first read replaces the guess
    r.observe(128 * mb, 128 * mb / 0.6e9)
    assert r.gbps == pytest.approx(0.6) and r.largest == 128 * mb  # 4x the largest: replaces
    r.observe(200 * mb, 200 * mb / 1.0e9)
    assert r.gbps == pytest.approx(0.8 * 0.6 + 0.2 * 1.0)  # 1.6x: averaged
    r.observe(1024 * mb, 1024 * mb / 0.5e9)
    assert r.gbps == pytest.approx(0.5)  # 5x: replaces
    user = ReadRate(1.2)
    user.observe(32 * mb, 32 * mb / 1.2e9)
    user.observe(128 * mb, 128 * mb / 0.6e9)
    assert user.gbps == pytest.approx(0.8 * 1.2 + 0.2 * 0.6)


# ---------------------------------------------------------------------------------------------- the model

def test_model_terms_by_hand():
    m = PrefillModel(0.001, 1e-5, 1e-9, 1e-8)
    # 100 tokens after 1000: pairs 100*1000 + 100*101/2 = 105050, reads 1100
    assert m.seconds(100, 1000) == pytest.approx(0.001 + 100e-5 + 105050e-9 + 1100e-8)
    assert m.seconds(0, 5000) == 0.0
    assert features([(100, 1000), (1, 50), (0, 7)]) == (1.0, 101.0, 105050.0 + 51, 1100.0 + 51)
    # a step's parts add up, the overhead once
    assert m.step_seconds([(100, 1000), (1, 50)]) == pytest.approx(m.seconds(100, 1000) + m.seconds(1, 50) - 0.001)


def test_from_rate_reads_as_its_two_numbers():
    m = PrefillModel.from_rate(30000, 32768)
    assert m.tokens_per_s(1, 0) == pytest.approx(30000, rel=1e-4)
    assert m.tokens_per_s(1, 32767) == pytest.approx(15000, rel=1e-3)  # a token attending to 32768 costs twice


@pytest.mark.parametrize("kw,match", [({"tokens_per_s": 0, "half_rate_context": 1}, "prefill_tokens_per_s"),
                                      ({"tokens_per_s": 1, "half_rate_context": -3}, "prefill_half_rate_context")])
def test_bad_start_values_name_themselves(kw, match):
    with pytest.raises(ConfigError, match=match):
        PrefillModel.from_rate(**kw)
    with pytest.raises(ConfigError, match="s_per_pair"):
        PrefillModel(0.0, 1e-5, -1.0)


# ---------------------------------------------------------------------------------------------- the estimator

def test_start_model_until_enough_samples_then_the_start_scaled_then_the_fit():
    est = PrefillEstimator(START)
    rng = random.Random(0)
    _feed(est, rng, TRUTH, SCALE_SAMPLES - 1, outliers=0)
    assert est.model() is START and est.report()["source"] == "start"
    _feed(est, rng, TRUTH, 1, outliers=0)
    scaled = est.model()
    assert est.report()["source"] == "scaled" and est.fitted
    ratio = scaled.s_per_token / START.s_per_token
    assert scaled.coefficients() == pytest.approx(tuple(c * ratio for c in START.coefficients()))
    _feed(est, rng, TRUTH, MIN_SAMPLES - SCALE_SAMPLES, outliers=0)
    assert est.model() is not scaled and est.report()["source"] == "online"


def test_the_scaled_start_takes_no_slow_step_in():
    """Four steps of one size, one of them slowed 3x (a first call's compilation, an allocator growing): the scaled
    start is right at that size; a full fit of the four coefficients to four samples would not be asked to."""
    est = PrefillEstimator(START)
    for i in range(SCALE_SAMPLES):
        est.observe(8192, 0, TRUTH.seconds(8192, 0) * (3.0 if i == 1 else 1.0))
    assert est.report()["source"] == "scaled"
    assert est.model().seconds(8192, 0) == pytest.approx(TRUTH.seconds(8192, 0), rel=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_converges_within_10_percent_of_the_truth_despite_noise_and_outliers(seed):
    est = PrefillEstimator(START)
    assert _worst_error(est.model(), TRUTH) > 0.2  # the start is well off
    _feed(est, random.Random(seed), TRUTH, 200)
    assert _worst_error(est.model(), TRUTH) < 0.10
    assert est.report()["outliers"] > 0  # some steps got no weight


def test_noise_free_fit_recovers_the_coefficients():
    est = PrefillEstimator(START)
    _feed(est, random.Random(3), TRUTH, 128, outliers=0, noise=0)
    for got, want in zip(est.model().coefficients()[:3], TRUTH.coefficients()[:3]):
        assert got == pytest.approx(want, rel=0.02)
    assert _worst_error(est.model(), TRUTH) < 0.01


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_follows_a_step_change(seed):
    """The GPU gets 1.5x slower (a co-tenant, a lower clock): within 10% of the new truth after 96 steps."""
    slower = PrefillModel(0.004, 1.5 / 40000, 1.5 / 40000 / 20000, 3e-9)
    est = PrefillEstimator(START)
    rng = random.Random(seed)
    _feed(est, rng, TRUTH, 150)
    assert _worst_error(est.model(), TRUTH) < 0.10 and _worst_error(est.model(), slower) > 0.25
    _feed(est, rng, slower, 96)
    assert _worst_error(est.model(), slower) < 0.10


def test_decode_only_steps_are_skipped_and_mixed_steps_count():
    est = PrefillEstimator(START)
    est.observe_step([(1, 4000)] * 30 + [(DECODE_TOKENS, 100)], 0.01)  # decoding (and a speculative verify) only
    est.observe_step([(DECODE_TOKENS + 1, 100)], 0.01)
    rep = est.report()
    assert rep["skipped_decode_steps"] == 1 and rep["samples"] == 1


def test_fixed_estimator_keeps_the_start_model():
    est = PrefillEstimator(START, fixed=True)
    _feed(est, random.Random(4), TRUTH, 50, outliers=0)
    assert est.model() is START and est.report() == {"source": "fixed", "model": START, "samples": 0,
                                                      "skipped_decode_steps": 0, "outliers": 0}


def test_refit_off_the_reading_thread_with_pauses():
    """``fit_on_read=False``: ``model`` never fits; ``refit`` does when due, outside the lock, calling ``pause``
    between slices of the work; the fit equals the one ``model`` would have made."""
    est, ref = PrefillEstimator(START, fit_on_read=False), PrefillEstimator(START)
    rng = random.Random(5)
    steps = [_step(rng, TRUTH) for _ in range(40)]
    for parts, secs in steps:
        est.observe_step(parts, secs)
        ref.observe_step(parts, secs)
    assert est.model() is START and est.report()["source"] == "start"
    pauses = []
    assert est.refit(pause=lambda: pauses.append(est.model()))  # readers get the old model while it fits
    assert len(pauses) >= 4 * 3 and all(m is START for m in pauses)  # at least 3 a round, 4 rounds
    assert est.model() == ref.model() and est.report()["source"] == "online"
    assert not est.refit()  # nothing new since
    est.observe_step(*steps[0])
    assert not est.refit() and est.report()["samples"] == 41  # one new sample: not due before REFIT_EVERY


def test_one_prompt_shape_only_fits_that_shape_and_keeps_the_start_shape_elsewhere():
    """All samples at one point (a benchmark of 8k prompts): that point is learned; elsewhere the start's shape
    (scaled) stands, with no coefficient below 0."""
    est = PrefillEstimator(START)
    for _ in range(40):
        est.observe(8192, 0, TRUTH.seconds(8192, 0))
    m = est.model()
    assert m.seconds(8192, 0) == pytest.approx(TRUTH.seconds(8192, 0), rel=0.01)
    assert min(m.coefficients()) >= 0 and m.s_per_token > 0


def test_bad_estimator_settings_are_config_errors():
    with pytest.raises(ConfigError, match="window"):
        PrefillEstimator(START, window=4, min_samples=8)


# ---------------------------------------------------------------------------------------------- step timer

def test_step_timer_sync_async_idle_and_lost_steps():
    t = StepTimer()
    t.scheduled(1, [(512, 0)], now=10.0)
    assert t.finished(1, now=10.1) == ([(512, 0)], pytest.approx(0.1))
    # async: step 3 is scheduled while step 2 runs; it starts when 2 ends
    t.scheduled(2, [(1024, 512)], now=10.1)
    t.scheduled(3, [(1, 1536)], now=10.15)
    assert t.finished(2, now=10.3)[1] == pytest.approx(0.2)
    assert t.finished(3, now=10.32)[1] == pytest.approx(0.02)
    # idle engine: a step scheduled later than the last one ended starts when scheduled
    t.scheduled(4, [(64, 0)], now=20.0)
    assert t.finished(4, now=20.05)[1] == pytest.approx(0.05)
    # a step whose output never came is forgotten once a later one finishes
    t.scheduled(5, [(64, 0)], now=21.0)
    t.scheduled(6, [(64, 0)], now=21.0)
    assert t.finished(6, now=21.1) is not None and t.finished(5, now=21.2) is None
    assert t.finished(99, now=22.0) is None


def test_step_timer_is_short_when_the_previous_output_is_applied_late():
    """vLLM's batch queue launches step N before it applies step N-1's output: a launch longer than what was left of
    N-1 moves N's start to that late apply, and N's time comes out short by the difference (why the vLLM connector
    times forwards on the workers: connector/vllm/forward_clock.py)."""
    t = StepTimer()
    t.scheduled(1, [(1, 64)], now=0.0)  # a short decode; the GPU is done with it at 0.01
    t.scheduled(2, [(8192, 0)], now=0.005)  # the next prefill, launched (on the CPU) until 0.065
    assert t.finished(1, now=0.065) is not None  # step 1's output, applied after step 2's launch
    assert t.finished(2, now=0.22)[1] == pytest.approx(0.155)  # the GPU ran it 0.01 -> 0.22: 0.21 s


def test_fit_of_one_prefill_size_and_one_turn2_size_predicts_the_prefill():
    """The shape of the H200 run of 2026-11-29 (12 prefills of 8,192 tokens, 12 turn-2 steps of 64 tokens after
    8,192 whose times hold a load): given the times measured from outside (turn-1 TTFT 0.225 s, turn-2 TTFTs), the fit
    predicts the 8k prefill within 10%. The connector's fit of that run said 0.65x: its step times were short."""
    turn2 = [0.0831, 0.0717, 0.032, 0.0333, 0.0373, 0.0441, 0.0438, 0.0392, 0.0475, 0.0352, 0.044, 0.0433]
    est = PrefillEstimator(PrefillModel.from_rate(37000, 32768))
    for t2 in turn2:
        est.observe(8192, 0, 0.225)
        est.observe(64, 8192, t2)
    assert est.model().seconds(8192, 0) == pytest.approx(0.225, rel=0.10)
