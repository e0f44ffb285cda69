"""Helpers for the planner tests: keys, a three-tier chain, and a driver that 'executes' jobs.

The driver only reports success/failure for each job, which is exactly what the planner sees
from real movers. Pure Python, no bytes moved.
"""
from __future__ import annotations

from tiered_kv.planner.chain import TierChain, TierSpec
from tiered_kv.values.jobs import Completion


def run_all(chain: TierChain, jobs, fail=lambda job: False, corrupt=lambda job, key: False):
    """Complete jobs (and what they unblock) until none are left; returns every job run."""
    seen = []
    while jobs:
        job = jobs.pop(0)
        seen.append(job)
        bad = fail(job)
        cor = [corrupt(job, k) for k in job.keys]
        jobs += chain.complete(Completion(job.job_id, [not bad and not c for c in cor], cor))
    return seen


def K(i: int) -> bytes:
    """A 32-byte key for block number ``i``."""
    return i.to_bytes(4, "little") * 8


def three_tier(gpu=2, cpu=3, disk=5, **kw) -> TierChain:
    """A gpu/cpu (slotted) + disk (keyed) chain with tiny capacities."""
    return TierChain([TierSpec("gpu", gpu), TierSpec("cpu", cpu), TierSpec("disk", disk, slotted=False)], **kw)
