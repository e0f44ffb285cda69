"""Repair of a damaged disk-tier directory: rebuild its index from what can be salvaged, else start fresh.

The payload file is not self-describing: a slot holds a block's bytes only, and which key a slot
holds, with the checksum that proves it, lives in the index (values/record.py). So a rebuild needs
the record headers. ``repair`` reads them out of the damaged index in a child process
(``check.py --dump``; LMDB may die on a damaged page, and every line printed before that is kept),
then keeps a record only when its header verifies (the header checksum covers the key), its owner
entry was salvaged (so no block changes namespace), and its payload in ``payload.bin`` matches the
header's checksum. The damaged index is moved aside (``index.damaged-<time>``) and a new one holds
the survivors at their old slots; the other slots go to the free list. When not even the format
record (slot size) can be read, the payload file is moved aside too and the directory starts empty.

Threading contract: run while no process has the directory open (a command-line tool's job).
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import lmdb

from tiered_kv.errors import ConfigError, RecordError
from tiered_kv.tiers.disk import check
from tiered_kv.tiers.disk.budget import OWNER_LEN, Space
from tiered_kv.tiers.disk.index import FORMAT
from tiered_kv.values.record import RecordHeader, payload_checksum

_U64 = struct.Struct(">Q")


def salvage(idx: Path, timeout: float = 300.0) -> tuple[dict, list[tuple[bytes, bytes, bytes | None]]]:
    """What a child process could read of the index at ``idx``: (meta as bytes, [(key, header, owner)])."""
    try:
        r = subprocess.run(check.child_command("--dump", str(idx)), capture_output=True, timeout=timeout)
        out = r.stdout
        if r.returncode == check.NO_LMDB_EXIT:  # nothing was read: refuse before anything is moved aside
            why = out.decode(errors="replace").strip()
            raise ConfigError(f"{str(idx)!r}: the salvage process cannot import lmdb ({why}); install lmdb for "
                              f"{sys.executable} and run the repair again")
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or b""
    meta: dict = {}
    records = []
    for line in out.decode(errors="replace").splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            break  # a line cut by the child's death
        if "meta" in item:
            meta = {k: bytes.fromhex(v) for k, v in item["meta"].items()}
        elif "k" in item:
            records.append((bytes.fromhex(item["k"]), bytes.fromhex(item["h"]),
                            None if item["o"] is None else bytes.fromhex(item["o"])))
    return meta, records


def repair(path: str | os.PathLike) -> dict:
    """Rebuild the index of the disk-tier directory ``path`` (see the module docstring). Returns a summary:
    ``salvaged``, ``dropped`` (records read but failing a check), ``fresh`` (started empty), ``moved``."""
    root = Path(path)
    idx = root / "index"
    payload = root / "payload.bin"
    if not idx.is_dir():
        raise ConfigError(f"{str(root)!r} holds no disk-tier index (no index/ inside)")
    meta, records = salvage(idx)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    moved = [str(idx.rename(root / f"index.damaged-{stamp}"))]
    try:
        fmt = json.loads(meta["format"])
        slot_bytes = int(fmt["slot_bytes"])
        ok_format = fmt.get("format") == FORMAT and slot_bytes > 0 and slot_bytes % 4096 == 0
    except (KeyError, ValueError, TypeError):
        ok_format = False
    if not ok_format or not payload.exists():
        if payload.exists():
            moved.append(str(payload.rename(root / f"payload.bin.damaged-{stamp}")))
        return {"salvaged": 0, "dropped": len(records), "fresh": True, "moved": moved}
    accounted = "acct" in meta
    keep: list[tuple[bytes, RecordHeader, bytes, bytes | None]] = []
    dropped = 0
    nslots = os.path.getsize(payload) // slot_bytes
    seen_slots: set[int] = set()
    with open(payload, "rb") as f:
        for key, raw, owner in records:
            try:
                hdr = RecordHeader.unpack(key, raw)
            except RecordError:
                dropped += 1
                continue
            if (accounted and (owner is None or len(owner) != OWNER_LEN + 8)) or hdr.slot >= nslots \
                    or hdr.slot in seen_slots or hdr.payload_len > slot_bytes:
                dropped += 1
                continue
            f.seek(hdr.slot * slot_bytes)
            if payload_checksum(f.read(hdr.payload_len)) != hdr.payload_xxh:
                dropped += 1
                continue
            seen_slots.add(hdr.slot)
            keep.append((key, hdr, raw, owner[:OWNER_LEN] if owner else None))
    _write_index(idx, meta, slot_bytes, nslots, keep, accounted)
    return {"salvaged": len(keep), "dropped": dropped, "fresh": False, "moved": moved}


def _write_index(idx: Path, meta: dict, slot_bytes: int, nslots: int, keep: list, accounted: bool) -> None:
    """A new index holding ``keep`` at their slots; every other slot below the high-water mark is free."""
    idx.mkdir(mode=0o700)
    env = lmdb.open(str(idx), map_size=max(64 << 20, nslots * 512 + (32 << 20)), max_dbs=10, subdir=True,
                    mode=0o600)
    try:
        dbs = {n: env.open_db(n.encode()) for n in ("records", "free", "claims", "meta", "owners", "order",
                                                     "spaces", "leases")}
        hwm = max((h.slot + 1 for _, h, _, _ in keep), default=0)
        used = {h.slot for _, h, _, _ in keep}
        spaces: dict[bytes, Space] = {}  # weights and quotas come back when each namespace opens again
        with env.begin(write=True) as txn:
            txn.put(b"format", json.dumps({"format": FORMAT, "slot_bytes": slot_bytes}).encode(), db=dbs["meta"])
            txn.put(b"slots", _U64.pack(max(nslots, hwm)), db=dbs["meta"])
            txn.put(b"hwm", _U64.pack(hwm), db=dbs["meta"])
            for name in ("budget_mode", "budget"):
                if name in meta:
                    txn.put(name.encode(), meta[name], db=dbs["meta"])
            for s in range(hwm):
                if s not in used:
                    txn.put(_U64.pack(s), b"", db=dbs["free"])
            for tick, (key, hdr, raw, owner) in enumerate(sorted(keep, key=lambda r: r[1].created_ns), 1):
                txn.put(key, raw, db=dbs["records"])
                if accounted:
                    txn.put(key, owner + _U64.pack(tick), db=dbs["owners"])
                    txn.put(owner + _U64.pack(tick) + key, b"", db=dbs["order"])
                    spaces.setdefault(owner, Space()).used += 1
            if accounted:
                txn.put(b"tick", _U64.pack(len(keep) + 1), db=dbs["meta"])
                txn.put(b"acct", b"1", db=dbs["meta"])
                for owner, sp in spaces.items():
                    txn.put(owner, sp.pack(), db=dbs["spaces"])
    finally:
        env.close()
