"""In-step loads of the vLLM worker: CPU-tier hits copied inside the step that reads them.

``InStepLoader`` belongs to a ``WorkerRuntime`` (``worker.py``), which keeps the job bookkeeping
(job events, GPU block lists, counters, reports to the planner) and hands this class only the
copy of each in-step load (``StepPlan.sync``):

- ``start`` (from ``before_forward``: vLLM's ``start_load_kv``) takes one load; ``submit``, once
  per step after the step's last ``start``, merges the step's loads into one copy per KV cache
  group (every load's blocks, layer group by layer group) and submits it on vLLM's own thread,
  ordered after the work already on the engine's current stream (vLLM's block zeroing). Merged,
  the first layer group of *every* load lands first: per load, a step of 30 loads had layer 0
  wait behind 29 loads' later layers. Where vLLM runs attention eagerly and ``load_mode`` is
  "layerwise" (or "adaptive"), each layer group is kept for ``wait_layer``; otherwise (a full
  CUDA graph may replay, no per-layer calls) the engine's stream waits for the whole load now.
- ``load_submit`` "pipelined" (default): a copy of at most ``load_ahead_bytes`` goes whole before
  the forward, as with "upfront". A larger one is cut into finer layer groups; ``submit`` hands
  the driver the leading groups that fit in ``load_ahead_bytes``, and ``wait_layer`` the rest:
  at every layer, the next groups while the bytes submitted and not landed stay within
  ``load_ahead_bytes``, and at the latest at the first layer that reads a group. Submitting costs
  vLLM's thread about 1 us per descriptor (H200, vLLM 0.26: a 4.7 GB step of 64 KiB runs held it
  68 ms, bytes / 69 GB/s), so a large load submitted whole before the forward delays the launch of
  every layer (and every decode in the batch) by about its PCIe time; pipelined, the first layers
  compute while later groups are still being submitted and crossing PCIe. "upfront": every group
  before the forward. A step that also starts asynchronous loads (``adaptive``) submits upfront:
  those are ordered after the in-step copies, which must exist by then.
- ``in_step_copy`` "auto" (default) picks the mechanism per KV cache group and step (``auto_copy``):
  the staged load where the copy engine is descriptor-bound (small layer-blocks, or a step of very
  many), the SM kernel for a copy of many descriptors in a step with few tokens (``small_step``), the
  staged load for a copy of ``in_step_staged_min_descriptors`` or more, the copier's choice otherwise.
- ``wait_layer`` (vLLM's ``wait_for_layer_load``) submits what is due (above), then makes the
  engine's stream wait, on the GPU, for that layer's group (no host wait for the bytes).
- ``finish`` (from ``poll``: vLLM's ``get_finished`` of the same step) submits any group vLLM
  never asked for, waits for the bytes and returns each load's ``Completion``, so a failed load
  reaches vLLM in the step that read it. A merged copy that fails fails every load in it.

Why on vLLM's thread, and why few groups: docs/vllm.md, "In-step loads". Everything here runs
before the forward is launched or between its layers, so it does no work a step does not need.
On CPU tensors every copy is synchronous, at the same points (what CI checks of the schedule).

Disk and remote hits read under the forward (``disk_overlap_bytes``): ``start(job, None)`` hands them to
``disk``, the rank's ``in_step_disk.InStepDiskLoader``, which runs a second loader of this class over its staging
slab (``pipeline``: layerwise and pipelined, nothing submitted ahead) whose ``span_ready`` hook waits for a layer
group's bytes to come off the disk before submitting its copy; ``submit``, ``wait_layer`` and ``finish`` drive it
along with the CPU-tier loads.

Hybrid models: one ``KVLayout``, CPU plane and copier per KV cache group; a load submits each
group's part (in the model order of the groups' first layers), and each attention layer waits
for its own group's copy. With several groups vLLM takes no per-block load errors, so a group
whose copy cannot start even as one copy is copied with plain torch ops on the engine's stream
(``plain_fallback``) instead of being reported.

Threading contract: every method runs on vLLM's worker thread (the model runner). The class
holds no lock and never touches the movers; its copier is its own (``threaded_submit=False``),
separate from the copiers the front mover thread drives.
"""
from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tiered_kv.copy import BackendUnavailableError, BlockCopier, CopyLaunchError, CopyResult, KVLayout, Mechanism
from tiered_kv.copy.segments import ChunkTable, block_runs
from tiered_kv.values.jobs import Completion, TransferJob
from tiered_kv.connector.vllm.config import ConnectorConfig, layer_spans

log = logging.getLogger(__name__)

#: An in-step load is cut into layer groups of at least this many bytes: each group costs a
#: driver call and an event (~50-100 us of submitter time), so a small load goes in one piece.
MIN_GROUP_BYTES = 32 << 20
#: ``in_step_copy: auto`` stages a KV cache group's in-step copy (``Mechanism.STAGED``: one DMA per run of
#: adjacent CPU slots into a device buffer, then a scatter on the device) where the copy engine is bound by
#: its ~1 us of driver time per descriptor (one per layer and block for vLLM's per-layer tensors): when the
#: group's layer-blocks are at most this many bytes (4-KV-head models: 32 KiB; MLA: 18 KiB) ...
AUTO_STAGED_MAX_CHUNK = 32 << 10
#: ... or when the step's copy of the group needs at least this many descriptors (64 KiB layer-blocks:
#: a 2 GiB step). H200, vLLM 0.26, ``benchmarks/serve_bench.py`` (2026-11-28, docs/benchmarks.md
#: "Staged in-step copies under load"): staged won every phase on the 32 KiB shape (c8 TTFT p50 63.7 against
#: 86.2 ms) and on the 64-layer shape (c8 188 against 219 ms: ~2.4 GB steps), and the 8B shape's c32 waves
#: (4.7 GB steps: 225.7 against 241.6 ms), but lost the 8B shape's c8 (1.2 GB steps: 99.5 against 80.3 ms), uncompiled
#: (compiled it won that cell: ``AUTO_STAGED_STEP_DESCRIPTORS``).
AUTO_STAGED_MIN_DESCRIPTORS = 1 << 15
#: ``in_step_staged_min_descriptors``'s default: a copy of this many descriptors or more that the SM-kernel rule below
#: leaves on the copy engine is staged too (512 MiB of 64 KiB layer-blocks). H200, vLLM 0.26 compiled (``vllm serve``'s
#: default), Llama-3-8B c8, 2026-12-01 (docs/notes/2026-12-01-gpu-round23.md): waves of seven 172 MB loads (1.2 GB,
#: 18,368 descriptors); vLLM's thread 2.0-2.7 ms a load on the copy engine over the phase, 0.7-1.1 staged; the wave's
#: forward 42.8 against 33.6 ms; staged c8 TTFT below the copy engine's in each of three calls; c32 equal. Round 26's
#: traces (docs/notes/2026-12-01-gpu-round26.md) found the steps under the old 16,384: four to six loads (9.2k-15.7k
#: descriptors, 0.6-1.03 GB) held the thread 11.4-26.1 ms on the copy engine (medians per start 14.0-26.1) where a
#: staged seven-load step held it 2.4-9.0 (4.6-6.4); one-load steps (2.3k-2.6k) and two (~5k, usually the SM kernel's:
#: few tokens) stay below it, where staging's scatter made the forward wait longer than the copy engine (round 23: 13.3
#: against 9.9 ms)
AUTO_STAGED_STEP_DESCRIPTORS = 1 << 13
#: ``in_step_copy: auto``: a copy the rules above leave on the copy engine goes through the SM kernel when it needs
#: at least this many descriptors (256 MiB of 64 KiB layer-blocks: ~4 ms of vLLM's thread) and the step schedules
#: at most ``in_step_sm_max_tokens`` tokens, so the forward the kernel shares the SMs with is small. H200, vLLM
#: 0.26, Llama-3-8B turn 2 with a roomy GPU cache (2026-11-29, docs/notes/2026-11-29-gpu-round7.md): the 1 GiB
#: load's 16,384 descriptors held vLLM's thread 15-22 ms and the copy engine moved 36-52 GB/s as the host allowed;
#: the SM kernel held it 6-8 ms at a steady 47-49 GB/s: TTFT 36.4 ms median over 5 starts against 49.4.
AUTO_SM_MIN_DESCRIPTORS = 1 << 12
#: At most this many layer groups by default (``load_groups`` = 0) with ``load_submit: upfront``.
#: The whole load is submitted on vLLM's thread before the forward is launched, so every group's
#: driver calls and event delay the launch; with few new tokens the forward's GPU work after the
#: last group is small anyway. H200, vLLM 0.26 (per-layer KV tensors, 16,384 64 KiB runs per 1 GiB
#: load), turn-2 TTFT of benchmarks/vllm_ttft.py: 0.0343 / 0.0335 / 0.0649 / 0.0387 s with
#: 1 / 2 / 8 / 32 groups (the call held vLLM's thread ~10 ms with 2 groups, ~13 ms with 32).
MAX_AUTO_GROUPS = 2
#: ``load_submit: pipelined``, a copy larger than ``load_ahead_bytes``: layer groups of about this
#: fraction of ``load_ahead_bytes`` (automatic count; at most one group per layer), so the bytes in
#: flight can be topped up a group at a time between layers.
PIPELINED_GROUP_FRACTION = 2
#: What a copier call raises when an in-step load cannot start (the load is then retried or failed)
_START_ERRORS = (BackendUnavailableError, CopyLaunchError, ValueError)


@dataclass
class _InStepLoad:
    """An in-step load: its job, its (GPU blocks, plane rows) per KV cache group, the copy results its
    bytes are in (shared with the step's other loads) and when it started."""

    job: TransferJob
    parts: Sequence[tuple[list[int], list[int]]]
    nbytes: int
    started: float
    results: list[CopyResult] = field(default_factory=list)
    error: BaseException | None = None
    marks: tuple | None = None  # debug log or trace: CUDA timing events (submission point, landed)
    open_copies: int = 0  # merged copies with layer groups not submitted yet
    submitted: bool = False


@dataclass
class _StepCopy:
    """One KV cache group's part of a step's in-step loads, merged: every load's blocks, by layer group.

    ``done`` groups of ``spans`` are submitted (their results in ``results``, of which the first
    ``landed`` have landed); ``span_of`` (layer name -> its group) is filled for a pipelined copy only.
    """

    g: int
    rows: list[int]
    gpu: list[int]
    loads: list[_InStepLoad]
    spans: list[tuple[int, int]]
    mechanism: Mechanism | None
    done: int = 0
    span_of: dict[str, int] = field(default_factory=dict)
    sizes: list[int] = field(default_factory=list)  # bytes of each group
    results: list[CopyResult] = field(default_factory=list)  # what was submitted, in order
    landed: int = 0
    checked: tuple | None = None  # (slots, blocks) as the copier checked them at the first submission

    def in_flight(self) -> int:
        """Bytes of submitted groups not landed yet (groups land in order; never blocks)."""
        while self.landed < len(self.results) and self.results[self.landed].done():
            self.landed += 1
        return sum(res.nbytes for res in self.results[self.landed:])


class InStepLoader:
    """One TP rank's in-step loads: merged per step, submitted by layer group, per-layer GPU waits.

    ``loads`` (loads started and not finished), ``layer_waits`` (layer name -> copy results that
    layer's forward waits for) and the pipelined copies still open are empty between steps;
    ``busy`` says whether ``wait_layer`` has anything to do.
    """

    def __init__(self, parts: Sequence[tuple[KVLayout, torch.Tensor, Sequence[str]]], cfg: ConnectorConfig,
                 rank: int, plain_fallback: bool = False, timing: bool = False,
                 pipeline: tuple[int, int] | None = None) -> None:
        """Bind each KV cache group's layout (tensor i = one layer's, in ``layer_names`` order), its CPU
        plane viewed as block rows, and its layer names. ``timing`` (``trace_path``): every load gets timing
        events (``_InStepLoad.marks``) the trace reads back later, without blocking. ``pipeline`` = (layer
        groups, bytes submitted ahead): layerwise and pipelined whatever ``cfg`` says (``in_step_disk``)."""
        self.kvs = [kv for kv, _, _ in parts]
        self.kv = self.kvs[0]
        self.rank = rank
        self._cuda = self.kv.device.type == "cuda"
        # In-step loads plan and submit on vLLM's own thread, before the forward is launched or between
        # its layers: from a submitter thread they fought vLLM's eager forward for the GIL and the H200
        # load took 31-64 ms instead of ~21 (turn-2 TTFT 0.043-0.048 s against 0.034-0.039 s).
        self.copiers = [BlockCopier(kv, rows, threaded_submit=False, staging_bytes=cfg.load_staging_bytes,
                                    staging_buffers=cfg.load_staging_buffers, load_priority=cfg.load_stream_priority,
                                    scatter_kernel=cfg.staged_scatter == "kernel")
                        for kv, rows, _ in parts]
        self.copier = self.copiers[0]
        self._layerwise = cfg.load_mode in ("layerwise", "adaptive")  # adaptive: layerwise within its budget
        self._pipelined = cfg.load_submit == "pipelined"
        self._ahead = cfg.load_ahead_bytes
        self._groups_wanted = cfg.load_groups
        if pipeline is not None:
            self._layerwise = self._pipelined = True
            self._groups_wanted, self._ahead = pipeline
        self._plain_fallback = plain_fallback
        #: called with a span's end (tensor index) before that layer group's copy is submitted, and returns once
        #: its source bytes are in the plane (``in_step_disk``: the disk reads); None: they always are
        self.span_ready: Callable[[int], None] | None = None
        #: the rank's overlapped disk loads (``in_step_disk.InStepDiskLoader``): ``start`` with no parts goes there
        self.disk = None
        self.plain_copies = 0
        # host time spent in ``wait_layer`` submitting later layer groups (pipelined), since last read
        self.forward_submit_ms = 0.0
        # ``in_step_copy``: the SM kernel where asked for and on CUDA, the staged load (CPU too), ``auto``'s
        # choice per group and step (``auto_copy``), else what the movers use
        self._forced = {"sm_kernel": Mechanism.SM_KERNEL if self._cuda else None,
                        "staged": Mechanism.STAGED}.get(cfg.in_step_copy)
        self._auto = cfg.in_step_copy == "auto"
        self._sm_max_tokens = cfg.in_step_sm_max_tokens  # ``auto``'s SM kernel in steps of at most this many tokens
        self._staged_min = cfg.in_step_staged_min_descriptors  # ``auto`` stages copies of at least this many (0: off)
        self._runs = [runs_per_block(kv) for kv in self.kvs]  # ``auto``'s rule, per KV cache group
        self.staged_copies = 0  # merged group copies that went through the staging buffer (forced or ``auto``)
        self.sm_copies = 0  # merged group copies that went through the SM kernel (forced or ``auto``)
        self._finished: list[_InStepLoad] = []  # the loads ``finish`` returned last (``step_descriptors``)
        # tensor i of group g belongs to layer _names[g][i] (a layer with several state tensors repeats)
        self._names = []
        for kv, _, names in parts:
            per_layer = len(kv.tensors) // max(1, len(names))
            self._names.append([n for n in names for _ in range(per_layer)])
        # groups load in the model order of their first layers, so early layers' bytes land first
        self._order = sorted(range(len(parts)), key=lambda g: min((_layer_number(n) for n in parts[g][2]),
                                                                  default=0))
        # debug log only: the stream that marks when an in-step load landed
        self._debug = self._cuda and log.isEnabledFor(logging.DEBUG)
        self._timing_stream = torch.cuda.Stream(self.kv.device) if self._debug or (timing and self._cuda) else None
        self.loads: list[_InStepLoad] = []
        self.layer_waits: dict[str, list[CopyResult]] = {}
        self._open: list[_StepCopy] = []  # pipelined copies with groups not submitted yet
        self._stream = None  # the engine's stream of this step's ``submit`` (CUDA)

    @property
    def busy(self) -> bool:
        """True while ``wait_layer`` has layer waits to enqueue or layer groups to submit."""
        return bool(self.layer_waits or self._open) or (self.disk is not None and self.disk.loader.busy)

    @property
    def pending(self) -> bool:
        """Loads started this step and not finished (``finish`` is due)."""
        return bool(self.loads) or (self.disk is not None and self.disk.busy)

    def every_copier(self) -> list[BlockCopier]:
        """This loader's copiers and its overlapped disk loader's (what ``copy.warm_copy_paths`` prepares)."""
        return [*self.copiers, *(self.disk.loader.copiers if self.disk is not None else ())]

    def start(self, job: TransferJob, parts: Sequence[tuple[list[int], list[int]]] | None) -> None:
        """Take one in-step load of this step: ``parts[g]`` = (GPU blocks, plane rows) of KV cache group g; None:
        its items are disk records, read under the forward (``disk``).

        Nothing is copied until ``submit``, which merges the step's loads.
        """
        if parts is None:
            if self.disk is not None:
                self.disk.start(job)
                return
            # planned as a read under the forward, but this rank has no such loader (its disk tier did not
            # open): the load fails in this step and vLLM recomputes its blocks
            self.loads.append(_InStepLoad(job, [([], [])] * len(self.kvs), 0, time.perf_counter(),
                                          error=RuntimeError("no in-step disk loader on this rank")))
            return
        nbytes = sum(len(gpu) * kv.block_nbytes for (gpu, _), kv in zip(parts, self.kvs))
        self.loads.append(_InStepLoad(job, parts, nbytes, time.perf_counter()))

    def adopt(self, jobs: list[TransferJob], events: dict, lock) -> list[TransferJob]:
        """The step's other jobs minus those the overlapped disk loads take over (``InStepDiskLoader.adopt``: the
        promotions of the records they read anyway)."""
        return self.disk.adopt(jobs, events, lock) if self.disk is not None and self.disk.busy else jobs

    def submit(self, layerwise_ok: bool, mechanism: Mechanism | None, pipelined: bool = True,
               step_tokens: int | None = None) -> tuple[int, int]:
        """Submit the loads ``start`` took since the last call, merged per KV cache group.

        ``layerwise_ok``: vLLM will call ``wait_layer`` for every attention layer of this step's
        forward. ``mechanism``: what the movers use now (None: the copier chooses), unless
        ``in_step_copy`` forces the SM kernel or the staged load, or (``auto``) ``auto_copy`` stages a
        group's copy or, ``step_tokens`` (the step's scheduled tokens; None: unknown) being at most
        ``in_step_sm_max_tokens``, sends it through the SM kernel. ``pipelined``: False submits every
        layer group now even with ``load_submit: pipelined`` (the caller orders more copies after
        these). Returns (loads started, layer groups planned); a load that could not start is
        counted in neither and ``finish`` reports it failed.
        """
        from_disk = self.disk.submit(layerwise_ok) if self.disk is not None else 0  # its reads start now
        pending = [load for load in self.loads if not load.submitted]
        if not pending:
            return from_disk, 0
        t0 = time.perf_counter()
        for load in pending:
            load.submitted = True
        cuda = self._cuda
        split = layerwise_ok and self._layerwise
        lazy = split and pipelined and self._pipelined
        self._stream = stream = torch.cuda.current_stream(self.kv.device) if cuda else None
        if self._timing_stream is not None:
            for load in pending:
                if load.nbytes:
                    load.marks = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                    load.marks[0].record(stream)
        if self._forced is not None:
            mechanism = self._forced
        # auto: not over the SM kernel the worker fell back to (a staged layer group needs cuda-python too)
        auto = self._auto and mechanism in (None, Mechanism.COPY_ENGINE)
        small = auto and step_tokens is not None and 0 < self._sm_max_tokens and step_tokens <= self._sm_max_tokens
        planned = 0
        for g in self._order:
            members = [load for load in pending if load.parts[g][0]]
            if not members:
                continue
            rows = [r for load in members for r in load.parts[g][1]]
            gpu = [b for load in members for b in load.parts[g][0]]
            kv = self.kvs[g]
            nbytes = len(gpu) * kv.block_nbytes
            ahead = lazy and nbytes > self._ahead
            chosen = auto_copy(kv, len(gpu), self._runs[g], small and self.copiers[g].sm_kernel_available(),
                               staged_min=self._staged_min) if auto else None
            if not split:
                spans = [(0, len(kv.tensors))]
            elif ahead:
                wanted = self._groups_wanted or -(-nbytes * PIPELINED_GROUP_FRACTION // self._ahead)
                spans = layer_groups(kv, nbytes, wanted)
            else:
                spans = layer_groups(kv, nbytes, self._groups_wanted)
            copy = _StepCopy(g, rows, gpu, members, spans, chosen or mechanism)
            for load in members:
                load.open_copies += 1
            planned += len(spans)
            if ahead and len(spans) > 1:
                names = self._names[g]
                for s, (a, b) in enumerate(spans):
                    for name in names[a:b]:
                        copy.span_of.setdefault(name, s)
                copy.sizes = [len(gpu) * sum(m.nbytes for m in kv.maps[a:b]) for a, b in spans]
                self._open.append(copy)
                first = 1
                while first < len(spans) and sum(copy.sizes[:first + 1]) <= self._ahead:
                    first += 1
                self._submit_spans(copy, first)
            else:
                self._submit_spans(copy, len(spans))
        started = sum(1 for load in pending if load.nbytes and load.error is None)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("rank %d: %d in-step loads submitted, %d bytes in %d layer groups (layerwise=%s, pipelined=%s), "
                      "call %.2f ms", self.rank, len(pending), sum(load.nbytes for load in pending), planned, split,
                      lazy, (time.perf_counter() - t0) * 1e3)
        return started + from_disk, (planned if started else 0)

    def _submit_spans(self, copy: _StepCopy, upto: int) -> None:
        """Submit ``copy``'s layer groups ``copy.done .. upto-1``; register their layer waits or make the
        engine's stream wait now; close the copy once its last group is submitted."""
        first = copy.done == 0
        spans = copy.spans[copy.done:upto]
        copy.done = upto
        if self.span_ready is not None and spans:
            self.span_ready(spans[-1][1])
        if any(load.error is None for load in copy.loads):
            results = self._submit(copy, spans, first)
            if results is None:  # a plain copy of every tensor of the group: nothing left to submit
                copy.done = len(copy.spans)
            elif results:
                if first and results[0].mechanism is Mechanism.STAGED:  # not when the copier had no staging memory
                    self.staged_copies += 1
                elif first and results[0].mechanism is Mechanism.SM_KERNEL:
                    self.sm_copies += 1
                copy.results.extend(results)
                for load in copy.loads:
                    load.results.extend(results)
                if len(copy.spans) > 1 and len(results) == len(spans) and self._cuda:
                    names = self._names[copy.g]
                    for (a, b), res in zip(spans, results):
                        for name in names[a:b]:
                            self.layer_waits.setdefault(name, []).append(res)
                elif self._cuda:  # one piece the forward waits for whole (a small load, a retry, no layerwise)
                    _stream_waits(results, torch.cuda.current_stream(self.kv.device))
        if copy.done < len(copy.spans):
            return
        if copy in self._open:
            self._open.remove(copy)
        for load in copy.loads:
            load.open_copies -= 1
            if not load.open_copies and load.marks is not None and load.results:
                _stream_waits(load.results, self._timing_stream)
                load.marks[1].record(self._timing_stream)

    def _submit(self, copy: _StepCopy, spans: list[tuple[int, int]], first: bool) -> list[CopyResult] | None:
        """Submit ``spans`` of ``copy``; once more as one copy if that cannot start; then (several KV cache
        groups) as a plain copy (returns None). Sets ``error`` on the copy's loads when all of it failed.

        ``first``: the copy's first submission, ordered after the engine's stream; later ones (from
        ``wait_layer``) are ordered only after the earlier groups, on the copier's side stream.
        """
        copier = self.copiers[copy.g]
        whole = spans == [(0, len(self.kvs[copy.g].tensors))]
        stream = self._stream
        try:
            if copy.checked is None:  # once per merged copy, however many calls its layer groups take
                copy.checked = copier.load_indices(copy.rows, copy.gpu)
            results = copier.cpu_to_gpu_grouped(*copy.checked, spans, stream=stream, mechanism=copy.mechanism,
                                                ordered=first, checked=True)
            _raise_failed_start(results)
            return results
        except _START_ERRORS as exc:
            # once more as one copy (the forward then waits for all of it); a load that cannot start at
            # all is reported failed in this step's poll and vLLM recomputes its blocks
            log.warning("TieredKVConnector rank %d: in-step load of %d blocks (jobs %s) failed to start (%s); "
                        "retrying as one copy", self.rank, len(copy.gpu), _job_ids(copy), exc)
        try:
            if first and (whole or copy.done == len(copy.spans)):
                results = [copier.cpu_to_gpu(copy.rows, copy.gpu, stream=stream, mechanism=copy.mechanism)]
            else:  # part of a pipelined copy: these tensors only, the copier's choice of mechanism
                results = copier.cpu_to_gpu_grouped(copy.rows, copy.gpu, [(spans[0][0], spans[-1][1])],
                                                    stream=stream, ordered=first)
            _raise_failed_start(results)
            return results
        except _START_ERRORS as exc2:
            if not self._plain_fallback:
                for load in copy.loads:
                    load.error = exc2
                log.warning("TieredKVConnector rank %d: in-step load of jobs %s failed: %s", self.rank, _job_ids(copy),
                            exc2)
                return []
            log.warning("TieredKVConnector rank %d: in-step load of jobs %s could not start (%s); copying group %d "
                        "with plain torch ops", self.rank, _job_ids(copy), exc2, copy.g)
        copier.copy_plain(copy.gpu, copy.rows, to_cpu=False)  # on the engine's current stream: before what reads it
        self.plain_copies += 1
        return None

    def wait_layer(self, layer_name: str) -> None:
        """``wait_for_layer_load``: (pipelined) hand the driver this layer's group if it is not yet, and
        more groups while the bytes in flight allow; then the engine's stream waits (on the GPU) for this
        layer's in-step loads."""
        if self._open:
            t0 = time.perf_counter()
            for copy in self._open[:]:
                s = copy.span_of.get(layer_name)
                upto = s + 1 if s is not None and s >= copy.done else copy.done
                in_flight = copy.in_flight() + sum(copy.sizes[copy.done:upto])
                while upto < len(copy.spans) and in_flight + copy.sizes[upto] <= self._ahead:
                    in_flight += copy.sizes[upto]
                    upto += 1
                if upto > copy.done:
                    self._submit_spans(copy, upto)
            self.forward_submit_ms += (time.perf_counter() - t0) * 1e3
        waits = self.layer_waits.pop(layer_name, None)
        if waits:
            _stream_waits(waits, torch.cuda.current_stream(self.kv.device))
        if self.disk is not None:
            self.disk.wait_layer(layer_name)

    @property
    def step_descriptors(self) -> int:
        """Descriptors (1-D runs, 2-D copies, kernel runs) the copies of the loads ``finish`` returned last took (a
        copy the step's loads share counts once): a step's 1 GiB of 64 KiB layer-blocks is 16,384 when no two blocks
        are adjacent on both sides. Counted when asked (the load trace), not in every step."""
        return sum(res.num_runs for res in {id(r): r for load in self._finished for r in load.results}.values())

    def take_forward_submit_ms(self) -> float:
        """Host ms ``wait_layer`` spent submitting layer groups since the last call (the trace's per-step figure)."""
        ms, self.forward_submit_ms = self.forward_submit_ms, 0.0
        return ms

    def finish(self) -> list[tuple[TransferJob, Completion]]:
        """Wait for the loads started this step to land; return each one's job and ``Completion``.

        The forward already waits for these bytes on the GPU, so waiting here costs the host at
        most the rest of the forward; it lets a failure reach vLLM in the step that read the blocks.
        Layer groups vLLM never reached through ``wait_layer`` are submitted here first.
        """
        if any(not load.submitted for load in self.loads):  # ``start`` without ``submit``: submit as one piece
            self.submit(False, None)
        for copy in self._open[:]:
            log.warning("TieredKVConnector rank %d: vLLM did not wait for layer groups %d.. of in-step load of jobs "
                        "%s; submitting them after the forward", self.rank, copy.done, _job_ids(copy))
            self._submit_spans(copy, len(copy.spans))
        loads, self.loads = self.loads, []
        self._finished = loads
        forward_done = None
        if self._debug and any(load.marks is not None for load in loads):  # the debug log waits for the forward
            forward_done = torch.cuda.Event(enable_timing=True)
            forward_done.record(torch.cuda.current_stream(self.kv.device))
        if self.layer_waits:  # a layer vLLM never waited for (not one of ours): order later work anyway
            stream = torch.cuda.current_stream(self.kv.device)
            for waits in self.layer_waits.values():
                _stream_waits(waits, stream)
            self.layer_waits.clear()
        out = []
        for load in loads:
            if load.error is None:
                for res in load.results:  # groups of one KV cache group land in order; the groups do not
                    try:
                        res.wait()
                    except CopyLaunchError as exc:
                        load.error = exc
                        break
            job, n = load.job, len(load.job)
            secs = time.perf_counter() - load.started
            if load.error is not None:
                log.warning("TieredKVConnector rank %d: in-step load of job %d failed: %s", self.rank, job.job_id,
                            load.error)
                done = Completion(job.job_id, [False] * n, [False] * n, 0, secs)
            else:
                done = Completion(job.job_id, [True] * n, [False] * n, load.nbytes, secs)
                log.debug("rank %d job %d in-step load: %d bytes in %d groups, host saw it done %.1f ms after "
                          "the call", self.rank, job.job_id, load.nbytes, len(load.results), secs * 1e3)
                if load.marks is not None and forward_done is not None:
                    forward_done.synchronize()
                    landed = load.marks[0].elapsed_time(load.marks[1])
                    log.debug("rank %d job %d on the GPU: landed %.2f ms after the submission point (%.1f GB/s), "
                              "step's forward done at %.2f ms", self.rank, job.job_id, landed,
                              load.nbytes / landed / 1e6, load.marks[0].elapsed_time(forward_done))
            out.append((job, done))
        if self.disk is not None:
            out += self.disk.finish()
        return out


def _job_ids(copy: _StepCopy) -> str:
    """The job ids of a merged copy, for log lines."""
    return ",".join(str(load.job.job_id) for load in copy.loads)


def _layer_number(name: str) -> int:
    """The layer index in a vLLM layer name such as ``model.layers.12.self_attn.attn`` (0 if none)."""
    m = re.search(r"\.(\d+)(?:\.|$)", name)
    return int(m.group(1)) if m else 0


def _raise_failed_start(results: list[CopyResult]) -> None:
    """A copy submitted on the caller's thread has failed already if its driver call did: raise that."""
    for res in results:
        if res.error is not None:
            raise CopyLaunchError(f"copy of {res.num_blocks} blocks failed: {res.error}") from res.error


def _stream_waits(results: list[CopyResult], stream) -> None:
    """Make ``stream`` wait for each copy; a copy that failed to start is skipped here (the load
    carries the same error on its last result, and ``finish`` reports the load as failed)."""
    for res in results:
        try:
            res.wait_on(stream)
        except CopyLaunchError:
            pass


def auto_copy(kv: KVLayout, blocks: int, runs: int | None = None, small_step: bool = False,
              staged_min: int = AUTO_STAGED_STEP_DESCRIPTORS) -> Mechanism | None:
    """``in_step_copy: auto`` for one KV cache group's copy of ``blocks`` blocks, on CUDA: ``Mechanism.STAGED``
    where the copy engine is descriptor-bound (layer-blocks of at most ``AUTO_STAGED_MAX_CHUNK`` bytes, or at
    least ``AUTO_STAGED_MIN_DESCRIPTORS`` of them in this copy); else ``Mechanism.SM_KERNEL`` where
    ``small_step`` (the step schedules few tokens and the SM kernel can run) and the copy takes at least
    ``AUTO_SM_MIN_DESCRIPTORS``; else ``Mechanism.STAGED`` where it takes at least ``staged_min`` (the
    ``in_step_staged_min_descriptors`` key; 0: never by this rule); else None (the copier's choice). On CPU
    tensors always None: there is no descriptor cost to save. ``runs``: ``runs_per_block(kv)`` if the caller
    keeps it. Pure function, like the ones below: any thread."""
    return auto_rule(kv, blocks, runs, small_step, staged_min) if kv.device.type == "cuda" else None


def auto_rule(kv: KVLayout, blocks: int, runs: int | None = None, small_step: bool = False,
              staged_min: int = AUTO_STAGED_STEP_DESCRIPTORS) -> Mechanism | None:
    """``auto_copy``'s choice as it would be on CUDA, whatever the device (what the CPU tests check)."""
    runs = runs_per_block(kv) if runs is None else runs
    if descriptor_bound(kv, blocks, runs):
        return Mechanism.STAGED
    if small_step and blocks * runs >= AUTO_SM_MIN_DESCRIPTORS:
        return Mechanism.SM_KERNEL
    if staged_min and blocks * runs >= staged_min:
        return Mechanism.STAGED
    return None


def descriptor_bound(kv: KVLayout, blocks: int, runs: int | None = None) -> bool:
    """Whether a copy of ``blocks`` blocks of ``kv`` on the copy engine is bound by its per-descriptor cost
    (``auto_copy``'s rule, whatever the device): small runs per block, or very many of them. A block's
    chunks that are adjacent on the device (the layers of a cross-layer KV tensor) count as one run (an
    upper bound on descriptors: the copier may merge runs across blocks too)."""
    runs = runs_per_block(kv) if runs is None else runs
    return kv.block_nbytes <= AUTO_STAGED_MAX_CHUNK * runs or blocks * runs >= AUTO_STAGED_MIN_DESCRIPTORS


def runs_per_block(kv: KVLayout) -> int:
    """Byte runs one block of ``kv`` takes on the copy engine: the count the copier's dispatcher plans
    with (``segments.block_runs``)."""
    return block_runs(ChunkTable.from_layout(kv))


def layer_groups(kv: KVLayout, nbytes: int, wanted: int = 0) -> list[tuple[int, int]]:
    """Consecutive tensor groups for an in-step load of ``nbytes``.

    ``wanted`` (the ``load_groups`` key, or the pipelined count) > 0 fixes the count (at most one
    group per tensor); 0 takes as many as ``MIN_GROUP_BYTES`` allows, at most ``MAX_AUTO_GROUPS``.
    """
    layers = len(kv.tensors)
    count = wanted if wanted > 0 else max(1, min(layers, nbytes // MIN_GROUP_BYTES, MAX_AUTO_GROUPS))
    return layer_spans(layers, count)
