"""Run a timing script with ``time.perf_counter`` replaced by the calling thread's CPU time.

``benchmarks/sched_overhead_runs.sh`` with ``SCHED_CLOCK=thread`` runs the scheduler-overhead tool
through this: the tool times ``schedule()`` + ``update_from_output()`` on the main thread, and on
a CPU box shared with other jobs wall time also counts the time the thread waited for a core
(2026-11-23: ``none`` 1,400-4,100 us/step wall in one set, 1,300-1,470 us/step CPU). CPU time
still includes the garbage collector and cache misses, which are the connector's real costs.

Usage: ``python benchmarks/probes/thread_clock.py SCRIPT [ARGS...]``.
Threading contract: a script; replaces the clock for the whole process (every thread then reads
its own CPU time).
"""
from __future__ import annotations

import runpy
import sys
import time

if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: thread_clock.py SCRIPT [ARGS...]")
    time.perf_counter = time.thread_time
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
