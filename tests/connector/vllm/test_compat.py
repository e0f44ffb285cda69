"""A full-attention model keeps the single-group connector's namespace, layout tag and record bytes.

``data/legacy_disk_fixture.tar.gz`` is a disk tier written by the connector of main 0c79a32 (before
hybrid KV cache groups; ``data/make_legacy_disk_fixture.py`` wrote it). The current connector must
adopt it at start-up and serve a hit from it bit for bit (the harness checks every loaded block
against the KV its tokens produce), and write the very same records when it stores that prompt.
"""
from __future__ import annotations

import os
import tarfile

import pytest

pytest.importorskip("vllm")

from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import init_none_hash  # noqa: E402

from tests.connector.vllm.harness import BS, Engine, write_model_dir  # noqa: E402
from tiered_kv.values.layout import BlockLayout  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "legacy_disk_fixture.tar.gz")
EXTRA = {"chunk_blocks": 4, "cpu_bytes": 2 * 4 * 4096, "disk_bytes": "4MiB", "write_policy": "write_through",
         "model_id": "tiny-llama"}
#: what main 0c79a32 printed for the fixture's engine
LEGACY_NAMESPACE = "708a3ac6ceb90e11"
LEGACY_TAG = ("vllm|FullAttentionSpec|block_size=16,dtype=float16,head_size=16,head_size_v=16,num_kv_heads=2"
              "|layers=2|layout=default|chunk=4")


def prompt(seed: int, n: int) -> list[int]:
    return [100 + (seed * 7919 + i * 31) % 800 for i in range(n)]


@pytest.fixture
def seeded(monkeypatch):
    """PYTHONHASHSEED=0 and vLLM's NONE_HASH derived from it, as when the fixture was written."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    init_none_hash(sha256)


def _records(disk, keys):
    import torch

    rows = torch.empty((len(keys), disk.layout.nbytes), dtype=torch.uint8)
    ok, _ = disk.read(keys, [0] * len(keys), rows)
    assert all(ok)
    return [bytes(r.numpy()) for r in rows]


def test_legacy_disk_cache_is_adopted_and_hit_bit_exact(tmp_path, seeded):
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(tmp_path, filter="data")
    model = write_model_dir(str(tmp_path / "model"))
    eng = Engine.create(model, dict(EXTRA, disk_path=str(tmp_path / "kv")), max_batched=64)
    try:
        conn = eng.connector
        assert conn.geo.tag == LEGACY_TAG
        assert conn.ns.prefix.hex() == LEGACY_NAMESPACE
        assert conn.ns.layout_fingerprint == BlockLayout((4 * 4096,), "uint8", LEGACY_TAG).fingerprint
        worker = eng.workers[0].connector.worker
        assert str(worker.disk.path) == str(tmp_path / "kv" / LEGACY_NAMESPACE / "rank0-of-1")
        assert conn.stats()["resident_disk"] == 3  # adopted at start-up
        eng.add("new", prompt(4, 12 * BS + 3) + prompt(98, 30), max_tokens=2)
        eng.run()
        eng.settle()
        st = conn.stats()
        assert st["sched_hit_tokens_disk"] == 12 * BS, st
        assert eng.verified_blocks >= 12  # every loaded block checked against its tokens' KV
    finally:
        eng.close()


def test_records_written_now_equal_the_legacy_records(tmp_path, seeded):
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(tmp_path / "old", filter="data")
    model = write_model_dir(str(tmp_path / "model"))
    eng = Engine.create(model, dict(EXTRA, disk_path=str(tmp_path / "kv")), max_batched=64)
    try:
        eng.add("old", prompt(4, 12 * BS + 3), max_tokens=2)  # the fixture's request
        eng.run()
        eng.settle()
        new_disk = eng.workers[0].connector.worker.disk
        keys = sorted(new_disk.stored_keys())
        assert len(keys) == 3
        from tiered_kv.tiers.disk import DiskTier

        old_disk = DiskTier(new_disk.layout, tmp_path / "old" / "kv" / LEGACY_NAMESPACE / "rank0-of-1", 0,
                            readonly=True)
        try:
            assert sorted(old_disk.stored_keys()) == keys  # same keys
            assert _records(old_disk, keys) == _records(new_disk, keys)  # same bytes
        finally:
            old_disk.close()
    finally:
        eng.close()
