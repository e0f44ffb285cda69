"""Child-process entry points for tests/reliability (run as ``python _workers.py <command> ...``).

Each command is one role a test needs in another process:

- ``crash_writer DIR ROUND CODEC SEED``: writes blocks to a disk-only store at full speed
  until SIGKILLed. Prints ``READY`` once open, ``A <ids>`` after each put the store
  acknowledged (so every printed id was committed before the line was written) and
  ``D <id>`` *before* it deletes an id.
- ``share_worker DIR WID SECONDS SEED``: puts/gets/deletes overlapping keys of one shared
  key space, reopening its store now and then to adopt the others' blocks; verifies every
  served block bit-exact. Prints heartbeats ``H <ops>`` and a final ``DONE {json}``.
- ``budget_worker DIR MODEL WID SECONDS SEED BUDGET_SLOTS``: one process of namespace MODEL on a
  directory with one shared budget: puts, gets and slow reads under leases; prints ``DONE {json}``
  with wrong bytes and leased records that vanished mid-read (both must be 0).
- ``txn_holder DIR``: opens the store's LMDB index directly, begins a write transaction,
  prints ``HOLDING`` and sleeps (the test SIGKILLs it while it holds the writer lock).
- ``fill_slots DIR N``: opens a store on DIR, puts N blocks of key space ``other``, closes.
- ``damage_trials ROOT FIRST LAST NKEYS [CPU_BYTES]``: for each trial directory ROOT/<i>, opens a
  store (with a CPU tier of CPU_BYTES, then also round-trips new blocks after the reads: serving
  goes on whether or not the disk tier was quarantined), reads back key_of(0..NKEYS-1) and prints
  one verdict line per trial:
  ``T <i> OPEN <typed|raw> <type>: <msg>`` or ``T <i> READ <json>``. A trial that kills the
  process (SIGBUS, abort) shows up to the parent as a missing verdict.

Threading contract: each command runs in its own process, single caller thread.
"""
from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from tests.reliability._common import (SHAPE, TORCH_DTYPE, blocks_of, disk_config, key_of,  # noqa: E402
                                       matches, put_or_get)
from tiered_kv.errors import TieredKVError  # noqa: E402
from tiered_kv.store.tiered_store import TieredStore  # noqa: E402


def say(line: str) -> None:
    """One whole line to stdout in a single write (a SIGKILL never leaves half a line)."""
    os.write(1, (line + "\n").encode())


def crash_writer(path: str, rnd: str, codec: str, seed: str) -> None:
    rng = random.Random(int(seed))
    space = f"crash-{rnd}".encode()
    # the test's budget (test_crash.DISK_BYTES): the directory's quota is one per namespace, the last opener's
    store = TieredStore(disk_config(path, disk_bytes=256 << 20, compression=codec))
    say("READY")
    acked: list[int] = []
    nxt = 0
    while True:
        n = rng.randint(1, 16)
        ids = list(range(nxt, nxt + n))
        nxt += n
        keys = [key_of(i, space) for i in ids]
        res = store.put(keys, blocks_of(keys)).wait(60)
        ok = [i for i, r in zip(ids, res) if r]
        acked += ok
        say("A " + " ".join(map(str, ok)))
        if acked and rng.random() < 0.15:
            victim = acked.pop(rng.randrange(len(acked)))
            say(f"D {victim}")
            store.delete([key_of(victim, space)])


def share_worker(path: str, wid: str, seconds: str, seed: str) -> None:
    rng = random.Random(int(seed))
    space, nkeys = b"shared", 256
    cfg = disk_config(path, disk_bytes=192 * 4096)
    stats = {"wid": int(wid), "ops": 0, "puts": 0, "put_ok": 0, "gets": 0, "served": 0, "wrong": 0,
             "deletes": 0, "reopens": 0, "errors": []}
    deadline = time.monotonic() + float(seconds)
    store = TieredStore(cfg)
    say("READY")
    next_reopen = time.monotonic() + rng.uniform(0.5, 2.0)
    last_beat = 0.0
    while time.monotonic() < deadline:
        try:
            op = rng.random()
            ids = rng.sample(range(nkeys), rng.randint(1, 8))
            keys = [key_of(i, space) for i in ids]
            if op < 0.45:
                res = store.put(keys, blocks_of(keys)).wait(30)
                stats["puts"] += len(keys)
                stats["put_ok"] += sum(res)
            elif op < 0.9:
                held = [k for k, h in zip(keys, store.contains(keys)) if h]
                out = torch.empty((len(held), *SHAPE), dtype=TORCH_DTYPE)
                n = store.get(held, out).wait(30)
                stats["gets"] += len(held)
                for k, b in zip(held[:n], out[:n]):
                    if matches(k, b):
                        stats["served"] += 1
                    else:
                        stats["wrong"] += 1
                        say(f"WRONG {k.hex()}")
            else:
                store.delete(keys[:2])
                stats["deletes"] += 2
            if time.monotonic() > next_reopen:
                store.close()
                store = TieredStore(cfg)
                stats["reopens"] += 1
                next_reopen = time.monotonic() + rng.uniform(0.5, 2.0)
        except Exception as exc:  # counted and reported: the test asserts there are none
            stats["errors"].append(f"{type(exc).__name__}: {exc}"[:200])
            say(f"E {type(exc).__name__}: {exc}"[:300])
        stats["ops"] += 1
        now = time.monotonic()
        if now - last_beat > 0.2:
            say(f"H {stats['ops']}")
            last_beat = now
    store.close()
    say("DONE " + json.dumps(stats))


def budget_worker(path: str, model: str, wid: str, seconds: str, seed: str, budget_slots: str) -> None:
    """One of several processes of two namespaces on one directory with one shared budget (issue 17).

    Puts blocks of its namespace's key space (shared with the other process of its namespace), gets
    them back through the store, and now and then reads leased records slowly, straight from the
    tier, while the others evict: a leased record must read back bit-exact (never vanish mid-read).
    """
    from tiered_kv.values.record import RecordHeader

    rng = random.Random(int(seed))
    space, nkeys = model.encode(), 400
    cfg = disk_config(path, disk_bytes=int(budget_slots) * 4096, model=model, disk_budget="shared")
    st = {"wid": int(wid), "model": model, "puts": 0, "put_ok": 0, "gets": 0, "served": 0, "wrong": 0,
          "leased_reads": 0, "vanished_mid_read": 0, "errors": []}
    store = TieredStore(cfg)
    disk = store.tiers[-1]
    say("READY")
    deadline = time.monotonic() + float(seconds)
    last_beat = 0.0
    ops = 0
    while time.monotonic() < deadline:
        try:
            keys = [key_of(i, space) for i in rng.sample(range(nkeys), rng.randint(1, 8))]
            op = rng.random()
            if op < 0.85:
                put_or_get(store, keys, st, put=op < 0.5)
            else:  # a slow read under leases, while the other processes keep evicting
                raws, leases = disk.index.lease(keys)
                try:
                    time.sleep(0.05)
                    for k, raw in zip(keys, raws):
                        if raw is None:
                            continue
                        st["leased_reads"] += 1
                        dst = torch.empty(disk.block_nbytes, dtype=torch.uint8)
                        try:
                            disk.slots.read(RecordHeader.unpack(k, raw), dst)
                            ok = matches(k, dst.view(TORCH_DTYPE).reshape(SHAPE))
                        except Exception:
                            ok = False
                        still = disk.index.has([k])[0]
                        if not ok or not still:
                            st["vanished_mid_read"] += 1
                            say(f"VANISHED {k.hex()} ok={ok} still={still}")
                finally:
                    disk.index.unlease(leases, [])
        except Exception as exc:
            st["errors"].append(f"{type(exc).__name__}: {exc}"[:200])
            say(f"E {type(exc).__name__}: {exc}"[:300])
        ops += 1
        now = time.monotonic()
        if now - last_beat > 0.2:
            say(f"H {ops}")
            last_beat = now
    store.close()
    say("DONE " + json.dumps(st))


def txn_holder(path: str) -> None:
    import lmdb

    env = lmdb.open(str(Path(path) / "index"), map_size=64 << 20, max_dbs=4, subdir=True, lock=True)
    meta = env.open_db(b"meta")
    txn = env.begin(write=True)
    txn.put(b"holder", str(os.getpid()).encode(), db=meta)
    say("HOLDING")
    time.sleep(3600)


def fill_slots(path: str, n: str, disk_bytes: str) -> None:
    keys = [key_of(i, b"other") for i in range(int(n))]
    with TieredStore(disk_config(path, disk_bytes=int(disk_bytes))) as store:
        res = store.put(keys, blocks_of(keys)).wait(60)
        store.flush()
    say(f"FILLED {sum(res)}")


def damage_trials(root: str, first: str, last: str, nkeys: str, cpu_bytes: str = "0") -> None:
    keys = [key_of(i, b"damage") for i in range(int(nkeys))]
    for i in range(int(first), int(last)):
        path = Path(root) / str(i)
        try:
            store = TieredStore(disk_config(path, disk_bytes=4 << 20, cpu_bytes=int(cpu_bytes)))
        except TieredKVError as exc:
            say(f"T {i} OPEN typed {type(exc).__name__}: {exc}"[:400].replace("\n", " "))
            continue
        except Exception as exc:
            say(f"T {i} OPEN raw {type(exc).__name__}: {exc}"[:400].replace("\n", " "))
            continue
        verdict = {"served": 0, "wrong": 0, "missing": 0, "get_errors": 0}
        for k in keys:
            out = torch.empty((1, *SHAPE), dtype=TORCH_DTYPE)
            try:
                n = store.get([k], out).wait(30)
            except Exception:
                verdict["get_errors"] += 1
                continue
            if n == 1:
                verdict["served" if matches(k, out[0]) else "wrong"] += 1
            else:
                verdict["missing"] += 1
        st = store.stats()
        disk = st["tiers"].get("disk", {})
        verdict["corrupt_dropped"] = disk.get("corrupt_dropped", 0)
        verdict["failed_transfers"] = disk.get("failed_transfers", 0)
        verdict["quarantined"] = st["disk_quarantined"] is not None
        if int(cpu_bytes):  # serving goes on: a new block round-trips through the tiers left
            fresh = [key_of(10**6 + i, b"after") for i in range(4)]
            try:
                stored = store.put(fresh, blocks_of(fresh)).wait(30)
                out = torch.empty((4, *SHAPE), dtype=TORCH_DTYPE)
                got = store.get(fresh, out).wait(30)
                verdict["after_ok"] = all(stored) and got == 4 and all(matches(k, out[j]) for j, k in enumerate(fresh))
            except Exception as exc:
                verdict["get_errors"] += 1
                verdict["after_error"] = f"{type(exc).__name__}: {exc}"
        try:
            store.close()
        except Exception as exc:
            verdict["close_error"] = f"{type(exc).__name__}: {exc}"
        say(f"T {i} READ " + json.dumps(verdict))


COMMANDS = {"crash_writer": crash_writer, "share_worker": share_worker, "budget_worker": budget_worker,
            "txn_holder": txn_holder,
            "fill_slots": fill_slots, "damage_trials": damage_trials}

if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.ERROR)
    COMMANDS[sys.argv[1]](*sys.argv[2:])
