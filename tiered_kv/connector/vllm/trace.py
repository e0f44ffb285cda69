"""Per-step load trace of a vLLM worker rank (``trace_path``): what each step loaded and how long it took.

Off by default. With ``trace_path: /some/file`` each worker rank appends JSON lines to
``/some/file.rank<r>.jsonl``: one line per step that loaded, saw loads land, scheduled at least
``PREFILL_LINE_TOKENS`` tokens (below) or carries GPU forward times of earlier lined steps (``fwd``); other steps,
e.g. most decode steps, write nothing. A line has

- ``step`` (the scheduler's step number), ``t`` (wall clock, seconds since the epoch, at the step's
  ``get_finished``), ``t_begin`` (wall clock when the rank took the step: its first hook; null on the second line of
  a step), ``in_step`` / ``async`` (loads started this step and their bytes on this rank;
  ``in_step.staged``: how many of its merged copies, one per KV cache group, went through the staging buffer;
  ``in_step.sm``: how many through the SM kernel;
  ``in_step.descriptors``: the runs those copies took on the copy engine, or the staged DMAs and scatters, or the
  SM kernel's runs: a step's 1 GiB of 64 KiB layer-blocks is 16,384 where no two blocks are adjacent on both
  sides, fewer where vLLM's blocks for a chunk lie in a row); ``in_step.staging_allocs``: staging buffers the
  rank's in-step loads allocated in the step (its first staged load, and each growth: a device allocation inside
  the step; round 25 saw a process's first in-step load hold ``start_load_kv`` 20.8 ms against 1.7-4.2 later,
  round 26 one start's early c32 step 14.1 ms against 1.3-2.9),
  ``start_load_ms`` (how long ``start_load_kv`` held vLLM's thread submitting them), ``front_jobs`` (jobs queued
  or running on the front mover when it began: mostly the previous step's stores, released at
  ``bind_connector_metadata``, whose Python competes with vLLM's thread for the GIL), ``fence_ms``
  (of that, waiting for fenced copies), ``forward_submit_ms`` (``load_submit: pipelined``: how long
  ``wait_for_layer_load`` held it submitting later layer groups, between the forward's layers),
  ``async_in_flight`` (asynchronous loads not landed yet);
- ``landed``: the loads whose timings resolved since the previous line, each ``{"job", "kind"
  ("in_step" | "async"), "step" (when submitted), "bytes", "gpu_ms", "host_ms"}``. ``gpu_ms`` comes
  from CUDA timing events read back without blocking, one or more steps later (in-step: from the
  engine stream's submission point to the last byte; async: the load's own copy time on its
  stream); ``host_ms``: from submission to the ``get_finished`` that reported it. On CPU tensors
  both are wall times.

Every step that schedules at least ``PREFILL_LINE_TOKENS`` tokens writes a line too, loads or not, so a step that
loaded can be set beside one that recomputed (the c1 question of 2026-11-29: is a loading step's time the copy, or
what the host spends launching the forward?):

- ``tokens``: what vLLM scheduled in the step (``StepPlan.tokens``; null where unknown);
- ``launch_ms``: host time from ``bind_connector_metadata`` to ``wait_for_save`` less what ``start_load_kv`` held,
  i.e. vLLM's thread launching the forward, our per-layer hooks included, whether vLLM calls ``start_load_kv`` before
  the forward (0.26) or after its launch in steps without in-step loads (0.32, 0.33). A forward whose kernels the GPU
  runs faster than the host launches them (eager prefill) takes about this long whatever it computes;
- ``fwd``: ``{step: ms}``, the GPU time of earlier lined steps' forwards from ``bind_connector_metadata`` to
  ``wait_for_save`` (``forward_clock.py``, with ``prefill_learn``), known a step or more later: a GPU time near
  ``launch_ms`` says the GPU waited for the host.

The scheduler writes its side beside it (``<trace_path>.sched.jsonl``, ``sched_trace.py``): when each of these steps
was scheduled and when its output was applied.

Cheap when on: a few ``perf_counter`` calls and event queries per step, one line write (line-buffered, so
a server stopped by a signal keeps every line written).

Threading contract: vLLM's worker thread only (the model runner), like ``WorkerRuntime``.
"""
from __future__ import annotations

import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    job: int
    kind: str
    step: int
    nbytes: int
    submitted: float  # perf_counter
    marks: tuple | None  # (start, end) CUDA timing events, or None (CPU: wall time at ``landed``)
    host_ms: float | None = None  # set when the load was reported (in-step: in its own step)
    cpu_ms: float | None = None  # CPU tensors: the copy's own wall time


#: a step that schedules at least this many tokens writes a line even without loads (decode steps do not)
PREFILL_LINE_TOKENS = 128
#: GPU forward times kept for lined steps not written yet, at most (older ones are dropped)
FWD_KEEP = 256


@dataclass
class _Step:
    step: int = -1
    tokens: int | None = None  # what vLLM scheduled (StepPlan.tokens)
    t_begin: float = 0.0  # wall clock when the rank took the step (``begin``)
    t_bound: float = 0.0  # perf_counter at ``bind_connector_metadata`` (0: not bound yet)
    launch_ms: float | None = None  # the binding to wait_for_save, less start_load_kv's hold
    in_step: list[int] = field(default_factory=lambda: [0, 0])  # loads, bytes
    staged: int = 0  # in-step merged copies (one per KV cache group) that went staged
    sm: int = 0  # ... and through the SM kernel
    descriptors: int = 0  # what those copies took (``CopyResult.num_runs``)
    staging_allocs: int = 0  # staging buffers allocated in the step (``staging``)
    async_: list[int] = field(default_factory=lambda: [0, 0])
    start_load_ms: float = 0.0
    front_jobs: int = 0  # front-mover jobs queued or running when start_load_kv began (``held``)
    fence_ms: float = 0.0
    forward_submit_ms: float = 0.0


class LoadTrace:
    """One rank's trace file and the loads whose timings have not resolved yet."""

    def __init__(self, path: str, rank: int) -> None:
        """Open ``<path>.rank<rank>.jsonl`` for appending (created if missing)."""
        self.path = f"{path}.rank{rank}.jsonl"
        # line-buffered: a server stopped by a signal keeps every line written; closed in close()
        self._f = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        self._step = _Step()
        self._pending: list[_Pending] = []
        self._landed: list[dict] = []
        self._lined: deque[int] = deque(maxlen=FWD_KEEP)  # steps written, whose GPU forward time is wanted
        self._fwd: dict[int, float] = {}  # their GPU forward times not written yet
        self._allocs_seen = 0  # the in-step copiers' staging allocations at the last ``staging``
        log.info("TieredKVConnector rank %d: load trace in %s", rank, self.path)

    def begin(self, step: int, tokens: int | None = None) -> None:
        """A new step's plan reached the worker (``handle_preemptions`` or ``bind_connector_metadata``, whichever
        came first); ``tokens``: what vLLM scheduled in it."""
        if self._step.step != step:
            self._step = _Step(step, tokens, time.time())

    def bound(self) -> None:
        """``bind_connector_metadata``: the forward's clock starts here (the first call of the step counts)."""
        if not self._step.t_bound:
            self._step.t_bound = time.perf_counter()

    def held(self, start_load_ms: float, fence_ms: float, front_jobs: int = 0) -> None:
        """``start_load_kv`` of this step held vLLM's thread this long (of which ``fence_ms`` in fences); the front
        mover had ``front_jobs`` jobs queued or running when it began."""
        self._step.start_load_ms += start_load_ms
        self._step.fence_ms += fence_ms
        self._step.front_jobs = max(self._step.front_jobs, front_jobs)

    def launched(self) -> None:
        """``wait_for_save``: the forward of this step has been launched (the first call of the step counts)."""
        st = self._step
        if st.launch_ms is None and st.t_bound:
            st.launch_ms = max(0.0, (time.perf_counter() - st.t_bound) * 1e3 - st.start_load_ms)

    def forwards(self, timed: dict[int, tuple[float, bool]] | None) -> None:
        """GPU forward times (``ForwardClock.take``: ``{step: (seconds, loaded)}``); those of lined steps are
        written with the next line."""
        if not timed:
            return
        for step, (seconds, _) in timed.items():
            if step in self._lined:
                self._fwd[step] = round(seconds * 1e3, 3)

    def held_in_forward(self, ms: float) -> None:
        """``wait_for_layer_load`` of this step held vLLM's thread this long submitting layer groups."""
        self._step.forward_submit_ms += ms

    def copies(self, staged: int, sm: int) -> None:
        """This step's in-step loads went as ``staged`` staged merged copies and ``sm`` through the SM kernel
        (``in_step_copy`` staged or sm_kernel, or auto's choice)."""
        self._step.staged += staged
        self._step.sm += sm

    def descriptors(self, n: int) -> None:
        """This step's in-step copies took ``n`` descriptors (runs, staged DMAs and scatters, or kernel runs)."""
        self._step.descriptors += n

    def staging(self, total: int) -> None:
        """The in-step copiers have allocated ``total`` staging buffers so far (``BlockCopier.staging_allocations``,
        summed): what came since the last call counts to this step."""
        self._step.staging_allocs += max(0, total - self._allocs_seen)
        self._allocs_seen = total

    def started(self, kind: str, job: int, nbytes: int, marks: tuple | None = None) -> None:
        """A load of ``kind`` ("in_step" | "async") started in this step; ``marks``: its timing events, if any."""
        counts = self._step.in_step if kind == "in_step" else self._step.async_
        counts[0] += 1
        counts[1] += nbytes
        self._pending.append(_Pending(job, kind, self._step.step, nbytes, time.perf_counter(), marks))

    def reported(self, job: int, marks: tuple | None = None, cpu_ms: float | None = None) -> None:
        """Load ``job`` was reported to vLLM (``get_finished``); ``marks`` if known only now, ``cpu_ms`` on CPU."""
        now = time.perf_counter()
        for p in self._pending:
            if p.job == job and p.host_ms is None:
                p.host_ms = (now - p.submitted) * 1e3
                if marks is not None:
                    p.marks = marks
                p.cpu_ms = cpu_ms
                return

    def flush(self, async_in_flight: int) -> None:
        """End of the step (``get_finished``): resolve what timings can be read without waiting; write the line."""
        keep = []
        for p in self._pending:
            if p.host_ms is None:
                keep.append(p)
                continue
            if p.marks is not None:
                start, end = p.marks
                if not end.query():  # not landed on the GPU yet (the host saw it done: rare); next step
                    keep.append(p)
                    continue
                try:
                    gpu_ms = start.elapsed_time(end)
                except RuntimeError:  # an end never recorded (the load failed to start): host time only
                    gpu_ms = p.host_ms
            else:
                gpu_ms = p.cpu_ms if p.cpu_ms is not None else p.host_ms
            self._landed.append({"job": p.job, "kind": p.kind, "step": p.step, "bytes": p.nbytes,
                                 "gpu_ms": round(gpu_ms, 3), "host_ms": round(p.host_ms, 3)})
        self._pending = keep
        st = self._step
        prefill = st.tokens is not None and st.tokens >= PREFILL_LINE_TOKENS
        lined = bool(st.in_step[0] or st.async_[0] or prefill)  # a step whose GPU forward time is wanted
        if not (lined or self._landed or self._fwd):
            return
        line = {"step": st.step, "t": round(time.time(), 4), "t_begin": round(st.t_begin, 4) or None,
                "tokens": st.tokens,
                "launch_ms": round(st.launch_ms, 3) if st.launch_ms is not None else None,
                "in_step": {"loads": st.in_step[0], "bytes": st.in_step[1], "staged": st.staged,
                            "sm": st.sm, "descriptors": st.descriptors, "staging_allocs": st.staging_allocs},
                "async": {"loads": st.async_[0], "bytes": st.async_[1]},
                "start_load_ms": round(st.start_load_ms, 3), "front_jobs": st.front_jobs,
                "fence_ms": round(st.fence_ms, 3),
                "forward_submit_ms": round(st.forward_submit_ms, 3),
                "async_in_flight": async_in_flight, "landed": self._landed, "fwd": self._fwd}
        self._f.write(json.dumps(line, separators=(",", ":")) + "\n")
        if lined and st.step not in self._lined:
            self._lined.append(st.step)
        self._landed, self._fwd = [], {}
        self._step = _Step(st.step)  # a second flush of the step writes only what lands after this one

    def close(self) -> None:
        """Write what is left (a last ``flush``: loads landed and forward times not written yet) and close the file."""
        if self._f.closed:
            return
        self.flush(0)
        self._f.flush()
        self._f.close()
