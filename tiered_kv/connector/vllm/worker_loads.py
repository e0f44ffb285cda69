"""A worker rank's loads around the forward, and what its stores wait for: ``WorkerRuntime``'s per-step methods.

- ``_start_async`` / ``_finish_async``: asynchronous CPU-tier loads through the ``AsyncLoader`` (one submission
  per step, reported as each lands);
- ``_finish_in_step``: this step's in-step loads (CPU tier, and disk or remote records read under the forward),
  waited for in ``poll``, so a failed one reaches vLLM in the step that read it;
- ``_store_or_hold`` / ``_release_stores``: a step with in-step loads keeps its stores until ``poll`` knows how
  those loads ended. If one failed, the forward computed this step's new KV from wrong bytes for some request
  (vLLM discards that output and recomputes), so none of the step's stores is written: each fails, and the planner
  frees its CPU slots (a cache may drop a store). Otherwise they are submitted then, ordered after the forward on
  the engine's stream like any store.

Threading contract: vLLM's worker thread, like the rest of ``WorkerRuntime`` (the mixin's state is the runtime's).
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from tiered_kv.values.jobs import Completion, JobKind, TransferJob
from tiered_kv.connector.vllm.common import CPU

if TYPE_CHECKING:
    from tiered_kv.connector.vllm.in_step import InStepLoader


def async_load(job: TransferJob) -> bool:
    """A job the ``AsyncLoader`` copies (a CPU-tier load vLLM waits for between steps), not the movers."""
    return job.kind is JobKind.EGRESS and job.src_tier == CPU


class StepLoads:
    """``WorkerRuntime``'s loads around the forward and its held stores (see the module)."""

    def _start_async(self, jobs: list[TransferJob]) -> list[TransferJob]:
        """Hand this step's asynchronous CPU-tier loads to the ``AsyncLoader`` (one batch, in plan order, after the
        in-step loads); returns the other jobs (for the movers)."""
        batch, rest = [], []
        for job in jobs:
            if async_load(job):
                (gpu, rows), = self.runner.load_rows(job)
                batch.append((job, gpu, rows))
                with self._lock:
                    self._events[job.job_id] = threading.Event()
                    self._loading.add(job.job_id)
            else:
                rest.append(job)
        if batch:
            in_step = self.in_step
            after = [load.results[-1] for load in in_step.loads if load.results] if in_step is not None else []
            self.async_loads.start(batch, after=after, fallback=self.runner.mechanism)
            if self.trace is not None:
                for p in self.async_loads.pending[-len(batch):]:
                    self.trace.started("async", p.job.job_id, p.result.nbytes)
            self.counters.async_loads += len(batch)
            self.counters.async_batches += 1
        return rest

    def _finish_async(self, done: list[tuple[TransferJob, Completion]]) -> None:
        """Count and queue the completions of landed asynchronous loads for ``poll``."""
        for job, c in done:
            self.runner.count(job, c.nbytes, c.seconds, c.ok, c.corrupt)
            self._on_done(job, c)
            if self.trace is not None:
                self.trace.reported(job.job_id, cpu_ms=c.seconds * 1e3)  # its GPU time (CPU: the copy's)

    def _finish_in_step(self, in_step: InStepLoader) -> bool:
        """Wait for this step's in-step loads to land; count and queue their completions for ``poll``. Returns
        whether any of them failed (in part): the forward then read wrong KV for some of its requests."""
        finished = in_step.finish()
        submit_ms = in_step.take_forward_submit_ms()
        # vLLM's thread between layers: the CPU-tier groups' submissions, and the overlapped disk loader's (with its
        # waits for the disk's bytes: overlap_wait_seconds is part of this)
        disk_ms = in_step.disk.loader.take_forward_submit_ms() if in_step.disk is not None else 0.0
        self.counters.layer_submit_seconds += (submit_ms + disk_ms) / 1e3
        if self.trace is not None:
            self.trace.held_in_forward(submit_ms)
            self.trace.descriptors(in_step.step_descriptors)
        for job, done in finished:
            self.runner.count(job, done.nbytes, done.seconds, done.ok, done.corrupt)
            self._on_done(job, done)
            if self.trace is not None:  # CUDA: the timing events given at start; CPU: the load's wall time
                self.trace.reported(job.job_id, cpu_ms=None if self._cuda else done.seconds * 1e3)
        return any(job.kind is JobKind.EGRESS and not all(done.ok) for job, done in finished)


    def _store_or_hold(self, stores: list[TransferJob]) -> None:
        """This step's stores: submitted now, or held until ``poll`` knows how its in-step loads ended."""
        if stores and self.in_step is not None and self.in_step.pending:
            self._held_stores = list(stores)
            return
        self._submit(stores)

    def _release_stores(self, loads_failed: bool) -> None:
        """Submit the held stores, or (``loads_failed``) fail each one: nothing computed from wrong KV is kept."""
        held, self._held_stores = self._held_stores, []
        if not held:
            return
        if not loads_failed:
            self._submit(held)
            return
        self.counters.stores_dropped_after_failed_load += len(held)
        for job in held:
            with self._lock:
                self._events[job.job_id] = threading.Event()
            self._on_done(job, Completion(job.job_id, [False] * len(job), [False] * len(job), 0, 0.0))
