"""SGLang's own CPU unit tests for HiCache storage backends, adapted to run against TieredHiCacheStorage.

Sources (sgl-project/sglang, ``test/registered/unit/mem_cache/``, registered with
``register_cpu_ci``). The search index holds one stored copy of each, not pinned to the
``v0.5.23`` tag (seaweedfs: commit 2b15fd52, storage_format_tag: 1ec059ad, file_lru:
00f8203e); where they differ from the 0.5.23 wheel we follow the wheel: host pools take
buffer descriptors (``MHABufferInfo``) instead of ``device_pool=``, and
``HiCacheStorageConfig`` has no ``use_shared_cp_storage``. Adapted means: the backend
under test is ours, built through SGLang's ``dynamic`` factory; the SGLang objects
(host pools, controller page helpers, ``storage_model_name``) are SGLang's own.

``test_hicache_seaweedfs_storage.py`` (the reference's "exact harness"):
  applies  test_controller_round_trip_is_bit_exact_for_every_layout
           -> test_seaweedfs_round_trip_every_layout
  applies  test_generic_and_zero_copy_read_each_others_pages
           -> test_seaweedfs_generic_and_zero_copy_interoperate
  applies  test_prefetch_stops_at_the_first_missing_page
           -> test_seaweedfs_prefetch_stops_at_first_missing_page
           (the page is dropped with our store's delete instead of an S3 delete)
  adapted  test_zero_copy_rejects_an_object_of_the_wrong_size
           -> test_seaweedfs_foreign_page_is_not_copied_into_the_pool
           (our API cannot store a raw 8 KiB blob under a key; the foreign object is a page
           of another geometry, written into the same disk_path under the same key)
  applies  test_object_of_the_wrong_size_is_a_miss_not_an_overrun
           -> test_seaweedfs_wrong_size_target_is_a_miss
  adapted  test_mha_and_context_parallel_ranks_do_not_share_objects
           -> test_seaweedfs_mha_and_cp_ranks_do_not_share
           (values are full pages: our blocks are page-sized, a 64-byte value is refused)
  adapted  test_mla_ranks_share_objects -> test_seaweedfs_mla_ranks_share_objects (the writer
           closes before the reader opens: one process cannot open one LMDB directory twice;
           both ranks alive at once, in two processes, is tests/connector/sglang/test_backend.py's MLA test)
  adapted  test_missing_endpoint_is_refused -> test_seaweedfs_missing_location_is_refused
  n/a      test_v2_* (six tests): the v2 multi-pool API serves hybrid models (Mamba/SWA/DSA
           side pools). SGLang uses v2 only when a request carries sidecar transfers, never for
           dense MHA/MLA, and treats the base class's NotImplementedError as a miss; we do not
           implement v2 yet, so these do not apply.

``test_hicache_storage_format_tag.py``:
  applies  test_untagged_page_misses_under_the_unified_name -> test_format_tag_untagged_page_misses
  applies  test_default_pools_keep_the_model_name / test_unified_pool_tags_the_model_name
           -> test_format_tag_model_names (they test SGLang's ``storage_model_name``, which
           produces the model name our namespace uses; run as-is on the 0.5.23 wheel)
  n/a      test_logical_anchor_pool_keeps_the_model_name: tests ``LogicalHostPool`` only.

``test_hicache_file_lru_unit.py`` (HiCacheFile's LRU evictor): our eviction lives in the
store, so the behaviours are tested, not HiCacheFile's internals:
  adapted  TestCapBasedEviction (basic LRU, get touches recency, repeated set is a no-op,
           clear resets, value larger than the cap) -> test_lru_* with disk_bytes of 3 pages;
           "larger than the cap" becomes: disk_bytes below one page fails at start.
  adapted  TestScanExistingFiles -> test_lru_restart_adopts_records_oldest_first
  adapted  TestParseSize -> test_lru_size_parsing (ours raises on a bad size instead of
           silently reading it as 0, so a typo cannot turn the cache off)
  adapted  TestCPSuffix (cp disabled, distinct cp ranks, cp applies to MLA, pp) -> test_lru_rank_scopes;
           the shared-CP-storage cases need ``use_shared_cp_storage``, absent in 0.5.23: n/a.
  adapted  TestMLAOwnerGating -> test_lru_mla_owner_gating (a non-writer MLA rank stores
           nothing; it answers True because SGLang stops a node's backup on False, and the
           writer rank stores the same bytes)
  n/a      TestEnvDefaults, TestMinFreeSpaceWatermark, TestPreReservationConcurrency,
           TestMetadataCache, TestHiCacheFileMetadataIntegration, TestTrackOrTouch: they test
           HiCacheFile's env variables, statvfs watermark, reservation list, TTL metadata cache
           and file adoption. We have none of these: capacity is disk_bytes, the index is
           authoritative (no TTL), and records written by another process are adopted by MLA
           reader ranks (tested in test_backend.py).
"""
from __future__ import annotations

import pytest

from tests.connector.sglang.harness import (
    PAGE_SIZE, attached_backend, controller_stub, create_backend, extra_config, fill_random, live_op,
    mha_pool, mla_pool, page_helpers, pages_bytes,
)

torch = pytest.importorskip("torch")

from sglang.srt.managers.cache_controller import storage_model_name  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo  # noqa: E402
from sglang.srt.mem_cache.pool_host.base import HostKVCache  # noqa: E402
from sglang.srt.mem_cache.pool_host.unified import UnifiedPageEnvelopeHostPool  # noqa: E402

from tiered_kv.errors import ConfigError  # noqa: E402

NUM_PAGES = 4


def _page(pool, i):
    return pages_bytes(pool, torch.arange(NUM_PAGES * PAGE_SIZE), NUM_PAGES)[i]


def _backup_and_reload(backend, pool, drop_page=None, set_via="generic", get_via="generic"):
    """Seaweedfs harness: back up NUM_PAGES random pages, wipe the pool, prefetch them back."""
    ctrl = controller_stub(backend, pool)
    fill_random(pool, NUM_PAGES + (drop_page or 0))
    expected = [_page(pool, i) for i in range(NUM_PAGES)]
    keys = [f"{pool.layout}-{set_via}-{get_via}-{drop_page}-{i}" for i in range(NUM_PAGES)]
    host_indices = torch.arange(NUM_PAGES * PAGE_SIZE, dtype=torch.int64)
    set_page, get_page = page_helpers(set_via, get_via)
    assert set_page(ctrl, keys, host_indices)
    if drop_page is not None:
        backend.store.delete(backend._keys([keys[drop_page]]))
        backend.store.drain()
    pool.kv_buffer.zero_()
    return keys, expected, get_page(ctrl, live_op("r"), keys, host_indices)


# ---------------------------------------------------------------- test_hicache_seaweedfs_storage.py
def test_seaweedfs_round_trip_every_layout(tmp_path):
    for via in ("generic", "zero_copy"):
        for layout in ("layer_first", "page_first", "page_first_direct"):
            pool = mha_pool(layout, page_size=PAGE_SIZE)
            backend = attached_backend(extra_config(tmp_path), pool)
            _, expected, loaded = _backup_and_reload(backend, pool, set_via=via, get_via=via)
            assert loaded == NUM_PAGES
            assert all(torch.equal(_page(pool, i), expected[i]) for i in range(NUM_PAGES)), (via, layout)
            backend.close()


def test_seaweedfs_generic_and_zero_copy_interoperate(tmp_path):
    for layout in ("page_first", "page_first_direct"):
        for set_via, get_via in (("generic", "zero_copy"), ("zero_copy", "generic")):
            pool = mha_pool(layout)
            backend = attached_backend(extra_config(tmp_path), pool)
            _, expected, loaded = _backup_and_reload(backend, pool, set_via=set_via, get_via=get_via)
            assert loaded == NUM_PAGES
            assert all(torch.equal(_page(pool, i), expected[i]) for i in range(NUM_PAGES)), (layout, set_via)
            backend.close()


def test_seaweedfs_prefetch_stops_at_first_missing_page(tmp_path):
    for via in ("generic", "zero_copy"):
        pool = mha_pool("page_first")
        backend = attached_backend(extra_config(tmp_path), pool)
        keys, _, loaded = _backup_and_reload(backend, pool, drop_page=2, set_via=via, get_via=via)
        assert loaded == 2
        assert not _page(pool, 3).any()  # ours copies nothing past a miss on either path
        assert backend.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=[])) == 2
        backend.close()


def test_seaweedfs_foreign_page_is_not_copied_into_the_pool(tmp_path):
    foreign_pool = mha_pool("page_first", page_size=8)  # other geometry, same model, same directory
    foreign = attached_backend(extra_config(tmp_path), foreign_pool)
    fill_random(foreign_pool, 1)
    assert foreign.batch_set_v1(["k"], torch.arange(8)) == [True]
    pool = mha_pool("page_first")
    pool.kv_buffer.zero_()
    backend = attached_backend(extra_config(tmp_path), pool)
    assert backend.batch_get_v1(["k"], torch.arange(PAGE_SIZE, dtype=torch.int64)) == [False]
    assert not pool.kv_buffer.any()
    foreign.close()
    backend.close()


def test_seaweedfs_wrong_size_target_is_a_miss(tmp_path):
    pool = mha_pool("page_first")
    backend = attached_backend(extra_config(tmp_path), pool)
    fill_random(pool, 2)
    page = pool.get_data_page(0, flat=True)
    assert backend.set("k", page)
    arena = torch.zeros(page.numel() * page.element_size() * 2, dtype=torch.uint8)
    assert backend.get("k", arena[: page.numel()]) is None  # half a page's bytes
    assert not arena.any()
    backend.close()


def _full_page(pool, fill):
    return torch.full((pool.get_dummy_flat_data_page().numel(),), fill, dtype=pool.dtype)


def test_seaweedfs_mha_and_cp_ranks_do_not_share(tmp_path):
    for ranks in ([dict(tp_rank=0, tp_size=2), dict(tp_rank=1, tp_size=2)],
                  [dict(cp_rank=0, cp_size=2), dict(cp_rank=1, cp_size=2)]):
        pools = [mha_pool("page_first"), mha_pool("page_first")]
        first, second = (attached_backend(extra_config(tmp_path), p, **r) for p, r in zip(pools, ranks))
        assert first.set("shared", _full_page(pools[0], 1))
        assert second.set("shared", _full_page(pools[1], 2))
        assert int(first.get("shared")[0]) == 1
        assert second.clear()
        assert first.exists("shared") and not second.exists("shared")
        first.close()
        second.close()


def test_seaweedfs_mla_ranks_share_objects(tmp_path):
    pool = mla_pool("page_first")
    writer = attached_backend(extra_config(tmp_path), pool, tp_rank=0, tp_size=2)
    assert writer.set("shared", _full_page(pool, 3))
    writer.close()
    reader = attached_backend(extra_config(tmp_path), mla_pool("page_first"), tp_rank=1, tp_size=2)
    assert reader.exists("shared")
    assert int(reader.get("shared")[0]) == 3
    reader.close()


def test_seaweedfs_missing_location_is_refused(tmp_path):
    extra = extra_config(tmp_path)
    del extra["disk_path"]
    with pytest.raises(ValueError):  # ConfigError is a ValueError, as SeaweedFSConfig raises
        create_backend(extra)


# ---------------------------------------------------------------- test_hicache_storage_format_tag.py
def test_format_tag_model_names():
    assert HostKVCache.storage_format_tag is None
    tag = UnifiedPageEnvelopeHostPool.storage_format_tag
    assert tag is not None
    assert storage_model_name("org/model", UnifiedPageEnvelopeHostPool) == f"org/model-{tag}"
    assert storage_model_name(None, UnifiedPageEnvelopeHostPool) == tag


def test_format_tag_untagged_page_misses(tmp_path):
    untagged = attached_backend(extra_config(tmp_path), mha_pool("page_first"), model="org/model")
    tagged = attached_backend(extra_config(tmp_path), mha_pool("page_first"),
                              model=storage_model_name("org/model", UnifiedPageEnvelopeHostPool))
    assert untagged.set("page-0", _full_page(untagged.mem_pool_host, 0))
    assert untagged.exists("page-0")
    assert not tagged.exists("page-0")
    untagged.close()
    tagged.close()


# ---------------------------------------------------------------- test_hicache_file_lru_unit.py
def _small(tmp_path, pages=3, **kw):
    """A backend whose disk holds ``pages`` pages (a 512 B page takes one 4 KiB slot)."""
    return attached_backend(extra_config(tmp_path, disk_bytes=pages * 4096, **kw), mha_pool("page_first"))


def test_lru_basic_evicts_oldest(tmp_path):
    b = _small(tmp_path)
    for i, k in enumerate("abc"):
        assert b.set(k, _full_page(b.mem_pool_host, i))
    assert b.set("d", _full_page(b.mem_pool_host, 9))
    b.store.drain()
    assert not b.exists("a")
    assert all(b.exists(k) for k in "bcd")
    assert b.store.stats()["tiers"]["disk"]["resident_blocks"] == 3
    b.close()


def test_lru_get_touches_recency(tmp_path):
    b = _small(tmp_path)
    for i, k in enumerate("abc"):
        b.set(k, _full_page(b.mem_pool_host, i))
    assert b.get("a") is not None
    b.set("d", _full_page(b.mem_pool_host, 9))
    b.store.drain()
    assert b.exists("a"), "a was just read and must survive"
    assert not b.exists("b"), "b became the least recently used"
    b.close()


def test_lru_value_larger_than_cap_fails_at_start(tmp_path):
    with pytest.raises(ConfigError, match="disk_bytes"):
        _small(tmp_path, pages=0.5)


def test_lru_repeated_set_same_key_is_noop(tmp_path):
    b = _small(tmp_path)
    assert b.set("a", _full_page(b.mem_pool_host, 1))
    assert b.set("a", _full_page(b.mem_pool_host, 2))
    assert int(b.get("a")[0]) == 1  # blocks are immutable: the first write stays
    assert b.stats()["backend"]["set_pages_deduplicated"] == 1
    assert b.store.stats()["resident_blocks"] == 1
    b.close()


def test_lru_clear_resets_state(tmp_path):
    b = _small(tmp_path)
    b.set("a", _full_page(b.mem_pool_host, 1))
    b.set("b", _full_page(b.mem_pool_host, 2))
    assert b.clear() is True
    assert b.store.stats()["resident_blocks"] == 0
    assert not b.exists("a")
    b.close()


def test_lru_restart_adopts_records_oldest_first(tmp_path):
    b = _small(tmp_path)
    for i, k in enumerate(["old", "mid", "new"]):
        b.set(k, _full_page(b.mem_pool_host, i))
    b.close()
    b = _small(tmp_path)
    assert b.store.stats()["resident_blocks"] == 3
    b.set("newer", _full_page(b.mem_pool_host, 7))
    b.store.drain()
    assert not b.exists("old") and all(b.exists(k) for k in ("mid", "new", "newer"))
    b.close()


def test_lru_size_parsing(tmp_path):
    for text, want in (("1024", 1024), ("1k", 1000), ("1KiB", 1024), ("1MiB", 1 << 20), ("2GiB", 2 << 30),
                       ("1.5G", int(1.5 * 10 ** 9))):
        assert create_backend(extra_config(tmp_path, disk_bytes=text)).options.disk_bytes == want
    for bad in ("abc", "10XY"):
        with pytest.raises(ConfigError, match="disk_bytes"):
            create_backend(extra_config(tmp_path, disk_bytes=bad))


def test_lru_rank_scopes(tmp_path):
    def ns(**kw):
        b = create_backend(extra_config(tmp_path), **kw)
        return b.scope.extras()

    assert "cp" not in ns(cp_rank=0, cp_size=1)
    assert ns(cp_rank=0, cp_size=8)["cp"] != ns(cp_rank=1, cp_size=8)["cp"]
    assert ns(is_mla=True, cp_rank=0, cp_size=4)["cp"] != ns(is_mla=True, cp_rank=3, cp_size=4)["cp"]
    assert "tp" not in ns(is_mla=True, tp_rank=1, tp_size=2)  # MLA drops TP, keeps CP
    assert ns(is_mla=True, pp_rank=1, pp_size=2)["pp"] == "1of2"


def test_lru_mla_owner_gating(tmp_path):
    owner = create_backend(extra_config(tmp_path), is_mla=True, tp_rank=0, tp_size=2)
    other = attached_backend(extra_config(tmp_path), mla_pool("page_first"), tp_rank=1, tp_size=2)
    mha = create_backend(extra_config(tmp_path), tp_rank=3, tp_size=4)
    assert owner.scope.is_writer and mha.scope.is_writer and not other.scope.is_writer
    assert other.set("a", _full_page(other.mem_pool_host, 5))
    assert not other.exists("a")  # nothing was created by the non-writer
    assert other.store.stats()["resident_blocks"] == 0
    other.close()
