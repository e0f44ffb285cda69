"""Deterministic block contents for integration tests: a block's bytes follow from its key."""
from __future__ import annotations

import torch


def key_of(i: int) -> bytes:
    """32-byte key for block number ``i``."""
    return b"blk-" + i.to_bytes(8, "little") + bytes(20)


def block_of(key: bytes, shape, dtype=torch.float32) -> torch.Tensor:
    """The expected content of ``key``: random data seeded by the key's hash."""
    g = torch.Generator().manual_seed(int.from_bytes(key[:12], "little") % (2**62) + 1)
    return torch.randn(tuple(shape), generator=g).to(dtype)


def blocks_of(keys, shape, dtype=torch.float32) -> torch.Tensor:
    """Stacked expected contents for ``keys``."""
    return torch.stack([block_of(k, shape, dtype) for k in keys])
