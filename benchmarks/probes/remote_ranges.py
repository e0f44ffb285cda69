"""What the remote tier's overlapped range reads cost a busy Python thread (vLLM's, launching the forward).

GPU round 16 (2026-11-30, docs/notes/2026-11-30-gpu-round16.md): with Redis on loopback, a turn-2 step whose
hit's first part was read under the forward (``disk_overlap_bytes``, ``InStepDiskLoader``) ran ~85 ms longer than
its compute although the reads kept up: the reads slowed vLLM's thread. This probe measures that on any machine,
without a GPU: a 3-master Redis Cluster on loopback (``tests/_redis.py``; ``redis-server`` on PATH), ``RECORDS``
records of ``BLOCKS`` blocks of ``BLOCK_KIB`` KiB, read range by range, layer group by layer group, the way the
loader reads one step's records, while a thread spins Python bytecode; beside each reader, the spinning thread's
rate alone. Readers:

- ``threads-N``: N reader threads, 4 blocks' ranges of one record a task (the loader's ``READERS`` = 32, which the
  remote tier used until this probe);
- ``one-exchange-per-group``: one thread, each layer group's ranges of every record in one pipelined exchange
  (``RemoteRangeReads.read_group``: one round trip per node a group), the loader's way since this probe.

It prints a table (read GB/s, the spinning thread's rate during the reads / alone) and writes
``remote_ranges.json`` to ``$OUT`` (default: current directory). Every read is checked against the bytes written.
Usage: ``python benchmarks/probes/remote_ranges.py`` (``RECORDS``, ``BLOCKS``, ``BLOCK_KIB``, ``GROUPS``, ``REPS``).
Threading: a script; the reader threads and one spinning thread, joined before each measurement ends.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from tiered_kv.tiers.remote import RemoteSettings, RemoteTier  # noqa: E402
from tiered_kv.values.layout import BlockLayout  # noqa: E402

PER_TASK = 4  # blocks' ranges of one record per task, as InStepDiskLoader's RANGES_PER_TASK


class Spinner:
    """A thread running Python bytecode in a loop; ``rate()`` is its iterations per second since ``mark()``."""

    def __init__(self) -> None:
        self.count = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._spin, daemon=True)
        self._mark = (0, time.perf_counter())

    def _spin(self) -> None:
        while not self._stop.is_set():
            for _ in range(200):
                self.count += 1

    def start(self) -> "Spinner":
        self._t.start()
        return self

    def mark(self) -> None:
        self._mark = (self.count, time.perf_counter())

    def rate(self) -> float:
        c0, t0 = self._mark
        return (self.count - c0) / max(1e-9, time.perf_counter() - t0)

    def stop(self) -> None:
        self._stop.set()
        self._t.join()


def read_threads(reads, n: int, blocks: int, block: int, groups: int, images: torch.Tensor, q: int) -> None:
    """The loader's way: tasks of ``PER_TASK`` blocks' ranges of one record, group by group, ``q`` threads."""
    per = block // groups
    tasks = [(i, [(b * block + g * per, b * block + (g + 1) * per) for b in range(b0, min(blocks, b0 + PER_TASK))])
             for g in range(groups) for i in range(n) for b0 in range(0, blocks, PER_TASK)]
    with ThreadPoolExecutor(q) as pool:
        assert all(pool.map(lambda t: reads.read_many(t[0], t[1], images[t[0]]), tasks))


def read_batched(reads, n: int, blocks: int, block: int, groups: int, images: torch.Tensor) -> None:
    """One thread, one exchange per layer group over every record's ranges of that group (``read_group``, what
    the loader does for the remote tier since 2026-11-30)."""
    per = block // groups
    for g in range(groups):
        spans = [(b * block + g * per, b * block + (g + 1) * per) for b in range(blocks)]
        assert all(reads.read_group(list(range(n)), spans, [images[i] for i in range(n)]))


def measure(tier, keys, rows, name: str, q: int, busy: bool, blocks: int, block: int, groups: int) -> dict:
    """One read of every record by reader ``name`` (``q`` threads; 0: one exchange per group), beside a spinning
    Python thread when ``busy`` (its rate measured alone first); the bytes checked."""
    n = len(keys)
    images = torch.zeros_like(rows)
    spin = Spinner().start() if busy else None
    try:
        alone = None
        if spin is not None:
            spin.mark()
            time.sleep(0.3)
            alone = spin.rate()
            spin.mark()
        reads = tier.open_ranges(keys)
        t0 = time.perf_counter()
        if q:
            read_threads(reads, n, blocks, block, groups, images, q)
        else:
            read_batched(reads, n, blocks, block, groups, images)
        seconds = time.perf_counter() - t0
        kept = spin.rate() / alone if spin is not None else None
    finally:
        if spin is not None:
            spin.stop()
    assert all(reads.verify(i, images[i]) for i in range(n)) and torch.equal(images, rows)
    reads.close()
    return {"reader": name, "busy": busy, "read_GBps": rows.numel() / seconds / 1e9, "spinner_kept": kept,
            "seconds": seconds}


def main() -> int:
    from tests._redis import RedisCluster, _running  # the launcher the tests use

    n, blocks = int(os.environ.get("RECORDS", "8")), int(os.environ.get("BLOCKS", "16"))
    block, groups = int(os.environ.get("BLOCK_KIB", "1024")) << 10, int(os.environ.get("GROUPS", "8"))
    reps = int(os.environ.get("REPS", "3"))
    readers = [("threads-32", 32), ("threads-4", 4), ("one-exchange-per-group", 0)]
    root = Path(tempfile.mkdtemp(prefix="tkv-remote-ranges-"))
    cells = []
    with _running(RedisCluster(root, maxmemory="1gb")) as cluster:
        os.environ["TKV_PROBE_REDIS_PASSWORD"] = cluster.password
        layout = BlockLayout((blocks * block,), "uint8", "remote-ranges")
        tier = RemoteTier(layout, RemoteSettings(cluster.url, "TKV_PROBE_REDIS_PASSWORD", op_timeout_s=30.0),
                          uuid.uuid4().bytes[:8])
        g = torch.Generator().manual_seed(3)
        rows = torch.randint(0, 256, (n, blocks * block), dtype=torch.uint8, generator=g)
        keys = [uuid.uuid4().bytes * 2 for _ in range(n)]
        assert all(tier.write(keys, [-1] * n, rows))
        try:
            for _ in range(reps):  # alternate readers within a round: a drift of the box hits all alike
                for name, q in readers:
                    for busy in (False, True):
                        cells.append(measure(tier, keys, rows, name, q, busy, blocks, block, groups))
        finally:
            tier.close()
    rows_out = []
    for name, _ in readers:
        for busy in (False, True):
            mine = [c for c in cells if c["reader"] == name and c["busy"] == busy]
            rows_out.append({"reader": name, "busy": busy, "reps": len(mine),
                             "read_GBps": statistics.median(c["read_GBps"] for c in mine),
                             "spinner_kept": statistics.median(c["spinner_kept"] for c in mine) if busy else None})
    print("| reader | busy Python thread | read GB/s | its rate during the reads / alone |\n|---|---|---|---|")
    for r in rows_out:
        kept = f"{r['spinner_kept']:.2f}" if r["busy"] else "-"
        print(f"| {r['reader']} | {'yes' if r['busy'] else 'no'} | {r['read_GBps']:.2f} | {kept} |")
    doc = {"date": time.strftime("%Y-%m-%d"), "command": "python benchmarks/probes/remote_ranges.py",
           "records": n, "blocks": blocks, "block_bytes": block, "groups": groups, "rows": rows_out, "cells": cells}
    out = Path(os.environ.get("OUT", ".")) / "remote_ranges.json"
    out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
