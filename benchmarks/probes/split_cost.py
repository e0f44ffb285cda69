"""What the split and the learned prefill model cost vLLM's scheduler thread (issue 32), on this machine (CPU only).

Times, with ``time.perf_counter`` (medians of many calls; p99 where a tail matters):

- ``step``: ``StepMeter.scheduled`` + ``finished`` per step (``build_connector_meta`` and ``update_connector_output``
  add them), for decode-only steps and for steps with one 512-token prefill chunk, with 8, 64 and 256 requests: the
  scheduler thread's CPU time per step, and the p99 of their wall time with the fit thread at work as in an engine
  (woken every ``REFIT_EVERY`` prefill steps);
- ``lookup``: ``SplitGate.decide`` for a hit of 32 chunks (256 tokens each) all in the CPU tier and for 8 CPU + 24
  disk chunks, the runs built as ``LookupPlanner._worth_loading`` builds them, against the old ``LoadGate.decide``;
- ``fit``: one fit of 128 samples inline (what it would cost vLLM's thread), the fit thread's slices, and what a
  busy main thread (work items of ~20 us back to back, i.e. never waiting for the GPU) sees while the thread fits
  without pause: its longest item against the same loop with no fit running.

Usage: ``PYTHONPATH=. .venv/bin/python benchmarks/probes/split_cost.py`` (imports the vLLM test harness for its
stand-in step outputs; prints a table; with ``$OUT`` set also writes ``split_cost.json`` there). Threading
contract: a script; the main thread plus the meter's fit thread.
"""
from __future__ import annotations

import json
import os
import random
import statistics
import threading
import time
from itertools import groupby
from pathlib import Path

from tests.connector.vllm.harness import step_output
from tiered_kv.connector.vllm.prefill import PAUSE_S, StepMeter
from tiered_kv.planner.gate import LoadGate, SplitGate
from tiered_kv.planner.rates import PrefillEstimator, PrefillModel, ReadRate, _fit, features

START = PrefillModel.from_rate(30000, 32768)
TRUTH = PrefillModel(0.004, 1 / 40000, 1 / 40000 / 20000, 2e-9)
CHUNK, BLOCK, KV = 256, 16, 128 << 10  # Llama-3-8B: 128 KiB a token


def _us(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e6, 2)


def _p99(xs: list[float]) -> float:
    return round(sorted(xs)[int(len(xs) * 0.99)] * 1e6, 1)


def _output(batch: int, prefill: bool, rng: random.Random):
    cached = [(f"d{i}", 1, rng.randrange(100, 8000)) for i in range(batch - (1 if prefill else 0))]
    new = [("p", 512, rng.randrange(0, 8192, 512))] if prefill else []
    return step_output(new, cached)


def step_rows(steps: int = 2000) -> list[dict]:
    """Per step: the scheduler thread's CPU time (a tight loop, ``time.thread_time``: what the hooks cost it) and the
    wall time of the two calls with a 0.2 ms "forward" between steps, during which the fit thread works."""
    rows = []
    rng = random.Random(0)
    for batch in (8, 64, 256):
        for prefill in (False, True):
            outs = [_output(batch, prefill, rng) for _ in range(16)]
            meter = StepMeter(PrefillEstimator(START, fit_on_read=False))
            cpu0 = time.thread_time()
            for step in range(1, 5 * steps + 1):
                meter.scheduled(step, outs[step % 16])
                meter.finished(step)
            cpu = (time.thread_time() - cpu0) / (5 * steps)
            secs = []
            for step in range(5 * steps + 1, 6 * steps + 1):
                out = outs[step % 16]
                t0 = time.perf_counter()
                meter.scheduled(step, out)
                meter.finished(step)
                secs.append(time.perf_counter() - t0)
                time.sleep(0.0002)  # the step itself: the fit thread runs here, as it would during a forward
            meter.close()
            rows.append({"what": f"step: {'1 prefill + ' if prefill else ''}{batch - prefill} decodes",
                         "median_us": round(cpu * 1e6, 2), "p99_us": _p99(secs),
                         "note": f"CPU time; p99 wall with the fit thread ({meter.fits} fits)"})
    return rows


def lookup_rows(n: int = 3000) -> list[dict]:
    est = PrefillEstimator(START, fixed=True)
    gate = SplitGate("auto", 32, {"cpu": ReadRate(25.0), "disk": ReadRate(3.0)}, est, overlap=False,
                     unit_tokens=BLOCK, unit_nbytes=BLOCK * KV)
    old = LoadGate("auto", 3.0, 32, 30000, CHUNK, CHUNK * KV)
    names = ["cpu", "disk"]
    rows = []
    for label, where in (("32 CPU chunks", [0] * 32), ("8 CPU + 24 disk chunks", [0] * 8 + [1] * 24)):
        secs = []
        for _ in range(n):
            t0 = time.perf_counter()
            runs = [[names[t], len(list(g)) * CHUNK] for t, g in groupby(where)]
            gate.decide(runs, 100, 0, count=False)
            secs.append(time.perf_counter() - t0)
        n_cpu = where.count(0)
        olds = []
        for _ in range(n):
            t0 = time.perf_counter()
            next((i for i, t in enumerate(where) if t != 0), len(where))
            old.decide(n_cpu, len(where))
            olds.append(time.perf_counter() - t0)
        rows.append({"what": f"lookup: {label}", "median_us": _us(secs), "p99_us": _p99(secs),
                     "note": f"LoadGate before: {_us(olds)} us"})
    return rows


def _samples(rng: random.Random, n: int = 128) -> list:
    out = []
    for _ in range(n):
        parts = [(rng.choice([512, 1024, 2048, 4096]), rng.randrange(0, 24576, 64))]
        parts += [(1, rng.randrange(100, 8000)) for _ in range(rng.randrange(0, 32))]
        out.append((features(parts), TRUTH.step_seconds(parts) * rng.lognormvariate(0, 0.05)))
    return out


def _busy_loop(seconds: float) -> list[float]:
    items = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        sum(range(400))  # ~20 us of Python
        items.append(time.perf_counter() - t0)
    return items


def fit_rows() -> list[dict]:
    rng = random.Random(1)
    samples = _samples(rng)
    inline = []
    for _ in range(20):
        t0 = time.perf_counter()
        _fit(samples, START, 32.0)
        inline.append(time.perf_counter() - t0)
    gaps, last = [], [0.0]

    def timed_pause() -> None:
        now = time.perf_counter()
        gaps.append(now - last[0])
        time.sleep(PAUSE_S)
        last[0] = time.perf_counter()

    for _ in range(10):
        last[0] = time.perf_counter()
        _fit(samples, START, 32.0, timed_pause)
    base = _busy_loop(1.0)
    stop = threading.Event()

    def fitter() -> None:
        while not stop.is_set():
            _fit(samples, START, 32.0, lambda: time.sleep(PAUSE_S))

    thread = threading.Thread(target=fitter, daemon=True)
    thread.start()
    busy = _busy_loop(2.0)
    stop.set()
    thread.join()
    return [
        {"what": "fit: 128 samples, inline", "median_us": _us(inline), "p99_us": round(max(inline) * 1e6, 1),
         "note": "every 8 prefill steps, if it ran on vLLM's thread"},
        {"what": "fit: the thread's slices", "median_us": _us(gaps), "p99_us": _p99(gaps),
         "note": f"max {max(gaps) * 1e6:.0f} us; {PAUSE_S * 1e6:.0f} us sleep after each"},
        {"what": "busy main thread, 20 us items, fit thread fitting non-stop", "median_us": _us(busy),
         "p99_us": _p99(busy), "note": f"longest {max(busy) * 1e3:.2f} ms (no fit: {max(base) * 1e3:.2f} ms, "
                                       f"p99 {_p99(base)} us)"},
    ]


def main() -> None:
    rows = step_rows() + lookup_rows() + fit_rows()
    cols = ["what", "median_us", "p99_us", "note"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[k]) for k in cols) + " |")
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "split_cost.json").write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(),
            "command": "PYTHONPATH=. .venv/bin/python benchmarks/probes/split_cost.py", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
