"""Sharing: four processes on one disk-tier directory never corrupt it, never deadlock, survive a dead writer.

What this proves (docs/reliability.md, "Sharing"):
- 4 worker processes open the same directory and put/get/delete overlapping keys of one
  256-key space for 10 s (``TKV_LONG=1``: 30 s), each reopening its store every 0.5-2 s to
  adopt the others' blocks (and evicting, since each planner holds at most 192 blocks);
  every block any of them is served is bit-exact, and none of them sees an exception;
- a process SIGKILLed while it holds LMDB's write transaction (``txn_holder``) does not
  block the others: every surviving worker makes progress within 5 s of the kill;
- a worker SIGKILLed at a random moment mid-run does not block the others either;
- every worker finishes on time (no deadlock), and afterwards the directory reopens,
  every stored block reads bit-exact, no record is damaged and no slot is unaccounted.

Threading contract: the test thread drives the processes; one reader thread per child
drains its stdout.
"""
from __future__ import annotations

import json
import random
import signal
import subprocess
import threading
import time

from tests.reliability._common import (child_env, disk_config, key_of, pick, read_all, slot_accounting,
                                       worker_cmd)
from tiered_kv.store.tiered_store import TieredStore

SECONDS = pick(10, 30)
WORKERS = 4


class Child:
    """A child process whose stdout lines are collected and whose last heartbeat is tracked."""

    def __init__(self, *args) -> None:
        self.proc = subprocess.Popen(worker_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=child_env())
        self.lines: list[str] = []
        self.ops = 0
        self.ready = threading.Event()
        self.reader = threading.Thread(target=self._drain, daemon=True)
        self.reader.start()

    def _drain(self) -> None:
        for raw in self.proc.stdout:
            line = raw.decode().rstrip("\n")
            self.lines.append(line)
            if line in ("READY", "HOLDING"):
                self.ready.set()
            elif line.startswith("H "):
                self.ops = int(line.split()[1])

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def done(self) -> dict | None:
        for line in self.lines:
            if line.startswith("DONE "):
                return json.loads(line[5:])
        return None


def _progress_after_kill(workers: list[Child], what: str, within: float = 5.0) -> None:
    before = {id(w): w.ops for w in workers}
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if all(w.ops > before[id(w)] or w.proc.poll() is not None for w in workers):
            return
        time.sleep(0.05)
    stuck = [w.proc.pid for w in workers if w.ops <= before[id(w)] and w.proc.poll() is None]
    raise AssertionError(f"workers {stuck} made no progress within {within} s after {what}: deadlock")


def test_four_processes_share_one_directory(tmp_path):
    path = tmp_path / "kv"
    rng = random.Random(4)
    TieredStore(disk_config(path, disk_bytes=192 * 4096)).close()  # create it once, so no open races on format
    workers = [Child("share_worker", path, w, SECONDS, rng.randrange(1 << 30)) for w in range(WORKERS)]
    for w in workers:
        assert w.ready.wait(120), f"worker never opened the store: {w.proc.stderr.read().decode()[-2000:]}"
    t0 = time.monotonic()

    time.sleep(SECONDS * 0.2)
    holder = Child("txn_holder", path)
    assert holder.ready.wait(60), holder.proc.stderr.read().decode()[-2000:]
    time.sleep(1.0)  # the others now queue behind its write transaction
    holder.kill()
    _progress_after_kill(workers, "SIGKILL of a process holding the LMDB write transaction")

    time.sleep(max(0.0, t0 + SECONDS * 0.5 - time.monotonic()))
    victim = workers[rng.randrange(WORKERS)]
    victim.kill()
    survivors = [w for w in workers if w is not victim]
    _progress_after_kill(survivors, "SIGKILL of a worker mid-run")

    for w in survivors:
        try:
            w.proc.wait(SECONDS + 60)
        except subprocess.TimeoutExpired:
            w.kill()
            raise AssertionError(f"worker {w.proc.pid} did not finish: deadlock")
        w.reader.join(30)
        assert w.proc.returncode == 0, w.proc.stderr.read().decode()[-3000:]
    results = [w.done() for w in survivors]
    wrong_lines = [ln for w in workers for ln in w.lines if ln.startswith("WRONG")]
    for r in results:
        print(f"worker {r['wid']}: {r['ops']} ops, {r['put_ok']}/{r['puts']} puts accepted, "
              f"{r['served']}/{r['gets']} reads served, {r['deletes']} deletes, {r['reopens']} reopens, "
              f"wrong {r['wrong']}, errors {len(r['errors'])}")
    assert not wrong_lines, f"blocks served with wrong bytes: {wrong_lines[:5]}"
    for r in results:
        assert r["wrong"] == 0 and not r["errors"], r
        assert r["served"] > 0 and r["put_ok"] > 0, f"worker {r['wid']} did no real work: {r}"

    keys = [key_of(i, b"shared") for i in range(256)]
    with TieredStore(disk_config(path, disk_bytes=192 * 4096)) as store:
        acct = slot_accounting(store.tiers[-1])
        served, wrong, missing = read_all(store, keys)
        st = store.stats()["tiers"]["disk"]
    print(f"after the run: {len(served)} blocks stored and bit-exact, {len(wrong)} wrong, slots {acct}, "
          f"corrupt_dropped {st['corrupt_dropped']}")
    assert not wrong and st["corrupt_dropped"] == 0
    assert acct["claims"] == 0 and acct["unaccounted"] == 0, acct
