"""The in-step disk load's AIO lanes on a memory file system: read rate and group 0's readiness by lane count.

2026-11-30: a disk tier at ``/dev/shm/tkv-disk`` on the GPU machine (its kernel takes O_DIRECT on tmpfs) read
through Linux AIO, where ``io_submit`` copies each read inside the call: one submit of 128 reads made layer group 0
ready only once the whole chunk was read, and one thread copied at one core's speed. ``tiers/disk/aio.py`` submits
in the batches a caller asks for, and ``InStepDiskLoader`` reads such a file on ``AIO_LANES_MEMORY_FS`` lanes, each
submitting one layer group's share of its reads at a time (at least 16). This probe runs the loader itself on the
CPU, its reads only (no GPU blocks to copy into: the copies are the GPU's business): records of 4 blocks of a
Llama-3-8B shape (32 layers, 64 KiB a layer-block: 8 MiB a record, 256 KiB a range, 8 layer groups) on a disk tier
in ``--dir``, one step at a time (``submit``; ``ready`` for group 0, as the forward's first layer waits;
``finish``), with 1, 2, 4 ... lanes, and once with one lane and the single submits of 128 reads of before; idle and
beside a thread spinning Python bytecode (vLLM's, launching an eager forward). Per cell: the reads' rate (the step's
bytes over the loader's read seconds), when group 0 was ready after ``submit`` (ms), and the step's wall time (reads
and verification); every step's staging is checked against the records.

Usage: ``python benchmarks/probes/aio_lanes.py --out aio_lanes.json`` (``--dir``, ``--mib``, ``--lanes``,
``--reps``); prints a table, writes the JSON to ``--out``. About 15 s on the 2-core CPU box.
Threading: a script; the loader's threads and one spinning thread, stopped before each measurement ends.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.probes.remote_ranges import Spinner  # noqa: E402
from tiered_kv.connector.vllm import in_step_disk  # noqa: E402
from tiered_kv.connector.vllm.config import ConnectorConfig, overlap_spans  # noqa: E402
from tiered_kv.copy import vllm_layer_layout  # noqa: E402
from tiered_kv.copy.testing import Shape, vllm026_tensors  # noqa: E402
from tiered_kv.tiers.disk import DiskTier  # noqa: E402
from tiered_kv.tiers.disk.aio import AioReader, aio_available  # noqa: E402
from tiered_kv.tiers.disk.slots import file_system_type  # noqa: E402
from tiered_kv.values.jobs import NO_SLOT, JobKind, TransferJob  # noqa: E402
from tiered_kv.values.layout import BlockLayout  # noqa: E402

K = 4  # blocks a record (a chunk)
DISK, DST = 1, 2  # chain indices of the job (only their names matter here)


def _setup(root: Path, records: int, layers: int):
    """The disk tier in ``root`` with ``records`` records, the CPU KV tensors, and what a loader needs."""
    shape = Shape(layers=layers, heads=8, block_size=16, head_dim=128, num_blocks=records * K)
    layout = vllm_layer_layout(vllm026_tensors("NHD", shape, torch.bfloat16, "cpu"))
    chunk = K * layout.block_nbytes
    disk = DiskTier(BlockLayout((chunk,), "uint8"), root / "disk", 2 * records * chunk)
    if not disk.slots.direct:
        disk.close()
        raise SystemExit(f"{root} refuses O_DIRECT: the disk tier reads it with threads, not AIO")
    keys = [uuid.uuid4().bytes for _ in range(records)]
    rows = torch.randint(0, 256, (records, chunk), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    assert all(disk.write(keys, [NO_SLOT] * records, rows))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]  # no copies: only the loader's bookkeeping
    cfg = ConnectorConfig(disk_path=str(root / "disk"), disk_overlap_bytes=records * chunk)
    cpu_slab = torch.empty((records, chunk), dtype=torch.uint8)

    def flat(job, slots, items):  # no GPU blocks: nothing to copy, the reads alone
        return [([], [])]

    def loader(lanes: int, batch: int | None = None):
        in_step_disk.AIO_LANES_MEMORY_FS = lanes
        made = in_step_disk.InStepDiskLoader(layout, names, cfg, 0, {DISK: disk}, chunk, K, flat, False, cpu_slab)
        if batch is not None:  # the single submit of before: one reader, ``batch`` reads a submit
            for lane in made._lanes:
                lane.close()
            made._lanes = [AioReader(in_step_disk.AIO_DEPTH, submit_batch=batch)]
            # and the disk path's submits (the whole depth), not the memory file system's one group's share a submit
            made._memory_fs = {t: False for t in made._memory_fs}
        return made

    def job(n: int) -> TransferJob:  # a step's load of the first n records
        return TransferJob(n, JobKind.EGRESS, DISK, DST, keys[:n], [NO_SLOT] * n, [NO_SLOT] * n)

    return disk, loader, job, rows, overlap_spans(layers)[0][1]


def _rate_alone(spin: Spinner) -> float:
    """The spinning thread's rate over 50 ms with nothing else to do; marks again for what follows."""
    spin.mark()
    time.sleep(0.05)
    rate = spin.rate()
    spin.mark()
    return rate


def _step(loader, job, rows: torch.Tensor, group0: int, spin: Spinner | None) -> dict:
    """One step: submit, wait for group 0 (``ready``), finish; the reads' seconds, group 0's readiness, the wall
    time and, beside ``spin``, its rate during the step over its rate alone just before."""
    alone = _rate_alone(spin) if spin is not None else None
    read0 = loader.counters.overlap_read_seconds
    loader.staging.zero_()
    loader.start(job)
    t0 = time.perf_counter()
    loader.submit(layerwise_ok=True)
    loader.ready(group0)
    first = time.perf_counter()
    (_, done), = loader.finish()
    wall = time.perf_counter() - t0
    kept = spin.rate() / alone if spin is not None else None
    assert not any(done.corrupt) and torch.equal(loader.staging[:len(rows)], rows), done
    return {"read_s": loader.counters.overlap_read_seconds - read0, "group0_ms": (first - t0) * 1e3,
            "wall_ms": wall * 1e3, "spinner_kept": kept}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/dev/shm", help="where the disk tier goes (default /dev/shm)")
    ap.add_argument("--mib", default="32,256", help="bytes read a step, MiB, one or more (8 MiB records; 32: the "
                                                     "33.5 MB chunk of the 2026-11-30 finding, 128 reads)")
    ap.add_argument("--lanes", default="1,2,4", help="lane counts to run")
    ap.add_argument("--reps", type=int, default=3, help="steps a cell (the median is kept)")
    ap.add_argument("--out", required=True, help="JSON file to write")
    args = ap.parse_args()
    if not aio_available():
        raise SystemExit("this kernel or sandbox refuses io_setup: no AIO here")
    sizes = [max(1, int(m) // 8) for m in args.mib.split(",")]  # records a step
    root = Path(args.dir) / f"tkv-aio-lanes-{uuid.uuid4().hex[:8]}"
    root.mkdir(parents=True)
    kinds = [("1 lane, one submit of 128 (before)", 1, 128)] + \
            [(f"{n} lane{'s' if n > 1 else ''}", n, None) for n in map(int, args.lanes.split(","))]
    cells = []
    try:
        disk, make, job, rows, group0 = _setup(root, max(sizes), 32)
        fs = file_system_type(disk.slots.fd)
        loaders = {name: make(n, batch) for name, n, batch in kinds}
        try:
            for ld in loaders.values():  # untimed: the first step touches the staging's pages
                _step(ld, job(max(sizes)), rows, group0, None)
            for _ in range(args.reps):  # the kinds alternate within a round: a drift of the box hits all alike
                for records in sizes:
                    for busy in (False, True):
                        for name, _, _ in kinds:
                            spin = Spinner().start() if busy else None
                            try:
                                got = _step(loaders[name], job(records), rows[:records], group0, spin)
                            finally:
                                if spin is not None:
                                    spin.stop()
                            cells.append({"reader": name, "lanes": len(loaders[name]._lanes), "busy": busy,
                                          "step_bytes": rows[:records].numel(), **got})
        finally:
            for ld in loaders.values():
                ld.close()
            disk.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = []
    print(f"from {args.dir} ({fs}), {os.cpu_count()} CPUs, Linux {platform.release()}, median of {args.reps} steps")
    print("| MiB a step | reader | busy Python thread | read GB/s | group 0 ready ms | step ms | its rate kept |")
    print("|---|---|---|---|---|---|---|")
    for nbytes in sorted({c["step_bytes"] for c in cells}):
        for name, _, _ in kinds:
            for busy in (False, True):
                mine = [c for c in cells if c["reader"] == name and c["busy"] == busy and c["step_bytes"] == nbytes]
                row = {"step_bytes": nbytes, "reader": name, "lanes": mine[0]["lanes"], "busy": busy,
                       "reps": len(mine), "read_GBps": statistics.median(nbytes / c["read_s"] / 1e9 for c in mine),
                       "group0_ms": statistics.median(c["group0_ms"] for c in mine),
                       "wall_ms": statistics.median(c["wall_ms"] for c in mine),
                       "spinner_kept": statistics.median(c["spinner_kept"] for c in mine) if busy else None}
                out.append(row)
                kept = f"{row['spinner_kept']:.2f}" if busy else "-"
                print(f"| {nbytes >> 20} | {name} | {'yes' if busy else 'no'} | {row['read_GBps']:.2f} | "
                      f"{row['group0_ms']:.1f} | {row['wall_ms']:.1f} | {kept} |")
    doc = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(["python"] + sys.argv),
           "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Linux {platform.release()}", "dir": args.dir,
           "fs": fs, "record_bytes": rows[0].numel(), "rows": out, "cells": cells}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
