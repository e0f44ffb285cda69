"""``benchmarks/probes/box_speed.py``: a calibration round beside each scheduler step, hidden from the tool's clock."""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "probes"))

import box_speed  # noqa: E402


class _Sched:
    calls = 0

    def schedule(self, n: int = 1) -> int:
        type(self).calls += n
        return n


def test_each_call_gets_a_round_the_tool_does_not_count():
    real_clock, real_method = time.perf_counter, _Sched.schedule
    s = _Sched()
    with box_speed.beside_each(_Sched) as samples:
        seen = []
        for _ in range(5):
            t0 = time.perf_counter()
            assert s.schedule(2) == 2  # the real method still runs, with its arguments
            seen.append((time.perf_counter() - t0) * 1e6)
    assert len(samples) == 5 and _Sched.calls == 10
    # what the caller timed excludes the calibration: the method itself is far cheaper than one round
    assert sum(seen) < sum(samples) / 2, (seen, samples)
    assert time.perf_counter is real_clock and _Sched.schedule is real_method  # restored


def test_the_calibration_is_fixed_work():
    assert box_speed.calibration(64) == box_speed.calibration(64)
    assert box_speed.calibration(64) != box_speed.calibration(128)
