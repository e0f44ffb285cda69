"""Every tier passes the shared contract suite in ``tiered_kv.testing``."""
from __future__ import annotations

import torch

from tiered_kv.testing import TierContract
from tiered_kv.tiers.cpu import CpuTier
from tiered_kv.tiers.disk import DiskTier
from tiered_kv.tiers.gpu import GpuTier


class TestCpuTier(TierContract):
    def make_tier(self, tmp_path, capacity):
        return CpuTier(self.layout, capacity * self.layout.nbytes)


class TestGpuTier(TierContract):
    """Runs on CUDA where present, else on a CPU tensor (the CI fallback)."""

    def make_tier(self, tmp_path, capacity):
        return GpuTier(self.layout, capacity * self.layout.nbytes, device="auto")


class TestBorrowedGpuTier(TierContract):
    def make_tier(self, tmp_path, capacity):
        engine = torch.zeros((capacity, *self.layout.shape), dtype=torch.float16)
        return GpuTier.borrow(self.layout, engine)


class TestDiskTier(TierContract):
    def make_tier(self, tmp_path, capacity):
        return DiskTier(self.layout, tmp_path / "disk", capacity * 4096 * 2)

    def reopen(self, tier, tmp_path, capacity):
        tier.close()
        return DiskTier(self.layout, tmp_path / "disk", capacity * 4096 * 2)


class TestDiskTierZstd(TestDiskTier):
    def make_tier(self, tmp_path, capacity):
        return DiskTier(self.layout, tmp_path / "disk", capacity * 4096 * 2, compression="zstd")

    def reopen(self, tier, tmp_path, capacity):
        tier.close()
        return DiskTier(self.layout, tmp_path / "disk", capacity * 4096 * 2, compression="zstd")
