"""BlockIndex: which tiers hold each key, in which state, and who is reading it.

Planner side: pure Python, no torch, no I/O. A key has at most one ``Copy`` per tier.
A copy is QUEUED (waiting for room), WRITING (its mover is filling it) or READY; only
READY copies are served (DESIGN invariant 1). ``pins`` counts jobs reading the copy:
a pinned copy is never freed, so its slot is not reused under a reader. ``leaving``
marks a copy whose eviction has started; ``doomed`` a copy to free once unpinned.

Threading contract: not thread-safe; the owning ``TierChain`` serializes access.
"""
from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


class CopyState(enum.IntEnum):
    """Lifecycle of one copy of a block in one tier."""

    QUEUED = 0
    WRITING = 1
    READY = 2


@dataclass(slots=True)
class Copy:
    """One block's copy in one tier."""

    state: CopyState
    slot: int
    pins: int = 0
    leaving: bool = False
    doomed: bool = False
    deleting: bool = False
    wanted: int = 0  # waiting copies that will read this one: evicted only when nothing else can be

    @property
    def readable(self) -> bool:
        """READY and not on its way out."""
        return self.state is CopyState.READY and not self.doomed


class Entry(dict):
    """Every copy of one key, by tier index: a ``dict`` of tier -> ``Copy`` (``copies`` is itself).

    One object per key instead of an entry plus its dict: the planner runs on vLLM's scheduler
    thread, where every long-lived object the garbage collector tracks makes its collections
    more frequent (docs/benchmarks.md, scheduler overhead). No Python ``__init__``: ``Entry({tier: copy})``
    runs ``dict``'s own, in C (the put fast path builds one per chunk key); ``deleted`` reads False
    until it is set.
    """

    __slots__ = ("deleted",)

    def __getattr__(self, name: str):
        # only reached while the ``deleted`` slot was never set (a plain slot has no default)
        if name == "deleted":
            return False
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def copies(self) -> "Entry":
        """The copies by tier (the entry itself)."""
        return self

    def __repr__(self) -> str:
        return f"Entry(copies={dict.__repr__(self)}, deleted={self.deleted})"

    def best(self) -> int | None:
        """Fastest tier with a readable copy, or None."""
        ready = [t for t, c in self.copies.items() if c.readable]
        return min(ready) if ready else None


class BlockIndex:
    """key -> Entry, with per-tier counts of copies."""

    def __init__(self, num_tiers: int) -> None:
        self._entries: dict[bytes, Entry] = {}
        self.copies_per_tier = [0] * num_tiers

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> Entry | None:
        """The entry for ``key`` or None."""
        return self._entries.get(key)

    def entry(self, key: bytes) -> Entry:
        """The entry for ``key``, created if missing."""
        e = self._entries.get(key)
        if e is None:
            e = self._entries[key] = Entry()
        return e

    def add_new(self, key: bytes, tier: int, copy: Copy) -> None:
        """Record the first copy of a key the index does not hold (the put fast path: one dict store)."""
        self._entries[key] = Entry({tier: copy})
        self.copies_per_tier[tier] += 1

    def add_new_many(self, keys: Sequence[bytes], tier: int, slots: Sequence[int], state: CopyState) -> None:
        """``add_new`` for many distinct keys the index does not hold, one copy each in ``tier``."""
        self._entries.update(zip(keys, [Entry({tier: Copy(state, s)}) for s in slots]))
        self.copies_per_tier[tier] += len(keys)

    def holds_none_of(self, keys: Sequence[bytes]) -> bool:
        """True when no key of ``keys`` has an entry (C speed)."""
        return self._entries.keys().isdisjoint(keys)

    def add_copy(self, key: bytes, tier: int, copy: Copy) -> None:
        """Record ``copy`` of ``key`` in ``tier`` (there must be none yet)."""
        e = self.entry(key)
        assert tier not in e.copies, (key.hex(), tier)
        e.copies[tier] = copy
        self.copies_per_tier[tier] += 1

    def remove_copy(self, key: bytes, tier: int) -> bool:
        """Forget ``key``'s copy in ``tier``. Returns True if the key has no copies left (and is dropped)."""
        e = self._entries[key]
        del e.copies[tier]
        self.copies_per_tier[tier] -= 1
        if not e.copies:
            del self._entries[key]
            return True
        return False

    def items(self) -> Iterator[tuple[bytes, Entry]]:
        """All (key, entry) pairs."""
        return iter(list(self._entries.items()))
