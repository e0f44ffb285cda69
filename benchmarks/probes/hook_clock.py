"""Run the scheduler-overhead tool and report the CPU time of each scheduler-side connector hook per step.

``../shared/tools/sched_overhead.py`` times vLLM's whole ``schedule()`` + ``update_from_output()``; on a
shared box that total moves by more than a connector costs. This probe wraps the connector class's
scheduler hooks (the class named by ``MODULE:CLASS``, as the tool's argument) with the calling thread's
CPU-time clock and prints, after the tool's own ``RESULT`` line, one ``HOOKS`` line: microseconds per
step of each hook (averaged over the steps, i.e. ``build_connector_meta`` calls) and their sum.

Usage: ``python benchmarks/probes/hook_clock.py ../shared/tools/sched_overhead.py MODULE:CLASS``
(from the repo root, with ``PYTHONPATH=.``). Threading contract: a script; the wrappers assume the hooks run
on one thread (vLLM's scheduler thread), as they do in the tool.
"""
from __future__ import annotations

import atexit
import functools
import importlib
import json
import runpy
import sys
import time

HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "request_finished",
         "request_finished_all_groups", "update_connector_output", "take_events", "get_kv_connector_stats")


def wrap(cls: type, spent: dict[str, float], calls: dict[str, int]) -> None:
    """Replace each hook ``cls`` defines (or inherits) with a wrapper adding its thread CPU time to ``spent``."""
    for name in HOOKS:
        fn = getattr(cls, name, None)
        if fn is None:
            continue

        @functools.wraps(fn)
        def timed(*a, __fn=fn, __name=name, **kw):
            t0 = time.thread_time()
            try:
                return __fn(*a, **kw)
            finally:
                spent[__name] = spent.get(__name, 0.0) + time.thread_time() - t0
                calls[__name] = calls.get(__name, 0) + 1

        setattr(cls, name, timed)


if __name__ == "__main__":
    if len(sys.argv) < 3 or ":" not in sys.argv[2]:
        raise SystemExit("usage: hook_clock.py TOOL MODULE:CLASS (the tool's connector argument)")
    mode = sys.argv[2]
    mod, cls_name = mode.split(":")
    spent: dict[str, float] = {}
    calls: dict[str, int] = {}
    wrap(getattr(importlib.import_module(mod), cls_name), spent, calls)

    def report() -> None:
        """Print the per-step hook times (nested calls, e.g. request_finished_all_groups -> request_finished,
        are counted in both: the sum uses the outer ones only)."""
        steps = max(1, calls.get("build_connector_meta", 0))
        per = {k: round(v / steps * 1e6, 1) for k, v in sorted(spent.items())}
        outer = sum(v for k, v in per.items() if k != "request_finished" or "request_finished_all_groups" not in per)
        print("HOOKS " + json.dumps({"mode": mode, "steps": steps, "us_per_step": per,
                                     "sum_us_per_step": round(outer, 1)}), flush=True)

    atexit.register(report)
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
