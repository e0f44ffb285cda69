"""Online estimates behind the disk-or-recompute decision: a tier's read rate and the engine's prefill time.

``ReadRate`` is one tier's read rate (GB/s): a start value, then an exponential average of the reads
the caller times (``EWMA_NEW`` for the newest), as the load gate has always done; ``fixed`` pins it. A
built-in start (``guess``) is lowered by the tier's measured writes until its first read (``hint``).

``PrefillModel`` is the time a forward takes to compute ``n`` tokens that follow ``c`` tokens already
in the KV cache::

    seconds(n, c) = overhead_s + s_per_token * n + s_per_pair * (n*c + n*(n+1)/2) + s_per_read * (c + n)

Why these four terms (per layer, summed over layers; the coefficients absorb the constants):

- ``overhead_s``, once per forward: launches, scheduling, sampling, and for a small batch the read
  of the weights, which costs the same for 1 token as for 200;
- ``s_per_token * n``: every linear layer (QKV, output, MLP) costs about 2 x parameters FLOPs per
  token whatever the context; for an 8B model, 16 GFLOP a token, most of a short prefill;
- ``s_per_pair * pairs``: causal attention multiplies each new query by every key before it, the
  ``c`` cached ones and the new ones up to itself: ``n*c + n*(n+1)/2`` query-key pairs, about
  ``4 * heads * head_dim`` FLOPs each (Llama-3-8B: 0.5 MFLOP a pair over 32 layers, so at 30k
  tokens of average context attention costs as much as the rest of the model);
- ``s_per_read * (c + n)``: attention reads every key and value at least once, so a decode token
  (``n = 1``) costs the memory traffic of its whole context (bandwidth-bound: ~36x a prefill pair's
  FLOP time on an H200 for Llama-3-8B); for a prefill of thousands of tokens this term is noise.

The features add up over the requests of a batch, so one step that mixes a prefill chunk with other
requests' decodes is one sample (``observe_step``); a per-context-band rate could not take such a
step, and would need a band for every context a request may have. A rate "tokens/s at context c"
is this model read at one point (``tokens_per_s``).

``PrefillEstimator`` fits that model online to the steps the caller times: the last ``window``
samples, newer ones weighing more (half weight every ``half_life`` samples, so a change is followed
within a few half-lives), relative errors (a 5 ms step counts as much as a 500 ms one), robust to
outliers (iteratively reweighted, Tukey's biweight on residuals scaled by their median absolute
value, so a step slowed 3x by a GC pause or a swap gets no weight), no coefficient below 0, and a
ridge toward the start model of 1e-3 of one sample's weight, so what the samples do not determine
(all of one prompt length, say) keeps the start model's shape. Steps that computed only decode
tokens (``DECODE_TOKENS`` or fewer per request) say nothing about prefill and are skipped, so
decode steps do not push the prefill steps out of the window. With ``fixed`` (or no samples yet)
the start model is the estimate; from ``SCALE_SAMPLES`` samples to ``MIN_SAMPLES``, the start model scaled by the
median ratio of measured to predicted times (robust where a few samples cannot support the fit). The fit costs a
few ms of Python (128 samples, 4 rounds): by default
``model()`` runs it when due, on the reader's thread; with ``fit_on_read=False`` ``model()`` only
reads the last fit and the owner calls ``refit`` from a thread of its own (the vLLM connector's
``StepMeter``), passing a ``pause`` that lets go of the GIL between slices of the work.

``OverlapCost`` is what reading a slow tier under the forward costs a step beyond the split's pricing, per byte,
learned from the forward times of the steps that did; ``LoadFloor`` the time a step with in-step CPU loads does
not go below (an uncompiled engine's launch).

``StepTimer`` turns when a step was scheduled and when its output came back into the seconds the
step ran, for engines that schedule the next step while one runs (vLLM's async scheduling).

Threading contract: ``ReadRate``, ``OverlapCost``, ``LoadFloor`` and ``PrefillEstimator`` take their own lock in
every method, so one thread may observe while another reads the estimate. ``StepTimer`` is not thread-safe: its
owner (the engine's scheduler thread) calls it. ``PrefillModel`` is a frozen value.
"""
from __future__ import annotations

import operator
import statistics
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import astuple, dataclass

from tiered_kv.errors import ConfigError

#: Weight of the newest read in a tier's read-rate average; a write smaller than ``HINT_MIN_BYTES`` measures the
#: medium's latency more than its rate: ``ReadRate.hint`` ignores it.
EWMA_NEW, HINT_MIN_BYTES = 0.2, 4 << 20
#: The built-in start of a slow tier's read rate (the engines' ``disk_read_gbps`` default): a ``ReadRate.guess``; a
#: guessed tier's read this many times its largest before replaces the estimate (``ReadRate.observe``).
DEFAULT_READ_GBPS, GROW_REPLACES = 3.0, 2
#: A request that computes this many tokens or fewer in a step is decoding (speculative decoding: a few).
DECODE_TOKENS = 16
#: Steps the fit keeps, and the age (in samples) at which a sample weighs half as much as the newest.
WINDOW, HALF_LIFE = 128, 32.0
#: Samples before the fit replaces the start model, then refitted every ``REFIT_EVERY`` new samples (a fit costs a
#: few ms of Python); from ``SCALE_SAMPLES`` to ``MIN_SAMPLES``: the start model times the samples' median measured /
#: predicted time (one number 4 steps tell even with one slowed; GPU round 17 planned 32k loads with a start 10% high).
MIN_SAMPLES, REFIT_EVERY, SCALE_SAMPLES = 8, 8, 4
#: Ridge weight toward the start model, per unit of (equilibrated) sample weight.
RIDGE = 1e-3
#: A loading step over this many times its priced time sat on the floor or above it (an eager launch); the floor is
#: the least of this many latest such steps (``LoadFloor``).
FLOOR_BOUND, FLOOR_WINDOW = 1.2, 4
#: Tukey's biweight constant (95% efficiency under normal noise), the rounds of reweighting, and the
#: smallest residual scale (relative): below 1% noise every sample is trusted as if it had 1%.
TUKEY_C, ROUNDS, MIN_SCALE = 4.685, 4, 0.01


def _positive(name: str, v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise ConfigError(f"{name}: expected a number > 0, got {v!r}")
    return float(v)


# ---------------------------------------------------------------------------------------------- read rate

class ReadRate:
    """One tier's read-rate estimate (GB/s): ``start``, then an exponential average of observed reads."""

    def __init__(self, start_gbps: float, fixed: bool = False, weight: float = EWMA_NEW, guess: bool = False,
                 replace_min_bytes: int = 0) -> None:
        """``guess``: the start value is a built-in default, not a figure anyone measured or set: the first
        observed read replaces it (an average with it would keep most of the guess for several reads), writes to
        the tier may lower it before then (``hint``), and ``SplitGate`` plans one chunk from this tier in an overlapped
        plan until then, a few times its largest read after (``_ramp``). ``replace_min_bytes``: only a read of at least
        this many bytes replaces the guess; smaller ones are averaged in (a few small pages measure latency)."""
        self._start = self._gbps = _positive("read rate (GB/s)", start_gbps)
        self.fixed, self.guess = bool(fixed), bool(guess)
        self.weight = float(weight)
        self._replace_min = int(replace_min_bytes)
        self._replaced = False
        self._reads = 0
        self._largest = 0  # the most bytes one observed read moved
        self._hint: float | None = None
        self._hints = 0
        self._lock = threading.Lock()

    @property
    def gbps(self) -> float:
        """The current estimate (GB/s)."""
        with self._lock:
            return self._gbps

    @property
    def reads(self) -> int:
        """Reads folded in so far (0 while ``fixed``)."""
        with self._lock:
            return self._reads

    @property
    def largest(self) -> int:
        """The most bytes one observed read moved (0 before any): how large a read the estimate has seen."""
        with self._lock:
            return self._largest

    def seconds(self, nbytes: float) -> float:
        """Seconds to read ``nbytes`` at the current estimate."""
        return nbytes / (self.gbps * 1e9)

    @property
    def replaced(self) -> bool:
        """A built-in guess that a read (of at least ``replace_min_bytes``) has replaced: the estimate is measured."""
        with self._lock:
            return self._replaced

    @property
    def source(self) -> str:
        """Where the estimate comes from: ``fixed`` (pinned), ``reads`` (measured reads), ``writes`` (the built-in
        guess lowered by the tier's writes), ``guess`` (the built-in start, perhaps averaged with reads too small to
        replace it) or ``set`` (a start someone gave, then its reads)."""
        with self._lock:
            if self.fixed:
                return "fixed"
            if self.guess:
                return "reads" if self._replaced else "writes" if self._hints else "guess"
            return "reads" if self._reads else "set"

    @property
    def hints(self) -> int:
        """Writes folded into the guess so far (``hint``)."""
        with self._lock:
            return self._hints

    def hint(self, nbytes: int, seconds: float) -> None:
        """A *write* to the tier moved ``nbytes`` in ``seconds``. While the estimate is still the built-in guess (no
        read yet), it becomes the smaller of the guess and the writes' running average: the rate the tier has shown
        bounds the bet of its first read (on the H200 host's virtio disk the 3.0 GB/s guess met 1.3 GB/s writes and,
        under them, a 0.5 GB/s first read). Ignored once a read replaced the guess, for a rate set by the user, for a
        write of less than ``HINT_MIN_BYTES`` (latency, not rate), or when ``seconds`` is not > 0."""
        if nbytes < HINT_MIN_BYTES or seconds <= 0 or self.fixed or not self.guess:
            return
        gbps = nbytes / seconds / 1e9
        with self._lock:
            if self._replaced:
                return
            self._hint = gbps if self._hint is None else (1 - self.weight) * self._hint + self.weight * gbps
            self._hints += 1
            self._gbps = min(self._start, self._hint)

    def observe(self, nbytes: int, seconds: float) -> None:
        """A read moved ``nbytes`` in ``seconds``: fold its rate in (ignored if either is not > 0, or ``fixed``). For a
        ``guess``, the first read replaces the estimate, and so does one ``GROW_REPLACES`` times the largest before it
        (a young tier's reads grow, ``SplitGate._ramp``; GPU round 17: a 33 MB read ran 2x a 1.3 GB one's rate)."""
        if nbytes <= 0 or seconds <= 0 or self.fixed:
            return
        gbps = nbytes / seconds / 1e9
        with self._lock:
            first = self.guess and not self._replaced and nbytes >= self._replace_min
            grown = self.guess and self._replaced and nbytes >= GROW_REPLACES * self._largest
            self._replaced = self._replaced or first
            self._gbps = gbps if first or grown else (1 - self.weight) * self._gbps + self.weight * gbps
            self._reads += 1
            self._largest = max(self._largest, int(nbytes))


# ---------------------------------------------------------------------------------------------- overlap cost

class _Sampled:
    """A lock and a count of the samples folded in (``OverlapCost``, ``LoadFloor`` say what a sample is)."""

    def __init__(self) -> None:
        self._samples = 0
        self._lock = threading.Lock()

    @property
    def samples(self) -> int:
        """Samples folded in so far."""
        with self._lock:
            return self._samples


class OverlapCost(_Sampled):
    """What a byte read from a slow tier *under the forward* costs the step beyond the split's own pricing (seconds
    per byte): the exponential average of ``observe``'s excess seconds over the exponential average of their bytes
    (same weight), 0 until one comes.

    The split prices an overlapped load as hidden under the compute it overlaps (``planner.split``). Where the reads
    slow the step anyway (reader threads taking the GIL from vLLM's thread, a network tier's round trips at a layer
    group's start), the engine's own forward times say so: the caller times each step whose forward read such
    bytes, subtracts the prefill model's time for the tokens the step computed and the exposed time the plans
    expected without this cost (``Split.seconds_exposed``: so a sample is the whole cost, not what the estimate
    in use missed), and hands the rest here with the bytes (H200, 2026-11-30: Redis on loopback, turn-2 steps with
    0.13-0.23 GB read under the forward ran ~85 ms longer than the model's compute, and the split's plans came out
    1.33x of recompute). A negative sample (the step ran faster than priced) lowers the average; the cost in use
    never goes below 0.

    A ratio of averages, not an average of ratios: a step's excess holds the model's error on its compute too, which
    does not scale with the bytes (GPU round 17: a 33 MB read under a 32k step 0.13 s under its price, -3.9 s/GB
    alone, kept an average of ratios below 0 through a 1.3 GB read 1.1 s over; the split kept loading)."""

    def __init__(self, weight: float = EWMA_NEW) -> None:
        super().__init__()
        self.weight = float(weight)
        self._avg = self._bytes = 0.0  # the exponential averages of the samples' excess seconds and of their bytes

    @property
    def s_per_byte(self) -> float:
        """The cost in use: seconds a byte read under the forward adds to its step (>= 0)."""
        with self._lock:
            return max(0.0, self._avg / self._bytes) if self._bytes > 0 else 0.0

    def observe(self, nbytes: int, excess_s: float) -> None:
        """A step read ``nbytes`` under its forward and ran ``excess_s`` longer than priced (negative: shorter).
        Ignored for ``nbytes`` <= 0. The first sample replaces the start of 0."""
        if nbytes <= 0:
            return
        with self._lock:
            w = self.weight if self._samples else 1.0
            self._bytes = (1 - w) * self._bytes + w * float(nbytes)
            self._avg = (1 - w) * self._avg + w * float(excess_s)
            self._samples += 1


class LoadFloor(_Sampled):
    """The time a step with in-step CPU loads does not go below (seconds), from the loading steps the caller times
    and prices (``observe``): an engine launching its prefill op by op from Python (no CUDA graph, no compilation)
    spends its launch on 160 tokens as on 1,300 (H200, Llama-3-8B: loading steps of 22-32 ms against ~27 ms to
    recompute the whole prompt), and a hit whose recompute costs less than the floor is better recomputed. A step
    that ran well over its price (``FLOOR_BOUND``) sat on the floor or above it: its time is a sample, and the floor
    is the least of the last ``FLOOR_WINDOW`` samples (0 before the first). A step that ran as priced says
    only that the floor is not above its time: every sample above it is lowered to it (a faster host, or a compiled
    engine, whose steps all run as priced: no sample ever, a floor of 0). A phase of large steps bound by their
    compute leaves the floor as it was. A floor is a step's, not a byte's: it turns down only a hit whose recompute
    costs less than it, or little more (``gate.RECOMPUTE_MARGIN``).

    Why the least, not an average: what lifts a step above the floor passes (an engine's first loading step; a host
    launching at two speeds, seconds at a time: H200, uncompiled Llama-3-8B, round 21). Three round-21 starts (the
    traced one's first loading steps: 54, 36, 19 ms) averaged 42-45 ms floors over the hits' 31 ms recompute, recomputed
    12 of 16 hits, c1 TTFT p50 46.6-51.6 ms; the start with a 24 ms floor loaded all: 35.9; no connector 39.0-42.5."""

    def __init__(self) -> None:
        super().__init__()
        self._window: deque[float] = deque(maxlen=FLOOR_WINDOW)  # the latest samples: loading steps over their price

    @property
    def seconds(self) -> float:
        """The floor in use (0: none seen)."""
        with self._lock:
            return min(self._window, default=0.0)

    def observe(self, seconds: float, priced_s: float) -> None:
        """A step with in-step CPU loads ran ``seconds``; its compute and its plans' exposure price ``priced_s``."""
        if seconds <= 0:
            return
        with self._lock:
            if seconds > FLOOR_BOUND * max(0.0, priced_s):
                self._window.append(float(seconds))
                self._samples += 1
            elif self._window:
                self._window = deque((min(t, seconds) for t in self._window), maxlen=FLOOR_WINDOW)


# ---------------------------------------------------------------------------------------------- prefill model

def features(parts: Iterable[tuple[int, int]]) -> tuple[float, float, float, float]:
    """The model's features of one forward: ``(1, tokens, query-key pairs, KV entries read)`` summed over
    ``parts``, each ``(tokens computed, context before them)`` of one request; parts with no tokens are skipped."""
    n_tot = pairs = reads = 0
    for n, c in parts:
        if n > 0:
            n_tot += n
            pairs += n * c + n * (n + 1) // 2
            reads += c + n
    return 1.0, float(n_tot), float(pairs), float(reads)


@dataclass(frozen=True)
class PrefillModel:
    """Seconds a forward takes: ``overhead_s + s_per_token*n + s_per_pair*pairs + s_per_read*reads`` (module doc)."""

    overhead_s: float
    s_per_token: float
    s_per_pair: float
    s_per_read: float = 0.0

    def __post_init__(self) -> None:
        for name, v in zip(("overhead_s", "s_per_token", "s_per_pair", "s_per_read"), astuple(self)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ConfigError(f"prefill model: {name} must be a number >= 0, got {v!r}")
        if self.s_per_token <= 0:
            raise ConfigError(f"prefill model: s_per_token must be > 0, got {self.s_per_token!r}")

    @classmethod
    def from_rate(cls, tokens_per_s: float, half_rate_context: float, overhead_s: float = 0.0) -> "PrefillModel":
        """A start model from two numbers a user knows: the prefill rate at short context (tokens/s), and the
        context at which attention halves it (a token attending to that many others costs twice as much)."""
        per_token = 1.0 / _positive("prefill_tokens_per_s", tokens_per_s)
        return cls(float(overhead_s), per_token, per_token / _positive("prefill_half_rate_context", half_rate_context))

    def coefficients(self) -> tuple[float, float, float, float]:
        """``(overhead_s, s_per_token, s_per_pair, s_per_read)``, in the order of ``features``."""
        return self.overhead_s, self.s_per_token, self.s_per_pair, self.s_per_read  # not astuple: it deep-copies

    def step_seconds(self, parts: Iterable[tuple[int, int]]) -> float:
        """Seconds of one forward computing ``parts`` (``(tokens, context)`` per request); 0 if it computes none."""
        x = features(parts)
        if x[1] == 0:
            return 0.0
        return sum(a * b for a, b in zip(x, self.coefficients()))

    def seconds(self, tokens: int, context: int) -> float:
        """Seconds to compute ``tokens`` tokens after ``context`` cached ones, in one forward (0 for no tokens):
        ``step_seconds`` of one part, written out (the split evaluates it for every plan it prices)."""
        if tokens <= 0:
            return 0.0
        pairs = tokens * context + tokens * (tokens + 1) // 2
        return (self.overhead_s + self.s_per_token * float(tokens) + self.s_per_pair * float(pairs)
                + self.s_per_read * float(context + tokens))

    def tokens_per_s(self, tokens: int, context: int) -> float:
        """The rate of a forward computing ``tokens`` after ``context`` (tokens/s)."""
        return tokens / self.seconds(tokens, context)


# ---------------------------------------------------------------------------------------------- estimator

class PrefillEstimator:
    """The prefill model in use: the start model, then a robust fit to the last steps timed (module doc)."""

    def __init__(self, start: PrefillModel, fixed: bool = False, window: int = WINDOW,
                 half_life: float = HALF_LIFE, min_samples: int = MIN_SAMPLES, fit_on_read: bool = True,
                 scale_samples: int = SCALE_SAMPLES) -> None:
        if window < min_samples or min_samples < 1 or half_life <= 0 or scale_samples < 1:
            raise ConfigError(f"prefill estimator: window {window} must hold min_samples {min_samples} >= 1, "
                              f"half_life {half_life} must be > 0, scale_samples {scale_samples} >= 1")
        self.start = start
        self.fixed = bool(fixed)
        self.half_life = float(half_life)
        self.min_samples = int(min_samples)
        self.scale_samples = min(int(scale_samples), self.min_samples)  # the first estimate's samples
        self._scaled = False  # the model in use is the start model scaled (``SCALE_SAMPLES``), not a fit
        self.fit_on_read = bool(fit_on_read)
        self._samples: deque[tuple[tuple[float, ...], float]] = deque(maxlen=int(window))
        self._model = start
        self._pending = 0  # samples since the last fit
        self._observed = self._skipped = self._outliers = 0
        self._lock = threading.Lock()

    def observe(self, tokens: int, context: int, seconds: float) -> None:
        """One forward computed ``tokens`` tokens after ``context`` cached ones in ``seconds``."""
        self.observe_step(((tokens, context),), seconds)

    def observe_step(self, parts: Sequence[tuple[int, int]], seconds: float) -> None:
        """One forward computed ``parts`` (``(tokens, context)`` per request) in ``seconds``. Skipped: ``fixed``,
        no time, or only decode tokens (``DECODE_TOKENS`` or fewer per request)."""
        if self.fixed or seconds <= 0:
            return
        if not any(n > DECODE_TOKENS for n, _ in parts):
            with self._lock:
                self._skipped += 1
            return
        x = features(parts)
        with self._lock:
            self._samples.append((x, float(seconds)))
            self._observed += 1
            self._pending += 1

    @property
    def fitted(self) -> bool:
        """An estimate from the engine's steps is in use (the scaled start or a fit, not the start model)."""
        with self._lock:
            return self._model is not self.start

    def model(self) -> PrefillModel:
        """The estimate in use: the start model while ``fixed`` or with fewer than ``scale_samples``, the start scaled
        to fewer than ``min_samples``, else the fit (with ``fit_on_read``: made under the lock when due, ``_due``;
        without: the last ``refit``'s)."""
        with self._lock:
            if self.fit_on_read and self._due():
                self._model, self._outliers, self._scaled = self._estimate(list(self._samples))
                self._pending = 0
            return self._model

    def _due(self) -> bool:
        """An estimate is due: new samples since the last, and ``scale_samples`` held for the first (the scaled start),
        ``min_samples`` for the first fit, ``REFIT_EVERY`` new ones after that."""
        n = len(self._samples)
        if self._pending == 0 or n < self.scale_samples:
            return False
        if self._model is self.start or (self._scaled and n >= self.min_samples):
            return True
        return self._pending >= REFIT_EVERY and n >= self.min_samples

    def _estimate(self, samples: list, pause: Callable[[], None] | None = None) -> tuple[PrefillModel, int, bool]:
        """The estimate from ``samples``, its outliers, and whether it is the start model scaled (fewer than
        ``min_samples``) rather than the fit."""
        if len(samples) < self.min_samples:
            return _scaled(samples, self.start), 0, True
        return (*_fit(samples, self.start, self.half_life, pause), False)

    def refit(self, pause: Callable[[], None] | None = None) -> bool:
        """Fit now if one is due (as ``model`` would), outside the lock: the samples are copied under it and the
        new model replaces the old under it, so readers and observers never wait for a fit. ``pause`` is called
        between slices of the work (one pass over the samples, or 16 samples of the normal equations: ~30-150 us
        on the CPU box). Returns whether it fitted."""
        with self._lock:
            if not self._due():
                return False
            samples, self._pending = list(self._samples), 0
        estimate = self._estimate(samples, pause)
        with self._lock:
            self._model, self._outliers, self._scaled = estimate
        return True

    def report(self) -> dict:
        """``source`` (``fixed``, ``start``, ``scaled``: the start model scaled to the first samples, or ``online``: a
        fit is in use), the model's coefficients, samples observed, decode-only steps skipped, and the samples the
        last fit gave no weight (outliers)."""
        m = self.model()
        with self._lock:
            source = "fixed" if self.fixed else ("start" if self._model is self.start else
                                                 "scaled" if self._scaled else "online")
            return {"source": source, "model": m, "samples": self._observed, "skipped_decode_steps": self._skipped,
                    "outliers": self._outliers}


def _scaled(samples: list[tuple[tuple[float, ...], float]], start: PrefillModel) -> PrefillModel:
    """``start`` with every coefficient times the median of the samples' measured / predicted times."""
    f = statistics.median(t / max(_dot(x, start.coefficients()), 1e-12) for x, t in samples)
    return PrefillModel(*(c * f for c in start.coefficients()))


def _fit(samples: list[tuple[tuple[float, ...], float]], start: PrefillModel, half_life: float,
         pause: Callable[[], None] | None = None) -> tuple[PrefillModel, int]:
    """Robust, recency-weighted, non-negative ridge fit of ``samples`` (features, seconds); and the outliers.
    ``pause`` (if any) is called between slices of the work."""
    pause = pause or _no_pause
    n = len(samples)
    recency = [0.5 ** ((n - 1 - i) / half_life) for i in range(n)]
    theta = start.coefficients()
    robust = [1.0] * n
    for _ in range(ROUNDS):
        # relative errors: weigh each sample by 1 / (its predicted time)^2, from the previous round's model
        pred = [max(_dot(x, theta), 1e-12) for x, _ in samples]
        pause()
        w = [recency[i] * robust[i] / pred[i] ** 2 for i in range(n)]
        theta = _ridge_nonneg(samples, w, start.coefficients(), pause)
        pause()
        fitted = [_dot(x, theta) for x, _ in samples]
        pause()
        rel = [(t - p) / max(p, 1e-12) for (_, t), p in zip(samples, fitted)]
        pause()
        scale = max(MIN_SCALE, 1.4826 * _weighted_median([abs(r) for r in rel], recency))
        robust = [max(0.0, 1 - (r / (TUKEY_C * scale)) ** 2) ** 2 for r in rel]
        pause()
    theta = (theta[0], max(theta[1], start.s_per_token * 1e-6), theta[2], theta[3])  # a model needs a token cost
    return PrefillModel(*theta), sum(1 for r in robust if r == 0.0)


def _dot(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(map(operator.mul, a, b))


def _weighted_median(values: list[float], weights: list[float]) -> float:
    pairs = sorted(zip(values, weights))
    half, acc = sum(weights) / 2, 0.0
    for v, w in pairs:
        acc += w
        if acc >= half:
            return v
    return pairs[-1][0] if pairs else 0.0


def _no_pause() -> None:
    pass


def _ridge_nonneg(samples: list[tuple[tuple[float, ...], float]], w: list[float],
                  prior: tuple[float, ...], pause: Callable[[], None] = _no_pause) -> tuple[float, ...]:
    """Weighted least squares with a small ridge toward ``prior`` (columns equilibrated), coefficients >= 0:
    a coefficient that comes out negative is fixed at 0 and the rest refitted."""
    k = len(prior)
    active = [j for j in range(k) if any(x[j] for x, _ in samples)]
    while True:
        theta = _ridge(samples, w, prior, active, pause)
        neg = [j for j in active if theta[j] < 0]
        if not neg:
            return tuple(theta)
        active.remove(min(neg, key=lambda j: theta[j]))


def _ridge(samples, w, prior, active: list[int], pause: Callable[[], None] = _no_pause) -> list[float]:
    k = len(active)
    a = [[0.0] * k for _ in range(k)]
    b = [0.0] * k
    for idx, ((x, t), wi) in enumerate(zip(samples, w)):  # one pass: the normal equations of the active columns
        if idx & 15 == 15:
            pause()
        xs = [x[j] for j in active]
        for i in range(k):
            wx = wi * xs[i]
            b[i] += wx * t
            row = a[i]
            for j in range(i, k):
                row[j] += wx * xs[j]
    s = [a[i][i] ** 0.5 or 1.0 for i in range(k)]
    # equilibrated (unit diagonal: u = s * theta), so RIDGE is a fraction of the samples' weight in each column
    for i in range(k):
        for j in range(i, k):
            a[i][j] /= s[i] * s[j]
            a[j][i] = a[i][j]
        b[i] = b[i] / s[i] + RIDGE * prior[active[i]] * s[i]
        a[i][i] += RIDGE
    u = _solve(a, b)
    theta = [0.0] * len(prior)
    for i, j in enumerate(active):
        theta[j] = u[i] / s[i]
    return theta


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (a small, ridge-regularized, so non-singular, system)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (m[r][n] - sum(m[r][c] * out[c] for c in range(r + 1, n))) / m[r][r]
    return out


# ---------------------------------------------------------------------------------------------- step timer

class StepTimer:
    """The seconds each step ran, from when it was scheduled and when its output arrived.

    A step starts when it was scheduled or when the step before it finished, whichever is later (with
    async scheduling the next step is scheduled while one runs; after an idle engine, it starts when
    scheduled), and ends when its output arrives. Feed ``finished``'s answer to
    ``PrefillEstimator.observe_step``.
    """

    def __init__(self) -> None:
        self._pending: dict[int, tuple[float, list[tuple[int, int]]]] = {}
        self._last_end = float("-inf")

    def scheduled(self, step: int, parts: Sequence[tuple[int, int]], now: float) -> None:
        """Step ``step`` was scheduled at ``now`` (monotonic seconds) to compute ``parts`` ((tokens, context) each)."""
        self._pending[step] = (now, list(parts))

    def finished(self, step: int, now: float) -> tuple[list[tuple[int, int]], float] | None:
        """Step ``step``'s output arrived at ``now``: its parts and the seconds it ran (None for an unknown step)."""
        got = self._pending.pop(step, None)
        for old in [s for s in self._pending if s < step]:  # a step whose output never came (aborted): forget it
            del self._pending[old]
        if got is None:
            return None
        start = max(got[0], self._last_end)
        self._last_end = now
        return got[1], max(0.0, now - start)
