"""The planner's counters: plain numbers ``TierChain`` and its ``RoomKeeper`` both add to.

The chain counts requests, hits and arrivals; the room keeper counts evictions and blocks
leaving. ``TieredStore.stats()`` and the vLLM connector's stats read them.

Threading contract: plain values, changed only under the owning ``TierChain``'s serialization.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TierCounters:
    """Per-tier counters (all monotonic except ``resident``)."""

    hits: int = 0
    blocks_in: int = 0
    blocks_out: int = 0
    evictions: int = 0
    failed_transfers: int = 0
    corrupt_dropped: int = 0
    vanished: int = 0
    refused: int = 0
    demotions_dropped: int = 0  # evicted from this tier, the copy down failed: dropped (a miss later), never kept


@dataclass
class ChainCounters:
    """Store-level counters: lookups = hits + misses; blocks_in = blocks_out + resident."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    blocks_in: int = 0
    blocks_out: int = 0
    puts_refused: int = 0
    puts_deduplicated: int = 0
