"""One disk directory shared by 4 processes of 2 namespaces under one budget (issue 17, shows 1).

What this proves (docs/reliability.md, "Sharing one directory"):
- 4 processes (2 namespaces x 2) write far more than a shared ``disk_bytes`` for 8 s (``TKV_LONG=1``:
  30 s); a watcher in the test process checks the directory from outside every 20 ms: records plus
  claims in flight never exceed the budget, and the payload file never holds more than the budget's
  bytes on disk;
- no process is ever served a wrong byte, and no record read under a lease vanishes mid-read;
- each namespace keeps its fair share: at the end each holds at least 80% of half the budget, though
  each could have filled it alone;
- afterwards each namespace lists, adopts and reads only its own records (bit-exact).

Threading contract: the test thread drives the processes; one reader thread per child.
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import threading
import time

import lmdb
import torch

from tests.reliability._common import SHAPE, TORCH_DTYPE, child_env, disk_config, matches, pick, worker_cmd
from tiered_kv.store.tiered_store import TieredStore

SECONDS = pick(8, 30)
BUDGET = 96  # slots of 4 KiB: the 4 processes write from 2 x 400 keys
MODELS = ("alpha", "beta")


def _watch(path, stop: threading.Event, seen: dict) -> None:
    """From outside the workers: records + claims and the payload file's allocated bytes, every 20 ms."""
    env = None
    while not stop.is_set():
        try:
            if env is None:
                opened = lmdb.open(str(path / "index"), readonly=True, lock=True, max_dbs=16, subdir=True)
                try:
                    dbs = {n: opened.open_db(n.encode(), create=False) for n in ("records", "claims", "spaces")}
                except lmdb.Error:
                    opened.close()  # the first worker has not created them yet
                    raise
                env = opened
            with env.begin() as txn:
                records = txn.stat(dbs["records"])["entries"]
                claims = txn.stat(dbs["claims"])["entries"]
                used = {bytes(k).hex(): struct.unpack("<IQQQ", bytes(v))[2] for k, v in txn.cursor(db=dbs["spaces"])}
            st = os.stat(path / "payload.bin")
            seen["samples"] += 1
            seen["max_slots"] = max(seen["max_slots"], records + claims)
            seen["max_used"] = max(seen["max_used"], sum(used.values()))
            seen["max_alloc"] = max(seen["max_alloc"], st.st_blocks * 512)
        except (lmdb.Error, FileNotFoundError):
            pass  # not created yet
        time.sleep(0.02)
    if env is not None:
        env.close()


def test_four_processes_two_namespaces_one_budget(tmp_path):
    path = tmp_path / "kv"
    procs = []
    for w in range(4):
        model = MODELS[w % 2]
        procs.append(subprocess.Popen(worker_cmd("budget_worker", path, model, w, SECONDS, 100 + w, BUDGET),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env()))
        if w == 0:
            time.sleep(1.0)  # the first one creates the directory
    seen = {"samples": 0, "max_slots": 0, "max_used": 0, "max_alloc": 0}
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(path, stop, seen), daemon=True)
    watcher.start()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=SECONDS + 120)
        lines = out.decode().splitlines()
        done = [json.loads(x[5:]) for x in lines if x.startswith("DONE ")]
        assert p.returncode == 0 and done, f"worker died rc={p.returncode}: {err.decode()[-2000:]}"
        results.append(done[0])
    stop.set()
    watcher.join(5)
    print(f"\nwatcher: {seen}")
    for r in results:
        print(f"worker: {r}")
    assert seen["samples"] > 50
    assert seen["max_slots"] <= BUDGET and seen["max_used"] <= BUDGET, seen
    assert seen["max_alloc"] <= BUDGET * 4096, seen
    assert sum(r["put_ok"] for r in results) > 4 * BUDGET, "the workers did not write more than the budget"
    assert all(not r["errors"] for r in results), [r["errors"][:3] for r in results]
    assert sum(r["wrong"] for r in results) == 0
    assert sum(r["served"] for r in results) > 0
    assert sum(r["leased_reads"] for r in results) > 50
    assert sum(r["vanished_mid_read"] for r in results) == 0

    held = {}
    for model in MODELS:
        with TieredStore(disk_config(path, disk_bytes=BUDGET * 4096, model=model, disk_budget="shared")) as s:
            usage = s.tiers[-1].usage()
            mine = s.tiers[-1].stored_keys()
            held[model] = mine
            assert usage["mode"] == "shared" and usage["budget_slots"] == BUDGET
            assert len(mine) == usage["spaces"][s.namespace.prefix.hex()]["used_slots"]
            assert len(mine) >= 0.8 * BUDGET / 2, f"{model} kept {len(mine)} of its share {BUDGET // 2}: {usage}"
            out = torch.empty((len(mine), *SHAPE), dtype=TORCH_DTYPE)
            assert s.get(mine, out).wait(60) == len(mine)
            assert all(matches(k, out[i]) for i, k in enumerate(mine))
    assert not set(held["alpha"]) & set(held["beta"])
    assert len(held["alpha"]) + len(held["beta"]) <= BUDGET
