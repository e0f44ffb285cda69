"""In-step loads of the vLLM worker: CPU-tier hits copied inside the step that reads them.

``InStepLoader`` belongs to a ``WorkerRuntime`` (``worker.py``), which keeps the job bookkeeping
(job events, GPU block lists, counters, reports to the planner) and hands this class only the
copy of each in-step load (``StepPlan.sync``):

- ``start`` (from ``before_forward``: vLLM's ``start_load_kv``) submits the load on vLLM's own
  thread, ordered after the work already on the engine's current stream (vLLM's block zeroing),
  in layer groups with one CUDA event each. Where vLLM runs attention eagerly and ``load_mode``
  is "layerwise" (or "adaptive"), each layer's group is kept for ``wait_layer``; otherwise (a
  full CUDA graph may replay, no per-layer calls) the engine's stream waits for the whole load now.
- ``wait_layer`` (vLLM's ``wait_for_layer_load``) makes the engine's stream wait, on the GPU,
  for that layer's group: no host wait, so layer 0 computes while later layers still cross PCIe.
- ``finish`` (from ``poll``: vLLM's ``get_finished`` of the same step) waits for the bytes and
  returns each load's ``Completion``, so a failed load reaches vLLM in the step that read it.

Why on vLLM's thread, and why few groups: docs/vllm.md, "In-step loads". Everything here runs
before the forward is launched or between its layers, so it does no work a step does not need.

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
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tiered_kv.copy import BackendUnavailableError, BlockCopier, CopyLaunchError, CopyResult, KVLayout, Mechanism
from tiered_kv.values.jobs import Completion, TransferJob
from tiered_kv.connector.vllm.config import ConnectorConfig

log = logging.getLogger(__name__)

#: An in-step load is cut into layer groups of at least this many bytes: each group costs a
#: driver call and an event (~50-100 us of submitter time), so a small load goes in one piece.
MIN_GROUP_BYTES = 32 << 20
#: At most this many layer groups by default (``load_groups`` = 0). The load is submitted on vLLM's
#: thread before the forward is launched, so every group's driver calls and event delay the launch;
#: with few new tokens the forward's GPU work after the last group is small anyway. H200, vLLM 0.26
#: (per-layer KV tensors, 16,384 64 KiB runs per 1 GiB load), turn-2 TTFT of benchmarks/vllm_ttft.py:
#: 0.0343 / 0.0335 / 0.0649 / 0.0387 s with 1 / 2 / 8 / 32 groups (the call held vLLM's thread
#: ~10 ms with 2 groups, ~13 ms with 32). More groups pay off when a step computes many new tokens.
MAX_AUTO_GROUPS = 2
#: What a copier call raises when an in-step load cannot start (the load is then retried or failed)
_START_ERRORS = (BackendUnavailableError, CopyLaunchError, ValueError)


@dataclass
class _InStepLoad:
    """An in-step load: its job, the per-group copy results and when it started."""

    job: TransferJob
    results: list[CopyResult]
    nbytes: int
    started: float
    error: BaseException | None = None
    marks: tuple | None = None  # debug log or trace: CUDA timing events (submission point, landed)


class InStepLoader:
    """One TP rank's in-step loads: submit by layer group, per-layer GPU waits, completion in the same step.

    ``loads`` (loads started and not finished) and ``layer_waits`` (layer name -> copy results
    that layer's forward waits for) are empty between steps; the runtime reads them to skip a
    call when there is nothing to do.
    """

    def __init__(self, parts: Sequence[tuple[KVLayout, torch.Tensor, Sequence[str]]], cfg: ConnectorConfig,
                 rank: int, plain_fallback: bool = False, timing: bool = False) -> None:
        """Bind each KV cache group's layout (tensor i = one layer's, in ``layer_names`` order), its CPU
        plane viewed as block rows, and its layer names. ``timing`` (``trace_path``): every load gets timing
        events (``_InStepLoad.marks``) the trace reads back later, without blocking."""
        self.kvs = [kv for kv, _, _ in parts]
        self.kv = self.kvs[0]
        self.rank = rank
        self._cuda = self.kv.device.type == "cuda"
        # In-step loads plan and submit on vLLM's own thread, before the forward is launched: from
        # a submitter thread they fought vLLM's eager forward for the GIL and the H200 load took
        # 31-64 ms instead of ~21 (turn-2 TTFT 0.043-0.048 s against 0.034-0.039 s).
        self.copiers = [BlockCopier(kv, rows, threaded_submit=False, staging_bytes=cfg.load_staging_bytes)
                        for kv, rows, _ in parts]
        self.copier = self.copiers[0]
        self._layerwise = cfg.load_mode in ("layerwise", "adaptive")  # adaptive: layerwise within its budget
        self._groups_wanted = cfg.load_groups
        self._plain_fallback = plain_fallback
        self.plain_copies = 0
        # ``in_step_copy``: the SM kernel where asked for and on CUDA, the staged load (CPU too), else
        # what the movers use
        self._forced = {"sm_kernel": Mechanism.SM_KERNEL if self._cuda else None,
                        "staged": Mechanism.STAGED}.get(cfg.in_step_copy)
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

    def start(self, job: TransferJob, parts: Sequence[tuple[list[int], list[int]]], layerwise_ok: bool,
              mechanism: Mechanism | None) -> int:
        """Start one in-step load: ``parts[g]`` = (GPU blocks, plane rows) of group g; layer groups in order.

        ``layerwise_ok``: vLLM will call ``wait_layer`` for every attention layer of this step's
        forward. ``mechanism``: what the movers use now (None: the copier chooses), unless
        ``in_step_copy`` forces the SM kernel or the staged load. Returns the number of layer groups submitted; 0 when
        nothing was (no blocks, or the load could not start: ``finish`` then reports it failed).
        """
        load = _InStepLoad(job, [], sum(len(gpu) * kv.block_nbytes for (gpu, _), kv in zip(parts, self.kvs)),
                           time.perf_counter())
        self.loads.append(load)
        if not load.nbytes:
            return 0
        cuda = self._cuda
        layerwise = layerwise_ok and self._layerwise
        stream = torch.cuda.current_stream(self.kv.device) if cuda else None
        if self._timing_stream is not None:
            load.marks = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            load.marks[0].record(stream)
        if self._forced is not None:
            mechanism = self._forced
        submitted = 0
        split = layerwise and cuda
        for g in self._order:
            gpu, rows = parts[g]
            if not gpu:
                continue
            kv, copier = self.kvs[g], self.copiers[g]
            # one group when the forward waits for the whole load: block-major runs, merged across layers
            spans = ([(0, len(kv.tensors))] if not split
                     else layer_groups(kv, len(gpu) * kv.block_nbytes, self._groups_wanted))
            results = self._submit(load, g, rows, gpu, spans, stream, mechanism)
            if load.error is not None:
                return 0
            if results is None:  # copied with plain torch ops on the engine's stream: nothing to wait for
                submitted += 1
                continue
            if len(results) == 1:
                spans = [(0, len(kv.tensors))]
            submitted += len(results)
            load.results.extend(results)
            if split and len(results) > 1:
                names = self._names[g]
                for (a, b), res in zip(spans, results):
                    for name in names[a:b]:
                        self.layer_waits.setdefault(name, []).append(res)
            elif cuda:
                _wait_all_results(load, results, stream)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("rank %d job %d in-step load started: %d bytes in %d groups, layerwise=%s, call %.2f ms",
                      self.rank, job.job_id, load.nbytes, submitted, layerwise,
                      (time.perf_counter() - load.started) * 1e3)
        if cuda and load.marks is not None and load.results:
            _stream_waits(load.results[-1:], self._timing_stream)
            load.marks[1].record(self._timing_stream)
        return submitted

    def _submit(self, load: _InStepLoad, g: int, rows: list[int], gpu: list[int], spans: list[tuple[int, int]],
                stream, mechanism: Mechanism | None) -> list[CopyResult] | None:
        """Submit group g's part in ``spans``; once more as one copy if that cannot start; then (several
        KV cache groups) as a plain copy (returns None). Sets ``load.error`` when all of it failed."""
        copier = self.copiers[g]
        try:
            results = copier.cpu_to_gpu_grouped(rows, gpu, spans, stream=stream, mechanism=mechanism)
            _raise_failed_start(results)
            return results
        except _START_ERRORS as exc:
            # once more as one whole copy (the forward then waits for all of it): a load that cannot
            # start at all is reported failed in this step's poll and vLLM recomputes its blocks
            log.warning("TieredKVConnector rank %d: layer-by-layer load of job %d failed to start (%s); "
                        "retrying as one copy", self.rank, load.job.job_id, exc)
        try:
            results = [copier.cpu_to_gpu(rows, gpu, stream=stream, mechanism=mechanism)]
            _raise_failed_start(results)
            return results
        except _START_ERRORS as exc2:
            if not self._plain_fallback:
                load.error = exc2
                log.warning("TieredKVConnector rank %d: in-step load of job %d failed: %s", self.rank,
                            load.job.job_id, exc2)
                return []
            log.warning("TieredKVConnector rank %d: in-step load of job %d could not start (%s); copying group %d "
                        "with plain torch ops", self.rank, load.job.job_id, exc2, g)
        copier.copy_plain(gpu, rows, to_cpu=False)  # on the engine's current stream: before the forward
        self.plain_copies += 1
        return None

    def wait_layer(self, layer_name: str) -> None:
        """``wait_for_layer_load``: the engine's stream waits (on the GPU) for this layer's in-step loads."""
        waits = self.layer_waits.pop(layer_name, None)
        if not waits:
            return
        t0 = time.perf_counter()
        _stream_waits(waits, torch.cuda.current_stream(self.kv.device))
        if log.isEnabledFor(logging.DEBUG) and not self.layer_waits:
            log.debug("rank %d layer %s: forward waits for its in-step load (host waited %.2f ms for submission)",
                      self.rank, layer_name, (time.perf_counter() - t0) * 1e3)

    def finish(self) -> list[tuple[TransferJob, Completion]]:
        """Wait for the loads started this step to land; return each one's job and ``Completion``.

        The forward already waits for these bytes on the GPU, so waiting here costs the host at
        most the rest of the forward; it lets a failure reach vLLM in the step that read the blocks.
        """
        loads, self.loads = self.loads, []
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
        return out


def _layer_number(name: str) -> int:
    """The layer index in a vLLM layer name such as ``model.layers.12.self_attn.attn`` (0 if none)."""
    m = re.search(r"\.(\d+)(?:\.|$)", name)
    return int(m.group(1)) if m else 0


def _raise_failed_start(results: list[CopyResult]) -> None:
    """A copy submitted on the caller's thread has failed already if its driver call did: raise that."""
    for res in results:
        if res.error is not None:
            raise CopyLaunchError(f"copy of {res.num_blocks} blocks failed: {res.error}") from res.error


def _wait_all_results(load: _InStepLoad, results: list[CopyResult], stream) -> None:
    """Make ``stream`` wait for every group of one KV cache group's copy (they land in order: the last suffices)."""
    try:
        results[-1].wait_on(stream)
    except CopyLaunchError as exc:
        load.error = exc


def _stream_waits(results: list[CopyResult], stream) -> None:
    """Make ``stream`` wait for each copy; a copy that failed to start is skipped here (the load
    carries the same error on its last result, and ``finish`` reports the load as failed)."""
    for res in results:
        try:
            res.wait_on(stream)
        except CopyLaunchError:
            pass


def layer_groups(kv: KVLayout, nbytes: int, wanted: int = 0) -> list[tuple[int, int]]:
    """Consecutive tensor groups for an in-step load of ``nbytes``.

    ``wanted`` (the ``load_groups`` key) > 0 fixes the count (at most one group per tensor);
    0 takes as many as ``MIN_GROUP_BYTES`` allows, at most ``MAX_AUTO_GROUPS``.
    """
    layers = len(kv.tensors)
    if wanted > 0:
        count = min(layers, wanted)
    else:
        count = max(1, min(layers, nbytes // MIN_GROUP_BYTES, MAX_AUTO_GROUPS))
    per = -(-layers // count)
    return [(a, min(layers, a + per)) for a in range(0, layers, per)]
