"""Tiers: one storage medium each, behind the ``Tier`` interface (see ``base``).

Threading contract: as stated in ``base`` and in each tier's module.
"""
from tiered_kv.tiers.base import Tier

__all__ = ["Tier"]
