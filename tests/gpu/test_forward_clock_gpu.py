"""The workers' forward clock on CUDA (``connector/vllm/forward_clock.py``): timing events on the current stream.

A "forward" is ``torch.cuda._sleep`` of a known number of GPU cycles between ``begin`` and ``end``, launched while
the stream is still busy with a longer sleep before it: the time reported is the forward's own (the GPU stamps
``begin`` when it gets there), not the wait behind the earlier work; ``take`` reports nothing until the GPU is done,
and each step once.
"""
from __future__ import annotations

import time

import torch

from tiered_kv.connector.vllm.forward_clock import ForwardClock


def _cycles_per_s() -> float:
    """GPU cycles per second, measured with the same sleep kernel (clocks vary across GPUs and boost states)."""
    torch.cuda._sleep(1_000_000)  # warm up
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(50_000_000)
    stop.record()
    stop.synchronize()
    return 50_000_000 / (start.elapsed_time(stop) / 1e3)


def test_cuda_clock_times_the_forward_not_the_work_before_it():
    rate = _cycles_per_s()
    fc = ForwardClock(torch.device("cuda", torch.cuda.current_device()))
    assert fc.cuda
    torch.cuda._sleep(int(0.20 * rate))  # the previous step, still on the GPU when this one is launched
    fc.begin(7, loaded=False)
    torch.cuda._sleep(int(0.05 * rate))
    fc.end()
    assert fc.take() == {}  # the GPU is ~0.25 s from done: not read yet, and take() did not wait
    torch.cuda.synchronize()
    got = fc.take()
    assert set(got) == {7} and abs(got[7][0] - 0.05) < 0.01 and got[7][1] is False, got
    assert fc.take() == {}


def test_cuda_clock_reads_finished_steps_in_order_without_waiting():
    rate = _cycles_per_s()
    fc = ForwardClock(torch.device("cuda", torch.cuda.current_device()))
    for step, s in ((1, 0.01), (2, 0.3)):
        fc.begin(step, loaded=step == 2)
        torch.cuda._sleep(int(s * rate))
        fc.end()
    time.sleep(0.1)  # step 1 is done on the GPU, step 2 is not
    t0 = time.perf_counter()
    first = fc.take()
    assert time.perf_counter() - t0 < 0.05 and set(first) == {1}, first
    torch.cuda.synchronize()
    second = fc.take()
    assert set(second) == {2} and second[2][1] is True and abs(second[2][0] - 0.3) < 0.03, second
