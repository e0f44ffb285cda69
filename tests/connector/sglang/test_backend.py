"""TieredHiCacheStorage under SGLang's real factory, host pools and controller page helpers (CPU).

Round trips go through ``HiCacheController._generic_page_set/_page_set_zero_copy`` and
``_generic_page_get/_page_get_zero_copy`` (the functions SGLang's storage threads call),
into fresh host slots, for every MHA and MLA host layout and every set/get pairing.
"""
from __future__ import annotations

import multiprocessing

import pytest

from tests.connector.sglang.harness import (
    ALL_POOLS, PAGE_SIZE, controller_stub, create_backend, extra_config, attached_backend, fill_random,
    live_op, make_pool, mla_writer_process, mha_pool, mla_pool, page_helpers, pages_bytes,
)

torch = pytest.importorskip("torch")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo  # noqa: E402

from tiered_kv.connector.sglang.backend import TieredHiCacheStorage  # noqa: E402
from tiered_kv.errors import ConfigError  # noqa: E402

N = 3


def _write_then_read(backend, pool, set_via, get_via, n=N, seed=0):
    set_page, get_page = page_helpers(set_via, get_via)
    ctrl = controller_stub(backend, pool)
    fill_random(pool, seed)
    src = pool.alloc(n * PAGE_SIZE)
    expected = pages_bytes(pool, src, n)
    keys = [f"{seed}-{set_via}-page{i}" for i in range(n)]
    assert set_page(ctrl, keys, src, HiCacheStorageExtraInfo(prefix_keys=[]))
    dst = pool.alloc(n * PAGE_SIZE)  # fresh host slots, as a prefetch gets
    pool.kv_buffer.zero_()
    loaded = get_page(ctrl, live_op(), keys, dst, HiCacheStorageExtraInfo(prefix_keys=[]))
    return keys, dst, expected, loaded


@pytest.mark.parametrize("kind,layout", ALL_POOLS)
def test_round_trip_is_bit_exact_for_every_pool_and_path(tmp_path, kind, layout):
    pool = make_pool(kind, layout)
    backend = attached_backend(extra_config(tmp_path), pool)
    try:
        for set_via in ("generic", "zero_copy"):
            for get_via in ("generic", "zero_copy"):
                keys, dst, expected, loaded = _write_then_read(backend, pool, set_via, get_via, seed=hash(get_via) % 97)
                assert loaded == N, (set_via, get_via)
                assert backend.batch_exists(keys + ["absent"] + keys) == N  # leading hits only
                for i, want in enumerate(expected):
                    assert torch.equal(pages_bytes(pool, dst, N)[i], want), (set_via, get_via, i)
                pool.free(dst)
        s = backend.stats()
        assert s["backend"].get("errors", 0) == 0, s["backend"]["last_error"]
    finally:
        backend.close()


@pytest.mark.parametrize("get_via", ["generic", "zero_copy"])
def test_prefetch_stops_at_the_first_missing_page(tmp_path, get_via):
    pool = mha_pool("page_first")
    backend = attached_backend(extra_config(tmp_path), pool)
    set_page, get_page = page_helpers("zero_copy", get_via)
    fill_random(pool, 3)
    src = pool.alloc(4 * PAGE_SIZE)
    keys = [f"hole{i}" for i in range(4)]
    assert set_page(controller_stub(backend, pool), keys, src)
    backend.store.delete(backend._keys([keys[2]]))
    backend.store.drain()
    assert backend.batch_exists(keys) == 2
    dst = pool.alloc(4 * PAGE_SIZE)
    assert get_page(controller_stub(backend, pool), live_op(), keys, dst) == 2
    backend.close()


def test_factory_builds_our_class_and_accepts_sglang_keys(tmp_path):
    extra = extra_config(tmp_path, tp_lcm_size=None, file_storage_path="/x", cpu_bytes="1MiB", tenant_salt="t")
    backend = create_backend(extra)
    assert isinstance(backend, TieredHiCacheStorage)
    assert backend.options.cpu_bytes == 1 << 20 and backend.options.disk_bytes == 64 << 20
    backend.register_mem_pool_host(mha_pool("page_first"))
    assert [t.name for t in backend.store.tiers] == ["cpu", "disk"]
    backend.close()


@pytest.mark.parametrize("bad,needle", [({"disk_pth": "/x"}, "disk_pth"), ({"disk_bytes": "lots"}, "disk_bytes"),
                                        ({"compression": "lz5"}, "lz5"), ({"cpu_bytes": -1}, "cpu_bytes")])
def test_a_wrong_key_fails_at_start_naming_it(tmp_path, bad, needle):
    with pytest.raises(ConfigError, match=needle):
        create_backend({**extra_config(tmp_path), **bad})


def test_no_tier_configured_is_refused(tmp_path):
    extra = extra_config(tmp_path)
    del extra["disk_path"]
    with pytest.raises(ConfigError, match="disk_path"):
        create_backend(extra)


def test_restart_on_the_same_disk_path_hits_pages_written_before(tmp_path):
    pool = mla_pool("page_first")
    first = attached_backend(extra_config(tmp_path), pool)
    fill_random(pool, 7)
    src = pool.alloc(N * PAGE_SIZE)
    expected = pages_bytes(pool, src, N)
    keys = [f"persist{i}" for i in range(N)]
    assert all(first.batch_set_v1(keys, src))
    first.close()

    fresh_pool = mla_pool("page_first")
    second = attached_backend(extra_config(tmp_path), fresh_pool)
    assert second.batch_exists(keys) == N
    dst = fresh_pool.alloc(N * PAGE_SIZE)
    assert second.batch_get_v1(keys, dst) == [True] * N
    assert all(torch.equal(a, b) for a, b in zip(pages_bytes(fresh_pool, dst, N), expected))
    second.close()


def _corrupt_payload(backend, key: str) -> None:
    """Flip bytes of one record's payload on disk (test-only reach into the disk tier)."""
    from tiered_kv.values.record import RecordHeader

    disk = backend.store.tiers[-1]
    k = backend._keys([key])[0]
    with disk.index.env.begin(db=disk.index.db_records, buffers=False) as txn:
        hdr = RecordHeader.unpack(k, txn.get(k))
    with open(disk.path / "payload.bin", "r+b") as f:
        f.seek(hdr.slot * disk.slot_bytes + 10)
        f.write(b"\xa5" * 16)


def test_a_corrupted_record_reads_as_a_miss_and_sglang_goes_on(tmp_path):
    pool = mha_pool("layer_first")
    backend = attached_backend(extra_config(tmp_path), pool)
    fill_random(pool, 11)
    src = pool.alloc(N * PAGE_SIZE)
    expected = pages_bytes(pool, src, N)
    keys = [f"bad{i}" for i in range(N)]
    assert all(backend.batch_set_v1(keys, src))
    _corrupt_payload(backend, keys[1])
    dst = pool.alloc(N * PAGE_SIZE)
    _, get_page = page_helpers("zero_copy", "zero_copy")
    assert get_page(controller_stub(backend, pool), live_op(), keys, dst) == 1  # SGLang keeps the leading page
    assert torch.equal(pages_bytes(pool, dst, 1)[0], expected[0])
    backend.store.drain()
    assert backend.batch_exists(keys) == 1  # the bad record is gone from the index
    assert backend.store.stats()["tiers"]["disk"]["corrupt_dropped"] == 1
    # and the page can be written again and served
    assert all(backend.batch_set_v1(keys, src))
    assert backend.batch_get_v1(keys, dst) == [True] * N
    assert backend.stats()["backend"].get("errors", 0) == 0
    backend.close()


def test_batch_calls_never_raise(tmp_path):
    backend = create_backend(extra_config(tmp_path))
    idx = torch.arange(PAGE_SIZE)
    # before a host pool is registered
    assert backend.batch_exists(["a"]) == 0
    assert backend.batch_get_v1(["a"], idx) == [False]
    assert backend.batch_set_v1(["a"], idx) == [False]
    assert backend.batch_get(["a"], [torch.zeros(4)]) == [None]
    assert backend.batch_set(["a"], [torch.zeros(4)]) is False
    pool = mha_pool("page_first")
    backend.register_mem_pool_host(pool)
    # misaligned and out-of-range host indices
    assert backend.batch_set_v1(["a"], idx + 1) == [False]
    assert backend.batch_get_v1(["a"], torch.arange(10 ** 6, 10 ** 6 + PAGE_SIZE)) == [False]
    # legacy value of the wrong size is refused, a wrong-size target is a miss and stays untouched
    assert backend.set("a", torch.ones(8, dtype=torch.uint8)) is False
    page = pool.get_data_page(0, flat=True).clone()
    assert backend.set("a", page) is True and backend.exists("a")
    arena = torch.zeros(page.numel() * 4, dtype=torch.uint8)
    assert backend.get("a", arena[: page.numel()]) is None
    assert not arena.any()
    assert torch.equal(backend.get("a"), page)
    counters = backend.stats()["backend"]
    assert counters["errors"] >= 6 and counters["size_mismatch"] >= 2
    backend.close()
    assert backend.batch_exists(["a"]) == 0  # closed: a miss, not an exception


def test_namespacing_keeps_ranks_layouts_dtypes_and_models_apart(tmp_path):
    extra = extra_config(tmp_path)
    page = {}

    def write(be, pool, key="shared"):
        fill_random(pool, len(page))
        idx = pool.alloc(PAGE_SIZE)
        assert be.batch_set_v1([key], idx) == [True]
        page[id(be)] = pages_bytes(pool, idx, 1)[0]

    # MHA: each TP rank holds other heads, so ranks never read each other's pages
    p0, p1 = mha_pool("page_first"), mha_pool("page_first")
    r0 = attached_backend(extra, p0, tp_rank=0, tp_size=2)
    r1 = attached_backend(extra, p1, tp_rank=1, tp_size=2)
    write(r0, p0)
    assert r1.batch_exists(["shared"]) == 0
    # the same page bytes under another layout, dtype or model are other pages
    others = [attached_backend(extra, mha_pool("layer_first")),
              attached_backend(extra, mha_pool("page_first", dtype=torch.float16)),
              attached_backend({**extra, "model": "other/model"}, mha_pool("page_first")),
              attached_backend({**extra, "tenant_salt": "tenant-b"}, mha_pool("page_first"))]
    base = attached_backend(extra, mha_pool("page_first"))
    write(base, base.mem_pool_host)
    assert [o.batch_exists(["shared"]) for o in others] == [0, 0, 0, 0]
    assert len({o.namespace.prefix for o in others + [base, r0, r1]}) == 7
    for be in others + [base, r0, r1]:
        be.close()


def test_mla_ranks_share_pages_one_writer_all_readers(tmp_path):
    extra = extra_config(tmp_path, reader_refresh_s=0)
    rpool = mla_pool("page_first")
    reader = attached_backend(extra, rpool, tp_rank=1, tp_size=2)
    assert not reader.scope.is_writer
    keys = [f"mla{i}" for i in range(N)]
    assert reader.batch_set_v1(keys, rpool.alloc(N * PAGE_SIZE)) == [True] * N  # a reader does not write
    assert reader.stats()["backend"]["set_skipped_reader"] == N and reader.batch_exists(keys) == 0
    # the writer rank is another process on the same directory, as under SGLang (LMDB allows one
    # open per process; spawn, because a forked child inherits the parent's open environments)
    child = multiprocessing.get_context("spawn").Process(target=mla_writer_process, args=(str(tmp_path), keys, 5))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert reader.batch_exists(keys) == N  # picked up from the shared directory
    dst = rpool.alloc(N * PAGE_SIZE)
    assert reader.batch_get_v1(keys, dst) == [True] * N
    twin = mla_pool("page_first")  # same seed, same allocation: the bytes the writer stored
    fill_random(twin, 5)
    expected = pages_bytes(twin, twin.alloc(N * PAGE_SIZE), N)
    assert all(torch.equal(a, b) for a, b in zip(pages_bytes(rpool, dst, N), expected))
    # adopted: by the store's own directory lookup (issue 17) or by the backend's reader refresh
    assert reader.store.stats()["resident_blocks"] == N
    reader.close()


def test_prefix_keys_are_served_by_the_radix_index(tmp_path):
    pool = mha_pool("page_first")
    backend = attached_backend(extra_config(tmp_path), pool)
    fill_random(pool, 2)
    idx = pool.alloc(4 * PAGE_SIZE)
    chain = [f"{i:064x}" for i in range(1, 5)]
    assert all(backend.batch_set_v1(chain[:2], idx[: 2 * PAGE_SIZE], HiCacheStorageExtraInfo(prefix_keys=[])))
    assert all(backend.batch_set_v1(chain[2:], idx[2 * PAGE_SIZE:], HiCacheStorageExtraInfo(prefix_keys=chain[:2])))
    before = backend.stats()["backend"].get("radix_pages", 0)
    assert backend.batch_exists(chain[1:], HiCacheStorageExtraInfo(prefix_keys=chain[:1])) == 3
    assert backend.stats()["backend"]["radix_pages"] - before == 3
    # the radix answer agrees with the plain path, and a chain it does not know falls back to hashing
    assert backend.batch_exists(chain[1:]) == 3
    assert backend.batch_exists(chain[1:], HiCacheStorageExtraInfo(prefix_keys=["f" * 64])) == 3
    backend.close()


def test_get_stats_clear_and_close(tmp_path):
    from sglang.srt.observability.metrics_collector import StorageMetrics

    pool = mha_pool("page_first")
    backend = attached_backend(extra_config(tmp_path), pool)
    fill_random(pool, 9)
    idx = pool.alloc(N * PAGE_SIZE)
    keys = [f"s{i}" for i in range(N)]
    assert all(backend.batch_set_v1(keys, idx))
    assert backend.batch_get_v1(keys, pool.alloc(N * PAGE_SIZE)) == [True] * N
    m = backend.get_stats()
    assert isinstance(m, StorageMetrics) and m.backup_pgs == [N] and m.prefetch_pgs == [N]
    assert m.backup_bandwidth[0] > 0 and m.prefetch_bandwidth[0] > 0
    assert backend.get_stats().backup_pgs == []  # windows reset per call, as SGLang expects
    assert backend.clear() is True
    assert backend.batch_exists(keys) == 0
    assert all(backend.batch_set_v1(keys, idx)) and backend.batch_exists(keys) == N
    backend.close()
    backend.close()


@pytest.mark.parametrize("kind,layout", [("mha", "page_first"), ("mla", "page_first"), ("mla", "layer_first")])
def test_batches_larger_than_a_chunk_pipeline_and_stop_at_a_hole(tmp_path, kind, layout):
    pool = make_pool(kind, layout)
    backend = attached_backend(extra_config(tmp_path, chunk_pages=2), pool)
    fill_random(pool, 21)
    src = pool.alloc(7 * PAGE_SIZE)
    expected = pages_bytes(pool, src, 7)
    keys = [f"chunk{i}" for i in range(7)]
    assert backend.batch_set_v1(keys, src) == [True] * 7
    dst = pool.alloc(7 * PAGE_SIZE)
    assert backend.batch_get_v1(keys, dst) == [True] * 7
    assert all(torch.equal(a, b) for a, b in zip(pages_bytes(pool, dst, 7), expected))
    counters = backend.stats()["backend"]
    # MLA page_first pages are contiguous in the pool: the store reads and writes them in place
    in_place = kind == "mla" and layout == "page_first"
    assert (counters["get_zero_copy_calls"] > 0) == in_place
    assert (counters["set_zero_copy_calls"] > 0) == in_place
    backend.store.delete(backend._keys([keys[4]]))
    backend.store.drain()
    pool.kv_buffer.zero_()
    assert backend.batch_get_v1(keys, dst) == [True] * 4 + [False] * 3
    assert all(torch.equal(a, b) for a, b in zip(pages_bytes(pool, dst, 4), expected[:4]))
    backend.close()


def test_a_hit_query_warms_the_cpu_tier(tmp_path):
    extra = extra_config(tmp_path, cpu_bytes="1MiB")
    pool = mha_pool("page_first")
    first = attached_backend(extra, pool)
    fill_random(pool, 4)
    keys = [f"warm{i}" for i in range(N)]
    assert all(first.batch_set_v1(keys, pool.alloc(N * PAGE_SIZE)))
    first.close()
    second = attached_backend(extra, mha_pool("page_first"))  # after a restart the pages are on disk only
    ks = second._keys(keys)
    assert second.store.locate(ks) == ["disk"] * N
    assert second.batch_exists(keys) == N
    second.store.drain()
    assert second.store.locate(ks) == ["cpu"] * N
    second.close()


def test_an_mla_reader_forgets_but_never_deletes_the_writers_pages(tmp_path):
    pool = mla_pool("page_first")
    writer = attached_backend(extra_config(tmp_path), pool, tp_rank=0, tp_size=2)
    fill_random(pool, 8)
    keys = [f"keep{i}" for i in range(N)]
    assert all(writer.batch_set_v1(keys, pool.alloc(N * PAGE_SIZE)))
    writer.close()  # one process cannot hold one LMDB directory twice: reader opens after
    reader = attached_backend(extra_config(tmp_path), mla_pool("page_first"), tp_rank=1, tp_size=2)
    assert reader.store.lookup(reader._keys(keys)) == N
    reader.store.delete(reader._keys(keys))  # what a reader-side eviction does
    reader.store.drain()
    assert reader.store.lookup(reader._keys(keys)) == N  # still in the directory: a lookup adopts them again
    assert reader.batch_exists(keys) == N
    reader.close()
    again = attached_backend(extra_config(tmp_path), mla_pool("page_first"), tp_rank=0, tp_size=2)
    assert again.batch_exists(keys) == N
    again.close()


def test_the_radix_index_refills_from_reads_after_a_restart(tmp_path):
    pool = mha_pool("page_first")
    first = attached_backend(extra_config(tmp_path), pool)
    fill_random(pool, 6)
    idx = pool.alloc(3 * PAGE_SIZE)
    chain = [f"{i:064x}" for i in range(11, 14)]
    assert all(first.batch_set_v1(chain, idx, HiCacheStorageExtraInfo(prefix_keys=[])))
    first.close()
    second = attached_backend(extra_config(tmp_path), mha_pool("page_first"))
    assert len(second._radix) == 0
    info = HiCacheStorageExtraInfo(prefix_keys=[])
    assert second.batch_get_v1(chain, second.mem_pool_host.alloc(3 * PAGE_SIZE), info) == [True] * 3
    assert len(second._radix) == 3
    assert second.batch_exists(chain[1:], HiCacheStorageExtraInfo(prefix_keys=chain[:1])) == 2
    assert second.stats()["backend"]["radix_pages"] >= 2
    second.close()


@pytest.mark.parametrize("kind,layout", [("mha", "layer_first"), ("mha", "page_head"), ("mla", "page_first")])
def test_per_page_fallback_when_pages_are_not_uniformly_strided(tmp_path, monkeypatch, kind, layout):
    from tiered_kv.connector.sglang.pages import HostPages

    monkeypatch.setattr(HostPages, "_strided_view", lambda self, first: None)
    pool = make_pool(kind, layout)
    backend = attached_backend(extra_config(tmp_path, chunk_pages=2), pool)
    assert not backend.pages.strided
    keys, dst, expected, loaded = _write_then_read(backend, pool, "zero_copy", "zero_copy", n=5, seed=13)
    assert loaded == 5
    assert all(torch.equal(a, b) for a, b in zip(pages_bytes(pool, dst, 5), expected))
    backend.close()
