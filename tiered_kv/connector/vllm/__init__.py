"""The vLLM KV connector: ``TieredKVConnector`` (load it with ``kv_connector_module_path``).

``kv_connector_module_path: tiered_kv.connector.vllm`` and ``kv_connector: TieredKVConnector``
name this package; the class is imported on first access so that the config and planner modules
(``config``, ``scheduler``) import in processes without vLLM.

Modules: ``connector`` (the vLLM-facing class), ``config`` (extra-config keys, geometry and KV
cache groups), ``scheduler`` (the planner side, in vLLM's scheduler process), ``worker`` and
``in_step`` (the byte side, in each GPU worker process), ``shared_slab`` (one CPU slab that every
TP rank maps, for MLA stored once).

Threading contract: see each module.
"""
from __future__ import annotations

__all__ = ["TieredKVConnector"]


def __getattr__(name: str):
    """Import the connector class on first access (it imports vLLM)."""
    if name == "TieredKVConnector":
        from tiered_kv.connector.vllm.connector import TieredKVConnector

        return TieredKVConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
