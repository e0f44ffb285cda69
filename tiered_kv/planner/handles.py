"""Handles: the caller requests a ``TierChain`` has in flight, item by item, and the results of finished ones.

A caller's ``put``/``get``/``prefetch`` opens a handle of ``n`` items; every job item the chain plans for it
reports back here (``item_done``; ``items_done`` for a read's items at once) when its outcome is known, and the
handle finishes when none is pending.
Its result then waits in ``finished`` until the owner drains it (``TierChain.take_finished``):

- put -> list[bool] (accepted per key);
- get -> int (leading blocks delivered); prefetch -> int (leading blocks now at the target tier or faster).

Threading contract: not thread-safe; the owning ``TierChain`` serializes every call.
"""
from __future__ import annotations

from collections.abc import Iterable


class _Handle:
    """One caller request's items still in flight; ``ok`` (per item) is made at the first item's outcome."""

    __slots__ = ("kind", "n", "pending", "ok")

    def __init__(self, kind: str, n: int) -> None:
        self.kind, self.n, self.pending = kind, n, n
        self.ok: list[bool] | None = None


class Handles:
    """Open handles by id, and ``finished``: ``(handle_id, result)`` of those done since the last ``take``."""

    def __init__(self) -> None:
        self._open: dict[int, _Handle] = {}
        self.finished: list[tuple[int, object]] = []

    def open(self, handle: int, kind: str, n: int) -> _Handle:
        """Open ``handle`` for a request of ``kind`` ("put", "get" or "prefetch") over ``n`` items."""
        h = _Handle(kind, n)
        self._open[handle] = h
        return h

    def item_done(self, handle: int, item: int, ok: bool) -> None:
        """Item ``item`` of ``handle`` ended (``ok``); finishes the handle with its last item."""
        h = self._open.get(handle)
        if h is None:
            return
        if h.ok is None:
            h.ok = [False] * h.n
        h.ok[item] = ok
        h.pending -= 1
        self.maybe_finish(handle, h)

    def items_done(self, handle: int, items: Iterable[int], ok: bool) -> None:
        """``item_done(handle, i, ok)`` for every ``i`` of ``items`` (distinct, each still pending), in one call."""
        h = self._open.get(handle)
        if h is None:
            return
        if h.ok is None:
            h.ok = [False] * h.n
        done = h.ok
        count = 0
        for i in items:
            done[i] = ok
            count += 1
        h.pending -= count
        self.maybe_finish(handle, h)

    def maybe_finish(self, handle: int, h: _Handle) -> None:
        """Finish ``h`` if none of its items is pending (a request may report every item while it is planned)."""
        if h.pending > 0 or self._open.get(handle) is not h:
            return
        del self._open[handle]
        done = h.ok if h.ok is not None else [False] * h.n  # (n == 0: no item ever reported)
        if h.kind == "put":
            result: object = list(done)
        else:
            result = next((i for i, ok in enumerate(done) if not ok), h.n)
        self.finished.append((handle, result))

    def take(self) -> list[tuple[int, object]]:
        """Drain the results of finished handles."""
        out, self.finished = self.finished, []
        return out
