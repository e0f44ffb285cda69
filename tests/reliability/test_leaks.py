"""Leaks: a soak of random put/get/prefetch/delete keeps memory and the planner's counters flat.

What this proves (docs/reliability.md, "Leaks"): a CPU (32 blocks) + disk (128 blocks) store
runs random puts, gets, prefetches and deletes over 400 keys (so evictions and promotions
run all the time) for 60 s (``TKV_LONG=1``: 600 s), sampling RSS (psutil),
``stats()["pinned"]``, ``["inflight_jobs"]`` and ``["waiting"]`` once a second:
- after a warm-up (the first 25%), the RSS slope is under 8 MiB/min (printed; generous for a 60 s run), and the last
  samples are within 16 MiB of the post-warm-up ones;
- every block served is bit-exact;
- deleting a block while its CPU copy is being demoted leaves the planner working (a bug
  this soak found once; pinned by a deterministic regression test below);
- when the soak stops and the store drains: no pinned copies, no jobs in flight, no
  waiters, and the stats invariants hold (lookups = hits + misses;
  bytes_in = bytes_out + resident_bytes).

Threading contract: the test thread issues every call; the store's movers run behind it.
"""
from __future__ import annotations

import random
import time

import psutil
import pytest
import torch

from tiered_kv.planner.chain import TierChain, TierSpec
from tiered_kv.values.jobs import Completion, JobKind
from tests.reliability._common import SHAPE, TORCH_DTYPE, blocks_of, key_of, matches, pick, slope

SECONDS = pick(60, 600)


def test_soak_keeps_rss_and_counters_flat(tmp_path):
    from tiered_kv.store.tiered_store import TieredStore

    rng = random.Random(66)
    keys = [key_of(i, b"soak") for i in range(400)]
    cfg = {"block_shape": list(SHAPE), "dtype": "bfloat16", "cpu_bytes": 32 * 4096, "disk_path": str(tmp_path / "kv"),
           "disk_bytes": 128 * 4096, "model": "soak"}
    proc = psutil.Process()
    samples: list[tuple[float, float, int, int, int]] = []  # t, rss MiB, pinned, inflight, waiting
    ops = served = wrong = 0
    with TieredStore(cfg) as store:
        t0 = time.monotonic()
        next_sample = t0
        while (now := time.monotonic()) - t0 < SECONDS:
            part = rng.sample(keys, rng.randint(1, 8))
            op = rng.random()
            if op < 0.4:
                store.put(part, blocks_of(part)).wait(30)
            elif op < 0.75:
                out = torch.empty((len(part), *SHAPE), dtype=TORCH_DTYPE)
                n = store.get(part, out).wait(30)
                for k, b in zip(part[:n], out[:n]):
                    served += 1
                    wrong += not matches(k, b)
            elif op < 0.9:
                store.prefetch(part, rng.choice(["cpu", "disk", 0, 1])).wait(30)
            else:  # any block, wherever it is and whatever is moving it
                store.delete(part)
            ops += 1
            if now >= next_sample:
                st = store.stats()
                samples.append((now - t0, proc.memory_info().rss / 2**20, st["pinned"], st["inflight_jobs"],
                                st["waiting"]))
                next_sample += 1.0
        assert store.drain(60)
        st = store.stats()
    warm = [s for s in samples if s[0] >= SECONDS * 0.25]
    rss_slope = slope([s[0] / 60 for s in warm], [s[1] for s in warm])  # MiB per minute
    pin_slope = slope([s[0] / 60 for s in warm], [s[2] for s in warm])
    inflight_slope = slope([s[0] / 60 for s in warm], [s[3] for s in warm])
    print(f"soak {SECONDS} s: {ops} ops, {served} blocks served, {wrong} wrong; RSS {warm[0][1]:.1f} -> "
          f"{warm[-1][1]:.1f} MiB, slope {rss_slope:+.3f} MiB/min; pinned slope {pin_slope:+.3f}/min "
          f"(max {max(s[2] for s in samples)}); inflight slope {inflight_slope:+.3f}/min "
          f"(max {max(s[3] for s in samples)}); waiting max {max(s[4] for s in samples)}")
    assert wrong == 0
    assert ops > 100 and served > 0
    assert rss_slope < 8.0, f"RSS grows {rss_slope:.2f} MiB/min after warm-up"
    assert warm[-1][1] - min(s[1] for s in warm[:3]) < 16, "RSS grew more than 16 MiB after warm-up"
    assert abs(pin_slope) < 5 and abs(inflight_slope) < 5
    assert st["pinned"] == 0 and st["inflight_jobs"] == 0 and st["waiting"] == 0, st
    assert st["lookups"] == st["hits"] + st["misses"], st
    assert st["bytes_in"] == st["bytes_out"] + st["resident_bytes"], st


def test_delete_during_demotion_keeps_the_planner_working():
    chain = TierChain([TierSpec("cpu", 2), TierSpec("disk", 10, slotted=False)])
    k1, k2, k3 = b"k1" * 16, b"k2" * 16, b"k3" * 16

    def run(jobs):
        for job in jobs:
            run(chain.complete(Completion(job.job_id, [True] * len(job))))
    run(chain.put([k1, k2], 1))
    jobs = chain.put([k3], 2)  # cpu is full: k1 (LRU) starts demoting to disk, k3 waits for its slot
    demote = [j for j in jobs if j.kind is JobKind.DEMOTE]
    assert demote and demote[0].keys == [k1]
    chain.delete([k1])  # the caller deletes k1 while its demotion is in flight
    run(jobs)  # the demotion completes
    finished = dict(chain.take_finished())
    assert finished.get(2) == [True], f"the put waiting for the demoted slot never finished: {finished}"
