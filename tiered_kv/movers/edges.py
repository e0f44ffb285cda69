"""The movers of one tier chain: one ``Mover`` per edge, and which edge runs which job.

A chain of tiers ``t0 -> t1 -> ... -> tn`` has a ``front`` edge (the caller's buffers <-> ``t0``)
and one edge per adjacent pair (``t0-t1``, ``t1-t2``, ...), each with its own threads and queue,
so a put into ``t0``, a demotion to ``t1`` and a prefetch from ``tn`` run at once and none waits
behind another edge's backlog.

Routing: a job between the caller and tier ``t`` (ingress, egress), or a delete in ``t``, runs on
the edge above ``t`` (``front`` for ``t0``); a job between two tiers runs on the edge between
them. ``depth(t)`` is the queue of the edge above ``t``, reported per tier in stats.

Threading contract: ``submit`` and ``depth`` may be called from any thread, including the
movers' own threads (a completion handler submits the jobs it unblocked); ``close`` is called
once, after the last submit.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from tiered_kv.errors import ConfigError
from tiered_kv.movers.mover import Mover
from tiered_kv.values.jobs import Completion, JobKind, TransferJob

# Jobs with one tier side only: they run on the edge above that tier.
_ONE_TIER = (JobKind.INGRESS, JobKind.EGRESS, JobKind.DELETE)


class EdgeMovers:
    """One ``Mover`` per edge of a chain of tiers named ``tier_names`` (fastest first).

    ``edge_workers[i]`` is the number of threads on the edge between tier ``i`` and tier ``i+1``
    (a slow keyed medium wants several). The front edge has one thread. Every mover runs
    ``execute(job)`` and then ``on_done(job, completion)`` on its thread.
    """

    def __init__(self, tier_names: Sequence[str], edge_workers: Sequence[int],
                 execute: Callable[[TransferJob], Completion],
                 on_done: Callable[[TransferJob, Completion], None]) -> None:
        if len(edge_workers) != max(len(tier_names) - 1, 0):
            raise ConfigError(f"{len(tier_names)} tiers have {max(len(tier_names) - 1, 0)} edges, "
                             f"got {len(edge_workers)} worker counts")
        # movers[t] is the edge above tier t: front for t = 0.
        self.movers = [Mover("front", execute, on_done, workers=1)]
        for (upper, lower), workers in zip(zip(tier_names, tier_names[1:]), edge_workers):
            self.movers.append(Mover(f"{upper}-{lower}", execute, on_done, workers=workers))

    def mover_for(self, job: TransferJob) -> Mover:
        """The mover of the edge ``job`` crosses."""
        if job.kind in _ONE_TIER:
            return self.movers[job.dst_tier if job.kind is JobKind.INGRESS else job.src_tier]
        return self.movers[max(job.src_tier, job.dst_tier)]

    def submit(self, jobs: Sequence[TransferJob]) -> None:
        """Queue each job on its edge; returns at once."""
        for job in jobs:
            self.mover_for(job).submit(job)

    def depth(self, tier: int) -> int:
        """Jobs queued or running on the edge above ``tier``."""
        return self.movers[tier].depth

    def close(self) -> None:
        """Finish queued jobs on every edge, then stop the threads."""
        for m in self.movers:
            m.close()
