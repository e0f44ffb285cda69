"""The workers' forward clock (``connector/vllm/forward_clock.py``) on the CPU fallback: a step is timed from
``begin`` to ``end`` by the clock, reported once by ``take``, with its ``loaded`` flag; what is not a step is not
timed. The CUDA events path: tests/gpu/test_forward_clock_gpu.py."""
from __future__ import annotations

import pytest
import torch

from tiered_kv.connector.vllm.forward_clock import ForwardClock


def test_cpu_clock_times_begin_to_end_and_reports_each_step_once():
    now = [10.0]
    fc = ForwardClock(torch.device("cpu"), clock=lambda: now[0])
    assert not fc.cuda and fc.take() == {}
    fc.begin(3, loaded=False)
    now[0] += 0.25
    fc.end()
    fc.end()  # a second end (wait_for_save twice) changes nothing
    fc.begin(4, loaded=True)
    now[0] += 0.5
    fc.end()
    assert fc.take() == {3: (0.25, False), 4: (0.5, True)}
    assert fc.take() == {}


def test_no_step_and_no_begin_are_not_timed():
    now = [0.0]
    fc = ForwardClock(None, clock=lambda: now[0])
    fc.begin(-1, loaded=False)  # prefill_learn off upstream: the plan's step is not echoed
    now[0] += 1.0
    fc.end()
    fc.end()  # an end with no begin (a step without a bound plan)
    assert fc.take() == {}
    fc.begin(1, loaded=False)
    fc.begin(2, loaded=False)  # a begin that replaces one not ended: only the last counts
    now[0] += 0.1
    fc.end()
    assert fc.take() == {2: (pytest.approx(0.1), False)}
