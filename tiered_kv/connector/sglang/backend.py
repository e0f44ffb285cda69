"""SGLang HiCache storage backend: ``TieredHiCacheStorage``, a thin adapter over ``TieredStore``.

Loaded by SGLang's ``dynamic`` storage backend, no patch to SGLang::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name":"tiered_kv","module_path":"tiered_kv.connector.sglang",
      "class_name":"TieredHiCacheStorage","interface_v1":1,"disk_path":"/nvme/kv","disk_bytes":"1TiB"}'

Our store is L3 behind SGLang's host pool (L2). One SGLang page is one block, with the
bytes of ``get_data_page(i, flat=True)`` (see ``sglang_pages``). SGLang's page keys are
SHA-256 chain hashes that carry no model, dtype, layout or rank, so each one is re-keyed
under a ``Namespace`` of model + block layout (shape, dtype, SGLang layout, page size)
+ tenant salt + MHA TP rank (+ PP/CP rank when used). MLA pages are the same on every TP
rank: their keys carry no TP rank, the writer rank stores them and every rank reads them
(reader ranks pick up the writer's new records from the shared disk directory).

Main path (``interface_v1``): ``batch_exists`` answers from the store's in-memory index;
``batch_set_v1`` / ``batch_get_v1`` move pages between the host pool and the store with
one batched copy (none for consecutive contiguous pages). The legacy ``get/set/batch_*``
calls are correct but copy through a staging tensor. Batch calls never raise into SGLang:
a failure is ``False``/0/``None`` plus a counter in ``stats()``.

Threading contract: SGLang calls ``batch_exists`` on its prefetch thread, ``batch_get*``
on its prefetch IO thread and ``batch_set*`` on its backup thread, all at once; every
method here is safe for that (``TieredStore`` is thread-safe, our counters are locked).
``register_mem_pool_host`` runs once before any of them; ``clear`` and ``close`` run when
SGLang has no storage operation in flight.
"""
from __future__ import annotations

import logging
import shutil
import threading
import time
from collections import Counter
from pathlib import Path

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.pool_host.base import HostKVCache

from tiered_kv.store.config import REMOTE_KEYS, StoreConfig
from tiered_kv.store.metrics import make_registry, serve
from tiered_kv.errors import ConfigError, InvalidInputError, StoreClosedError
from tiered_kv.values.keys import Namespace
from tiered_kv.planner.radix import RadixIndex
from tiered_kv.store.tiered_store import TieredStore
from tiered_kv.connector.sglang.config import SGLangBackendConfig, Scope, scope_from
from tiered_kv.connector.sglang.gate import MEMORY_TIERS, PageGate
from tiered_kv.connector.sglang.page_io import read_pages, write_pages
from tiered_kv.connector.sglang.pages import HostPages
from tiered_kv.connector.sglang.stats import BackendCounters

log = logging.getLogger(__name__)


class TieredHiCacheStorage(HiCacheStorage):
    """SGLang ``HiCacheStorage`` over a ``TieredStore`` (legacy + zero-copy v1 API)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        """Validate our extra-config keys (ConfigError names a bad one).

        The store opens in ``register_mem_pool_host``, once the page layout is known.
        """
        self.storage_config = storage_config
        self.options = SGLangBackendConfig.from_extra_config(storage_config.extra_config)
        self.scope: Scope = scope_from(storage_config, self.options.model)
        self.mem_pool_host: HostKVCache | None = None
        self.pages: HostPages | None = None
        self.store: TieredStore | None = None
        self.namespace: Namespace | None = None
        self.disk_dir: Path | None = None
        self.counters = BackendCounters()
        self.gate: PageGate | None = None
        self._gated = False  # True once the store has a tier slower than memory (disk, remote)
        self._radix = RadixIndex(1, max(1, self.options.radix_pages))
        self._radix_lock = threading.Lock()
        self._refresh_lock = threading.Lock()
        self._last_refresh = 0.0
        if self.options.metrics_port is not None:
            self._serve_metrics(self.options.metrics_port + self.scope.metrics_offset())

    def _serve_metrics(self, port: int) -> None:
        """Prometheus metrics (``tiered_kv.store.metrics``, store label ``sglang``) on 127.0.0.1:``port`` for the
        backend's lifetime; a port in use is logged, not fatal (the engine runs without this rank's metrics)."""
        try:
            serve(make_registry(self.metrics_stats, "sglang"), port)
        except OSError as exc:
            log.warning("tiered_kv SGLang backend: cannot serve metrics on 127.0.0.1:%d (%s); set metrics_port to a "
                        "free range of ports (one per TP rank)", port, exc)
            return
        log.info("tiered_kv SGLang backend: Prometheus metrics on 127.0.0.1:%d", port)

    # ------------------------------------------------------------------ setup
    def register_mem_pool_host(self, mem_pool_host: HostKVCache) -> None:
        """Derive the block layout from SGLang's host pool and open the store (raises ConfigError on bad setup)."""
        if not isinstance(mem_pool_host, HostKVCache):
            raise ConfigError(f"tiered_kv needs an SGLang HostKVCache host pool, got {type(mem_pool_host).__name__}")
        super().register_mem_pool_host(mem_pool_host)
        self.close()  # a re-registration (SGLang re-attach, our clear) reopens the store
        pages = HostPages(mem_pool_host, self.scope.is_mla)
        o = self.options
        extras = {k: str(v) for k, v in self.scope.extras().items()}
        probe = Namespace(self.scope.model, pages.layout.fingerprint, o.tenant_salt, tuple(sorted(extras.items())))
        disk_dir = None
        if o.disk_path is not None:
            disk_dir = Path(o.disk_path) / (self.scope.shared_dir_name() if o.disk_budget == "shared"
                                            else self.scope.dir_name(pages.layout.tag, probe.prefix.hex()))
        cfg = StoreConfig.from_dict({
            "block_shape": list(pages.page_shape), "dtype": pages.layout.dtype, "page_size": pages.page_size,
            "layout_tag": pages.layout.tag, "model": self.scope.model, "tenant_salt": o.tenant_salt,
            "gpu_bytes": 0, "cpu_bytes": o.cpu_bytes, "pin_memory": False,
            "cpu_pool": o.cpu_pool, "cpu_pool_weight": o.cpu_pool_weight,  # one CPU tier for the host's replicas
            "disk_path": None if disk_dir is None else str(disk_dir), "disk_bytes": o.disk_bytes,
            "disk_budget": o.disk_budget, "disk_weight": o.disk_weight,
            "compression": o.compression, "disk_sync": o.disk_sync, "disk_workers": o.disk_workers,
            "eviction": o.eviction, "write_policy": "write_through", "promote_on_hit": True,
            "namespace_extra": extras,
            **{k: getattr(o, k) for k in REMOTE_KEYS},  # the Redis Cluster shared by the fleet, if any
            # one writer per directory: a reader rank never writes or deletes there (damaged records aside)
            "disk_role": "reader" if self.scope.is_mla and not self.scope.is_writer else "writer",
        })
        store = TieredStore(cfg)
        self.namespace = store.namespace
        if self.namespace.prefix != probe.prefix:  # the directory name must name exactly these keys
            store.close()
            raise ConfigError(f"store namespace {self.namespace} differs from the one the disk directory "
                              f"{disk_dir} was named for ({probe}); this is a tiered_kv bug, please report it")
        self.pages, self.store, self.disk_dir = pages, store, disk_dir
        tiers = [t.name for t in store.tiers]
        self._gated = any(t not in MEMORY_TIERS for t in tiers)
        if self.gate is None or self.gate.page_nbytes != pages.page_nbytes:  # keep the estimates on re-attach
            self.gate = PageGate.for_tiers(o, tiers, pages.page_size, pages.page_nbytes)
        store.on_write(self.gate.hint_write)  # the slow tiers' writes bound their guessed read rates
        log.info("tiered_kv SGLang backend: %s, %d B/page, %s, tiers %s, %d pages held",
                 pages.layout.tag, pages.page_nbytes, "writer" if self.scope.is_writer else "reader",
                 [t.name for t in store.tiers], store.stats()["resident_blocks"])

    def _ready(self) -> tuple[TieredStore, HostPages]:
        if self.store is None or self.pages is None:
            raise StoreClosedError("no host pool registered (or backend closed)")
        return self.store, self.pages

    def _keys(self, hashes: list[str]) -> list[bytes]:
        ns = self.namespace
        if ns is None:
            raise StoreClosedError("no host pool registered")
        return [ns.key(_hash_bytes(h)) for h in hashes]

    # ------------------------------------------------------------------ queries
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Number of leading ``keys`` worth loading: held, and (``gate``) of the tiers whose pages load faster than
        SGLang recomputes them. SGLang loads that many and recomputes the rest (``gate.py``).

        From the index only (no I/O). 0 on any failure.
        """
        try:
            store, _ = self._ready()
            ks = self._chain_keys(keys, extra_info)
            hits = store.lookup(ks)
            if hits < len(ks) and self._adopt_if_reader(ks[hits:]):
                hits = store.lookup(ks)
            if hits and self._gated:
                hits = self.gate.worth_loading(store.locate(ks[:hits]), _context_pages(extra_info))
            self.counters.add(exists_calls=1, exists_pages=len(ks), exists_hits=hits)
            if hits and self.options.cpu_bytes and self.options.disk_path is not None:
                store.prefetch(ks[:hits], to=0)  # warm the CPU tier while SGLang allocates host slots
            return hits
        except Exception as exc:  # never raise into SGLang's prefetch thread
            self.counters.fail("batch_exists", exc)
            return 0

    def exists(self, key: str) -> bool:
        """Whether one page is held."""
        return self.batch_exists([key]) == 1

    def _chain_keys(self, hashes: list[str], extra_info: HiCacheStorageExtraInfo | None) -> list[bytes]:
        """Store keys for ``hashes``; with SGLang's prefix keys, the radix index serves the chain it already knows."""
        prefix = extra_info.prefix_keys if extra_info is not None else None
        if prefix is None or self.options.radix_pages == 0:
            return self._keys(hashes)
        with self._radix_lock:
            known = self._radix.match(list(prefix) + list(hashes))[len(prefix):]
        self.counters.add(radix_pages=len(known))
        return known + self._keys(hashes[len(known):])

    def _remember_chain(self, hashes: list[str], ks: list[bytes], ok: list[bool],
                        extra_info: HiCacheStorageExtraInfo | None) -> None:
        """Record the leading stored/landed run of ``prefix_keys + hashes`` in the radix index (after a restart too)."""
        prefix = extra_info.prefix_keys if extra_info is not None else None
        if prefix is None or self.options.radix_pages == 0:
            return
        n = next((i for i, good in enumerate(ok) if not good), len(ok))
        if n == 0:
            return
        with self._radix_lock:
            prefix_ks = self._radix.match(list(prefix))
            if len(prefix_ks) < len(prefix):
                prefix_ks = self._keys(list(prefix))
            self._radix.insert(list(prefix) + list(hashes[:n]), prefix_ks + ks[:n])

    # ------------------------------------------------------------------ zero-copy v1
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Read pages straight into the host pool at ``host_indices``; leading Trues are the pages landed."""
        n = len(keys)
        try:
            store, pages = self._ready()
            t0 = time.perf_counter()
            ks = self._chain_keys(keys, extra_info)
            page_ids = pages.page_ids(host_indices, n)
            tiers = self._slow_tiers(store, ks)
            got, zero_copy = read_pages(store, pages, ks, page_ids, self.options.chunk_pages)
            if got < n and self._adopt_if_reader(ks[got:]):
                more, _ = read_pages(store, pages, ks[got:], page_ids[got:], self.options.chunk_pages)
                got += more
            seconds = time.perf_counter() - t0
            self._observe(tiers, got, seconds)
            self.counters.transfer("get", got, n - got, got * pages.page_nbytes, seconds, zero_copy)
            result = [True] * got + [False] * (n - got)
            self._remember_chain(keys, ks, result, extra_info)
            return result
        except Exception as exc:  # never raise into SGLang's prefetch IO thread
            self.counters.fail("batch_get_v1", exc)
            return [False] * n

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store pages from the host pool at ``host_indices``; pages already held are not copied again."""
        n = len(keys)
        try:
            store, pages = self._ready()
            if not self.scope.is_writer:
                self.counters.add(set_skipped_reader=n)  # MLA: the writer rank stores the same bytes
                return [True] * n
            t0 = time.perf_counter()
            ks = self._chain_keys(keys, extra_info)
            page_ids = pages.page_ids(host_indices, n)
            held = store.contains(ks)
            todo = [i for i in range(n) if not held[i]]
            ok = list(held)
            zero_copy = False
            if todo:
                res, zero_copy = write_pages(store, pages, [ks[i] for i in todo], [page_ids[i] for i in todo],
                                             self.options.chunk_pages)
                for i, good in zip(todo, res):
                    ok[i] = good
            stored = len(todo) - ok.count(False)
            self.counters.transfer("set", stored, ok.count(False), stored * pages.page_nbytes,
                                   time.perf_counter() - t0, zero_copy, deduplicated=n - len(todo))
            self._remember_chain(keys, ks, ok, extra_info)
            return ok
        except Exception as exc:  # never raise into SGLang's backup thread
            self.counters.fail("batch_set_v1", exc)
            return [False] * n

    # ------------------------------------------------------------------ legacy API
    def batch_get(self, keys: list[str], target_locations: list[torch.Tensor] | None = None,
                  target_sizes: list[int] | None = None) -> list[torch.Tensor | None]:
        """Legacy read: page i is copied into ``target_locations[i]`` (or a new tensor); None from the first miss on."""
        n = len(keys)
        out: list[torch.Tensor | None] = [None] * n
        try:
            store, pages = self._ready()
            t0 = time.perf_counter()
            staging = torch.empty((n, *pages.page_shape), dtype=pages.torch_dtype)
            tiers = self._slow_tiers(store, self._keys(keys))
            got = store.get(self._keys(keys), staging).wait()
            self._observe(tiers, got, time.perf_counter() - t0)
            if got == 0 and n and self._adopt_if_reader(self._keys(keys)):
                got = store.get(self._keys(keys), staging).wait()
            for i in range(got):
                if target_locations is None or target_locations[i] is None:
                    out[i] = staging[i].flatten()
                    continue
                dst = pages.as_block(target_locations[i])
                if dst is None:  # a wrong-size target is a miss, never an overrun
                    self.counters.add(size_mismatch=1)
                    break
                dst.copy_(staging[i])
                out[i] = target_locations[i]
            landed = sum(x is not None for x in out)
            self.counters.transfer("get", landed, n - landed, landed * pages.page_nbytes,
                                   time.perf_counter() - t0, False)
        except Exception as exc:
            self.counters.fail("batch_get", exc)
        return out

    def get(self, key: str, target_location: torch.Tensor | None = None,
            target_sizes: int | None = None) -> torch.Tensor | None:
        """Legacy single-page read; None on a miss."""
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_set(self, keys: list[str], values: list[torch.Tensor] | None = None,
                  target_locations: list[torch.Tensor] | None = None, target_sizes: list[int] | None = None) -> bool:
        """Legacy write of flat page tensors; True only if every page is stored."""
        n = len(keys)
        try:
            store, pages = self._ready()
            if not self.scope.is_writer:
                self.counters.add(set_skipped_reader=n)
                return True
            if values is None or len(values) != n:
                raise InvalidInputError(f"batch_set got {0 if values is None else len(values)} values for {n} keys")
            t0 = time.perf_counter()
            blocks = [pages.as_block(v) for v in values]
            bad = [i for i, b in enumerate(blocks) if b is None]
            if bad:
                self.counters.add(size_mismatch=len(bad))
                raise InvalidInputError(f"value for key {keys[bad[0]]!r} has {values[bad[0]].numel()} elements of "
                                        f"{values[bad[0]].element_size()} B; a page is {pages.page_nbytes} B")
            ks = self._keys(keys)
            held = store.contains(ks)
            todo = [i for i in range(n) if not held[i]]
            ok = list(held)
            if todo:
                stacked = torch.stack([blocks[i] for i in todo])
                for i, good in zip(todo, store.put([ks[i] for i in todo], stacked).wait()):
                    ok[i] = good
            stored = len(todo) - ok.count(False)
            self.counters.transfer("set", stored, ok.count(False), stored * pages.page_nbytes,
                                   time.perf_counter() - t0, False, deduplicated=n - len(todo))
            return all(ok)
        except Exception as exc:
            self.counters.fail("batch_set", exc)
            return False

    def set(self, key: str, value: torch.Tensor | None = None, target_location: torch.Tensor | None = None,
            target_sizes: int | None = None) -> bool:
        """Legacy single-page write."""
        return self.batch_set([key], None if value is None else [value])

    # ------------------------------------------------------------------ load gate
    def _slow_tiers(self, store: TieredStore, ks: list[bytes]) -> list[str | None]:
        """Per key: the fastest tier holding it now. Empty when the store has no slow tier (nothing to measure)."""
        if not self._gated:
            return []
        return store.locate(ks)

    def _observe(self, tiers: list[str | None], got: int, seconds: float) -> None:
        """Feed the gate the read rates of the slow tiers among the ``got`` pages that landed."""
        slow = Counter(t for t in tiers[:got] if t is not None and t not in MEMORY_TIERS)
        if slow and self.gate is not None:
            self.gate.observe_read(slow, seconds)

    # ------------------------------------------------------------------ reader ranks
    def _adopt_if_reader(self, keys: list[bytes]) -> bool:
        """MLA reader ranks: adopt those of ``keys`` the writer rank has committed since we looked. True if any."""
        if self.scope.is_writer or not self.scope.is_mla or self.store is None or not keys:
            return False
        now = time.monotonic()
        with self._refresh_lock:
            if now - self._last_refresh < self.options.reader_refresh_s:
                return False
            self._last_refresh = now
        added = self.store.refresh(keys)
        self.counters.add(reader_probes=1, reader_adopted=added)
        return added > 0

    # ------------------------------------------------------------------ admin
    def clear(self) -> bool:
        """Drop every page of this backend's namespace (SGLang's ``/hicache/storage-backend/clear``)."""
        try:
            self._ready()
            if not self.scope.is_writer:
                return True  # the writer rank clears the shared directory
            pool = self.mem_pool_host
            self.close()
            if self.disk_dir is not None and self.disk_dir.is_dir():
                shutil.rmtree(self.disk_dir)
            with self._radix_lock:
                self._radix = RadixIndex(1, max(1, self.options.radix_pages))
            self.register_mem_pool_host(pool)
            self.counters.add(clears=1)
            return True
        except Exception as exc:
            self.counters.fail("clear", exc)
            return False

    def get_stats(self):
        """SGLang ``StorageMetrics`` for the pages moved since the last call (lists reset on each call)."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        m = StorageMetrics()
        (m.prefetch_pgs, m.prefetch_bandwidth, m.backup_pgs, m.backup_bandwidth) = self.counters.drain_windows()
        return m

    def metrics_stats(self) -> dict:
        """The store's ``stats()`` plus the load gate's report, for Prometheus ({} until a host pool is registered).
        On the scraping thread: the store and the gate are thread-safe."""
        store, gate = self.store, self.gate
        if store is None:
            return {}
        out = store.stats()
        out["gate"] = gate.report() if gate is not None and self._gated else None
        return out

    def stats(self) -> dict:
        """Our counters plus the store's ``stats()`` (for tests, logs and the CLI)."""
        out = {"backend": self.counters.snapshot(), "scope": self.scope.__dict__.copy(),
               "gate": None if self.gate is None else self.gate.snapshot(),
               "layout": None if self.pages is None else self.pages.layout.describe(),
               "disk_dir": None if self.disk_dir is None else str(self.disk_dir)}
        if self.store is not None:
            out["store"] = self.store.stats()
        return out

    def close(self) -> None:
        """Finish queued writes and close the store. Idempotent."""
        store, self.store = self.store, None
        if store is not None:
            store.close()


def _context_pages(extra_info: HiCacheStorageExtraInfo | None) -> int:
    """Pages before a query: SGLang's ``prefix_keys`` (with ``hicache_storage_pass_prefix_keys``), else 0."""
    prefix = extra_info.prefix_keys if extra_info is not None else None
    return 0 if prefix is None else len(prefix)


def _hash_bytes(h: str) -> bytes:
    """SGLang page hashes are 64 hex chars (32 raw bytes); other keys (EAGLE bigrams, tests) are tagged UTF-8."""
    if not isinstance(h, str):
        raise InvalidInputError(f"page key must be a str, got {type(h).__name__} {h!r:.60}")
    if len(h) == 64:
        try:
            return bytes.fromhex(h)
        except ValueError:
            pass
    return b"s:" + h.encode()
