"""Tiers: one storage medium each, behind the ``Tier`` interface (see ``base``)."""
from .base import Tier

__all__ = ["Tier"]
