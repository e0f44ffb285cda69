"""Hybrid models: give vLLM back a shared prefix's GPU hit that loads can never restore (``hybrid_reseed``).

vLLM's own prefix hit on a model with sliding-window layers needs, at the hit's end, the window layers' blocks just
before it. A request whose prefix the connector loads gets window blocks only at the end of its hit. So once the
last window of a prefix that many conversations share (a system prompt) has left the GPU, no loaded request puts it
back: every later request loads that prefix again and holds a private copy of its full-attention blocks, while
without a connector the next request would recompute it and re-cache it for the rest
(``benchmarks/probes/hybrid_shared_prefix.py``; docs/vllm.md, "Hybrid models").

``SharedPrefixWatch`` notices such a prefix from the hits themselves: two hits that start at the same chunk past
vLLM's own hit and go on alike before they diverge (two conversations, not two turns of one, which extend each
other) share their common run, and vLLM holds none of it. Then, at most once per ``interval_s``, the lookup answers
that request "no hit": it recomputes its prompt, vLLM caches the shared prefix with its window, and the requests
after it hit the prefix in the GPU and load only what follows. The trade: one request's recompute against every
later request's load of the shared prefix and its private copy of it; off by default until a GPU run prices it.

Threading contract: vLLM's scheduler thread only (``LookupPlanner``); no I/O, no torch.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

#: first chunks whose last hit is remembered, at most (least recently seen first to go)
CAPACITY = 4096


class SharedPrefixWatch:
    """Per first chunk of a hit, the longest hit seen from it; ``branch`` tells how far a new hit ran alike."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic,
                 capacity: int = CAPACITY) -> None:
        if interval_s < 0:
            raise ValueError(f"hybrid_reseed_interval_s={interval_s!r}: must be >= 0 seconds")
        self.interval_s = interval_s
        self.clock = clock
        self.capacity = capacity
        self._paths: OrderedDict[bytes, tuple[bytes, ...]] = OrderedDict()
        self._last: float | None = None  # when the last reseed was answered

    def branch(self, keys: Sequence[bytes]) -> int:
        """Chunks at the start of ``keys`` (a hit's chunk keys, from the first chunk vLLM does not hold) that the
        remembered hit from the same first chunk had too before the two diverged; 0 when none did, or when one hit
        extends the other (later turns of one conversation). Remembers the longer of the two."""
        if not keys:
            return 0
        first = keys[0]
        seen = self._paths.get(first)
        path = tuple(keys)
        if seen is None:
            self._paths[first] = path
            if len(self._paths) > self.capacity:
                self._paths.popitem(last=False)
            return 0
        self._paths.move_to_end(first)
        common = 0
        for a, b in zip(seen, path):
            if a != b:
                break
            common += 1
        if common == min(len(seen), len(path)):  # one extends the other: one conversation, no branch
            if len(path) > len(seen):
                self._paths[first] = path
            return 0
        return common

    def due(self) -> bool:
        """Whether a reseed may be answered now (none in the last ``interval_s``)."""
        return self._last is None or self.clock() - self._last >= self.interval_s

    def fired(self) -> None:
        """A reseed was answered now."""
        self._last = self.clock()
