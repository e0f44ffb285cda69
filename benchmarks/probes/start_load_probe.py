"""What the worker side of the vLLM connector holds vLLM's thread for, per step, outside the copies (CPU only).

Round 25 (H200, vLLM 0.26, traced serving at c8; docs/notes/2026-12-01-gpu-round25.md) found ``start_load_kv`` holding
vLLM's engine thread ~2.0 ms in a prefill step with one in-step load of ~75 MB (2 layer groups) and ~3.3 ms with seven
(527 MB), while a probe put one staged layer-group call (``StagedLoader.load``) at ~0.36 ms: about 1.3 ms of the
one-load step lay outside the copy calls (the fence, plan bookkeeping, ``JobRunner.load_rows``,
``InStepLoader.start/adopt/submit``, events, the trace, counters, the id and slot tensors). This probe drives a rank's
``WorkerRuntime`` the way ``tests/connector/vllm/test_worker_in_step.py`` does (no vLLM: a ``StepPlan`` per step,
vLLM's hook order), on CPU tensors that are small (``--head-dim``: a few hundred bytes a layer-block), so what it
times is Python and torch-dispatch overhead, not bytes: Qwen2.5-7B's shape of that run (28 per-layer tensors, vLLM
0.26/0.32's one contiguous chunk a layer and block, 16-token blocks, 16-block chunks), loads of ``--blocks`` blocks
(82: one request's prefix; the first chunk's leading blocks already on the GPU, -1, as a partial GPU hit leaves them),
each chunk in a random CPU slot, random GPU blocks, in-step, layerwise (vLLM's eager attention: ``wait_layer`` for
every layer). Rows: ``in_step_copy`` staged and copy_engine (on CPU the copier's torch path), 1 load in 2 layer groups
and 7 loads in 7 (the pipelined shape: two groups before the forward, the rest from ``wait_layer``, as
``load_ahead_bytes`` cut the 527 MB step), the load trace on (``trace_path``, as that run) and off.

Per step (medians over ``--steps`` steps after ``--warmup``), in ms of wall time (``perf_counter``) and of this
thread's CPU time (``thread_time``):

- ``start``: ``before_forward`` (vLLM's ``start_load_kv``, fence included);
- ``copy``: of that, the in-step copier calls (``BlockCopier.cpu_to_gpu_grouped``; staged: ``StagedLoader.load``);
  ``outside``: ``start - copy``, the fixed per-step and per-load cost this probe is about;
- ``layers``: every ``wait_layer`` of the step (pipelined: the later groups' copier calls are in here);
- ``save``: ``after_forward`` (``wait_for_save``); ``hot``: start + layers + save.

``on_plan`` (``bind_connector_metadata``) and ``poll`` (``get_finished``) run each step too, untimed here.

Not measured on CPU (CUDA only): the engine and side streams (``torch.cuda.current_stream``, stream contexts,
events recorded and waited), the driver's DMA calls (batched descriptors, 2-D copies), the pinned upload of the
block ids, the load trace's CUDA timing events: on CPU the staged load runs torch copies and ``index_put_`` in place
of them, and ``wait_layer`` has no stream waits to enqueue. The probe reports what stays: Python and dispatch.

``--profile`` runs the first case's steps once more under ``cProfile`` (this thread only: the rank's idle mover
threads are not profiled) and prints the functions with the most own time and the most cumulative time.

Usage: ``PYTHONPATH=. .venv/bin/python benchmarks/probes/start_load_probe.py [--steps N] [--out F] [--profile]``.
Prints a table; ``--out`` also writes the rows as JSON. Threading contract: a script on the main thread, which plays
vLLM's worker thread; the rank's mover threads exist and stay idle (no store or tier move is planned).
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tiered_kv.connector.vllm.common import CPU, StepPlan  # noqa: E402
from tiered_kv.connector.vllm.config import ConnectorConfig  # noqa: E402
from tiered_kv.connector.vllm.geometry import Geometry  # noqa: E402
from tiered_kv.connector.vllm.worker import WorkerRuntime  # noqa: E402
from tiered_kv.values.jobs import EXT, JobKind, TransferJob  # noqa: E402
from tiered_kv.values.keys import Namespace  # noqa: E402

LAYERS, BS, K = 28, 16, 16  # Qwen2.5-7B's layers, vLLM's 16-token blocks, 16-block (256-token) chunks
CASES = ((1, 2), (7, 7))  # (loads a step, layer groups): round 26's one-load and seven-load steps
COLS = ["copy", "loads", "groups", "trace", "start_ms", "copy_ms", "outside_ms", "layers_ms", "save_ms", "hot_ms",
        "start_cpu_ms", "hot_cpu_ms", "steps"]


def make_runtime(copy: str, loads: int, groups: int, blocks: int, heads: int, head_dim: int, trace: str | None):
    """A rank-0 ``WorkerRuntime`` registered on ``LAYERS`` fresh ``(num_blocks, heads, BS, 2 * head_dim)`` bf16 layer
    tensors (as ``test_worker_in_step.make_runtime`` builds it), room for ``loads`` loads of ``blocks`` a step.

    ``groups``: the layer groups of a step's copy (``load_groups``); with more than two, ``load_ahead_bytes`` is cut
    so that two go before the forward and the rest from ``wait_layer`` (``load_submit: pipelined``)."""
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))
    block_nbytes = LAYERS * heads * BS * 2 * head_dim * 2
    chunks = -(-blocks // K)
    cpu_chunks = max(64, 4 * loads * chunks)
    num_blocks = max(1024, 2 * loads * blocks)
    step_bytes = loads * blocks * block_nbytes
    ahead = max(1, step_bytes * 2 // groups) if groups > 2 else 256 << 20
    geo = Geometry(BS, K, names, block_nbytes, 1, "probe")
    cfg = ConnectorConfig(chunk_blocks=K, cpu_bytes=cpu_chunks * K * block_nbytes, load_mode="layerwise",
                          in_step_copy=copy, load_groups=groups, load_ahead_bytes=ahead, trace_path=trace)
    rt = WorkerRuntime(cfg, geo, Namespace("probe"), 0, cpu_chunks, 0)
    kv = {n: torch.zeros((num_blocks, heads, BS, 2 * head_dim), dtype=torch.bfloat16) for n in names}
    rt.register(kv)
    return rt, names, num_blocks, cpu_chunks


def plans(loads: int, blocks: int, num_blocks: int, cpu_chunks: int, count: int, seed: int = 0) -> list[StepPlan]:
    """``count`` steps of ``loads`` in-step loads of ``blocks`` GPU blocks each: the chunks in random CPU slots, the
    first chunk's leading blocks -1 (held on the GPU), every GPU block distinct within a step."""
    rng = random.Random(seed)
    chunks = -(-blocks // K)
    held = chunks * K - blocks
    out = []
    job_id = 1
    for step in range(1, count + 1):
        gpu = rng.sample(range(num_blocks), loads * blocks)
        slots = rng.sample(range(cpu_chunks), loads * chunks)
        early, ext = [], {}
        for i in range(loads):
            ids = [-1] * held + gpu[i * blocks:(i + 1) * blocks]
            early.append(TransferJob(job_id, JobKind.EGRESS, CPU, EXT, [b"k%d.%d" % (job_id, c) for c in range(chunks)],
                                     slots[i * chunks:(i + 1) * chunks], list(range(chunks))))
            ext[job_id] = ids
            job_id += 1
        out.append(StepPlan(step, early=early, ext=ext, sync=[j.job_id for j in early], tokens=loads * 512))
    return out


class _Timed:
    """Wraps a copier's ``cpu_to_gpu_grouped``: wall and thread seconds inside it since the last ``take``."""

    def __init__(self, fn) -> None:
        self.fn, self.wall, self.cpu = fn, 0.0, 0.0

    def __call__(self, *args, **kwargs):
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.wall += time.perf_counter() - w0
            self.cpu += time.thread_time() - c0

    def take(self) -> float:
        wall, self.wall, self.cpu = self.wall, 0.0, 0.0
        return wall


def run_steps(rt: WorkerRuntime, names, steps: list[StepPlan], timed: list[_Timed] | None) -> list[dict]:
    """vLLM's hook order per step; per step the wall and thread ms of each timed hook."""
    out = []
    for plan in steps:
        rt.on_plan(plan)
        w0, c0 = time.perf_counter(), time.thread_time()
        rt.before_forward(layerwise_ok=True)
        w1, c1 = time.perf_counter(), time.thread_time()
        copy = sum(t.take() for t in timed) if timed else 0.0
        for name in names:
            rt.wait_layer(name)
        w2, c2 = time.perf_counter(), time.thread_time()
        rt.after_forward()
        w3, c3 = time.perf_counter(), time.thread_time()
        res = rt.poll()
        if timed:
            for t in timed:
                t.take()
        assert all(all(r.ok) for r in res.reports.values()) and len(res.reports) == len(plan.sync), res.reports
        out.append({"start": (w1 - w0) * 1e3, "copy": copy * 1e3, "layers": (w2 - w1) * 1e3, "save": (w3 - w2) * 1e3,
                    "start_cpu": (c1 - c0) * 1e3, "hot_cpu": (c3 - c0) * 1e3})
    return out


def case(copy: str, loads: int, groups: int, trace: bool, args) -> dict:
    """One row: medians over ``args.steps`` steps after ``args.warmup``."""
    with tempfile.TemporaryDirectory() as tmp:
        rt, names, num_blocks, cpu_chunks = make_runtime(copy, loads, groups, args.blocks, args.heads, args.head_dim,
                                                         f"{tmp}/trace" if trace else None)
        try:
            timed = []
            for copier in rt.in_step.copiers:
                copier.cpu_to_gpu_grouped = t = _Timed(copier.cpu_to_gpu_grouped)
                timed.append(t)
            steps = plans(loads, args.blocks, num_blocks, cpu_chunks, args.warmup + args.steps)
            got = run_steps(rt, names, steps, timed)[args.warmup:]
        finally:
            rt.close()

    def med(key: str) -> float:
        return round(statistics.median(s[key] for s in got), 4)

    hot = [s["start"] + s["layers"] + s["save"] for s in got]
    return {"copy": copy, "loads": loads, "groups": groups, "trace": "on" if trace else "off",
            "start_ms": med("start"), "copy_ms": med("copy"),
            "outside_ms": round(statistics.median(s["start"] - s["copy"] for s in got), 4),
            "layers_ms": med("layers"), "save_ms": med("save"), "hot_ms": round(statistics.median(hot), 4),
            "start_cpu_ms": med("start_cpu"), "hot_cpu_ms": med("hot_cpu"), "steps": len(got)}


def profile(copy: str, loads: int, groups: int, trace: bool, args, top: int) -> str:
    """cProfile of one case's steps (after its warm-up): the functions with the most own and cumulative time."""
    with tempfile.TemporaryDirectory() as tmp:
        rt, names, num_blocks, cpu_chunks = make_runtime(copy, loads, groups, args.blocks, args.heads, args.head_dim,
                                                         f"{tmp}/trace" if trace else None)
        try:
            steps = plans(loads, args.blocks, num_blocks, cpu_chunks, args.warmup + args.steps)
            run_steps(rt, names, steps[:args.warmup], None)
            prof = cProfile.Profile()
            prof.enable()
            run_steps(rt, names, steps[args.warmup:], None)
            prof.disable()
        finally:
            rt.close()
    lines = []
    for key in ("tottime", "cumulative"):
        text = _Sink()
        pstats.Stats(prof, stream=text).strip_dirs().sort_stats(key).print_stats(top)
        lines.append(f"--- {copy}, {loads} load(s), {groups} groups, trace {'on' if trace else 'off'}: by {key} "
                     f"({len(steps) - args.warmup} steps) ---\n{text.text}")
    return "\n".join(lines)


class _Sink:
    def __init__(self) -> None:
        self.text = ""

    def write(self, s: str) -> None:
        self.text += s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="timed steps per case (medians over these)")
    p.add_argument("--warmup", type=int, default=30, help="untimed steps first")
    p.add_argument("--blocks", type=int, default=82, help="GPU blocks a load fills")
    p.add_argument("--heads", type=int, default=1, help="KV heads of a layer tensor (small: overhead dominates)")
    p.add_argument("--head-dim", type=int, default=4, help="head dim (bf16; K and V side by side)")
    p.add_argument("--copies", default="staged,copy_engine", help="in_step_copy values, comma-separated")
    p.add_argument("--trace", default="off,on", help="the load trace: off, on, or both")
    p.add_argument("--rounds", type=int, default=1, help="run every case this many times, interleaved (rows each)")
    p.add_argument("--profile", action="store_true", help="also cProfile the first case and print the top")
    p.add_argument("--top", type=int, default=30, help="functions printed per profile listing")
    p.add_argument("--out", help="write the rows (and the profile text) as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    cases = [(c, n, g, t == "on") for c in args.copies.split(",") for n, g in CASES for t in args.trace.split(",")]
    for r in range(args.rounds):
        for c in cases:
            row = case(*c, args)
            row["round"] = r
            rows.append(row)
            print(" ".join(f"{k}={row[k]}" for k in COLS), file=sys.stderr, flush=True)
    print("| " + " | ".join(COLS) + " |")
    print("|" + "---|" * len(COLS))
    for row in rows:
        print("| " + " | ".join(str(row[k]) for k in COLS) + " |")
    text = profile(*cases[0], args, args.top) if args.profile else None
    if text:
        print(text)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "device": "cpu",
            "command": "python benchmarks/probes/start_load_probe.py " + " ".join(argv or sys.argv[1:]),
            "blocks": args.blocks, "layers": LAYERS, "heads": args.heads, "head_dim": args.head_dim,
            "rows": rows, "profile": text}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
