"""Do the GPUs of one host slow each other's host copies? (issue 14), on a several-GPU machine.

``serve_bench.py`` can run one engine per GPU of a multi-GPU machine at once
(``scripts/gpu/on_each_gpu.sh``). That is only fair if one GPU's loads do not slow its neighbours':
GPUs behind one PCIe switch share its uplink, and all of them share the host's memory bandwidth.
This probe answers it before such a run: one process per visible GPU, each with its own pinned
1 GiB host buffer, copies ``REPS`` contiguous 1 GiB copies per direction

- ``alone``: one GPU at a time (the others wait at a barrier);
- ``together``: every GPU at once (released by one barrier),

and prints per GPU the median GB/s of each, their ratio and the sum over GPUs. A ratio near 1.0 on
every GPU means parallel engine starts measure what a lone start would.

Usage (GPU machine): ``python3 benchmarks/probes/neighbor_probe.py`` (``REPS``, default 8). Prints a
table and writes ``neighbor_probe.json`` to ``$OUT``. Threading: a script; one spawned process per
GPU, each single-threaded; they meet only at ``multiprocessing`` barriers.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

NBYTES = 1 << 30
REPS = int(os.environ.get("REPS", "8"))
DIRECTIONS = ("h2d", "d2h")


def _copies(torch, host, dev, direction: str, reps: int) -> list[float]:
    """GB/s of ``reps`` copies of ``host`` <-> ``dev``, each event-timed."""
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if direction == "h2d":
            dev.copy_(host, non_blocking=True)
        else:
            host.copy_(dev, non_blocking=True)
        end.record()
        end.synchronize()
        out.append(NBYTES / (start.elapsed_time(end) / 1e3) / 1e9)
    return out


def _child(rank: int, n: int, barrier, results) -> None:
    """One GPU's side: warm up, then the alone rounds (one GPU per round) and the together round."""
    import torch
    torch.cuda.set_device(rank)
    host = torch.empty(NBYTES, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(NBYTES, dtype=torch.uint8, device="cuda")
    for d in DIRECTIONS:
        _copies(torch, host, dev, d, 2)
    row = {"gpu": rank, "name": torch.cuda.get_device_name(rank)}
    for d in DIRECTIONS:
        for turn in range(n):
            barrier.wait()
            if turn == rank:
                row[f"{d}_alone"] = statistics.median(_copies(torch, host, dev, d, REPS))
        barrier.wait()
        row[f"{d}_together"] = statistics.median(_copies(torch, host, dev, d, REPS))
    results[rank] = row


def main() -> None:
    """Spawn one process per visible GPU, collect their rows, print and write them."""
    import torch
    n = torch.cuda.device_count()
    if n == 0:
        raise SystemExit("neighbor_probe: no CUDA device visible (run it on the GPU machine)")
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(n), ctx.Manager().dict()
    procs = [ctx.Process(target=_child, args=(r, n, barrier, results)) for r in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    bad = [p.exitcode for p in procs if p.exitcode]
    if bad or len(results) != n:
        raise SystemExit(f"neighbor_probe: {n - len(results)} of {n} GPU processes failed (exit codes {bad})")
    rows = [dict(results[r]) for r in range(n)]
    for r in rows:
        for d in DIRECTIONS:
            r[f"{d}_ratio"] = round(r[f"{d}_together"] / r[f"{d}_alone"], 3)
            r[f"{d}_alone"], r[f"{d}_together"] = round(r[f"{d}_alone"], 2), round(r[f"{d}_together"], 2)
    total = {"gpu": "sum", **{f"{d}_{k}": round(sum(r[f"{d}_{k}"] for r in rows), 1)
                              for d in DIRECTIONS for k in ("alone", "together")}}
    from probe_report import emit
    emit("neighbor_probe", rows + [total],
         ["gpu", "h2d_alone", "h2d_together", "h2d_ratio", "d2h_alone", "d2h_together", "d2h_ratio"],
         gpus=n, reps=REPS, bytes=NBYTES)


if __name__ == "__main__":
    main()
