"""The SGLang HiCache storage backend: ``TieredHiCacheStorage`` (load it with the ``dynamic`` backend).

``module_path: tiered_kv.connector.sglang`` and ``class_name: TieredHiCacheStorage`` name this
package; the class is imported on first access so that ``config`` imports without SGLang.

Modules: ``backend`` (the SGLang-facing class), ``config`` (extra-config keys), ``pages`` (views of
SGLang's host pool pages), ``page_io`` (page reads/writes through the store), ``stats`` (counters).

Threading contract: see each module.
"""
from __future__ import annotations

__all__ = ["TieredHiCacheStorage"]


def __getattr__(name: str):
    """Import the backend class on first access (it imports SGLang)."""
    if name == "TieredHiCacheStorage":
        from tiered_kv.connector.sglang.backend import TieredHiCacheStorage

        return TieredHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
