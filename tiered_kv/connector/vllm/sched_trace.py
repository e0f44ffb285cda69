"""Scheduler side of the per-step trace (``trace_path``): when vLLM scheduled a step and when its output came back.

The workers' trace (``trace.py``) times what a rank does inside a step: ``start_load_kv``, the forward's launch, its
GPU time. vLLM's own per-request figure, prefill time, runs from the ``schedule()`` that took the request to the
``update_from_output()`` that applied its first token, both in the engine core: a connector can lengthen it outside
the forward too (a late worker, a slow hook of ours on the scheduler thread, an output that comes back late). Round 24
(H200, Qwen2.5-7B c8, docs/notes/2026-12-01-gpu-round24.md) saw a loading wave's forward 2.7 ms longer than the same
step without loads (``tiered-resident``'s), and vLLM's prefill time per request 8-19 ms longer than the floor's in
three calls; this file says where the rest goes.

With ``trace_path: /some/file`` the scheduler-role connector appends to ``/some/file.sched.jsonl`` one line per step
that scheduled at least ``trace.PREFILL_LINE_TOKENS`` tokens or planned loads, written when that step's output is
applied (``update_connector_output``; a step whose output never came back is written at shutdown without it):

- ``step``; ``t`` (wall clock, seconds since the epoch, at ``build_connector_meta``: the end of vLLM's
  ``schedule()``); ``t_hook`` (at the start of the first of our hooks in that ``schedule()``: a waiting request's
  ``get_num_new_matched_tokens``, after vLLM scheduled the running requests; null where none ran before the
  build); ``t_applied`` (at ``update_connector_output`` of that step, inside vLLM's ``update_from_output``: just
  before the step's first tokens leave the engine core). vLLM's ``scheduled_ts`` is taken at the start of
  ``schedule()``, a little before ``t_hook``;
- ``tokens`` (scheduled), ``new`` (requests scheduled for the first time), ``loads`` (in-step load jobs in the plan:
  ``StepPlan.sync``), ``async_loads`` (requests whose asynchronous loads the plan starts: ``StepPlan.loads``);
- ``hooks_ms``: our scheduler hooks' time inside that ``schedule()`` (``get_num_new_matched_tokens``,
  ``update_state_after_alloc``, ``build_connector_meta``); ``apply_ms``: ``update_connector_output``'s.

Needs the step number back from the workers, which they send with ``prefill_learn`` (the default); without it the
lines are written only at shutdown (the last ``OPEN_KEEP`` steps, without ``t_applied``). The worker lines carry
``t_begin``, the wall clock at which the rank took the step (its first hook), so a summary can cut ``t_hook`` ..
``t_applied`` into: the rest of ``schedule()``, reaching the worker, the worker's step, and the rest
(``benchmarks/serving/trace_summary.py``).

Threading contract: vLLM's scheduler thread only (the engine core's), like ``SchedulerPlanner``.
"""
from __future__ import annotations

import functools
import json
import logging
import time
from collections import OrderedDict

from tiered_kv.connector.vllm.trace import PREFILL_LINE_TOKENS

log = logging.getLogger(__name__)

#: steps scheduled and not applied yet, kept at most (the oldest go unwritten: outputs that never came back)
OPEN_KEEP = 256


class SchedTrace:
    """The scheduler's trace file and the lined steps whose output has not come back yet."""

    def __init__(self, path: str) -> None:
        """Open ``<path>.sched.jsonl`` for appending (created if missing)."""
        self.path = f"{path}.sched.jsonl"
        # line-buffered: a server stopped by a signal keeps every line written; closed in close()
        self._f = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        self._hook_s = 0.0  # our hooks' seconds since the last build_connector_meta
        self._t_hook: float | None = None  # wall clock at the start of the first of them
        self._open: OrderedDict[int, dict] = OrderedDict()
        log.info("TieredKVConnector: scheduler trace in %s", self.path)

    def hook(self, seconds: float) -> None:
        """One of our scheduler hooks ran this long inside the ``schedule()`` being built (it just returned)."""
        if self._t_hook is None:
            self._t_hook = time.time() - seconds
        self._hook_s += seconds

    def built(self, step: int, scheduler_output, plan, build_s: float) -> None:
        """``build_connector_meta`` of ``step`` returned after ``build_s``: the end of vLLM's ``schedule()``."""
        hooks_ms = (self._hook_s + build_s) * 1e3
        t_hook, self._hook_s, self._t_hook = self._t_hook, 0.0, None
        tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
        loads = len(plan.sync)
        async_loads = len(plan.loads)
        if tokens < PREFILL_LINE_TOKENS and not loads and not async_loads:
            return
        new = len(getattr(scheduler_output, "scheduled_new_reqs", ()) or ())
        self._open[step] = {"step": step, "t": round(time.time(), 4),
                            "t_hook": None if t_hook is None else round(t_hook, 4), "tokens": tokens, "new": new,
                            "loads": loads, "async_loads": async_loads, "hooks_ms": round(hooks_ms, 3)}
        while len(self._open) > OPEN_KEEP:
            self._open.popitem(last=False)

    def applied(self, step: int, apply_s: float) -> None:
        """``update_connector_output`` of ``step`` took ``apply_s``: write its line if it is one."""
        rec = self._open.pop(step, None)
        if rec is None:
            return
        rec["t_applied"] = round(time.time(), 4)
        rec["apply_ms"] = round(apply_s * 1e3, 3)
        self._f.write(json.dumps(rec, separators=(",", ":")) + "\n")

    def close(self) -> None:
        """Write the steps whose output never came back (no ``t_applied``) and close the file. Safe to call twice."""
        if self._f.closed:
            return
        for rec in self._open.values():
            self._f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        self._open.clear()
        self._f.close()


def timed_sched_hook(fn):
    """Add a scheduler hook's time to the scheduler trace when one is on (``self._sched_trace``)."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        trace = self._sched_trace
        if trace is None:
            return fn(self, *args, **kwargs)
        t0 = time.perf_counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            trace.hook(time.perf_counter() - t0)

    return wrapper
