"""Shared helpers for tests/reliability: CI vs. long mode, deterministic block contents, configs.

Mode: CI mode (default) keeps every test bounded so the whole directory runs in a few
minutes on a 2-core box. ``TKV_LONG=1`` in the environment selects the long mode
(more kill rounds, longer sharing and soak runs, more fuzz examples). It is an
environment variable, not a pytest option, so it needs nothing from tests/conftest.py::

    TKV_LONG=1 .venv/bin/python -m pytest tests/reliability -s

Block contents follow from the key alone (a SHAKE-256 stream seeded by the key), so a
reader in any process can verify any block bit-exact without talking to the writer.
Half of each block is a repeated pattern so zstd actually compresses it (both codecs get
exercised when a test turns compression on).

Threading contract: pure functions; safe anywhere (also imported by the child processes
in ``_workers.py``).
"""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import torch

LONG = os.environ.get("TKV_LONG", "") not in ("", "0")
REPO = Path(__file__).resolve().parents[2]

#: One block: 4 x 512 bfloat16 = 4 KiB = exactly one disk slot.
SHAPE = (4, 512)
DTYPE = "bfloat16"
TORCH_DTYPE = torch.bfloat16
NBYTES = 4 * 512 * 2


def pick(ci, long):
    """``long`` in long mode (TKV_LONG=1), else ``ci``."""
    return long if LONG else ci


def key_of(i: int, space: bytes = b"rel") -> bytes:
    """32-byte key for block number ``i`` in key space ``space``."""
    return hashlib.blake2b(space + b"/" + i.to_bytes(8, "little"), digest_size=32).digest()


def content_bytes(key: bytes, nbytes: int = NBYTES) -> bytes:
    """The expected bytes of ``key``: half pseudo-random (seeded by the key), half a key-derived pattern."""
    half = nbytes // 2
    rnd = hashlib.shake_256(b"tkv-content/" + key).digest(half)
    pattern = (key[:8] * (-(-(nbytes - half) // 8)))[: nbytes - half]
    return rnd + pattern


def block_of(key: bytes) -> torch.Tensor:
    """Expected block for ``key`` as a tensor of the store's shape and dtype."""
    raw = bytearray(content_bytes(key))
    return torch.frombuffer(raw, dtype=torch.uint8).view(TORCH_DTYPE).reshape(SHAPE).clone()


def blocks_of(keys) -> torch.Tensor:
    """Stacked expected blocks for ``keys`` (shape ``(len(keys), *SHAPE)``)."""
    if not keys:
        return torch.empty((0, *SHAPE), dtype=TORCH_DTYPE)
    return torch.stack([block_of(k) for k in keys])


def matches(key: bytes, block: torch.Tensor) -> bool:
    """True if ``block`` holds exactly the expected bytes of ``key``."""
    return bytes(block.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()) == content_bytes(key)


def disk_config(path, disk_bytes: int = 64 << 20, **over) -> dict:
    """A disk-only store config (puts land on disk directly) for ``path``."""
    cfg = {"block_shape": list(SHAPE), "dtype": DTYPE, "cpu_bytes": 0, "disk_path": str(path),
           "disk_bytes": disk_bytes, "model": "reliability"}
    cfg.update(over)
    return cfg


def pool_config(spec: str, blocks: int, model: str = "reliability", **over) -> dict:
    """A store whose only tier is the host pool ``spec`` of ``blocks`` blocks (the same in every process)."""
    cfg = {"block_shape": list(SHAPE), "dtype": DTYPE, "cpu_bytes": blocks * NBYTES, "cpu_pool": spec, "model": model}
    cfg.update(over)
    return cfg


def child_env() -> dict:
    """Environment for child processes: the repo on sys.path, quiet logs, one torch thread."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def worker_cmd(*args: str) -> list[str]:
    """Command line running ``tests/reliability/_workers.py`` with ``args``."""
    return [sys.executable, str(Path(__file__).with_name("_workers.py")), *map(str, args)]


def slope(xs, ys) -> float:
    """Least-squares slope of ``ys`` over ``xs`` (0.0 with fewer than two points)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return 0.0 if var == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var


def put_or_get(store, keys, st: dict, put: bool) -> None:
    """One step of a worker sharing a budget: put ``keys`` (counting ``puts`` and ``put_ok`` in ``st``) or get them
    back (counting ``gets``, and each block returned as ``served`` when bit-exact, else ``wrong``)."""
    if put:
        res = store.put(keys, blocks_of(keys)).wait(30)
        st["puts"] += len(keys)
        st["put_ok"] += sum(res)
        return
    out = torch.empty((len(keys), *SHAPE), dtype=TORCH_DTYPE)
    n = store.get(keys, out).wait(30)
    st["gets"] += len(keys)
    for k, b in zip(keys[:n], out[:n]):
        st["served" if matches(k, b) else "wrong"] += 1


def read_all(store, keys, batch: int = 64):
    """Read every key that ``store.contains`` reports; returns (served, wrong, missing) key lists.

    Keys are read in batches of held keys; a batch that comes back short (a record found
    damaged on read) is retried one key at a time so every key gets its own verdict.
    """
    held = store.contains(keys)
    want = [k for k, h in zip(keys, held) if h]
    missing = [k for k, h in zip(keys, held) if not h]
    served, wrong = [], []
    for s in range(0, len(want), batch):
        part = want[s:s + batch]
        out = torch.empty((len(part), *SHAPE), dtype=TORCH_DTYPE)
        n = store.get(part, out).wait(60)
        for k, b in zip(part[:n], out[:n]):
            (served if matches(k, b) else wrong).append(k)
        for k in part[n:]:
            one = torch.empty((1, *SHAPE), dtype=TORCH_DTYPE)
            if store.get([k], one).wait(60) == 1:
                (served if matches(k, one[0]) else wrong).append(k)
            else:
                missing.append(k)
    return served, wrong, missing


def slot_accounting(disk) -> dict:
    """Slots of a DiskTier by fate: records + free list + pending claims vs. the high-water mark."""
    import struct

    with disk.index.env.begin() as txn:
        hwm = struct.unpack(">Q", txn.get(b"hwm", db=disk.index.db_meta))[0]
        records = txn.stat(disk.index.db_records)["entries"]
        free = txn.stat(disk.index.db_free)["entries"]
        claims = txn.stat(disk.index.db_claims)["entries"]
    return {"hwm": hwm, "records": records, "free": free, "claims": claims,
            "unaccounted": hwm - records - free - claims}
