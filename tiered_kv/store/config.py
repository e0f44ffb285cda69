"""Configuration: one frozen dataclass, built from a dict, JSON or YAML with strict validation.

Unknown keys are an error that names the key and lists the valid ones; sizes accept
``"64GiB"``-style strings; every value is checked at construction, so a bad config fails
when the store (or the engine using it) starts, not on the first transfer.

Threading contract: immutable values; safe from any thread.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from tiered_kv.errors import ConfigError
from tiered_kv.values.layout import normalize_dtype
from tiered_kv.planner.policy import POLICIES, WRITE_POLICIES
from tiered_kv.tiers.pool import check_pool_size
from tiered_kv.tiers.remote.settings import RemoteKeys
from tiered_kv.values.config_keys import config_key
from tiered_kv.values.record import CODECS
from tiered_kv.values.units import parse_size

_SIZE_KEYS = ("gpu_bytes", "cpu_bytes", "disk_bytes")
#: The remote tier's keys, shared by the engine adapters that pass them through.
REMOTE_KEYS = tuple(f.name for f in fields(RemoteKeys))
DISK_ROLES = ("writer", "reader")
DISK_BUDGETS = ("namespace", "shared")  # docs/reliability.md, "Sharing one directory"


@dataclass(frozen=True)
class StoreConfig(RemoteKeys):
    """Everything a ``TieredStore`` needs, one ``config_key`` each (the README's table is generated from them)."""

    block_shape: tuple[int, ...] = config_key((2, 16, 8, 64), "shape of one block (all layers of `page_size` tokens)")
    dtype: str = config_key("bfloat16", "element type of a block: `float32`, `float16`, `bfloat16`, `float8_e4m3fn`, "
                                        "`float8_e5m2`, `uint8`, ...")
    page_size: int = config_key(16, "tokens per block, for `keys_for_tokens` / `match_prefix`", "tokens")
    layout_tag: str = config_key("", "extra layout fact folded into the layout fingerprint (e.g. `vllm:LBNHC`)")
    model: str = config_key("", "model name in the key namespace: two models never read each other's blocks")
    tenant_salt: str = config_key("", "tenant salt in the key namespace: two salts never read each other's blocks")
    gpu_bytes: int = config_key(0, "GPU slab size (0 = no GPU tier); on a machine without CUDA it is a CPU tensor",
                                   "bytes")
    device: str = config_key("auto", "`auto`, `cuda`, `cuda:N` or `cpu` for the GPU tier")
    cpu_bytes: int = config_key(1 << 30, "host slab, pinned (one `cudaHostRegister`) in the background when CUDA is "
                                         "present", "bytes")
    pin_memory: bool | None = config_key(None, "`null` = pin when CUDA exists; `false` = never")
    cpu_pool: str | None = config_key(None, "`host:<name>`: the CPU tier is the host pool `<name>`, one pinned pool in "
                                            "`/dev/shm` shared by every process on the host that names it (its size "
                                            "is `cpu_bytes`, the same in each; docs/reliability.md, \"One host pool, "
                                            "many processes\"); `null`: a private CPU tier")
    cpu_pool_weight: int = config_key(1, "this namespace's weight in the host pool's one budget: its fair share is "
                                         "`cpu_bytes * weight / sum(weights)`, as `disk_weight` under a `shared` "
                                         "disk budget")
    disk_path: str | None = config_key(None, "directory of the disk tier (created 0700; `..` and symlinks refused); "
                                             "`null`: no disk tier")
    disk_bytes: int = config_key(10 << 30, "disk budget (slots of the block size rounded up to 4 KiB)", "bytes")
    compression: str = config_key("none", "`none` or `zstd` (kept per record only when smaller)")
    zstd_level: int = config_key(1, "zstd level")
    disk_sync: bool = config_key(False, "`true`: fdatasync each batch and sync LMDB commits (power-loss safe); "
                                        "`false`: crash safe, `flush()` for power loss")
    disk_workers: int = config_key(2, "threads of the CPU↔disk mover", "threads")
    disk_role: str = config_key("writer", "`reader`: never writes or deletes records in a directory another process "
                                          "writes (damaged records aside); pick up its new blocks with "
                                          "`store.refresh(keys)`")
    disk_budget: str = config_key("namespace", "`namespace`: `disk_bytes` is this namespace's quota in `disk_path`, "
                                               "shared by every process of it; `shared`: `disk_bytes` is one budget "
                                               "for every namespace on `disk_path`, split in fair shares by "
                                               "`disk_weight` (docs/reliability.md, \"Sharing one directory\")")
    disk_weight: int = config_key(1, "this namespace's weight in a `shared` budget: its fair share is `disk_bytes * "
                                     "weight / sum(weights)`; a tenant below its share evicts the one furthest above "
                                     "its share, never below it")
    namespace_extra: dict = config_key({}, "more namespace parts, e.g. `{\"tp\": \"0of2\"}`")
    eviction: str = config_key("lru", "`lru` or `s3fifo` (scan-resistant)")
    write_policy: str = config_key("write_back", "`write_back` (copy down on eviction) or `write_through` (copy down "
                                                 "at once)")
    promote_on_hit: bool = config_key(True, "a hit in a lower tier also copies the block one tier up")
    metrics_port: int | None = config_key(None, "serve Prometheus metrics on `127.0.0.1:PORT`")
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        shape = self.block_shape
        if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
            raise ConfigError(f"block_shape: expected a list of positive ints, got {shape!r}")
        shape = tuple(shape)
        if not shape or any(not isinstance(d, int) or isinstance(d, bool) or d <= 0 for d in shape):
            raise ConfigError(f"block_shape: expected a non-empty list of positive ints, got {list(shape)!r}")
        set_("block_shape", shape)
        set_("dtype", normalize_dtype(self.dtype))
        for key in _SIZE_KEYS:
            set_(key, parse_size(getattr(self, key), key))
        _check_int(self.page_size, "page_size", 1)
        _check_int(self.zstd_level, "zstd_level", -7, 22)
        _check_int(self.disk_workers, "disk_workers", 1, 64)
        for key in ("layout_tag", "model", "tenant_salt", "device"):
            if not isinstance(getattr(self, key), str):
                raise ConfigError(f"{key}: expected a string, got {getattr(self, key)!r}")
        for key in ("disk_sync", "promote_on_hit"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{key}: expected true or false, got {getattr(self, key)!r}")
        if self.pin_memory is not None and not isinstance(self.pin_memory, bool):
            raise ConfigError(f"pin_memory: expected true, false or null (auto), got {self.pin_memory!r}")
        _check_choice(self.compression, "compression", CODECS)
        _check_choice(self.disk_role, "disk_role", DISK_ROLES)
        _check_choice(self.disk_budget, "disk_budget", DISK_BUDGETS)
        _check_int(self.disk_weight, "disk_weight", 1, 1 << 20)
        _check_int(self.cpu_pool_weight, "cpu_pool_weight", 1, 1 << 20)
        check_pool_size(self.cpu_pool, self.cpu_bytes)
        extra = self.namespace_extra
        if not isinstance(extra, dict) or not all(isinstance(k, str) and isinstance(v, (str, int))
                                                  and not isinstance(v, bool) for k, v in extra.items()):
            raise ConfigError(f"namespace_extra: expected a mapping of names to strings or ints, got {extra!r}")
        set_("namespace_extra", {k: str(v) for k, v in extra.items()})
        _check_choice(self.eviction, "eviction", POLICIES)
        _check_choice(self.write_policy, "write_policy", WRITE_POLICIES)
        if self.metrics_port is not None:
            _check_int(self.metrics_port, "metrics_port", 1, 65535)
        if self.disk_path is not None:
            if not isinstance(self.disk_path, (str, os.PathLike)) or not str(self.disk_path):
                raise ConfigError(f"disk_path: expected a directory path or null, got {self.disk_path!r}")
            set_("disk_path", str(self.disk_path))
        self.check_remote_keys()
        if self.gpu_bytes == 0 and self.cpu_bytes == 0 and self.disk_path is None and self.remote_url is None:
            raise ConfigError("no tier configured: set at least one of gpu_bytes, cpu_bytes, disk_path or remote_url")


    @classmethod
    def valid_keys(cls) -> list[str]:
        """Names accepted by ``from_dict``."""
        return [f.name for f in fields(cls) if f.name != "extra"]

    @classmethod
    def from_dict(cls, data: dict, *, allow: tuple[str, ...] = ()) -> "StoreConfig":
        """Build from a mapping. Unknown keys raise ConfigError, except those in ``allow`` (kept in ``extra``)."""
        if not isinstance(data, dict):
            raise ConfigError(f"config must be a mapping, got {type(data).__name__}")
        valid = set(cls.valid_keys())
        unknown = sorted((k for k in data if k not in valid and k not in allow), key=repr)
        if unknown:
            raise ConfigError(f"unknown config key(s) {unknown}; valid keys: {sorted(valid)}")
        known = {k: v for k, v in data.items() if k in valid}
        extra = {k: v for k, v in data.items() if k in allow}
        return cls(**known, extra=extra)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "StoreConfig":
        """Build from a ``.json``, ``.yaml`` or ``.yml`` file (YAML is read with ``safe_load``)."""
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config file {str(p)!r}: {exc}") from None
        try:
            data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
        except (ValueError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot parse config file {str(p)!r}: {exc}") from None
        return cls.from_dict(data or {})

    def to_dict(self) -> dict:
        """Plain dict of every key (sizes as byte counts)."""
        return {k: (list(v) if isinstance(v, tuple) else dict(v) if isinstance(v, dict) else v) for k, v in
                ((f.name, getattr(self, f.name)) for f in fields(self)) if k != "extra"}


def _check_int(value: object, name: str, lo: int, hi: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ConfigError(f"{name}: expected an int {rng}, got {value!r}")


def _check_choice(value: object, name: str, choices) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"{name}: unknown value {value!r}; valid: {sorted(choices)}")
