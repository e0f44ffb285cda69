"""Asynchronous CPU-tier loads of the vLLM worker: one batch per step, each reported as soon as it landed.

A request whose CPU hit loads between steps (``load_mode: async``, or ``adaptive`` past its
step's budget) waits in vLLM's ``WAITING_FOR_REMOTE_KVS`` until ``get_finished`` names it. Run
one job at a time on the front mover thread, each such load paid a hand-over between three
threads (mover, copier submitter, mover again), each needing the GIL that vLLM's eager forward
holds in 5 ms slices, and PCIe sat idle between two loads. ``AsyncLoader`` instead:

- ``start`` (from ``before_forward``: vLLM's ``start_load_kv``, on vLLM's thread) validates the
  step's loads and hands all of them to the copier's submitter thread in ONE job
  (``BlockCopier.cpu_to_gpu_many``): they go to the driver back to back on one stream, in plan
  order (= the order vLLM scheduled the requests), after this step's in-step loads (``after``:
  the forward waits for those, so they get PCIe first);
- ``landed`` (from ``poll``: vLLM's ``get_finished``) checks the loads' CUDA events without
  blocking and returns those done, in order: each request is reported in the first step after
  its own bytes landed, not with the whole batch;
- ``wait`` (fences, shutdown) blocks until the named loads landed.

Each ``Completion`` carries the load's time on the GPU (timing events; CPU: the copy's wall
time), which the planner's adaptive budget turns into its H2D rate estimate. One KV cache group
only (vLLM takes per-block load errors there); other models keep the front mover.

Threading contract: every method runs on vLLM's worker thread (the model runner). The copier
is the runtime's threaded one; only its submitter thread touches the loads' results meanwhile.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from tiered_kv.copy import BackendUnavailableError, BlockCopier, CopyLaunchError, CopyResult, Mechanism
from tiered_kv.values.jobs import Completion, TransferJob

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    job: TransferJob
    result: CopyResult
    started: float  # perf_counter at submission
    cpu_secs: float | None = None  # CPU tensors: the copy's share of the batch's wall time (it ran in ``start``)


class AsyncLoader:
    """One TP rank's in-flight asynchronous CPU-tier loads, in submission order."""

    def __init__(self, copier: BlockCopier, mechanism: Mechanism | None = None) -> None:
        """``copier``: the rank's (threaded) copier of its one KV cache group; ``mechanism``: forced
        (``Mechanism.STAGED`` with ``in_step_copy: staged``; ``auto`` stages only in-step copies) or None
        (the copier chooses)."""
        self.copier = copier
        self.mechanism = mechanism
        self._cuda = copier.layout.device.type == "cuda"
        self._order: torch.cuda.Stream | None = None  # where the batch waits for the forward's stream and in-step loads
        self.pending: list[_Pending] = []

    def start(self, jobs: list[tuple[TransferJob, list[int], list[int]]], after: Iterable[CopyResult] = (),
              fallback: Mechanism | None = None) -> None:
        """Submit ``(job, GPU block ids, slab rows)`` loads in this order, after the engine's current stream's
        work and after ``after`` (this step's in-step copies). ``fallback``: the mechanism the movers use now
        (None: the copier chooses), taken unless one is forced; a copy engine that cannot run (no cuda-python)
        makes this loader use the SM kernel from then on, as the movers do."""
        if not jobs:
            return
        stream = None
        if self._cuda:
            if self._order is None:
                self._order = torch.cuda.Stream(device=self.copier.layout.device)
            stream = self._order
            stream.wait_stream(torch.cuda.current_stream(self.copier.layout.device))
            for res in after:
                try:
                    res.wait_on(stream)
                except CopyLaunchError:
                    pass  # that in-step load is reported failed on its own; ours need not wait for it
        now = time.perf_counter()
        loads = [(rows, gpu) for _, gpu, rows in jobs]
        try:
            try:
                results = self.copier.cpu_to_gpu_many(loads, stream=stream, mechanism=self.mechanism or fallback,
                                                      timing=self._cuda)
            except BackendUnavailableError as exc:
                if self.mechanism is not None or fallback is not None or not self._cuda:
                    raise
                log.warning("TieredKVConnector: %s; asynchronous loads use the SM-kernel copy from now on", exc)
                self.mechanism = Mechanism.SM_KERNEL
                results = self.copier.cpu_to_gpu_many(loads, stream=stream, mechanism=self.mechanism,
                                                      timing=self._cuda)
        except Exception as exc:  # noqa: BLE001 - every load of the batch is reported failed in poll
            log.warning("TieredKVConnector: %d asynchronous loads could not start: %s", len(jobs), exc)
            results = []
            for job, gpu, _ in jobs:
                res = CopyResult(Mechanism.CPU, False, len(gpu), 0, 0)
                res._finish(None, exc)
                results.append(res)
        batch = [_Pending(job, res, now) for (job, _, _), res in zip(jobs, results)]
        if not self._cuda:  # the copies ran in the call above
            total = sum(res.nbytes for res in results) or 1
            secs = time.perf_counter() - now
            for p in batch:
                p.cpu_secs = secs * p.result.nbytes / total
        self.pending.extend(batch)

    def landed(self) -> list[tuple[TransferJob, Completion]]:
        """The loads whose bytes have landed (or failed) since the last call, in submission order; never blocks."""
        out, keep = [], []
        for p in self.pending:
            if p.result.done():
                out.append((p.job, self._complete(p)))
            else:
                keep.append(p)
        self.pending = keep
        return out

    def any_landed(self) -> bool:
        """Whether a load in flight has landed (or failed) since the last ``landed``; never blocks."""
        return any(p.result.done() for p in self.pending)

    def wait(self, job_ids: set[int] | None = None) -> list[tuple[TransferJob, Completion]]:
        """Block until the named loads (all: None) landed; return their completions (they leave ``pending``)."""
        out, keep = [], []
        for p in self.pending:
            if job_ids is None or p.job.job_id in job_ids:
                try:
                    p.result.wait()
                except CopyLaunchError:
                    pass  # reported in the completion
                out.append((p.job, self._complete(p)))
            else:
                keep.append(p)
        self.pending = keep
        return out

    def holds(self, job_id: int) -> bool:
        """Whether ``job_id`` is one of the loads in flight here."""
        return any(p.job.job_id == job_id for p in self.pending)

    def _complete(self, p: _Pending) -> Completion:
        job, res, n = p.job, p.result, len(p.job)
        if res.error is not None:
            log.warning("TieredKVConnector: asynchronous load of job %d failed: %s", job.job_id, res.error)
            return Completion(job.job_id, [False] * n, [False] * n, 0, time.perf_counter() - p.started)
        secs = p.cpu_secs if p.cpu_secs is not None else time.perf_counter() - p.started
        if res.start is not None and res.event is not None:
            secs = res.start.elapsed_time(res.event) / 1e3  # its own time on the GPU (both events have fired)
        return Completion(job.job_id, [True] * n, [False] * n, res.nbytes, secs)
