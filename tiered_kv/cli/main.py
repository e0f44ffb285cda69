"""The ``tiered-kv`` command line: ``demo``, ``inspect PATH|redis://...``, ``repair PATH``, ``bench``, ``top URL``.

Threading contract: a command-line entry point; runs on the main thread.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from tiered_kv.cli.top import add_parser as add_top_parser, run_top
from tiered_kv.values.units import format_size


def _demo(args: argparse.Namespace) -> int:
    import torch

    from tiered_kv.store.tiered_store import TieredStore

    con = Console()
    path = args.dir or tempfile.mkdtemp(prefix="tiered-kv-demo-")
    shape, n = (2, 16, 8, 64), args.blocks  # K/V x 16 tokens x 8 heads x 64 dims, bf16: 32 KiB a block
    cfg = {"block_shape": list(shape), "dtype": "bfloat16", "gpu_bytes": "2MiB", "cpu_bytes": "4MiB",
           "disk_path": os.path.join(path, "kv"), "disk_bytes": "64MiB", "model": "demo", "eviction": "s3fifo"}
    con.rule("[bold]tiered_kv demo")
    con.print(f"tiers: gpu 2 MiB ({'CUDA' if torch.cuda.is_available() else 'CPU stand-in'}) -> cpu 4 MiB ({'pinned' if torch.cuda.is_available() else 'unpinned: no CUDA'}) "
              f"-> disk 64 MiB at {cfg['disk_path']}")
    tokens = torch.randint(0, 32000, (n * 16,)).tolist()
    blocks = torch.randn((n, *shape)).to(torch.bfloat16)
    t0 = time.perf_counter()
    with TieredStore(cfg) as store:
        keys = store.keys_for_tokens(tokens)
        with Progress(console=con, transient=True) as prog:
            task = prog.add_task("put (cascading down)", total=n)
            for s in range(0, n, 32):
                store.put(keys[s:s + 32], blocks[s:s + 32]).wait(60)
                prog.update(task, advance=min(32, n - s))
        store.put_tokens(tokens, blocks).wait(60)  # all held already: only indexes the tokens
        store.drain()
        where = store.locate(keys)
        con.print(f"put {n} blocks ({format_size(n * store.layout.nbytes)}) in {time.perf_counter() - t0:.2f} s; "
                  f"now {where.count('gpu')} on gpu, {where.count('cpu')} on cpu, {where.count('disk')} on disk")
        m = store.match_prefix(tokens[:40 * 16] + [1, 2, 3])
        con.print(f"match_prefix of a 643-token prompt: {m['num_tokens']} tokens held "
                  f"(first block on {m['tiers'][0] if m['tiers'] else '-'})")
        out = torch.empty_like(blocks)
        t1 = time.perf_counter()
        got = store.get(keys, out).wait(60)
        exact = torch.equal(out[:got], blocks[:got])
        con.print(f"get {got}/{n} blocks back in {time.perf_counter() - t1:.2f} s, bit-exact: {exact}")
        store.drain()
        stats = store.stats()
    with TieredStore(cfg) as again:
        held = again.lookup(keys)
        con.print(f"reopened the store: {held} blocks still held on disk (leading run)")
    table = Table(title="summary")
    for col in ("tier", "capacity", "resident", "hits", "evictions", "bytes in", "bytes out"):
        table.add_column(col, justify="right")
    for name, t in stats["tiers"].items():
        table.add_row(name, str(t["capacity_blocks"]), str(t["resident_blocks"]), str(t["hits"]),
                      str(t["evictions"]), format_size(t["bytes_in"]), format_size(t["bytes_out"]))
    con.print(table)
    con.print(f"lookups {stats['lookups']} = hits {stats['hits']} + misses {stats['misses']}; "
              f"corrupt dropped {sum(t['corrupt_dropped'] for t in stats['tiers'].values())}")
    return 0 if exact and got == n else 1


def _inspect(args: argparse.Namespace) -> int:
    if args.path.startswith(("redis://", "rediss://")):
        return _inspect_remote(args)
    from pathlib import Path

    from tiered_kv.errors import ConfigError
    from tiered_kv.values.layout import BlockLayout
    from tiered_kv.tiers.disk import DiskTier, check_index

    con = Console()
    idx = Path(args.path) / "index"
    if (idx / "data.mdb").exists():
        report = check_index(idx)  # in a child process: a damaged index must not take this one down
        if not report["ok"]:
            if args.json:
                print(json.dumps({"path": args.path, "damaged": True, "error": report["error"]}, indent=2))
            else:
                con.print(f"[red]DAMAGED: {args.path}: {report['error']}")
                con.print(f"salvage what can be read with: tiered-kv repair {args.path}")
            return 1
    try:
        tier = DiskTier(BlockLayout((1,), "uint8"), args.path, 0, readonly=True)
    except (ConfigError, OSError) as exc:
        con.print(f"[red]cannot open {args.path}: {exc}")
        return 2
    try:
        info = tier.scan()
    finally:
        tier.close()
    if args.json:
        print(json.dumps(dict(info, damaged=False), indent=2))
        return 0
    table = Table(title=f"disk tier {info['path']}")
    table.add_column("field")
    table.add_column("value", justify="right")
    for k in ("records", "payload_bytes", "raw_bytes", "slot_bytes", "physical_slots", "free_listed",
              "pending_claims", "bad_headers", "index_bytes"):
        v = info[k]
        table.add_row(k, format_size(v) if k.endswith("bytes") and k != "slot_bytes" else str(v))
    con.print(table)
    for fp, count in info["layouts"].items():
        con.print(f"layout {fp}: {count} blocks")
    budget = info["budget"]
    if budget["mode"]:
        shared = budget["mode"] == "shared"
        con.print(f"budget: {budget['mode']}" + (f", {budget['budget_slots']} slots shared" if shared
                                                  else " (each namespace its own quota)"))
        for ns, sp in budget["spaces"].items():
            con.print(f"  namespace {ns}: {sp['used_slots']} slots used, quota {sp['quota_slots']}, weight "
                      f"{sp['weight']}, {sp['evictions']} evicted")
    healthy = info["bad_headers"] == 0 and info["pending_claims"] == 0
    con.print("[green]healthy" if healthy else "[yellow]damaged headers or pending claims (a reopen repairs them)")
    return 0


def _inspect_remote(args: argparse.Namespace) -> int:
    from tiered_kv.cli.fleet import fleet_report
    from tiered_kv.errors import ConfigError, RemoteUnavailableError

    con = Console()
    try:
        rep = fleet_report(args.path, args.password_env, args.user, args.tls_ca, args.key_prefix, args.max_keys)
    except (ConfigError, RemoteUnavailableError) as exc:
        con.print(f"[red]cannot inspect {args.path}: {exc}")
        return 2
    if args.json:
        print(json.dumps(rep, indent=2))
        return 0
    nodes = Table(title=f"remote tier {rep['cluster']['url']} (key prefix {rep['cluster']['key_prefix']!r})")
    for col in ("node", "keys", "used memory", "maxmemory", "policy", "evicted keys"):
        nodes.add_column(col, justify="left" if col in ("node", "policy") else "right")
    for n in rep["nodes"]:
        nodes.add_row(n["node"], f"{n['keys']:,}", format_size(n["used_memory"]),
                      format_size(n["maxmemory"]) if n["maxmemory"] else "no limit", n["policy"], f"{n['evicted_keys']:,}")
    con.print(nodes)
    spaces = Table(title="namespaces (what the fleet holds)")
    for col in ("namespace", "blocks", "bytes", "presence entries", "layouts (sampled)"):
        spaces.add_column(col, justify="left" if col in ("namespace", "layouts (sampled)") else "right")
    for ns, sp in rep["namespaces"].items():
        layouts = ", ".join(f"{fp} x{c}" for fp, c in sp["layouts_sampled"].items()) or "-"
        spaces.add_row(ns, f"{sp['blocks']:,}", format_size(sp["bytes"]), f"{sp['presence_entries']:,}", layouts)
    con.print(spaces)
    if rep["partial"]:
        con.print(f"[yellow]partial: stopped after --max-keys {args.max_keys} keys")
    return 0


def _repair(args: argparse.Namespace) -> int:
    from tiered_kv.errors import ConfigError
    from tiered_kv.tiers.disk.repair import repair

    con = Console()
    try:
        out = repair(args.path)
    except (ConfigError, OSError) as exc:
        con.print(f"[red]cannot repair {args.path}: {exc}")
        return 2
    if args.json:
        print(json.dumps(out, indent=2))
    elif out["fresh"]:
        con.print(f"[yellow]{args.path}: nothing salvageable (no readable format record); started empty; moved "
                  f"aside: {', '.join(out['moved'])}")
    else:
        con.print(f"[green]{args.path}: index rebuilt with {out['salvaged']} verified records "
                  f"({out['dropped']} dropped); old index moved to {out['moved'][0]}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from tiered_kv.cli.bench import main as bench_main

    argv = ["--total-mib", str(args.total_mib)] + (["--dir", args.dir] if args.dir else [])
    return bench_main(argv + ["--json", args.json])


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tiered-kv`` command."""
    from tiered_kv.version import __version__

    ap = argparse.ArgumentParser(prog="tiered-kv", description="tiered KV-cache store: demo, inspect, repair, bench, top")
    ap.add_argument("--version", action="version", version=f"tiered-kv {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="put -> cascade to disk -> get back, with a summary table")
    d.add_argument("--blocks", type=int, default=256)
    d.add_argument("--dir", default=None, help="where to put the disk tier (default: a temp dir)")
    i = sub.add_parser("inspect", help="a disk tier (PATH, opened read-only: blocks, bytes, layouts, health) or a "
                       "remote tier (redis://HOST:PORT[,...]: nodes, and blocks and bytes per namespace)")
    i.add_argument("path", help="a disk tier's directory, or the remote tier's seed nodes as remote_url takes them")
    i.add_argument("--json", action="store_true")
    i.add_argument("--password-env", default=None, help="remote: environment variable holding the Redis password")
    i.add_argument("--user", default=None, help="remote: Redis ACL user (default: default)")
    i.add_argument("--tls-ca", default=None, help="remote: CA file for rediss:// seeds")
    i.add_argument("--key-prefix", default="tkv:", help="remote: the fleet's key prefix (default tkv:)")
    i.add_argument("--max-keys", type=int, default=None, help="remote: stop the scan after this many keys")
    r = sub.add_parser("repair", help="rebuild a damaged disk tier's index from the records that still verify")
    r.add_argument("path")
    r.add_argument("--json", action="store_true")
    b = sub.add_parser("bench", help="CPU <-> disk benchmark against raw O_DIRECT on the same disk")
    b.add_argument("--dir", default=None)
    b.add_argument("--total-mib", type=int, default=512)
    b.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "disk_bench.json"))
    add_top_parser(sub)
    args = ap.parse_args(argv)
    return {"demo": _demo, "inspect": _inspect, "repair": _repair, "bench": _bench, "top": run_top}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
