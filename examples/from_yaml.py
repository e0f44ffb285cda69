"""Open a store from a YAML file and push more blocks than the GPU and CPU tiers hold.

Run: python examples/from_yaml.py examples/three_tier.yaml
"""
import sys

import torch

from tiered_kv import StoreConfig, TieredStore

config = StoreConfig.from_file(sys.argv[1] if len(sys.argv) > 1 else "examples/three_tier.yaml")
with TieredStore(config) as store:
    n = 200  # 400 MiB of 2 MiB blocks: 32 fit the GPU tier, 128 the CPU tier, the rest go to disk
    keys = [store.namespace.key(f"block-{i}".encode()) for i in range(n)]  # engine-style hashes -> keys
    # A key names one immutable block: re-running this script finds the blocks already on disk,
    # so the content must be the same for the same key (seeded here).
    blocks = torch.randn(n, *config.block_shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    print("accepted:", sum(store.put(keys, blocks).wait()))
    store.drain()
    where = store.locate(keys)
    print({t: where.count(t) for t in ("gpu", "cpu", "disk")})
    out = torch.empty(8, *config.block_shape, dtype=torch.bfloat16)
    assert store.get(keys[:8], out).wait() == 8 and torch.equal(out, blocks[:8])
    print("first 8 blocks read back bit-exact from", store.locate(keys[:8])[0] or "?")
