"""The load gates (``tiered_kv.planner.gate``): ``LoadGate`` (the vLLM connector) and ``SplitGate`` (the SGLang
backend; the vLLM connector next)."""
from __future__ import annotations

import pytest

from tiered_kv.errors import ConfigError, InvalidInputError
from tiered_kv.planner.gate import (ALL_FAST, ALWAYS, BEATS, DECLINED, FLOOR_MIN_SAMPLES, PROBE, RECENT_STEPS,
                                   RECOMPUTE, RECOMPUTE_MARGIN, RECOMPUTE_PROBE_EVERY, SCALE_BOUNDS, SPLIT, LoadGate,
                                   SplitGate)
from tiered_kv.planner.rates import FLOOR_WINDOW, PrefillEstimator, PrefillModel, ReadRate

MIB8 = 8 << 20  # one unit: 8 MiB for 64 tokens; break-even at 30k tokens/s = 3.93 GB/s


def test_memory_hits_always_load_and_policies_decide_the_rest():
    assert LoadGate("never", 1.0, 0, 30000, 64, MIB8).decide(4, 4) == (4, ALL_FAST)
    assert LoadGate("always", 0.1, 0, 30000, 64, MIB8).decide(1, 4) == (4, ALWAYS)
    assert LoadGate("never", 100.0, 0, 30000, 64, MIB8).decide(1, 4) == (1, DECLINED)
    assert LoadGate("auto", 8.0, 0, 30000, 64, MIB8).decide(1, 4) == (4, BEATS)
    assert LoadGate("auto", 2.0, 0, 30000, 64, MIB8).decide(1, 4) == (1, DECLINED)


def test_declined_tier_is_probed_and_the_estimate_follows_reads():
    g = LoadGate("auto", 2.0, 3, 30000, 64, MIB8)
    assert g.break_even_gbps() == pytest.approx(MIB8 * 30000 / 64 / 1e9)
    assert [g.decide(0, 2)[1] for _ in range(6)] == [DECLINED, DECLINED, PROBE, DECLINED, DECLINED, PROBE]
    for _ in range(20):
        g.observe(MIB8, MIB8 / 10e9)  # reads at 10 GB/s
    assert g.gbps == pytest.approx(10.0, rel=0.05) and g.beats_recompute()
    assert g.decide(0, 2) == (2, BEATS)
    g.observe(0, 1.0)
    g.observe(MIB8, 0.0)  # nothing moved / no time: ignored
    assert g.gbps == pytest.approx(10.0, rel=0.05)


def test_bad_policy_and_unit_are_config_errors():
    with pytest.raises(ConfigError, match="disk_load_policy"):
        LoadGate("sometimes", 1.0, 0, 30000, 64, MIB8)
    with pytest.raises(ConfigError, match="unit"):
        LoadGate("auto", 1.0, 0, 30000, 0, MIB8)


# ---------------------------------------------------------------------------------------------- SplitGate

KV = 128 << 10
LLAMA = PrefillModel(0.0, 0.22 / 8192, 0.0)


def _split_gate(policy="auto", probe=0, overlap=True, disk=2.15, remote=1.0):
    rates = {"disk": ReadRate(disk), "remote": ReadRate(remote)}
    return SplitGate(policy, probe, rates, PrefillEstimator(LLAMA, fixed=True), overlap=overlap, unit_tokens=256,
                     unit_nbytes=256 * KV)


def test_split_gate_outcomes():
    g = _split_gate()
    assert g.decide([("cpu", 1024)], 1, 0)[1] == ALL_FAST
    plan, outcome = g.decide([("disk", 8192)], 0, 0)
    assert outcome == SPLIT and 0 < plan.load_tokens < 8192
    assert _split_gate(overlap=False).decide([("disk", 8192)], 0, 0)[1] == DECLINED
    assert _split_gate(disk=50.0).decide([("disk", 8192)], 0, 0)[1] == BEATS
    plan, outcome = _split_gate("always").decide([("cpu", 256), ("disk", 512)], 0, 0)
    assert outcome == ALWAYS and plan.load_tokens == 768
    plan, outcome = _split_gate("never", disk=50.0).decide([("cpu", 256), ("disk", 512)], 0, 0)
    assert outcome == DECLINED and plan.load_tokens == 256


def test_split_gate_aligns_a_split_to_the_loaders_chunks():
    """``align``: a split between two chunk ends becomes the better of them (priced again), never below the memory
    tiers' part; a plan that loads all or none is left as it is."""
    g = _split_gate()
    free, _ = g.decide([("disk", 8192)], 0, 0)
    assert free.load_tokens % 1024, free.load_tokens  # the unaligned optimum (256-token units)
    plan, outcome = g.decide([("disk", 8192)], 0, 0, align=1024)
    assert outcome == SPLIT and plan.load_tokens % 1024 == 0 and abs(plan.load_tokens - free.load_tokens) < 1024
    assert plan.seconds >= free.seconds - 1e-12
    shifted, _ = g.decide([("disk", 8192)], 0, 0, align=1024, offset=256)  # vLLM holds a chunk's first 256 tokens
    assert (shifted.load_tokens + 256) % 1024 == 0
    plan, _ = g.decide([("cpu", 512), ("disk", 8192)], 0, 0, align=1024)
    assert plan.load_tokens >= 512 and (plan.load_tokens % 1024 == 0 or plan.load_tokens == 512)
    assert _split_gate(disk=50.0).decide([("disk", 8192)], 0, 0, align=1000)[0].load_tokens == 8192  # all: kept


def test_split_gate_probes_every_nth_plan_that_leaves_slow_tokens_out():
    g = _split_gate(probe=2, overlap=False)
    got = [g.decide([("disk", 8192)], 0, 0) for _ in range(4)]
    assert [o for _, o in got] == [DECLINED, PROBE, DECLINED, PROBE]
    assert [p.load_tokens for p, _ in got] == [0, 8192, 0, 8192]


def test_split_gate_counts_tokens_per_tier_and_estimated_seconds():
    g = _split_gate(overlap=False, disk=8.0, remote=1.0)
    plan, _ = g.decide([("cpu", 512), ("disk", 1024), ("remote", 1024)], 256, 0)
    assert plan.per_tier() == {"cpu": (512, 0), "disk": (1024, 0), "remote": (0, 1024)}
    rep = g.report()
    assert rep["decisions"][DECLINED] == 0 and rep["decisions"][SPLIT] == 1  # some slow tokens loaded, some not
    assert rep["declined_units"] == 4 and rep["read_gbps"] == 8.0
    split = rep["split"]
    assert split["tokens"] == {"cpu": {"loaded": 512, "recomputed": 0}, "disk": {"loaded": 1024, "recomputed": 0},
                               "remote": {"loaded": 0, "recomputed": 1024}}
    assert split["estimated_seconds"]["chosen"] == pytest.approx(plan.seconds)
    assert split["estimated_seconds"]["chosen"] < split["estimated_seconds"]["recompute"]
    assert split["prefill"]["source"] == "fixed" and split["prefill"]["tokens_per_s"][0] == pytest.approx(8192 / 0.22)
    assert rep["break_even_gbps"] == pytest.approx(KV * 8192 / 0.22 / 1e9)


def test_split_gate_reports_every_tier_it_reads_before_any_hit():
    """A tier with no hit yet says 0 loaded and 0 recomputed (stats and metrics keep their keys from the start)."""
    zero = {"loaded": 0, "recomputed": 0}
    assert _split_gate().report()["split"]["tokens"] == {"disk": zero, "remote": zero}


def test_split_gate_counts_a_plan_once_the_caller_says_it_was_taken():
    """``decide(count=False)`` plans without counting (an engine may ask about the same request again); ``count``
    adds the plan it took."""
    g = _split_gate(overlap=False, disk=8.0)
    for _ in range(3):
        plan, outcome = g.decide([("cpu", 256), ("disk", 512)], 16, 0, count=False)
    assert g.report()["decisions"][outcome] == 0
    assert all(t == {"loaded": 0, "recomputed": 0} for t in g.report()["split"]["tokens"].values())
    g.count(plan, outcome)
    rep = g.report()
    assert rep["decisions"][outcome] == 1 and rep["split"]["tokens"]["disk"] == {"loaded": 512, "recomputed": 0}


def test_split_gate_shares_a_mixed_read_between_its_slow_tiers_and_ignores_memory():
    g = _split_gate(disk=4.0, remote=1.0)
    # 1 GB from each slow tier (estimated 0.25 s + 1 s) and some CPU bytes, read in 2.5 s: both found 2x slower
    g.observe_reads({"disk": 10**9, "remote": 10**9, "cpu": 10**9}, 2.5)
    assert g.rates["disk"].gbps == pytest.approx(0.8 * 4.0 + 0.2 * 2.0)
    assert g.rates["remote"].gbps == pytest.approx(0.8 * 1.0 + 0.2 * 0.5)
    g.observe_reads({"cpu": 10**9}, 1.0)
    g.observe_reads({"disk": 10**9}, 0.0)
    assert g.rates["disk"].reads == 1


def test_an_overlapped_plan_bets_one_chunk_on_a_guessed_rate_until_a_read_replaces_it():
    """A rate nobody set (``ReadRate.guess``): the overlapped plan loads one chunk of that tier, however fast the
    guess says it reads; the first read replaces the guess, and the next plan uses the measured rate. Without the
    overlap, or with a user's rate, nothing is capped."""
    rates = {"disk": ReadRate(3.0, guess=True)}
    g = SplitGate("auto", 0, rates, PrefillEstimator(LLAMA, fixed=True), overlap=True, unit_tokens=16,
                  unit_nbytes=16 * KV)
    plan, outcome = g.decide([("cpu", 512), ("disk", 8192)], 0, 0, align=256)
    assert outcome == SPLIT and plan.load_tokens == 512 + 256  # the CPU part, then one chunk of disk
    assert _split_gate(disk=3.0).decide([("disk", 8192)], 0, 0, align=256)[0].load_tokens > 256  # a user's 3.0
    unlapped = SplitGate("auto", 0, {"disk": ReadRate(50.0, guess=True)}, PrefillEstimator(LLAMA, fixed=True),
                         overlap=False, unit_tokens=16, unit_nbytes=16 * KV)
    assert unlapped.decide([("disk", 8192)], 0, 0)[1] == BEATS  # no overlap: all or nothing, as before
    g.observe_reads({"disk": 256 * KV}, 256 * KV / 20e9)  # the chunk read at 20 GB/s
    assert rates["disk"].gbps == pytest.approx(20.0)  # replaced, not averaged with the guess
    g.observe_reads({"disk": 256 * KV}, 256 * KV / 10e9)
    assert rates["disk"].gbps == pytest.approx(0.8 * 20.0 + 0.2 * 10.0)  # then the average
    assert rates["disk"].largest == 256 * KV


def test_a_young_rate_ramps_up_four_times_its_largest_read_a_plan():
    """GPU round 17: a rate measured on one chunk's read let the next 32k hit load 1.3 GB under the forward at half
    that rate. After its first read a guessed tier's overlapped plan loads at most 4x the largest read (on the chunk
    grid, after the CPU part), so a fast tier reaches all of a hit in a few hits; a user's rate is not capped, nor a
    plan without overlap, nor a plan the cap does not reach."""
    rates = {"disk": ReadRate(3.0, guess=True)}
    g = SplitGate("auto", 0, rates, PrefillEstimator(LLAMA, fixed=True), overlap=True, unit_tokens=16,
                  unit_nbytes=16 * KV)
    loaded = []
    for _ in range(4):
        plan, outcome = g.decide([("cpu", 512), ("disk", 8192)], 0, 0, align=256)
        loaded.append((plan.load_tokens - 512, outcome))
        disk = plan.load_tokens - 512
        g.observe_reads({"disk": disk * KV}, disk * KV / 20e9)  # reads at 20 GB/s: loading all is best
    assert loaded == [(256, SPLIT), (1024, SPLIT), (4096, SPLIT), (8192, BEATS)]
    assert rates["disk"].largest == 8192 * KV
    # off the chunk grid (the hit starts 96 tokens into a chunk): the cap ends on a chunk end
    young = SplitGate("auto", 0, {"disk": ReadRate(3.0, guess=True)}, PrefillEstimator(LLAMA, fixed=True),
                      overlap=True, unit_tokens=16, unit_nbytes=16 * KV)
    young.observe_reads({"disk": 256 * KV}, 256 * KV / 20e9)
    plan, _ = young.decide([("disk", 8192)], 0, 0, align=256, offset=96)
    assert plan.load_tokens == 160 + 3 * 256 and (plan.load_tokens + 96) % 256 == 0
    assert _split_gate(disk=20.0).decide([("disk", 8192)], 0, 0, align=256)[1] == BEATS  # a user's rate
    # one tier in two runs (a CPU run between): the cap counts both, as the load reads them in one job
    two = SplitGate("auto", 0, {"disk": ReadRate(3.0, guess=True)}, PrefillEstimator(LLAMA, fixed=True),
                    overlap=True, unit_tokens=16, unit_nbytes=16 * KV)
    two.observe_reads({"disk": 1024 * KV}, 1024 * KV / 20e9)  # 4x: 4,096 tokens
    plan, _ = two.decide([("disk", 3840), ("cpu", 256), ("disk", 8192)], 0, 0, align=256)
    assert plan.load_tokens == 3840 + 256 + 256  # 256 of the 4,096 left for the second run, one chunk
    # a probe of a young tier whose first read was slow loads up to the cap, not the whole hit
    slow = SplitGate("auto", 2, {"disk": ReadRate(3.0, guess=True)}, PrefillEstimator(LLAMA, fixed=True),
                     overlap=True, unit_tokens=16, unit_nbytes=16 * KV)
    slow.observe_reads({"disk": 256 * KV}, 256 * KV / 0.01e9)
    plans = [slow.decide([("disk", 32768)], 0, 0, align=256) for _ in range(4)]
    assert [o for _, o in plans] == [DECLINED, PROBE, DECLINED, PROBE]
    assert all(p.load_tokens == 1024 for p, o in plans if o == PROBE)
    unlapped = SplitGate("auto", 0, {"disk": ReadRate(3.0, guess=True)}, PrefillEstimator(LLAMA, fixed=True),
                         overlap=False, unit_tokens=16, unit_nbytes=16 * KV)
    unlapped.rates["disk"].observe(256 * KV, 256 * KV / 20e9)
    assert unlapped.decide([("disk", 8192)], 0, 0)[1] == BEATS  # no overlap: all or nothing, as before


def test_writes_lower_a_guessed_read_rate_until_the_first_read():
    """Demotions to a tier whose read rate is the built-in guess bound the guess by their rate (a running average),
    never raise it; the first read still replaces it; a user's rate and a measured one ignore writes."""
    rates = {"disk": ReadRate(3.0, guess=True), "remote": ReadRate(3.0, guess=True), "cpu": ReadRate(50.0, fixed=True)}
    slow = PrefillModel(0.0, 1.0 / 8192, 0.0)  # 8k tokens recomputed in 1 s
    g = SplitGate("auto", 0, rates, PrefillEstimator(slow, fixed=True), overlap=False, unit_tokens=16,
                  unit_nbytes=16 * KV)
    assert g.decide([("disk", 8192)], 0, 0)[1] == BEATS  # 8k tokens of 128 KiB (1 GiB) at 3 GB/s: 0.36 s
    g.hint_writes({"disk": 1 << 30}, (1 << 30) / 0.5e9)  # the disk took writes at 0.5 GB/s
    assert rates["disk"].gbps == pytest.approx(0.5) and rates["disk"].hints == 1
    assert rates["remote"].gbps == 3.0 and rates["cpu"].gbps == 50.0  # other tiers untouched
    assert g.decide([("disk", 8192)], 0, 0)[1] == DECLINED  # 2.1 s of reads now: recompute wins
    g.hint_writes({"disk": 1 << 30}, (1 << 30) / 10.5e9)  # faster writes: the average, capped at the guess
    assert rates["disk"].gbps == pytest.approx(min(3.0, 0.8 * 0.5 + 0.2 * 10.5))
    g.hint_writes({"disk": 1 << 30}, (1 << 30) / 100e9)
    assert rates["disk"].gbps == 3.0  # never above the guess
    g.observe_reads({"disk": 1 << 30}, (1 << 30) / 1.5e9)
    assert rates["disk"].gbps == pytest.approx(1.5)  # the first read replaces it
    g.hint_writes({"disk": 1 << 30}, (1 << 30) / 0.1e9)
    assert rates["disk"].gbps == pytest.approx(1.5) and rates["disk"].hints == 3  # measured: writes ignored
    user = ReadRate(3.0)  # a user's figure (or a tier that is not a guess)
    user.hint(1 << 30, 10.0)
    assert user.gbps == 3.0 and user.hints == 0
    g.hint_writes({"disk": 0, "cpu": 1 << 30}, 1.0)  # nothing slow written: nothing to do
    g.hint_writes({"remote": (4 << 20) - 1}, 1.0)  # under HINT_MIN_BYTES: latency, not rate
    g.hint_writes({"remote": 1 << 30}, 0.0)
    assert rates["remote"].hints == 0


def test_split_gate_needs_a_rate_for_every_slow_tier():
    with pytest.raises(InvalidInputError, match="no read rate for tier 'nvmeof'"):
        _split_gate().decide([("nvmeof", 256)], 0, 0)
    with pytest.raises(ConfigError, match="disk_load_policy"):
        _split_gate("sometimes")


def test_a_hybrid_hit_is_priced_at_its_own_bytes():
    """A sliding-window layer reads its window once per hit, not once per chunk: priced per unit (a 256-token chunk
    carrying both layers' blocks), an 8k hit looks like 1 GiB and is declined at 3 GB/s against 0.22 s of
    recompute; priced at its own bytes (512 MiB of the full-attention layer + the 8 MiB window) it loads."""
    per_layer_token = 64 << 10

    def hit_nbytes(tokens: int) -> int:
        return tokens * per_layer_token + min(tokens, 128) * per_layer_token

    def gate(exact):
        return SplitGate("auto", 0, {"disk": ReadRate(3.0)}, PrefillEstimator(LLAMA, fixed=True), overlap=False,
                         unit_tokens=256, unit_nbytes=2 * 256 * per_layer_token, hit_nbytes=exact)

    assert gate(None).decide([("disk", 8192)], 64, 0)[1] == DECLINED
    plan, outcome = gate(hit_nbytes).decide([("disk", 8192)], 64, 0)
    assert outcome == BEATS and plan.load_tokens == 8192
    assert gate(hit_nbytes).segments([("cpu", 4096), ("disk", 4096)])[1].nbytes_per_token == hit_nbytes(8192) / 8192


def test_split_gate_learns_what_overlapped_reads_cost_and_plans_with_it():
    """A step's excess over its price is shared by its slow tiers' bytes; the segments carry each tier's cost, so
    the 8k disk hit that split at no cost is declined once overlapped reads were measured slow; the report says so;
    memory tiers and empty reads are ignored."""
    g = _split_gate()
    assert g.decide([("disk", 8192)], 0, 0)[1] == SPLIT
    g.observe_loaded_step({"disk": 3e8, "remote": 1e8, "cpu": 5e8}, 0.5, 0.1)  # 0.3 s the disk's, 0.1 the remote's
    assert g.overlap_cost["disk"].s_per_byte == pytest.approx(1e-9) and g.overlap_cost["remote"].samples == 1
    assert "cpu" not in g.overlap_cost and g.load_floor.samples == 0
    g.observe_loaded_step({"disk": 0}, 5.0, 0.0)
    assert g.overlap_cost["disk"].samples == 1
    assert g.segments([("cpu", 256), ("disk", 512)])[1].overlap_cost == pytest.approx(1e-9)
    assert g.segments([("cpu", 256)])[0].overlap_cost == 0.0
    plan, outcome = g.decide([("disk", 8192)], 0, 0)
    assert outcome == DECLINED and plan.load_tokens == 0
    assert g.report()["split"]["overlap_cost"]["disk"] == {"s_per_gb": pytest.approx(1.0), "samples": 1}


def test_a_small_reads_model_error_does_not_hide_a_large_reads_slowdown():
    """GPU round 17 at 32k: a step that read one chunk ran 0.13 s under a prefill model 10% high; the next read
    1.32 GB under the forward and ran 1.14 s over its price. The gate's overlap cost comes out near 0.4 s/GB, not 0,
    and the next 32k hit no longer splits at the rate its reads showed."""
    g = _split_gate(disk=0.9)
    plan, outcome = g.decide([("disk", 32768)], 64, 0)
    assert outcome == SPLIT and plan.load_tokens > 0
    g.observe_loaded_step({"disk": 256 * KV}, 1.19, 1.32)
    g.observe_loaded_step({"disk": 10080 * KV}, 2.29, 1.15)
    assert g.overlap_cost["disk"].s_per_byte * 1e9 == pytest.approx(0.42, abs=0.05)
    plan, outcome = g.decide([("disk", 32768)], 64, 0)
    assert outcome == DECLINED and plan.load_tokens == 0


@pytest.mark.parametrize("truth", [0.1e-9, 0.5e-9])
def test_the_learned_overlap_cost_converges_on_the_truth_through_the_plans_that_price_it(truth):
    """The gate plans with the cost it learned, the engine's steps run ``truth`` per byte over the split's pricing
    without it, and the step's excess over the plan's price (``seconds_exposed`` leaves the measured cost out) feeds
    the cost back: it converges on the truth, not on a fraction of it."""
    g = _split_gate(disk=1.53)
    model = g.prefill.model()
    for _ in range(40):
        plan, _ = g.decide([("disk", 8192)], 64, 0)
        plan = plan if plan.load_tokens else g.decide([("disk", 8192)], 64, 0, overlap=True)[0]
        nbytes = plan.loaded_bytes().get("disk", 0.0) or 256 * KV  # a probe-sized read when the plan declines
        compute = model.seconds(plan.recompute_tokens, plan.load_tokens)
        priced = compute + plan.seconds_exposed
        g.observe_loaded_step({"disk": nbytes}, priced + truth * nbytes, priced)
    assert g.overlap_cost["disk"].s_per_byte == pytest.approx(truth, rel=0.02)


def _fitted_gate():
    g = _split_gate()
    g.prefill = PrefillEstimator(LLAMA, fit_on_read=True, min_samples=1)
    g.prefill.observe(1024, 0, LLAMA.seconds(1024, 0))
    g.prefill.model()  # fits (on read)
    assert g.prefill.fitted
    return g


def test_cpu_hits_recompute_where_loading_steps_have_a_floor_above_their_recompute():
    """A loading step held at 35 ms while priced at 6 ms (an uncompiled engine's launch): after
    ``FLOOR_MIN_SAMPLES`` of them, a 1,024-token CPU hit whose recompute costs 31.8 ms is recomputed whole (the CPU
    part too), every ``RECOMPUTE_PROBE_EVERY``-th one planned as usual; an 8k hit (recompute 0.22 s, above the floor)
    still loads; a hit that will not load in-step, policy ``always`` and a gate without a fitted model never
    decline; large steps bound by their compute leave the floor alone, and one loading step that ran as priced
    brings it down to its time (a faster host; a compiled engine never has a floor)."""
    g = _fitted_gate()
    hit = [("cpu", 1024)]
    for _ in range(FLOOR_MIN_SAMPLES - 1):
        g.observe_loaded_step({"cpu": 128 << 20}, 0.035, 0.006)
        assert g.decide(hit, 160, 0)[1] == ALL_FAST  # too few samples yet
    g.observe_loaded_step({"cpu": 128 << 20, "disk": 1e8}, 0.5, 0.006)  # slow-tier bytes in the step: theirs
    assert g.load_floor.samples == FLOOR_MIN_SAMPLES - 1
    g.observe_loaded_step({"cpu": 128 << 20}, 0.035, 0.006)
    assert g.load_floor.seconds == pytest.approx(0.035)
    outcomes = [g.decide(hit, 160, 0) for _ in range(2 * RECOMPUTE_PROBE_EVERY)]
    assert [o for _, o in outcomes].count(ALL_FAST) == 2 and [o for _, o in outcomes].count(RECOMPUTE) == 14
    plan = next(p for p, o in outcomes if o == RECOMPUTE)
    assert plan.load_tokens == 0 and plan.per_tier() == {"cpu": (0, 1024)}
    assert g.decide([("cpu", 8192)], 160, 0)[1] == ALL_FAST
    assert g.decide(hit, 160, 0, in_step=False)[1] == ALL_FAST
    g.policy = "always"
    assert g.decide(hit, 160, 0)[1] == ALL_FAST
    g.policy = "auto"
    unfitted = _split_gate()
    for _ in range(FLOOR_MIN_SAMPLES):
        unfitted.observe_loaded_step({"cpu": 128 << 20}, 0.035, 0.006)
    assert unfitted.decide(hit, 160, 0)[1] == ALL_FAST
    for _ in range(10):
        g.observe_loaded_step({"cpu": 1 << 30}, 0.200, 0.190)  # large steps bound by their compute: no news
    assert g.load_floor.seconds == pytest.approx(0.035) and g.decide(hit, 160, 0)[1] == RECOMPUTE
    g.observe_loaded_step({"cpu": 128 << 20}, 0.0065, 0.006)  # a loading step as priced: the floor is at most that
    assert g.load_floor.seconds == pytest.approx(0.0065) and g.decide(hit, 160, 0)[1] == ALL_FAST
    assert g.report()["split"]["load_floor"]["samples"] == FLOOR_MIN_SAMPLES


@pytest.mark.parametrize("floor_ms, outcome", [(31.0, RECOMPUTE), (30.4, RECOMPUTE), (30.0, ALL_FAST)])
def test_a_near_tie_with_the_load_floor_recomputes(floor_ms, outcome):
    """H200, uncompiled Gemma-2 c1, 2026-11-30: the floor (59.2 ms) was just under the hit's priced recompute, so it
    loaded, and the loading step's host work (``start_load_kv``, 4 ms) made it 1.06x of no connector. A hit whose
    recompute (31.8 ms here) is within ``RECOMPUTE_MARGIN`` of its loading step's floor recomputes; one whose floor
    is further below still loads."""
    g = _fitted_gate()
    recompute_s = g.prefill.model().seconds(1024 + 160, 0)
    assert recompute_s == pytest.approx(0.0318, abs=1e-4)
    for _ in range(FLOOR_MIN_SAMPLES):
        g.observe_loaded_step({"cpu": 128 << 20}, floor_ms / 1e3, 0.006)
    assert (recompute_s < (1 + RECOMPUTE_MARGIN) * floor_ms / 1e3) == (outcome == RECOMPUTE)
    assert g.decide([("cpu", 1024)], 160, 0)[1] == outcome


def test_a_cold_first_loading_step_does_not_make_the_hits_recompute():
    """H200, uncompiled Llama-3-8B c1, round 21: loading steps of 54 ms (the engine's first), 36 and 19 ms made an
    averaged floor of 42 ms, over the ~31 ms a hit's recompute costs, and the hits after them recomputed (c1 1.16x
    of no connector). The floor is the least of the latest loading steps: the hits load; when every loading step
    runs slow (34 ms, a host's slow phase) they recompute again."""
    g = _fitted_gate()
    hit = [("cpu", 1024)]
    for ms in (54.2, 36.3, 18.6):
        g.observe_loaded_step({"cpu": 128 << 20}, ms / 1e3, 0.006)
    assert g.load_floor.samples == FLOOR_MIN_SAMPLES and g.decide(hit, 160, 0)[1] == ALL_FAST
    for _ in range(FLOOR_WINDOW):
        g.observe_loaded_step({"cpu": 128 << 20}, 0.034, 0.006)
    assert g.decide(hit, 160, 0)[1] == RECOMPUTE


def test_the_floors_decision_prices_recompute_at_the_engines_speed_now():
    """H200, uncompiled Gemma-2 c1, round 18: the host's launches slowed after the warm phase the model was fitted
    on; the floor, measured on the hits' loading steps, rose with them (75 ms) while recompute was priced at the old
    speed, so 7 of 16 hits recomputed, at 88 ms each. The gate prices recompute at the median measured / priced time
    of the last ``RECENT_STEPS`` unloaded prefill steps: one slow step does not move it, three do; a faster host
    keeps recomputing; the scale stays within ``SCALE_BOUNDS`` and is reported."""
    g = _fitted_gate()
    hit = [("cpu", 1024)]
    for _ in range(FLOOR_MIN_SAMPLES):
        g.observe_loaded_step({"cpu": 128 << 20}, 0.035, 0.006)
    assert g.recompute_scale == 1.0 and g.decide(hit, 160, 0)[1] == RECOMPUTE  # 31.8 ms priced under a 35 ms floor
    for _ in range(RECENT_STEPS - 1):
        g.observe_unloaded_step(0.050, 0.050)  # the warm phase: steps as priced
    g.observe_unloaded_step(0.065, 0.050)  # one slow step: the median stays
    assert g.recompute_scale == 1.0 and g.decide(hit, 160, 0)[1] == RECOMPUTE
    for _ in range(2):
        g.observe_unloaded_step(0.065, 0.050)
    assert g.recompute_scale == pytest.approx(1.3)
    assert g.decide(hit, 160, 0)[1] == ALL_FAST  # 41.3 ms of recompute at this speed: loading the hit is faster
    for _ in range(RECENT_STEPS):
        g.observe_unloaded_step(0.040, 0.050)  # a faster host: recompute is cheaper still
    assert g.recompute_scale == pytest.approx(0.8) and g.decide(hit, 160, 0)[1] == RECOMPUTE
    for _ in range(RECENT_STEPS):
        g.observe_unloaded_step(0.5, 0.05)
    assert g.recompute_scale == SCALE_BOUNDS[1] and g.report()["split"]["load_floor"]["recompute_scale"] == 2.0
    g.observe_unloaded_step(0.0, 0.05)  # nothing timed: ignored
    assert g.recompute_scale == SCALE_BOUNDS[1]
