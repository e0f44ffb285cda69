"""The planner: which block lives where, what moves next (pure Python, no bytes, no torch).

``TierChain`` routes puts, gets, prefetches and completions over a ``BlockIndex`` with one
``EvictionPolicy`` per tier and returns ``TransferJob`` records; its ``RoomKeeper`` keeps the
room in each tier (waiters for a full tier, eviction by policy, copies leaving).
``RadixIndex`` maps token sequences to chunk keys. ``gate.LoadGate`` decides whether a hit in a slow
tier (disk, remote) is worth loading or cheaper to recompute (both engine adapters use it). Imports only ``tiered_kv.values`` and
``tiered_kv.errors``.

Threading contract: not thread-safe; one owner thread (or the owner's lock) drives a chain.
"""
