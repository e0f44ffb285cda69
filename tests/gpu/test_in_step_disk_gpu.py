"""Overlapped in-step disk loads on CUDA (``connector/vllm/in_step_disk.py``), without vLLM.

Records of a Llama-3-8B-like shape (32 layers, 64 KiB per layer-block, 4-block chunks: 8 MiB records) on a real
disk tier are read layer group by layer group into pinned staging (O_DIRECT where the file system allows) and
copied into per-layer GPU tensors behind a busy engine stream, one layer group submitted as the "forward" reaches
it. Checked: every block bit-exact against the record (the reference copy is torch indexing); a record changed on
disk fails its chunk only (and is dropped), the others load; the reads' time is reported.
"""
from __future__ import annotations

import torch

from tiered_kv.connector.vllm.config import ConnectorConfig
from tiered_kv.connector.vllm.in_step_disk import InStepDiskLoader
from tiered_kv.copy import cpu, vllm_layer_layout
from tiered_kv.copy.testing import Shape, vllm026_tensors
from tiered_kv.tiers.disk import DiskTier
from tiered_kv.values.jobs import NO_SLOT, JobKind, TransferJob
from tiered_kv.values.layout import BlockLayout
from tiered_kv.values.record import RecordHeader

K = 4  # blocks per chunk
LLAMA = Shape(layers=32, heads=8, block_size=16, head_dim=128, num_blocks=128)
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LLAMA.layers)]
N = 6  # chunks


def _setup(tmp_path, gen):
    layout = vllm_layer_layout(vllm026_tensors("NHD", LLAMA, torch.bfloat16, "cuda"))
    chunk = K * layout.block_nbytes
    disk = DiskTier(BlockLayout((chunk,), "uint8"), tmp_path / "disk", 2 * N * chunk)
    keys = [bytes([i]) * 16 for i in range(N)]
    rows = torch.randint(0, 256, (N, chunk), dtype=torch.uint8, generator=gen)
    assert all(disk.write(keys, [NO_SLOT] * N, rows))
    blocks = torch.randperm(LLAMA.num_blocks, generator=gen)[:N * K].view(N, K).tolist()

    def flat(job, slots, items):
        gpu = [b for i in items for b in blocks[i]]
        return [(gpu, [slots[i] * K + j for i in items for j in range(K)])]

    cfg = ConnectorConfig(disk_path=str(tmp_path / "unused"), disk_overlap_bytes=N * chunk)
    cpu_slab = torch.empty((N, chunk), dtype=torch.uint8, pin_memory=True)
    loader = InStepDiskLoader(layout, NAMES, cfg, 0, {1: disk}, chunk, K, flat, True, cpu_slab)
    job = TransferJob(7, JobKind.EGRESS, 1, 2, keys, [NO_SLOT] * N, [NO_SLOT] * N)
    return layout, disk, keys, rows, blocks, loader, job


def _busy_stream():
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(6):
        a = a @ a / 64.0
    return a


def _forward(loader):
    """What vLLM's attention layers do: each waits for its layer's bytes, then reads them (a kernel on the stream)."""
    _busy_stream()
    loader.submit(layerwise_ok=True)
    for name in NAMES:
        loader.wait_layer(name)
        torch.cuda._sleep(20_000)  # the layer's compute
    out = loader.finish()
    torch.cuda.synchronize()
    return out


def _check(layout, rows, blocks, items):
    ref = vllm_layer_layout([t.clone() for t in layout.tensors])
    plane = rows.view(N * K, layout.block_nbytes)
    for i in items:
        ids = torch.tensor(blocks[i])
        cpu.slab_to_blocks(ref, plane, torch.tensor([i * K + j for j in range(K)]), ids)
        for li, (t, r) in enumerate(zip(layout.tensors, ref.tensors)):
            dev = ids.to(t.device)
            assert torch.equal(t.view(torch.int16)[dev], r.view(torch.int16)[dev]), f"layer {li}, chunk {i}"


def test_records_read_by_layer_group_land_bit_exact(tmp_path):
    layout, disk, keys, rows, blocks, loader, job = _setup(tmp_path, torch.Generator().manual_seed(5))
    loader.start(job)
    (got_job, done), = _forward(loader)
    assert got_job is job and all(done.ok) and not any(done.corrupt) and done.seconds > 0
    assert done.nbytes == N * K * layout.block_nbytes and loader.counters.overlap_loads == 1
    _check(layout, rows, blocks, range(N))
    loader.close()
    disk.close()


def test_a_record_changed_on_disk_fails_its_chunk_only(tmp_path):
    layout, disk, keys, rows, blocks, loader, job = _setup(tmp_path, torch.Generator().manual_seed(6))
    hdr = RecordHeader.unpack(keys[2], disk.index.headers([keys[2]])[0])
    with open(disk.path / "payload.bin", "r+b") as fh:
        fh.seek(hdr.slot * disk.slots.slot_bytes + 3 * layout.block_nbytes + 77)
        b = fh.read(1)
        fh.seek(hdr.slot * disk.slots.slot_bytes + 3 * layout.block_nbytes + 77)
        fh.write(bytes([(b[0] + 1) % 256]))
    loader.start(job)
    (_, done), = _forward(loader)
    assert done.ok == [i != 2 for i in range(N)] and done.corrupt == [i == 2 for i in range(N)]
    _check(layout, rows, blocks, [i for i in range(N) if i != 2])
    assert disk.index.headers([keys[2]]) == [None]  # dropped
    loader.close()
    disk.close()
