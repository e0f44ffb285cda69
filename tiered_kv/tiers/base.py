"""The ``Tier`` interface: one medium (GPU slab, pinned CPU slab, disk) that stores blocks.

A tier does *how*, never *what*: it writes, reads and deletes the blocks it is told to,
and never chooses a victim or edits the planner's index (DESIGN: planner vs. mover).

Two kinds of tier:
- slab tiers (``slotted = True``): a ``slab`` tensor of shape ``(capacity, block_nbytes)``
  uint8; the planner hands out slot numbers; any row is a block. Slab-to-slab copies
  are done by movers directly on ``slab`` rows.
- keyed tiers (``slotted = False``): addressed by key; the tier places records itself
  and verifies them on read (the disk tier).

Rows passed to ``write``/``read`` are 2-D uint8 tensors ``(n, block_nbytes)`` on any device.

Threading contract: a tier's methods may be called from several mover threads at once
for *different* slots/keys; the planner never issues two jobs that write the same slot
or key concurrently. ``close()`` is called once, after every mover stopped.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from tiered_kv.values.layout import BlockLayout


class Tier(ABC):
    """One storage medium in the chain."""

    name: str = "tier"
    slotted: bool = True
    governed: bool = False  # the medium keeps its own budget and evicts by itself (planner.room.TierSpec)

    def __init__(self, layout: BlockLayout, capacity: int) -> None:
        self.layout = layout
        self.capacity = capacity
        self.block_nbytes = layout.nbytes

    @property
    def device(self) -> torch.device:
        """Where this tier's bytes live (for slab tiers; keyed tiers report CPU)."""
        return torch.device("cpu")

    @abstractmethod
    def write(self, keys: Sequence[bytes], slots: Sequence[int], rows: torch.Tensor) -> list[bool]:
        """Store ``rows[i]`` as ``keys[i]`` (in ``slots[i]`` for slab tiers). Returns per-item success."""

    @abstractmethod
    def read(self, keys: Sequence[bytes], slots: Sequence[int], out: torch.Tensor) -> tuple[list[bool], list[bool]]:
        """Fill ``out[i]`` with block ``keys[i]``. Returns (ok, corrupt) per item.

        ``corrupt[i]`` means the stored record failed verification and the tier removed it.
        """

    def write_ex(self, keys: Sequence[bytes], slots: Sequence[int], rows) -> tuple[list[bool], list[bytes]]:
        """``write`` plus the keys whose records the medium dropped to make room (a governed tier); none here."""
        return self.write(keys, slots, rows), []

    def read_ex(self, keys: Sequence[bytes], slots: Sequence[int], out) -> tuple[list[bool], list[bool], list[bool]]:
        """``read`` plus ``missing[i]`` (the tier holds no record of ``keys[i]``); slab tiers never miss."""
        ok, corrupt = self.read(keys, slots, out)
        return ok, corrupt, [False] * len(keys)

    def delete(self, keys: Sequence[bytes]) -> None:
        """Forget ``keys`` (keyed tiers). Slab tiers need nothing: the planner frees slots."""

    def stored_keys(self) -> list[bytes]:
        """Keys this tier already holds when opened (keyed, persistent tiers); slab tiers hold none."""
        return []

    def flush(self) -> None:
        """Make written blocks durable (persistent tiers)."""

    def close(self) -> None:
        """Release the medium. Idempotent."""

    def describe(self) -> dict:
        """A small dict for stats and the CLI."""
        return {"name": self.name, "capacity_blocks": self.capacity, "block_nbytes": self.block_nbytes,
                "device": str(self.device)}


class SlabTier(Tier):
    """A tier whose blocks are rows of one ``(capacity, block_nbytes)`` uint8 tensor."""

    slotted = True

    def __init__(self, layout: BlockLayout, slab: torch.Tensor) -> None:
        super().__init__(layout, slab.shape[0])
        self.slab = slab

    @property
    def device(self) -> torch.device:
        """Device of the slab."""
        return self.slab.device

    def write(self, keys: Sequence[bytes], slots: Sequence[int], rows: torch.Tensor) -> list[bool]:
        """Copy ``rows`` into the slab rows ``slots`` (one batched copy)."""
        copy_rows(rows, range(len(slots)), self.slab, slots)
        return [True] * len(slots)

    def read(self, keys: Sequence[bytes], slots: Sequence[int], out: torch.Tensor) -> tuple[list[bool], list[bool]]:
        """Copy slab rows ``slots`` into ``out`` (one batched copy)."""
        copy_rows(self.slab, slots, out, range(len(slots)))
        n = len(slots)
        return [True] * n, [False] * n


def runs(src_idx: Sequence[int], dst_idx: Sequence[int]) -> list[tuple[int, int, int]]:
    """Merge index pairs into runs ``(src_start, dst_start, length)`` where both sides are consecutive."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src_idx, dst_idx):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            s0, d0, n = out[-1]
            out[-1] = (s0, d0, n + 1)
        else:
            out.append((s, d, 1))
    return out


def copy_rows(src: torch.Tensor, src_idx: Sequence[int], dst: torch.Tensor, dst_idx: Sequence[int],
              non_blocking: bool = False) -> None:
    """``dst[dst_idx[i]] = src[src_idx[i]]`` for 2-D tensors on any devices, one copy per consecutive run.

    Runs are merged so contiguous slots move in one copy; a block is never split per layer.
    """
    for s, d, n in runs(src_idx, dst_idx):
        dst[d:d + n].copy_(src[s:s + n], non_blocking=non_blocking)
