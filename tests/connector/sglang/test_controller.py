"""TieredHiCacheStorage under a real SGLang ``HiCacheController`` with its storage threads (CPU).

Flow per test, as UnifiedRadixCache drives it: ``write_storage`` (backup thread ->
``batch_set_v1`` or legacy ``batch_set``) -> ``prefetch`` (prefetch thread: SGLang's
SHA-256 page hashes -> ``batch_exists``) -> host slots allocated -> ``prefetch_buffer``
(IO thread -> ``batch_get_v1`` or legacy ``batch_get``) -> ``PrefetchAck``s -> pages
compared bit for bit in the fresh host slots.
"""
from __future__ import annotations

import threading

import pytest

from tests.connector.sglang.harness import (
    PAGE_SIZE, extra_config, make_pool, mha_pool, pages_bytes, running_controller,
)

torch = pytest.importorskip("torch")

from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402

TIMEOUT = 20


def _backup(ctrl, pool, tokens, seed):
    """Fill fresh host slots with random KV for ``tokens`` and back them up through the backup thread."""
    src = pool.alloc(len(tokens))
    fill = torch.Generator().manual_seed(seed)
    for i in range(len(tokens) // PAGE_SIZE):  # random bytes only in our pages: other ops' slots stay intact
        page = pool.get_data_page(int(src[i * PAGE_SIZE]), flat=False)
        page.copy_(torch.randn(page.shape, generator=fill).to(page.dtype))
    expected = pages_bytes(pool, src, len(tokens) // PAGE_SIZE)
    hashes = get_hash_str(tokens, None, page_size=PAGE_SIZE)
    op_id = ctrl.write_storage(src, tokens, hash_value=hashes, prefix_keys=[])
    return op_id, src, expected


def _wait_backup(ctrl, op_id):
    ack = ctrl.ack_backup_queue.get(timeout=TIMEOUT)
    assert ack.id == op_id
    return ack.completed_tokens


def _prefetch(ctrl, pool, req, tokens, last_hash=None, prefix_keys=()):
    """Hit query, then host slots for the hit, then the IO thread; returns (hit tokens, loaded tokens, slots).
    ``last_hash``/``prefix_keys``: the pages before ``tokens`` (SGLang with ``hicache_storage_pass_prefix_keys``)."""
    op = ctrl.prefetch(req, tokens, last_hash=last_hash, prefix_keys=list(prefix_keys))
    assert ctrl.prefetch_hit_queue.get(timeout=TIMEOUT) is op
    hit = op.storage_hit_count
    if hit == 0:
        return 0, 0, None
    dst = pool.alloc(hit)
    op.host_indices = dst
    ctrl.prefetch_buffer.put(op)
    loaded = 0
    while True:
        ack = ctrl.ack_prefetch_queue.get(timeout=TIMEOUT)
        loaded = max(loaded, ack.completed_tokens or 0)
        if ack.completed_req:
            return hit, loaded, dst


def _tokens(start, pages):
    return list(range(start, start + pages * PAGE_SIZE))


def _no_errors(ctrl):
    counters = ctrl.storage_backend.stats()["backend"]
    assert counters.get("errors", 0) == 0, counters["last_error"]
    return counters


@pytest.mark.parametrize("interface_v1", [True, False], ids=["v1", "legacy"])
@pytest.mark.parametrize("kind,layout", [("mha", "page_first"), ("mha", "layer_first"), ("mla", "page_first"),
                                         ("mla", "layer_first")])
def test_backup_hit_query_prefetch_bit_exact(tmp_path, kind, layout, interface_v1):
    pool = make_pool(kind, layout)
    with running_controller(pool, extra_config(tmp_path, interface_v1)) as ctrl:
        want_get = "_page_get_zero_copy" if interface_v1 else "_generic_page_get"
        assert ctrl.page_get_func.__name__ == want_get
        tokens = _tokens(100, 5)
        op_id, _, expected = _backup(ctrl, pool, tokens, seed=1)
        assert _wait_backup(ctrl, op_id) == len(tokens)
        query = tokens + _tokens(900, 2)  # 5 stored pages + 2 never written
        hit, loaded, dst = _prefetch(ctrl, pool, "req-1", query)
        assert hit == loaded == len(tokens)
        assert all(torch.equal(a, b) for a, b in zip(pages_bytes(pool, dst, 5), expected))
        counters = _no_errors(ctrl)
        assert counters["set_pages"] == 5 and counters["get_pages"] == 5


def test_restart_hits_pages_written_before(tmp_path):
    tokens = _tokens(7, 4)
    pool = mha_pool("page_first")
    with running_controller(pool, extra_config(tmp_path)) as ctrl:
        op_id, _, expected = _backup(ctrl, pool, tokens, seed=2)
        assert _wait_backup(ctrl, op_id) == len(tokens)
    # detach closed the backend; a new server process on the same disk_path
    fresh = mha_pool("page_first")
    with running_controller(fresh, extra_config(tmp_path)) as ctrl:
        hit, loaded, dst = _prefetch(ctrl, fresh, "after-restart", tokens)
        assert hit == loaded == len(tokens)
        assert all(torch.equal(a, b) for a, b in zip(pages_bytes(fresh, dst, 4), expected))


def test_shared_disk_budget_keeps_two_models_apart(tmp_path):
    """Issue 17: two models on one disk_path with ``disk_budget: shared`` share one directory and budget;
    the second one's prefetch of the very same tokens is a miss, a raw key of the first one's namespace is
    refused by the store, and the first one still hits its pages afterwards."""
    from tiered_kv.errors import InvalidInputError

    tokens = _tokens(900, 4)
    extra = extra_config(tmp_path, disk_budget="shared")
    pool = mha_pool("page_first")
    with running_controller(pool, extra, model="model-a") as ctrl:
        op_id, _, expected = _backup(ctrl, pool, tokens, seed=9)
        assert _wait_backup(ctrl, op_id) == len(tokens)
        foreign = ctrl.storage_backend._keys(get_hash_str(tokens, None, page_size=PAGE_SIZE))
        dir_a = ctrl.storage_backend.disk_dir
    other = mha_pool("page_first")
    with running_controller(other, extra, model="model-b") as ctrl:
        backend = ctrl.storage_backend
        assert backend.disk_dir == dir_a and backend.store.stats()["resident_blocks"] == 0  # nothing adopted
        hit, loaded, _ = _prefetch(ctrl, other, "b", tokens)
        assert hit == loaded == 0
        with pytest.raises(InvalidInputError, match="namespace"):
            backend.store.contains(foreign)
        op_id, _, _ = _backup(ctrl, other, tokens, seed=10)  # model-b's own pages of the same tokens
        assert _wait_backup(ctrl, op_id) == len(tokens)
        assert len(backend.store.tiers[-1].usage()["spaces"]) == 2
        _no_errors(ctrl)
    again = mha_pool("page_first")
    with running_controller(again, extra, model="model-a") as ctrl:
        hit, loaded, dst = _prefetch(ctrl, again, "a2", tokens)
        assert hit == loaded == len(tokens)
        assert all(torch.equal(a, b) for a, b in zip(pages_bytes(again, dst, 4), expected))  # not model-b's


def test_corrupted_record_is_a_miss_and_sglang_goes_on(tmp_path):
    from tiered_kv.values.record import RecordHeader

    pool = mha_pool("page_first")
    with running_controller(pool, extra_config(tmp_path)) as ctrl:
        tokens = _tokens(500, 5)
        op_id, _, expected = _backup(ctrl, pool, tokens, seed=3)
        assert _wait_backup(ctrl, op_id) == len(tokens)
        backend = ctrl.storage_backend
        disk = backend.store.tiers[-1]
        key = backend._keys(get_hash_str(tokens, None, page_size=PAGE_SIZE)[2:3])[0]
        with disk.index.env.begin(db=disk.index.db_records, buffers=False) as txn:
            slot = RecordHeader.unpack(key, txn.get(key)).slot
        with open(disk.path / "payload.bin", "r+b") as f:  # flip bytes of page 2's payload on disk
            f.seek(slot * disk.slot_bytes + 100)
            f.write(b"\x5a" * 64)
        hit, loaded, dst = _prefetch(ctrl, pool, "corrupt", tokens)
        assert hit == len(tokens) and loaded == 2 * PAGE_SIZE  # pages 0-1 land, page 2 is a miss
        assert all(torch.equal(a, b) for a, b in zip(pages_bytes(pool, dst, 2), expected[:2]))
        pool.free(dst)
        hit, loaded, _ = _prefetch(ctrl, pool, "after", tokens)
        assert hit == loaded == 2 * PAGE_SIZE  # the bad record is gone; SGLang asks for what is left
        assert backend.store.stats()["tiers"]["disk"]["corrupt_dropped"] == 1
        op_id, _, _ = _backup(ctrl, pool, _tokens(5000, 3), seed=4)  # and keeps backing up
        assert _wait_backup(ctrl, op_id) == 3 * PAGE_SIZE
        _no_errors(ctrl)


@pytest.mark.parametrize("interface_v1", [True, False], ids=["v1", "legacy"])
def test_concurrent_backup_and_prefetch_threads(tmp_path, interface_v1):
    pool = mha_pool("page_first", dev_tokens=1024)
    seqs = [_tokens(10_000 * (i + 1), 3 + i % 4) for i in range(16)]
    with running_controller(pool, extra_config(tmp_path, interface_v1)) as ctrl:
        first = [_backup(ctrl, pool, s, seed=i) for i, s in enumerate(seqs[:8])]
        for (op_id, _, _), s in zip(first, seqs[:8]):
            assert _wait_backup(ctrl, op_id) == len(s)
        # second half backs up while the first half is prefetched, on SGLang's own threads
        second = [_backup(ctrl, pool, s, seed=100 + i) for i, s in enumerate(seqs[8:])]
        errors: list = []

        def reader():
            try:
                for i, s in enumerate(seqs[:8]):
                    hit, loaded, dst = _prefetch(ctrl, pool, f"r{i}", s)
                    assert hit == loaded == len(s), (i, hit, loaded)
                    got = pages_bytes(pool, dst, len(s) // PAGE_SIZE)
                    assert all(torch.equal(a, b) for a, b in zip(got, first[i][2])), i
            except BaseException as exc:  # surface in the main thread
                errors.append(exc)

        t = threading.Thread(target=reader)
        t.start()
        done = [_wait_backup(ctrl, op_id) for op_id, _, _ in second]
        t.join(60)
        assert not errors, errors
        assert done == [len(s) for s in seqs[8:]]
        for i, s in enumerate(seqs[8:]):  # what was backed up during the reads reads back intact
            hit, loaded, dst = _prefetch(ctrl, pool, f"late{i}", s)
            assert hit == loaded == len(s)
            assert all(torch.equal(a, b) for a, b in zip(pages_bytes(pool, dst, len(s) // PAGE_SIZE), second[i][2]))
        counters = _no_errors(ctrl)
        assert counters["set_pages"] == sum(len(s) for s in seqs) // PAGE_SIZE


def test_sglang_failure_injector_around_our_backend(tmp_path, monkeypatch):
    """SGLang's own test hook wraps any backend in HiCacheStorageFailureInjector (random failed calls)."""
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    pool = mha_pool("page_first", dev_tokens=512)
    seqs = [_tokens(20_000 * (i + 1), 4) for i in range(10)]
    with running_controller(pool, extra_config(tmp_path)) as ctrl:
        assert type(ctrl.storage_backend).__name__ == "HiCacheStorageFailureInjector"
        ours = ctrl.storage_backend._backend
        backed = []
        for i, s in enumerate(seqs):
            op_id, _, expected = _backup(ctrl, pool, s, seed=i)
            backed.append((_wait_backup(ctrl, op_id), expected))
        for i, (s, (stored, expected)) in enumerate(zip(seqs, backed)):
            hit, loaded, dst = _prefetch(ctrl, pool, f"inj{i}", s)
            assert loaded <= hit and (hit == 0 or hit <= len(s))
            for a, b in zip(pages_bytes(pool, dst, loaded // PAGE_SIZE) if loaded else [], expected):
                assert torch.equal(a, b)  # whatever lands is the right page
        assert any(stored for stored, _ in backed)
        assert ours.stats()["backend"].get("errors", 0) == 0  # injected failures never became our errors
