"""Which garbage collections land inside the scheduler steps the scheduler-overhead tool times, and where.

``../shared/tools/sched_overhead.py`` times vLLM's ``Scheduler.schedule()`` + ``update_from_output()``. A
young-generation collection runs whenever enough new container objects have piled up, in whatever code
allocates the next one, so its cost (0.2-2.5 ms on that workload) lands in one step of one mode: a phase of
every allocation before it, not only of the connector's. This probe runs the tool with ``gc.callbacks``
recording each collection: its generation, the calling thread's CPU time it took, the step it fell in (0 and
``null``: outside the timed calls), the connector hook it interrupted (``MODULE:CLASS`` modes only; ``null``:
vLLM's own code), and how many young objects it walked. At exit it prints one ``GC`` line of JSON: those
inside the timed calls, and the count and milliseconds of those outside. The probe's own objects move the
phase by a few steps, so compare modes under the probe with each other, not with the tool's plain runs.

Usage: ``python benchmarks/probes/gc_in_step.py ../shared/tools/sched_overhead.py MODE`` (from the repo root,
``PYTHONPATH=.``; MODE as the tool takes it). Put ``benchmarks/probes/engine_gc.py`` in front for the
collector state vLLM's engine leaves. Threading contract: a script; the wrappers assume the scheduler runs on
one thread, as it does in the tool.
"""
from __future__ import annotations

import atexit
import functools
import gc
import importlib
import json
import runpy
import sys
import time

from benchmarks.probes.hook_clock import HOOKS


def main(argv: list[str]) -> None:
    """Wrap the scheduler and the connector's hooks, record collections, run the tool."""
    if len(argv) < 3:
        raise SystemExit("usage: gc_in_step.py TOOL MODE")
    from vllm.v1.core.sched.scheduler import Scheduler

    state = {"step": 0, "timed": False, "hook": None, "t0": 0.0, "young": 0}
    inside: list[dict] = []
    outside = {"count": 0, "ms": 0.0}

    def timed(fn, first: bool):
        @functools.wraps(fn)
        def run(*a, **kw):
            if first:
                state["step"] += 1
            state["timed"] = True
            try:
                return fn(*a, **kw)
            finally:
                state["timed"] = False
        return run

    Scheduler.schedule = timed(Scheduler.schedule, True)
    Scheduler.update_from_output = timed(Scheduler.update_from_output, False)
    if ":" in argv[2]:
        mod, name = argv[2].split(":")
        cls = getattr(importlib.import_module(mod), name)
        for hook in HOOKS:
            fn = getattr(cls, hook, None)
            if fn is None:
                continue

            @functools.wraps(fn)
            def tagged(*a, __fn=fn, __hook=hook, **kw):
                prev, state["hook"] = state["hook"], __hook
                try:
                    return __fn(*a, **kw)
                finally:
                    state["hook"] = prev

            setattr(cls, hook, tagged)

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            state["young"] = len(gc.get_objects(0)) if state["timed"] else 0
            state["t0"] = time.thread_time()  # after the count: the walk above is the probe's, not the collector's
            return
        ms = (time.thread_time() - state["t0"]) * 1e3
        if state["timed"]:
            inside.append({"generation": info["generation"], "ms": round(ms, 3), "step": state["step"],
                           "hook": state["hook"], "young_objects": state["young"]})
        else:
            outside["count"] += 1
            outside["ms"] += ms

    def report() -> None:
        print("GC " + json.dumps({"mode": argv[2], "steps": state["step"], "inside": inside,
                                  "inside_ms": round(sum(c["ms"] for c in inside), 3),
                                  "outside": {"count": outside["count"], "ms": round(outside["ms"], 3)}}), flush=True)

    gc.callbacks.append(on_gc)
    atexit.register(report)
    sys.argv = argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv)
