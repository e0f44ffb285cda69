"""A "host" for the remote-tier sharing test: one TieredStore with its own CPU and disk tiers plus the shared
Redis Cluster, run as ``python _remote_worker.py write|read DIR URL N SEED``.

- ``write``: puts N blocks (keys and bytes from SEED), waits until every write-through copy reached Redis,
  prints ``DONE {json}``.
- ``read``: waits for its presence feed to catch up, reads the N keys, checks every block bit-exact and
  prints ``DONE {json}`` with what was served and from which tier.

Threading contract: one process, one caller thread.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from tiered_kv.store.tiered_store import TieredStore  # noqa: E402

SHAPE = (2, 4, 8, 64)


def blocks(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *SHAPE), generator=g, dtype=torch.float32).to(torch.bfloat16)


def config(path: str, url: str) -> dict:
    return dict(block_shape=list(SHAPE), dtype="bfloat16", model="shared-model", cpu_bytes=4 * 8192,
                disk_path=path, disk_bytes=64 * 8192, remote_url=url, remote_password_env="TKV_TEST_REDIS_PASSWORD",
                remote_timeout_s=1.0)


def main(role: str, path: str, url: str, n: str, seed: str) -> None:
    n, seed = int(n), int(seed)
    with TieredStore(config(path, url)) as store:
        tokens = list(range(seed, seed + n * 16))
        keys = store.keys_for_tokens(tokens)
        want = blocks(n, seed)
        if role == "write":
            ok = store.put(keys, want).wait(30)
            drained = store.drain(30)
            out = {"accepted": sum(ok), "drained": drained, "remote": store.stats()["tiers"]["remote"]["blocks_in"]}
        else:
            caught_up = store.wait_remote_sync(20)
            held = store.locate(keys)
            got = torch.zeros_like(want)
            served = store.get(keys, got).wait(30)
            exact = [bool(torch.equal(got[i], want[i])) for i in range(served)]
            out = {"caught_up": caught_up, "held": held, "served": served, "exact": sum(exact),
                   "remote_hits": store.stats()["tiers"]["remote"]["hits"]}
    print("DONE " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
