"""What differs between the SGLang releases the backend runs on: 0.5.17 (GPU machine, torch 2.11) and 0.5.23 (CI).

Read from both wheels' ``sglang/srt/mem_cache/hicache_storage.py``, ``storage/backend_factory.py``,
``managers/cache_controller.py`` and ``mem_cache/registry.py`` (docs/sglang.md has the table).
Every difference the backend depends on is answered here, in one place, by looking at the
object SGLang hands over (never by comparing version strings):

- ``HiCacheStorageConfig.is_storage_writer`` is a property in 0.5.23 (``not is_mla_model or
  tp_rank == dcp_rank``); 0.5.17 has no such property and its controller skips MLA backups on
  every rank but TP rank 0 (``backup_skip``). ``storage_writer`` returns the same answer on both.
- ``dp_rank`` (attention data parallel) is a config field in 0.5.23 only. On 0.5.17 the
  controller knows it but does not pass it; ``dp_rank`` asks SGLang's DP-attention module then.
- ``dcp_size`` / ``dcp_rank`` / ``logical_page_size`` (decode context parallel) exist in 0.5.23
  only; 0.5.17 refuses L3 storage with DCP at server start. We refuse DCP > 1 on both.
- Extra-config keys SGLang pops before the backend sees them: 0.5.17's ``HiRadixCache`` also pops
  ``prefetch_timeout_max``; 0.5.23's ``UnifiedRadixCache`` does not (so it would reach us).
  ``config.SGLANG_KEYS`` accepts and ignores it on both.
- 0.5.23's factory may wrap any backend in ``HiCacheStorageFailureInjector`` (test env vars);
  ``unwrap`` returns our object behind it (0.5.17 has no wrapper).
- Host pool constructors differ (0.5.17: from the device pool; 0.5.23: from buffer descriptors);
  the backend only uses the pool methods both have (``get_data_page``, ``set_from_flat_data_page``,
  ``page_size``, ``size``, ``layout``, ``dtype``).

Threading contract: pure functions over immutable config objects; safe from any thread.
"""
from __future__ import annotations

from tiered_kv.errors import ConfigError

#: SGLang releases this backend was checked against (CI runs the newest; the GPU machine the oldest).
TESTED_SGLANG = ("0.5.17", "0.5.23")


def sglang_version() -> str:
    """The installed SGLang's version string ("" if SGLang is not importable)."""
    try:
        import sglang
    except ImportError:
        return ""
    return str(getattr(sglang, "__version__", ""))


def storage_writer(cfg: object) -> bool:
    """Whether this rank writes L3 pages: SGLang's own answer where it has one (0.5.23+), else 0.5.17's rule.

    0.5.17 (``HiCacheController.attach_storage_backend``): MLA pages are backed up by TP rank 0
    only; every MHA rank writes its own heads.
    """
    prop = getattr(type(cfg), "is_storage_writer", None)
    if isinstance(prop, property):
        return bool(cfg.is_storage_writer)
    return not bool(cfg.is_mla_model) or int(cfg.tp_rank) == 0


def dcp(cfg: object) -> tuple[int, int]:
    """(dcp_rank, dcp_size) of decode context parallel; (0, 1) where SGLang has no such field (0.5.17)."""
    return int(getattr(cfg, "dcp_rank", 0) or 0), int(getattr(cfg, "dcp_size", 1) or 1)


def dp_rank(cfg: object) -> int:
    """Attention data-parallel rank: the config field (0.5.23+), else SGLang's DP-attention state (0.5.17), else 0."""
    if hasattr(cfg, "dp_rank"):
        return int(cfg.dp_rank or 0)
    try:
        from sglang.srt.layers import dp_attention as dpa
    except ImportError:
        return 0
    try:
        if dpa.is_dp_attention_enabled():
            return int(dpa.get_attention_dp_rank())
    except (AssertionError, AttributeError, RuntimeError, TypeError):
        pass  # DP attention never initialised in this process (tests, tools): no DP groups
    return 0


def check_supported(cfg: object) -> None:
    """Raise ConfigError for SGLang setups the backend cannot name pages for (today: DCP > 1)."""
    rank, size = dcp(cfg)
    if size > 1:
        raise ConfigError(f"tiered_kv SGLang backend: decode context parallel (dcp_size={size}, dcp_rank={rank}) "
                          f"is not supported: each DCP rank holds an interleaved shard of every page. Run with "
                          f"dcp_size 1, or use SGLang's file/mooncake backend for DCP")


def unwrap(backend: object) -> object:
    """Our backend behind SGLang 0.5.23's ``HiCacheStorageFailureInjector`` (the object itself otherwise)."""
    inner = getattr(backend, "_backend", None)
    return inner if inner is not None and type(backend).__name__ == "HiCacheStorageFailureInjector" else backend
