"""Write ``legacy_disk_fixture.tar.gz``: a disk tier filled by the single-group connector of main
commit 0c79a32 (before hybrid groups), for ``test_compat.py``.

Run from a checkout of that commit (its harness and connector are the ones imported)::

    cd <checkout of 0c79a32> && PYTHONHASHSEED=0 .venv/bin/python <this file> <out.tar.gz>

The engine: the tiny Llama of ``tests/connector/vllm/harness.py``, ``model_id`` "tiny-llama",
chunks of 4 blocks, ``write_through``; one request with a 12-block-and-3-token prompt, so three
chunks are on disk. ``test_compat.py`` replays the same request's next turn against it.
"""
from __future__ import annotations

import os
import sys
import tarfile
import tempfile

os.environ.setdefault("PYTHONHASHSEED", "0")
sys.path.insert(0, os.getcwd())

from tests.connector.vllm.harness import BS, Engine, write_model_dir  # noqa: E402

EXTRA = {"chunk_blocks": 4, "cpu_bytes": 2 * 4 * 4096, "disk_bytes": "4MiB", "write_policy": "write_through",
         "model_id": "tiny-llama"}


def prompt(seed: int, n: int) -> list[int]:
    return [100 + (seed * 7919 + i * 31) % 800 for i in range(n)]


def main(out: str) -> None:
    tmp = tempfile.mkdtemp(prefix="tkv-legacy-")
    model = write_model_dir(os.path.join(tmp, "model"))
    eng = Engine.create(model, dict(EXTRA, disk_path=os.path.join(tmp, "kv")), max_batched=64)
    try:
        eng.add("old", prompt(4, 12 * BS + 3), max_tokens=2)
        eng.run()
        eng.settle()
        assert eng.connector.stats()["resident_disk"] == 3, eng.connector.stats()
        print("namespace", eng.connector.ns.prefix.hex(), "tag", eng.connector.geo.tag)
    finally:
        eng.close()
    with tarfile.open(out, "w:gz") as tar:
        tar.add(os.path.join(tmp, "kv"), arcname="kv")


if __name__ == "__main__":
    main(sys.argv[1])
