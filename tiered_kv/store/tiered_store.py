"""TieredStore: the Python API over one tier chain, with planner, tiers and movers in one process.

``put / get / prefetch`` return a ``Handle`` at once; ``handle.wait()`` (or ``await handle``)
gives the result. The planner (``TierChain``) runs under one lock and only does dictionary
work; bytes move on the movers' threads, one mover per tier edge (plus the front edge
between the caller and the fastest tier): ``movers.EdgeMovers`` routes each job to its edge
and ``movers.JobExecutor`` runs it against the tiers. This module keeps the planner's side:
it starts calls, applies each ``Completion`` to the planner under the lock, submits the jobs
that unblocks, and resolves handles.

Buffers: ``put`` reads the caller's ``blocks`` and ``get`` writes the caller's ``out`` on a
mover thread; keep them alive and unchanged until the handle is done (as with any
non-blocking copy).

Shared media: a disk directory and a host pool (``cpu_pool``, the CPU tier in shared memory) are
``IndexedTier``s other processes and namespaces use at once. Each is *governed* (the medium keeps one
budget and one eviction order for every process and namespace on it; the planner learns of evictions
through ``Completion.evicted`` or a read that finds a record gone; a block landing in a governed tier
with a tier below is copied down at once). Keys the planner does not know are looked up in each shared
medium, fastest first (another process of this namespace may have written them), and adopted; a store
adopts its namespace's blocks in each when it opens. A key that carries another namespace's prefix (one
registered in a shared medium) is refused with ``InvalidInputError``; a record another namespace owns is a
miss whatever its key.
``SharedMedium`` (``shared_dir.py``) keeps the planner and each shared medium agreeing.

Threading contract: every public method may be called from any thread, concurrently.
Handles may be waited on from any thread or awaited from any event loop.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence

import torch

from tiered_kv.planner.chain import TierChain, TierSpec
from tiered_kv.store.config import StoreConfig
from tiered_kv.store.handle import Handle  # also imported from here by callers
from tiered_kv.errors import DamagedIndexError, InvalidInputError, StoreClosedError, TransferTimeout
from tiered_kv.values.keys import Namespace, chain_keys, check_key
from tiered_kv.values.layout import BlockLayout
from tiered_kv.store.metrics import make_registry, serve
from tiered_kv.store.shared_dir import SharedMedium
from tiered_kv.planner.policy import PlacementPolicy
from tiered_kv.planner.radix import RadixIndex
from tiered_kv.tiers.base import Tier
from tiered_kv.tiers.cpu import CpuTier
from tiered_kv.tiers.disk import DiskTier, quarantine
from tiered_kv.tiers.disk.indexed import IndexedTier
from tiered_kv.tiers.gpu import GpuTier
from tiered_kv.tiers.pool import PoolTier
from tiered_kv.tiers.remote import PresenceFeed, RemoteTier
from tiered_kv.values.jobs import EXT, Completion, JobKind, TransferJob
from tiered_kv.movers.edges import EdgeMovers
from tiered_kv.movers.executor import JobExecutor
from tiered_kv.movers.mover import close_at_exit

log = logging.getLogger(__name__)


class TieredStore:
    """A tiered block store: GPU -> pinned CPU -> disk. Use as a context manager."""

    def __init__(self, config: StoreConfig | dict) -> None:
        if isinstance(config, dict):
            config = StoreConfig.from_dict(config)
        self.config = config
        self.layout = BlockLayout(config.block_shape, config.dtype, config.layout_tag)
        self.namespace = Namespace(config.model, self.layout.fingerprint, config.tenant_salt,
                                   tuple(sorted(config.namespace_extra.items())))
        self._torch_dtype = self.layout.torch_dtype()
        self._closed = False
        # _edge_workers[i]: mover threads between tier i and tier i+1; disk_quarantined: set when the disk
        # directory was damaged and moved aside
        self.tiers, self._edge_workers, self.disk_quarantined = open_tiers(config, self.layout, self.namespace.prefix)
        self.disk: DiskTier | None = None
        self._shared: list[SharedMedium] = []  # the shared media (disk directory, host pool), fastest first
        remote = self._remote = next((i for i, t in enumerate(self.tiers) if isinstance(t, RemoteTier)), None)
        copy_to = (remote,) if remote and config.remote_write == "through" else ()
        self.chain = TierChain([TierSpec(t.name, t.capacity, t.slotted, t.governed) for t in self.tiers],
                               config.eviction, PlacementPolicy(config.write_policy, config.promote_on_hit,
                                                                copy_to=copy_to))
        self.radix = RadixIndex(config.page_size)
        self._lock = threading.RLock()
        self._handles: dict[int, Handle] = {}
        self._buffers: dict[int, torch.Tensor] = {}
        self._ids = itertools.count(1)
        self._bytes = {t.name: [0, 0] for t in self.tiers}  # bytes in, bytes out per tier
        self._write_listeners: list = []  # on_write's functions, called on the movers' threads
        self._executor = JobExecutor(self.tiers, self._buffers)
        self._gpu_dev = self._executor.cuda_device
        self.movers = EdgeMovers([t.name for t in self.tiers], self._edge_workers, self._executor.execute,
                                 self._on_done)
        self._metrics_server = None
        if config.metrics_port:
            self._metrics_server = serve(make_registry(self.stats), config.metrics_port)
        self.disk = next((t for t in self.tiers if isinstance(t, DiskTier)), None)
        self.pool: PoolTier | None = next((t for t in self.tiers if isinstance(t, PoolTier)), None)
        for i, t in enumerate(self.tiers):
            if isinstance(t, IndexedTier):  # other processes use it: hook it to the planner, adopt its blocks
                shared = SharedMedium(t, i, self.chain, self._lock, self._submit, self.namespace.prefix)
                self._shared.append(shared)
                shared.join()
        # the remote tier's presence feed: what the fleet stores, adopted as hints before each lookup
        self._feed: PresenceFeed | None = None if remote is None else self.tiers[remote].feed()
        # a store its owner never closed is closed before the interpreter kills our daemon threads (a thread
        # killed inside a torch copy aborts the process at exit)
        close_at_exit(self, "TieredStore")

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ validation
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("this TieredStore is closed; open a new one")

    def _check_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        if isinstance(keys, (bytes, bytearray, str)) or not isinstance(keys, Sequence):
            raise InvalidInputError(f"keys must be a sequence of bytes keys, got {type(keys).__name__}")
        keys = [check_key(k, f"keys[{i}]") for i, k in enumerate(keys)]
        for shared in self._shared:
            shared.check_namespace(keys)
        return keys

    def key(self, name: bytes) -> bytes:
        """This store's namespaced key for ``name`` (any bytes: an engine's block hash, a page id)."""
        return self.namespace.key(name)

    def _discover(self, keys: list[bytes]) -> int:
        """Adopt keys the planner does not know but a shared medium holds for this namespace (written by another
        process since this one opened it), fastest medium first (``SharedMedium.discover``)."""
        if not keys:
            return 0
        return sum(shared.discover(keys) for shared in self._shared)

    def _forget_evicted(self, keys: list[bytes]) -> None:
        """Before a read: forget the copies of ``keys`` that other processes evicted from a shared medium with a
        tier below it (a host pool above a disk), so the read goes to the copy below instead of missing. One
        read txn per such medium; an eviction between this and the read's lease is still a plain miss."""
        for shared in self._shared:
            t = shared.tier
            if not shared.medium.governed or t + 1 == len(self.tiers):
                continue  # no evictions by others, or nothing below (a record gone is a miss either way)
            with self._lock:
                mine = [k for k, w in zip(keys, self.chain.locate(keys)) if w == t]
            if not mine:
                continue
            gone = [k for k, held in zip(mine, shared.medium.has(mine)) if not held]
            if gone:
                with self._lock:
                    jobs = self.chain.forget(t, gone)
                self._submit(jobs)

    def _check_buffer(self, name: str, buf: torch.Tensor, n: int) -> torch.Tensor:
        if not isinstance(buf, torch.Tensor):
            raise InvalidInputError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
        if buf.dtype != self._torch_dtype:
            raise InvalidInputError(f"{name} has dtype {buf.dtype}, the store holds {self._torch_dtype}; "
                                    f"convert with .to({self._torch_dtype})")
        want = (n, *self.layout.shape)
        if tuple(buf.shape) != want:
            raise InvalidInputError(f"{name} has shape {tuple(buf.shape)}; expected {want} "
                                    f"(one block of {list(self.layout.shape)} per key)")
        if buf.device.type != "cpu" and buf.device != self._gpu_dev:
            raise InvalidInputError(f"{name} is on {buf.device}; use a CPU tensor"
                                    + (f" or one on {self._gpu_dev}" if self._gpu_dev else ""))
        if n == 0:
            return torch.empty((0, self.layout.nbytes), dtype=torch.uint8)
        if not buf.is_contiguous():
            raise InvalidInputError(f"{name} is not contiguous; pass {name}.contiguous()")
        return buf.view(torch.uint8).reshape(n, self.layout.nbytes)

    # ------------------------------------------------------------------ public API
    def put(self, keys: Sequence[bytes], blocks: torch.Tensor) -> Handle:
        """Store ``blocks[i]`` under ``keys[i]``. ``wait()`` -> list[bool]: accepted per key.

        A key already held is accepted without copying (blocks are immutable). A full
        store evicts by policy; a key that finds no room is refused (False), never an error.
        """
        self._check_open()
        keys = self._check_keys(keys)
        rows = self._check_buffer("blocks", blocks, len(keys))
        user = Handle("put", len(keys))
        results: list[bool] = []
        # Stream large puts in chunks no larger than the put tier, so a put bigger than the
        # fastest tier cascades down instead of being refused for lack of room.
        put_tier = self.tiers[self.chain.placement.put_tier]
        chunk = max(1, len(keys) if put_tier.governed else put_tier.capacity)  # a governed tier makes its own room

        def run(start: int) -> None:
            end = min(start + chunk, len(keys))
            part = keys[start:end]

            def on_chunk(res: list[bool]) -> None:
                results.extend(res)
                if end < len(keys) and not self._closed:
                    run(end)
                else:
                    results.extend([False] * (len(keys) - len(results)))
                    user._set(results)

            h = self._start("put", part, rows[start:end], lambda hid: (self.chain.put(part, hid), None))
            h.add_done_callback(on_chunk)

        if not keys:
            user._set([])
        else:
            run(0)
        return user

    def get(self, keys: Sequence[bytes], out: torch.Tensor) -> Handle:
        """Fill ``out[:n]`` with the longest leading run of ``keys`` held. ``wait()`` -> n."""
        self._check_open()
        keys = self._check_keys(keys)
        self._sync_remote()
        rows = self._check_buffer("out", out, len(keys))
        self._discover(keys)
        self._forget_evicted(keys)
        return self._start("get", keys, rows, lambda hid: self.chain.get(keys, hid)[::-1])

    def prefetch(self, keys: Sequence[bytes], to: str | int = 0) -> Handle:
        """Move the leading run of held ``keys`` up to tier ``to`` (name or index). ``wait()`` -> count there."""
        self._check_open()
        keys = self._check_keys(keys)
        self._sync_remote()
        target = self.chain.tier_index(to)
        self._discover(keys)
        self._forget_evicted(keys)
        return self._start("prefetch", keys, None, lambda hid: self.chain.prefetch(keys, target, hid)[::-1])

    def _start(self, kind: str, keys: list[bytes], rows: torch.Tensor | None, plan) -> Handle:
        h = Handle(kind, len(keys))
        with self._lock:
            self._check_open()
            hid = next(self._ids)
            self._handles[hid] = h
            if rows is not None:
                self._buffers[hid] = rows
            jobs = plan(hid)[0]
            finished = self.chain.take_finished()
        self._submit(jobs)
        self._resolve(finished)
        return h

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is held (readable) in some tier."""
        keys = self._check_keys(keys)
        self._discover(keys)
        self._sync_remote()
        with self._lock:
            return [t is not None for t in self.chain.locate(keys)]

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Leading number of ``keys`` held."""
        keys = self._check_keys(keys)
        self._discover(keys)
        self._sync_remote()
        with self._lock:
            return self.chain.lookup(keys)

    def locate(self, keys: Sequence[bytes]) -> list[str | None]:
        """Name of the fastest tier holding each key (None if not held)."""
        keys = self._check_keys(keys)
        self._discover(keys)
        self._sync_remote()
        with self._lock:
            return [None if t is None else self.tiers[t].name for t in self.chain.locate(keys)]

    def delete(self, keys: Sequence[bytes]) -> None:
        """Drop ``keys`` from every tier (copies being read go when their reader is done)."""
        self._check_open()
        keys = self._check_keys(keys)
        with self._lock:
            jobs = self.chain.delete(keys)
        self._submit(jobs)

    def _sync_remote(self) -> None:
        """Adopt the blocks the fleet stored in the remote tier, and forget those it removed, since the last call
        (a list swap when nothing arrived: no network I/O here)."""
        feed = self._feed
        if feed is None or not feed.pending():
            return
        stored, removed = feed.take()
        with self._lock:
            if self._closed:
                return
            jobs = self.chain.adopt(self._remote, [k for k in stored if k not in self.chain.index])
            jobs += self.chain.forget(self._remote, removed)
        self._submit(jobs)

    def wait_remote_sync(self, timeout: float = 10.0) -> bool:
        """Wait until the presence feed read the fleet's stream through once (the remote tier's keys known at
        start); True if it did. Without a remote tier: True at once."""
        if self._feed is None:
            return True
        done = self._feed.caught_up.wait(timeout)
        self._sync_remote()
        return done

    def refresh(self, keys: Sequence[bytes]) -> int:
        """Adopt those of ``keys`` that another process committed to a shared medium (a disk directory, a host
        pool) since we opened it.

        For stores sharing a directory (e.g. SGLang MLA: one writer rank, every rank reads). One read
        transaction per shared medium, no payload I/O. Returns how many keys were adopted.
        """
        self._check_open()
        return self._discover(self._check_keys(keys))

    def clear(self, timeout: float = 60.0) -> None:
        """Drop every block this store holds, in every tier, and wait until it is done."""
        self._check_open()
        with self._lock:
            jobs = self.chain.delete([k for k, _ in self.chain.index.items()])
            self.radix = RadixIndex(self.config.page_size)
        self._submit(jobs)
        if not self.drain(timeout):
            raise TransferTimeout(f"clear: deletes still in flight after {timeout} s")

    # ------------------------------------------------------------------ tokens
    def keys_for_tokens(self, token_ids: Sequence[int]) -> list[bytes]:
        """Chained, namespaced keys for each full page of ``token_ids``."""
        return chain_keys(self.namespace, token_ids, self.config.page_size)

    def put_tokens(self, token_ids: Sequence[int], blocks: torch.Tensor) -> Handle:
        """``put`` the blocks of each full page of ``token_ids`` and index them for ``match_prefix``."""
        keys = self.keys_for_tokens(token_ids)
        if blocks.shape[0] != len(keys):
            raise InvalidInputError(f"{len(token_ids)} tokens make {len(keys)} full pages of "
                                    f"{self.config.page_size}, but blocks has {blocks.shape[0]} blocks")
        with self._lock:
            self.radix.insert(token_ids, keys)
        return self.put(keys, blocks)

    def match_prefix(self, token_ids: Sequence[int]) -> dict:
        """How long a prefix of ``token_ids`` is held, and where.

        Returns ``{"num_tokens", "keys", "tiers"}`` for the longest leading run of pages held
        in some tier. Uses the radix index; pages it does not know (e.g. after a restart) are
        found by hashing the tokens and asking the tiers.
        """
        self._sync_remote()
        with self._lock:
            keys = self.radix.match(token_ids)
        if len(keys) < len(token_ids) // self.config.page_size:
            keys = self.keys_for_tokens(token_ids)
        self._discover(keys)
        with self._lock:
            where = self.chain.locate(keys)
        n = next((i for i, t in enumerate(where) if t is None), len(where))
        return {"num_tokens": n * self.config.page_size, "keys": keys[:n],
                "tiers": [self.tiers[t].name for t in where[:n]]}

    # ------------------------------------------------------------------ jobs and completions
    def _submit(self, jobs: list[TransferJob]) -> None:
        self.movers.submit(jobs)

    def _on_done(self, job: TransferJob, done: Completion) -> None:
        # On a mover thread: tell on_write's listeners, apply the outcome to the planner, start what it unblocked,
        # resolve handles. The listeners go first, so that a job drain() sees finished has been reported.
        if (self._write_listeners and job.dst_tier != EXT and not job.kind.is_load and job.kind is not JobKind.DELETE
                and done.nbytes > 0 and done.seconds > 0):
            _tell(self._write_listeners, self.tiers[job.dst_tier].name, done.nbytes, done.seconds)
        with self._lock:
            if job.src_tier != EXT and job.kind is not JobKind.DELETE:
                self._bytes[self.tiers[job.src_tier].name][1] += done.nbytes
            if job.dst_tier != EXT and job.kind is not JobKind.DELETE:
                self._bytes[self.tiers[job.dst_tier].name][0] += done.nbytes
            jobs = self.chain.complete(done)
            finished = self.chain.take_finished()
        self._submit(jobs)
        self._resolve(finished)

    def _resolve(self, finished: list[tuple[int, object]]) -> None:
        for hid, result in finished:
            with self._lock:
                h = self._handles.pop(hid, None)
                self._buffers.pop(hid, None)
            if h is not None:
                h._set(result)

    # ------------------------------------------------------------------ housekeeping
    def drain(self, timeout: float = 60.0) -> bool:
        """Wait until no job is in flight (demotions, write-through copies...). True if drained."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self.chain.inflight() == 0:
                    return True
            time.sleep(0.002)
        return False

    def flush(self, timeout: float = 60.0) -> None:
        """Wait for in-flight jobs, then make the disk tier durable (fsync). See docs/reliability.md."""
        self._check_open()
        if not self.drain(timeout):
            raise TransferTimeout(f"flush: jobs still in flight after {timeout} s")
        for t in self.tiers:
            t.flush()

    def stats(self) -> dict:
        """Counters and occupancy. Invariants: lookups = hits + misses; bytes_in = bytes_out + resident_bytes.

        ``transfers``: blocks and bytes per tier edge and load-job seconds per tier (``TransferCounters``);
        ``remote``: the remote tier's error counters (None without one)."""
        with self._lock:
            c = self.chain.counters
            nb = self.layout.nbytes
            tiers = {}
            for i, t in enumerate(self.tiers):
                tc = self.chain.tier_counters[i]
                tiers[t.name] = {
                    "capacity_blocks": t.capacity, "resident_blocks": self.chain.resident(i),
                    "hits": tc.hits, "blocks_in": tc.blocks_in, "blocks_out": tc.blocks_out,
                    "bytes_in": self._bytes[t.name][0], "bytes_out": self._bytes[t.name][1],
                    "evictions": tc.evictions, "failed_transfers": tc.failed_transfers,
                    "corrupt_dropped": tc.corrupt_dropped, "vanished": tc.vanished, "refused": tc.refused,
                    "demotions_dropped": tc.demotions_dropped, "queue_depth": self.movers.depth(i),
                }
            return {
                "lookups": c.lookups, "hits": c.hits, "misses": c.misses,
                "bytes_in": c.blocks_in * nb, "bytes_out": c.blocks_out * nb,
                "resident_bytes": len(self.chain.index) * nb, "resident_blocks": len(self.chain.index),
                "puts_refused": c.puts_refused, "puts_deduplicated": c.puts_deduplicated,
                "inflight_jobs": self.chain.inflight(), "pinned": self.chain.pinned(),
                "waiting": self.chain.waiting(), "block_nbytes": nb, "tiers": tiers,
                "disk_quarantined": self.disk_quarantined, "transfers": self.chain.transfers.snapshot(nb),
                "remote": None if self._remote is None else self._remote_counters(),
            }

    def on_write(self, fn) -> None:
        """Call ``fn(tier_name, nbytes, seconds)`` for every finished job that wrote into a tier (store, demotion,
        write-through): the rate a tier has shown (``ReadRate.hint``). On a mover thread, before the job counts as
        finished (``drain`` returns after its listeners ran): keep it quick and off the store; an exception is logged
        and dropped."""
        self._write_listeners.append(fn)

    def _remote_counters(self) -> dict:
        """The remote tier's counters and its client's (``client_*``): plain ints, read without their writers'
        locks (a scrape may see one counter a job ahead of another)."""
        tier = self.tiers[self._remote]
        return {**tier.counters, **{f"client_{k}": v for k, v in tier.client.counters.items()}}

    def close(self) -> None:
        """Finish queued work, stop movers, close tiers. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.drain(timeout=60.0)
        self.movers.close()
        for t in self.tiers:
            t.close()
        if self._metrics_server is not None:
            self._metrics_server[0].shutdown()


def open_tiers(c: StoreConfig, layout: BlockLayout, owner: bytes) -> tuple[list[Tier], list[int], dict | None]:
    """Open the tiers ``c`` configures, fastest first, for blocks of ``layout`` in namespace ``owner``.

    Returns ``(tiers, edge_workers, quarantined)``: ``edge_workers[i]`` mover threads between tier i and
    i+1, and what was done with a damaged disk directory (None when there was none); the store then runs
    without the disk tier. If a tier fails to open, the ones opened before it are closed.
    """
    tiers: list[Tier] = []
    edge_workers: list[int] = []
    quarantined = None

    def add(tier: Tier, workers: int) -> None:
        """Append ``tier`` below the others; ``workers`` threads move between it and the tier above."""
        tiers.append(tier)
        if len(tiers) > 1:
            edge_workers.append(workers)

    try:
        if c.gpu_bytes:
            add(GpuTier(layout, c.gpu_bytes, c.device), 1)
        if c.cpu_bytes and c.cpu_pool is not None:
            add(PoolTier(layout, c.cpu_pool, c.cpu_bytes, owner=owner, weight=c.cpu_pool_weight, pin=c.pin_memory), 1)
        elif c.cpu_bytes:
            add(CpuTier(layout, c.cpu_bytes, c.pin_memory), 1)
        if c.disk_path is not None:
            # Several threads on the edge into disk: each waits on its own reads and writes. The directory
            # governs its budget and evicts by itself, unless a remote tier below should receive the evictions
            # (then the planner evicts and demotes, and the directory only refuses what exceeds its budget).
            try:
                disk = DiskTier(layout, c.disk_path, c.disk_bytes, c.compression, c.zstd_level, c.disk_sync,
                                writer=c.disk_role == "writer", owner=owner, budget=c.disk_budget,
                                weight=c.disk_weight, evicts=c.remote_settings() is None)
            except DamagedIndexError as exc:
                moved = quarantine(c.disk_path, exc.reason)
                quarantined = {"path": c.disk_path, "moved_to": moved, "reason": exc.reason}
                log.error("tiered_kv: DISK TIER OFF: the index of %s is damaged (%s); %s and running without the "
                          "disk tier. `tiered-kv repair %s` salvages what it can.", c.disk_path, exc.reason,
                          f"moved it to {moved}" if moved else "left it in place (see above)", moved or c.disk_path)
            else:
                add(disk, c.disk_workers)
        settings = c.remote_settings()
        if settings is not None:  # below disk (or below CPU): Redis owns its capacity
            add(RemoteTier(layout, settings, owner), c.remote_workers)
        if not tiers:  # the only tier was a damaged disk: keep serving (every get a miss, every put refused)
            add(CpuTier(layout, 0, False), 1)
    except BaseException:
        for t in tiers:
            t.close()
        raise
    return tiers, edge_workers, quarantined


def _tell(listeners: list, *args) -> None:
    """Call each of ``TieredStore.on_write``'s listeners with ``args``; one that raises is logged, the rest still run
    (a listener must not stop the movers)."""
    for fn in listeners:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001
            log.exception("on_write listener %r failed", fn)
