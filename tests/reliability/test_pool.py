"""One host pool shared by several processes (issue 33, must-show 1, and 3 for Python-API processes).

What this proves (docs/reliability.md, "One host pool, many processes"), every process real, every pool in
``/dev/shm`` with its LMDB index:

- blocks one process stores are read bit-exact by the others, through ``get`` and through ``lease`` views of
  the shared pages; every process maps the same pages: the pool's memory exists once (its payload's
  allocated bytes), each process's mapping of it is shared, not private (``/proc/<pid>/smaps``), and the
  processes' proportional shares (Pss) add up to one pool;
- three writers of two namespaces, evicting all along, never take the pool past its budget, seen from a
  watcher process sampling the index; no wrong byte, no record vanishing under a lease; each namespace ends
  near its fair share;
- a writer SIGKILLed mid-write (half of each reserved slot written) leaves claims, never a readable torn block,
  and its slots come back at the next write after a second; writers at full speed killed at random moments
  while they hold claims (half of their batches written in place, as the GPU edge will) leave every served
  block bit-exact and every slot accounted;
- a reader SIGKILLed holding leases holds nothing once dead: the next write evicts what it held;
- namespaces never read, list, overwrite or delete each other's blocks across processes.

Threading contract: the test thread drives the children; one thread per child drains its stdout.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests._pool import assert_gone, mapping_usage, pool_path, pool_spec
from tests.reliability._common import (NBYTES, SHAPE, TORCH_DTYPE, blocks_of, child_env, key_of, matches, pick,
                                       pool_config, read_all, slot_accounting)
from tiered_kv.errors import InvalidInputError
from tiered_kv.store.tiered_store import TieredStore
from tiered_kv.tiers.pool.tier import RECOVER_EVERY_S

WORKERS = Path(__file__).with_name("_pool_workers.py")
SHARE_BLOCKS = 16384  # 64 MiB of 4 KiB blocks
BUDGET = 96
SECONDS = pick(4, 30)
MODELS = ("alpha", "beta")


class Child:
    """A ``_pool_workers.py`` role in its own process; its stdout lines are collected as they come."""

    def __init__(self, *args: object) -> None:
        self.proc = subprocess.Popen([sys.executable, str(WORKERS), *map(str, args)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env())
        self.lines: list[str] = []
        self._cv = threading.Condition()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for raw in self.proc.stdout:
            with self._cv:
                self.lines.append(raw.decode().rstrip("\n"))
                self._cv.notify_all()
        with self._cv:
            self.lines.append("<eof>")
            self._cv.notify_all()

    def wait_for(self, prefix: str, timeout: float = 180) -> str:
        """The first line starting with ``prefix`` (fails with the child's stderr when it never comes)."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                hit = next((x for x in self.lines if x.startswith(prefix)), None)
                if hit is not None:
                    return hit
                left = deadline - time.monotonic()
                if "<eof>" in self.lines or left <= 0:
                    break
                self._cv.wait(left)
        self.proc.kill()
        pytest.fail(f"{self.proc.args[2]} never said {prefix!r}; stderr: {self.proc.stderr.read().decode()[-3000:]}")

    def json(self, prefix: str, timeout: float = 180) -> dict:
        """The JSON after ``prefix`` on its line."""
        return json.loads(self.wait_for(prefix, timeout)[len(prefix):])

    def all(self, prefix: str) -> list[str]:
        with self._cv:
            return [x for x in self.lines if x.startswith(prefix)]

    def send(self, line: str) -> None:
        self.proc.stdin.write((line + "\n").encode())
        self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def finish(self, timeout: float = 60) -> None:
        assert self.proc.wait(timeout) == 0, self.proc.stderr.read().decode()[-3000:]


def test_processes_read_each_others_blocks_bit_exact_and_map_one_copy_of_the_pool():
    spec, n = pool_spec("share"), SHARE_BLOCKS
    with TieredStore(pool_config(spec, n)) as mine:  # the test process is one of the pool's users too
        writer = Child("fill", spec, n, n)
        assert writer.wait_for("WROTE") == f"WROTE {n}"
        readers = [Child("read", spec, n, n) for _ in range(2)]
        for r in readers:
            got = r.json("READ ")
            assert got["served"] == n and got["wrong"] == 0 and got["leased"] == n and got["lease_wrong"] == 0, got
        served, wrong, missing = read_all(mine, [key_of(i, b"pool") for i in range(n)], batch=1024)
        assert len(served) == n and not wrong and not missing
        procs = [writer, *readers]
        for c in procs:
            c.wait_for("READY")
            c.send("REPORT")
        payload = mine.pool.slots.path
        maps = {"test": mapping_usage(payload)}
        maps.update({f"{c.proc.args[2]}-{i}": c.json("SMAPS ") for i, c in enumerate(procs)})
        allocated = os.stat(payload).st_blocks * 512
        for c in procs:
            c.send("EXIT")
            c.finish()
    assert_gone(spec)
    pool_bytes = n * NBYTES
    print(f"\npool {pool_bytes >> 20} MiB, payload allocated {allocated >> 20} MiB in /dev/shm")
    for who, m in maps.items():
        print(f"{who:8s} " + " ".join(f"{k}={v >> 10}KiB" for k, v in m.items() if k != "mappings"))
    assert allocated == pool_bytes  # the memory exists once, however many processes map it
    for who, m in maps.items():
        assert m["mappings"] == 1 and m["Rss"] >= 0.99 * pool_bytes, (who, m)  # every page mapped in every process
        assert m["Private_Clean"] + m["Private_Dirty"] <= 0.01 * pool_bytes, (who, m)  # ... and none of it private
    pss = sum(m["Pss"] for m in maps.values())
    assert abs(pss - pool_bytes) <= 0.02 * pool_bytes, pss  # four processes' shares add up to one pool


def test_writers_of_two_namespaces_hold_one_budget_under_a_watcher_process():
    spec = pool_spec("budget")
    with TieredStore(pool_config(spec, BUDGET, "alpha")) as alpha:
        watcher = Child("watch", pool_path(spec) / "index")
        writers = [Child("budget", spec, BUDGET, MODELS[w % 2], w, SECONDS, 100 + w) for w in range(3)]
        results = [w.json("DONE ", SECONDS + 240) for w in writers]
        watcher.wait_for("M ")
        watcher.send("EXIT")
        watcher.finish()
        samples, max_slots, max_used = map(int, watcher.all("M ")[-1].split()[1:])
        print(f"\nwatcher: {samples} samples, records + claims at most {max_slots}, accounted use at most {max_used}")
        for r in results:
            print(f"writer: {r}")
        assert samples > 100 and max_slots <= BUDGET and max_used <= BUDGET
        assert sum(r["put_ok"] for r in results) > 3 * BUDGET, "the writers did not write past the budget"
        assert all(not r["errors"] for r in results), [r["errors"][:3] for r in results]
        assert sum(r["wrong"] for r in results) == 0 and sum(r["served"] for r in results) > 0
        assert sum(r["leased_reads"] for r in results) > 20 and sum(r["vanished_mid_read"] for r in results) == 0
        with TieredStore(pool_config(spec, BUDGET, "beta")) as beta:
            held = {}
            for store in (alpha, beta):
                keys = store.pool.stored_keys()
                usage = store.pool.usage()
                held[store.config.model] = keys
                assert usage["budget_slots"] == BUDGET and len(keys) == usage["spaces"][
                    store.namespace.prefix.hex()]["used_slots"]
                assert len(keys) >= 0.8 * BUDGET / 2, f"{store.config.model} kept {len(keys)}: {usage}"
                served, wrong, _ = read_all(store, keys)
                assert len(served) == len(keys) and not wrong
    assert not set(held["alpha"]) & set(held["beta"]) and len(held["alpha"]) + len(held["beta"]) <= BUDGET
    assert_gone(spec)


def test_a_writer_killed_mid_write_serves_nothing_torn_and_its_slots_come_back():
    spec, blocks = pool_spec("torn"), 64
    rng = random.Random(33)
    with TieredStore(pool_config(spec, blocks)) as mine:
        pool = mine.pool
        child = Child("claim_hang", spec, blocks, 8)
        slots = [int(s) for s in child.wait_for("CLAIMED").split()[1:]]
        torn = [key_of(i, b"torn") for i in range(8)]
        assert len(slots) == 8 and min(slots) >= 0
        assert slot_accounting(pool)["claims"] == 8 and pool.has(torn) == [False] * 8
        child.kill()
        out = torch.empty((8, *SHAPE), dtype=TORCH_DTYPE)
        assert mine.get(torn, out).wait(30) == 0 and mine.contains(torn) == [False] * 8  # never readable
        time.sleep(RECOVER_EVERY_S + 0.2)  # the next write returns the dead writer's claims
        fresh = [key_of(i, b"fresh") for i in range(8)]
        assert mine.put(fresh, blocks_of(fresh)).wait(30) == [True] * 8
        acct = slot_accounting(pool)
        assert acct["claims"] == 0 and acct["unaccounted"] == 0 and acct["records"] == 8, acct
        assert pool.usage()["spaces"][mine.namespace.prefix.hex()]["used_slots"] == 8
        wrong = served = 0
        dead_claims = []
        for rnd in range(3):  # a writer at full speed, killed at a random moment while it holds claims
            loop = Child("put_loop", spec, blocks, rng.randrange(1 << 30))
            loop.wait_for("READY")
            time.sleep(rng.uniform(0.2, 0.8))
            deadline = time.monotonic() + 2
            while slot_accounting(pool)["claims"] == 0 and time.monotonic() < deadline:
                pass  # until it is between a claim and its commit
            loop.kill()
            dead_claims.append(slot_accounting(pool)["claims"])  # > 0: killed between claim and commit
            written = max((int(i) for line in loop.all("A ") for i in line.split()[1:]), default=0)
            got, bad, _ = read_all(mine, [key_of(i, b"loop") for i in range(written + 17)])
            served, wrong = served + len(got), wrong + len(bad)
            time.sleep(RECOVER_EVERY_S + 0.2)
            after = [key_of(i, b"after-%d" % rnd) for i in range(4)]
            assert mine.put(after, blocks_of(after)).wait(30) == [True] * 4  # a write: dead claims go back
            acct = slot_accounting(pool)
            assert acct["claims"] == 0 and acct["unaccounted"] == 0, acct
        print(f"\nkilled writers: claims left by each {dead_claims}, {served} blocks served after, {wrong} wrong")
        assert wrong == 0 and served > 0 and sum(dead_claims) > 0
    assert_gone(spec)


def test_a_reader_killed_holding_leases_holds_nothing_once_dead():
    spec, blocks = pool_spec("lease"), 16
    with TieredStore(pool_config(spec, blocks)) as mine:
        held = [key_of(i, b"held") for i in range(8)]
        assert mine.put(held, blocks_of(held)).wait(30) == [True] * 8
        child = Child("lease_hang", spec, blocks, 8)
        assert child.wait_for("LEASED") == "LEASED 8"
        new = [key_of(i, b"new") for i in range(16)]
        assert mine.put(new, blocks_of(new)).wait(30) == [True] * 8 + [False] * 8  # the leased 8 stay
        assert mine.pool.has(held) == [True] * 8 and mine.pool.usage()["leases"] == 8
        child.kill()
        assert mine.put(new[8:], blocks_of(new[8:])).wait(30) == [True] * 8  # the dead reader's hold is gone
        assert mine.pool.has(held) == [False] * 8 and mine.pool.usage()["leases"] == 0
        served, wrong, _ = read_all(mine, new)
        assert len(served) == 16 and not wrong
    assert_gone(spec)


def test_namespaces_never_read_each_other_across_processes():
    spec, blocks = pool_spec("ns"), 64
    with TieredStore(pool_config(spec, blocks, "beta")) as beta:
        done = Child("alpha", spec, blocks, 8).json("DONE ")
        own, opaque = ([bytes.fromhex(k) for k in done[part]] for part in ("own", "opaque"))
        assert done["ok"] == 16
        out = torch.empty((8, *SHAPE), dtype=TORCH_DTYPE)
        with pytest.raises(InvalidInputError, match="belongs to namespace"):
            beta.get(own, out)  # alpha's keys carry alpha's prefix: refused at the API
        assert beta.contains(opaque) == [False] * 8 and beta.get(opaque, out).wait(30) == 0
        assert beta.put(opaque, torch.zeros((8, *SHAPE), dtype=TORCH_DTYPE)).wait(30) == [False] * 8
        beta.delete(opaque)
        assert beta.pool.stored_keys() == []
        with TieredStore(pool_config(spec, blocks, "alpha")) as alpha:  # alpha's blocks are whole
            both = torch.empty((16, *SHAPE), dtype=TORCH_DTYPE)
            assert alpha.get(own + opaque, both).wait(30) == 16
            assert all(matches(k, b) for k, b in zip(own + opaque, both))
    assert_gone(spec)
