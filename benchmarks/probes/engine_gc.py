"""Run the scheduler-overhead tool with the garbage collector in the state a real vLLM engine leaves it.

vLLM's ``EngineCore`` builds its ``Scheduler`` (and so the connector) and then calls
``vllm.utils.gc_utils.freeze_gc_heap()``: a full collection, then ``gc.freeze()``, so the start-up heap is
never scanned again and the generation counters start from zero. ``../shared/tools/sched_overhead.py``
builds the ``Scheduler`` directly and skips that, so which young-generation collections land inside its
~95 measured steps (~0.13 s; a generation-1 collection costs ~6-9 ms on this workload) depends on how
many objects each mode happened to allocate while starting: a phase, not a per-step cost. This probe
calls vLLM's own ``freeze_gc_heap()`` right after ``Scheduler.__init__``, as the engine does, so every
mode starts its steps from the same collector state. A control next to the tool's plain numbers, not a
replacement for them.

Usage: ``python benchmarks/probes/engine_gc.py TOOL MODE`` (``SCHED_GC=engine`` in
``benchmarks/sched_overhead_runs.sh``). Threading contract: a script; patches ``Scheduler.__init__``.
"""
from __future__ import annotations

import runpy
import sys

if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: engine_gc.py SCRIPT [ARGS...]")
    from vllm.utils.gc_utils import freeze_gc_heap
    from vllm.v1.core.sched.scheduler import Scheduler

    _init = Scheduler.__init__

    def init(self, *args, **kwargs) -> None:
        """``Scheduler.__init__``, then what ``EngineCore.__init__`` does after building it."""
        _init(self, *args, **kwargs)
        freeze_gc_heap()

    Scheduler.__init__ = init
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
