"""Other processes' chunks on the vLLM scheduler side: the remote tier's (``RemotePresence``) and a host pool's
(``PoolPresence``).

The remote tier: what the fleet stored, adopted into the chain when a lookup reaches it.

The presence feed (``tiers.remote.PresenceFeed``) reads on its own thread which chunks other engines stored
in (or removed from) the shared Redis Cluster. ``RemotePresence`` takes that once per step or lookup (set
work, no network I/O) and keeps the announced keys; a chunk is adopted into the ``TierChain`` as a copy in
the remote tier only when a lookup reaches it, so an announcement costs a set insert on the scheduler
thread. A load that finds a remote record missing or damaged forgets it; one that could not read it (its
node down or slow) forgets it too, so the next lookup misses and the recompute stores the chunk anew.

A host pool (``cpu_pool``, the CPU tier itself, keyed and governed): a ``PoolWatch`` thread reads the pool's index
for the chunks of this namespace other processes stored (or the pool dropped); ``PoolPresence`` takes that once per
step and before each lookup, adopts the new chunks as CPU copies at once (a dictionary insert each: they are
this model's, and the pool holds at most ``cpu_bytes`` of them) and forgets the removed ones. The evictions this
engine's own stores make come back sooner, in their jobs' reports (``JobReport.evicted``).

Threading contract: vLLM's scheduler thread only; no I/O (the feed and the watch did it), no torch.
"""
from __future__ import annotations

from typing import Protocol

from tiered_kv.planner.chain import TierChain
from tiered_kv.values.jobs import JobKind, TransferJob
from tiered_kv.connector.vllm.common import JobReport
from tiered_kv.connector.vllm.routing import JobRouter
from tiered_kv.connector.vllm.state import PlannerCounters


class PresenceSource(Protocol):
    """What the planner needs of the remote tier's presence feed (``tiers.remote.PresenceFeed``)."""

    def pending(self) -> bool: ...

    def take(self) -> tuple[list[bytes], list[bytes]]: ...


class PoolSource(Protocol):
    """What the planner needs of a host pool's watch (``tiers.pool.PoolWatch``)."""

    def pending(self) -> bool: ...

    def take(self) -> tuple[list[bytes], set[bytes] | None]: ...


class _Presence:
    """What both kinds share: the source other processes' chunks come from, and the chain tier they land in."""

    def __init__(self, source: PresenceSource | PoolSource, chain: TierChain, tier: int, router: JobRouter,
                 counters: PlannerCounters) -> None:
        self._source = source
        self.chain = chain
        self.tier = tier
        self._router = router
        self.counters = counters

    def pending(self) -> bool:
        """Whether the source brought anything since the last ``sync``."""
        return self._source.pending()


class RemotePresence(_Presence):
    """The chunks the fleet announced in remote tier ``tier`` and not yet adopted or forgotten (``known``)."""

    def __init__(self, source: PresenceSource, chain: TierChain, tier: int, router: JobRouter,
                 counters: PlannerCounters) -> None:
        super().__init__(source, chain, tier, router, counters)
        # chunks the fleet stored in the remote tier, adopted into the chain only when a lookup reaches one:
        # a set insert per announced chunk keeps the feed's cost off the scheduler thread's steps
        self.known: set[bytes] = set()

    def sync(self) -> None:
        """Take what the presence feed reported since the last call: chunks the fleet stored in the remote tier
        (remembered, adopted when a lookup reaches one) and removed (forgotten). Set work: the feed did the
        network I/O on its own thread."""
        stored, removed = self._source.take()
        known = self.known
        known.update(stored)
        if removed:
            known.difference_update(removed)
            self._router.route(self.chain.forget(self.tier, removed))
        self.counters.remote_announced += len(stored)

    def adopt(self, key: bytes) -> int | None:
        """Adopt one announced chunk as a copy in the remote tier; the fastest tier now holding it readable."""
        self.counters.remote_adopted += 1
        self._router.route(self.chain.adopt(self.tier, [key]))
        return self.chain.index.best(key)

    def job_done(self, job: TransferJob, rep: JobReport) -> list[bytes]:
        """A job ended: never adopt again what it found gone from Redis; returns the chunks a load from the
        remote tier could not read although Redis may still hold them (the caller forgets those copies once
        the job is complete: vLLM recomputes them and would at once ask for the same load again)."""
        if job.src_tier != self.tier:
            return []
        if self.known and (any(rep.missing) or any(rep.corrupt)):  # gone from Redis: never adopt it again
            self.known.difference_update(
                k for k, m, c in zip(job.keys, rep.missing or [False] * len(job), rep.corrupt) if m or c)
        if job.kind is not JobKind.EGRESS or all(rep.ok):
            return []
        n = len(job)
        gone = [m or c for m, c in zip(rep.missing or [False] * n, rep.corrupt or [False] * n)]
        keys = [k for k, ok, g in zip(job.keys, rep.ok, gone) if not (ok or g)]
        self.known.difference_update(keys)
        return keys


class PoolPresence(_Presence):
    """The chunks other processes stored in (or the pool dropped from) tier ``tier``, a host pool, taken from
    ``source`` (a ``tiers.pool.PoolWatch``) into the chain, whose only tier it is. The first ``sync`` runs here: what
    the pool held when the engine started."""

    def __init__(self, source: PoolSource, chain: TierChain, tier: int, router: JobRouter,
                 counters: PlannerCounters) -> None:
        super().__init__(source, chain, tier, router, counters)
        self.sync()

    def sync(self) -> None:
        """Take what the watch found: after a full listing, forget the copies the pool no longer holds and adopt
        the ones the chain lacks (two set differences at C speed, once per listing); then adopt what was stored
        since (keys the chain holds are skipped)."""
        stored, held = self._source.take()
        chain, route, tier = self.chain, self._router.route, self.tier
        before = chain.resident(tier)
        if held is not None:
            keys = chain.index.keys()
            gone = list(keys - held)  # pool mode: every key of the chain is a copy in the pool (or on its way)
            if gone:
                route(chain.forget(tier, gone))  # copies still being written are left to their job
                self.counters.pool_forgotten += before - chain.resident(tier)
                before = chain.resident(tier)
            stored = list(held - keys) + stored
        if stored:
            route(chain.adopt(tier, stored))
            self.counters.pool_adopted += chain.resident(tier) - before

    def before(self, match):
        """``match`` that first takes what the watch found (a request arriving after an idle spell sees it)."""
        pending, sync = self._source.pending, self.sync

        def synced(request, num_computed_tokens: int) -> int | None:
            if pending():
                sync()
            return match(request, num_computed_tokens)

        return synced
