"""BlockIndex: which tiers hold each key, in which state, and who is reading it.

Planner side: pure Python, no torch, no I/O. A key has at most one ``Copy`` per tier.
A copy is QUEUED (waiting for room), WRITING (its mover is filling it) or READY; only
READY copies are served (DESIGN invariant 1). ``pins`` counts jobs reading the copy:
a pinned copy is never freed, so its slot is not reused under a reader. ``leaving``
marks a copy whose eviction has started; ``doomed`` a copy to free once unpinned.

Compact records: most keys spend their life as one *plain* copy in one tier (no pins, no
flags, no waiting readers, entry not deleted), from the put through READY until they are
read or evicted. Such a key is stored as one ``int`` (slot, tier and state packed, see
``_pack``) instead of an ``Entry`` and a ``Copy``: the two objects per key are what Python's
garbage collector tracks, and on vLLM's scheduler thread every tracked object a step leaves
behind makes the collections more frequent and the long-lived heap slower to walk
(docs/benchmarks.md, scheduler step cost). ``get``/``entry``/``items`` hand out a real
``Entry`` (expanding a compact record in place, once), so every path that reads or changes
``Copy`` fields works unchanged; ``best``, ``plain`` and ``set_plain_state`` answer the hot
paths (lookups, a store's completion, eviction checks) without expanding, and ``pin_best`` (a
read) builds the pinned Entry straight from the record.

Threading contract: not thread-safe; the owning ``TierChain`` serializes access.
"""
from __future__ import annotations

import enum
from collections.abc import Iterator, KeysView, Sequence
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


# A compact record: ``slot << _SHIFT | tier << 2 | state`` (state 0..2 in 2 bits, tier 0..7 in 3 bits; a
# negative slot, NO_SLOT, keeps its sign under the shift). An int is never GC-tracked.
_TIER_BITS = 3
_SHIFT = 2 + _TIER_BITS
_TIER_MASK = (1 << _TIER_BITS) - 1
_READY = int(CopyState.READY)
_STATES = tuple(CopyState)


def _pack(tier: int, slot: int, state: CopyState) -> int:
    return slot << _SHIFT | tier << 2 | state


class BlockIndex:
    """key -> Entry (or a compact record of one plain copy, expanded on demand), with per-tier counts of copies."""

    def __init__(self, num_tiers: int) -> None:
        self._entries: dict[bytes, Entry | int] = {}
        self.copies_per_tier = [0] * num_tiers
        #: store plain copies compactly (False: every key an Entry; the tests compare the two). More tiers than
        #: the packing holds: Entries only.
        self.compact_records = num_tiers <= 1 << _TIER_BITS

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def _expand(self, key: bytes, code: int) -> Entry:
        """Replace ``key``'s compact record by the equivalent Entry (for good: it may be changed through it)."""
        e = self._entries[key] = Entry({code >> 2 & _TIER_MASK: Copy(_STATES[code & 3], code >> _SHIFT)})
        return e

    def get(self, key: bytes) -> Entry | None:
        """The entry for ``key`` or None."""
        e = self._entries.get(key)
        if e.__class__ is int:
            return self._expand(key, e)
        return e

    def entry(self, key: bytes) -> Entry:
        """The entry for ``key``, created if missing."""
        e = self._entries.get(key)
        if e is None:
            e = self._entries[key] = Entry()
        elif e.__class__ is int:
            e = self._expand(key, e)
        return e

    def best(self, key: bytes) -> int | None:
        """Fastest tier with a readable copy of ``key``, or None (``get(key).best()`` without expanding)."""
        e = self._entries.get(key)
        if e is None:
            return None
        if e.__class__ is int:
            return e >> 2 & _TIER_MASK if e & 3 == _READY else None
        return e.best()

    def pin_best(self, key: bytes) -> tuple[int, int] | None:
        """Pin ``key``'s fastest readable copy (its ``pins`` + 1) and return ``(tier, slot)`` of it, or None when no
        copy is readable: ``get(key).best()``'s copy, pinned, without building the Entry twice (a compact record
        becomes an Entry holding the pinned copy)."""
        e = self._entries.get(key)
        if e.__class__ is int:
            if e & 3 != _READY:
                return None
            t, slot = e >> 2 & _TIER_MASK, e >> _SHIFT
            entry = self._entries[key] = Entry({t: Copy(CopyState.READY, slot, 1)})
            entry.deleted = False  # set: read without ``__getattr__`` when the unpin stores it compactly again
            return t, slot
        if e is None:
            return None
        t = e.best()
        if t is None:
            return None
        c = e[t]
        c.pins += 1
        return t, c.slot

    def plain(self, key: bytes) -> tuple[int, CopyState] | None:
        """``(tier, state)`` of ``key``'s only copy when it is plain (compact: no pins, flags or waiting readers,
        entry not deleted), else None (absent, or an Entry: read it with ``get``)."""
        e = self._entries.get(key)
        if e.__class__ is int:
            return e >> 2 & _TIER_MASK, _STATES[e & 3]
        return None

    def set_plain_state(self, key: bytes, tier: int, state: CopyState) -> bool:
        """If ``key``'s only copy is plain and in ``tier``, set its state and return True; else change nothing
        and return False (the caller then goes through ``get``)."""
        e = self._entries.get(key)
        if e.__class__ is int and e >> 2 & _TIER_MASK == tier:
            self._entries[key] = e & ~3 | state
            return True
        return False

    def add_new(self, key: bytes, tier: int, slot: int, state: CopyState) -> None:
        """Record the first copy of a key the index does not hold, plain (the put path: one dict store)."""
        self._entries[key] = _pack(tier, slot, state) if self.compact_records else Entry({tier: Copy(state, slot)})
        self.copies_per_tier[tier] += 1

    def add_new_many(self, keys: Sequence[bytes], tier: int, slots: Sequence[int], state: CopyState) -> None:
        """``add_new`` for many distinct keys the index does not hold, one plain copy each in ``tier``."""
        if self.compact_records:
            low = tier << 2 | state
            self._entries.update(zip(keys, [s << _SHIFT | low for s in slots]))
        else:
            self._entries.update(zip(keys, [Entry({tier: Copy(state, s)}) for s in slots]))
        self.copies_per_tier[tier] += len(keys)

    def keys(self) -> KeysView[bytes]:
        """Every key with an entry (a live view: set operations on it run at C speed)."""
        return self._entries.keys()

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
        if e.__class__ is int:
            assert e >> 2 & _TIER_MASK == tier, (key.hex(), tier)
            del self._entries[key]
            self.copies_per_tier[tier] -= 1
            return True
        del e.copies[tier]
        self.copies_per_tier[tier] -= 1
        if not e.copies:
            del self._entries[key]
            return True
        return False

    def compact(self, key: bytes) -> None:
        """Store ``key``'s entry compactly again if it is back to one plain copy (a read let go of it)."""
        e = self._entries.get(key)
        if self.compact_records and e.__class__ is Entry and len(e) == 1 and not e.deleted:
            ((tier, c),) = e.items()
            if not (c.pins or c.leaving or c.doomed or c.deleting or c.wanted):
                self._entries[key] = _pack(tier, c.slot, c.state)

    def items(self) -> Iterator[tuple[bytes, Entry]]:
        """All (key, entry) pairs (compact records expanded)."""
        return iter([(k, self.get(k)) for k in list(self._entries)])
