"""Run ``../shared/tools/sched_overhead.py`` with its step clock switched to the calling thread's CPU time.

The tool times ``schedule()`` + ``update_from_output()`` with ``time.perf_counter``; on a busy shared box
wall time also counts the moments other processes held the CPU, which moved single runs by 4x here
(2026-11-23). ``time.thread_time`` counts only the scheduler thread's own CPU: the connector's work on
that thread, without other processes, and without the connector's background threads (the remote
tier's presence feed runs on one of those). Usage, as the tool's stand-in::

    SCHED_OVERHEAD_TOOL=benchmarks/probes/sched_thread_cpu.py benchmarks/sched_overhead_runs.sh 5

Threading contract: a command-line wrapper; the tool runs on the main thread.
"""
from __future__ import annotations

import os
import runpy
import sys
import time

TOOL = os.environ.get("TKV_SCHED_TOOL", "")
for candidate in (TOOL, "../shared/tools/sched_overhead.py", "/work/shared/tools/sched_overhead.py"):
    if candidate and os.path.exists(candidate):
        TOOL = candidate
        break

if __name__ == "__main__":
    time.perf_counter = time.thread_time  # the tool reads time.perf_counter at each call
    sys.argv = [TOOL, *sys.argv[1:]]
    runpy.run_path(TOOL, run_name="__main__")
