"""``PoolTier``: the CPU tier every process on a host opens by name (``cpu_pool: "host:<name>"``).

Data-parallel replicas on one host (one engine per GPU) and Python-API processes beside them share one
pinned pool instead of one private CPU tier each: a block one process stored is a hit for every other
process of its namespace, and the host's memory holds it once. There is no server: the pool is the
shared disk directory's machinery (``IndexedTier`` over a ``DiskIndex``: one budget, one eviction order,
claims, leases, namespaces) with its payload slots in shared memory (``ShmSlots``) and its LMDB index
in ``/dev/shm`` too (place.py says where, who may open it, and when it is made and removed).

The tier is keyed and governed (``slotted=False``; ``governed=True``, as a shared disk directory): the
pool places records, evicts by the budget's rules inside the claim transaction that needs room, and
reports what it evicted (``write_ex``). ``cpu_bytes`` is the pool's size, set by its creator; every
joiner must give the same (and the same block size), else ``ConfigError``. The budget is the shared
disk directory's ``shared`` mode: one budget, each namespace's fair share ``weight / sum(weights)``.

Besides the ``Tier`` protocol it hands out the shared pages themselves, for a copier that moves bytes
between the GPU and the pool with no staging copy:

- ``lease(keys) -> PoolLease``: the records' slots and 1-D uint8 views of their bytes in ``slab``, held
  by leases (no eviction by any process reuses a leased slot) until ``release``;
- ``reserve(keys) -> PoolReservation``: claimed slots and writable views for the keys not stored yet;
  ``publish(reservation, written)`` commits the filled ones (their checksums computed then) and gives
  the rest back. Every reservation must end in ``publish``; a process that dies first leaves claims
  the next writer (within ``recover_every_s``) or opener returns to the free list.

Recovery: a process that dies mid-write leaves only a claim (no record points at its slot): returned
by pid liveness within a second. One that dies holding leases: its leases stop counting at once (an
evictor checks the holder's pid), and expire after 60 s in any case. Nothing torn is served, because a
record is committed only after its bytes are written; checksums catch scribbles on the shared pages.

Threading contract: as ``IndexedTier`` (any mover thread may read, write, lease and reserve at once);
``release``/``publish`` from any thread, once per lease or reservation; ``close()`` once, after every
caller stopped. Do not ``fork`` a process with a pool open (LMDB environments do not survive a fork).
"""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tiered_kv.errors import ConfigError, InvalidInputError, RecordError
from tiered_kv.tiers.disk.budget import ANON
from tiered_kv.tiers.disk.index import DiskIndex
from tiered_kv.tiers.disk.indexed import IndexedTier
from tiered_kv.tiers.pool.place import (PAYLOAD, SHM_DIR, Geometry, in_use, pool_lock, pool_name, prepare, remove,
                                       user_root, write_geometry)
from tiered_kv.tiers.pool.region import ShmSlots
from tiered_kv.values.layout import BlockLayout
from tiered_kv.values.record import RecordHeader

log = logging.getLogger(__name__)

#: How often a writer returns dead writers' claims to the free list (one small write txn).
RECOVER_EVERY_S = 1.0


@dataclass
class PoolLease:
    """Records held for a reader. ``slots[i]`` is ``keys[i]``'s row in ``PoolTier.slab`` and ``views[i]`` its
    bytes there (``-1`` / None: a miss). The bytes stay put until ``PoolTier.release`` (or the ``with``
    block ends); do not use the views after that."""

    keys: list[bytes]
    slots: list[int]
    views: list[torch.Tensor | None]
    lease_keys: list[bytes] = field(repr=False)
    tier: "PoolTier" = field(repr=False)
    released: bool = False

    @property
    def hits(self) -> list[bool]:
        """Per key: held (its view is valid)."""
        return [v is not None for v in self.views]

    def __enter__(self) -> "PoolLease":
        return self

    def __exit__(self, *exc) -> None:
        self.tier.release(self)


@dataclass
class PoolReservation:
    """Slots claimed for a writer. ``views[i]`` is the writable row for ``keys[i]`` (None: no slot: already stored
    when ``ok[i]``, else refused: another namespace's key or no room). ``evicted`` are the keys whose records
    the pool dropped to make room."""

    keys: list[bytes]
    ok: list[bool]
    slots: list[int]
    views: list[torch.Tensor | None]
    evicted: list[bytes]
    published: bool = False


class PoolTier(IndexedTier):
    """A host pool named by ``spec`` (``"host:<name>"``), joined or made with ``capacity_bytes`` of blocks.

    ``owner`` is this opener's namespace prefix (whose records it reads, lists and writes), ``weight`` its
    fair-share weight in the pool's one budget, ``pin`` as for the CPU tier (None: pin when CUDA is present),
    ``shm_dir`` where the user's pools live (``/dev/shm``; tests may point elsewhere).
    """

    name = "cpu"

    def __init__(self, layout: BlockLayout, spec: str, capacity_bytes: int, owner: bytes = ANON, weight: int = 1,
                 pin: bool | None = None, shm_dir: str | os.PathLike = SHM_DIR) -> None:
        name = pool_name(spec)
        slots = capacity_bytes // layout.nbytes
        if slots == 0:
            raise ConfigError(f"cpu_pool {spec}: cpu_bytes={capacity_bytes} is smaller than one block "
                              f"({layout.nbytes} bytes); the pool's size is cpu_bytes of whoever creates it")
        geo = Geometry(layout.nbytes, slots)
        super().__init__(layout, slots, "cpu pool", spec, owner, evicts=True, recover_every_s=RECOVER_EVERY_S)
        self.spec = spec
        self.root = user_root(shm_dir)
        with pool_lock(self.root):
            self.path, create = prepare(self.root, name, geo)
            self.created = create
            try:
                self.slots = ShmSlots(self.path / PAYLOAD, geo, create, pin, self.where)
                try:
                    self.index = DiskIndex(self.path / "index", geo.slot_bytes, slots, owner=owner, budget="shared",
                                           weight=weight, label="cpu pool")
                except BaseException:
                    self.slots.close()
                    raise
            except BaseException:
                if create:
                    remove(self.path, "making it failed")
                raise
            if create:
                write_geometry(self.path, geo)
        self.index.recover_claims()
        log.info("cpu pool %s: %s %s (%d blocks of %d bytes)", spec, "made" if create else "joined", self.path,
                 slots, layout.nbytes)

    # ------------------------------------------------------------------ the shared pages
    @property
    def slab(self) -> torch.Tensor:
        """The whole pool as a ``(capacity, block_nbytes)`` uint8 tensor over the shared pages: rows are the
        slots ``lease``/``reserve`` name. Touch only rows you hold a lease or reservation on."""
        return self.slots.slab

    def lease(self, keys: Sequence[bytes], verify: bool = True) -> PoolLease:
        """Hold the records of ``keys`` (one write txn) and hand out their slots and bytes, no copy.

        ``verify`` checks each payload against its checksum first (a CPU pass over the bytes); a record that
        fails is dropped and is a miss. A key of another namespace, layout or none at all is a miss.
        """
        self._check_open()
        raws, lease_keys = self.index.lease(keys)
        n = len(keys)
        slots, views = [-1] * n, [None] * n
        for i, (key, raw) in enumerate(zip(keys, raws)):
            hdr = None if raw is None else self._leased_header(key, raw, verify)
            if hdr is not None:
                slots[i], views[i] = hdr.slot, self.slots.view(hdr.slot, hdr.raw_len)
        return PoolLease(list(keys), slots, views, lease_keys, self)

    def _leased_header(self, key: bytes, raw: bytes, verify: bool) -> RecordHeader | None:
        try:
            hdr = self.header(key, raw)
            if hdr is not None and verify and not self.slots.verify(hdr):
                raise RecordError("payload checksum mismatch")
            return hdr
        except RecordError as exc:
            self._drop_damaged(key, raw, exc)
            return None

    def release(self, lease: PoolLease, used: Sequence[bytes] | None = None) -> None:
        """End ``lease`` (idempotent). ``used``: the keys actually read, which move to the young end of the
        eviction order (default: every hit)."""
        if lease.released:
            return
        lease.released = True
        read = [k for k, v in zip(lease.keys, lease.views) if v is not None] if used is None else list(used)
        self.index.unlease(lease.lease_keys, read)

    def reserve(self, keys: Sequence[bytes]) -> PoolReservation:
        """Claim a slot for each of ``keys`` not stored yet (one write txn, evicting by the budget's rules) and hand
        out writable views of them. End it with ``publish``."""
        ok, fresh, claimed, evicted = self._claim(keys)
        n = len(keys)
        slots, views = [-1] * n, [None] * n
        for i, slot in zip(fresh, claimed):
            slots[i], views[i] = slot, self.slots.view(slot, self.block_nbytes)
        return PoolReservation(list(keys), ok, slots, views, evicted)

    def publish(self, res: PoolReservation, written: Sequence[bool] | None = None) -> list[bool]:
        """Commit the reserved rows the caller filled (``written[i]``; default all) as records, in one write txn,
        and give the other slots back. Returns per key whether the pool holds it now. Once per reservation."""
        if res.published:
            raise InvalidInputError("PoolTier.publish: this reservation was published already; reserve again")
        res.published = True
        fp = self.layout.fingerprint
        items = [(i, s) for i, s in enumerate(res.slots) if s >= 0]
        headers = {i: self.slots.header_of(s, self.block_nbytes, fp) if written is None or written[i] else None
                   for i, s in items}
        return self._commit(res.keys, list(res.ok), items, headers)

    # ------------------------------------------------------------------ state
    @property
    def pinned_fraction(self) -> float:
        """Share of this process's mapping already page-locked (1.0 when no pinning is wanted or possible)."""
        return self.slots.pin.fraction

    def wait_pinned(self, timeout: float | None = None) -> bool:
        """Block until this process's mapping is pinned; True if it is."""
        return self.slots.pin.wait(timeout)

    def describe(self) -> dict:
        """Adds the pool's name and path, the pinned fraction and the processes using it."""
        d = super().describe()
        d.update(pool=self.spec, path=str(self.path), pinned_fraction=round(self.pinned_fraction, 3))
        return d

    def close(self) -> None:
        """Unmap and close the index; the last process to close removes the pool (its memory goes back). Idempotent."""
        if self._closed:
            return
        super().close()
        with pool_lock(self.root):
            if not in_use(self.path):
                remove(self.path, "its last user closed it")
