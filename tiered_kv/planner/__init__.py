"""The planner: which block lives where, what moves next (pure Python, no bytes, no torch).

``TierChain`` routes puts, gets, prefetches and completions over a ``BlockIndex`` with one
``EvictionPolicy`` per tier and returns ``TransferJob`` records; its ``RoomKeeper`` keeps the
room in each tier (waiters for a full tier, eviction by policy, copies leaving).
``RadixIndex`` maps token sequences to chunk keys. What of a hit below the memory tiers to load and what
to recompute: ``split.plan_split`` (the decision, per tier, with or without an overlap of load and
compute), ``rates`` (each tier's read rate, the prefill model and its online fit), ``gate.SplitGate``
(the two with a policy, probes and counters: the SGLang backend and the vLLM connector) and
``gate.LoadGate`` (the older all-or-nothing rule, no longer used by a front end). Imports only ``tiered_kv.values`` and ``tiered_kv.errors``.

Threading contract: not thread-safe; one owner thread (or the owner's lock) drives a chain.
"""
