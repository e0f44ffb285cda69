"""Child-process roles for tests/reliability/test_pool.py (run as ``python _pool_workers.py <role> ...``).

Every role opens the host pool ``SPEC`` of ``BLOCKS`` blocks through a ``TieredStore`` (namespace ``rel``
unless a model is named), and says what it did in whole lines on stdout (a SIGKILL never leaves half a line):

- ``fill SPEC BLOCKS N``: puts blocks ``0..N-1`` (key space ``pool``); ``WROTE <accepted>``; then ``hold``.
- ``read SPEC BLOCKS N``: reads them back through ``get`` and through ``lease`` views, checks every byte;
  ``READ {json}``; then ``hold``.
- ``hold`` (the end of both): ``READY``; on the line ``REPORT`` from stdin, ``SMAPS {json}`` (how this
  process maps the pool's payload); on ``EXIT`` (or stdin closed) closes its store and exits.
- ``alpha SPEC BLOCKS N``: namespace ``alpha`` stores N blocks under its own keys and N under opaque keys
  (key space ``opaque``); ``DONE {json}`` with both lists of keys (hex); exits.
- ``budget SPEC MODEL WID SECONDS SEED``: for SECONDS puts, gets and slow leased reads of its namespace's key
  space (shared with the other process of its namespace) while the others evict; ``DONE {json}`` with
  accepted puts, bytes served and wrong, leased reads and records that vanished under a lease (must be 0).
- ``watch INDEX``: opens the pool's LMDB index read-only and samples records + claims and the namespaces'
  accounted use every 5 ms until a line (or EOF) on stdin; ``M <samples> <max records+claims> <max used>``
  every 20 samples and at the end.
- ``claim_hang SPEC BLOCKS N``: reserves N slots (key space ``torn``), fills half of each, ``CLAIMED <slots>``,
  sleeps (SIGKILLed mid-write).
- ``put_loop SPEC BLOCKS SEED``: stores batches at full speed, one in five through ``put``, the others written
  in place (``reserve``, the bytes made in the reserved slots, ``publish``: most of its time between claim and
  commit, so a kill at a random moment is mostly mid-write); ``A <ids>`` after each acknowledged batch.
- ``lease_hang SPEC BLOCKS N``: leases blocks ``0..N-1`` of key space ``held``, checks them,
  ``LEASED <hits>``, sleeps (SIGKILLed holding the leases).

Threading contract: each role runs in its own process, on its main thread.
"""
from __future__ import annotations

import json
import os
import random
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests._pool import mapping_usage  # noqa: E402
from tests.reliability._common import (NBYTES, SHAPE, TORCH_DTYPE, blocks_of, content_bytes, key_of,  # noqa: E402
                                       matches, pool_config, put_or_get)


def say(line: str) -> None:
    """One whole line to stdout in a single write."""
    os.write(1, (line + "\n").encode())


def open_store(spec: str, blocks: str, model: str = "reliability"):
    from tiered_kv.store.tiered_store import TieredStore

    return TieredStore(pool_config(spec, int(blocks), model))


def hold(store) -> None:
    say("READY")
    for line in sys.stdin:
        if line.strip() == "REPORT":
            say("SMAPS " + json.dumps(mapping_usage(store.pool.slots.path)))
        elif line.strip() == "EXIT":
            break
    store.close()


def fill(spec: str, blocks: str, n: str) -> None:
    store = open_store(spec, blocks)
    keys = [key_of(i, b"pool") for i in range(int(n))]
    ok = 0
    for s in range(0, len(keys), 1024):
        ok += sum(store.put(keys[s:s + 1024], blocks_of(keys[s:s + 1024])).wait(120))
    say(f"WROTE {ok}")
    hold(store)


def read(spec: str, blocks: str, n: str) -> None:
    import torch

    store = open_store(spec, blocks)
    keys = [key_of(i, b"pool") for i in range(int(n))]
    st = {"served": 0, "wrong": 0, "leased": 0, "lease_wrong": 0, "pinned_fraction": store.pool.pinned_fraction}
    for s in range(0, len(keys), 1024):
        part = keys[s:s + 1024]
        out = torch.empty((len(part), *SHAPE), dtype=TORCH_DTYPE)
        got = store.get(part, out).wait(120)
        for k, b in zip(part[:got], out[:got]):
            st["served" if matches(k, b) else "wrong"] += 1
        with store.pool.lease(part) as held:  # the shared pages themselves
            for k, v in zip(part, held.views):
                if v is not None:
                    st["leased" if bytes(v.numpy()) == content_bytes(k) else "lease_wrong"] += 1
    say("READ " + json.dumps(st))
    hold(store)


def alpha(spec: str, blocks: str, n: str) -> None:
    store = open_store(spec, blocks, "alpha")
    own = [store.key(b"a%d" % i) for i in range(int(n))]
    opaque = [key_of(i, b"opaque") for i in range(int(n))]
    ok = store.put(own + opaque, blocks_of(own + opaque)).wait(60)
    store.close()
    say("DONE " + json.dumps({"ok": sum(ok), "own": [k.hex() for k in own], "opaque": [k.hex() for k in opaque]}))


def budget(spec: str, blocks: str, model: str, wid: str, seconds: str, seed: str) -> None:
    import torch

    rng = random.Random(int(seed))
    store = open_store(spec, blocks, model)
    space, nkeys = model.encode(), 300
    st = {"wid": int(wid), "model": model, "puts": 0, "put_ok": 0, "gets": 0, "served": 0, "wrong": 0,
          "leased_reads": 0, "vanished_mid_read": 0, "errors": []}
    say("READY")
    deadline = time.monotonic() + float(seconds)
    while time.monotonic() < deadline:
        keys = [key_of(i, space) for i in rng.sample(range(nkeys), rng.randint(1, 8))]
        op = rng.random()
        try:
            if op < 0.85:
                put_or_get(store, keys, st, put=op < 0.5)
            else:  # a slow read of the shared pages under leases, while the others keep evicting
                with store.pool.lease(keys) as held:
                    time.sleep(0.05)
                    for k, v in zip(keys, held.views):
                        if v is not None:
                            st["leased_reads"] += 1
                            if bytes(v.numpy()) != content_bytes(k) or not store.pool.has([k])[0]:
                                st["vanished_mid_read"] += 1
        except Exception as exc:  # reported: the test asserts there are none
            st["errors"].append(f"{type(exc).__name__}: {exc}"[:200])
    store.close()
    say("DONE " + json.dumps(st))


def watch(index: str) -> None:
    import threading

    import lmdb

    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    env = lmdb.open(index, readonly=True, lock=True, max_dbs=16, subdir=True)
    dbs = {n: env.open_db(n.encode(), create=False) for n in ("records", "claims", "spaces")}
    samples = max_slots = max_used = 0
    while not stop.is_set():
        with env.begin() as txn:
            slots = txn.stat(dbs["records"])["entries"] + txn.stat(dbs["claims"])["entries"]
            used = sum(struct.unpack("<IQQQ", bytes(v))[2] for _, v in txn.cursor(db=dbs["spaces"]))
        samples += 1
        max_slots, max_used = max(max_slots, slots), max(max_used, used)
        if samples % 20 == 0:
            say(f"M {samples} {max_slots} {max_used}")
        time.sleep(0.005)
    say(f"M {samples} {max_slots} {max_used}")
    env.close()


def claim_hang(spec: str, blocks: str, n: str) -> None:
    import torch

    store = open_store(spec, blocks)
    keys = [key_of(i, b"torn") for i in range(int(n))]
    res = store.pool.reserve(keys)
    for k, v in zip(keys, res.views):
        if v is not None:  # half of the block written, as a writer killed mid-copy leaves it
            v[:NBYTES // 2].copy_(torch.frombuffer(bytearray(content_bytes(k)[:NBYTES // 2]), dtype=torch.uint8))
    say("CLAIMED " + " ".join(str(s) for s in res.slots))
    time.sleep(600)


def put_loop(spec: str, blocks: str, seed: str) -> None:
    import torch

    rng = random.Random(int(seed))
    store = open_store(spec, blocks)
    say("READY")
    nxt = 0
    while True:
        ids = list(range(nxt, nxt + rng.randint(1, 16)))
        nxt = ids[-1] + 1
        keys = [key_of(i, b"loop") for i in ids]
        if rng.random() < 0.2:
            res = store.put(keys, blocks_of(keys)).wait(60)
        else:  # in place, as the GPU edge will: the bytes are made inside the reserved slots, then published
            held = store.pool.reserve(keys)
            for k, v in zip(keys, held.views):
                if v is not None:
                    v.copy_(torch.frombuffer(bytearray(content_bytes(k)), dtype=torch.uint8))
            res = store.pool.publish(held)
        say("A " + " ".join(str(i) for i, r in zip(ids, res) if r))


def lease_hang(spec: str, blocks: str, n: str) -> None:
    store = open_store(spec, blocks)
    keys = [key_of(i, b"held") for i in range(int(n))]
    held = store.pool.lease(keys)
    good = sum(1 for k, v in zip(keys, held.views) if v is not None and bytes(v.numpy()) == content_bytes(k))
    say(f"LEASED {good}")
    time.sleep(600)


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    {"fill": fill, "read": read, "alpha": alpha, "budget": budget, "watch": watch, "claim_hang": claim_hang,
     "put_loop": put_loop, "lease_hang": lease_hang}[role](*args)
