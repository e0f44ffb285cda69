"""One disk directory shared by several processes (issue 17): what the shared budget and its checks cost.

Measures, on the disk holding ``--dir``:
1. the integrity check a writable open runs in a child process, for N records in the index
   (``check_index``: B-tree walk, entry counts, write probe, ownership cross-check), and a store's
   whole open with it;
2. read leases: one lease + unlease write transaction pair per read batch, per batch size;
3. eviction under one shared budget: P processes (half of them in each of 2 namespaces) put 4 KiB
   blocks into a directory whose budget holds a fraction of what they write; blocks/s put (every put
   beyond the budget evicts inside its claim transaction), evictions/s, and the share each namespace
   keeps, for P = 1, 2, 4.

Usage: python benchmarks/disk_sharing_bench.py [--dir /nvme/tmp] [--records 1000,10000,100000]
       [--seconds 5] [--json out.json]
Prints a table per part and writes JSON (default ``$OUT/disk_sharing_bench.json`` or ``./``).

Threading contract: a command-line script; the worker processes it starts are single-threaded callers.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tiered_kv.store.tiered_store import TieredStore  # noqa: E402
from tiered_kv.tiers.disk import DiskIndex, DiskTier, check_index  # noqa: E402
from tiered_kv.values.layout import BlockLayout  # noqa: E402
from tiered_kv.values.record import CODEC_NONE, RecordHeader  # noqa: E402

SLOT = 4096
SHAPE = (2048,)  # one bfloat16 block of 4 KiB: one slot, so the index work is what is measured


def _fill_index(idx: Path, n: int) -> None:
    """An index of ``n`` committed records (headers only: the check never reads payloads)."""
    idx.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    index = DiskIndex(idx, SLOT, n, owner=b"bench-ns")
    try:
        for s in range(0, n, 4096):
            keys = [b"bench-ns" + i.to_bytes(24, "little") for i in range(s, min(n, s + 4096))]
            _, slots = index.claim(keys)
            index.commit([(k, sl, RecordHeader(CODEC_NONE, 1, sl, SLOT, SLOT, 7).pack(k))
                          for k, sl in zip(keys, slots)], [])
    finally:
        index.close()


def bench_check(root: Path, counts: list[int]) -> list[dict]:
    """Part 1: seconds of ``check_index`` (median of 3) and of a store's open, per record count."""
    out = []
    for n in counts:
        d = root / f"check-{n}"
        _fill_index(d / "index", n)
        times = []
        for _ in range(3):
            rep = check_index(d / "index")
            assert rep["ok"], rep
            times.append(rep["seconds"])
        t0 = time.perf_counter()
        tier = DiskTier(BlockLayout(SHAPE, "bfloat16"), d, n * SLOT, owner=b"bench-ns")
        open_s = time.perf_counter() - t0
        tier.close()
        out.append({"records": n, "index_mib": round(rep["index_bytes"] / 2**20, 2),
                    "check_s": round(statistics.median(times), 4), "open_with_check_s": round(open_s, 4)})
        shutil.rmtree(d)
    return out


def bench_leases(root: Path, batches: list[int], rounds: int = 400) -> list[dict]:
    """Part 2: microseconds of one lease + unlease pair, and of a plain header read txn, per batch size."""
    d = root / "leases"
    tier = DiskTier(BlockLayout(SHAPE, "bfloat16"), d, 1024 * SLOT, owner=b"bench-ns")
    out = []
    try:
        keys = [b"bench-ns" + i.to_bytes(24, "little") for i in range(256)]
        tier.write(keys, [-1] * len(keys), torch.zeros((len(keys), SLOT), dtype=torch.uint8))
        for b in batches:
            part = keys[:b]
            t0 = time.perf_counter()
            for _ in range(rounds):
                _, leases = tier.index.lease(part)
                tier.index.unlease(leases, part)
            lease_us = (time.perf_counter() - t0) / rounds * 1e6
            t0 = time.perf_counter()
            for _ in range(rounds):
                tier.index.headers(part)
            plain_us = (time.perf_counter() - t0) / rounds * 1e6
            out.append({"batch": b, "lease_unlease_us": round(lease_us, 1), "headers_only_us": round(plain_us, 1),
                        "per_block_us": round(lease_us / b, 2)})
    finally:
        tier.close()
        shutil.rmtree(d)
    return out


def _evict_worker(path: str, model: str, seconds: float, budget: int, q) -> None:
    torch.set_num_threads(1)
    cfg = {"block_shape": list(SHAPE), "dtype": "bfloat16", "cpu_bytes": 0, "disk_path": path,
           "disk_bytes": budget * SLOT, "model": model, "disk_budget": "shared", "disk_workers": 1}
    blocks = torch.zeros((16, *SHAPE), dtype=torch.bfloat16)
    with TieredStore(cfg) as store:
        n = ok = 0
        pid = os.getpid().to_bytes(4, "little")
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            keys = [store.key(pid + (n + i).to_bytes(8, "little")) for i in range(16)]
            ok += sum(store.put(keys, blocks).wait(60))
            n += 16
        store.drain()
        ev = store.stats()["tiers"]["disk"]["evictions"]
        used = store.tiers[-1].usage()["spaces"][store.namespace.prefix.hex()]["used_slots"]
    q.put({"model": model, "puts_ok": ok, "evictions": ev, "used_slots_at_end": used})


def bench_eviction(root: Path, procs: list[int], seconds: float, budget: int = 512) -> list[dict]:
    """Part 3: P processes of 2 namespaces putting into one shared budget; totals per second."""
    out = []
    ctx = mp.get_context("spawn")
    for p in procs:
        d = root / f"evict-{p}"
        q = ctx.Queue()
        ws = [ctx.Process(target=_evict_worker, args=(str(d), ("alpha", "beta")[i % 2], seconds, budget, q))
              for i in range(p)]
        for w in ws:
            w.start()
        res = [q.get(timeout=seconds + 300) for _ in ws]
        for w in ws:
            w.join()
        puts = sum(r["puts_ok"] for r in res)
        evs = sum(r["evictions"] for r in res)
        out.append({"processes": p, "budget_slots": budget, "puts_per_s": round(puts / seconds),
                    "evictions_per_s": round(evs / seconds), "mib_per_s": round(puts * SLOT / seconds / 2**20, 1),
                    "per_namespace_used": {r["model"]: r["used_slots_at_end"] for r in res}})
        shutil.rmtree(d)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the three parts, print tables, write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None)
    ap.add_argument("--records", default="1000,10000,100000")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--procs", default="1,2,4")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "disk_sharing_bench.json"))
    a = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="tkv-share-", dir=a.dir))
    try:
        check = bench_check(root, [int(x) for x in a.records.split(",")])
        print(f"{'records':>8} {'index MiB':>9} {'check s':>8} {'open s':>8}")
        for r in check:
            print(f"{r['records']:>8} {r['index_mib']:>9} {r['check_s']:>8} {r['open_with_check_s']:>8}")
        leases = bench_leases(root, [1, 8, 32])
        print(f"{'batch':>6} {'lease+unlease us':>16} {'headers us':>10} {'us/block':>8}")
        for r in leases:
            print(f"{r['batch']:>6} {r['lease_unlease_us']:>16} {r['headers_only_us']:>10} {r['per_block_us']:>8}")
        evict = bench_eviction(root, [int(x) for x in a.procs.split(",")], a.seconds)
        print(f"{'procs':>5} {'puts/s':>8} {'evictions/s':>11} {'MiB/s':>7}  used per namespace (budget 512)")
        for r in evict:
            print(f"{r['processes']:>5} {r['puts_per_s']:>8} {r['evictions_per_s']:>11} {r['mib_per_s']:>7}  "
                  f"{r['per_namespace_used']}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {"bench": "disk_sharing", "date": time.strftime("%Y-%m-%d"), "machine": platform.node(),
              "cpus": os.cpu_count(), "dir": a.dir or tempfile.gettempdir(), "integrity_check": check,
              "leases": leases, "eviction": evict}
    Path(a.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
