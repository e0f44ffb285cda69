"""Issue 2, shows 4 and 5: bad input gets a typed error naming the value; a corrupted disk record is
never served: it reads as a miss, is deleted, and is counted."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiered_kv import TieredStore
from tiered_kv.errors import ConfigError, InvalidInputError, StoreClosedError
from tiered_kv.values.record import HEADER_LEN, RecordHeader

from tests.store._blocks import blocks_of, key_of

SHAPE = (2, 4, 64)


def test_bad_input_is_typed_and_named(small_cfg, tmp_path):
    with TieredStore(small_cfg()) as s:
        keys = [key_of(0), key_of(1)]
        with pytest.raises(InvalidInputError, match="dtype"):
            s.put(keys, torch.zeros((2, *SHAPE), dtype=torch.float16))
        with pytest.raises(InvalidInputError, match=r"shape \(2, 4, 64\)"):
            s.put(keys, torch.zeros(SHAPE))
        with pytest.raises(InvalidInputError, match="meta"):
            s.put(keys, torch.zeros((2, *SHAPE), device="meta"))
        with pytest.raises(InvalidInputError, match=r"\(1, 2, 4, 64\)"):
            s.put(keys[:1], torch.zeros((2, *SHAPE)))  # keys/blocks length mismatch
        with pytest.raises(InvalidInputError, match="contiguous"):
            s.get(keys, torch.zeros((*SHAPE, 2)).permute(3, 0, 1, 2))
        with pytest.raises(InvalidInputError, match=r"keys\[1\]"):
            s.put([key_of(0), "str-key"], torch.zeros((2, *SHAPE)))
        with pytest.raises(InvalidInputError, match="unknown tier 'nvme'"):
            s.prefetch(keys, to="nvme")
    with pytest.raises(StoreClosedError):
        s.put(keys, torch.zeros((2, *SHAPE)))
    with pytest.raises(ConfigError, match="gpu_byts"):
        TieredStore(small_cfg(gpu_byts=1))
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        TieredStore(small_cfg(disk_path=str(a_file)))
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    if os.geteuid() != 0:  # root writes anywhere; the check is then moot
        with pytest.raises(ConfigError, match="not writable"):
            TieredStore(small_cfg(disk_path=str(ro / "kv")))


def _disk_only(small_cfg):
    return small_cfg(gpu_bytes=0, cpu_bytes=0, disk_bytes=32 * 4096)


def test_flipped_payload_and_header_are_misses_deleted_and_counted(small_cfg, tmp_path):
    cfg = _disk_only(small_cfg)
    keys = [key_of(i) for i in range(12)]
    data = blocks_of(keys, SHAPE)
    with TieredStore(cfg) as s:
        assert all(s.put(keys, data).wait(30))
        s.flush()
        with s.tiers[0].index.env.begin(db=s.tiers[0].index.db_records) as txn:
            headers = {k: bytes(txn.get(k)) for k in keys}
    path = tmp_path / "kv"
    # 1) flip one byte inside block 3's payload
    slot = RecordHeader.unpack(keys[3], headers[keys[3]]).slot
    with open(path / "payload.bin", "r+b") as f:
        f.seek(slot * 4096 + 100)
        b = f.read(1)
        f.seek(slot * 4096 + 100)
        f.write(bytes([b[0] ^ 0x40]))
    # 2) flip one byte of block 7's header inside the LMDB data file
    mdb = path / "index" / "data.mdb"
    raw = bytearray(mdb.read_bytes())
    at = raw.find(headers[keys[7]])
    assert at >= 0
    raw[at + 30] ^= 0x01
    mdb.write_bytes(bytes(raw))
    with TieredStore(cfg) as s:
        out = torch.full((12, *SHAPE), float("nan"))
        assert s.stats()["tiers"]["disk"]["corrupt_dropped"] == 1  # the bad header, found and dropped at open
        assert s.lookup(keys) == 7
        n = s.get(keys[:3], out[:3]).wait(10)
        assert n == 3 and torch.equal(out[:3], data[:3])
        assert s.get([keys[3]], out[3:4]).wait(10) == 0  # damaged payload: a miss
        assert s.get([keys[7]], out[7:8]).wait(10) == 0  # damaged header: a miss
        rest = [i for i in range(12) if i not in (3, 7)]
        for i in rest:
            assert s.get([keys[i]], out[i:i + 1]).wait(10) == 1 and torch.equal(out[i], data[i])
        assert s.drain(10)
        st = s.stats()
        assert st["tiers"]["disk"]["corrupt_dropped"] == 2
        assert s.contains([keys[3], keys[7], keys[0]]) == [False, False, True]
    with TieredStore(cfg) as s:  # deleted for good: not adopted again
        assert s.contains([keys[3], keys[7]]) == [False, False]
        assert s.lookup(keys[:3]) == 3


def test_record_removed_by_another_process_vanishes_from_the_index(small_cfg):
    """Two stores share a disk directory; one deletes a block: the other's read is a plain miss (not
    corrupt), and it stops answering a stale hit."""
    cfg = _disk_only(small_cfg)
    keys = [key_of(i) for i in range(4)]
    data = blocks_of(keys, SHAPE)
    with TieredStore(cfg) as a:
        assert all(a.put(keys, data).wait(30))
        a.flush()
        # another process (py-lmdb allows one open of a directory per process) deletes block 1
        script = (f"from tiered_kv import TieredStore\n"
                  f"with TieredStore({cfg!r}) as b:\n"
                  f"    assert b.lookup({keys!r}) == 4\n"
                  f"    b.delete([{keys[1]!r}])\n"
                  f"    assert b.drain(10)\n")
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert a.contains([keys[1]]) == [True]  # a does not know yet
        out = torch.empty((4, *SHAPE))
        assert a.get(keys, out).wait(10) == 1 and torch.equal(out[0], data[0])
        assert a.drain(10)
        assert a.contains(keys) == [True, False, True, True]
        disk = a.stats()["tiers"]["disk"]
        assert disk["vanished"] == 1 and disk["corrupt_dropped"] == 0 and disk["failed_transfers"] == 0


def test_cpu_slab_rows_are_page_aligned(small_cfg):
    with TieredStore(small_cfg(cpu_bytes=16 * 4096, block_shape=[1024], dtype="float32")) as s:
        slab = s.tiers[1].slab
        assert slab.data_ptr() % 4096 == 0 and slab.stride(0) % 4096 == 0


def test_refresh_adopts_what_another_process_wrote_and_reader_role_never_writes(small_cfg):
    cfg = _disk_only(small_cfg)
    keys = [key_of(i) for i in range(3)]
    data = blocks_of(keys, SHAPE)
    with TieredStore(dict(cfg, disk_role="reader")) as reader:
        reader.put(keys[:1], data[:1]).wait(10)  # the planner tries...
        assert reader.drain(10) and reader.lookup(keys[:1]) == 0  # ...but a reader's disk never stores it
        script = (f"import torch, sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                  f"from _blocks import blocks_of\nfrom tiered_kv import TieredStore\n"
                  f"with TieredStore({cfg!r}) as w:\n"
                  f"    assert all(w.put({keys!r}, blocks_of({keys!r}, {SHAPE!r})).wait(30))\n")
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert reader.refresh(keys[:1]) == 1 and reader.refresh(keys[:1]) == 0
        assert reader.lookup(keys) == 3  # a lookup asks the directory for keys the planner does not know
        out = torch.empty((3, *SHAPE))
        assert reader.get(keys, out).wait(10) == 3 and torch.equal(out, data)
        reader.clear()
        assert reader.lookup(keys) == 3  # the reader's clear forgot them, but they are still in the directory
    with TieredStore(cfg) as writer:  # the reader's clear forgot the blocks but deleted none of them
        assert writer.lookup(keys) == 3
