"""In-step loads of the vLLM worker: CPU-tier hits copied inside the step that reads them.

``InStepLoader`` belongs to a ``WorkerRuntime`` (``worker.py``), which keeps the job bookkeeping
(job events, GPU block lists, counters, reports to the planner) and hands this class only the
copy of each in-step load (``StepPlan.sync``):

- ``start`` (from ``before_forward``: vLLM's ``start_load_kv``) submits the load on vLLM's own
  thread, ordered after the work already on the engine's current stream (vLLM's block zeroing),
  in layer groups with one CUDA event each. Where vLLM runs attention eagerly and
  ``load_mode`` is "layerwise", each layer's group is kept for ``wait_layer``; otherwise (a full
  CUDA graph may replay, no per-layer calls) the engine's stream waits for the whole load now.
- ``wait_layer`` (vLLM's ``wait_for_layer_load``) makes the engine's stream wait, on the GPU,
  for that layer's group: no host wait, so layer 0 computes while later layers still cross PCIe.
- ``finish`` (from ``poll``: vLLM's ``get_finished`` of the same step) waits for the bytes and
  returns each load's ``Completion``, so a failed load reaches vLLM in the step that read it.

Why on vLLM's thread, and why few groups: docs/vllm.md, "In-step loads". Everything here runs
before the forward is launched or between its layers, so it does no work a step does not need.

Threading contract: every method runs on vLLM's worker thread (the model runner). The class
holds no lock and never touches the movers; its copier is its own (``threaded_submit=False``),
separate from the copiers the front mover thread drives.
"""
from __future__ import annotations

import logging
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
    marks: tuple | None = None  # debug log only: CUDA timing events (submission point, landed)


class InStepLoader:
    """One TP rank's in-step loads: submit by layer group, per-layer GPU waits, completion in the same step.

    ``loads`` (loads started and not finished) and ``layer_waits`` (layer index -> copy results
    that layer's forward waits for) are empty between steps; the runtime reads them to skip a
    call when there is nothing to do.
    """

    def __init__(self, kv: KVLayout, slab_rows: torch.Tensor, layer_names: Sequence[str], cfg: ConnectorConfig,
                 rank: int) -> None:
        """Bind vLLM's KV tensors (``kv``, tensor i = layer i) and the CPU slab viewed as block rows."""
        self.kv = kv
        self.rank = rank
        self._cuda = kv.device.type == "cuda"
        # In-step loads plan and submit on vLLM's own thread, before the forward is launched: from
        # a submitter thread they fought vLLM's eager forward for the GIL and the H200 load took
        # 31-64 ms instead of ~21 (turn-2 TTFT 0.043-0.048 s against 0.034-0.039 s).
        self.copier = BlockCopier(kv, slab_rows, threaded_submit=False)
        self._layerwise = cfg.load_mode == "layerwise"
        self._groups_wanted = cfg.load_groups
        # ``in_step_copy``: the SM kernel where asked for and on CUDA, else what the movers use
        self._forced = Mechanism.SM_KERNEL if self._cuda and cfg.in_step_copy == "sm_kernel" else None
        self._layer_index = {n: i for i, n in enumerate(layer_names)}
        # debug log only: the stream that marks when an in-step load landed
        self._timing_stream = torch.cuda.Stream(kv.device) if self._cuda and log.isEnabledFor(logging.DEBUG) else None
        self.loads: list[_InStepLoad] = []
        self.layer_waits: dict[int, list[CopyResult]] = {}

    def start(self, job: TransferJob, gpu: list[int], slots: list[int], layerwise_ok: bool,
              mechanism: Mechanism | None) -> int:
        """Start one in-step load of block rows ``slots`` into GPU blocks ``gpu``: layer groups in order.

        ``layerwise_ok``: vLLM will call ``wait_layer`` for every attention layer of this step's
        forward. ``mechanism``: what the movers use now (None: the copier chooses), unless
        ``in_step_copy`` forces the SM kernel. Returns the number of groups submitted; 0 when
        nothing was (no blocks, or the load could not start: ``finish`` then reports it failed).
        """
        kv = self.kv
        load = _InStepLoad(job, [], len(gpu) * kv.block_nbytes, time.perf_counter())
        self.loads.append(load)
        if not gpu:
            return 0
        cuda = self._cuda
        layerwise = layerwise_ok and self._layerwise
        stream = torch.cuda.current_stream(kv.device) if cuda else None
        # one group when the forward waits for the whole load: block-major runs, merged across layers
        groups = (layer_groups(kv, load.nbytes, self._groups_wanted)
                  if layerwise and cuda else [(0, len(kv.tensors))])
        if self._timing_stream is not None:
            load.marks = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            load.marks[0].record(stream)
        if self._forced is not None:
            mechanism = self._forced
        copier = self.copier
        try:
            load.results = copier.cpu_to_gpu_grouped(slots, gpu, groups, stream=stream, mechanism=mechanism)
        except _START_ERRORS as exc:
            # once more as one whole copy (the forward then waits for all of it): a load that cannot
            # start at all is reported failed in this step's poll and vLLM recomputes its blocks
            log.warning("TieredKVConnector rank %d: layer-by-layer load of job %d failed to start (%s); "
                        "retrying as one copy", self.rank, job.job_id, exc)
            try:
                load.results = [copier.cpu_to_gpu(slots, gpu, stream=stream, mechanism=mechanism)]
            except _START_ERRORS as exc2:
                load.error = exc2
                log.warning("TieredKVConnector rank %d: in-step load of job %d failed: %s", self.rank,
                            job.job_id, exc2)
                return 0
            groups = [(0, len(kv.tensors))]
        if log.isEnabledFor(logging.DEBUG):
            log.debug("rank %d job %d in-step load started: %d blocks in %d groups, layerwise=%s, call %.2f ms",
                      self.rank, job.job_id, len(gpu), len(groups), layerwise,
                      (time.perf_counter() - load.started) * 1e3)
        if not cuda:
            return len(groups)  # the CPU copy is done already
        if load.marks is not None:
            _stream_waits(load.results[-1:], self._timing_stream)
            load.marks[1].record(self._timing_stream)
        if layerwise and len(groups) > 1:
            bounds = [b for _, b in groups]
            waits = self.layer_waits
            g = 0
            for layer in range(len(kv.tensors)):
                while layer >= bounds[g]:
                    g += 1
                waits.setdefault(layer, []).append(load.results[g])
        else:
            _wait_all(load, stream)
        return len(groups)

    def wait_layer(self, layer_name: str) -> None:
        """``wait_for_layer_load``: the engine's stream waits (on the GPU) for this layer's in-step loads."""
        layer = self._layer_index.get(layer_name, -1)
        waits = self.layer_waits.pop(layer, None)
        if not waits:
            return
        t0 = time.perf_counter()
        _stream_waits(waits, torch.cuda.current_stream(self.kv.device))
        if log.isEnabledFor(logging.DEBUG) and (layer == 0 or not self.layer_waits):
            log.debug("rank %d layer %d: forward waits for its in-step load (host waited %.2f ms for submission)",
                      self.rank, layer, (time.perf_counter() - t0) * 1e3)

    def finish(self) -> list[tuple[TransferJob, Completion]]:
        """Wait for the loads started this step to land; return each one's job and ``Completion``.

        The forward already waits for these bytes on the GPU, so waiting here costs the host at
        most the rest of the forward; it lets a failure reach vLLM in the step that read the blocks.
        """
        loads, self.loads = self.loads, []
        forward_done = None
        if any(load.marks is not None for load in loads):
            forward_done = torch.cuda.Event(enable_timing=True)
            forward_done.record(torch.cuda.current_stream(self.kv.device))
        if self.layer_waits:  # a layer vLLM never waited for (not one of ours): order later work anyway
            stream = torch.cuda.current_stream(self.kv.device)
            for waits in self.layer_waits.values():
                _stream_waits(waits, stream)
            self.layer_waits.clear()
        out = []
        for load in loads:
            if load.error is None and load.results:
                try:
                    load.results[-1].wait()
                except CopyLaunchError as exc:
                    load.error = exc
            job, n = load.job, len(load.job)
            secs = time.perf_counter() - load.started
            if load.error is not None:
                log.warning("TieredKVConnector rank %d: in-step load of job %d failed: %s", self.rank, job.job_id,
                            load.error)
                done = Completion(job.job_id, [False] * n, [False] * n, 0, secs)
            else:
                done = Completion(job.job_id, [True] * n, [False] * n, load.nbytes, secs)
                log.debug("rank %d job %d in-step load: %d blocks in %d groups, host saw it done %.1f ms after "
                          "the call", self.rank, job.job_id, load.nbytes // self.kv.block_nbytes,
                          len(load.results), secs * 1e3)
                if load.marks is not None and forward_done is not None:
                    forward_done.synchronize()
                    landed = load.marks[0].elapsed_time(load.marks[1])
                    log.debug("rank %d job %d on the GPU: landed %.2f ms after the submission point (%.1f GB/s), "
                              "step's forward done at %.2f ms", self.rank, job.job_id, landed,
                              load.nbytes / landed / 1e6, load.marks[0].elapsed_time(forward_done))
            out.append((job, done))
        return out


def _wait_all(load: _InStepLoad, stream) -> None:
    """Make ``stream`` wait for every group of ``load`` (groups land in order: the last one suffices)."""
    try:
        load.results[-1].wait_on(stream)
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
