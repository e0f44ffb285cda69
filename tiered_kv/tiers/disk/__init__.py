"""The disk tier: ``DiskTier`` (tier.py) composes the LMDB index (``DiskIndex``, index.py) and the
payload slot file (``SlotFile``, slots.py) of one directory::

    <disk_path>/index/        LMDB: records (key -> header), free slots, claims, meta
    <disk_path>/payload.bin   fixed slots of the block size rounded up to 4 KiB

Other modules import from here, not from the three files. Threading contract: as stated in each
module (reads, writes and deletes may run on several threads at once; ``close()`` once).
"""
from tiered_kv.tiers.disk.index import FORMAT, DiskIndex
from tiered_kv.tiers.disk.slots import ALIGN, SlotFile
from tiered_kv.tiers.disk.tier import DiskTier, check_store_path, file_mode

__all__ = ["ALIGN", "FORMAT", "DiskIndex", "DiskTier", "SlotFile", "check_store_path", "file_mode"]
