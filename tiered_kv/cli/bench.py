"""CPU <-> disk benchmark: raw O_DIRECT vs. LMDB values vs. our disk tier, same disk, same run.

Measures, for ``block_mib`` blocks (default 2 MiB) and ``total_mib`` per measurement:
- raw: O_DIRECT ``pwrite`` (sequential) and ``preadv`` (4 in flight, as the disk tier reads) of
  aligned buffers: the disk's ceiling;
- lmdb-values: 2 MiB values stored inside LMDB (32 puts per txn, writemap, no sync until the end),
  read back single-threaded after reopening (a mapped file would keep its pages in RAM);
- tiered-disk: our ``DiskTier`` (LMDB index + slot file), batches of 32, fsync included in writes;
- tiered-disk+zstd: the same with zstd level 1 on model-shaped bf16 data, with the bytes saved;
- tiered-disk ranges: the reads of an overlapped in-step disk load (``disk_overlap_bytes``): 32 MiB records (a
  Llama-3-8B chunk: 16 blocks of 2 MiB), read layer group by layer group (8 groups: one 256 KiB range of every block
  of every record, then the next group) by 8 threads, each record verified once whole.
Reads drop the page cache for the file first (``posix_fadvise(DONTNEED)``) so they hit the disk.

Run: ``tiered-kv bench`` or ``python benchmarks/disk_bench.py``; prints a table, writes JSON.

``--ranges-sweep`` measures only those range reads: reader threads or Linux AIO, by layer groups, with the CPU
idle and beside a busy Python thread (as vLLM's launching thread is).

Threading contract: a command-line tool; its measurements run reader threads and, for ``--ranges-sweep``, one
busy Python thread, all joined before it returns.
"""
from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lmdb
import torch

from tiered_kv.values.layout import BlockLayout
from tiered_kv.tiers.cpu import aligned_empty
from tiered_kv.tiers.disk import DiskTier
from tiered_kv.tiers.disk.aio import AioReader, aio_available

#: What ``run`` measures, in its order (each round alternates them, so a noisy neighbour hits every path alike)
PATHS = ("raw_odirect", "lmdb_values", "tiered_disk_none", "tiered_disk_zstd", "tiered_disk_ranges")


def drop_cache(path: Path) -> None:
    """fsync and evict one file (or every file under a directory) from the page cache."""
    for p in ([path] if path.is_file() else [q for q in path.rglob("*") if q.is_file()]):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _kv_like(n: int, nbytes: int, seed: int = 0) -> torch.Tensor:
    """bf16 values shaped like KV activations (normal, a few outlier channels), as uint8 rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, nbytes // 2), generator=g)
    x[:, ::64] *= 8.0
    return x.to(torch.bfloat16).view(torch.uint8).reshape(n, nbytes)


def raw_direct(dirpath: Path, rows: torch.Tensor, read_threads: int = 4) -> tuple[float, float]:
    """GB/s of O_DIRECT write (sequential) then read of every row with ``read_threads`` reads in flight.

    The read runs at the same queue depth as the disk tier's reads, so the ratio compares like with like.
    """
    n, nb = rows.shape
    buf = mmap.mmap(-1, nb)  # page-aligned, as O_DIRECT needs
    path = dirpath / "raw.bin"
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0)
    fd = os.open(path, flags, 0o600)
    try:
        t0 = time.perf_counter()
        for i in range(n):
            buf[:] = rows[i].numpy().tobytes()
            os.pwrite(fd, buf, i * nb)
        os.fsync(fd)
        w = time.perf_counter() - t0
        bufs = [mmap.mmap(-1, nb) for _ in range(read_threads)]

        def read_part(t: int) -> None:
            for i in range(t, n, read_threads):
                os.preadv(fd, [bufs[t]], i * nb)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(read_threads) as pool:
            list(pool.map(read_part, range(read_threads)))
        r = time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink()
    gb = n * nb / 1e9
    return gb / w, gb / r


def lmdb_values(dirpath: Path, rows: torch.Tensor, per_txn: int = 32) -> tuple[float, float]:
    """GB/s of LMDB with whole blocks as values."""
    n, nb = rows.shape
    path = dirpath / "lmdb-values"
    env = lmdb.open(str(path), map_size=n * nb * 2 + (64 << 20), writemap=True, sync=False, metasync=False)
    try:
        t0 = time.perf_counter()
        for s in range(0, n, per_txn):
            with env.begin(write=True) as txn:
                for i in range(s, min(n, s + per_txn)):
                    txn.put(i.to_bytes(8, "big"), rows[i].numpy().tobytes())
        env.sync(True)
        w = time.perf_counter() - t0
        env.close()  # a mapped file keeps its pages in RAM: unmap before dropping the cache
        drop_cache(path)
        env = lmdb.open(str(path), readonly=True, lock=False)
        out = torch.empty_like(rows)
        t0 = time.perf_counter()
        with env.begin(buffers=True) as txn:
            for i in range(n):
                out[i].copy_(torch.frombuffer(txn.get(i.to_bytes(8, "big")), dtype=torch.uint8))
        r = time.perf_counter() - t0
        assert torch.equal(out, rows)
    finally:
        env.close()
        shutil.rmtree(path)
    gb = n * nb / 1e9
    return gb / w, gb / r


def tiered_disk(dirpath: Path, rows: torch.Tensor, compression: str, batch: int = 32) -> dict:
    """GB/s of our DiskTier write (with fsync) and cold read; bytes on disk."""
    n, nb = rows.shape
    layout = BlockLayout((nb,), "uint8")
    path = dirpath / f"tiered-{compression}"
    tier = DiskTier(layout, path, n * (nb + 4096), compression=compression)
    keys = [i.to_bytes(8, "little") * 4 for i in range(n)]
    try:
        t0 = time.perf_counter()
        for s in range(0, n, batch):
            e = min(n, s + batch)
            assert all(tier.write(keys[s:e], [-1] * (e - s), rows[s:e]))
        tier.flush()
        w = time.perf_counter() - t0
        stored = tier.scan()["payload_bytes"]
        drop_cache(path)
        out = aligned_empty(n, nb)  # page-aligned rows, as the CPU tier's slab has
        t0 = time.perf_counter()
        for s in range(0, n, batch):
            e = min(n, s + batch)
            ok, _ = tier.read(keys[s:e], [-1] * (e - s), out[s:e])
            assert all(ok)
        r = time.perf_counter() - t0
        assert torch.equal(out, rows)
    finally:
        tier.close()
        shutil.rmtree(path)
    gb = n * nb / 1e9
    return {"write_GBps": gb / w, "read_GBps": gb / r, "stored_bytes": stored, "raw_bytes": n * nb}


def _record_tier(path: Path, total_bytes: int, record_mib: int, seed: int):
    """An empty raw ``DiskTier`` at ``path`` for ``total_bytes`` of ``record_mib`` MiB records (at least 2), their
    keys and KV-like rows: ``(tier, path, keys, rows)``."""
    nb = record_mib << 20
    n = max(2, total_bytes // nb)
    tier = DiskTier(BlockLayout((nb,), "uint8"), path, n * (nb + 4096), compression="none")
    return tier, path, [i.to_bytes(8, "little") * 4 for i in range(n)], _kv_like(n, nb, seed=seed)


def tiered_ranges(dirpath: Path, total_bytes: int, record_mib: int = 32, blocks: int = 16, groups: int = 8,
                  threads: int = 8) -> dict:
    """GB/s of our DiskTier read by ranges the way ``InStepDiskLoader`` reads (cold), and of its write."""
    tier, path, keys, rows = _record_tier(dirpath / "tiered-ranges", total_bytes, record_mib, seed=1)
    n, nb = rows.shape
    bn, per = nb // blocks, nb // blocks // groups
    try:
        t0 = time.perf_counter()
        for s in range(0, n, 4):
            e = min(n, s + 4)
            assert all(tier.write(keys[s:e], [-1] * (e - s), rows[s:e]))
        tier.flush()
        w = time.perf_counter() - t0
        drop_cache(path)
        images = aligned_empty(n, nb)
        reads = tier.open_ranges(keys)

        def one_group(i: int, g: int) -> bool:
            return all(reads.read(i, b * bn + g * per, b * bn + (g + 1) * per, images[i]) for b in range(blocks))

        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            for g in range(groups):  # group g of every record before group g+1 of any
                assert all(pool.map(one_group, range(n), [g] * n))
        r = time.perf_counter() - t0
        assert all(reads.verify(i, images[i]) for i in range(n))
        reads.close()
        assert torch.equal(images, rows)
    finally:
        tier.close()
        shutil.rmtree(path)
    gb = n * nb / 1e9
    return {"write_GBps": gb / w, "read_GBps": gb / r, "record_bytes": nb, "range_bytes": per, "threads": threads}


def ranges_sweep(dirpath: Path, total_bytes: int, readers=(("threads", 8), ("threads", 32), ("aio", 128)),
                 groups=(8, 4), per_task: int = 4, busy=(False, True), record_mib: int = 32, blocks: int = 16) -> dict:
    """GB/s of range reads (cold) for each reader x layer groups, with the CPU idle and beside a busy Python thread
    (vLLM's thread launching an eager forward holds the GIL the same way), every group queued at once as
    ``InStepDiskLoader`` reads: ``("threads", n)``: n reader threads, ``per_task`` block ranges of one record a
    task; ``("aio", depth)``: Linux AIO, one thread (``tiers.disk.aio``). Beside them, raw O_DIRECT reads of
    whole 2 MiB blocks with 4 and 16 in flight. Writes the records once; drops the page cache before every read."""
    tier, path, keys, rows = _record_tier(dirpath / "tiered-sweep", total_bytes, record_mib, seed=2)
    n, nb = rows.shape
    bn = nb // blocks
    out: dict = {"record_bytes": nb, "records": n, "cells": []}
    try:
        for s in range(0, n, 4):
            e = min(n, s + 4)
            assert all(tier.write(keys[s:e], [-1] * (e - s), rows[s:e]))
        tier.flush()
        images = aligned_empty(n, nb)
        for hot in busy:
            with _busy_python_thread(hot):
                for kind, q in readers:
                    if kind == "aio" and not aio_available():
                        continue
                    for gr in groups:
                        per = bn // gr
                        ranges = [(i, [(b * bn + g * per, b * bn + (g + 1) * per)
                                       for b in range(b0, min(blocks, b0 + per_task))])
                                  for g in range(gr) for i in range(n) for b0 in range(0, blocks, per_task)]
                        drop_cache(path)
                        reads = tier.open_ranges(keys)
                        t0 = time.perf_counter()
                        if kind == "aio":
                            reqs = [q_ for i, rs in ranges for q_ in reads.requests(i, rs, images[i])]
                            aio = AioReader(q)
                            try:
                                aio.run(reqs, lambda k, res: None)
                            finally:
                                aio.close()
                        else:
                            with ThreadPoolExecutor(q) as pool:
                                assert all(pool.map(lambda t: reads.read_many(t[0], t[1], images[t[0]]), ranges))
                        r = time.perf_counter() - t0
                        assert all(reads.verify(i, images[i]) for i in range(n))
                        reads.close()
                        out["cells"].append({"reader": kind, "in_flight": q, "groups": gr, "range_bytes": per,
                                             "busy_python_thread": hot, "read_GBps": n * nb / 1e9 / r})
    finally:
        tier.close()
        shutil.rmtree(path)
    raw_rows = rows.view(-1)[: n * nb].view(n * blocks, bn)
    out["raw"] = {q: raw_direct(dirpath, raw_rows, read_threads=q)[1] for q in (4, 16)}
    return out


@contextlib.contextmanager
def _busy_python_thread(on: bool):
    """A thread running Python bytecode in a loop while the body runs (``on``), as vLLM's launching thread does."""
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            for i in range(1000):
                x += i

    t = threading.Thread(target=spin, daemon=True) if on else None
    if t is not None:
        t.start()
    try:
        yield
    finally:
        stop.set()
        if t is not None:
            t.join()


def sweep_table(res: dict) -> str:
    """``ranges_sweep``'s result as a Markdown table."""
    lines = [f"{res['records']} records of {res['record_bytes'] >> 20} MiB; raw O_DIRECT 2 MiB reads: "
             + ", ".join(f"{q} in flight {g:.2f} GB/s" for q, g in res["raw"].items()), "",
             "| reader | in flight | groups | range KiB | busy Python thread | read GB/s | / raw (16) |",
             "|---|---|---|---|---|---|---|"]
    raw = res["raw"][16]
    for c in res["cells"]:
        busy = "yes" if c["busy_python_thread"] else "no"
        lines.append(f"| {c['reader']} | {c['in_flight']} | {c['groups']} | {c['range_bytes'] >> 10} | {busy} | "
                     f"{c['read_GBps']:.2f} | {c['read_GBps'] / raw:.2f} |")
    return "\n".join(lines)


def run(directory: str | None = None, block_mib: float = 2.0, total_mib: int = 512, repeats: int = 3) -> dict:
    """Run every measurement ``repeats`` times, alternating paths; return medians as a JSON-able dict."""
    nb = int(block_mib * (1 << 20))
    n = max(8, int(total_mib * (1 << 20)) // nb)
    rows = _kv_like(n, nb)
    base = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="tkv-bench-", dir="."))
    base.mkdir(parents=True, exist_ok=True)
    res: dict = {"date": time.strftime("%Y-%m-%d"), "block_bytes": nb, "blocks": n, "dir": str(base),
                 "repeats": repeats, "method": "rounds alternate raw/lmdb/tiered/tiered+zstd/tiered ranges; medians reported"}
    rounds: dict[str, list[dict]] = {k: [] for k in PATHS}
    try:
        for _ in range(repeats):  # alternate, so a noisy neighbour hits every path alike
            rounds["raw_odirect"].append(dict(zip(("write_GBps", "read_GBps"), raw_direct(base, rows))))
            rounds["lmdb_values"].append(dict(zip(("write_GBps", "read_GBps"), lmdb_values(base, rows))))
            for comp in ("none", "zstd"):
                rounds[f"tiered_disk_{comp}"].append(tiered_disk(base, rows, comp))
            rounds["tiered_disk_ranges"].append(tiered_ranges(base, n * nb))
    finally:
        if not directory:
            shutil.rmtree(base, ignore_errors=True)
    for k, rs in rounds.items():
        res[k] = {f: statistics.median(r[f] for r in rs) for f in rs[0]}
        res[k]["rounds"] = rs
    raw = res["raw_odirect"]
    for k in PATHS[1:]:
        for f in ("write", "read"):  # ratio within each round (same moment, same disk), then the median
            res[k][f"{f}_ratio"] = statistics.median(
                r[f"{f}_GBps"] / b[f"{f}_GBps"] for r, b in zip(res[k]["rounds"], raw["rounds"]))
    z = res["tiered_disk_zstd"]
    z["bytes_saved_ratio"] = 1 - z["stored_bytes"] / z["raw_bytes"]
    return res


def table(res: dict) -> str:
    """The result as a Markdown table."""
    lines = [f"{res['blocks']} blocks of {res['block_bytes'] / 2**20:.1f} MiB, {res['date']}", "",
             "| path | write GB/s | read GB/s | write / raw | read / raw |", "|---|---|---|---|---|"]
    for k in PATHS:
        r = res[k]
        wr = f"{r['write_ratio']:.2f}" if "write_ratio" in r else "1.00"
        rr = f"{r['read_ratio']:.2f}" if "read_ratio" in r else "1.00"
        lines.append(f"| {k} | {r['write_GBps']:.2f} | {r['read_GBps']:.2f} | {wr} | {rr} |")
    lines.append(f"\nzstd: {res['tiered_disk_zstd']['bytes_saved_ratio'] * 100:.1f}% of payload bytes saved")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m tiered_kv.benchmark [--dir D] [--total-mib N] [--json FILE]``."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir here)")
    ap.add_argument("--total-mib", type=int, default=512)
    ap.add_argument("--block-mib", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "disk_bench.json"))
    ap.add_argument("--ranges-sweep", action="store_true",
                    help="only the overlapped load's range reads: threads or AIO x layer groups, idle and beside a busy "
                         "Python thread")
    a = ap.parse_args(argv)
    if a.ranges_sweep:
        base = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="tkv-bench-", dir="."))
        base.mkdir(parents=True, exist_ok=True)
        try:
            res = ranges_sweep(base, a.total_mib << 20)
        finally:
            if not a.dir:
                shutil.rmtree(base, ignore_errors=True)
        res.update(date=time.strftime("%Y-%m-%d"),
                   command=" ".join(["tiered-kv bench"] + list(argv if argv is not None else sys.argv[1:])))
        print(sweep_table(res))
        Path(a.json).write_text(json.dumps(res, indent=2))
        print(f"\nJSON: {a.json}")
        return 0
    res = run(a.dir, a.block_mib, a.total_mib, a.repeats)
    res["command"] = " ".join(["tiered-kv bench"] + list(argv if argv is not None else sys.argv[1:]))
    print(table(res))
    Path(a.json).write_text(json.dumps(res, indent=2))
    print(f"\nJSON: {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
