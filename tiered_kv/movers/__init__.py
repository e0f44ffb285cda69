"""Movers: the threads that execute the planner's transfer jobs, one pool per tier edge.

Threading contract: see ``mover``.
"""
from tiered_kv.movers.mover import Mover

__all__ = ["Mover"]
