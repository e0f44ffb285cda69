"""The vLLM worker with several KV cache groups on CUDA: group planes, per-group copiers, in-step loads.

Runs ``tests/connector/vllm/test_worker_groups.run_group_round_trip`` on CUDA tensors and a pinned
slab with the engine's stream kept busy before the in-step load, so a layer read before its
group's copy landed would see the old bytes; also the plain-copy fallback (a batched copy that
cannot start) and a disk round trip of group records.
"""
from __future__ import annotations

from tests.connector.vllm.test_worker_groups import run_group_round_trip


def test_group_round_trip_on_cuda():
    # 8 heads x 128 dims: 64 KiB per block and layer; 24 chunks
    stats = run_group_round_trip("cuda", heads=8, head_dim=128, chunks=24, slow_stream=True)
    assert stats["sync_loads"] == 1 and stats["failed_items"] == 0 and stats["plain_copy_fallbacks"] == 0


def test_group_round_trip_staged_on_cuda():
    stats = run_group_round_trip("cuda", heads=8, head_dim=128, chunks=24, slow_stream=True, in_step_copy="staged")
    assert stats["sync_loads"] == 1 and stats["failed_items"] == 0 and stats["plain_copy_fallbacks"] == 0


def test_group_round_trip_pipelined_on_cuda():
    # every layer group after the first submitted from wait_layer, ordered only behind the first
    stats = run_group_round_trip("cuda", heads=8, head_dim=128, chunks=24, slow_stream=True,
                                 load_ahead_bytes="1MiB", load_groups=3)
    assert stats["failed_items"] == 0 and stats["sync_load_groups"] == 5


def test_group_plain_copy_fallback_on_cuda():
    stats = run_group_round_trip("cuda", heads=8, head_dim=128, chunks=6, slow_stream=True, break_copies=True)
    assert stats["sync_loads"] == 1 and stats["failed_items"] == 0


def test_group_records_through_disk_on_cuda(tmp_path):
    run_group_round_trip("cuda", heads=4, head_dim=64, chunks=4, tmp_path=tmp_path)
