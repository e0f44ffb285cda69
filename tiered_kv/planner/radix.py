"""RadixIndex: token prefix -> block keys, page-aligned, with LRU eviction of leaves.

Each node is one page (``page_size`` tokens) and holds the key of the block that covers
the prefix up to and including that page. ``match`` walks full pages from the root and
returns the keys of the longest matching prefix. The tree is bounded: past
``max_pages`` nodes, least recently used leaves go first (a leaf is the only node that
can go without orphaning a longer prefix).

Planner side: pure Python, no torch, no I/O.
Threading contract: not thread-safe; ``TieredStore`` calls it under its lock.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence

from tiered_kv.errors import InvalidInputError


class _Node:
    __slots__ = ("key", "children", "parent", "page", "stamp")

    def __init__(self, key: bytes | None, parent: "_Node | None", page: tuple[int, ...], stamp: int) -> None:
        self.key = key
        self.children: dict[tuple[int, ...], _Node] = {}
        self.parent = parent
        self.page = page
        self.stamp = stamp


class RadixIndex:
    """Page-granular prefix tree of block keys."""

    def __init__(self, page_size: int, max_pages: int = 1 << 20) -> None:
        if not isinstance(page_size, int) or page_size <= 0:
            raise InvalidInputError(f"page_size must be a positive int, got {page_size!r}")
        self.page_size = page_size
        self.max_pages = max_pages
        self._clock = itertools.count(1)
        self._root = _Node(None, None, (), 0)
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def _pages(self, token_ids: Sequence[int]) -> list[tuple[int, ...]]:
        ps = self.page_size
        return [tuple(token_ids[i:i + ps]) for i in range(0, len(token_ids) - ps + 1, ps)]

    def insert(self, token_ids: Sequence[int], keys: Sequence[bytes]) -> None:
        """Record that page i of ``token_ids`` (with everything before it) is block ``keys[i]``."""
        pages = self._pages(token_ids)
        if len(keys) > len(pages):
            raise InvalidInputError(f"{len(keys)} keys for {len(pages)} full pages of {len(token_ids)} tokens")
        node, now = self._root, next(self._clock)
        for page, key in zip(pages, keys):
            child = node.children.get(page)
            if child is None:
                child = node.children[page] = _Node(key, node, page, now)
                self._size += 1
            else:
                child.key, child.stamp = key, now
            node = child
        self._evict()

    def match(self, token_ids: Sequence[int]) -> list[bytes]:
        """Keys of the longest page-aligned prefix of ``token_ids`` in the tree (refreshes their recency)."""
        node, now, out = self._root, next(self._clock), []
        for page in self._pages(token_ids):
            node = node.children.get(page)
            if node is None:
                break
            node.stamp = now
            out.append(node.key)
        return out

    def remove_prefix(self, token_ids: Sequence[int]) -> int:
        """Drop the node for the full ``token_ids`` path and everything under it. Returns nodes removed."""
        node = self._root
        for page in self._pages(token_ids):
            node = node.children.get(page)
            if node is None:
                return 0
        if node is self._root:
            return 0
        removed = self._count(node)
        del node.parent.children[node.page]
        self._size -= removed
        return removed

    def _count(self, node: _Node) -> int:
        return 1 + sum(self._count(c) for c in node.children.values())

    def _evict(self) -> None:
        if self._size <= self.max_pages:
            return
        leaves = []
        stack = [self._root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if not n.children and n is not self._root:
                leaves.append(n)
        leaves.sort(key=lambda n: n.stamp)
        for leaf in leaves:
            if self._size <= self.max_pages:
                break
            parent = leaf.parent
            del parent.children[leaf.page]
            self._size -= 1
            # the parent may now be a leaf older than the rest; it is found on the next eviction pass
