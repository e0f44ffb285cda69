"""A store its owner never closed is closed at interpreter exit: queued write-through copies reach the
disk instead of dying with the mover's daemon threads (which, inside a torch copy on a GPU machine,
also aborts the process). A child process puts blocks and exits without ``close``; a second one
reopens the directory and reads them back bit-exact."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COMMON = textwrap.dedent("""
    import sys, torch
    from tiered_kv import TieredStore
    cfg = {{"block_shape": [2, 16, 4, 64], "dtype": "bfloat16", "cpu_bytes": "8MiB", "disk_path": {path!r},
           "disk_bytes": "64MiB", "write_policy": "write_through", "model": "exit-test"}}
    n = 48
    gen = torch.Generator().manual_seed(3)
    blocks = torch.randn((n, 2, 16, 4, 64), generator=gen).to(torch.bfloat16)
""")
WRITER = COMMON + textwrap.dedent("""
    store = TieredStore(cfg)
    keys = store.keys_for_tokens(list(range(16 * n)))
    assert store.put(keys, blocks).wait() == [True] * n
    print("PUT", n, flush=True)   # exits now: the copies down to disk may still be queued
""")
READER = COMMON + textwrap.dedent("""
    cfg["cpu_bytes"] = "1MiB"
    with TieredStore(cfg) as store:
        keys = store.keys_for_tokens(list(range(16 * n)))
        out = torch.empty_like(blocks)
        got = store.get(keys, out).wait()
        print("GOT", got, bool(torch.equal(out[:got], blocks[:got])), flush=True)
""")


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    return out


def test_unclosed_store_finishes_write_through_at_exit(tmp_path):
    path = str(tmp_path / "disk")
    assert "PUT 48" in _run(WRITER.format(path=path))
    out = _run(READER.format(path=path))
    assert "GOT 48 True" in out, out[-2000:]
