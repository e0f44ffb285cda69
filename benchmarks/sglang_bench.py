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
      [--dir /nvme/tmp] [--pages 256] [--layouts page_first,layer_first] [--json bench_out/sglang.json]

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

import torch

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


def drop_cache(path: Path) -> None:
    """fsync and evict one file (or every file under a directory) from the page cache."""
    for p in ([path] if path.is_file() else [q for q in path.rglob("*") if q.is_file()]):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


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


def table(res: dict) -> str:
    """Markdown table of one run."""
    raw_w, raw_r = res["raw_write_gbps"], res["raw_read_gbps"]
    lines = ["| path | layout | pages/s | GB/s | ratio to raw O_DIRECT |", "|---|---|---:|---:|---:|",
             f"| raw O_DIRECT write + fsync (ceiling) | - | - | {raw_w:.2f} | 1.00 |",
             f"| raw O_DIRECT read (ceiling) | - | - | {raw_r:.2f} | 1.00 |"]
    for r in res["runs"]:
        lines.append(f"| batch_set_v1 + flush | {r['layout']} | {r['set_pages_s']:.0f} | {r['set_gbps']:.2f} | "
                     f"{r['set_gbps'] / raw_w:.2f} |")
        lines.append(f"| batch_get_v1 (cold cache) | {r['layout']} | {r['get_pages_s']:.0f} | {r['get_gbps']:.2f} | "
                     f"{r['get_gbps'] / raw_r:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print a table, write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="directory on the disk to test (default: a temp dir in /tmp)")
    ap.add_argument("--pages", type=int, default=256, help="pages per layout (8 MiB each)")
    ap.add_argument("--layouts", default="page_first,layer_first")
    ap.add_argument("--json", default="bench_out/sglang_bench.json")
    a = ap.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="tkv-sglang-bench-", dir=a.dir))
    try:
        page_nbytes = 2 * LAYERS * PAGE * HEADS * HEAD_DIM * 2
        raw_w, raw_r = raw_ceiling(base, a.pages * page_nbytes, page_nbytes)
        runs = [run_layout(base, lay, a.pages) for lay in a.layouts.split(",")]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    res = {"bench": "sglang_hicache_backend", "model_shape": {"layers": LAYERS, "kv_heads": HEADS,
           "head_dim": HEAD_DIM, "dtype": "bfloat16", "page_tokens": PAGE}, "batch_pages": BATCH,
           "dir": str(base.parent), "host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
           "raw_write_gbps": raw_w, "raw_read_gbps": raw_r, "runs": runs}
    print(table(res))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=2))
        print(f"wrote {a.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
