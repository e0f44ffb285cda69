"""The tiered_kv Python API end to end: put, cascade, get, prefetch, reopen.

Run: python examples/python_api.py   (CPU is fine: the "gpu" tier falls back to a CPU tensor)
"""
import tempfile

import torch

from tiered_kv import TieredStore

disk = tempfile.mkdtemp(prefix="tkv-example-")
config = {
    # one block = K and V of 16 tokens, 8 KV heads, head_dim 64, for 4 layers, in bf16 (128 KiB)
    "block_shape": [4, 2, 16, 8, 64],
    "dtype": "bfloat16",
    "gpu_bytes": "1MiB",      # 8 blocks
    "cpu_bytes": "2MiB",      # 16 blocks
    "disk_path": disk,        # LMDB index + payload file; survives restarts
    "disk_bytes": "64MiB",
    "model": "my-model",      # namespaces the keys
}

tokens = list(range(100 * 16))                       # a 1,600-token conversation
blocks = torch.randn(100, 4, 2, 16, 8, 64).to(torch.bfloat16)

with TieredStore(config) as store:
    keys = store.keys_for_tokens(tokens)             # chained, page-aligned, namespaced keys
    accepted = store.put(keys, blocks).wait()        # async underneath; wait() returns per-key results
    store.drain()                                    # let evictions settle: 8 on gpu, 16 on cpu, the rest on disk
    where = store.locate(keys)
    print("where:", {t: where.count(t) for t in ("gpu", "cpu", "disk")})

    out = torch.empty_like(blocks)
    n = store.get(keys, out).wait()                  # longest leading run held, from wherever it lives
    assert n == 100 and torch.equal(out, blocks)
    print("get:", n, "blocks, bit-exact")

    store.prefetch(keys[:8], to="gpu").wait()        # move a prefix up before it is needed
    print("after prefetch:", store.locate(keys[:8]))
    print("stats:", {k: store.stats()[k] for k in ("lookups", "hits", "misses", "resident_blocks")})
    disk_keys = [k for k, t in zip(keys, store.locate(keys)) if t == "disk"]

with TieredStore(config) as store:                   # a new process would see the same
    print("reopened: holds", sum(store.contains(disk_keys)), "of", len(disk_keys), "disk blocks")
    match = store.match_prefix(tokens)
    print("match_prefix:", match["num_tokens"], "tokens held")
