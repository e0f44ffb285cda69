"""The load gates: of a hit below the memory tiers (disk, remote), what to load and what to recompute.

``SplitGate`` (the SGLang backend and the vLLM connector since issue 32) decides per hit with
``planner.split``: the held tokens as segments per tier, each read at its own measured rate
(``planner.rates.ReadRate``), against the prefill model in use (``planner.rates.PrefillEstimator``),
with or without an in-step overlap of load and compute; it counts, per tier, the held tokens loaded
and recomputed, and sums the estimated times of its plans against recompute-all and load-all.

``LoadGate`` (the vLLM connector per chunk and the SGLang backend per page before issue 32; no front end
uses it now) is the older rule, kept as it was: with ``disk_load_policy`` ``auto``, the leading units held
in memory tiers always load; the units after them, held only in a slow tier, load while
``unit_nbytes / rate < unit_tokens / prefill_tokens_per_s``. The rate starts at ``disk_read_gbps`` and follows the reads the caller times
(an exponential average, ``EWMA_NEW`` for the newest). A declined tier is never read, so its estimate
would never change: every ``probe_every``-th declined decision takes the hit anyway (``0``: never).
``always`` loads every held unit; ``never`` only the memory-tier ones.

Threading contract: ``decide`` and ``observe`` (``observe_reads``) may run on different threads at
once (SGLang's prefetch and prefetch-IO threads); both gates take their lock, the rates theirs.
"""
from __future__ import annotations

import statistics
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence

from tiered_kv.errors import ConfigError, InvalidInputError
from tiered_kv.planner.rates import EWMA_NEW, LoadFloor, OverlapCost, PrefillEstimator, ReadRate
from tiered_kv.planner.split import MEMORY_TIERS, Segment, Split, forced_tokens, plan_split, split_at

DISK_LOAD_POLICIES = ("auto", "always", "never")
__all__ = ["EWMA_NEW", "LoadGate", "SplitGate", "DISK_LOAD_POLICIES", "OUTCOMES"]

#: ``decide`` outcomes: memory tiers only; every held token loaded by policy, or because that is fastest; a split
#: (some slow-tier tokens loaded, the rest recomputed: ``SplitGate`` only); a probe; no slow-tier token loaded; and
#: (``SplitGate``) nothing loaded, memory tiers included, as the engine's loading steps have a floor above, or within
#: ``RECOMPUTE_MARGIN`` of, the hit's recompute (``SplitGate.load_floor``).
ALL_FAST, ALWAYS, BEATS, SPLIT, PROBE, DECLINED = "all_fast", "always", "beats", "split", "probe", "declined"
RECOMPUTE = "recompute"
OUTCOMES = (ALL_FAST, ALWAYS, BEATS, PROBE, DECLINED)
SPLIT_OUTCOMES = (ALL_FAST, ALWAYS, BEATS, SPLIT, PROBE, DECLINED, RECOMPUTE)
#: Of the hits the load floor declines, every this-many-th is planned as if it were not (loads), so the floor follows
#: the engine; and the floor acts only once this many loading steps measured it, with a prefill model fitted.
RECOMPUTE_PROBE_EVERY, FLOOR_MIN_SAMPLES = 8, 3
#: Where the floor applies, a CPU hit is recomputed unless its priced recompute is more than this fraction above the
#: loading step's time (the floor, or the loading plan's own price if longer): a near tie recomputes, as the engine
#: alone would. Why: a loading step carries host work its price leaves out (``start_load_kv``: 4-5 ms p50 on the
#: Gemma-2 shape), and the linear prefill model charges a launch-bound step for tokens that cost it no time (H200,
#: uncompiled Gemma-2 c1, 2026-11-30: every hit loaded, its loading steps ran 61.7 ms on the GPU against 53.8 ms for
#: 1,152-token recompute steps, 1.06x of no connector); on such engines vLLM's connector, which always loads, ran
#: 1.14-1.36x of no connector.
RECOMPUTE_MARGIN = 0.05
#: The floor is measured on the latest loading steps, the model fitted on older steps: the floor's decision prices
#: recompute at the engine's speed now, the model's price times the median measured / priced time of the last this
#: many unloaded prefill steps (``observe_unloaded_step``), kept within ``SCALE_BOUNDS``. Why: a host whose launches
#: slowed between the warm phase and the hits (H200, uncompiled Gemma-2 c1, round 18: 1,152-token steps at 60 ms,
#: then 1,312-token recomputes at 88 ms and loading steps at 75 ms) had its hits' recompute priced at the old speed
#: under the new floor, and recomputed 7 of 16 hits, each slower than loading.
RECENT_STEPS, SCALE_BOUNDS = 5, (0.5, 2.0)
#: An overlapped plan loads at most this many times a young slow tier's largest measured read (``SplitGate._ramp``).
RAMP_READS = 4
#: The prefill rate is reported for a chunk of this many tokens after each of these contexts.
REPORT_CHUNK, REPORT_CONTEXTS = 2048, (0, 8192, 32768)


def _check_policy(policy: str) -> None:
    if policy not in DISK_LOAD_POLICIES:
        raise ConfigError(f"disk_load_policy: expected one of {list(DISK_LOAD_POLICIES)}, got {policy!r}")


class LoadGate:
    """How many leading held units (chunks, pages) are worth loading; the rest are recomputed."""

    def __init__(self, policy: str, disk_read_gbps: float, probe_every: int, prefill_tokens_per_s: float,
                 unit_tokens: int, unit_nbytes: int) -> None:
        _check_policy(policy)
        if unit_tokens <= 0 or unit_nbytes <= 0:
            raise ConfigError(f"load gate: unit of {unit_tokens} tokens / {unit_nbytes} B; both must be > 0")
        self.policy = policy
        self.probe_every = int(probe_every)
        self.prefill_tokens_per_s = float(prefill_tokens_per_s)
        self.unit_tokens = int(unit_tokens)
        self.unit_nbytes = int(unit_nbytes)
        self._rate = ReadRate(disk_read_gbps)
        self._declined = 0
        self._decisions = dict.fromkeys(OUTCOMES, 0)
        self._declined_units = 0
        self._lock = threading.Lock()

    @property
    def gbps(self) -> float:
        """The current slow-tier read-rate estimate (GB/s)."""
        return self._rate.gbps

    def beats_recompute(self) -> bool:
        """Whether, at the current estimate, a slow-tier unit loads faster than it is recomputed."""
        return self.unit_nbytes / (self.gbps * 1e9) < self.unit_tokens / self.prefill_tokens_per_s

    def break_even_gbps(self) -> float:
        """The slow-tier rate above which loading a unit beats recomputing it."""
        return self.unit_nbytes * self.prefill_tokens_per_s / self.unit_tokens / 1e9

    def decide(self, n_fast: int, n: int) -> tuple[int, str]:
        """Of ``n`` held leading units, the first ``n_fast`` in memory tiers: how many to load, and why
        (``ALL_FAST``, ``ALWAYS``, ``BEATS``, ``PROBE`` or ``DECLINED``). Each outcome is counted (``report``)."""
        hits, outcome = self._decide(n_fast, n)
        with self._lock:
            self._decisions[outcome] += 1
            self._declined_units += n - hits
        return hits, outcome

    def _decide(self, n_fast: int, n: int) -> tuple[int, str]:
        if n_fast == n:
            return n, ALL_FAST
        if self.policy == "always":
            return n, ALWAYS
        if self.policy == "auto":
            if self.beats_recompute():
                return n, BEATS
            with self._lock:
                self._declined += 1
                probe = self.probe_every > 0 and self._declined % self.probe_every == 0
            if probe:
                return n, PROBE
        return n_fast, DECLINED

    def report(self) -> dict:
        """For metrics: ``decisions`` (count per outcome), ``declined_units`` (held slow-tier units not loaded, so
        recomputed), ``read_gbps`` (the slow-tier rate estimate) and ``break_even_gbps``."""
        with self._lock:
            return {"decisions": dict(self._decisions), "declined_units": self._declined_units,
                    "read_gbps": self.gbps, "break_even_gbps": self.break_even_gbps()}

    def observe(self, nbytes: int, seconds: float) -> None:
        """A slow-tier read moved ``nbytes`` in ``seconds``: fold its rate into the estimate."""
        self._rate.observe(nbytes, seconds)


class SplitGate:
    """Per hit, how many leading held tokens to load (``planner.split``), under ``disk_load_policy``.

    ``auto``: the fastest plan at the current estimates; every ``probe_every``-th plan that leaves held slow-tier
    tokens unloaded loads them all instead (``PROBE``), so a tier that got faster (a warm page cache) is seen.
    ``always``: every held token. ``never``: the memory-tier ones. ``rates`` holds one ``ReadRate`` per tier a
    hit may come from; a memory tier without one reads for free (always loaded anyway; without overlap its time
    is the same in every plan). ``unit_tokens``/``unit_nbytes``: one chunk or page. ``hit_nbytes``: the bytes a
    hit of so many tokens reads, where that is not tokens x ``unit_nbytes / unit_tokens`` (hybrid models: a
    sliding-window layer reads its window once, not per chunk); a hit is then priced at its own average per
    token. ``overlap``, ``layers``, ``extra_recompute`` and ``step_tokens``: ``planner.split.plan_split``'s.
    With ``overlap``, each slow tier's bytes read under the forward carry that tier's measured ``OverlapCost``
    (``observe_loaded_step``), so a tier whose overlapped reads slow the step more than priced loads less.

    Memory-tier (CPU) hits load in every plan, unless the hit would load in-step and the engine's loading steps have
    a floor (``load_floor``: ``rates.LoadFloor``, measured by ``observe_loaded_step``) above, or within
    ``RECOMPUTE_MARGIN`` of, the time to recompute every held token and the new ones, priced at the engine's recent
    speed (``recompute_scale``): then nothing loads (``RECOMPUTE``; every ``RECOMPUTE_PROBE_EVERY``-th such
    hit is planned as usual, to measure again). That happens where the engine's step does not get faster with fewer
    tokens: an engine launching its prefill op by op from Python (no CUDA graph, no compilation), whose step of 160
    tokens costs its host launch as a step of 1,300 does (H200, Llama-3-8B shape, 2026-11-30: loading steps of
    22-32 ms by the host's speed against 27 ms to recompute). The floor acts after ``FLOOR_MIN_SAMPLES`` loading
    steps and with a fitted prefill model. Policy ``always`` never declines.
    """

    def __init__(self, policy: str, probe_every: int, rates: Mapping[str, ReadRate], prefill: PrefillEstimator, *,
                 overlap: bool, unit_tokens: int, unit_nbytes: int, layers: int = 0,
                 extra_recompute: bool = False, step_tokens: int = 0,
                 hit_nbytes: Callable[[int], int] | None = None) -> None:
        _check_policy(policy)
        if unit_tokens <= 0 or unit_nbytes <= 0 or layers < 0:
            raise ConfigError(f"split gate: unit of {unit_tokens} tokens / {unit_nbytes} B (both must be > 0), "
                              f"layers {layers} (>= 0)")
        self.policy, self.probe_every = policy, int(probe_every)
        self.rates, self.prefill = dict(rates), prefill
        self.overlap, self.layers, self.extra_recompute = bool(overlap), int(layers), bool(extra_recompute)
        self.step_tokens = int(step_tokens)
        self.unit_tokens, self.unit_nbytes = int(unit_tokens), int(unit_nbytes)
        self.hit_nbytes = hit_nbytes
        self._lock = threading.Lock()
        self._declined = 0
        self._decisions = dict.fromkeys(SPLIT_OUTCOMES, 0)
        # tier -> [held tokens loaded, held tokens recomputed]; every tier of ``rates`` from the start, so the stats
        # and metrics of a tier that has had no hit yet say 0 rather than nothing
        self._tokens: dict[str, list[int]] = {t: [0, 0] for t in rates}
        self.overlap_cost = {t: OverlapCost() for t in rates if t not in MEMORY_TIERS}
        self.load_floor = LoadFloor()  # memory-tier loads (class doc); only a front end that times steps feeds it
        self._recent: deque[float] = deque(maxlen=RECENT_STEPS)  # unloaded prefill steps' measured / priced times
        self._recompute_declined = 0
        self._seconds = {"chosen": 0.0, "recompute": 0.0, "load_all": 0.0}

    # ------------------------------------------------------------------ the decision
    def segments(self, runs: Sequence[tuple[str, int]]) -> list[Segment]:
        """``runs`` ((tier, tokens) in prefix order) as segments at the current read estimates (equal tiers merged),
        every token at the hit's average bytes (``hit_nbytes``; else one unit's)."""
        total = sum(tokens for _, tokens in runs)
        per_token = (self.hit_nbytes(total) / total if self.hit_nbytes is not None and total > 0
                     else self.unit_nbytes / self.unit_tokens)
        out: list[Segment] = []
        costs = self.overlap_cost
        for tier, tokens in runs:
            if out and out[-1].tier == tier:
                tokens += out.pop().tokens
            cost = costs.get(tier)
            out.append(Segment(tier, tokens, per_token, self._gbps(tier), cost.s_per_byte if cost is not None else 0.0))
        return out

    def _gbps(self, tier: str) -> float:
        rate = self.rates.get(tier)
        if rate is not None:
            return rate.gbps
        if tier in MEMORY_TIERS:
            return float("inf")
        raise InvalidInputError(f"split gate: no read rate for tier {tier!r}; it has {sorted(self.rates)}")

    def decide(self, runs: Sequence[tuple[str, int]], new_tokens: int, context: int,
               count: bool = True, align: int = 0, offset: int = 0,
               overlap: bool | None = None, in_step: bool = True) -> tuple[Split, str]:
        """The plan for a hit held as ``runs`` ((tier, tokens) in prefix order, whole units), after ``context``
        tokens the engine has, with ``new_tokens`` to compute after it; and why (an outcome). Counted in ``report``
        (``count=False``: not yet; the caller passes it to ``count`` once the engine took the plan, so a hit
        the engine asks about again is counted once). ``align`` > 0: a split that loads part of a run ends where
        ``offset`` + the tokens loaded is a multiple of it (the loader moves whole chunks: the better of the chunk
        ends either side of the best split). ``overlap``: this plan's mode when not the gate's (False: the load will
        run before the forward after all). ``in_step``: the hit may load inside the step (the load floor applies)."""
        segs = self.segments(runs)
        split, outcome = self._plan(segs, new_tokens, context, align, offset,
                                    self.overlap if overlap is None else bool(overlap), in_step)
        if count:
            self.count(split, outcome)
        return split, outcome

    def _plan(self, segs: list[Segment], new_tokens: int, context: int, align: int = 0,
              offset: int = 0, overlap: bool = False, in_step: bool = True) -> tuple[Split, str]:
        model = self.prefill.model()
        held, lo = sum(s.tokens for s in segs), forced_tokens(segs)

        def at(m: int) -> Split:
            return split_at(segs, m, new_tokens, context, model, overlap=overlap, layers=self.layers,
                            step_tokens=self.step_tokens)

        if lo and in_step and self.policy != "always" and self.load_floor.samples >= FLOOR_MIN_SAMPLES:
            loaded = at(lo)
            if self._recompute(loaded, new_tokens, context, model):
                return at(0), RECOMPUTE
            if lo == held:
                return loaded, ALL_FAST
        if lo == held:
            return at(held), ALL_FAST
        if self.policy != "auto":
            return (at(held), ALWAYS) if self.policy == "always" else (at(lo), DECLINED)
        best = plan_split(segs, new_tokens, context, model, overlap=overlap, unit_tokens=self.unit_tokens,
                          layers=self.layers, extra_recompute=self.extra_recompute, step_tokens=self.step_tokens)
        cut = (best.load_tokens + offset) % align if align else 0
        if cut and lo < best.load_tokens < held:  # between two chunk ends: the better of them
            down = max(lo, best.load_tokens - cut)
            best = min((at(m) for m in (down, min(held, down + align))), key=lambda sp: (sp.seconds, -sp.load_tokens))
        cap = self._ramp(segs, align, offset) if overlap else None
        if cap is not None and best.load_tokens > cap:  # never bet a run on a guess, nor on a rate from small reads
            return at(cap), SPLIT
        if best.load_tokens == held:
            return best, BEATS
        with self._lock:
            self._declined += 1
            probe = self.probe_every > 0 and self._declined % self.probe_every == 0
        if probe:  # a probe of a young tier loads what the ramp allows (it measures a larger read all the same)
            return at(held if cap is None else cap), PROBE
        return best, (DECLINED if best.load_tokens == lo else SPLIT)

    def _recompute(self, loaded: Split, new_tokens: int, context: int, model) -> bool:
        """Whether to load nothing (``RECOMPUTE``): a step running ``loaded`` (the plan that loads the memory-tier
        part) would take the load floor or its own priced time, whichever is longer, and recomputing every held token
        and the new ones takes less than ``1 + RECOMPUTE_MARGIN`` times that, both priced times at the engine's
        recent speed (``recompute_scale``); not for every ``RECOMPUTE_PROBE_EVERY``-th such hit (planned as usual:
        a sample)."""
        floor = self.load_floor.seconds
        if floor <= 0 or not self.prefill.fitted:
            return False
        scale = self.recompute_scale
        recompute_s = model.seconds(loaded.held_tokens + new_tokens, context) * scale
        if recompute_s >= (1 + RECOMPUTE_MARGIN) * max(floor, loaded.seconds * scale):
            return False
        with self._lock:
            self._recompute_declined += 1
            return self._recompute_declined % RECOMPUTE_PROBE_EVERY != 0

    def _ramp(self, segs: list[Segment], align: int = 0, offset: int = 0) -> int | None:
        """The most held tokens an overlapped plan may load while a slow tier's rate is young, or None for no cap.
        A tier whose rate began as a built-in guess (``ReadRate.guess``) may load, in one plan, one unit (the
        ``align`` chunk where given) until its first read, then at most ``RAMP_READS`` times its largest measured read
        (``ReadRate.largest``) over all its runs in the hit, on the unit grid and at least one unit: the cap is on the
        first run that goes past it (the runs before it load as planned). A probe loads up to the cap too. Why: on
        the H200 host the default 3 GB/s against the 0.9 GB/s read beside vLLM's thread made the first overlapped disk
        hits 2-3x slower than recompute; and in GPU round 17 a rate measured on one chunk's read (33 MB) sent the next
        32k-token hit to load 1.3 GB under the forward at half that rate: 1.9x of recompute. A read vouches for a few
        times its size; a few hits grow it to any size."""
        start = 0
        used: dict[str, int] = {}  # a tier's tokens in the runs before this one: one read with them (one load job)
        for s in segs:
            rate = self.rates.get(s.tier)
            if s.tier not in MEMORY_TIERS and s.tokens and rate is not None and rate.guess:
                allowed = (RAMP_READS * rate.largest / s.nbytes_per_token if s.nbytes_per_token > 0 else float("inf"))
                allowed -= used.get(s.tier, 0)
                if rate.reads == 0 or allowed < s.tokens:
                    step = (align - (start + offset) % align) if align else self.unit_tokens
                    grid = align or self.unit_tokens
                    more = int(max(0.0, allowed - step) // grid) * grid if rate.reads else 0
                    return start + min(s.tokens, step + more)
                used[s.tier] = used.get(s.tier, 0) + s.tokens
            start += s.tokens
        return None

    def count(self, split: Split, outcome: str) -> None:
        """Count a plan ``decide`` made (with ``count=False``) in ``report``: its outcome, its tokens per tier, its
        estimated seconds."""
        with self._lock:
            self._decisions[outcome] += 1
            for tier, (loaded, recomputed) in split.per_tier().items():
                t = self._tokens.setdefault(tier, [0, 0])
                t[0] += loaded
                t[1] += recomputed
            s = self._seconds
            s["chosen"] += split.seconds
            s["recompute"] += split.seconds_recompute
            s["load_all"] += split.seconds_load_all

    # ------------------------------------------------------------------ measurements
    def observe_reads(self, nbytes_by_tier: Mapping[str, int], seconds: float) -> None:
        """One read moved ``nbytes_by_tier`` in ``seconds`` (its whole wall time). The time is charged to the slow
        tiers in it (memory tiers' share ignored: conservative), shared by their estimated times when several."""
        slow = {t: n for t, n in nbytes_by_tier.items() if n > 0 and t not in MEMORY_TIERS and t in self.rates}
        if not slow or seconds <= 0:
            return
        est = {t: self.rates[t].seconds(n) for t, n in slow.items()}
        total = sum(est.values())
        for t, n in slow.items():
            self.rates[t].observe(n, seconds * est[t] / total)

    def observe_loaded_step(self, nbytes_by_tier: Mapping[str, float], seconds: float, priced_s: float) -> None:
        """A step loaded ``nbytes_by_tier`` in-step (slow tiers read under its forward, memory tiers copied) and ran
        ``seconds``; the model's compute of its tokens and its plans' exposure price ``priced_s``. With slow-tier
        bytes, each slow tier's ``OverlapCost`` takes its share of the excess, by bytes (the memory tiers' bytes are
        far cheaper: left out); with memory-tier bytes only, ``load_floor`` takes the step."""
        slow = {t: n for t, n in nbytes_by_tier.items() if n > 0 and t in self.overlap_cost}
        if not slow:
            if any(n > 0 for t, n in nbytes_by_tier.items() if t in MEMORY_TIERS):
                self.load_floor.observe(seconds, priced_s)
            return
        total = sum(slow.values())
        for t, n in slow.items():
            self.overlap_cost[t].observe(n, (seconds - priced_s) * n / total)

    def observe_unloaded_step(self, seconds: float, priced_s: float) -> None:
        """A prefill step with no in-step load ran ``seconds`` where the prefill model in use priced ``priced_s``: one
        of the last ``RECENT_STEPS`` that ``recompute_scale`` takes its median of."""
        if seconds > 0 and priced_s > 0:
            with self._lock:
                self._recent.append(seconds / priced_s)

    @property
    def recompute_scale(self) -> float:
        """The engine's speed now against the prefill model's: the median measured / priced time of the last
        ``RECENT_STEPS`` unloaded prefill steps, within ``SCALE_BOUNDS`` (1.0 before any)."""
        with self._lock:
            recent = list(self._recent)
        if not recent:
            return 1.0
        return min(SCALE_BOUNDS[1], max(SCALE_BOUNDS[0], statistics.median(recent)))

    def hint_writes(self, nbytes_by_tier: Mapping[str, int], seconds: float) -> None:
        """A write to slow tiers moved ``nbytes_by_tier`` in ``seconds``: a tier whose read rate is still the
        built-in guess takes it as a bound (``ReadRate.hint``); the time is shared as ``observe_reads`` does."""
        slow = {t: n for t, n in nbytes_by_tier.items() if n > 0 and t not in MEMORY_TIERS and t in self.rates}
        if not slow or seconds <= 0:
            return
        total = sum(slow.values())
        for t, n in slow.items():
            self.rates[t].hint(n, seconds * n / total)

    # ------------------------------------------------------------------ reporting
    def break_even_gbps(self, tier_context: int = 0) -> float:
        """The read rate above which loading one unit beats recomputing it (no overlap, after ``tier_context``)."""
        m = self.prefill.model()
        compute = m.seconds(self.unit_tokens, tier_context) - m.overhead_s
        return self.unit_nbytes / compute / 1e9

    def report(self) -> dict:
        """For metrics, as ``LoadGate.report`` (``decisions``, ``declined_units``, ``read_gbps`` of the first slow
        tier, ``break_even_gbps``) plus ``split``: held tokens loaded/recomputed per tier, every tier's read rate and
        its source (``ReadRate.source``),
        the prefill model in use (rates for a ``REPORT_CHUNK``-token chunk after each of ``REPORT_CONTEXTS``,
        its source and samples), the summed estimated seconds of the plans taken, of recompute-all and of
        load-all, the mode (``overlap``), each slow tier's overlap cost (seconds per GB, samples) and the memory
        tiers' load floor (seconds, samples)."""
        prefill = self.prefill.report()
        model = prefill["model"]
        scale = self.recompute_scale  # takes the lock: before the block below
        gbps = {t: r.gbps for t, r in self.rates.items()}
        slow = [g for t, g in gbps.items() if t not in MEMORY_TIERS]
        with self._lock:
            tokens = {t: {"loaded": v[0], "recomputed": v[1]} for t, v in self._tokens.items()}
            declined = sum(v["recomputed"] for v in tokens.values()) // self.unit_tokens
            split = {"tokens": tokens, "read_gbps": gbps, "read_source": {t: r.source for t, r in self.rates.items()},
                     "estimated_seconds": dict(self._seconds),
                     "overlap": self.overlap,
                     "overlap_cost": {t: {"s_per_gb": c.s_per_byte * 1e9, "samples": c.samples}
                                      for t, c in self.overlap_cost.items()},
                     "load_floor": {"seconds": self.load_floor.seconds, "samples": self.load_floor.samples,
                                    "recompute_scale": scale},
                     "prefill": {"source": prefill["source"], "samples": prefill["samples"],
                                 "coefficients": model.coefficients(),
                                 "tokens_per_s": {c: model.tokens_per_s(REPORT_CHUNK, c) for c in REPORT_CONTEXTS}}}
            return {"decisions": dict(self._decisions), "declined_units": declined,
                    "read_gbps": slow[0] if slow else 0.0, "break_even_gbps": self.break_even_gbps(), "split": split}
