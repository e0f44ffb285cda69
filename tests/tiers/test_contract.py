"""Every tier passes the shared contract suite in ``tiered_kv.testing``."""
from __future__ import annotations

import torch

from tests._pool import assert_gone, pool_spec
from tiered_kv.testing import TierContract
from tiered_kv.tiers.cpu import CpuTier
from tiered_kv.tiers.disk import DiskTier
from tiered_kv.tiers.gpu import GpuTier
from tiered_kv.tiers.pool import PoolTier


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


class TestPoolTier(TierContract):
    """The host pool (``cpu_pool``). It lives while a process has it open, so its "reopen" is what a second
    process sees: a joiner opens it, then the first opener closes (its blocks stay, with the joiner)."""

    def make_tier(self, tmp_path, capacity):
        return PoolTier(self.layout, pool_spec("contract"), capacity * self.layout.nbytes)

    def reopen(self, tier, tmp_path, capacity):
        again = PoolTier(self.layout, tier.spec, capacity * self.layout.nbytes)
        tier.close()
        return again

    def test_the_last_close_removes_the_pool(self, tmp_path):
        tier = self.make_tier(tmp_path, 4)
        joiner = self.reopen(PoolTier(self.layout, tier.spec, 4 * self.layout.nbytes), tmp_path, 4)
        tier.close()
        assert joiner.path.exists()
        joiner.close()
        assert_gone(tier.spec)
