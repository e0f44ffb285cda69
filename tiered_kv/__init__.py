"""tiered_kv: a tiered KV-cache store (GPU -> pinned CPU -> LMDB disk) for LLM serving.

Public API: ``TieredStore``, ``StoreConfig``, ``Handle``, ``Namespace``, ``chain_keys``,
``BlockLayout`` and the errors in ``tiered_kv.errors``. Connectors live in
``tiered_kv.connector`` and import their engines lazily.

Threading contract: see each module; ``TieredStore`` methods may be called from any thread.
"""
from .config import StoreConfig
from .errors import ConfigError, InvalidInputError, StoreClosedError, TieredKVError, TransferTimeout
from .keys import Namespace, chain_keys
from .layout import BlockLayout
from .store import Handle, TieredStore

__version__ = "0.1.0"
__all__ = ["TieredStore", "StoreConfig", "Handle", "Namespace", "chain_keys", "BlockLayout", "TieredKVError",
           "ConfigError", "InvalidInputError", "StoreClosedError", "TransferTimeout"]
