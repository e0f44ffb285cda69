"""Issue 2, shows 2: 1,000 random blocks cascade GPU -> CPU -> disk, read back bit-exact; hits promote;
a new process reopens the disk tier and reads the disk-resident blocks back bit-exact."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from tiered_kv import TieredStore

from tests.store._blocks import blocks_of, key_of

SHAPE = (2, 4, 64)


def test_cascade_get_promote_and_reopen_in_new_process(small_cfg):
    cfg = small_cfg(disk_bytes=1200 * 4096)
    keys = [key_of(i) for i in range(1000)]
    data = blocks_of(keys, SHAPE)
    with TieredStore(cfg) as store:
        assert store.put(keys, data).wait(60) == [True] * 1000
        assert store.drain(60)
        where = store.locate(keys)
        assert where.count("gpu") == 8 and where.count("cpu") == 16 and where.count("disk") == 976
        st = store.stats()
        assert st["tiers"]["gpu"]["evictions"] == 992 and st["tiers"]["cpu"]["evictions"] == 976
        # read everything back, 100 at a time, from wherever it lives
        out = torch.empty((100, *SHAPE))
        for start in range(0, 1000, 100):
            part = keys[start:start + 100]
            assert store.get(part, out).wait(60) == 100
            assert torch.equal(out, data[start:start + 100])
        assert store.drain(60)
        # hits promote: a disk-resident block read once moves up a tier
        k = keys[0]
        assert store.locate([k]) == ["disk"]
        assert store.get([k], out[:1]).wait(10) == 1 and store.drain(10)
        assert store.locate([k])[0] in ("cpu", "gpu")
        st = store.stats()
        assert st["lookups"] == st["hits"] + st["misses"]
        assert st["bytes_in"] == st["bytes_out"] + st["resident_bytes"]
        assert st["inflight_jobs"] == 0 and st["pinned"] == 0
        disk_keys = [kk for kk, w in zip(keys, store.locate(keys)) if w == "disk"]
    assert len(disk_keys) > 900
    script = textwrap.dedent(f"""
        import json, sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from _blocks import blocks_of
        from tiered_kv import TieredStore
        keys = [bytes.fromhex(h) for h in json.load(sys.stdin)]
        with TieredStore({cfg!r}) as s:
            held = s.lookup(keys)
            out = torch.empty((len(keys), 2, 4, 64))
            got = s.get(keys, out).wait(60)
            ok = torch.equal(out[:got], blocks_of(keys, (2, 4, 64))[:got])
            print(json.dumps({{"held": held, "got": got, "bit_exact": ok}}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], input=json.dumps([k.hex() for k in disk_keys]),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res == {"held": len(disk_keys), "got": len(disk_keys), "bit_exact": True}
