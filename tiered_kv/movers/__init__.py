"""Movers: the threads that execute the planner's transfer jobs, one pool per tier edge, and the
executor that turns a job into reads and writes of two tiers.

Threading contract: see ``mover``, ``edges`` and ``executor``.
"""
from tiered_kv.movers.edges import EdgeMovers
from tiered_kv.movers.executor import JobExecutor
from tiered_kv.movers.mover import Mover

__all__ = ["Mover", "EdgeMovers", "JobExecutor"]
