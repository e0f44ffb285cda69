"""Probe: TTFT of a closed-loop burst per ``load_mode``, vLLM's real scheduler on a modelled clock.

CPU only, and a MODEL, not a measurement of a GPU: vLLM's real Scheduler with our connector and
the test harness's CPU "model runner" (``tests/connector/vllm/harness.py``: every block a forward
reads is checked byte for byte) decide what runs in which step, which hits load in-step, which
asynchronously and when each request is reported loaded; a simulated clock prices each step from
the issue-14 H200 figures (Llama-3-8B shape, 128 KiB of KV per token):

- ``start_load_kv`` holds vLLM's thread ``HOLD_MS_PER_GIB`` per GiB of in-step load (per-layer
  tensors) before the forward launches;
- in-step loads cross PCIe at ``PCIE_GBPS`` from the step's start; the forward computes its
  prefill tokens at ``PREFILL_TPS`` plus ``DECODE_MS`` per step and overlaps the loads layer by layer
  (it ends no earlier than the last byte plus one layer's compute); a step with any prefill costs at
  least ``EAGER_PREFILL_MS`` (vLLM replays decode-only steps as a CUDA graph but runs a step with a
  prefill eagerly: the H200 serving trace of 2026-11-23; ``--eager-prefill-ms 0`` gives the earlier model);
- asynchronous loads queue behind the step's in-step bytes on the same link, first in first out,
  and a request is reported in the first step that ends after its own bytes landed (the worker's
  ``AsyncLoader``); the scheduler runs it in the next step.

The turns arrive in waves (a closed loop with equal output lengths: a wave finishes together and
the next turns arrive together); each turn hits its whole history in the CPU tier (the GPU prefix
cache is dropped between waves) and computes ``--new`` new tokens. Prints TTFT p50/p90 per mode
(modelled ms) and writes ``burst_sim.json``.

Usage (from the repo root)::

    PYTHONPATH=. .venv/bin/python benchmarks/probes/burst_sim.py [--users 32] [--waves 3] [--out DIR]

Threading contract: a single-threaded script (the connector's movers run their own threads).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import tiered_kv.connector.vllm.worker as worker  # noqa: E402
from benchmarks.serving.stats import percentile  # noqa: E402
from tests.connector.vllm.harness import BS, Engine, write_model_dir  # noqa: E402
from tiered_kv.connector.vllm.admission import StepLoadBudget  # noqa: E402
from tiered_kv.values.jobs import Completion  # noqa: E402

worker.FENCE_PATIENCE_S = 1.0  # this probe prices steps, not the CPU box's thread timing

KV_BYTES_PER_TOKEN = 128 << 10  # Llama-3-8B, bf16: what one hit token costs on PCIe in the model
PCIE_GBPS = 53.0  # measured pinned H2D ceiling on the H200 (docs/benchmarks.md)
HOLD_MS_PER_GIB = 10.0  # start_load_kv on vLLM's thread, per-layer tensors (docs/vllm.md, "In-step loads")
PREFILL_TPS = 37000.0  # serve_bench's H200 rate for the 8B shape
DECODE_MS = 7.8  # one step of 32 decodes (~250 ms for 32 tokens on the H200 run)
#: the least a step with any prefill costs: vLLM 0.26 runs it eagerly (CUDA graphs for decode-only steps);
#: loading steps of the H200 serve_bench trace (8B, 2026-11-23) took ~22-30 ms against ~5.5 ms decode steps
EAGER_PREFILL_MS = 22.0
LAYERS = 32
MODES = {"layerwise": {}, "adaptive": {"load_mode": "adaptive"}, "async": {"load_mode": "async"},
         "adaptive-1GiB": {"load_mode": "adaptive", "step_load_bytes": "1GiB"},
         # in-step up to a c8 wave's size on the H200 (0.7-1.2 GB a step), asynchronous beyond (2026-11-28)
         "adaptive-2GiB": {"load_mode": "adaptive", "step_load_bytes": "2GiB"},
         # the rule before a0bd10c: the budget priced at all busy steps' pace (decode steps), for comparison
         "adaptive-allsteps": {"load_mode": "adaptive", "_pace": "all"}}


class _AllStepsBudget(StepLoadBudget):
    """``StepLoadBudget`` priced at all busy steps' pace (the rule before the prefill pace)."""

    @property
    def pace_s(self) -> float:
        """All busy steps' average interval."""
        return self.step_s


class Clock:
    """The modelled time and PCIe queue of one engine."""

    def __init__(self) -> None:
        self.t = 0.0  # seconds
        self.pcie_free = 0.0
        self.land: dict[int, float] = {}  # async job -> modelled landing time
        self.bytes: dict[int, int] = {}
        self.step_end = 0.0  # when the step being run ends (its get_finished sees what landed by then)
        self.prefill_steps = 0  # steps that carried a prefill (each an eager forward)
        self.eager_s = EAGER_PREFILL_MS / 1e3


def prompt(user: int, n: int) -> list[int]:
    return [100 + (user * 7919 + i * 31) % 800 for i in range(n)]


def run_mode(model_dir: str, extra: dict, users: int, waves: int, hist: int, new: int, answer: int,
             eager_ms: float = EAGER_PREFILL_MS) -> dict:
    extra = dict(extra)
    pace = extra.pop("_pace", None)
    eng = Engine.create(model_dir, {"cpu_bytes": 1 << 30, **extra}, num_blocks=users * ((hist + new * (waves + 2) +
                        answer * (waves + 2)) // BS + 8), max_batched=8192, max_model_len=4096,
                        tweak=lambda c: setattr(c.scheduler_config, "max_num_seqs", max(8, users)))
    clock = Clock()
    clock.eager_s = eager_ms / 1e3
    planner = eng.connector.planner
    if planner._budget is not None and pace == "all":
        planner._budget.__class__ = _AllStepsBudget
    if planner._budget is not None:
        planner._budget._clock = lambda: clock.t  # the budget's step time follows the modelled clock
        # and its hits are priced in the modelled model's bytes, not the tiny harness model's
        # (the planner's parts share the connector's frozen Geometry: its method is shadowed on the instance)
        object.__setattr__(eng.connector.geo, "hit_nbytes", lambda tokens: -(-tokens // BS) * BS * KV_BYTES_PER_TOKEN)
    w = eng.workers[0].connector.worker
    loader = w.async_loads
    start, landed = loader.start, loader.landed

    def timed_start(jobs, *args, **kwargs):
        for job, gpu, _ in jobs:
            clock.bytes[job.job_id] = int(len(gpu) * BS * KV_BYTES_PER_TOKEN)
        return start(jobs, *args, **kwargs)

    def timed_landed():  # only loads whose modelled bytes landed by the end of this step
        keep_all = loader.pending
        ready = [p for p in keep_all if clock.land.get(p.job.job_id, 1e18) <= clock.step_end]
        loader.pending = ready
        out = landed()
        loader.pending = [p for p in keep_all if p not in ready] + loader.pending
        return [(j, Completion(c.job_id, c.ok, c.corrupt, clock.bytes[j.job_id],
                               clock.bytes[j.job_id] / (PCIE_GBPS * 1e9))) for j, c in out]

    loader.start, loader.landed = timed_start, timed_landed
    ttft: list[float] = []
    waves_ms: list[float] = []
    steps = 0
    try:
        # turn 0 of every user, computed and stored; then the GPU forgets: every later turn is a CPU hit
        reqs = [eng.add(f"u{u}-t0", prompt(u, hist), max_tokens=answer) for u in range(users)]
        eng.run(max_steps=20000, timeout=900)
        eng.settle()
        for wave in range(1, waves + 1):
            assert eng.sched.reset_prefix_cache()  # every block is free between waves
            arrival = clock.t  # the whole wave arrives together (equal output lengths: they finished together)
            reqs = [eng.add(f"u{u}-t{wave}", list(r.prompt_token_ids) + list(r.output_token_ids)
                            + prompt(1000 + u * 31 + wave, new), max_tokens=answer) for u, r in enumerate(reqs)]
            first: dict[str, float] = {}
            if wave == 2:
                clock.prefill_steps = 0  # count the measured waves only
            while not all(r.is_finished() for r in reqs):
                step_cost(eng, clock)
                steps += 1
                for r in reqs:
                    if r.request_id not in first and r.output_token_ids:
                        first[r.request_id] = clock.t
            eng.settle()
            if wave > 1:  # wave 1 follows the cold turn 0 (the budget's estimates start from their guesses)
                ttft += [(first[r.request_id] - arrival) * 1e3 for r in reqs]
                waves_ms.append((clock.t - arrival) * 1e3)  # the wave's last answer: a throughput proxy
        st = eng.connector.stats()
        ws = w.stats()
    finally:
        eng.close()
    return {"ttft_ms_p50": round(percentile(ttft, 50), 1), "ttft_ms_p90": round(percentile(ttft, 90), 1),
            "ttft_ms_max": round(max(ttft), 1), "requests": len(ttft), "steps": steps,
            "prefill_steps": clock.prefill_steps, "wave_ms_mean": round(sum(waves_ms) / len(waves_ms), 1),
            "in_step_loads": ws["sync_loads"], "async_loads": ws["async_loads"],
            "deferred": st.get("admit_deferred", 0), "budget_mb": round(st.get("admit_budget_bytes", 0) / 1e6, 1)}


def step_cost(eng: Engine, clock: Clock) -> None:
    """One engine step on the modelled clock: price it from what the scheduler put in it."""
    sched_out = eng.sched.schedule()
    plan = sched_out.kv_connector_metadata.plan
    in_step = sum(len([g for g in plan.ext.get(j, []) if g >= 0]) for j in plan.sync) * BS * KV_BYTES_PER_TOKEN
    prefill = sum(n for rid, n in sched_out.num_scheduled_tokens.items() if n > 1)
    compute = prefill / PREFILL_TPS + (DECODE_MS / 1e3 if sched_out.total_num_scheduled_tokens else 0.0)
    if prefill:
        compute = max(compute, clock.eager_s)
        clock.prefill_steps += 1
    hold = in_step / (1 << 30) * HOLD_MS_PER_GIB / 1e3
    load = in_step / (PCIE_GBPS * 1e9)
    t0 = clock.t
    end = t0 + hold + max(compute, load + compute / LAYERS) if sched_out.total_num_scheduled_tokens else t0 + 0.001
    # asynchronous loads planned this step: behind this step's in-step bytes on the link, first in first out
    clock.pcie_free = max(clock.pcie_free, t0 + hold + load)
    for j in plan.early:
        if j.job_id in plan.sync or j.job_id not in {x for ids in plan.loads.values() for x in ids}:
            continue
        nbytes = len([g for g in plan.ext.get(j.job_id, []) if g >= 0]) * BS * KV_BYTES_PER_TOKEN
        clock.pcie_free += nbytes / (PCIE_GBPS * 1e9)
        clock.land[j.job_id] = clock.pcie_free
    clock.step_end = end
    mro = eng._run_workers(sched_out)
    eng.sched.update_from_output(sched_out, mro)
    eng.steps += 1
    clock.t = end


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--waves", type=int, default=3, help="measured waves after the first (cold) one")
    ap.add_argument("--history", type=int, default=1152, help="tokens of turn 0 (the first CPU hit)")
    ap.add_argument("--new", type=int, default=160, help="new tokens per turn")
    ap.add_argument("--answer", type=int, default=32)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--eager-prefill-ms", type=float, default=EAGER_PREFILL_MS,
                    help="least cost of a step with a prefill (0: the model before the 2026-11-23 trace)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    a = ap.parse_args()
    model_dir = write_model_dir(tempfile.mkdtemp(prefix="burst-sim-"))
    results = {}
    for m in a.modes.split(","):
        results[m] = run_mode(model_dir, {"chunk_blocks": 16, **MODES[m]}, a.users, a.waves + 1, a.history, a.new,
                              a.answer, a.eager_prefill_ms)
        print(f"{m:>14}: TTFT p50 {results[m]['ttft_ms_p50']} ms p90 {results[m]['ttft_ms_p90']} ms "
              f"max {results[m]['ttft_ms_max']} | {results[m]}", flush=True)
    print("\n| mode | TTFT p50 (model ms) | p90 | max | wave ms (mean) | prefill steps | in-step loads | async loads "
          "| engine steps | budget MB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for m, r in results.items():
        print(f"| {m} | {r['ttft_ms_p50']} | {r['ttft_ms_p90']} | {r['ttft_ms_max']} | {r['wave_ms_mean']} | "
              f"{r['prefill_steps']} | {r['in_step_loads']} | {r['async_loads']} | {r['steps']} | {r['budget_mb']} |")
    os.makedirs(a.out, exist_ok=True)
    params = {"users": a.users, "waves": a.waves, "history": a.history, "new": a.new, "answer": a.answer,
              "kv_bytes_per_token": KV_BYTES_PER_TOKEN, "pcie_gbps": PCIE_GBPS, "hold_ms_per_gib": HOLD_MS_PER_GIB,
              "prefill_tps": PREFILL_TPS, "decode_ms": DECODE_MS, "eager_prefill_ms": a.eager_prefill_ms}
    with open(os.path.join(a.out, "burst_sim.json"), "w") as f:
        json.dump({"model": params, "results": results}, f, indent=1)
    print(f"wrote {os.path.join(a.out, 'burst_sim.json')}")


if __name__ == "__main__":
    main()
