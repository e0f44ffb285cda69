"""``PoolWatch``: what a host pool holds for one namespace, followed on a thread and handed over without I/O.

A vLLM scheduler process plans with a host pool as its CPU tier, but its scheduler thread never reads the pool
(DESIGN invariant 7: scheduler-side calls are dictionary work), while other processes (replicas of the same
model, Python API stores) store into the pool and evict from it at any time. A ``PoolWatch`` thread polls the
pool's index every ``interval_s`` and queues what changed for its namespace; the owner takes it with ``take()``
(a list swap), as it takes the remote tier's presence feed:

- *stored*: the namespace's records committed or read since the last poll. The budget's eviction order is kept
  by an age clock that every commit and every read moves (``Budget.keys_since``), so a poll reads one clock
  value when nothing changed, and otherwise walks only the entries past the clock it saw last. A record read
  again is reported again: the owner skips what it holds (and so re-learns a record it forgot and another
  process stored anew).
- *held*: a full listing of the namespace's records, from which the owner drops what it lists and the pool no
  longer holds (evicted by any process's writes, deleted), and adds what it missed. A listing walks every
  record of the namespace, so it runs only when the namespace's eviction count moved (or every ``rescan_s``,
  for deletes), at most once per ``MIN_RESCAN_S`` and never more than ``RESCAN_SHARE`` of the thread's time.
  Until then a record another process evicted stays in the owner's view: a read of it misses (a failed load,
  recomputed), never wrong bytes. (Comparing listings on this thread would miss what was stored and evicted
  between two polls: the owner knows what it stored itself, the watch does not.)

The first poll (a full listing) runs in the constructor, so the owner adopts what the pool held at its start.

Threading contract: ``pending``/``take`` from any thread (one consumer expected); polls run on the watch's daemon
thread (the first on the constructing thread); ``close`` once, from the owner, after which the tier is closed too.
"""
from __future__ import annotations

import logging
import threading
import time

from tiered_kv.tiers.pool.tier import PoolTier

log = logging.getLogger(__name__)

#: Full listings are at least this far apart (seconds) ...
MIN_RESCAN_S = 0.25
#: ... and at most this share of the time: a listing that took 10 ms waits 0.5 s before the next.
RESCAN_SHARE = 0.02
#: A poll that failed is logged at most once per this many seconds.
LOG_EVERY_S = 10.0


class PoolWatch:
    """Polls ``tier``'s index for its owner's records on a daemon thread (see the module)."""

    def __init__(self, tier: PoolTier, interval_s: float = 0.02, rescan_s: float = 10.0) -> None:
        self.tier = tier
        self.interval_s = interval_s
        self.rescan_s = rescan_s
        self._owner = tier.owner
        self._lock = threading.Lock()
        self._stored: list[bytes] = []
        self._held: set[bytes] | None = None  # the last listing, until taken
        self._clock = 0  # the pool's age clock at the last poll
        self._evictions = -1  # the namespace's eviction count at the last listing (-1: none yet)
        self._listed_at = 0.0
        self._list_cost = 0.0  # seconds the last listing took
        self._logged_at = 0.0
        self.polls = self.listings = 0
        self._stop = threading.Event()
        self.poll()
        self._thread = threading.Thread(target=self._run, name="tkv-pool-watch", daemon=True)
        self._thread.start()

    def pending(self) -> bool:
        """Whether anything changed since the last ``take``."""
        return bool(self._stored) or self._held is not None

    def take(self) -> tuple[list[bytes], set[bytes] | None]:
        """``(stored, held)`` since the last call: keys stored or read, and the last full listing (None: none since)
        with what was stored after it in ``stored``. A list swap."""
        with self._lock:
            out = self._stored, self._held
            self._stored, self._held = [], None
        return out

    def poll(self) -> None:
        """One look at the pool's index (one read txn): queue what was stored, or (when due) a full listing."""
        index = self.tier.index
        budget, owner = index.budget, self._owner
        now = time.monotonic()
        with index.env.begin(buffers=False) as txn:
            clock = budget.clock(txn)
            evictions = budget.evictions(txn, owner)
            gap = max(MIN_RESCAN_S, self._list_cost / RESCAN_SHARE)
            listing = self._evictions < 0 or ((evictions != self._evictions or now - self._listed_at >= self.rescan_s)
                                              and now - self._listed_at >= gap)
            if listing:
                t0 = time.perf_counter()
                held = set(budget.keys_since(txn, owner))
                self._evictions, self._listed_at = evictions, now
                self._list_cost = time.perf_counter() - t0
                self.listings += 1
            elif clock != self._clock:
                stored = budget.keys_since(txn, owner, self._clock)
            else:
                return
        self._clock = clock
        self.polls += 1
        with self._lock:
            if listing:  # what was queued before is in the listing (or gone)
                self._stored, self._held = [], held
            else:
                self._stored += stored

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 - a hint source: keep polling, say so now and then
                if time.monotonic() - self._logged_at > LOG_EVERY_S:
                    self._logged_at = time.monotonic()
                    log.warning("cpu pool %s: reading its index failed (%s); retrying", self.tier.spec, exc)

    def close(self) -> None:
        """Stop polling and close the tier (the last process to close the pool removes it). Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5.0)
        self.tier.close()
