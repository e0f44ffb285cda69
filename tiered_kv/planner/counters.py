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


#: Upper bounds (seconds) of the load-latency histogram's buckets; +Inf is implied. 0.5 ms to 5 s: a CPU hit of
#: a few MiB lands in about a millisecond, a cold disk or remote read of a long prompt in hundreds.
LOAD_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
#: The name transfer counters give the caller's side of a job (``EXT``): the engine's GPU blocks, the
#: Python API caller's tensor.
ENGINE = "engine"


class LatencyHistogram:
    """Counts of observed seconds per bucket of ``LOAD_SECONDS_BUCKETS`` (plus +Inf), their sum and count."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(LOAD_SECONDS_BUCKETS) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        """Count one observation of ``seconds``."""
        i = next((i for i, le in enumerate(LOAD_SECONDS_BUCKETS) if seconds <= le), len(LOAD_SECONDS_BUCKETS))
        self.counts[i] += 1
        self.total += seconds

    def snapshot(self) -> dict:
        """``{"buckets": [(upper bound, cumulative count), ..., (inf, count)], "sum", "count"}`` (Prometheus's shape)."""
        cum, buckets = 0, []
        for le, n in zip((*LOAD_SECONDS_BUCKETS, float("inf")), self.counts):
            cum += n
            buckets.append((le, cum))
        return {"buckets": buckets, "sum": self.total, "count": cum}


class TransferCounters:
    """Blocks moved per tier edge, and how long load jobs took per source tier.

    An edge is ``(source, destination)`` by tier name, ``ENGINE`` for the caller's side: ``engine -> cpu`` is a
    store, ``cpu -> disk`` a demotion or write-through, ``disk -> cpu`` a promotion, ``cpu -> engine`` a load.
    Only blocks that arrived count. A load job's seconds are what its mover reported (the copy, not the time it
    waited in a queue), for jobs toward the caller (loads and promotions), by the tier they read.
    """

    def __init__(self, tier_names: list[str]) -> None:
        self._names = list(tier_names)
        self.edge_blocks: dict[tuple[str, str], int] = {}
        self.load_seconds: dict[str, LatencyHistogram] = {}

    def record(self, src: int, dst: int, blocks: int, seconds: float, is_load: bool) -> None:
        """One finished job from tier ``src`` to ``dst`` (-1: the caller's side) that moved ``blocks`` blocks in
        ``seconds``."""
        edge = (ENGINE if src < 0 else self._names[src], ENGINE if dst < 0 else self._names[dst])
        self.edge_blocks[edge] = self.edge_blocks.get(edge, 0) + blocks
        if is_load and src >= 0 and seconds > 0:
            hist = self.load_seconds.get(edge[0])
            if hist is None:
                hist = self.load_seconds[edge[0]] = LatencyHistogram()
            hist.observe(seconds)

    def snapshot(self, block_nbytes: int) -> dict:
        """Plain copy for ``stats()``: ``edges`` (``{"src", "dst", "blocks", "bytes"}`` each, bytes at
        ``block_nbytes`` a block) and ``load_seconds`` (per source tier, ``LatencyHistogram.snapshot``)."""
        edges = [{"src": s, "dst": d, "blocks": n, "bytes": n * block_nbytes}
                 for (s, d), n in sorted(self.edge_blocks.items())]
        return {"edges": edges, "load_seconds": {t: h.snapshot() for t, h in sorted(self.load_seconds.items())}}
