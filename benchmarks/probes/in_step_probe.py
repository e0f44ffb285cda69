"""How long an in-step load holds vLLM's thread, against when its bytes land (issue 3), on the GPU machine.

The vLLM connector submits an in-step load on vLLM's own thread before the forward is launched
(``BlockCopier.cpu_to_gpu_grouped`` with inline submission), so every millisecond the call holds
the thread delays the forward's launch. For the turn-2 load of ``benchmarks/vllm_ttft.py`` (512
random Llama-3-8B-shaped blocks, 1 GiB) into vLLM 0.26's cross-layer KV tensor and into separate
per-layer tensors, for several layer-group counts and the three mechanisms (the staged load also as one call per
layer group, as a pipelined in-step load submits them, from slots in runs of 16, as a request's chunks lie in
the CPU tier, with its column ranges as the driver's batched 2-D copies, off by default since round 16:
``staged.RECT_BATCH``, and with the scatter as one Triton launch over the layout's table on the device, off by
default too: the ``staged_scatter`` key, ``scatter_table.py``), it measures:

- ``call_ms``: host time of the call (what the forward's launch waits for);
- ``first_ms`` / ``landed_ms``: GPU time from the submission point to the first / last group landed;
- ``gbps``: bytes / ``landed_ms``;
- ``cold_call_ms`` / ``cold_landed_ms``: the same of each case's first call, left out of the medians (the first
  case's is the process's first copy through our path, a new copier: in an engine that falls on turn 1's first
  stores, not on its first loading step, whose 9-16 ms excess in round 22 lay outside ``start_load_kv``).

``--warm``: each copier first runs ``copy.warm_copy_paths`` (what the vLLM connector does at start-up: the copiers
prepared, one block's round trip through a private slab; ``warmed_ms`` in the JSON, None where it failed), so the
first row's cold columns say what that leaves of a process's first in-step load (run it in its own process: the
cold columns are a process's first calls).

Prints a table and writes ``in_step_probe.json`` to ``$OUT`` (default: current directory; ``--warm``:
``in_step_probe_warm.json``). Usage: ``python3 benchmarks/probes/in_step_probe.py [--warm]``. Threading: a script;
main thread only.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import tiered_kv.copy.staged as staged_mod  # noqa: E402
from tiered_kv.copy import BlockCopier, Mechanism, allocate_slab, vllm_layer_layout, warm_copy_paths  # noqa: E402
from tiered_kv.copy.testing import storages  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_report import LLAMA3_8B, emit  # noqa: E402

SHAPE = LLAMA3_8B
N = 512
CHUNK = 16  # a 256-token chunk of 16-token blocks: the slots a chunk takes in the CPU tier are adjacent
REPS = 7
WARM = "--warm" in sys.argv[1:]


def kv_views(cross_layer: bool) -> list[torch.Tensor]:
    """Per-layer ``(B, H, N, 2D)`` bf16 views: of one ``(B, L, N, H, 2D)`` tensor, or separate NHD tensors."""
    s = SHAPE
    if cross_layer:
        whole = torch.empty((s.num_blocks, s.layers, s.block_size, s.heads, 2 * s.head_dim), dtype=torch.bfloat16,
                            device="cuda")
        return [whole[:, i].permute(0, 2, 1, 3) for i in range(s.layers)]
    return [torch.empty((s.num_blocks, s.block_size, s.heads, 2 * s.head_dim), dtype=torch.bfloat16,
                        device="cuda").permute(0, 2, 1, 3) for _ in range(s.layers)]


def measure(copier: BlockCopier, slots, ids, groups, mech: Mechanism, per_group: bool = False) -> dict:
    """Median host call ms and GPU first/last landed ms of one grouped in-step load. ``per_group``: one call per
    layer group, as a pipelined in-step load submits them, with the ids checked once (``load_indices``); ``call_ms``
    is then the host time of all the calls together."""
    stream = torch.cuda.current_stream()
    calls, firsts, lasts, cold = [], [], [], {}
    for rep in range(REPS + 1):
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        aux = torch.cuda.Stream()
        start.record(stream)
        t0 = time.perf_counter()
        if per_group:
            pair = copier.load_indices(slots, ids)
            res = [r for i, g in enumerate(groups) for r in copier.cpu_to_gpu_grouped(
                *pair, [g], stream=stream, mechanism=mech, ordered=i == 0, checked=True)]
        else:
            res = copier.cpu_to_gpu_grouped(slots, ids, groups, stream=stream, mechanism=mech)
        call = (time.perf_counter() - t0) * 1e3
        res[0].wait_on(aux)
        first.record(aux)
        res[-1].wait_on(aux)
        last.record(aux)
        last.synchronize()
        if not rep:  # the first call warms up: kept apart
            cold = {"cold_call_ms": round(call, 3), "cold_landed_ms": round(start.elapsed_time(last), 3)}
        else:
            calls.append(call)
            firsts.append(start.elapsed_time(first))
            lasts.append(start.elapsed_time(last))
    med = statistics.median
    return {"call_ms": round(med(calls), 3), "first_ms": round(med(firsts), 3), "landed_ms": round(med(lasts), 3),
            "gbps": round(N * copier.layout.block_nbytes / med(lasts) / 1e6, 1), **cold}


def main() -> None:
    """Run every case, print the table, write the JSON."""
    gen = torch.Generator().manual_seed(3)
    block = 2 << 20
    slab = torch.empty((2 * N, block), dtype=torch.uint8, pin_memory=True)
    slab.random_(0, 256)
    rows, warmed_ms = [], []
    for cross in (True, False):
        layout = vllm_layer_layout(kv_views(cross), "vllm")
        for flat in storages(layout):
            flat.zero_()
        ids = torch.randperm(SHAPE.num_blocks, generator=gen)[:N]
        slots = torch.randperm(slab.shape[0], generator=gen)[:N]
        # how a request's chunks lie in the CPU tier: runs of CHUNK adjacent slots, the runs in random order
        chunked = (torch.randperm(slab.shape[0] // CHUNK, generator=gen)[:N // CHUNK][:, None] * CHUNK
                   + torch.arange(CHUNK)).reshape(-1)
        copier = BlockCopier(layout, slab, threaded_submit=False)
        if WARM:  # as the connector does at start-up (its scratch copiers: a private slab)
            scratch = BlockCopier(layout, allocate_slab(1, layout.block_nbytes, pin=True))
            seconds = warm_copy_paths([copier], [scratch], "auto", "in_step_probe")
            warmed_ms.append(None if seconds is None else round(seconds * 1e3, 1))
            print("warm-up FAILED (see the log): the cold columns are unwarmed" if seconds is None
                  else f"warmed in {warmed_ms[-1]} ms", flush=True)
        for count in (1, 4, 8, 16, 32):
            per = SHAPE.layers // count
            groups = [(a, a + per) for a in range(0, SHAPE.layers, per)]
            cases = [(m, False, slots, "") for m in (Mechanism.COPY_ENGINE, Mechanism.SM_KERNEL, Mechanism.STAGED)]
            cases += [(Mechanism.STAGED, True, slots, "")] if count > 1 else []
            cases += [(Mechanism.STAGED, False, chunked, "")]
            # beside them: column ranges as the driver's batched 2-D copies (layer groups; off by default,
            # staged.RECT_BATCH: a 2-D call a long run and 1-D descriptors otherwise), and (whole rows) the scatter
            # as one Triton launch over a table of runs (index_put_ per rectangle otherwise)
            cases += [(Mechanism.STAGED, False, w, ", batched 2-D") for w in (slots, chunked)] if count > 1 else []
            one = ", one-launch scatter"
            cases += [(Mechanism.STAGED, False, w, one) for w in (slots, chunked)] if count == 1 else []
            for mech, per_group, which, variant in cases:
                rec = {"kv": "cross-layer" if cross else "per-layer", "groups": count, "mechanism": mech.value,
                       "calls": ("one per group" if per_group else "one") + variant,
                       "slots": "random" if which is slots else f"runs of {CHUNK}",
                       "runs": copier.plan(ids, which, False).count if count == 1 else None}
                loader = copier._staged_loader()
                kept = loader._rect_batch
                if variant == ", batched 2-D":
                    staged_mod.RECT_BATCH, loader._rect_batch = True, None  # bound again at the first DMA
                if variant == one:  # the layout's table on the device and the kernel compiled, as at start-up
                    loader.scatter_kernel = True
                    loader.prepare()
                try:
                    rec.update(measure(copier, which, ids, groups, mech, per_group))
                except Exception as exc:  # noqa: BLE001 - a mechanism that cannot take this case: say so
                    rec["error"] = repr(exc)[:200]
                finally:
                    loader._rect_batch = kept
                    staged_mod.RECT_BATCH = False
                    loader.scatter_kernel, loader._table = False, None
                rows.append(rec)
                print(json.dumps(rec), flush=True)
        copier.close()
        del layout
        torch.cuda.empty_cache()
    cols = ["kv", "groups", "mechanism", "calls", "slots", "call_ms", "first_ms", "landed_ms", "gbps", "cold_call_ms",
            "cold_landed_ms"]
    if WARM:
        emit("in_step_probe_warm", rows, cols, command="python3 benchmarks/probes/in_step_probe.py --warm",
             warmed_ms=warmed_ms)
    else:
        emit("in_step_probe", rows, cols)

if __name__ == "__main__":
    main()
