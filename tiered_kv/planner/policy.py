"""Eviction and placement policies (planner side: pure Python, no torch, no I/O).

An ``EvictionPolicy`` orders the blocks of one tier: the planner tells it about
inserts, accesses and removals, and asks it for victims. Like cachetools, a policy
overrides a small surface; the bookkeeping of what may be evicted (pinned, being
written, already leaving) stays with the planner, which passes ``evictable``.

Policies:
- ``LRUPolicy``: least recently used first.
- ``S3FIFOPolicy``: S3-FIFO (small FIFO for new blocks, main FIFO for blocks seen
  twice, ghost list of recent small-queue victims). Scan-resistant: a one-pass scan of
  new blocks evicts other new blocks, not the hot working set.

``PlacementPolicy`` names where puts land and how blocks move (write-back or
write-through, promote-on-hit).

Threading contract: not thread-safe; the owning ``TierChain`` serializes calls.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tiered_kv.errors import ConfigError


class EvictionPolicy:
    """Orders one tier's resident keys for eviction. Subclasses implement the five hooks."""

    name = "base"

    def insert(self, key: bytes) -> None:
        """A block became resident in the tier."""
        raise NotImplementedError

    def access(self, key: bytes) -> None:
        """A resident block was read or re-put."""
        raise NotImplementedError

    def remove(self, key: bytes) -> None:
        """A block left the tier (evicted, deleted or failed). Unknown keys are ignored."""
        raise NotImplementedError

    def reorder(self, key: bytes) -> None:
        """The caller orders blocks it knows belong together (``TierChain.touch``): a recency policy moves
        ``key`` to the most recently used end; an access it is not (no frequency counts). Default: nothing."""

    def victims(self, n: int, evictable: Callable[[bytes], bool]) -> list[bytes]:
        """Up to ``n`` keys to evict, in policy order, skipping keys for which ``evictable`` is False.

        Does not remove them: the planner calls ``remove`` when each one is gone.
        """
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, key: bytes) -> None:
        """Insert as most recently used."""
        self._order[key] = None
        self._order.move_to_end(key)

    def access(self, key: bytes) -> None:
        """Mark as most recently used."""
        if key in self._order:
            self._order.move_to_end(key)

    reorder = access

    def remove(self, key: bytes) -> None:
        """Forget ``key``."""
        self._order.pop(key, None)

    def victims(self, n: int, evictable: Callable[[bytes], bool]) -> list[bytes]:
        """Oldest evictable keys first."""
        out: list[bytes] = []
        for key in self._order:
            if len(out) >= n:
                break
            if evictable(key):
                out.append(key)
        return out

    def __len__(self) -> int:
        return len(self._order)


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO: small FIFO (10%), main FIFO with 2-bit frequency, ghost FIFO of small-queue victims."""

    name = "s3fifo"

    def __init__(self, small_ratio: float = 0.1) -> None:
        if not 0.0 < small_ratio < 1.0:
            raise ConfigError(f"s3fifo small_ratio must be in (0, 1), got {small_ratio!r}")
        self.small_ratio = small_ratio
        self._small: OrderedDict[bytes, None] = OrderedDict()
        self._main: OrderedDict[bytes, None] = OrderedDict()
        self._freq: dict[bytes, int] = {}
        self._ghost: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, key: bytes) -> None:
        """New blocks go to the small queue, unless recently evicted from it (ghost hit -> main)."""
        if key in self._small or key in self._main:
            self.access(key)
            return
        self._freq[key] = 0
        if self._ghost.pop(key, False) is None:
            self._main[key] = None
        else:
            self._small[key] = None

    def access(self, key: bytes) -> None:
        """Bump the key's frequency (saturating at 3)."""
        if key in self._freq:
            self._freq[key] = min(self._freq[key] + 1, 3)

    def reorder(self, key: bytes) -> None:
        """Move the key to the new end of whichever queue holds it; its frequency stays."""
        if key in self._small:
            self._small.move_to_end(key)
        elif key in self._main:
            self._main.move_to_end(key)

    def remove(self, key: bytes) -> None:
        """Forget ``key``; a key leaving from the small queue is remembered in the ghost list."""
        self._freq.pop(key, None)
        if self._small.pop(key, False) is None:
            self._ghost[key] = None
            limit = max(16, len(self._small) + len(self._main))
            while len(self._ghost) > limit:
                self._ghost.popitem(last=False)
        else:
            self._main.pop(key, None)

    def victims(self, n: int, evictable: Callable[[bytes], bool]) -> list[bytes]:
        """Walk the queues as S3-FIFO would: re-used small keys graduate to main, main keys age.

        Keys that are not evictable are skipped without touching their frequency.
        """
        out: list[bytes] = []
        chosen: set[bytes] = set()
        for _ in range(5):  # frequencies are <= 3, so a few passes always settle
            if len(out) >= n:
                break
            progressed = False
            total = len(self._small) + len(self._main)
            if self._small and (len(self._small) >= self.small_ratio * total or not self._main):
                graduate: list[bytes] = []
                for key in self._small:
                    if len(out) >= n:
                        break
                    if key in chosen or not evictable(key):
                        continue
                    if self._freq.get(key, 0) > 0:
                        graduate.append(key)
                    else:
                        out.append(key)
                        chosen.add(key)
                    progressed = True
                for key in graduate:
                    del self._small[key]
                    self._main[key] = None
                    self._freq[key] = 0
            aged: list[bytes] = []
            for key in self._main:
                if len(out) >= n:
                    break
                if key in chosen or not evictable(key):
                    continue
                if self._freq.get(key, 0) > 0:
                    aged.append(key)
                else:
                    out.append(key)
                    chosen.add(key)
                progressed = True
            for key in aged:
                self._freq[key] -= 1
                self._main.move_to_end(key)
            if not progressed:
                break
        return out

    def __len__(self) -> int:
        return len(self._small) + len(self._main)


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "s3fifo": S3FIFOPolicy}


def make_policy(name: str) -> EvictionPolicy:
    """Build an eviction policy by name ("lru" or "s3fifo")."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ConfigError(f"eviction: unknown policy {name!r}; valid: {sorted(POLICIES)}") from None


WRITE_POLICIES = ("write_back", "write_through")


@dataclass(frozen=True)
class PlacementPolicy:
    """Where puts land and how blocks move between tiers.

    - ``write_policy``: ``write_back`` copies a block down only when it is evicted;
      ``write_through`` also copies every new block down to every lower tier right after
      the put lands (safer against a crash, more bytes moved).
    - ``promote_on_hit``: a get served from a lower tier also copies the block one tier up.
    - ``put_tier``: index of the tier puts land in (0 = fastest).
    - ``copy_to``: tiers that also get a copy of every new block right after its put lands, straight
      from the put tier, whatever ``write_policy`` says of the tiers between (the remote tier with
      ``remote_write`` "through": other hosts see a block as soon as it is stored).
    """

    write_policy: str = "write_back"
    promote_on_hit: bool = True
    put_tier: int = 0
    copy_to: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.write_policy not in WRITE_POLICIES:
            raise ConfigError(f"write_policy: unknown value {self.write_policy!r}; valid: {list(WRITE_POLICIES)}")
        if not isinstance(self.put_tier, int) or self.put_tier < 0:
            raise ConfigError(f"put_tier must be an int >= 0, got {self.put_tier!r}")
        if any(not isinstance(t, int) or t <= self.put_tier for t in self.copy_to):
            raise ConfigError(f"copy_to must name tiers below put_tier={self.put_tier}, got {self.copy_to!r}")


def drain(policy: EvictionPolicy, keys: Iterable[bytes]) -> None:
    """Remove every key in ``keys`` from ``policy``."""
    for key in keys:
        policy.remove(key)
