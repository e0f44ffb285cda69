"""The vLLM KV connector: ``TieredKVConnector`` (load it with ``kv_connector_module_path``).

``kv_connector_module_path: tiered_kv.connector.vllm`` and ``kv_connector: TieredKVConnector``
name this package; the class is imported on first access so that the config and planner modules
(``config``, ``geometry``, ``scheduler`` and its parts) import in processes without vLLM.

Modules: ``connector`` (the vLLM-facing class, a facade over either side by role), ``config``
(extra-config keys, namespace, capacities), ``geometry`` (block geometry and KV cache groups),
``common`` (the messages each way); the scheduler side, in vLLM's scheduler process:
``scheduler`` (``SchedulerPlanner``) and its parts ``lookup`` (with ``reseed``), ``loads``, ``stores``, ``blocks``,
``routing``, ``presence``, ``state``, ``parts``, ``admission``; the byte side, in each GPU worker
process: ``worker`` (``WorkerRuntime``), ``runner`` (the mover threads' jobs), ``in_step``,
``async_loads``, ``shared_slab`` (one CPU slab that every TP rank maps, for MLA stored once).
``tiered_kv/README.md`` says what each holds.

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
