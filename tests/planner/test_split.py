"""The split decision (``tiered_kv.planner.split``) on synthetic rates: all load, none, split, several tiers, the
no-overlap mode, granularity; and against a brute-force search over every grid point.

The numbers of issue 32: Llama-3-8B (128 KiB of KV a token), an 8k-token prefix (1 GiB) on a disk read at
2.15 GB/s (0.5 s), recomputed at 37k tokens/s (0.22 s).
"""
from __future__ import annotations

import random

import pytest

from tiered_kv.errors import InvalidInputError
from tiered_kv.planner.rates import PrefillModel
from tiered_kv.planner.split import Segment, forced_tokens, plan_split, split_at

KV = 128 << 10  # bytes of KV per token, Llama-3-8B bf16
CHUNK = 256     # tokens per chunk (16 blocks of 16)
LLAMA = PrefillModel(0.0, 0.22 / 8192, 0.0)  # 8192 tokens in 0.22 s (attention folded in, as the issue's figure)


def _plan(segs, new=1, context=0, model=LLAMA, overlap=True, unit=CHUNK, layers=0, extra_recompute=False):
    return plan_split(segs, new, context, model, overlap=overlap, unit_tokens=unit, layers=layers,
                      extra_recompute=extra_recompute)


def test_issue_example_the_split_beats_both_ends():
    """8k tokens on disk: all-load 0.5 s, recompute 0.22 s; with overlap, load ~2.5k tokens: ~0.15 s."""
    disk = [Segment("disk", 8192, KV, 2.15)]
    p = _plan(disk, new=0)
    assert p.seconds_load_all == pytest.approx(0.4994, abs=1e-3)
    assert p.seconds_recompute == pytest.approx(0.22)
    assert 2304 <= p.load_tokens <= 2816 and p.load_tokens % CHUNK == 0
    assert p.seconds == pytest.approx(0.153, abs=0.005)
    assert p.seconds <= 0.8 * min(p.seconds_recompute, p.seconds_load_all)
    assert p.per_tier() == {"disk": (p.load_tokens, 8192 - p.load_tokens)}
    assert p.recompute_tokens == 8192 - p.load_tokens


def test_fast_tier_loads_everything_in_both_modes():
    """A disk in the page cache (20 GB/s): loading every token beats recomputing them, overlapped or not."""
    disk = [Segment("disk", 8192, KV, 20.0)]
    for overlap in (True, False):
        p = _plan(disk, overlap=overlap)
        assert p.load_tokens == 8192 and p.seconds == p.seconds_load_all


def test_extra_recompute_trades_gpu_work_for_a_little_ttft():
    """With overlap, recomputing the tail of a fast tier while the rest loads is faster still (44 ms against
    54 ms), but costs 41 ms of GPU work: only with ``extra_recompute``."""
    disk = [Segment("disk", 8192, KV, 20.0)]
    p = _plan(disk, extra_recompute=True)
    assert 6144 <= p.load_tokens < 8192
    assert p.seconds == pytest.approx(0.0436, abs=1e-3) and p.seconds_load_all == pytest.approx(0.0537, abs=1e-3)
    slow = [Segment("disk", 8192, KV, 2.15)]  # slow: the split already saves GPU work; both agree
    assert _plan(slow, extra_recompute=True).load_tokens == _plan(slow).load_tokens


def test_without_overlap_a_slow_tier_is_all_or_nothing():
    """No overlap: T = load(m) + compute(m) is concave per tier, so the best is at an end; here recompute."""
    disk = [Segment("disk", 8192, KV, 2.15)]
    p = _plan(disk, overlap=False)
    assert p.load_tokens == 0 and p.seconds == p.seconds_recompute
    ends = [_plan(disk, overlap=False).seconds] + [split_at(disk, m, 1, 0, LLAMA, overlap=False).seconds
                                                     for m in range(CHUNK, 8192 + 1, CHUNK)]
    assert min(ends) == ends[0]


def test_none_with_overlap_when_the_tier_is_far_slower_than_the_pipeline_fill_allows():
    """With the fill (the first layer's load before any compute), a tier > layers x slower than compute per token
    is not worth even a chunk."""
    disk = [Segment("disk", 8192, KV, 0.1)]  # 1.3 ms a token against 27 us of compute: > 32x slower
    p = _plan(disk, unit=16, layers=32)
    assert p.load_tokens == 0
    assert _plan(disk, unit=16).load_tokens > 0  # without the fill term a crumb always overlaps for free


def test_memory_tier_tokens_are_always_loaded_even_if_slow():
    segs = [Segment("cpu", 1024, KV, 0.001), Segment("disk", 2048, KV, 0.001)]
    for overlap in (True, False):
        p = _plan(segs, overlap=overlap)
        assert p.load_tokens == 1024 == forced_tokens(segs)
        assert p.per_tier() == {"cpu": (1024, 0), "disk": (0, 2048)}


def test_multi_tier_no_overlap_cpu_then_disk_then_recompute_the_remote_part():
    """CPU part, then a disk part faster than recompute, then a remote part slower: load CPU + disk only."""
    segs = [Segment("cpu", 1024, KV, 20.0), Segment("disk", 4096, KV, 8.0), Segment("remote", 4096, KV, 1.0)]
    p = _plan(segs, new=512, overlap=False)
    assert p.load_tokens == 5120
    assert p.per_tier() == {"cpu": (1024, 0), "disk": (4096, 0), "remote": (0, 4096)}
    assert p.seconds < min(p.seconds_recompute, p.seconds_load_all)


def test_multi_tier_overlap_splits_inside_the_slow_tier():
    segs = [Segment("cpu", 1024, KV, 20.0), Segment("disk", 4096, KV, 8.0), Segment("remote", 8192, KV, 1.0)]
    p = _plan(segs, new=512, layers=32)
    cpu, disk, remote = (p.per_tier()[t] for t in ("cpu", "disk", "remote"))
    assert cpu == (1024, 0) and disk == (4096, 0) and 0 < remote[0] < 8192
    assert p.seconds < 0.8 * min(p.seconds_recompute, p.seconds_load_all)


def test_a_later_memory_segment_is_not_forced_but_cheap():
    """CPU chunks after a disk run are no longer 'free': reaching them means loading the disk run first."""
    segs = [Segment("disk", 1024, KV, 0.1), Segment("cpu", 1024, KV, 20.0)]
    assert forced_tokens(segs) == 0
    assert _plan(segs, overlap=False).load_tokens == 0


def test_deep_context_makes_recompute_dearer():
    """With attention in the model, the same disk tokens are worth loading deep in a prompt but not at its start."""
    model = PrefillModel.from_rate(30000, 8192)
    disk = [Segment("disk", 2048, KV, 2.5)]
    assert _plan(disk, context=0, model=model, overlap=False).load_tokens == 0
    assert _plan(disk, context=16384, model=model, overlap=False).load_tokens == 2048


def test_granularity_and_bad_input():
    p = _plan([Segment("disk", 8192, KV, 2.15)], unit=512)
    assert p.load_tokens % 512 == 0
    with pytest.raises(InvalidInputError, match="not a multiple of the unit"):
        _plan([Segment("disk", 100, KV, 2.0)])
    with pytest.raises(InvalidInputError, match="GB/s"):
        _plan([Segment("disk", 256, KV, 0.0)])
    with pytest.raises(InvalidInputError, match="unit_tokens"):
        _plan([Segment("disk", 256, KV, 1.0)], unit=0)
    with pytest.raises(InvalidInputError, match="load_tokens"):
        split_at([Segment("disk", 256, KV, 1.0)], 512, 0, 0, LLAMA, overlap=True)


def test_empty_hit_loads_nothing():
    p = _plan([], new=100)
    assert p.load_tokens == 0 and p.held_tokens == 0 and p.recompute_tokens == 100


@pytest.mark.parametrize("seed", range(8))
def test_plan_is_the_brute_force_optimum_on_the_grid(seed):
    """Random tiers, rates, context, model and mode: ``plan_split`` finds the least T over every grid point."""
    rng = random.Random(seed)
    unit = rng.choice([16, 64, 256])
    tiers = ["cpu"] * rng.randrange(0, 2) + ["disk"] + ["remote"] * rng.randrange(0, 2)
    segs = [Segment(t, unit * rng.randrange(1, 40), KV, rng.uniform(0.3, 30.0)) for t in tiers]
    model = PrefillModel(rng.uniform(0, 0.01), rng.uniform(1e-5, 5e-5), rng.uniform(0, 3e-9), rng.uniform(0, 1e-8))
    new, context = rng.randrange(0, 2000), rng.randrange(0, 30000)
    for overlap in (False, True):
        layers = rng.choice([0, 32]) if overlap else 0
        best = _plan(segs, new, context, model, overlap, unit, layers, extra_recompute=True)
        lo, held = forced_tokens(segs), sum(s.tokens for s in segs)
        brute = min(split_at(segs, m, new, context, model, overlap=overlap, layers=layers).seconds
                    for m in range(lo, held + 1, unit))
        assert best.seconds == pytest.approx(brute, rel=1e-12, abs=1e-15)
        # by default: the best plan that recomputes no more than the best all-or-nothing plan
        ends = {lo} | {sum(s.tokens for s in segs[:i + 1]) for i in range(len(segs))}
        end = min(ends, key=lambda m: (split_at(segs, m, new, context, model, overlap=overlap,
                                                layers=layers).seconds, -m))
        thrifty = min(split_at(segs, m, new, context, model, overlap=overlap, layers=layers).seconds
                      for m in range(end, held + 1, unit))
        assert _plan(segs, new, context, model, overlap, unit, layers).seconds == pytest.approx(thrifty, rel=1e-12,
                                                                                                abs=1e-15)
        if not overlap:  # all or nothing per tier: the answer is a segment end
            assert best.load_tokens in ends


def test_a_step_budget_limits_the_compute_that_hides_the_load():
    """vLLM computes at most ``max_num_batched_tokens`` a step: the issue's example with 2,048 tokens a step overlaps
    the load with only the first step's compute, so the 0.153 s split is gone and the plan never beats recompute by
    pretending; with 8,192 a step it is the unlimited plan."""
    disk = [Segment("disk", 8192, KV, 2.15)]
    free = _plan(disk, new=0)
    assert plan_split(disk, 0, 0, LLAMA, overlap=True, unit_tokens=CHUNK, step_tokens=8192).seconds == \
        pytest.approx(free.seconds)
    capped = plan_split(disk, 0, 0, LLAMA, overlap=True, unit_tokens=CHUNK, step_tokens=2048)
    assert capped.seconds <= capped.seconds_recompute + 1e-12 and capped.seconds > free.seconds + 0.01
    m = capped.load_tokens
    want = max(2048 * 0.22 / 8192, m * KV / 2.15e9) + (8192 - m - 2048) * 0.22 / 8192 if 8192 - m > 2048 else None
    if want is not None:
        assert capped.seconds == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_plan_with_a_step_budget_is_the_brute_force_optimum(seed):
    rng = random.Random(100 + seed)
    unit = rng.choice([16, 64, 256])
    segs = [Segment("cpu", unit * rng.randrange(0, 8), KV, 50.0), Segment("disk", unit * rng.randrange(1, 60), KV,
                                                                          rng.uniform(0.3, 10.0))]
    segs = [s for s in segs if s.tokens]
    model = PrefillModel(rng.uniform(0, 0.01), rng.uniform(1e-5, 5e-5), rng.uniform(0, 3e-9), 0.0)
    new, context, step = rng.randrange(0, 2000), rng.randrange(0, 20000), rng.choice([512, 2048, 8192])
    best = plan_split(segs, new, context, model, overlap=True, unit_tokens=unit, layers=8, extra_recompute=True,
                      step_tokens=step)
    lo, held = forced_tokens(segs), sum(s.tokens for s in segs)
    brute = min(split_at(segs, m, new, context, model, overlap=True, layers=8, step_tokens=step).seconds
                for m in range(lo, held + 1, unit))
    assert best.seconds == pytest.approx(brute, rel=1e-12, abs=1e-15)


def test_a_measured_overlap_cost_shrinks_the_split_and_at_a_high_cost_declines_it():
    """The issue's 8k example with a cost per byte read under the forward: at 0 the plan is the old split; a small
    cost keeps it and adds to its time; the cost the H200 measured with Redis on loopback (~0.8 ns a byte: 0.1 s
    more for 126 MB) loads nothing. Without overlap the cost is not charged. The plan's exposed seconds are its time
    beyond compute."""
    def disk(cost: float) -> list[Segment]:
        return [Segment("disk", 8192, KV, 2.15, cost)]

    base = _plan([Segment("disk", 8192, KV, 2.15)], new=0)
    assert _plan(disk(0.0), new=0) == base
    small = _plan(disk(0.05e-9), new=0)  # the split sits at the crossing of load and compute: a kink a small cost
    assert small.load_tokens == base.load_tokens  # does not move; the plan's time takes the cost
    assert small.seconds == pytest.approx(base.seconds + base.load_tokens * KV * 0.05e-9)
    high = _plan(disk(0.8e-9), new=0)
    assert high.load_tokens == 0 and high.seconds == pytest.approx(high.seconds_recompute)
    no_overlap = (_plan(disk(c), new=0, overlap=False) for c in (0.8e-9, 0.0))
    assert len({(p.load_tokens, p.seconds, p.seconds_recompute, p.seconds_load_all) for p in no_overlap}) == 1
    compute = LLAMA.seconds(8192 - base.load_tokens, base.load_tokens)
    assert base.seconds_exposed == pytest.approx(base.seconds - compute) and base.seconds_exposed > 0
    assert base.loaded_bytes() == {"disk": base.load_tokens * KV} and high.loaded_bytes() == {}
    with pytest.raises(InvalidInputError, match="overlap cost"):
        _plan(disk(-1.0), new=0)
