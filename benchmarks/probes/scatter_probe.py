"""How long a staged in-step load holds the caller's thread with each scatter, on the GPU machine.

Round 25 (H200, Qwen2.5-7B compiled c8, docs/notes/2026-12-01-gpu-round25.md) found the prefill steps bound by vLLM's
thread and a one-load step's ``start_load_kv`` at 1.7-2.0 ms: the staged load's scatter is an ``index_put_`` per
layer tensor there. This probe sets the two scatters side by side (``staged_scatter: index_put`` and ``kernel``, the
one launch over the layout's table on the device, ``tiered_kv/copy/scatter_table.py``) on that model's per-layer
KV tensors (28 layers, 4 KV heads of 128, 16-token blocks, bf16: 32 KiB a layer-block) for the loads of that run's
c8 waves: 82 blocks (one request's prefix) and 574 (seven), slots in runs of 16 (how a request's chunks lie in the
CPU tier), in 2 layer groups (a copy within ``load_ahead_bytes``) and in 7 of 4 layers, one call per group as a
pipelined in-step load submits them. Groups of fewer rectangle rows than ``staged.SCATTER_KERNEL_MIN_ROWS`` keep
``index_put_`` even with the kernel on: the 7-group rows then time ``index_put_`` twice (their spread), and
``launches`` (the kernel's launches in the case's last call) says which ran. Per case, median over ``REPS`` calls
after one warm-up call:

- ``call_ms``: host time of the calls (what the forward's launch waits for);
- ``landed_ms``: GPU time from the first call's submission to the last group landed;
- ``equal``: the blocks' bytes equal the slab rows they were loaded from (every layer, every block).

Prints a table and writes ``scatter_probe.json`` to ``$OUT`` (default: current directory). Usage:
``python3 benchmarks/probes/scatter_probe.py``. Threading: a script; main thread only.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tiered_kv.copy import BlockCopier, Mechanism, allocate_slab, prepare_copier, vllm_layer_layout  # noqa: E402
from tiered_kv.copy.testing import Shape  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_report import emit  # noqa: E402

QWEN2_5_7B = Shape(layers=28, heads=4, block_size=16, head_dim=128, num_blocks=4096)
LOADS = (82, 574)
CHUNK = 16
REPS = 9


def kv_tensors(s: Shape) -> list[torch.Tensor]:
    """vLLM 0.26's per-layer ``(B, N, H, 2D)`` bf16 tensors, viewed ``(B, H, N, 2D)`` as the connector sees them."""
    return [torch.empty((s.num_blocks, s.block_size, s.heads, 2 * s.head_dim), dtype=torch.bfloat16,
                        device="cuda").permute(0, 2, 1, 3) for _ in range(s.layers)]


def loaded_equal(layout, slab: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor) -> bool:
    """Whether every layer's chunks of block ``ids[i]`` hold the bytes of slab row ``slots[i]`` at their slot
    offsets (read through each tensor's storage, in the layout's own byte order)."""
    rows = slab[slots].cuda()
    dev_ids = ids.cuda()
    for t, m in zip(layout.tensors, layout.maps):
        flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        base = m.base_ptr - t.untyped_storage().data_ptr()
        pos = m.slot_offset
        for off, size in zip(m.chunk_offsets, m.chunk_sizes):
            idx = base + off + dev_ids[:, None] * m.block_stride + torch.arange(size, device=t.device)
            if not torch.equal(flat[idx], rows[:, pos:pos + size]):
                return False
            pos += size
    return True


def measure(copier: BlockCopier, slots: torch.Tensor, ids: torch.Tensor, groups: list[tuple[int, int]]) -> dict:
    """Median host ms of one load's calls (one per group, the ids checked once) and GPU ms until the last landed."""
    stream = torch.cuda.current_stream()
    calls, landed = [], []
    for rep in range(REPS + 1):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        t0 = time.perf_counter()
        pair = copier.load_indices(slots, ids)
        res = [r for i, g in enumerate(groups) for r in copier.cpu_to_gpu_grouped(
            *pair, [g], stream=stream, mechanism=Mechanism.STAGED, ordered=i == 0, checked=True)]
        call = (time.perf_counter() - t0) * 1e3
        res[-1].wait_on(stream)
        end.record(stream)
        end.synchronize()
        if rep:
            calls.append(call)
            landed.append(start.elapsed_time(end))
    return {"call_ms": round(statistics.median(calls), 3), "landed_ms": round(statistics.median(landed), 3)}


def main() -> None:
    """Run every case, print the table, write the JSON."""
    s = QWEN2_5_7B
    gen = torch.Generator().manual_seed(5)
    layout = vllm_layer_layout(kv_tensors(s), "vllm")
    slab = allocate_slab(max(LOADS) + 64, layout.block_nbytes, pin=True)
    slab.random_(0, 256, generator=gen)
    rows = []
    for scatter in ("index_put", "kernel"):
        copier = BlockCopier(layout, slab, threaded_submit=False, scatter_kernel=scatter == "kernel")
        ready = prepare_copier(copier, [Mechanism.STAGED])
        table = copier._staged._table if copier._staged is not None else None
        launched: list[bool] = []  # what each of the table's launches returned (True: the kernel ran)
        if table is not None:
            def counted(*args, _launch=table.launch):
                ok = _launch(*args)
                launched.append(ok)
                return ok

            table.launch = counted
        for n in LOADS:
            runs = -(-n // CHUNK)
            slots = (torch.randperm(slab.shape[0] // CHUNK, generator=gen)[:runs][:, None] * CHUNK
                     + torch.arange(CHUNK)).reshape(-1)[:n]
            ids = torch.randperm(s.num_blocks, generator=gen)[:n]
            for count in (2, 7):
                per = -(-s.layers // count)
                groups = [(a, min(s.layers, a + per)) for a in range(0, s.layers, per)]
                rec = {"scatter": scatter, "blocks": n, "mb": round(n * layout.block_nbytes / 1e6, 1),
                       "groups": len(groups), "table": table is not None, "prepared": sorted(m.value for m in ready)}
                launched.clear()
                try:
                    rec.update(measure(copier, slots, ids, groups))
                    rec["launches"] = sum(launched) // (REPS + 1)  # kernel launches a call (every call alike)
                    torch.cuda.synchronize()
                    rec["equal"] = loaded_equal(layout, slab, slots, ids)
                except Exception as exc:  # noqa: BLE001 - a case that cannot run: say so
                    rec["error"] = repr(exc)[:200]
                rows.append(rec)
                print(rec, flush=True)
        copier.close()
    emit("scatter_probe", rows, ["scatter", "blocks", "mb", "groups", "table", "launches", "call_ms", "landed_ms",
                                 "equal"])


if __name__ == "__main__":
    main()
