"""SGLang HiCache backend throughput (issue 4): batch_set_v1 / batch_get_v1 through SGLang's real host pool.

Model shape: an 8B-class model (32 layers, 8 KV heads, head_dim 128, bf16) with 64-token
pages, so one page (one L3 object) is 2 * 32 * 64 * 8 * 128 * 2 B = 8 MiB. Pages are
written in SGLang's batches of 128 (``STORAGE_BATCH_SIZE``) from a real CPU
``MHATokenToKVPoolHost`` through ``TieredHiCacheStorage.batch_set_v1`` (then ``flush`` =
fsync, so the write number is disk, not page cache), the payload file is dropped from
the page cache (``POSIX_FADV_DONTNEED``), and the pages are read back with
``batch_get_v1`` into other host slots and checked bit for bit.

Ceiling, same run, same directory: O_DIRECT sequential write (+ fsync) and read of a file
of the same size in 8 MiB chunks from one aligned buffer. Ratio = ours / ceiling.

Usage (CPU SGLang venv):
  PYTHONPATH=scripts/cpu_stubs .venv-sglang/bin/python benchmarks/sglang_bench.py \
      [--dir /nvme/tmp] [--pages 128] [--repeats 3] [--layouts page_first,layer_first] [--json bench_out/sglang.json]

Threading contract: a script; single-threaded apart from the store's own movers.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import torch

from tiered_kv.cli.bench import drop_cache

LAYERS, HEADS, HEAD_DIM, PAGE, BATCH = 32, 8, 128, 64, 128


def host_pool(layout: str, pages: int):
    """A real SGLang CPU MHA host pool of ``pages`` pages with the 8B shape."""
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    # Tiny stand-in device buffers: the host pool reads only their geometry and dtype.
    k = tuple(torch.zeros(PAGE, HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS))
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=k, k_data_ptrs=torch.tensor([t.data_ptr() for t in k], dtype=torch.uint64),
                          v_data_ptrs=torch.tensor([t.data_ptr() for t in k], dtype=torch.uint64),
                          layout=KVBufferLayout.NHD),
        page_size=PAGE, head_num=HEADS, head_dim=HEAD_DIM, v_head_dim=HEAD_DIM, dtype=torch.bfloat16,
        device=torch.device("cpu"))
    return MHATokenToKVPoolHost(info, 1.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=pages * PAGE, host_token_capacity=pages * PAGE,
                                start_layer=0, end_layer=LAYERS)


def raw_ceiling(directory: Path, total: int, chunk: int) -> tuple[float, float]:
    """GB/s of O_DIRECT sequential write (+fsync) and read of ``total`` bytes in ``chunk`` pieces."""
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(1 << 20) * (chunk >> 20))
    path = directory / "raw_ceiling.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
    try:
        t0 = time.perf_counter()
        for off in range(0, total, chunk):
            os.pwrite(fd, buf, off)
        os.fsync(fd)
        w = time.perf_counter() - t0
        t0 = time.perf_counter()
        for off in range(0, total, chunk):
            os.preadv(fd, [buf], off)
        r = time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink()
    return total / w / 1e9, total / r / 1e9


def run_layout(directory: Path, layout: str, pages: int) -> dict:
    """Write ``pages`` pages with batch_set_v1, read them back cold with batch_get_v1; GB/s and pages/s."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    batch = min(BATCH, pages)
    pool = host_pool(layout, 2 * batch)
    g = torch.Generator().manual_seed(0)
    pool.kv_buffer.view(torch.int16).copy_(torch.randint(-(2 ** 15), 2 ** 15 - 1, pool.kv_buffer.shape,
                                                         generator=g, dtype=torch.int16))
    src, dst = pool.alloc(batch * PAGE), pool.alloc(batch * PAGE)
    extra = {"backend_name": "tiered_kv", "module_path": "tiered_kv.connector.sglang",
             "class_name": "TieredHiCacheStorage", "interface_v1": 1, "disk_path": str(directory / layout),
             "disk_bytes": (pages + 8) * pool.get_dummy_flat_data_page().numel() * 2}
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False,
                               is_page_first_layout=layout == "page_first", model_name="bench/8b",
                               extra_config=extra)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, None)
    backend.register_mem_pool_host(pool)
    page_nbytes = backend.pages.page_nbytes
    keys = [f"{i:064x}" for i in range(1, pages + 1)]
    batches = [keys[i:i + batch] for i in range(0, pages, batch)]
    try:
        t0 = time.perf_counter()
        for b in batches:
            if not all(backend.batch_set_v1(b, src[: len(b) * PAGE])):
                raise RuntimeError(f"batch_set_v1 refused pages: {backend.stats()['backend']}")
        backend.store.flush()
        t_set = time.perf_counter() - t0
        drop_cache(backend.disk_dir)
        want = [pool.get_data_page(int(src[i * PAGE]), flat=True).view(torch.int16).clone() for i in (0, batch - 1)]
        t0 = time.perf_counter()
        for b in batches:
            if backend.batch_get_v1(b, dst[: len(b) * PAGE]) != [True] * len(b):
                raise RuntimeError(f"batch_get_v1 missed pages: {backend.stats()['backend']}")
        t_get = time.perf_counter() - t0
        got = [pool.get_data_page(int(dst[i * PAGE]), flat=True).view(torch.int16) for i in (0, len(batches[-1]) - 1)]
        if not (torch.equal(got[0], want[0]) and (len(batches[-1]) != batch or torch.equal(got[1], want[1]))):
            raise RuntimeError("pages read back differ from the pages written")
    finally:
        backend.close()
    total = pages * page_nbytes
    return {"layout": layout, "pages": pages, "page_bytes": page_nbytes,
            "set_pages_s": pages / t_set, "set_gbps": total / t_set / 1e9,
            "get_pages_s": pages / t_get, "get_gbps": total / t_get / 1e9}


def store_only(directory: Path, pages: int) -> dict:
    """The same pages through ``TieredStore.put``/``get`` alone (no SGLang, no host pool): the adapter's floor."""
    from tiered_kv.store.tiered_store import TieredStore

    shape = (2, PAGE, LAYERS, HEADS, HEAD_DIM)
    batch = min(BATCH, pages)
    blocks = torch.randint(-(2 ** 15), 2 ** 15 - 1, (batch, *shape), dtype=torch.int16).view(torch.bfloat16)
    out = torch.zeros_like(blocks)
    keys = [i.to_bytes(8, "little") * 4 for i in range(1, pages + 1)]
    cfg = {"block_shape": list(shape), "dtype": "bfloat16", "page_size": PAGE, "cpu_bytes": 0,
           "disk_path": str(directory / "store_only"), "disk_bytes": (pages + 8) * blocks[0].numel() * 2}
    with TieredStore(cfg) as store:
        t0 = time.perf_counter()
        for a in range(0, pages, batch):
            n = min(batch, pages - a)
            if not all(store.put(keys[a:a + n], blocks[:n]).wait()):
                raise RuntimeError("store refused pages")
        store.flush()
        t_put = time.perf_counter() - t0
        drop_cache(directory / "store_only")
        t0 = time.perf_counter()
        for a in range(0, pages, batch):
            n = min(batch, pages - a)
            if store.get(keys[a:a + n], out[:n]).wait() != n:
                raise RuntimeError("store missed pages")
        t_get = time.perf_counter() - t0
    total = pages * blocks[0].numel() * 2
    return {"layout": "(store only)", "pages": pages, "set_pages_s": pages / t_put, "set_gbps": total / t_put / 1e9,
            "get_pages_s": pages / t_get, "get_gbps": total / t_get / 1e9}


ROWS = [  # (label, run layout, metric, raw metric)
    ("TieredStore.put + flush, no SGLang", "(store only)", "set", "write"),
    ("TieredStore.get (cold cache), no SGLang", "(store only)", "get", "read"),
    ("batch_set_v1 + flush", None, "set", "write"),
    ("batch_get_v1 (cold cache)", None, "get", "read"),
]


def summarize(repeats: list[dict], layouts: list[str]) -> list[dict]:
    """Median (and min, max) over repeats of GB/s, pages/s and the same-repeat ratio to the raw ceiling."""
    rows = []
    for kind in ("write", "read"):
        gb = [r[f"raw_{kind}_gbps"] for r in repeats]
        rows.append({"path": f"raw O_DIRECT {kind}" + (" + fsync" if kind == "write" else "") + " (ceiling)",
                     "layout": "-", "gbps": median(gb), "gbps_min": min(gb), "gbps_max": max(gb),
                     "pages_s": None, "ratio": 1.0})
    for label, fixed, metric, raw in ROWS:
        for lay in ([fixed] if fixed else layouts):
            runs = [next(x for x in r["runs"] if x["layout"] == lay) | {"raw": r[f"raw_{raw}_gbps"]} for r in repeats]
            gb = [x[f"{metric}_gbps"] for x in runs]
            rows.append({"path": label, "layout": lay if not fixed else "-", "gbps": median(gb), "gbps_min": min(gb),
                         "gbps_max": max(gb), "pages_s": median([x[f"{metric}_pages_s"] for x in runs]),
                         "ratio": median([x[f"{metric}_gbps"] / x["raw"] for x in runs])})
    return rows


def table(rows: list[dict], repeats: int) -> str:
    """Markdown table of the summary."""
    lines = [f"| path | layout | pages/s | GB/s (median of {repeats}) | min-max | ratio to raw (same repeat) |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        pages = "-" if r["pages_s"] is None else f"{r['pages_s']:.0f}"
        lines.append(f"| {r['path']} | {r['layout']} | {pages} | {r['gbps']:.2f} | "
                     f"{r['gbps_min']:.2f}-{r['gbps_max']:.2f} | {r['ratio']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print a table, write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="directory on the disk to test (default: a temp dir in /tmp)")
    ap.add_argument("--pages", type=int, default=128, help="pages per layout and repeat (8 MiB each)")
    ap.add_argument("--repeats", type=int, default=3, help="repeats (the box may be shared: medians are reported)")
    ap.add_argument("--layouts", default="page_first,layer_first")
    ap.add_argument("--json", default="bench_out/sglang_bench.json")
    a = ap.parse_args(argv)
    layouts = a.layouts.split(",")
    page_nbytes = 2 * LAYERS * PAGE * HEADS * HEAD_DIM * 2
    repeats = []
    for _ in range(a.repeats):
        base = Path(tempfile.mkdtemp(prefix="tkv-sglang-bench-", dir=a.dir))
        try:
            raw_w, raw_r = raw_ceiling(base, a.pages * page_nbytes, page_nbytes)
            runs = [store_only(base, a.pages)] + [run_layout(base, lay, a.pages) for lay in layouts]
        finally:
            shutil.rmtree(base, ignore_errors=True)
        repeats.append({"raw_write_gbps": raw_w, "raw_read_gbps": raw_r, "runs": runs})
    rows = summarize(repeats, layouts)
    res = {"bench": "sglang_hicache_backend", "model_shape": {"layers": LAYERS, "kv_heads": HEADS,
           "head_dim": HEAD_DIM, "dtype": "bfloat16", "page_tokens": PAGE, "page_bytes": page_nbytes},
           "batch_pages": BATCH, "pages": a.pages, "dir": str(base.parent), "host": platform.node(),
           "cpus": os.cpu_count(), "loadavg_end": os.getloadavg(), "torch": torch.__version__,
           "summary": rows, "repeats": repeats}
    print(table(rows, a.repeats))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=2))
        print(f"wrote {a.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
