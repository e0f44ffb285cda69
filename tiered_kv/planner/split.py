"""The split: of a hit held below the GPU, how many leading tokens to load and how many to recompute.

A request finds ``L`` tokens of its prefix held, as ordered ``Segment``s (the tokens of one tier in a
row: CPU first, then disk, then remote, as the tiers hold them), after ``context`` tokens the engine
already has, and has ``new_tokens`` more to compute after them. Loading the first ``m`` held tokens
and recomputing the other ``L - m`` (plus the new ones) takes:

- with ``overlap`` (a load inside the step, layer by layer through pinned staging, while the forward
  of the recomputed tokens runs: layer i's load overlaps layer i-1's compute)::

      T(m) = max(load(m), compute(m)) + min(load(m), compute(m)) / layers

  (with ``step_tokens``, an engine that computes at most that many tokens a step, only the first step's
  compute overlaps the load: ``compute(m)`` above is that step's, and the later steps' compute is added after;
  each byte loaded from a segment adds its ``overlap_cost``, what such reads were measured to slow a step
  beyond this pricing: ``rates.OverlapCost``, 0 until measured) the second term being the pipeline's fill (the
  first layer's load before any compute, or the last layer's compute after the last load; ``layers=0`` leaves it
  out). ``load`` rises with ``m`` and
  ``compute`` falls, so the best ``m`` is where the load ends about when the compute that needs it
  would have: the split;
- without overlap (the load finishes before the forward starts: SGLang's prefetch into its host
  pool, or vLLM's promotions to the CPU tier before the load)::

      T(m) = load(m) + compute(m)

  Within one segment ``load`` is linear in ``m`` and ``compute`` concave (each token recomputed
  later in the prompt attends to more tokens, so it costs more), so ``T`` is concave there and its
  minimum is at a segment's end: per tier, all or nothing. A split inside a tier never pays
  without overlap.

``load(m)`` adds each segment's tokens x bytes per token / its read rate, one segment after the
other (one load stream; conservative where tiers could read in parallel). ``compute(m)`` is the
``PrefillModel``'s time for ``L - m + new_tokens`` tokens after ``context + m`` (``planner.rates``).
The leading memory-tier segments (GPU, CPU: ``MEMORY_TIERS``) are always loaded. ``m`` is a
multiple of ``unit_tokens`` (a chunk, a page), so every segment must be one too.

GPU work: with overlap, even a tier that loads faster than the GPU computes gives a split, since
the overlapped compute of the tail looks free (8k tokens from the page cache at 20 GB/s: 54 ms to
load all, 44 ms loading 6.6k and recomputing 1.5k, which costs 41 ms of GPU time that other
requests could have had). By default (``extra_recompute=False``) the plan never recomputes more
than the best all-or-nothing plan (the best segment end) does: ``m`` is searched from there up, so
the split only takes a gain that also saves GPU work (a slow disk: recompute-all is the best end,
and the split loads part of it and recomputes less). ``extra_recompute=True``: the least ``T`` at
any GPU cost (an engine with nothing else to run).

``plan_split`` evaluates ``T`` at the exact candidates (segment ends, and the grid points either
side of each segment's crossing of ``load`` and ``compute``, found by bisection): the optimum on the
grid, since ``T`` is concave between them (an overlap cost is linear within a segment: it leaves them so).
Ties go to loading more (it saves GPU work for others).

Threading contract: pure functions and frozen values; safe from any thread.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tiered_kv.errors import InvalidInputError
from tiered_kv.planner.rates import PrefillModel

#: Tiers whose hits are always loaded (faster than any prefill recomputes them).
MEMORY_TIERS = frozenset({"gpu", "cpu"})


@dataclass(frozen=True)
class Segment:
    """``tokens`` held tokens in a row, in ``tier``, read at ``gbps`` (GB/s), ``nbytes_per_token`` each; read under
    the forward, each byte adds ``overlap_cost`` seconds to the step (module doc)."""

    tier: str
    tokens: int
    nbytes_per_token: float
    gbps: float
    overlap_cost: float = 0.0

    def seconds(self, tokens: int) -> float:
        """Seconds to read the first ``tokens`` of this segment."""
        return tokens * self.nbytes_per_token / (self.gbps * 1e9)


@dataclass(frozen=True)
class Split:
    """A plan: load the first ``load_tokens`` held tokens, recompute the rest; with its time and the alternatives'."""

    segments: tuple[Segment, ...]
    load_tokens: int
    new_tokens: int
    seconds: float            # estimated time of this plan
    seconds_recompute: float  # ... of loading only the memory-tier tokens
    seconds_load_all: float   # ... of loading every held token
    seconds_exposed: float = 0.0  # the part of ``seconds`` beyond its compute and its segments' overlap costs

    @property
    def held_tokens(self) -> int:
        """Tokens held below the GPU."""
        return sum(s.tokens for s in self.segments)

    @property
    def recompute_tokens(self) -> int:
        """Tokens the engine computes: held ones not loaded plus the new ones."""
        return self.held_tokens - self.load_tokens + self.new_tokens

    def _taken(self):
        """``(segment, its tokens this plan loads)`` for every segment, in order."""
        left = self.load_tokens
        for s in self.segments:
            got = min(left, s.tokens)
            left -= got
            yield s, got

    def loaded_bytes(self) -> dict[str, float]:
        """Tier -> bytes this plan loads from it (tiers it loads nothing from are left out)."""
        out: dict[str, float] = {}
        for s, got in self._taken():
            if got:
                out[s.tier] = out.get(s.tier, 0.0) + got * s.nbytes_per_token
        return out

    def per_tier(self) -> dict[str, tuple[int, int]]:
        """Tier -> (held tokens loaded, held tokens recomputed)."""
        out: dict[str, tuple[int, int]] = {}
        for s, got in self._taken():
            loaded, recomputed = out.get(s.tier, (0, 0))
            out[s.tier] = (loaded + got, recomputed + s.tokens - got)
        return out


def forced_tokens(segments: Sequence[Segment]) -> int:
    """Tokens of the leading memory-tier segments: always loaded."""
    n = 0
    for s in segments:
        if s.tier not in MEMORY_TIERS:
            break
        n += s.tokens
    return n


def plan_split(segments: Sequence[Segment], new_tokens: int, context: int, model: PrefillModel, *,
               overlap: bool, unit_tokens: int, layers: int = 0, extra_recompute: bool = False,
               step_tokens: int = 0) -> Split:
    """The fastest plan (module doc): how many leading held tokens to load, the rest recomputed. ``step_tokens``
    (the engine's token budget per step; 0: none): with overlap only the first step's compute hides the load."""
    segs = _checked(segments, new_tokens, context, unit_tokens, layers)
    timing = _Timing(segs, new_tokens, context, model, overlap, layers, step_tokens)
    lo = forced_tokens(segs)

    def cost(m: int) -> tuple[float, int]:
        return timing.total(m), -m

    if not extra_recompute:  # from the best all-or-nothing plan up: never more GPU work than it
        lo = min(_ends(timing, lo), key=cost)
    best = min(_candidates(timing, lo, unit_tokens), key=cost)
    return split_at(segs, best, new_tokens, context, model, overlap=overlap, layers=layers, step_tokens=step_tokens)


def split_at(segments: Sequence[Segment], load_tokens: int, new_tokens: int, context: int, model: PrefillModel, *,
             overlap: bool, layers: int = 0, step_tokens: int = 0) -> Split:
    """The plan that loads the first ``load_tokens`` held tokens (a policy's choice, a probe), with its times."""
    segs = tuple(segments)
    timing = _Timing(segs, new_tokens, context, model, overlap, layers, step_tokens)
    held = timing.held
    if not 0 <= load_tokens <= held:
        raise InvalidInputError(f"split: load_tokens {load_tokens} outside 0..{held} held tokens")
    lo = forced_tokens(segs)
    chosen = timing.total(load_tokens)
    # the same plan priced once (an all-memory hit, a plan that loads all or only the memory tiers: the usual)
    measured = timing.cost(load_tokens) if overlap else 0.0  # the overlap costs ``chosen`` holds: not exposure
    return Split(segs, load_tokens, new_tokens, chosen, chosen if lo == load_tokens else timing.total(lo),
                 chosen if held == load_tokens else timing.total(held),
                 max(0.0, chosen - timing.compute(load_tokens) - measured))


def _checked(segments: Sequence[Segment], new_tokens: int, context: int, unit_tokens: int,
             layers: int) -> tuple[Segment, ...]:
    if unit_tokens <= 0 or new_tokens < 0 or context < 0 or layers < 0:
        raise InvalidInputError(f"split: unit_tokens {unit_tokens} must be > 0; new_tokens {new_tokens}, context "
                                f"{context} and layers {layers} >= 0")
    for s in segments:
        if s.tokens < 0 or s.tokens % unit_tokens:
            raise InvalidInputError(f"split: segment {s.tier!r} holds {s.tokens} tokens, not a multiple of the unit "
                                    f"({unit_tokens} tokens): pass whole chunks/pages")
        if not s.gbps > 0 or s.nbytes_per_token < 0 or not s.overlap_cost >= 0:
            raise InvalidInputError(f"split: segment {s.tier!r} reads at {s.gbps} GB/s, {s.nbytes_per_token} B/token, "
                                    f"overlap cost {s.overlap_cost} s/B; need a rate > 0, bytes and cost >= 0")
    return tuple(segments)


class _Timing:
    """``load(m)``, ``compute(m)`` and ``T(m)`` of one hit."""

    def __init__(self, segs: tuple[Segment, ...], new_tokens: int, context: int, model: PrefillModel,
                 overlap: bool, layers: int, step_tokens: int = 0) -> None:
        self.segs, self.new, self.context, self.model = segs, new_tokens, context, model
        self.overlap, self.layers, self.step_tokens = overlap, layers, step_tokens
        self.held = sum(s.tokens for s in segs)
        self.starts = [sum(s.tokens for s in segs[:i]) for i in range(len(segs))]

    def _first(self, m: int):
        """``(segment, its tokens among the first m held)`` for the segments those reach, in order."""
        for s, start in zip(self.segs, self.starts):
            if m <= start:
                return
            yield s, min(s.tokens, m - start)

    def load(self, m: int) -> float:
        return sum(s.seconds(n) for s, n in self._first(m))

    def cost(self, m: int) -> float:
        """The measured overlap cost of loading the first ``m`` held tokens under the forward (seconds)."""
        return sum(n * s.nbytes_per_token * s.overlap_cost for s, n in self._first(m) if s.overlap_cost)

    def compute(self, m: int) -> float:
        return self.model.seconds(self.held - m + self.new, self.context + m)

    def overlapped(self, m: int) -> float:
        """The part of ``compute(m)`` the load can overlap: the first step's (``step_tokens`` of the tokens to
        compute; all of them when they fit one step, or without a cap)."""
        rest = self.held - m + self.new
        if self.step_tokens and rest > self.step_tokens:
            return self.model.seconds(self.step_tokens, self.context + m)
        return self.compute(m)

    def total(self, m: int) -> float:
        ld, cp = self.load(m), self.compute(m)
        if not self.overlap:
            return ld + cp
        ov = self.overlapped(m)
        return max(ld, ov) + (min(ld, ov) / self.layers if self.layers else 0.0) + (cp - ov) + self.cost(m)


def _ends(t: _Timing, lo: int) -> set[int]:
    """``lo`` and every segment end above it: the all-or-nothing plans."""
    return {lo} | {start + s.tokens for s, start in zip(t.segs, t.starts) if start + s.tokens > lo}


def _candidates(t: _Timing, lo: int, unit: int) -> set[int]:
    """Where ``T`` can be least: ``lo``, every segment end above it, and the grid points either side of each
    segment's crossing of load and compute."""
    out = {lo}
    for s, start in zip(t.segs, t.starts):
        a, b = max(start, lo), start + s.tokens
        if b <= lo:
            continue
        out.add(b)
        if t.overlap and t.load(a) < t.overlapped(a) and t.load(b) >= t.overlapped(b):
            cross = _first_at_or_after_crossing(t, a, b, unit)
            out.update({cross, max(a, cross - unit)})
        if t.overlap and t.step_tokens:  # where the tokens to compute start to fit one step
            edge = t.held + t.new - t.step_tokens
            if a < edge < b:
                grid = a + (edge - a) // unit * unit
                out.update({grid, min(b, grid + unit)})
    return out


def _first_at_or_after_crossing(t: _Timing, a: int, b: int, unit: int) -> int:
    """The first grid point in ``(a, b]`` where the load takes at least the compute (``load - compute`` rises)."""
    lo, hi = 0, (b - a) // unit  # load < compute at a + lo*unit; load >= compute at a + hi*unit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if t.load(a + mid * unit) >= t.overlapped(a + mid * unit):
            hi = mid
        else:
            lo = mid
    return a + hi * unit
