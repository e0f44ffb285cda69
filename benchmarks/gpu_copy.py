"""Benchmark: GPU <-> pinned CPU block copies (issue 5), run on the GPU machine.

Measures, for Llama-3-8B-shaped blocks (32 layers, 8 KV heads, head_dim 128,
bf16, 16 tokens: 2 MiB a block) and a small model (16 layers, 8 KV heads,
head_dim 64: 512 KiB a block), with blocks and slots chosen at random:

- GB/s GPU->CPU, CPU->GPU and both at once, per mechanism (copy engine, SM
  kernel), for per-layer ``LBNHC`` (64 KiB / 32 KiB runs) and block-outermost
  ``BLHNC`` (one run per block), 16..4096 blocks per call, next to a contiguous
  pinned copy of the same byte count measured in the same run, and the ratio;
- the same for synthetic layouts whose blocks split into 1..64 KiB chunks (the
  data behind the mechanism selection rule);
- the slowdown of a concurrent bf16 matmul loop while both directions copy at
  full rate, per mechanism;
- ``--staged-only`` (issue 12): loads of 512 blocks from chunk runs of 16 adjacent slots into
  small per-layer blocks (DeepSeek-V2-Lite MLA: 27 layers x 18 KiB; Qwen2.5-7B: 28 layers x
  32 KiB; and Llama-3-8B's 32 x 64 KiB, which the serving runs stage in big steps), copy engine (one descriptor per layer-block) vs the staged load (one DMA per slot
  run into a device buffer, then an on-device scatter; whole, and in 2 layer groups) vs the
  contiguous pinned copy of the same bytes, plus the matmul slowdown under each.

``pcie_ceiling()`` (no CLI; ``vllm_ttft.py`` runs it in a child process for issue 14's floor): the
contiguous pinned copy alone, 8 x 1 GiB per direction, best / median / every GB/s.

Prints a table, writes ``gpu_copy.json`` and ``gpu_copy.png`` to ``$OUT`` (or
``--out``). ``--plot-from FILE.json`` only redraws the plot (no GPU needed).
Times are wall-clock from the call to the event firing (planning and driver
submission included), median of several repetitions after a warm-up.

Threading: a script; runs on the main thread only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiered_kv.copy import BlockCopier, KVLayout, Mechanism, vllm_layer_layout  # noqa: E402
from tiered_kv.copy.testing import Shape, storages, vllm026_tensors, vllm033_views  # noqa: E402

MIB = 1 << 20
SHAPES = {
    "llama3-8b": Shape(layers=32, heads=8, block_size=16, head_dim=128, num_blocks=8192),
    "small-16L-hd64": Shape(layers=16, heads=8, block_size=16, head_dim=64, num_blocks=8192),
}
MECHS = (Mechanism.COPY_ENGINE, Mechanism.SM_KERNEL)


def _median_time(fn: Callable[[], list], reps: int) -> tuple[float, float]:
    """Median wall seconds of ``fn`` until its results have landed, and median seconds until it returned."""
    total, submit = _times(fn, reps)
    return statistics.median(total), statistics.median(submit)


def _times(fn: Callable[[], list], reps: int) -> tuple[list[float], list[float]]:
    """Wall seconds of each of ``reps`` calls of ``fn`` (after one warm-up) until its results have landed,
    and until it returned."""
    fn_results = fn()  # warm-up (Triton compile, driver entry point)
    for r in fn_results:
        r.wait()
    torch.cuda.synchronize()
    total, submit = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        results = fn()
        t1 = time.perf_counter()
        for r in results:
            r.wait()
        t2 = time.perf_counter()
        total.append(t2 - t0)
        submit.append(t1 - t0)
    return total, submit


class _Event:
    """Adapter so a contiguous copy's event looks like a CopyResult."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.event = torch.cuda.Event()
        self.event.record(stream)

    def wait(self) -> None:
        """Block until the contiguous copy has landed."""
        self.event.synchronize()


class Bench:
    """Holds the pinned slab, the contiguous GPU buffer and the collected records."""

    def __init__(self, slab_bytes: int, quick: bool) -> None:
        t0 = time.perf_counter()
        self.host = torch.empty(slab_bytes, dtype=torch.uint8, pin_memory=True)
        self.pin_seconds = time.perf_counter() - t0
        self.gpu_flat = torch.empty(slab_bytes, dtype=torch.uint8, device="cuda")
        self.gpu_flat.random_(0, 256)
        self.s1, self.s2 = torch.cuda.Stream(), torch.cuda.Stream()
        self.quick = quick
        self.records: list[dict] = []
        self.gen = torch.Generator().manual_seed(2026)

    def reps(self, nbytes: int) -> int:
        """Timed repetitions for a copy of ``nbytes``: about 3 GB in all, 3 to 20."""
        return 2 if self.quick else max(3, min(20, int(3e9 / max(nbytes, 1))))

    def slab(self, slot_bytes: int) -> torch.Tensor:
        """The pinned buffer viewed as slots of ``slot_bytes``."""
        return self.host[: (self.host.numel() // slot_bytes) * slot_bytes].view(-1, slot_bytes)

    def contiguous(self, nbytes: int, direction: str, calls: int = 1) -> float:
        """GB/s of contiguous pinned copies of ``nbytes`` each way (``both``: two at once), ``calls`` back to back."""
        moved = nbytes * (2 if direction == "both" else 1) * calls
        seconds, _ = _median_time(self._contiguous_fn(nbytes, direction, calls), self.reps(moved))
        return moved / seconds / 1e9

    def contiguous_samples(self, nbytes: int, direction: str, reps: int) -> list[float]:
        """GB/s of each of ``reps`` contiguous pinned copies of ``nbytes`` (one direction, or ``both``),
        timed one at a time after a warm-up."""
        moved = nbytes * (2 if direction == "both" else 1)
        totals, _ = _times(self._contiguous_fn(nbytes, direction, 1), reps)
        return [moved / t / 1e9 for t in totals]

    def _contiguous_fn(self, nbytes: int, direction: str, calls: int) -> Callable[[], list]:
        """A callable that queues the contiguous copies and returns their events."""
        if 2 * nbytes > self.host.numel():
            raise ValueError(f"a contiguous copy of {nbytes} bytes needs a slab of >= {2 * nbytes} bytes, "
                             f"this one has {self.host.numel()}: make the Bench larger")
        h, g = self.host, self.gpu_flat

        def run() -> list:
            out = []
            for _ in range(calls):
                if direction in ("d2h", "both"):
                    with torch.cuda.stream(self.s1):
                        h[:nbytes].copy_(g[:nbytes], non_blocking=True)
                    out.append(_Event(self.s1))
                if direction in ("h2d", "both"):
                    with torch.cuda.stream(self.s2):
                        g[nbytes : 2 * nbytes].copy_(h[nbytes : 2 * nbytes], non_blocking=True)
                    out.append(_Event(self.s2))
            return out

        return run

    def copies(self, label: str, layout: KVLayout, n: int, directions: tuple[str, ...], mechs=MECHS,
               calls: int = 1, **opts) -> None:
        """Record GB/s per mechanism and direction for ``n`` random blocks per call (``opts`` go to BlockCopier).

        ``calls`` > 1: that many calls per direction back to back per sample (a mover with a queue of
        copies: each call's fixed host cost overlaps the previous call's transfer), against as many
        back-to-back contiguous copies.
        """
        slab = self.slab(layout.block_nbytes)
        copier = BlockCopier(layout, slab, **opts)
        blocks = torch.randperm(layout.num_blocks, generator=self.gen)
        slots = torch.randperm(slab.shape[0], generator=self.gen)
        out_b, out_s = blocks[:n], slots[:n]
        in_b, in_s = blocks[n : 2 * n], slots[n : 2 * n]
        nbytes = n * layout.block_nbytes
        for direction in directions:
            base = self.contiguous(nbytes, direction, calls)
            for mech in mechs:
                last: list = []

                def run(mech=mech, direction=direction, last=last) -> list:
                    out = []
                    for _ in range(calls):
                        if direction in ("d2h", "both"):
                            out.append(copier.gpu_to_cpu(out_b, out_s, mechanism=mech))
                        if direction in ("h2d", "both"):
                            out.append(copier.cpu_to_gpu(in_s, in_b, mechanism=mech))
                    last[:] = out
                    return out

                moved = nbytes * (2 if direction == "both" else 1) * calls
                seconds, submit = _median_time(run, self.reps(moved))
                rate = moved / seconds / 1e9
                runs = last[0].num_runs  # descriptors of one direction: 1-D runs, 2-D copies or kernel runs
                rec = dict(case=label, opts=opts, blocks=n, calls=calls, block_bytes=layout.block_nbytes, direction=direction,
                           mechanism=last[0].mechanism.value, gbps=round(rate, 2), contiguous_gbps=round(base, 2),
                           ratio=round(rate / base, 3), runs_per_call=runs,
                           mean_run_bytes=nbytes // max(runs, 1), call_ms=round(submit * 1e3, 3),
                           total_ms=round(seconds * 1e3, 3))
                self.records.append(rec)
                tag = ",".join(f"{k}={v}" for k, v in opts.items())
                tag += f" x{calls} back to back" if calls > 1 else ""
                print(f"{label + (' ' + tag if tag else ''):<34} {n:>5} {direction:<4} {mech.value:<11} {rate:7.2f} GB/s"
                      f"  contig {base:6.2f}  ratio {rate / base:5.3f}  descr {runs:>7}"
                      f"  call {submit * 1e3:7.2f} ms", flush=True)
        copier.close()


def pcie_ceiling(nbytes: int = 1 << 30, reps: int = 8, directions: tuple[str, ...] = ("h2d", "d2h")) -> dict:
    """The ceiling other benchmarks compare with: ``reps`` contiguous pinned copies of ``nbytes`` per
    direction, each timed alone (call to event, after a warm-up), as best / median / every GB/s.

    Used by ``vllm_ttft.py`` (issue 14's floor) in a process of its own, so that its pinned and device
    buffers are gone before an engine starts. Without a CUDA device it returns ``{"error": ...}``.
    """
    if not torch.cuda.is_available():
        return {"error": "no CUDA device"}
    bench = Bench(2 * nbytes, quick=False)
    out: dict = {"device": torch.cuda.get_device_name(0), "bytes": nbytes, "reps": reps,
                 "pin_seconds": round(bench.pin_seconds, 2)}
    for d in directions:
        samples = bench.contiguous_samples(nbytes, d, reps)
        out[d] = {"best_gbps": round(max(samples), 2), "median_gbps": round(statistics.median(samples), 2),
                  "samples_gbps": [round(x, 2) for x in samples]}
    del bench
    torch.cuda.empty_cache()
    return out


def ab_submit(bench: Bench, label: str, layout: KVLayout, n: int) -> None:
    """Copy-engine stores: driver submission on the submitter thread vs. on the caller's thread.

    Alternated twice; per mode the median of: call returned, submission finished
    (result ready), copy landed — to tell thread hand-off cost from driver cost.
    """
    slab = bench.slab(layout.block_nbytes)
    blocks = torch.randperm(layout.num_blocks, generator=bench.gen)[:n]
    slots = torch.randperm(slab.shape[0], generator=bench.gen)[:n]
    for rep in range(2):
        for threaded in (True, False):
            copier = BlockCopier(layout, slab, threaded_submit=threaded)
            copier.gpu_to_cpu(blocks, slots, mechanism=Mechanism.COPY_ENGINE).wait()
            call, ready, total = [], [], []
            for _ in range(10):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                res = copier.gpu_to_cpu(blocks, slots, mechanism=Mechanism.COPY_ENGINE)
                t1 = time.perf_counter()
                res._submitted.wait()
                t2 = time.perf_counter()
                res.wait()
                t3 = time.perf_counter()
                call.append(t1 - t0)
                ready.append(t2 - t0)
                total.append(t3 - t0)
            copier.close()
            med = {k: statistics.median(v) * 1e3 for k, v in (("call", call), ("ready", ready), ("total", total))}
            rate = n * layout.block_nbytes / med["total"] / 1e6
            bench.records.append(dict(case=label, opts={"threaded_submit": threaded}, ab=True, blocks=n,
                                      block_bytes=layout.block_nbytes, direction="d2h", mechanism="copy_engine",
                                      gbps=round(rate, 2), call_ms=round(med["call"], 3), ready_ms=round(med["ready"], 3),
                                      total_ms=round(med["total"], 3), rep=rep))
            print(f"A/B {label:<24} {n:>5} d2h threaded={threaded!s:<5} {rate:7.2f} GB/s  call {med['call']:7.3f} ms"
                  f"  submitted {med['ready']:7.3f} ms  landed {med['total']:7.3f} ms", flush=True)


def build_model_layout(shape: Shape, order: str) -> KVLayout:
    """vLLM 0.33 per-layer views in ``order``, storage filled with random bytes on the GPU."""
    layout = vllm_layer_layout(vllm033_views(order, shape, torch.bfloat16, "cuda"), f"vllm:{order}")
    for flat in storages(layout):
        flat.random_(0, 256)
    return layout


def build_chunked_layout(chunk_bytes: int, block_bytes: int, num_blocks: int) -> KVLayout:
    """One uint8 tensor ``(chunks, blocks, chunk_bytes)``: each block is ``block_bytes/chunk_bytes`` separate chunks."""
    t = torch.empty((block_bytes // chunk_bytes, num_blocks, chunk_bytes), dtype=torch.uint8, device="cuda")
    t.random_(0, 256)
    return KVLayout((t,), block_dim=1, name=f"chunks{chunk_bytes}")


def matmul_interference(bench: Bench, layout: KVLayout, n: int, iters: int,
                        variants: list[tuple[Mechanism, dict]]) -> list[dict]:
    """Slowdown of a bf16 8192^3 matmul loop while ``n``-block stores and loads run back to back."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    ms = torch.cuda.Stream()

    def mm() -> tuple[torch.cuda.Event, torch.cuda.Event]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(ms):
            start.record()
            for _ in range(iters):
                torch.matmul(a, b, out=c)
            end.record()
        return start, end

    def alone() -> float:
        s, e = mm()
        e.synchronize()
        return s.elapsed_time(e)

    alone()
    base = [alone(), alone()]
    slab = bench.slab(layout.block_nbytes)
    blocks = torch.randperm(layout.num_blocks, generator=bench.gen)
    slots = torch.randperm(slab.shape[0], generator=bench.gen)
    out = []
    for mech, opts in variants:
        copier = BlockCopier(layout, slab, **opts)
        pending: deque = deque()

        def round_() -> None:
            pending.append((copier.gpu_to_cpu(blocks[:n], slots[:n], mechanism=mech),
                            copier.cpu_to_gpu(slots[n : 2 * n], blocks[n : 2 * n], mechanism=mech)))

        round_()
        for r in pending.popleft():  # warm-up (Triton compile)
            r.wait()
        round_()
        round_()
        s, e = mm()
        t0, rounds = time.perf_counter(), 0
        while not e.query():
            while len(pending) >= 3:
                for r in pending.popleft():
                    r.wait()
            round_()
            rounds += 1
        t1 = time.perf_counter()
        while pending:
            for r in pending.popleft():
                r.wait()
        copier.close()
        busy = s.elapsed_time(e)
        base.append(alone())
        ref = statistics.median(base)
        moved = rounds * 2 * n * layout.block_nbytes
        tag = ",".join(f"{k}={v}" for k, v in opts.items())
        rec = dict(mechanism=mech.value, opts=opts, matmul_ms_alone=round(ref, 2), matmul_ms_with_copies=round(busy, 2),
                   slowdown_pct=round(100 * (busy / ref - 1), 2), copy_gbps_during=round(moved / (t1 - t0) / 1e9, 2),
                   alone_samples_ms=[round(x, 2) for x in base], blocks_per_call=n, iters=iters)
        out.append(rec)
        print(f"matmul x{iters} alone {ref:8.2f} ms  with {mech.value} {tag:<16} copies {busy:8.2f} ms"
              f"  slowdown {rec['slowdown_pct']:7.2f} %  copies {rec['copy_gbps_during']:6.2f} GB/s both ways", flush=True)
    return out


STAGED_SHAPES = {
    # vLLM 0.26 separate per-layer tensors: one chunk per (layer, block)
    "dsv2-lite-mla": (Shape(layers=27, heads=1, block_size=16, head_dim=576, num_blocks=1100), True),
    "qwen2.5-7b": (Shape(layers=28, heads=4, block_size=16, head_dim=128, num_blocks=1100), False),
    # 64 KiB layer-blocks: the serving benchmark's c32 steps stage these (issue 14)
    "llama3-8b": (Shape(layers=32, heads=8, block_size=16, head_dim=128, num_blocks=1100), False),
}


def build_staged_layout(shape: Shape, mla: bool) -> KVLayout:
    """vLLM 0.26 per-layer tensors (separate allocations), random bytes."""
    layout = vllm_layer_layout(vllm026_tensors("NHD", shape, torch.bfloat16, "cuda", mla=mla), "vllm026")
    for flat in storages(layout):
        flat.random_(0, 256)
    return layout


def staged_rows(bench: Bench, label: str, layout: KVLayout, n: int = 512, chunk: int = 16) -> None:
    """Loads of ``n`` blocks from slot runs of ``chunk`` (the runs in random order) into random blocks:
    contiguous ceiling, copy engine, SM kernel, staged (whole / 2 layer groups), staged from scattered slots."""
    slab = bench.slab(layout.block_nbytes)
    runs = slab.shape[0] // chunk
    starts = torch.randperm(runs, generator=bench.gen)[: -(-n // chunk)] * chunk
    slots = (starts[:, None] + torch.arange(chunk)[None, :]).reshape(-1)[:n]
    scattered = torch.randperm(slab.shape[0], generator=bench.gen)[:n]
    blocks = torch.randperm(layout.num_blocks, generator=bench.gen)[:n]
    nbytes = n * layout.block_nbytes
    base = bench.contiguous(nbytes, "h2d")
    half = len(layout.tensors) // 2
    variants = [
        ("copy_engine", Mechanism.COPY_ENGINE, slots, None, {}),
        ("sm_kernel", Mechanism.SM_KERNEL, slots, None, {}),
        ("staged", Mechanism.STAGED, slots, None, {}),
        ("staged 2 groups", Mechanism.STAGED, slots, [(0, half), (half, len(layout.tensors))], {}),
        ("staged 64MiB buf", Mechanism.STAGED, slots, None, {"staging_bytes": 64 << 20}),
        # two halves of the cap: the next piece's DMA beside the last piece's scatter (load_staging_buffers 2)
        ("staged 2 halves", Mechanism.STAGED, slots, None, {"staging_buffers": 2}),
        ("staged 64MiB 2 halves", Mechanism.STAGED, slots, None, {"staging_bytes": 64 << 20, "staging_buffers": 2}),
        ("staged scattered", Mechanism.STAGED, scattered, None, {}),
        ("copy_engine scattered", Mechanism.COPY_ENGINE, scattered, None, {}),
        # as the in-step loader calls them: on the caller's thread ("call" = time the caller is held)
        ("copy_engine inline", Mechanism.COPY_ENGINE, slots, None, {"threaded_submit": False}),
        ("staged inline", Mechanism.STAGED, slots, None, {"threaded_submit": False}),
        ("staged inline 2 groups", Mechanism.STAGED, slots, [(0, half), (half, len(layout.tensors))],
         {"threaded_submit": False}),
        ("staged inline 2 groups 2 halves", Mechanism.STAGED, slots, [(0, half), (half, len(layout.tensors))],
         {"threaded_submit": False, "staging_buffers": 2}),
    ]
    print(f"{label}: {n} blocks x {len(layout.tensors)} layers x {layout.maps[0].nbytes // 1024} KiB = "
          f"{nbytes / 1e9:.3f} GB, contiguous pinned h2d {base:.2f} GB/s", flush=True)
    for name, mech, sl, groups, opts in variants:
        copier = BlockCopier(layout, slab, **opts)
        last: list = []

        def run(mech=mech, sl=sl, groups=groups, last=last) -> list:
            if groups is None:
                out = [copier.cpu_to_gpu(sl, blocks, mechanism=mech)]
            else:
                out = copier.cpu_to_gpu_grouped(sl, blocks, groups, mechanism=mech)
            last[:] = out
            return out

        seconds, submit = _median_time(run, max(5, bench.reps(nbytes)))
        rate = nbytes / seconds / 1e9
        ops = sum(r.num_runs for r in last)
        rec = dict(case=label, staged=True, variant=name, blocks=n, layers=len(layout.tensors),
                   layer_block_bytes=layout.maps[0].nbytes, block_bytes=layout.block_nbytes, direction="h2d",
                   mechanism=mech.value, opts=opts, gbps=round(rate, 2), contiguous_gbps=round(base, 2),
                   ratio=round(rate / base, 3), ops_per_call=ops, call_ms=round(submit * 1e3, 3),
                   total_ms=round(seconds * 1e3, 3))
        bench.records.append(rec)
        print(f"  {name:<32} {rate:7.2f} GB/s  ratio {rate / base:5.3f}  ops {ops:>6}  call {submit * 1e3:7.2f} ms"
              f"  landed {seconds * 1e3:7.2f} ms", flush=True)
        copier.close()


def plot(data: dict, path: Path) -> None:
    """GB/s vs blocks per call, one panel per (model, layout), one line per mechanism and direction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(r: dict) -> str | None:
        opts = r.get("opts") or {}
        if not opts:
            return r["mechanism"]
        if opts == {"rect_copies": False}:
            return "copy_engine 1-D runs"
        if opts == {"rect_copies": True}:
            return "copy_engine 2-D"
        return None

    recs = [r for r in data["copies"] if r["direction"] in ("d2h", "h2d") and series(r)
            and r["case"] in ("llama3-8b/LBNHC", "llama3-8b/BLHNC")]
    panels = sorted({r["case"] for r in recs})
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(5 * (len(panels) + 1), 4), squeeze=False)
    for ax, case in zip(axes[0], panels):
        for mech in ("copy_engine", "copy_engine 2-D", "sm_kernel"):
            for direction, style in (("d2h", "-o"), ("h2d", "-s")):
                pts = sorted((r["blocks"], r["gbps"]) for r in recs if r["case"] == case and series(r) == mech and r["direction"] == direction)
                if pts:
                    ax.plot(*zip(*pts), style, label=f"{mech} {direction}")
        base = sorted({r["blocks"]: r["contiguous_gbps"] for r in recs
                       if r["case"] == case and r["direction"] == "d2h" and not r.get("opts")}.items())
        if base:
            ax.plot(*zip(*base), "k--", label="contiguous d2h")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("blocks per call (2 MiB each)")
        ax.set_ylabel("GB/s")
        ax.set_title(case)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[0][-1]
    chunk = [r for r in data["copies"] if r["case"].startswith("chunks") and series(r)]
    for mech in ("copy_engine", "copy_engine 1-D runs", "sm_kernel"):
        for direction, style in (("d2h", "-o"), ("h2d", "-s")):
            pts = sorted((int(r["case"][6:-3]), r["gbps"]) for r in chunk if series(r) == mech and r["direction"] == direction)
            if pts:
                ax.plot(*zip(*pts), style, label=f"{mech} {direction}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("chunk size (KiB); 512 blocks of 256 KiB per call")
    ax.set_ylabel("GB/s")
    ax.set_title("chunked blocks: mechanism choice")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle(f"GPU <-> pinned CPU, {data['device']} ({data['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    """Run every measurement (or only redraw the plot) and write the JSON and PNG."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--quick", action="store_true", help="2 repetitions, fewer sizes: a smoke run")
    ap.add_argument("--plot-from", help="redraw the PNG from this JSON and exit")
    ap.add_argument("--matmul-iters", type=int, default=200)
    ap.add_argument("--ab-only", action="store_true", help="only the submission-thread A/B")
    ap.add_argument("--staged-only", action="store_true",
                    help="only the staged-load rows (issue 12): small per-layer blocks, 512-block loads")
    ap.add_argument("--streamed-only", action="store_true",
                    help="only 256-block calls, 8 back to back per sample, vs 8 back-to-back contiguous copies")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.plot_from:
        plot(json.loads(Path(args.plot_from).read_text()), out / "gpu_copy.png")
        return 0
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    import triton
    from cuda import bindings

    big = SHAPES["llama3-8b"]
    bench = Bench(slab_bytes=(2 << 30) if args.staged_only else 2 * 4096 * 2 * MIB, quick=args.quick)
    data = dict(device=torch.cuda.get_device_name(0), date=datetime.date.today().isoformat(),
                command=" ".join([sys.executable.split("/")[-1]] + sys.argv), torch=torch.__version__,
                triton=triton.__version__, cuda_bindings=getattr(bindings, "__version__", "?"),
                pin_seconds_16GiB=round(bench.pin_seconds, 2), copies=[], matmul=[])
    print(f"{data['device']}  torch {data['torch']}  triton {data['triton']}  cuda-bindings {data['cuda_bindings']}"
          f"  pinned {bench.host.numel() / 2**30:.0f} GiB in {bench.pin_seconds:.2f} s", flush=True)
    sweep = (256, 4096) if args.quick else (16, 64, 256, 1024, 4096)
    if args.ab_only:
        for shape, order, n in ((big, "LBNHC", 256), (big, "BLHNC", 16), (SHAPES["small-16L-hd64"], "LBNHC", 4096)):
            layout = build_model_layout(shape, order)
            ab_submit(bench, f"{'llama3-8b' if shape is big else 'small-16L-hd64'}/{order}", layout, n)
            if shape is big and order == "LBNHC":
                bench.copies("llama3-8b/LBNHC", layout, 256, ("both",), (Mechanism.COPY_ENGINE,))
                bench.copies("llama3-8b/LBNHC", layout, 256, ("both",), (Mechanism.COPY_ENGINE,), threaded_submit=False)
            del layout
            torch.cuda.empty_cache()
        (out / "gpu_copy_ab.json").write_text(json.dumps(bench.records, indent=1))
        return 0
    ce, sm = (Mechanism.COPY_ENGINE,), (Mechanism.SM_KERNEL,)
    if args.staged_only:
        for name, (shape, mla) in STAGED_SHAPES.items():
            layout = build_staged_layout(shape, mla)
            staged_rows(bench, name, layout)
            if mla:
                variants = [(Mechanism.COPY_ENGINE, {}), (Mechanism.STAGED, {})]
                data["matmul"] = matmul_interference(bench, layout, 512, min(args.matmul_iters, 100), variants)
            del layout
            torch.cuda.empty_cache()
        data["copies"] = bench.records
        (out / "gpu_copy_staged.json").write_text(json.dumps(data, indent=1))
        return 0
    if args.streamed_only:
        for shape_name, order in (("llama3-8b", "LBNHC"), ("llama3-8b", "BLHNC"), ("small-16L-hd64", "LBNHC"),
                                  ("small-16L-hd64", "BLHNC")):
            layout = build_model_layout(SHAPES[shape_name], order)
            for calls in (1, 8):
                bench.copies(f"{shape_name}/{order}", layout, 256, ("d2h", "h2d", "both"), calls=calls)
            del layout
            torch.cuda.empty_cache()
        data["copies"] = bench.records
        (out / "gpu_copy_streamed.json").write_text(json.dumps(data, indent=1))
        return 0
    for order in ("LBNHC", "BLHNC"):
        layout = build_model_layout(big, order)
        for n in sweep:
            dirs = ("d2h", "h2d", "both") if n in (256, 4096) else ("d2h", "h2d")
            bench.copies(f"llama3-8b/{order}", layout, n, dirs)
            if order == "LBNHC":  # the same copies as one 2-D copy per block instead of 32 batched 64 KiB runs
                bench.copies(f"llama3-8b/{order}", layout, n, dirs, ce, rect_copies=True)
        if order == "LBNHC":
            for programs in (16, 66, 132):
                bench.copies(f"llama3-8b/{order}", layout, 256, ("d2h", "h2d"), sm, sm_programs=programs)
            variants = [(Mechanism.COPY_ENGINE, {}), (Mechanism.COPY_ENGINE, {"rect_copies": True}),
                        (Mechanism.COPY_ENGINE, {"prefer_overlap": False})]
            variants += [(Mechanism.SM_KERNEL, {"sm_programs": p}) for p in (16, 32, 132)]
            data["matmul"] = matmul_interference(bench, layout, 256, args.matmul_iters, variants)
        del layout
        torch.cuda.empty_cache()
    layout = build_model_layout(big, "LHBNC")  # 8 KiB chunks: 2-D rows of 8 KiB, or 256 tiny runs per block
    bench.copies("llama3-8b/LHBNC", layout, 256, ("d2h", "h2d", "both"))
    bench.copies("llama3-8b/LHBNC", layout, 256, ("d2h", "h2d", "both"), ce, rect_copies=False)
    for programs in (16, 66, 132):
        bench.copies("llama3-8b/LHBNC", layout, 256, ("d2h", "h2d"), sm, sm_programs=programs)
    del layout
    torch.cuda.empty_cache()
    small = SHAPES["small-16L-hd64"]
    for order in ("LBNHC", "BLHNC"):
        layout = build_model_layout(small, order)
        for n in (256, 4096):
            bench.copies(f"small-16L-hd64/{order}", layout, n, ("d2h", "h2d", "both"))
            if order == "LBNHC":  # default there is 2-D (32 KiB runs); compare with batched 1-D runs
                bench.copies(f"small-16L-hd64/{order}", layout, n, ("d2h", "h2d", "both"), ce, rect_copies=False)
        del layout
        torch.cuda.empty_cache()
    for chunk_kib in (1, 2, 4, 8, 16, 32, 64):
        layout = build_chunked_layout(chunk_kib * 1024, 256 * 1024, 2048)
        bench.copies(f"chunks{chunk_kib}KiB", layout, 512, ("d2h", "h2d"))
        bench.copies(f"chunks{chunk_kib}KiB", layout, 512, ("d2h", "h2d"), ce, rect_copies=False)
        if chunk_kib in (1, 4, 16):
            bench.copies(f"chunks{chunk_kib}KiB", layout, 512, ("d2h", "h2d"), sm, sm_programs=132)
        del layout
        torch.cuda.empty_cache()
    for name, (shape, mla) in STAGED_SHAPES.items():  # issue 12: small per-layer blocks, staged loads
        layout = build_staged_layout(shape, mla)
        staged_rows(bench, name, layout)
        del layout
        torch.cuda.empty_cache()
    data["copies"] = bench.records
    (out / "gpu_copy.json").write_text(json.dumps(data, indent=1))
    try:
        plot(data, out / "gpu_copy.png")
    except ImportError as exc:
        print(f"no plot: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
