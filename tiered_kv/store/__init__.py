"""The Python API front end: ``TieredStore`` (planner + tiers + movers in one process) and its config.

Threading contract: ``TieredStore`` methods may be called from any thread (see ``tiered_store``).
"""
from tiered_kv.store.config import StoreConfig
from tiered_kv.store.tiered_store import Handle, TieredStore

__all__ = ["TieredStore", "Handle", "StoreConfig"]
