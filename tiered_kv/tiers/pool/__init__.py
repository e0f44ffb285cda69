"""The host pool: one CPU tier in shared memory for every process on a host (``cpu_pool: "host:<name>"``).

``PoolTier`` (tier.py) is the tier: the shared disk directory's index, budget, claims and leases
(``tiers/disk/``, by composition) over payload slots in ``/dev/shm`` (``ShmSlots``, region.py); place.py
says where a pool lives, who may open it, and when it is made, joined and removed; ``PoolWatch`` (watch.py)
follows one namespace's records in it from a thread (a vLLM scheduler process, which never reads the pool)::

    /dev/shm/tiered_kv-<uid>/<name>/   pool.json (geometry), payload (the slots), index/ (LMDB)

Other modules import from here. Threading contract: as stated in each module.
"""
from tiered_kv.tiers.pool.place import SHM_DIR, Geometry, check_pool_size, pool_name, user_root
from tiered_kv.tiers.pool.region import ShmSlots
from tiered_kv.tiers.pool.tier import PoolLease, PoolReservation, PoolTier
from tiered_kv.tiers.pool.watch import PoolWatch

__all__ = ["SHM_DIR", "Geometry", "check_pool_size", "PoolLease", "PoolReservation", "PoolTier", "PoolWatch", "ShmSlots", "pool_name",
           "user_root"]
