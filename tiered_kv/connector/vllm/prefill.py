"""Load or recompute on the vLLM scheduler side: the split gate, and the prefill model learned from vLLM's steps.

``split_gate`` builds the ``planner.gate.SplitGate`` that ``lookup.LookupPlanner`` asks per hit (design:
docs/design.md, "Load or recompute: the split"):

- read rates per tier, whole-engine GB/s (the bytes of every TP rank's share over the slowest rank's time, as the
  workers report a job): ``disk`` from ``disk_read_gbps``, ``remote`` from ``remote_read_gbps``, each then an
  exponential average of the completed loads ``loads.LoadPlanner.load_done`` feeds it; ``cpu`` at ``load_gbps``
  per rank, fixed (CPU-tier hits are always loaded; its time only enters the estimated seconds);
- the prefill model: ``prefill_tokens_per_s`` and ``prefill_half_rate_context`` as the start, then fitted to
  vLLM's steps (``StepMeter``) unless ``prefill_learn`` is false;
- with ``disk_overlap_bytes`` (one KV cache group, ``config.overlap_possible``): ``overlap=True``, a hit's disk
  part read under the forward layer group by layer group (``in_step_disk.py``; ``layers`` =
  ``config.overlap_fill_layers``, the fill of its ``config.overlap_spans``), so the split may load a run's first
  part and recompute the rest; otherwise
- no overlap of load and compute (``overlap=False``): a disk or remote hit is loaded before the request's forward
  runs. With one KV cache group its records go straight to the GPU blocks vLLM allocated, while the request waits
  in ``WAITING_FOR_REMOTE_KVS``; hybrid models promote them to the CPU tier first and load from there. Nothing
  reads a disk record layer by layer under the forward, so the best plan is per tier all or nothing (the split's
  module doc): the CPU part, then the disk part or not, then the remote part or not;
- units of one GPU block (``unit_tokens`` = the scheduler's block size; ``unit_nbytes`` = a block's bytes over
  every rank and group a hit reads): without overlap the plan ends at a run's end anyway, and a tail piece (a few
  blocks after a prompt's whole chunks) then counts its real tokens, not a chunk's.

``StepMeter`` times vLLM's steps and feeds ``PrefillEstimator.observe_step``:

- ``scheduled(step, scheduler_output)`` (``build_connector_meta``): the step's ``(tokens scheduled, tokens
  computed before them)`` per request, when some request computes more than ``DECODE_TOKENS`` (else the step is
  decode only: no list is built);
- ``finished(step, forward)`` (``update_connector_output``): the step's output reached the scheduler. The workers
  echo the step's number in their worker metadata (``TieredKVWorkerMeta.step``) so every step's output calls the
  connector back, and an output is matched to its step even with asynchronous scheduling (outputs one step late)
  or a batch queue. ``forward`` (``TieredKVWorkerMeta.forward``) holds the forwards the workers timed
  (``forward_clock.py``: ``{step: (seconds, loaded)}``, the slowest rank's, usually a step after the step ran).

A step with in-step loads (``scheduled``'s ``in_step``: bytes per tier, CPU copies or slow-tier reads under the
forward, and the seconds the plans priced beyond compute) is also their measurement: ``on_loaded``
(``SplitGate.observe_loaded_step``: a slow tier's overlap cost, or the CPU tier's load floor) gets its forward time
and its price, the model's time for the tokens it computed plus that priced exposure, on vLLM's thread (a pass over
the step's requests).

What a step's time is: the workers' forward time, from ``bind_connector_metadata`` to ``wait_for_save`` on the GPU
(CUDA events; the CPU fallback's clock), once any worker metadata carried a ``forward`` (workers of this version
always do). A step whose forward waited for in-step loads (``loaded``) is timed but not fitted: its time is not a
recompute's. So the fitted ``overhead_s`` is a forward's fixed cost on the GPU; what the engine spends around the
forward (scheduling, sampling, applying outputs) is spent whether a hit loads or recomputes. Before that, or with
workers that send no ``forward``, the scheduler's own clock (``planner.rates.StepTimer``): from when the step was
scheduled, or when the previous step's output was applied if that is later, to when its own output is applied. That
clock runs short when vLLM applies the previous output late (``forward_clock.py`` says how, with the H200 numbers).
``recent`` keeps the last steps' times by both clocks (the benchmarks print them).

The fit (2-4 ms of Python on the CPU box every ``REFIT_EVERY`` prefill steps: far over what vLLM's thread may spend)
and the features of each timed step (a pass over its requests) run on the meter's own daemon thread, started at
the first fit, in slices of ~30-150 us with a short sleep after each (``PAUSE_S``): the thread lets go of the GIL
after every slice, so vLLM's scheduler thread waits for it one slice at most, whether it woke up during a slice
or was busy when the fit thread, after CPython's 5 ms switch interval, took the GIL from it. Most of the fit
runs while vLLM's thread waits for the GPU with the GIL released. vLLM's thread only builds the step's list, appends it to a
queue and reads the last fit (``SplitGate.decide`` calls ``PrefillEstimator.model``, which never fits here:
``fit_on_read=False``). Measured (``benchmarks/probes/split_cost.py``): docs/vllm.md, "Disk or recompute".

Threading contract: ``scheduled``, ``finished`` and ``close`` on vLLM's scheduler thread; ``drain`` on the meter's
thread (or on the caller's, in tests); the estimator takes its own lock.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from tiered_kv.planner.chain import TierChain
from tiered_kv.planner.gate import SplitGate
from tiered_kv.planner.rates import (DECODE_TOKENS, DEFAULT_READ_GBPS, REFIT_EVERY, WINDOW, PrefillEstimator,
                                     PrefillModel, ReadRate, StepTimer)
from tiered_kv.planner.split import MEMORY_TIERS
from tiered_kv.connector.vllm.config import ConnectorConfig, overlap_fill_layers, overlap_possible
from tiered_kv.connector.vllm.geometry import Geometry

log = logging.getLogger(__name__)

#: The fit thread sleeps this long between slices of its work, so a waiting scheduler thread takes the GIL.
PAUSE_S = 50e-6
#: Steps scheduled with no output back carrying a step number before the meter gives up (no worker echoes them:
#: something between the workers and the scheduler drops the worker metadata); the start model stays.
UNANSWERED_STEPS = 1024
#: Scheduled steps kept for the workers' forward times to match (they come back a step or two later)
UNTIMED_STEPS = 256
#: Steps ``StepMeter.recent`` keeps
RECENT = 32


def tier_names(chain: TierChain) -> list[str]:
    """The split's name of each chain tier, by index: ``cpu`` for the first (the CPU tier, a private slab or a host
    pool: always loaded), then the chain's names (``disk``, ``remote``)."""
    return ["cpu"] + [spec.name for spec in chain.specs[1:]]


def split_gate(cfg: ConnectorConfig, geo: Geometry, tiers: Sequence[str]) -> SplitGate:
    """The gate of an engine with these tiers (``tier_names``; see the module)."""
    copies = 1 if geo.replicated else geo.tp_size
    remote_gbps = cfg.remote_read_gbps if cfg.remote_read_gbps is not None else cfg.disk_read_gbps
    overlap = overlap_possible(cfg, len(geo.groups), geo.rank_chunk_nbytes) is None and \
        any(t not in MEMORY_TIERS for t in tiers)
    # a rate nobody set is a guess (``ReadRate.guess``): the tier's measured writes lower it to their rate, its first
    # read replaces it, and with the overlap the first plans load only a chunk from that tier; a user's figure is
    # trusted from the start
    rates = {}
    for name in tiers:
        if name in MEMORY_TIERS:
            rates[name] = ReadRate(cfg.load_gbps * copies, fixed=True)
        else:
            gbps = remote_gbps if name == "remote" else cfg.disk_read_gbps
            rates[name] = ReadRate(gbps, guess=gbps == DEFAULT_READ_GBPS)
    start = PrefillModel.from_rate(cfg.prefill_tokens_per_s, cfg.prefill_half_rate_context)
    estimator = PrefillEstimator(start, fixed=not cfg.prefill_learn, fit_on_read=False)
    unit_nbytes = max(1, geo.hit_nbytes(geo.chunk_tokens) * copies // geo.chunk_blocks)
    layers = len({name for g in geo.groups for name in g.layer_names})
    def exact(tokens: int) -> int:  # hybrid models: full-attention layers for every token, a window only once
        return geo.hit_nbytes(tokens) * copies

    return SplitGate(cfg.disk_load_policy, cfg.disk_probe_every, rates, estimator, overlap=overlap,
                     unit_tokens=geo.block_size, unit_nbytes=unit_nbytes,
                     layers=overlap_fill_layers(layers) if overlap else layers, step_tokens=geo.step_tokens,
                     hit_nbytes=exact if geo.parts else None)


def step_parts(scheduler_output) -> list[tuple[int, int]]:
    """``(tokens scheduled, tokens computed before them)`` of every request of a step in which some request computes
    more than ``DECODE_TOKENS`` tokens; ``[]`` for a decode-only step (no pass over its requests when the total
    says so)."""
    nst = scheduler_output.num_scheduled_tokens
    if not nst or scheduler_output.total_num_scheduled_tokens - (len(nst) - 1) <= DECODE_TOKENS:
        return []  # even if every other request took 1 token, none took more than DECODE_TOKENS
    if max(nst.values()) <= DECODE_TOKENS:
        return []
    parts = [(nst[r.req_id], r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
    cached = scheduler_output.scheduled_cached_reqs
    parts += zip(map(nst.__getitem__, cached.req_ids), cached.num_computed_tokens)
    return parts


class StepMeter:
    """Times vLLM's steps into the split gate's ``PrefillEstimator`` (see the module). ``clock``: monotonic seconds
    (tests pass their own)."""

    def __init__(self, estimator: PrefillEstimator, clock: Callable[[], float] = time.monotonic,
                 on_loaded: Callable[[dict[str, float], float, float], None] | None = None,
                 on_unloaded: Callable[[float, float], None] | None = None) -> None:
        self.estimator = estimator
        self.clock = clock
        self.on_loaded = on_loaded  # ``SplitGate.observe_loaded_step``: steps with in-step loads, timed and priced
        self.on_unloaded = on_unloaded  # ``SplitGate.observe_unloaded_step``: prefill steps without, timed and priced
        self.priced_steps = 0  # loaded steps timed whose loads were priced (``scheduled(..., in_step)``)
        self.on = not estimator.fixed
        self.timed = 0  # steps timed (decode-only ones too)
        self.loaded_steps = 0  # steps timed by the workers whose forward waited for in-step loads (not fitted)
        self.fits = 0  # fits the thread made
        self._queued = 0  # prefill steps queued for the fit since the start
        self.worker_clock = False  # the workers time the forwards (a ``forward`` came back): the step timer is not used
        #: the last steps timed: ``(step, tokens computed, scheduler's seconds or None, workers' seconds or None,
        #: loaded)``, for the benchmarks' record of both clocks
        self.recent: deque[tuple[int, int, float | None, float | None, bool]] = deque(maxlen=RECENT)
        self._timer = StepTimer()
        self._parts: dict[int, list[tuple[int, int]]] = {}  # scheduled steps the workers have not timed yet
        self._sched_s: dict[int, float] = {}  # the scheduler clock's time of those steps (``recent``)
        self._in_step: dict[int, tuple[dict[str, float], float]] = {}  # those steps' in-step loads (``scheduled``)
        self._queue: deque[tuple[list[tuple[int, int]], float]] = deque(maxlen=WINDOW)  # timed prefill steps
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._busy = False
        self._closed = False
        self._unanswered = 0  # steps scheduled since an output last came back with a step number

    # ------------------------------------------------------------------ vLLM's scheduler thread
    def scheduled(self, step: int, scheduler_output,
                  in_step: tuple[dict[str, float], float] | None = None) -> None:
        """Step ``step`` was scheduled now (``build_connector_meta``). ``in_step``: the bytes its in-step loads move
        per tier and the seconds their plans priced beyond compute (``LoadPlanner.take_in_step``)."""
        if not self.on:
            return
        self._unanswered += 1
        if self._unanswered > UNANSWERED_STEPS:
            log.warning("TieredKVConnector: %d steps and no output came back with its step number; the prefill "
                        "model stays the configured one (prefill_tokens_per_s, prefill_half_rate_context)",
                        UNANSWERED_STEPS)
            self.on = False
            self._timer = StepTimer()
            self._parts.clear()
            self._sched_s.clear()
            self._in_step.clear()
            return
        parts = step_parts(scheduler_output)
        self._timer.scheduled(step, parts, self.clock())
        self._parts[step] = parts
        if in_step is not None:
            self._in_step[step] = in_step
        if len(self._parts) > UNTIMED_STEPS:  # the workers never timed these (dicts keep insertion order)
            for old in list(self._parts)[:len(self._parts) - UNTIMED_STEPS]:
                del self._parts[old]
                self._sched_s.pop(old, None)
                self._in_step.pop(old, None)

    def finished(self, step: int, forward: dict[int, tuple[float, bool]] | None = None) -> None:
        """Step ``step``'s output reached the scheduler now (``update_connector_output``); ``forward``: the forwards
        the workers timed, ``{step: (seconds, loaded)}`` (None: these workers time none)."""
        if not self.on:
            return
        self._unanswered = 0
        got = self._timer.finished(step, self.clock())
        if forward is not None:
            self.worker_clock = True
        if not self.worker_clock:
            self._parts.pop(step, None)
            self._in_step.pop(step, None)  # the scheduler's clock cannot tell a forward that waited for its loads
            if got is not None:
                self._timed(got[0], got[1], got[1], None, False, step)
            return
        if got is not None and step in self._parts:
            self._sched_s[step] = got[1]
        for s, (seconds, loaded) in sorted((forward or {}).items()):
            parts = self._parts.pop(s, None)
            if parts is not None:  # else unknown, or timed already by another rank's report
                self._timed(parts, seconds, self._sched_s.pop(s, None), seconds, loaded, s)

    def _timed(self, parts: list[tuple[int, int]], seconds: float, sched_s: float | None, fwd_s: float | None,
               loaded: bool, step: int) -> None:
        self.timed += 1
        self.recent.append((step, sum(n for n, _ in parts), sched_s, fwd_s, loaded))
        in_step = self._in_step.pop(step, None)
        if loaded:
            self.loaded_steps += 1
            if in_step is not None and self.on_loaded is not None and parts:
                # its price: the model's compute of its tokens and the exposed time its plans priced (a pass over the
                # step's requests and a dot product, no fit)
                self.priced_steps += 1
                self.on_loaded(in_step[0], seconds, self.estimator.model().step_seconds(parts) + in_step[1])
            return
        if not parts:
            self.estimator.observe_step((), seconds)  # counted as a decode-only step, nothing else
            return
        if self.on_unloaded is not None and self.worker_clock:  # speed now against the model's (a dot product)
            self.on_unloaded(seconds, self.estimator.model().step_seconds(parts))
        self._queue.append((parts, seconds))
        self._queued += 1
        # every REFIT_EVERY steps; and as soon as the estimator can make its first estimate (the start model scaled)
        # and its first fit (a few long prompts, as a 32k-token benchmark of 6 conversations runs, would otherwise keep
        # the start model all along)
        first = self._queued in (self.estimator.scale_samples, self.estimator.min_samples)
        if (len(self._queue) >= REFIT_EVERY or first) and not self._closed:
            self._wake_thread()

    def close(self) -> None:
        """Stop the fit thread (the connector's shutdown)."""
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    # ------------------------------------------------------------------ the fit thread
    def _wake_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tiered_kv-prefill-fit", daemon=True)
            self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            if self._closed:
                return
            self._busy = True  # before the event clears: ``idle`` never sees neither
            self._wake.clear()
            try:
                self.drain()
            except Exception:  # noqa: BLE001 - a fit must never take the engine down; the last model stays
                log.exception("TieredKVConnector: the prefill fit failed; the split keeps the last model")

    def drain(self, pause: Callable[[], None] | None = None) -> None:
        """Fold the timed steps into the estimator and refit when due (the fit thread; tests call it directly with
        no ``pause``)."""
        pause = pause if pause is not None else (lambda: time.sleep(PAUSE_S))
        self._busy = True
        try:
            while self._queue:
                parts, seconds = self._queue.popleft()
                self.estimator.observe_step(parts, seconds)
                pause()
            if self.estimator.refit(pause):
                self.fits += 1
        finally:
            self._busy = False

    def idle(self) -> bool:
        """The fit thread has nothing to do (fewer than ``REFIT_EVERY`` timed steps may wait in its queue, once it
        fitted) and is not fitting (tests)."""
        return not self._wake.is_set() and not self._busy


def split_stats(gate: SplitGate) -> dict:
    """The split's estimates and counters for ``SchedulerPlanner.stats``: read rates per slow tier and their sources
    (``<tier>_gbps_source``: guess, writes, reads or set), the prefill rate
    of a 2048-token chunk at context 0 and its source and samples, held tokens loaded and recomputed per tier, and
    the summed estimated seconds of the plans taken, of recomputing and of loading every held token
    (``split_est_<plan>_s``: what the decisions weighed, so a benchmark can tell a near call from a clear one), and
    each slow tier's measured overlap cost (``<tier>_overlap_s_per_gb``: seconds a GB read under the forward adds)
    and the CPU tier's load floor (``cpu_load_floor_s``) with the engine's recent speed against the prefill model
    (``cpu_recompute_scale``, which the floor's decision prices recompute at)."""
    rep = gate.report()["split"]
    out: dict = {f"{t}_gbps_estimate": float(f"{g:.4g}") for t, g in rep["read_gbps"].items() if t not in MEMORY_TIERS}
    out.update({f"{t}_gbps_source": src for t, src in rep["read_source"].items() if t not in MEMORY_TIERS})
    prefill = rep["prefill"]
    out.update({"prefill_tokens_per_s": round(prefill["tokens_per_s"][0]), "prefill_source": prefill["source"],
                "prefill_samples": prefill["samples"]})
    for tier, t in rep["tokens"].items():
        out[f"split_{tier}_loaded_tokens"] = t["loaded"]
        out[f"split_{tier}_recomputed_tokens"] = t["recomputed"]
    for plan, seconds in rep["estimated_seconds"].items():
        out[f"split_est_{plan}_s"] = round(seconds, 6)
    for tier, c in rep["overlap_cost"].items():
        out[f"{tier}_overlap_s_per_gb"] = round(c["s_per_gb"], 6)
    out["cpu_load_floor_s"] = round(rep["load_floor"]["seconds"], 6)
    out["cpu_recompute_scale"] = round(rep["load_floor"]["recompute_scale"], 4)
    return out
