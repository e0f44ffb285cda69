"""Run the scheduler step-cost tool with the box's speed measured beside every step, on the tool's own clock.

The scheduler step-cost sets (``benchmarks/sched_overhead_runs.sh``) compare modes run one after the other on a
shared 2-core VM whose speed drifts: on 2026-11-29 no connector's own step (scheduler thread CPU time) swung
1,262-2,527 us between runs, against 1,050-1,070 on 2026-11-23, and a profile of two runs showed the tool's
prompt generation (pure ``random`` calls, no connector involved) 1.8x slower in one run than in the other, the
same factor as its steps. CPU time does not remove that: a core shared with a neighbour's hyperthread, or a
throttled one, does less per second of CPU time. A calibration before and after each run did not help either:
the box's speed changed within a run (one run's two calibrations: 2,261 and 1,330 us).

So this wrapper runs a fixed piece of pure-Python work (``calibration``: attribute and dict traffic and small
hashes, the kind of work a scheduler step does, allocating nothing the collector tracks) right before every
``Scheduler.schedule`` call, and hides its time from the tool: the tool's ``time.perf_counter`` becomes the clock
it had (``thread_clock.py`` may have made it CPU time) minus the calibration time so far. At the end it prints
``CALIB {"calib_us": <median us of one calibration round>, "calib_rounds": <steps>}``, and
``sched_overhead_runs.sh`` with ``SCHED_CALIB=1`` puts it on the run's line: ``sched_overhead_json.py`` then
also compares the modes over the runs at the set's best box speed (its "quiet" runs).

Usage: ``python benchmarks/probes/box_speed.py SCRIPT [ARGS...]`` (after ``thread_clock.py`` when both are used).
Threading contract: a script; the calibration runs on the thread that calls ``Scheduler.schedule``.
"""
from __future__ import annotations

import hashlib
import json
import runpy
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

#: iterations of one calibration round (~0.3 ms on the 2-core CPU box, a fifth of a step)
ITERATIONS = 1000


class _Item:
    __slots__ = ("key", "tokens", "blocks")

    def __init__(self, key: int) -> None:
        self.key = key
        self.tokens = key * 3
        self.blocks = 0


_TABLE = {i: _Item(i) for i in range(512)}  # built once: a round allocates nothing the collector tracks


def calibration(iterations: int = ITERATIONS) -> int:
    """A fixed piece of interpreter work; returns a checksum so nothing is skipped."""
    table, total = _TABLE, 0
    for item in table.values():  # the same start every round
        item.blocks = 0
    for i in range(iterations):
        item = table[i & 511]
        item.blocks = (item.blocks + i) & 0xFFFF
        total += item.tokens + item.blocks
        if not i & 7:
            total += hashlib.sha256(i.to_bytes(8, "little")).digest()[0]
    return total


@contextmanager
def beside_each(cls: type, method: str = "schedule") -> Iterator[list[float]]:
    """Within the block, every ``cls.method`` call first runs one ``calibration`` round whose time
    ``time.perf_counter`` no longer counts; yields the list the rounds' microseconds are appended to. Restores both
    on exit."""
    base = time.perf_counter
    hidden = [0.0]
    samples: list[float] = []
    real = getattr(cls, method)

    def patched(self, *args, **kwargs):
        t0 = base()
        calibration()
        dt = base() - t0
        hidden[0] += dt
        samples.append(dt * 1e6)
        return real(self, *args, **kwargs)

    setattr(cls, method, patched)
    time.perf_counter = lambda: base() - hidden[0]
    try:
        yield samples
    finally:
        setattr(cls, method, real)
        time.perf_counter = base


def main(argv: list[str]) -> None:
    """Run ``argv[0]`` as ``__main__`` with ``argv`` as its arguments, a calibration round beside each of vLLM's
    ``Scheduler.schedule`` calls; print CALIB."""
    if not argv:
        raise SystemExit("usage: box_speed.py SCRIPT [ARGS...]")
    from vllm.v1.core.sched.scheduler import Scheduler

    sys.argv = argv
    with beside_each(Scheduler) as samples:
        try:
            runpy.run_path(argv[0], run_name="__main__")
        finally:
            if samples:
                print("CALIB " + json.dumps({"calib_us": round(statistics.median(samples), 1),
                                             "calib_rounds": len(samples)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
