"""The ``Tier`` contract suite, shipped with the library so any tier (ours or a third party's)
runs the same tests.

Usage: subclass ``TierContract`` in a pytest module and implement ``make_tier(tmp_path,
capacity)``; pytest collects the inherited ``test_*`` methods. ``reopen`` is optional:
persistent tiers implement it to get the restart tests.

Threading contract: test code; each test builds its own tier.
"""
from __future__ import annotations

import threading
from pathlib import Path

import torch

from tiered_kv.values.layout import BlockLayout
from tiered_kv.tiers.base import Tier

LAYOUT = BlockLayout((2, 4, 32), "float16")


def random_rows(n: int, layout: BlockLayout = LAYOUT, seed: int = 0) -> torch.Tensor:
    """``n`` random blocks as uint8 rows of ``layout.nbytes`` bytes (never all zeros)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 255, (n, layout.nbytes), dtype=torch.uint8, generator=g)


def make_keys(n: int, prefix: bytes = b"k") -> list[bytes]:
    """``n`` distinct 32-byte keys."""
    return [prefix + i.to_bytes(8, "little") + b"\x00" * (31 - len(prefix) - 7) for i in range(n)]


class TierContract:
    """Inherited tests every tier must pass."""

    layout = LAYOUT

    def make_tier(self, tmp_path: Path, capacity: int) -> Tier:
        """Build a tier holding ``capacity`` blocks of ``self.layout``."""
        raise NotImplementedError

    def reopen(self, tier: Tier, tmp_path: Path, capacity: int) -> Tier | None:
        """Close ``tier`` and open it again on the same medium (persistent tiers); None if not persistent."""
        return None

    def _slots(self, tier: Tier, n: int) -> list[int]:
        return list(range(n)) if tier.slotted else [-1] * n

    def test_capacity_and_name(self, tmp_path):
        """The tier reports its capacity, block size and a describe() dict."""
        tier = self.make_tier(tmp_path, 8)
        try:
            assert tier.capacity >= 8
            assert tier.block_nbytes == self.layout.nbytes
            assert isinstance(tier.describe(), dict) and tier.describe()["name"] == tier.name
        finally:
            tier.close()

    def test_roundtrip_bit_exact(self, tmp_path):
        """Blocks written come back bit-exact."""
        tier = self.make_tier(tmp_path, 8)
        try:
            keys, rows = make_keys(8), random_rows(8)
            slots = self._slots(tier, 8)
            assert tier.write(keys, slots, rows) == [True] * 8
            out = torch.zeros_like(rows)
            ok, corrupt = tier.read(keys, slots, out)
            assert ok == [True] * 8 and corrupt == [False] * 8
            assert torch.equal(out, rows)
        finally:
            tier.close()

    def test_read_subset_out_of_order(self, tmp_path):
        """Any subset, in any order, reads back the right blocks."""
        tier = self.make_tier(tmp_path, 8)
        try:
            keys, rows = make_keys(8), random_rows(8, seed=1)
            slots = self._slots(tier, 8)
            tier.write(keys, slots, rows)
            pick = [5, 1, 7]
            out = torch.zeros((3, self.layout.nbytes), dtype=torch.uint8)
            ok, _ = tier.read([keys[i] for i in pick], [slots[i] for i in pick], out)
            assert ok == [True] * 3
            assert torch.equal(out, rows[pick])
        finally:
            tier.close()

    def test_concurrent_disjoint_writes_and_reads(self, tmp_path):
        """Four threads writing and reading disjoint blocks at once see their own bytes."""
        tier = self.make_tier(tmp_path, 32)
        try:
            keys, rows = make_keys(32), random_rows(32, seed=2)
            slots = self._slots(tier, 32)
            errors: list[BaseException] = []

            def worker(part: range) -> None:
                try:
                    idx = list(part)
                    assert tier.write([keys[i] for i in idx], [slots[i] for i in idx], rows[idx]) == [True] * len(idx)
                    out = torch.zeros((len(idx), self.layout.nbytes), dtype=torch.uint8)
                    ok, _ = tier.read([keys[i] for i in idx], [slots[i] for i in idx], out)
                    assert all(ok) and torch.equal(out, rows[idx])
                except BaseException as exc:  # surfaced below
                    errors.append(exc)

            threads = [threading.Thread(target=worker, args=(range(i, 32, 4),)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert not errors, errors
        finally:
            tier.close()

    def test_close_is_idempotent(self, tmp_path):
        """close() twice is fine."""
        tier = self.make_tier(tmp_path, 2)
        tier.close()
        tier.close()

    def test_persistence_if_supported(self, tmp_path):
        """Persistent tiers find their blocks again after a reopen; deleted ones are gone."""
        tier = self.make_tier(tmp_path, 8)
        keys, rows = make_keys(8), random_rows(8, seed=3)
        slots = self._slots(tier, 8)
        tier.write(keys, slots, rows)
        tier.flush()
        again = self.reopen(tier, tmp_path, 8)
        if again is None:
            tier.close()
            return
        try:
            assert sorted(again.stored_keys()) == sorted(keys)
            out = torch.zeros_like(rows)
            ok, _ = again.read(keys, slots, out)
            assert ok == [True] * 8 and torch.equal(out, rows)
            again.delete(keys[:2])
            ok, corrupt = again.read(keys[:2], slots[:2], out[:2])
            assert ok == [False, False] and corrupt == [False, False]
        finally:
            again.close()
