"""Shared pytest setup: quiet logs from the libraries we drive, and a helper to make store configs."""
from __future__ import annotations

import logging
import os

import pytest

logging.getLogger("tiered_kv").setLevel(logging.ERROR)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def small_cfg(tmp_path):
    """A three-tier config with tiny capacities (2 KiB blocks): GPU 8, CPU 16, disk 64 blocks."""
    def make(**over):
        cfg = dict(block_shape=[2, 4, 64], dtype="float32", gpu_bytes=8 * 2048, cpu_bytes=16 * 2048,
                   disk_path=str(tmp_path / "kv"), disk_bytes=64 * 4096, model="test-model")
        cfg.update(over)
        return cfg
    return make


from tests._redis import redis_cluster, redis_replicas, redis_tls, replica_cluster  # noqa: E402,F401 (the session's Redis Clusters, for every suite)
