"""The SGLang 0.5.17 (GPU machine) vs 0.5.23 (CI) differences the backend depends on (``versions.py``).

CI has SGLang 0.5.23 only (0.5.17 pins torch 2.11, CI runs torch 2.13), so a 0.5.17-shaped storage config is
rebuilt below from 0.5.17's field list (``hicache_storage.py`` of the 0.5.17 wheel): a stand-in for the one
framework class that cannot be installed here. Everything else is SGLang 0.5.23's real code: the ``dynamic``
factory, the host pools, ``HiCacheStorageConfig`` with its ``is_storage_writer`` property. The real 0.5.17 is
probed on the GPU machine by ``scripts/gpu/sglang/check_adapter.py``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from tests.connector.sglang.harness import (
    PAGE_SIZE, extra_config, fill_random, mha_pool, mla_pool, pages_bytes, storage_config,
)

torch = pytest.importorskip("torch")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

from tiered_kv.connector.sglang import versions  # noqa: E402
from tiered_kv.connector.sglang.config import SGLangBackendConfig, scope_from  # noqa: E402
from tiered_kv.errors import ConfigError  # noqa: E402


@dataclass
class Config0517:
    """SGLang 0.5.17's ``HiCacheStorageConfig`` fields, in order (no dp_rank, no DCP, no is_storage_writer)."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    attn_cp_rank: int
    attn_cp_size: int
    is_mla_model: bool
    enable_storage_metrics: bool
    is_page_first_layout: bool
    model_name: str | None
    tp_lcm_size: int | None = None
    should_split_heads: bool = False
    extra_config: dict | None = None


def _cfg0517(extra, tp_rank=0, tp_size=1, is_mla=False):
    return Config0517(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                      is_mla_model=is_mla, enable_storage_metrics=False, is_page_first_layout=True,
                      model_name="Qwen/Qwen3-0.6B", extra_config=dict(extra))


def test_0517_field_list_is_a_subset_of_0523():
    """What the backend reads exists in both; 0.5.23 only adds fields (with defaults)."""
    old = [f.name for f in dataclasses.fields(Config0517)]
    new = {f.name: f for f in dataclasses.fields(HiCacheStorageConfig)}
    assert set(old) <= set(new)
    added = set(new) - set(old)
    assert {"dp_rank", "dcp_size", "dcp_rank"} <= added
    assert all(new[name].default is not dataclasses.MISSING for name in added)
    assert isinstance(HiCacheStorageConfig.__dict__["is_storage_writer"], property)
    assert "is_storage_writer" not in Config0517.__dict__


@pytest.mark.parametrize("is_mla,tp_rank", [(False, 0), (False, 1), (True, 0), (True, 1)])
def test_storage_writer_same_answer_on_both_versions(tmp_path, is_mla, tp_rank):
    new = storage_config(extra_config(tmp_path), tp_rank=tp_rank, tp_size=2, is_mla=is_mla)
    old = _cfg0517(extra_config(tmp_path), tp_rank=tp_rank, tp_size=2, is_mla=is_mla)
    want = not is_mla or tp_rank == 0  # 0.5.17's backup_skip and 0.5.23's property agree without DCP
    assert versions.storage_writer(new) is new.is_storage_writer is want
    assert versions.storage_writer(old) is want
    assert scope_from(old, "").is_writer is want and scope_from(new, "").is_writer is want


def test_dp_and_dcp_defaults_on_0517(tmp_path):
    old = _cfg0517(extra_config(tmp_path))
    assert versions.dcp(old) == (0, 1)
    assert versions.dp_rank(old) == 0  # no DP attention initialised in this process
    versions.check_supported(old)


def test_dcp_is_refused_with_a_message(tmp_path):
    cfg = HiCacheStorageConfig(tp_rank=1, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=True,
                               model_name="m", extra_config=extra_config(tmp_path), dcp_size=2, dcp_rank=1,
                               logical_page_size=2 * PAGE_SIZE)
    with pytest.raises(ConfigError, match="dcp_size=2"):
        StorageBackendFactory.create_backend("dynamic", cfg, None)


def test_dp_rank_gets_its_own_directory(tmp_path):
    """Two attention-DP groups' rank 0 must not both write one directory (0.5.23 passes dp_rank)."""
    dirs = []
    for dp in (0, 1):
        cfg = dataclasses.replace(storage_config(extra_config(tmp_path)), dp_rank=dp)
        be = StorageBackendFactory.create_backend("dynamic", cfg, None)
        be.register_mem_pool_host(mha_pool("page_first"))
        dirs.append(be.disk_dir)
        be.close()
    assert dirs[0] != dirs[1] and "-dp1-" in dirs[1].name and "-dp" not in dirs[0].name


def test_prefetch_timeout_max_is_sglang_s_key():
    """0.5.23's UnifiedRadixCache passes it through to the backend (0.5.17's HiRadixCache pops it)."""
    cfg = SGLangBackendConfig.from_extra_config({"disk_path": "/x", "prefetch_timeout_max": 30})
    assert cfg.disk_path == "/x"


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_backend_round_trip_with_a_0517_config(tmp_path, kind):
    """Through SGLang's real ``dynamic`` factory with a 0.5.17-shaped config: store, query, load, bit-exact."""
    extra = extra_config(tmp_path)
    pool = mla_pool("page_first") if kind == "mla" else mha_pool("page_first")
    be = StorageBackendFactory.create_backend("dynamic", _cfg0517(extra, is_mla=kind == "mla"), None)
    be.register_mem_pool_host(pool)
    fill_random(pool, seed=5)
    keys = [f"{i:064x}" for i in range(1, 6)]
    src = pool.alloc(5 * PAGE_SIZE)
    want = pages_bytes(pool, src, 5)  # raw bytes: random bits include NaNs
    assert all(be.batch_set_v1(keys, src))
    assert be.batch_exists(keys + [f"{99:064x}"]) == 5
    dst = pool.alloc(5 * PAGE_SIZE)
    assert all(be.batch_get_v1(keys, dst))
    assert all(torch.equal(a, b) for a, b in zip(pages_bytes(pool, dst, 5), want))
    assert be.stats()["backend"].get("errors", 0) == 0
    be.close()


def test_mla_reader_rank_on_0517_writes_nothing(tmp_path):
    extra = extra_config(tmp_path)
    be = StorageBackendFactory.create_backend("dynamic", _cfg0517(extra, tp_rank=1, tp_size=2, is_mla=True), None)
    pool = mla_pool("page_first")
    be.register_mem_pool_host(pool)
    keys = [f"{i:064x}" for i in range(1, 4)]
    assert all(be.batch_set_v1(keys, pool.alloc(3 * PAGE_SIZE)))  # True: the writer rank stores them
    assert be.batch_exists(keys) == 0
    assert be.stats()["backend"]["set_skipped_reader"] == 3
    be.close()


def test_unwrap_finds_our_backend_behind_the_failure_injector(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.5")
    be = StorageBackendFactory.create_backend("dynamic", storage_config(extra_config(tmp_path)), None)
    assert type(be).__name__ == "HiCacheStorageFailureInjector"
    ours = versions.unwrap(be)
    assert type(ours).__name__ == "TieredHiCacheStorage" and versions.unwrap(ours) is ours


def test_tested_versions_include_the_installed_one():
    assert versions.sglang_version() in versions.TESTED_SGLANG
