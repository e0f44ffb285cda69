"""Crash safety: a writer SIGKILLed at random moments never leaves a wrong or unopenable store.

What this proves (docs/reliability.md, "Crash"):
- a child process writes blocks to a disk-only store at full speed (random batch sizes,
  random deletes, alternating ``none``/``zstd`` codecs) and is killed with SIGKILL at a
  random moment — usually mid-write, sometimes while it is still opening the store;
- after every kill the store reopens without error (dead writers' slot claims recovered);
- every block the reopened store serves is bit-exact (zero wrong blocks, zero exceptions);
- every put the child saw acknowledged (``wait()`` -> True) before it died is still there:
  with ``disk_sync=False`` a *process* crash loses only blocks whose put had not returned;
- no slot leaks: after recovery, records + free list == high-water mark, no claims pending;
- blocks kept from earlier rounds stay readable across all later crashes.

CI: 10 kills. Long (``TKV_LONG=1``): 50 kills.

Threading contract: single-threaded test; one reader thread per child drains its stdout.
"""
from __future__ import annotations

import random
import signal
import subprocess
import threading
import time

from tests.reliability._common import (LONG, child_env, disk_config, key_of, pick, read_all,
                                       slot_accounting, worker_cmd)
from tiered_kv.store.tiered_store import TieredStore
from tiered_kv.tiers.disk import DiskTier

ROUNDS = pick(10, 50)
DISK_BYTES = 256 << 20  # 65536 slots: far more than a round writes, so nothing is evicted by policy


_startup: list[float] = []  # seconds from spawn to READY in earlier rounds


def _run_and_kill(path, rnd: int, rng: random.Random) -> tuple[list[str], str]:
    codec = "zstd" if rnd % 2 else "none"
    proc = subprocess.Popen(worker_cmd("crash_writer", path, rnd, codec, rng.randrange(1 << 30)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env())
    lines: list[str] = []
    ready = threading.Event()

    def drain():
        for raw in proc.stdout:
            line = raw.decode().rstrip("\n")
            lines.append(line)
            if line == "READY":
                ready.set()
    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    t0 = time.monotonic()
    if rnd % 5 == 4 and _startup:  # kill at a random moment around start-up (open, claim recovery)
        when = "startup"
        time.sleep(rng.uniform(0.7, 1.1) * max(_startup))
    else:
        when = "writing"
        assert ready.wait(120), f"crash_writer never became ready: {proc.stderr.read().decode()[-2000:]}"
        _startup.append(time.monotonic() - t0)
        time.sleep(rng.uniform(0.02, 0.6))
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    reader.join(30)
    err = proc.stderr.read().decode()
    assert proc.returncode in (-signal.SIGKILL, 0) or not err, f"child failed before the kill:\n{err[-3000:]}"
    assert "Traceback" not in err, f"child raised before the kill:\n{err[-3000:]}"
    return lines, when


def test_sigkill_during_writes_never_serves_wrong_blocks(tmp_path):
    path = tmp_path / "kv"
    rng = random.Random(20261122)
    kept: set[bytes] = set()  # acknowledged in earlier rounds and never deleted: must always be served
    totals = {"acked": 0, "survived": 0, "lost": 0, "inflight_survived": 0, "deleted": 0, "wrong": 0}
    for rnd in range(ROUNDS):
        lines, when = _run_and_kill(path, rnd, rng)
        space = f"crash-{rnd}".encode()
        acked, deleted = set(), set()
        for line in lines:
            if line.startswith("A "):
                acked.update(int(x) for x in line.split()[1:])
            elif line.startswith("D "):
                deleted.add(int(line.split()[1]))
        top = max(acked | deleted, default=-1)
        candidates = list(range(top + 17))  # everything mentioned plus one batch in flight
        must = acked - deleted
        keys = {i: key_of(i, space) for i in candidates}

        with TieredStore(disk_config(path, DISK_BYTES)) as store:  # must open without error
            disk = store.tiers[-1]
            assert isinstance(disk, DiskTier)
            acct = slot_accounting(disk)
            served, wrong, missing = read_all(store, list(keys.values()) + sorted(kept))
            served_set, missing_set = set(served), set(missing)
            lost = [i for i in must if keys[i] in missing_set]
            lost_kept = [k for k in kept if k in missing_set]
            inflight = [i for i in candidates if i not in acked and keys[i] in served_set]
            st = store.stats()["tiers"]["disk"]
            print(f"round {rnd:2d} ({when}, {'zstd' if rnd % 2 else 'none'}): acked {len(acked)}, "
                  f"deleted {len(deleted)}, survived {len(must) - len(lost)}, lost {len(lost)}, "
                  f"unacked-but-committed {len(inflight)}, wrong {len(wrong)}, kept-from-earlier "
                  f"{len(kept) - len(lost_kept)}/{len(kept)}, slots {acct}")
            assert not wrong, f"round {rnd}: {len(wrong)} blocks served with wrong bytes"
            assert not lost, f"round {rnd}: acknowledged blocks lost after a process crash: {sorted(lost)[:20]}"
            assert not lost_kept, f"round {rnd}: {len(lost_kept)} blocks from earlier rounds lost"
            assert st["corrupt_dropped"] == 0, f"round {rnd}: a process crash produced damaged records: {st}"
            assert acct["claims"] == 0 and acct["unaccounted"] == 0, f"round {rnd}: slots leaked: {acct}"
            # keep a few of this round's blocks for later rounds, delete the rest (bounded disk use)
            keep = {keys[i] for i in sorted(must)[::25]}
            store.delete([k for k in served_set if k not in keep and k not in kept])
            store.flush()
            kept |= keep
        totals["acked"] += len(acked)
        totals["survived"] += len(must) - len(lost)
        totals["lost"] += len(lost)
        totals["inflight_survived"] += len(inflight)
        totals["deleted"] += len(deleted)
        totals["wrong"] += len(wrong)
    print(f"crash totals over {ROUNDS} SIGKILLs{' (long mode)' if LONG else ''}: {totals}")
    assert totals["acked"] > 0, "the writer never got a put acknowledged: the test proved nothing"
