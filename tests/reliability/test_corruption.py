"""Corruption: damaged bytes on disk are never served, never raise into the caller, and are counted.

What this proves (docs/reliability.md, "Corruption"):
- payload damage (random byte flips, zeroed 4 KiB pages, a truncated ``payload.bin``), both
  codecs: every damaged block reads as a miss, is removed from the index, is counted in
  ``stats()["tiers"]["disk"]["corrupt_dropped"]`` and its slot goes back to the free list;
  every undamaged block still hits bit-exact, also after another reopen;
- damage to record headers inside LMDB's ``index/data.mdb`` while the store is open:
  same promise (miss, removed, counted);
- the same header damage while the store is closed: the block reads as a miss, is never
  served, is removed from the index at reopen and counted (``dropped_at_open``);
- random damage to LMDB's own pages (flips, zeroed pages), one child process per batch of
  trials: a store that opens serves only bit-exact blocks and ``get()`` never raises. What
  LMDB does with its damaged B-tree (open refused with a raw ``lmdb`` error, or the process
  killed by an LMDB abort) is printed; a damaged index that LMDB refuses, zeroed meta pages and
  a truncated ``data.mdb`` give a ``ConfigError`` naming the path (no raw ``lmdb`` error, no SIGBUS).

Threading contract: single-threaded tests; damage is done while no process has the files
open unless the test says otherwise.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess

import pytest
import torch

from tests.reliability._common import (NBYTES, SHAPE, TORCH_DTYPE, blocks_of, child_env, disk_config, key_of,
                                       matches, pick, slot_accounting, worker_cmd)
from tiered_kv.errors import DamagedIndexError, TieredKVError
from tiered_kv.tiers.disk import DiskTier
from tiered_kv.values.layout import BlockLayout
from tiered_kv.values.record import RecordHeader
from tiered_kv.store.tiered_store import TieredStore

N = 120
PAGE = 4096


def _fill(path, n=N, codec="none", space=b"damage") -> list[bytes]:
    keys = [key_of(i, space) for i in range(n)]
    with TieredStore(disk_config(path, disk_bytes=4 << 20, compression=codec)) as store:
        assert all(store.put(keys, blocks_of(keys)).wait(60))
        store.flush()
    return keys


def _headers(path, keys) -> dict[bytes, bytes]:
    """Raw header bytes of each key, read with the store open (then closed)."""
    with TieredStore(disk_config(path, disk_bytes=4 << 20)) as store:
        disk = store.tiers[-1]
        with disk.index.env.begin(db=disk.index.db_records, buffers=False) as txn:
            return {k: txn.get(k) for k in keys}


def _get_one(store, key):
    out = torch.empty((1, *SHAPE), dtype=TORCH_DTYPE)
    n = store.get([key], out).wait(30)
    return out[0] if n == 1 else None


def _check_verdicts(store, keys, damaged):
    """Every damaged key misses, every other key hits bit-exact. Returns the count of damaged keys."""
    for k in keys:
        got = _get_one(store, k)
        if k in damaged:
            assert got is None, f"damaged block {k.hex()[:16]} was served"
        else:
            assert got is not None, f"undamaged block {k.hex()[:16]} missed"
            assert matches(k, got), f"undamaged block {k.hex()[:16]} served with wrong bytes"


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_payload_damage_reads_as_miss_is_removed_and_counted(tmp_path, codec):
    path = tmp_path / "kv"
    keys = _fill(path, codec=codec)
    hdrs = {k: RecordHeader.unpack(k, raw) for k, raw in _headers(path, keys).items()}
    rng = random.Random(7)
    slot_bytes = PAGE  # one 4 KiB block per slot
    order = sorted(keys, key=lambda k: hdrs[k].slot)
    truncated = set(order[-5:])  # the 5 highest slots are cut off by a truncation
    pool = [k for k in keys if k not in truncated]
    rng.shuffle(pool)
    flipped, zeroed = set(pool[:15]), set(pool[15:25])
    payload = path / "payload.bin"
    with open(payload, "r+b") as f:
        for k in flipped:
            h = hdrs[k]
            for _ in range(rng.randint(1, 3)):
                off = h.slot * slot_bytes + rng.randrange(h.payload_len)
                f.seek(off)
                b = f.read(1)[0]
                f.seek(off)
                f.write(bytes([b ^ (1 << rng.randrange(8))]))
        for k in zeroed:
            f.seek(hdrs[k].slot * slot_bytes)
            f.write(bytes(PAGE))
        f.truncate(hdrs[order[-5]].slot * slot_bytes + rng.randrange(1, hdrs[order[-5]].payload_len))
    damaged = flipped | zeroed | truncated

    with TieredStore(disk_config(path, disk_bytes=4 << 20)) as store:
        _check_verdicts(store, keys, damaged)
        st = store.stats()["tiers"]["disk"]
        assert st["corrupt_dropped"] == len(damaged), st
        assert store.contains(sorted(damaged)) == [False] * len(damaged)
        acct = slot_accounting(store.tiers[-1])
        assert acct["records"] == N - len(damaged) and acct["unaccounted"] == 0, acct
    print(f"payload damage ({codec}): {len(flipped)} flipped, {len(zeroed)} zeroed, {len(truncated)} truncated "
          f"-> {len(damaged)} misses counted, {N - len(damaged)} hits bit-exact")
    with TieredStore(disk_config(path, disk_bytes=4 << 20)) as store:  # removed for good
        assert store.contains(sorted(damaged)) == [False] * len(damaged)
        _check_verdicts(store, keys, damaged)
        assert store.stats()["tiers"]["disk"]["corrupt_dropped"] == 0


def _damage_headers_in_file(data_mdb, raws, rng) -> int:
    """Flip or zero bytes of each raw header wherever it occurs in data.mdb (stale copies too)."""
    data = bytearray(data_mdb.read_bytes())
    hits = 0
    for raw in raws:
        start = data.find(raw)
        assert start >= 0, "header bytes not found in data.mdb"
        while start >= 0:
            hits += 1
            if rng.random() < 0.5:
                off = start + rng.randrange(len(raw))
                data[off] ^= 1 << rng.randrange(8)
            else:
                a = rng.randrange(len(raw) - 8)
                data[start + a:start + a + 8] = bytes(8)
            start = data.find(raw, start + 1)
    with open(data_mdb, "r+b") as f:  # in place: an open store sees it through its mmap
        f.write(data)
    return hits


def test_header_damage_in_lmdb_while_open_reads_as_miss_is_removed_and_counted(tmp_path):
    path = tmp_path / "kv"
    keys = _fill(path)
    rng = random.Random(11)
    with TieredStore(disk_config(path, disk_bytes=4 << 20)) as store:
        disk = store.tiers[-1]
        with disk.index.env.begin(db=disk.index.db_records, buffers=False) as txn:
            raws = {k: txn.get(k) for k in keys}
        damaged = set(rng.sample(keys, 20))
        _damage_headers_in_file(path / "index" / "data.mdb", [raws[k] for k in damaged], rng)
        _check_verdicts(store, keys, damaged)
        st = store.stats()["tiers"]["disk"]
        assert st["corrupt_dropped"] == len(damaged), st
        with disk.index.env.begin(db=disk.index.db_records) as txn:
            assert all(txn.get(k) is None for k in damaged), "damaged headers left in the index"


def test_header_damage_in_lmdb_while_closed_is_never_served(tmp_path):
    path = tmp_path / "kv"
    keys = _fill(path)
    raws = _headers(path, keys)
    rng = random.Random(12)
    damaged = set(rng.sample(keys, 20))
    _damage_headers_in_file(path / "index" / "data.mdb", [raws[k] for k in damaged], rng)
    with TieredStore(disk_config(path, disk_bytes=4 << 20)) as store:
        _check_verdicts(store, keys, damaged)
        out = torch.empty((len(keys), *SHAPE), dtype=TORCH_DTYPE)
        store.put(keys, out).wait(30)  # re-putting works for every key (a caller recomputes and stores)
        assert store.stats()["puts_refused"] == 0


def test_header_damage_in_lmdb_while_closed_is_removed_and_counted_at_reopen(tmp_path):
    path = tmp_path / "kv"
    keys = _fill(path)
    raws = _headers(path, keys)
    damaged = set(random.Random(13).sample(keys, 10))
    _damage_headers_in_file(path / "index" / "data.mdb", [raws[k] for k in damaged], random.Random(14))
    with TieredStore(disk_config(path, disk_bytes=4 << 20)) as store:
        _check_verdicts(store, keys, damaged)
        acct = slot_accounting(store.tiers[-1])
        assert acct["records"] == N - len(damaged), f"damaged records still indexed: {acct}"
        assert store.stats()["tiers"]["disk"]["corrupt_dropped"] == len(damaged)


# ---------------------------------------------------------------------------------------- LMDB's own pages
def _prepare_trials(tmp_path, n_trials, seed, kinds=("flip", "zero")) -> tuple[os.PathLike, list[str]]:
    base = tmp_path / "orig"
    _fill(base)
    root = tmp_path / "trials"
    root.mkdir()
    rng = random.Random(seed)
    what = []
    for i in range(n_trials):
        d = root / str(i)
        shutil.copytree(base, d)
        data_mdb = d / "index" / "data.mdb"
        data = bytearray(data_mdb.read_bytes())
        kind = rng.choice(kinds)
        if kind == "flip":
            n = rng.randint(1, 16)
            for _ in range(n):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            what.append(f"flip x{n}")
        elif kind == "zero":
            pg = rng.randrange(len(data) // PAGE)
            data[pg * PAGE:(pg + 1) * PAGE] = bytes(PAGE)
            what.append(f"zero page {pg}")
        else:
            cut = rng.randrange(2 * PAGE, len(data))
            data = data[:cut]
            what.append(f"truncate to {cut}")
        data_mdb.write_bytes(bytes(data))
    return root, what


def _run_trials(root, n_trials, cpu_bytes=0) -> dict[int, str]:
    """Run damage_trials children until every trial has a verdict; a trial that kills its child gets 'CRASH'."""
    verdicts: dict[int, str] = {}
    first = 0
    while first < n_trials:
        try:
            r = subprocess.run(worker_cmd("damage_trials", root, first, n_trials, N, cpu_bytes), capture_output=True,
                               env=child_env(), timeout=120)
            rc, out = r.returncode, r.stdout.decode()
        except subprocess.TimeoutExpired as exc:
            rc, out = "HANG", (exc.stdout or b"").decode()
        for line in out.splitlines():
            if line.startswith("T "):
                _, i, rest = line.split(" ", 2)
                verdicts[int(i)] = rest
        if rc != 0:
            done = [i for i in verdicts if i >= first]
            bad = max(done) + 1 if done else first
            if bad < n_trials:
                verdicts[bad] = f"CRASH rc={rc}"
            first = bad + 1
        else:
            first = n_trials
    return verdicts


def test_random_lmdb_page_damage_never_serves_wrong_bytes(tmp_path):
    n = pick(16, 200)
    root, what = _prepare_trials(tmp_path, n, seed=2026)
    verdicts = _run_trials(root, n)
    outcomes = {"served_ok": 0, "refused_typed": 0, "refused_raw_lmdb": 0, "crashed": 0}
    totals = {"served": 0, "missing": 0, "wrong": 0, "get_errors": 0, "corrupt_dropped": 0}
    for i in range(n):
        v = verdicts.get(i, "CRASH (no verdict)")
        print(f"trial {i:3d} {what[i]:>16}: {v[:160]}")
        if v.startswith("READ "):
            d = json.loads(v[5:])
            outcomes["served_ok"] += 1
            for k in totals:
                totals[k] += d.get(k, 0)
        elif v.startswith("OPEN typed"):
            outcomes["refused_typed"] += 1
        elif v.startswith("OPEN raw"):
            outcomes["refused_raw_lmdb"] += 1
        else:
            outcomes["crashed"] += 1
    print(f"LMDB page damage over {n} trials: {outcomes}; reads: {totals}")
    assert totals["wrong"] == 0, "a damaged index made the store serve wrong bytes"
    assert totals["get_errors"] == 0, "get() raised into the caller on a damaged index"
    assert outcomes["served_ok"] > 0, "no trial opened: the sweep tested nothing"


def test_zeroed_lmdb_meta_pages_quarantine_the_directory_and_the_store_serves_on(tmp_path, caplog):
    """Both meta pages zeroed: LMDB cannot open the file. Promise: the store opens without its disk tier,
    says so loudly, moves the directory aside; a disk tier opened directly raises a typed error."""
    path = tmp_path / "kv"
    keys = _fill(path)
    data_mdb = path / "index" / "data.mdb"
    with open(data_mdb, "r+b") as f:
        f.write(bytes(2 * PAGE))
    with pytest.raises(DamagedIndexError) as info:
        DiskTier(BlockLayout(SHAPE, "bfloat16"), path, 4 << 20)
    _expect_typed(info.value, path)
    with TieredStore(disk_config(path, disk_bytes=4 << 20, cpu_bytes=1 << 20)) as store:
        q = store.stats()["disk_quarantined"]
        assert q is not None and q["path"] == str(path) and "disk" not in store.stats()["tiers"]
        assert any("DISK TIER OFF" in r.message for r in caplog.records)
        assert os.path.isdir(q["moved_to"]) and not path.exists()
        assert _get_one(store, keys[0]) is None  # nothing served from the damaged index
        fresh = [key_of(i, b"fresh") for i in range(3)]
        assert all(store.put(fresh, blocks_of(fresh)).wait(30)) and matches(fresh[0], _get_one(store, fresh[0]))
    with TieredStore(disk_config(path, disk_bytes=4 << 20)) as again:  # the next open starts an empty directory
        assert again.stats()["disk_quarantined"] is None and again.lookup(keys) == 0


def _expect_typed(exc, path):
    assert isinstance(exc, TieredKVError), f"raw {type(exc).__module__}.{type(exc).__name__}: {exc}"
    assert str(path) in str(exc)


def test_truncated_lmdb_data_file_does_not_kill_the_process(tmp_path):
    base = tmp_path / "trials" / "0"
    _fill(base)
    data_mdb = base / "index" / "data.mdb"
    data = data_mdb.read_bytes()
    data_mdb.write_bytes(data[:3 * PAGE])  # meta pages kept; the B-tree pages they point at are gone
    verdicts = _run_trials(tmp_path / "trials", 1)
    print(f"truncated data.mdb ({len(data)} -> {3 * PAGE} bytes): {verdicts}")
    assert verdicts[0].startswith(("READ", "OPEN typed")), verdicts[0]


def _damage_at(data: bytes, kind: str, off: int, rng: random.Random) -> bytes:
    """``data`` with the 4 KiB page holding ``off`` zeroed, 64 random bytes written at ``off``, or cut at ``off``."""
    out = bytearray(data)
    if kind == "zero":
        pg = off // PAGE
        out[pg * PAGE:(pg + 1) * PAGE] = bytes(PAGE)
    elif kind == "random":
        out[off:off + 64] = rng.randbytes(64)
    else:
        out = out[:off]
    return bytes(out)


def test_lmdb_damage_at_many_offsets_never_kills_the_process_and_serves_on_without_disk(tmp_path):
    """Issue 17, shows 3: zeroed pages, random bytes and a truncated file at 20+ offsets of ``data.mdb``.

    Every trial runs in one child process that opens a store with a CPU tier over the damaged directory,
    reads every block back and round-trips new blocks. Promise: the child never dies; damage the
    integrity walk finds is reported (directory quarantined, ``disk_quarantined`` in stats) and the store
    serves on from the CPU tier; records whose ownership entries are damaged are dropped and counted
    (``corrupt_dropped``); every other block reads back bit-exact. No block goes missing unreported.
    """
    base = tmp_path / "orig"
    _fill(base)
    data = (base / "index" / "data.mdb").read_bytes()
    used = len(data) // PAGE
    rng = random.Random(17)
    offsets = sorted({pg * PAGE + d for pg in range(used) for d in (0, 16, PAGE // 2)})
    offsets = offsets if len(offsets) <= 24 else sorted(rng.sample(offsets, 24))
    offsets = offsets + [PAGE * 2 + 8] if len(offsets) < 20 else offsets
    root = tmp_path / "trials"
    root.mkdir()
    what = []
    for kind in ("zero", "random", "truncate"):
        for off in offsets:
            if kind == "truncate" and off == 0:
                off = 1
            d = root / str(len(what))
            shutil.copytree(base, d)
            (d / "index" / "data.mdb").write_bytes(_damage_at(data, kind, off, rng))
            what.append(f"{kind}@{off}")
    verdicts = _run_trials(root, len(what), cpu_bytes=1 << 20)
    tally = {"quarantined": 0, "all_served": 0, "crashed": 0, "wrong": 0, "get_errors": 0, "not_serving": 0,
             "unreported": 0}
    for i, w in enumerate(what):
        v = verdicts.get(i, "CRASH (no verdict)")
        print(f"trial {i:3d} {w:>16}: {v[:150]}")
        if not v.startswith("READ "):
            tally["crashed"] += 1
            continue
        d = json.loads(v[5:])
        tally["quarantined"] += d["quarantined"]
        tally["all_served"] += d["served"] == N
        tally["wrong"] += d["wrong"]
        tally["get_errors"] += d["get_errors"]
        tally["not_serving"] += not d.get("after_ok", False)
        tally["unreported"] += d["missing"] > 0 and not d["quarantined"] and d["corrupt_dropped"] < d["missing"]
    print(f"LMDB damage at {len(offsets)} offsets x 3 kinds ({len(what)} trials, {used} pages): {tally}")
    assert len(offsets) >= 20
    assert tally["crashed"] == 0, "a damaged index killed (or was refused by) the process"
    assert tally["wrong"] == 0 and tally["get_errors"] == 0
    assert tally["not_serving"] == 0, "the store stopped serving new blocks after finding damage"
    assert tally["quarantined"] >= len(offsets), "the walk found too little: every truncation alone is damage"
    assert tally["unreported"] == 0, "a block went missing without the damage being reported"


def test_inspect_reports_damage_and_repair_rebuilds_the_index_from_what_verifies(tmp_path, capsys):
    """``tiered-kv inspect`` says DAMAGED (exit 1) without dying; ``tiered-kv repair`` rebuilds the index from
    the records whose header, owner entry and payload checksum still verify, else starts empty. After it
    the directory is healthy and a store serves the salvaged blocks bit-exact and nothing else."""
    from tiered_kv.cli.main import main as cli

    base = tmp_path / "orig"
    keys = _fill(base)
    data = (base / "index" / "data.mdb").read_bytes()
    pages = len(data) // PAGE
    rng = random.Random(5)
    salvaged_total = 0
    trials = [("zero", pg * PAGE) for pg in range(2, pages, max(1, pages // 6))] + [("truncate", 3 * PAGE + 100)]
    checked = 0
    for n, (kind, off) in enumerate(trials):
        d = tmp_path / f"t{n}"
        shutil.copytree(base, d)
        (d / "index" / "data.mdb").write_bytes(_damage_at(data, kind, off, rng))
        if cli(["inspect", str(d)]) != 1:
            continue  # this page held nothing the walk needs (free space): not a damage case
        checked += 1
        assert "DAMAGED" in capsys.readouterr().out
        assert cli(["repair", str(d), "--json"]) == 0
        summary = json.loads(capsys.readouterr().out)
        # rebuilt: healthy; started fresh: an empty directory (no index until a store opens it)
        assert cli(["inspect", str(d)]) == (2 if summary["fresh"] else 0), f"{kind}@{off}: still damaged"
        capsys.readouterr()
        with TieredStore(disk_config(d, disk_bytes=4 << 20)) as store:
            assert store.stats()["disk_quarantined"] is None
            served = [k for k in keys if (b := _get_one(store, k)) is not None and (matches(k, b) or 1 / 0)]
        assert len(served) == summary["salvaged"], (kind, off, summary, len(served))
        salvaged_total += summary["salvaged"]
        with capsys.disabled():
            print(f"{kind}@{off}: {summary['salvaged']} salvaged, {summary['dropped']} dropped, "
                  f"fresh={summary['fresh']}")
    assert checked >= 3 and salvaged_total > 0
