"""Issue 2, shows 3: 8 threads doing mixed put/get/prefetch for 20 s (TKV_STRESS_SECONDS): no error, every
read bit-exact, and the stats add up (hits + misses = lookups; bytes in = bytes out + resident)."""
from __future__ import annotations

import os
import random
import threading
import time

import torch

from tiered_kv import TieredStore

from tests.store._blocks import block_of, key_of

SHAPE = (2, 4, 64)
SECONDS = float(os.environ.get("TKV_STRESS_SECONDS", "20"))


def test_eight_threads_mixed_ops(small_cfg):
    cfg = small_cfg(disk_bytes=256 * 4096, eviction="s3fifo")
    errors: list[BaseException] = []
    counts = {"put": 0, "get": 0, "prefetch": 0, "blocks_read": 0, "lookups": 0}
    lock = threading.Lock()
    stop = time.monotonic() + SECONDS
    with TieredStore(cfg) as store:
        def worker(seed: int) -> None:
            rng = random.Random(seed)
            try:
                while time.monotonic() < stop:
                    start = rng.randrange(0, 400)
                    keys = [key_of(i) for i in range(start, start + rng.randint(1, 12))]
                    op = rng.random()
                    if op < 0.4:
                        data = torch.stack([block_of(k, SHAPE) for k in keys])
                        res = store.put(keys, data).wait(30)
                        assert len(res) == len(keys)
                        kind = "put"
                    elif op < 0.85:
                        out = torch.full((len(keys), *SHAPE), float("nan"))
                        n = store.get(keys, out).wait(30)
                        for i in range(n):
                            assert torch.equal(out[i], block_of(keys[i], SHAPE)), f"wrong bytes for {keys[i].hex()}"
                        kind = "get"
                        with lock:
                            counts["blocks_read"] += n
                            counts["lookups"] += len(keys)
                    else:
                        store.prefetch(keys, to=rng.choice(["gpu", "cpu"])).wait(30)
                        kind = "prefetch"
                    with lock:
                        counts[kind] += 1
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[:3]
        assert store.drain(30)
        st = store.stats()
    print(f"\nstress {SECONDS:.0f}s: {counts}")
    assert counts["get"] > 50 and counts["put"] > 50 and counts["prefetch"] > 5
    assert st["lookups"] == counts["lookups"] == st["hits"] + st["misses"]
    assert st["hits"] == counts["blocks_read"]
    assert st["bytes_in"] == st["bytes_out"] + st["resident_bytes"]
    assert st["inflight_jobs"] == 0 and st["pinned"] == 0 and st["waiting"] == 0
    assert sum(t["hits"] for t in st["tiers"].values()) == st["hits"]
    for name, t in st["tiers"].items():
        assert t["resident_blocks"] <= t["capacity_blocks"], name
