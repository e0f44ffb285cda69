"""Remote tier benchmark (issue 15): our RemoteTier vs raw redis-py on the same Redis Cluster, same run.

Measures, for ``--block-mib`` blocks (default 2 MiB) and ``--total-mib`` per measurement, in batches of
``--batch`` blocks (what one mover job carries):
- raw: redis-py's own ``RedisCluster`` pipeline (``SET``/``GET`` of the same bytes, prepared beforehand,
  the pipeline grouping commands per node as redis-py does): the client's ceiling on this cluster;
- tier: ``RemoteTier.write`` / ``read_ex`` of the same blocks from and into uint8 tensors: header and
  both checksums; writes send the header and a view of the row (no join copy), reads receive the
  payload from the socket straight into the caller's row (no parser copies); every node gets its
  burst before any answer is read;
- presence: how long a block another process stored takes to show up in this process's feed, and
  what adopting what the feed brought costs the planner (per 1,000 keys), and a 64-key lookup.
Each measurement runs ``--reps`` times, the two paths back to back in each round; the table shows the
medians, and tier / raw is the median of the per-round ratios.

By default it starts its own 3-master cluster on 127.0.0.1 (``redis-server`` must be installed, as
``scripts/setup_venvs.sh`` does) and stops it at the end; ``--url`` (+ ``--password-env``) uses yours.

Usage: python benchmarks/remote_bench.py [--total-mib 256] [--json out.json] [--url redis://h:p,...]

Threading contract: a command-line tool; the tier's own threads aside, single-threaded.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tiered_kv.planner.chain import TierChain, TierSpec  # noqa: E402
from tiered_kv.tiers.remote import RemoteSettings, RemoteTier  # noqa: E402
from tiered_kv.values.layout import BlockLayout  # noqa: E402


def kv_like(n: int, nbytes: int, seed: int = 0) -> torch.Tensor:
    """bf16 values shaped like KV activations, as uint8 rows."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, nbytes // 2), generator=g).to(torch.bfloat16).view(torch.uint8).reshape(n, nbytes)


def batches(n: int, size: int):
    for lo in range(0, n, size):
        yield range(lo, min(n, lo + size))


def raw_round(rc, keys: list[bytes], values: list[bytes], batch: int) -> tuple[float, float]:
    """(write s, read s) of redis-py cluster pipelines over every value, checking every value read back."""
    t0 = time.perf_counter()
    for part in batches(len(keys), batch):
        pipe = rc.pipeline()
        for i in part:
            pipe.set(keys[i], values[i])
        assert all(pipe.execute())
    w = time.perf_counter() - t0
    t0 = time.perf_counter()
    for part in batches(len(keys), batch):
        pipe = rc.pipeline()
        for i in part:
            pipe.get(keys[i])
        got = pipe.execute()
        assert all(len(g) == len(values[i]) for g, i in zip(got, part))
    r = time.perf_counter() - t0
    rc.delete(*keys[:1])
    for k in keys:
        rc.delete(k)
    return w, r


def tier_round(tier: RemoteTier, keys: list[bytes], rows: torch.Tensor, out: torch.Tensor,
               batch: int) -> tuple[float, float]:
    """(write s, read s) through the tier into ``out`` (allocated once and touched, like the CPU tier's slab an
    engine reads into), every block read back checked bit-exact (outside the timing)."""
    out.zero_()
    t0 = time.perf_counter()
    for part in batches(len(keys), batch):
        ks = [keys[i] for i in part]
        assert all(tier.write(ks, [-1] * len(ks), rows[part.start:part.stop]))
    w = time.perf_counter() - t0
    t0 = time.perf_counter()
    for part in batches(len(keys), batch):
        ks = [keys[i] for i in part]
        ok, _, _ = tier.read_ex(ks, [-1] * len(ks), out[part.start:part.stop])
        assert all(ok)
    r = time.perf_counter() - t0
    assert torch.equal(out, rows)
    tier.delete(keys)
    return w, r


def presence(settings: RemoteSettings, layout: BlockLayout, reps: int) -> dict:
    """Feed latency (another writer's block visible here) and the planner's cost of adopting and looking up."""
    ns = uuid.uuid4().bytes[:8]
    writer = RemoteTier(layout, settings, ns)
    reader = RemoteTier(layout, settings, ns)
    feed = reader.feed()
    feed.caught_up.wait(10)
    lat = []
    try:
        row = kv_like(1, layout.nbytes)
        for i in range(max(reps, 5)):
            key = uuid.uuid4().bytes * 2
            t0 = time.perf_counter()
            writer.write([key], [-1], row)
            while key not in feed.take()[0]:
                time.sleep(0.0002)
            lat.append(time.perf_counter() - t0)
    finally:
        writer.delete([k for k in writer.stored_keys()])
        writer.close()
        reader.close()
    chain = TierChain([TierSpec("cpu", 1024), TierSpec("remote", 0, slotted=False, governed=True)])
    keys = [uuid.uuid4().bytes * 2 for _ in range(100_000)]
    t0 = time.perf_counter()
    for part in batches(len(keys), 1000):
        chain.adopt(1, [keys[i] for i in part if keys[i] not in chain.index])
    adopt_us = (time.perf_counter() - t0) / (len(keys) / 1000) * 1e6
    probe = keys[:64]
    t0 = time.perf_counter()
    for _ in range(1000):
        chain.lookup(probe)
    lookup_us = (time.perf_counter() - t0) / 1000 * 1e6
    return {"feed_latency_ms_median": round(statistics.median(lat) * 1e3, 2),
            "feed_latency_ms_max": round(max(lat) * 1e3, 2), "adopt_us_per_1000_keys": round(adopt_us, 1),
            "lookup_us_64_keys_100k_known": round(lookup_us, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-mib", type=float, default=2.0)
    ap.add_argument("--total-mib", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--url", default=None, help="seed nodes of an existing cluster (default: start a local one)")
    ap.add_argument("--password-env", default=None, help="environment variable holding the cluster's password")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)

    cluster = None
    url, pw_env = args.url, args.password_env
    if url is None:
        from tests._redis import RedisCluster  # the same launcher the tests use

        cluster = RedisCluster(Path(tempfile.mkdtemp(prefix="tkv-remote-bench-")), maxmemory="1gb")
        cluster.create()
        url, pw_env = cluster.url, "TKV_BENCH_REDIS_PASSWORD"
        os.environ[pw_env] = cluster.password
    try:
        nbytes = int(args.block_mib * (1 << 20))
        n = max(1, args.total_mib * (1 << 20) // nbytes)
        layout = BlockLayout((nbytes,), "uint8", "remote-bench")
        settings = RemoteSettings(url, pw_env, op_timeout_s=30.0)
        tier = RemoteTier(layout, settings, uuid.uuid4().bytes[:8])
        rows = kv_like(n, nbytes)
        keys = [uuid.uuid4().bytes * 2 for _ in range(n)]
        raw_keys = [b"tkv-raw:" + k for k in keys]
        values = [bytes(rows[i].numpy()) for i in range(n)]
        rc = tier.client.rc
        out = torch.zeros_like(rows)
        res = {"raw": [], "tier": []}
        for _ in range(args.reps):  # alternate, so a drift of the box hits both alike
            res["raw"].append(raw_round(rc, raw_keys, values, args.batch))
            res["tier"].append(tier_round(tier, keys, rows, out, args.batch))
        tier.close()
        total = n * nbytes
        table = {}
        for name, runs in res.items():
            table[name] = {"write_gbps": round(total / statistics.median(w for w, _ in runs) / 1e9, 3),
                           "read_gbps": round(total / statistics.median(r for _, r in runs) / 1e9, 3),
                           "write_runs_s": [round(w, 4) for w, _ in runs],
                           "read_runs_s": [round(r, 4) for _, r in runs]}
        # ratios within each round (both paths ran back to back), then the median: the box's drift cancels out
        ratio = {"write_gbps": round(statistics.median(r[0] / t[0] for r, t in zip(res["raw"], res["tier"])), 3),
                 "read_gbps": round(statistics.median(r[1] / t[1] for r, t in zip(res["raw"], res["tier"])), 3)}
        pres = presence(settings, BlockLayout((64 << 10,), "uint8", "remote-bench-small"), args.reps)
    finally:
        if cluster is not None:
            cluster.close()
    print(f"remote tier vs raw redis-py, {n} x {args.block_mib:g} MiB blocks, batches of {args.batch}, "
          f"median of {args.reps}, {'local 3-master cluster' if cluster else url}")
    print("| path | write GB/s | read GB/s |")
    print("|---|---|---|")
    for name in ("raw", "tier"):
        print(f"| {name} | {table[name]['write_gbps']:.3f} | {table[name]['read_gbps']:.3f} |")
    print(f"| tier / raw | {ratio['write_gbps']:.0%} | {ratio['read_gbps']:.0%} |")
    print(f"presence: feed latency median {pres['feed_latency_ms_median']} ms (max {pres['feed_latency_ms_max']}), "
          f"adopt {pres['adopt_us_per_1000_keys']} us per 1,000 keys, lookup of 64 keys "
          f"{pres['lookup_us_64_keys_100k_known']} us with 100k keys known")
    out = {"bench": "remote_bench", "date": time.strftime("%Y-%m-%d", time.gmtime()), "host": platform.node(),
           "cpus": os.cpu_count(), "block_mib": args.block_mib, "blocks": n, "batch": args.batch, "reps": args.reps,
           "cluster": "local 3 masters (redis-server 7, loopback)" if cluster else "given", **table,
           "tier_over_raw": ratio, "presence": pres,
           "command": "python benchmarks/remote_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
