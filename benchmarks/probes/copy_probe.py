"""Where the time of one batched copy goes (issue 5: the 256-blocks-per-call gap), on the GPU machine.

For 256 random Llama-3-8B-shaped blocks (2 MiB each; ``LBNHC``: 8,192 runs of 64 KiB,
``BLHNC``: 256 runs of 2 MiB) in each direction, it measures:

- ``engine_ms``: copy-engine time alone: every descriptor is queued behind a GPU sleep kernel, so
  the host's planning and driver calls are done before the first byte moves; CUDA events time
  the copy itself. The same for one contiguous pinned copy of the same bytes (``contig_ms``);
- ``call_ms``: ``BlockCopier`` from the call to its event firing, as ``benchmarks/gpu_copy.py``
  times it, for variants: the default; no ``PREFER_OVERLAP_WITH_COMPUTE`` flag; submission on the
  caller's thread; one driver call for the whole list (no growing slices);
- ``stream_gbps``: 8 calls back to back (each waits for nothing), total bytes / total time, next to
  8 back-to-back contiguous copies: the rate a mover that keeps a queue of copies sees.

Prints a table and writes ``copy_probe.json`` to ``$OUT`` (default: current directory).
Usage: ``python3 benchmarks/probes/copy_probe.py``. Threading: a script; main thread only.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tiered_kv.copy import BlockCopier, Mechanism, plan_runs, vllm_layer_layout  # noqa: E402
from tiered_kv.copy import dispatch, engine  # noqa: E402
from tiered_kv.copy.engine import BatchMemcpy  # noqa: E402
from tiered_kv.copy.testing import storages, vllm033_views  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_report import LLAMA3_8B, emit  # noqa: E402

SHAPE = LLAMA3_8B
N = 256
REPS = 9


def _sleep_then(stream: torch.cuda.Stream) -> None:
    """Keep ``stream`` busy ~20 ms so everything queued after this starts only once the host is done."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(40_000_000)


def _gpu_ms(enqueue) -> float:
    """Median GPU ms of what ``enqueue(stream)`` puts on a stream kept busy by a sleep kernel meanwhile."""
    s = torch.cuda.Stream()
    out = []
    for _ in range(REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        _sleep_then(s)
        start.record(s)
        enqueue(s)
        end.record(s)
        end.synchronize()
        out.append(start.elapsed_time(end))
    return statistics.median(out)


def engine_only(copier: BlockCopier, ids: torch.Tensor, slots: torch.Tensor, to_cpu: bool) -> float:
    """Median ms the copy engine needs for the runs of one call, with submission finished beforehand."""
    runs = plan_runs(copier._gpu.table, ids, slots, copier.slab.data_ptr(), copier.slab.stride(0), to_cpu)
    eng = BatchMemcpy()
    return _gpu_ms(lambda s: eng.submit(runs, s.cuda_stream))


def contig_only(host: torch.Tensor, dev: torch.Tensor, nbytes: int, to_cpu: bool) -> float:
    """Median ms of one contiguous pinned copy of ``nbytes``, queued behind a sleep like ``engine_only``."""

    def enqueue(s: torch.cuda.Stream) -> None:
        with torch.cuda.stream(s):
            if to_cpu:
                host[:nbytes].copy_(dev[:nbytes], non_blocking=True)
            else:
                dev[:nbytes].copy_(host[:nbytes], non_blocking=True)

    return _gpu_ms(enqueue)


def call_time(copier: BlockCopier, ids, slots, to_cpu: bool, calls: int = 1) -> float:
    """Median ms from the first call to the last result landing, ``calls`` calls back to back."""
    fn = copier.gpu_to_cpu if to_cpu else copier.cpu_to_gpu
    a, b = (ids, slots) if to_cpu else (slots, ids)
    fn(a, b, mechanism=Mechanism.COPY_ENGINE).wait()
    out = []
    for _ in range(REPS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = [fn(a, b, mechanism=Mechanism.COPY_ENGINE) for _ in range(calls)]
        for r in res:
            r.wait()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def contig_calls(host, dev, nbytes: int, to_cpu: bool, calls: int = 1) -> float:
    """Median ms of ``calls`` contiguous copies back to back, call to event (like ``call_time``)."""
    s = torch.cuda.Stream()
    out = []
    for _ in range(REPS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(s):
            for _ in range(calls):
                if to_cpu:
                    host[:nbytes].copy_(dev[:nbytes], non_blocking=True)
                else:
                    dev[:nbytes].copy_(host[:nbytes], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(s)
        ev.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def main() -> None:
    """Run every probe, print the table, write the JSON."""
    rows = []
    gen = torch.Generator().manual_seed(11)
    block = 2 << 20
    host = torch.empty(4096 * block // 4, dtype=torch.uint8, pin_memory=True)  # 2 GiB
    dev = torch.empty(N * block, dtype=torch.uint8, device="cuda")
    slab = host.view(-1, block)
    for order in ("LBNHC", "BLHNC"):
        layout = vllm_layer_layout(vllm033_views(order, SHAPE, torch.bfloat16, "cuda"), f"vllm:{order}")
        for flat in storages(layout):
            flat.random_(0, 256)
        ids = torch.randperm(SHAPE.num_blocks, generator=gen)[:N]
        slots = torch.randperm(slab.shape[0], generator=gen)[:N]
        nbytes = N * layout.block_nbytes
        for to_cpu in (True, False):
            d = "d2h" if to_cpu else "h2d"
            base = BlockCopier(layout, slab)
            rec = {"layout": order, "direction": d, "blocks": N, "nbytes": nbytes,
                   "runs": base.plan(ids, slots, to_cpu).count}
            rec["engine_ms"] = round(engine_only(base, ids, slots, to_cpu), 3)
            rec["contig_ms"] = round(contig_only(host, dev, nbytes, to_cpu), 3)
            rec["call_ms_default"] = round(call_time(base, ids, slots, to_cpu), 3)
            rec["contig_call_ms"] = round(contig_calls(host, dev, nbytes, to_cpu), 3)
            base.close()
            variants = {
                "no_overlap_flag": dict(prefer_overlap=False),
                "inline_submit": dict(threaded_submit=False),
            }
            for name, opts in variants.items():
                c = BlockCopier(layout, slab, **opts)
                rec[f"call_ms_{name}"] = round(call_time(c, ids, slots, to_cpu), 3)
                c.close()
            saved = (dispatch.FIRST_SLICE_BLOCKS, engine.FIRST_SLICE)
            dispatch.FIRST_SLICE_BLOCKS, engine.FIRST_SLICE = 1 << 20, 1 << 20
            try:
                c = BlockCopier(layout, slab, max_runs_per_call=1 << 20)
                rec["call_ms_one_driver_call"] = round(call_time(c, ids, slots, to_cpu), 3)
                c.close()
            finally:
                dispatch.FIRST_SLICE_BLOCKS, engine.FIRST_SLICE = saved
            c = BlockCopier(layout, slab)
            rec["stream8_ms"] = round(call_time(c, ids, slots, to_cpu, calls=8), 3)
            c.close()
            rec["contig_stream8_ms"] = round(contig_calls(host, dev, nbytes, to_cpu, calls=8), 3)
            rec["stream_gbps"] = round(8 * nbytes / rec["stream8_ms"] / 1e6, 2)
            rec["contig_stream_gbps"] = round(8 * nbytes / rec["contig_stream8_ms"] / 1e6, 2)
            rows.append(rec)
            print(json.dumps(rec), flush=True)
    emit("copy_probe", rows, [k for k in rows[0] if k not in ("blocks", "nbytes")])

if __name__ == "__main__":
    main()
