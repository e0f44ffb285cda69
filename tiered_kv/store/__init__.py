"""The Python API front end: ``TieredStore`` (planner + tiers + movers in one process), its config and ``Handle``.

Threading contract: ``TieredStore`` methods may be called from any thread (see ``tiered_store``);
a ``Handle`` may be waited on from any thread (see ``handle``).
"""
from tiered_kv.store.config import StoreConfig
from tiered_kv.store.handle import Handle
from tiered_kv.store.tiered_store import TieredStore

__all__ = ["TieredStore", "Handle", "StoreConfig"]
