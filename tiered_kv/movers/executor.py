"""The job executor: turns one ``TransferJob`` into reads and writes of two tiers, and a ``Completion``.

A job names its two sides by tier index (``EXT`` for the caller's buffer). The executor sees
each side as one of two things, and that, not the tier's class, decides how bytes move:

- *rows*: a 2-D uint8 tensor it may copy to and from directly: a slab tier's ``slab``, or the
  caller's buffer for ``EXT`` (looked up by the job's handle in the registry it was given);
- *keyed*: a tier without a slab (disk today, a remote tier later), reached only through the
  ``Tier`` protocol: ``read_ex`` (which verifies and reports corrupt or missing records),
  ``write`` and ``delete``.

So rows to rows is one batched ``copy_rows``; keyed to rows reads straight into the destination
rows when they are in host memory (staged through host memory when they are on the GPU); rows to
keyed hands the source rows to the tier (gathered to host memory first when on the GPU); keyed to
keyed stages through page-aligned host rows. A new keyed tier needs no change here. Writes go through
``write_ex``, so the keys a governed tier evicted to make room ride back in ``Completion.evicted``.

On a machine with a GPU tier every job runs on a CUDA stream of its own thread, so copies of
different movers overlap, and waits for that stream before it reports.

The executor never chooses what moves and never touches the planner: its ``Completion`` goes to
whoever submitted the job (``TieredStore``'s bookkeeping).

Threading contract: ``execute`` may run on several mover threads at once, for jobs the planner
made disjoint (no two jobs write the same slot or key at once). The buffer registry is owned by
the caller: it adds a handle's rows before submitting that handle's jobs and removes them only
after their completions; the executor only reads it.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping, Sequence

import torch

from tiered_kv.tiers.base import SlabTier, Tier, copy_rows
from tiered_kv.tiers.cpu import aligned_empty
from tiered_kv.values.jobs import EXT, Completion, JobKind, TransferJob

#: Per-item outcome of a read: (ok, corrupt, missing), as ``Tier.read_ex`` returns it.
ReadOutcome = tuple[list[bool], list[bool], list[bool]]


class JobExecutor:
    """Executes transfer jobs between the tiers of one chain and the callers' buffers.

    ``tiers`` is the chain, fastest first (job tier indices index it). ``buffers`` maps a job's
    ``handle`` to the caller's rows (``(n, block_nbytes)`` uint8, CPU or the GPU tier's device)
    for the ``EXT`` side of its jobs.
    """

    def __init__(self, tiers: Sequence[Tier], buffers: Mapping[int, torch.Tensor]) -> None:
        self.tiers = list(tiers)
        self.block_nbytes = self.tiers[0].block_nbytes if self.tiers else 0
        self._buffers = buffers
        # The rows of each tier the executor may copy directly; None marks a keyed tier.
        self._slabs: list[torch.Tensor | None] = [t.slab if isinstance(t, SlabTier) else None for t in self.tiers]
        self.cuda_device: torch.device | None = next((t.device for t in self.tiers if t.device.type == "cuda"), None)
        # One stream per mover thread, made on first use. Keyed by thread id: each thread only
        # touches its own entry, and a dict store is atomic, so no lock is needed.
        self._streams: dict[int, torch.cuda.Stream] = {}

    def execute(self, job: TransferJob) -> Completion:
        """Run ``job`` and return its outcome. I/O errors come back per item; an exception is a bug or a dead medium."""
        n = len(job)
        if job.kind is JobKind.DELETE:
            self.tiers[job.src_tier].delete(job.keys)
            return Completion(job.job_id, [True] * n, [False] * n)
        src_rows, dst_rows = self._rows(job.src_tier, job), self._rows(job.dst_tier, job)
        ok, corrupt, missing = [True] * n, [False] * n, []
        evicted: list[bytes] = []
        stream = self._stream()
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if src_rows is None and dst_rows is None:
                ok, corrupt, missing, evicted = self._keyed_to_keyed(job)
            elif src_rows is None:
                ok, corrupt, missing = self._keyed_to_rows(job, dst_rows)
            elif dst_rows is None:
                ok, evicted = self._rows_to_keyed(job, src_rows)
            else:
                copy_rows(src_rows, job.src_slots, dst_rows, job.dst_slots, non_blocking=stream is not None)
            if stream is not None:
                stream.synchronize()
        return Completion(job.job_id, ok, corrupt, nbytes=sum(ok) * self.block_nbytes, missing=missing,
                          evicted=evicted)

    # ------------------------------------------------------------------ the three keyed cases
    def _keyed_to_rows(self, job: TransferJob, dst_rows: torch.Tensor) -> ReadOutcome:
        src = self.tiers[job.src_tier]
        if dst_rows.device.type == "cpu":  # read straight into the destination rows: no staging copy
            return src.read_ex(job.keys, job.src_slots, [dst_rows[d] for d in job.dst_slots])
        staging = torch.empty((len(job), self.block_nbytes), dtype=torch.uint8)
        ok, corrupt, missing = src.read_ex(job.keys, job.src_slots, staging)
        good = [i for i in range(len(job)) if ok[i]]
        copy_rows(staging, good, dst_rows, [job.dst_slots[i] for i in good])
        return ok, corrupt, missing

    def _rows_to_keyed(self, job: TransferJob, src_rows: torch.Tensor) -> tuple[list[bool], list[bytes]]:
        # Host rows go to the tier as views (no gather copy: a page-aligned row can be written
        # with O_DIRECT as is); GPU rows are gathered to host memory in one copy.
        if src_rows.device.type == "cpu":
            rows = [src_rows[s] for s in job.src_slots]
        else:
            rows = src_rows[torch.as_tensor(job.src_slots, device=src_rows.device)].cpu()
        return self.tiers[job.dst_tier].write_ex(job.keys, job.dst_slots, rows)

    def _keyed_to_keyed(self, job: TransferJob) -> tuple[list[bool], list[bool], list[bool], list[bytes]]:
        # Page-aligned staging rows, so a tier doing O_DIRECT reads and writes them without a bounce copy.
        n = len(job)
        staging = aligned_empty(n, self.block_nbytes)
        ok, corrupt, missing = self.tiers[job.src_tier].read_ex(job.keys, job.src_slots, staging)
        good = [i for i in range(n) if ok[i]]
        written, evicted = ([], []) if not good else self.tiers[job.dst_tier].write_ex(
            [job.keys[i] for i in good], [job.dst_slots[i] for i in good], [staging[i] for i in good])
        ok = [False] * n
        for i, w in zip(good, written):
            ok[i] = w
        return ok, corrupt, missing, evicted

    # ------------------------------------------------------------------ sides and streams
    def _rows(self, tier: int, job: TransferJob) -> torch.Tensor | None:
        if tier == EXT:
            return self._buffers.get(job.handle)
        return self._slabs[tier]

    def _stream(self) -> torch.cuda.Stream | None:
        if self.cuda_device is None:
            return None
        key = threading.get_ident()
        s = self._streams.get(key)
        if s is None:
            s = self._streams[key] = torch.cuda.Stream(device=self.cuda_device)
        return s
