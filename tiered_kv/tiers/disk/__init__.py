"""The disk tier: ``DiskTier`` (tier.py) composes the LMDB index (``DiskIndex``, index.py) and the
payload slot file (``SlotFile``, slots.py) of one directory::

    <disk_path>/index/        LMDB: records (key -> header), free slots, claims, meta, and the
                              shared budget (owners, order, spaces, leases: budget.py)
    <disk_path>/payload.bin   fixed slots of the block size rounded up to 4 KiB

Other modules import from here, not from the three files. Threading contract: as stated in each
module (reads, writes and deletes may run on several threads at once; ``close()`` once).
"""
from tiered_kv.tiers.disk.index import FORMAT, DiskIndex
from tiered_kv.tiers.disk.slots import ALIGN, SlotFile
from tiered_kv.tiers.disk.budget import ANON, MODES as BUDGET_MODES
from tiered_kv.tiers.disk.check import check_index
from tiered_kv.tiers.disk.tier import DiskTier, check_store_path, file_mode, index_users, quarantine

__all__ = ["ALIGN", "ANON", "BUDGET_MODES", "FORMAT", "DiskIndex", "DiskTier", "SlotFile", "check_index",
           "check_store_path", "file_mode", "index_users", "quarantine"]
