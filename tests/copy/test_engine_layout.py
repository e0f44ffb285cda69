"""The copy engine's hand-built driver descriptors against cuda-python's own structs (no GPU needed).

``engine.pitched_ops`` packs ``CUDA_MEMCPY3D_BATCH_OP`` entries as int64 words for ``cuMemcpy3DBatchAsync``
(one driver call for a staged load's pitched copies). The driver cannot run on the CPU box, so a wrong layout
would show only on the GPU machine as wrong bytes or a refused call; here each word is compared with the bytes
cuda-python's ``CUDA_MEMCPY3D_BATCH_OP`` holds for the same fields.
"""
from __future__ import annotations

import ctypes

import pytest
import torch

from tiered_kv.copy.engine import OP_WORDS, pitched_ops

driver = pytest.importorskip("cuda.bindings.driver")


def _reference(dst: int, src: int, pitch: int, width: int, d: int, r: int, h: int) -> list[int]:
    op = driver.CUDA_MEMCPY3D_BATCH_OP()
    pointer = driver.CUmemcpy3DOperandType.CU_MEMCPY_OPERAND_TYPE_POINTER
    op.src.type, op.dst.type = pointer, pointer
    op.src.op.ptr.ptr, op.src.op.ptr.rowLength, op.src.op.ptr.layerHeight = src + r * pitch, pitch, h
    op.dst.op.ptr.ptr, op.dst.op.ptr.rowLength, op.dst.op.ptr.layerHeight = dst + d, width, h
    op.extent.width, op.extent.height, op.extent.depth = width, h, 1
    op.srcAccessOrder = driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    op.flags = int(driver.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE)
    raw = ctypes.string_at(op.getPtr(), OP_WORDS * 8)
    return torch.frombuffer(bytearray(raw), dtype=torch.int64).tolist()


def test_pitched_ops_match_cuda_pythons_struct_word_for_word():
    runs = [(0, 3, 2), (8192, 17, 1), (12288, 40, 16)]
    dst, src, pitch, width = 0x7F00_0000_0000, 0x5500_0000_1000, 1 << 21, 4096
    ops = pitched_ops(dst, src, pitch, width, runs)
    assert ops.shape == (len(runs), OP_WORDS)
    for row, (d, r, h) in zip(ops.tolist(), runs):
        assert row == _reference(dst, src, pitch, width, d, r, h)


def test_no_runs_is_an_empty_array():
    assert pitched_ops(0, 0, 64, 16, []).shape == (0, OP_WORDS)
