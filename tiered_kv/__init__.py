"""tiered_kv: a tiered KV-cache store (GPU -> pinned CPU -> LMDB disk) for LLM serving.

Public API: ``TieredStore``, ``StoreConfig``, ``Handle``, ``Namespace``, ``chain_keys``,
``BlockLayout`` and the errors in ``tiered_kv.errors``. Connectors live in
``tiered_kv.connector`` and import their engines lazily.

Threading contract: see each module; ``TieredStore`` methods may be called from any thread.
"""
from tiered_kv.store.config import StoreConfig
from tiered_kv.errors import ConfigError, InvalidInputError, StoreClosedError, TieredKVError, TransferTimeout
from tiered_kv.values.keys import Namespace, chain_keys
from tiered_kv.values.layout import BlockLayout
from tiered_kv.store.handle import Handle
from tiered_kv.store.tiered_store import TieredStore
from tiered_kv.version import __version__
__all__ = ["TieredStore", "StoreConfig", "Handle", "Namespace", "chain_keys", "BlockLayout", "TieredKVError",
           "ConfigError", "InvalidInputError", "StoreClosedError", "TransferTimeout"]
