"""Does the kind of pinned host memory change the copy rate? (issues 3 and 5), on the GPU machine.

The vLLM connector's CPU tier is one large slab of ordinary memory page-locked with
``cudaHostRegister`` (``tiered_kv/tiers/cpu.py``); ``benchmarks/gpu_copy.py`` copies from torch's
pinned memory (``cudaHostAlloc``). A debug run of the vLLM benchmark saw a 1 GiB load from the tier
land at ~30 GB/s where the copy benchmark moves the same runs at ~51 GB/s. This probe puts the
same copies on each kind of host memory, one after the other in one process:

- ``torch_pinned``: ``torch.empty(..., pin_memory=True)``;
- ``tier``: a ``CpuTier`` exactly as shipped (ordinary 4 KiB pages registered in the
  background; the probe waits for pinning to end);
- ``registered_thp``: the same allocation with transparent huge pages asked for
  (``madvise(MADV_HUGEPAGE)``) before it is registered.

Measured 2026-11-22 on the H200 (``docs/benchmarks.md``): all three move 1 GiB at 55 GB/s in
the copy engine; huge pages only made pinning slower, so the tier does not ask for them.

For each: pinning time, the process's ``AnonHugePages`` growth, and copy-engine milliseconds
(event-timed, queued behind a GPU sleep so host work is excluded) of one contiguous 1 GiB copy and
of 512 random Llama-3-8B-shaped blocks (1 GiB: the vLLM benchmark's turn-2 load) in block-outermost
``BLHNC`` (512 runs of 2 MiB) and per-layer ``LBNHC`` (16,384 runs of 64 KiB), both directions;
plus the call-to-event time of the ``BLHNC`` call through ``BlockCopier``.

Prints a table and writes ``host_memory_probe.json`` to ``$OUT`` (default: current directory).
Usage: ``python3 benchmarks/probes/host_memory_probe.py`` (``SLAB_GIB``, default 8). Threading: a
script; main thread only (the tier's pinning thread is joined before measuring).
"""
from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import copy_probe  # noqa: E402
from probe_report import LLAMA3_8B, emit  # noqa: E402
from tiered_kv.copy import BlockCopier, vllm_layer_layout  # noqa: E402
from tiered_kv.copy.testing import storages, vllm033_views  # noqa: E402
from tiered_kv.values.layout import BlockLayout  # noqa: E402
from tiered_kv.tiers import cpu as cpu_tier  # noqa: E402

SHAPE = LLAMA3_8B
BLOCK = 2 << 20
N = 512
SLAB_GIB = int(os.environ.get("SLAB_GIB", "8"))


def anon_huge_kib() -> int:
    """This process's ``AnonHugePages`` in KiB (0 where the kernel does not say)."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def thp_mode() -> str:
    """The kernel's transparent-huge-page setting, e.g. ``always [madvise] never``."""
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        return "unknown"


def _advise_huge_pages(addr: int, nbytes: int) -> bool:
    """``madvise(MADV_HUGEPAGE)`` on the 2 MiB-aligned interior of ``[addr, addr + nbytes)``."""
    huge = 2 << 20
    lo, hi = -(-addr // huge) * huge, (addr + nbytes) // huge * huge
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 14) == 0  # 14 = MADV_HUGEPAGE


def make_slab(kind: str):
    """``(slab (rows, 2 MiB) uint8, closer, pin seconds, huge-page advice taken)`` for one kind."""
    rows = SLAB_GIB * 1024 * 1024 * 1024 // BLOCK
    t0 = time.perf_counter()
    if kind == "torch_pinned":
        slab = torch.empty((rows, BLOCK), dtype=torch.uint8, pin_memory=True)
        return slab, (lambda: None), time.perf_counter() - t0, False
    if kind == "tier":
        tier = cpu_tier.CpuTier(BlockLayout((BLOCK,), "uint8"), rows * BLOCK)
        tier.wait_pinned()
        return tier.slab, tier.close, time.perf_counter() - t0, False
    # registered_thp: the tier's allocation, huge pages asked for before the pages are touched
    slab = cpu_tier.aligned_empty(rows, BLOCK)
    storage = slab.untyped_storage()
    advised = _advise_huge_pages(storage.data_ptr(), storage.nbytes())
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(storage.data_ptr(), storage.nbytes(), 1)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {storage.nbytes()} bytes failed: {err}")
    return slab, (lambda: cudart.cudaHostUnregister(storage.data_ptr())), time.perf_counter() - t0, advised


def main() -> None:
    """Measure every kind of host memory, print the table, write the JSON."""
    gen = torch.Generator().manual_seed(5)
    dev = torch.empty(N * BLOCK, dtype=torch.uint8, device="cuda")
    layouts = {}
    for order in ("BLHNC", "LBNHC"):
        lay = vllm_layer_layout(vllm033_views(order, SHAPE, torch.bfloat16, "cuda"), f"vllm:{order}")
        for flat in storages(lay):
            flat.random_(0, 256)
        layouts[order] = lay
    ids = torch.randperm(SHAPE.num_blocks, generator=gen)[:N]
    rows = []
    for kind in ("torch_pinned", "tier", "registered_thp"):
        huge0 = anon_huge_kib()
        slab, close, pin_s, advised = make_slab(kind)
        rec = {"kind": kind, "slab_gib": SLAB_GIB, "pin_s": round(pin_s, 2), "thp_advised": advised,
               "anon_huge_gib": round((anon_huge_kib() - huge0) / 2**20, 2),
               "pinned": bool(slab.is_pinned())}
        slots = torch.randperm(slab.shape[0], generator=gen)[:N]
        flat = slab.view(-1)
        for to_cpu in (False, True):
            d = "d2h" if to_cpu else "h2d"
            rec[f"contig_{d}_ms"] = round(copy_probe.contig_only(flat, dev, N * BLOCK, to_cpu), 3)
            for order, lay in layouts.items():
                c = BlockCopier(lay, slab)
                rec[f"{order}_{d}_ms"] = round(copy_probe.engine_only(c, ids, slots, to_cpu), 3)
                if order == "BLHNC":
                    rec[f"{order}_{d}_call_ms"] = round(copy_probe.call_time(c, ids, slots, to_cpu), 3)
                c.close()
        for k in [k for k in rec if k.endswith("_ms")]:
            rec[k.replace("_ms", "_gbps")] = round(N * BLOCK / rec[k] / 1e6, 1)
        rows.append(rec)
        print(json.dumps(rec), flush=True)
        del slab, flat
        close()
    cols = ["kind", "pin_s", "anon_huge_gib", "contig_h2d_gbps", "BLHNC_h2d_gbps", "BLHNC_h2d_call_gbps",
            "LBNHC_h2d_gbps", "contig_d2h_gbps", "BLHNC_d2h_gbps", "BLHNC_d2h_call_gbps", "LBNHC_d2h_gbps"]
    print(f"THP: {thp_mode()}")
    emit("host_memory_probe", rows, cols, thp=thp_mode())

if __name__ == "__main__":
    main()
