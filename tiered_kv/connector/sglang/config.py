"""Translate SGLang's HiCache storage config into tiered_kv's, in one place.

SGLang hands the backend ``HiCacheStorageConfig`` (ranks, model name, MLA flag) plus
``extra_config``: the parsed ``--hicache-storage-backend-extra-config`` JSON. That dict
mixes SGLang's own keys (which SGLang reads, and which we accept and ignore) with ours.
Ours are validated here, once, when SGLang builds the backend: an unknown key fails the
server at start with a message that names it and lists the valid ones.

Threading contract: pure functions and frozen values; safe from any thread.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields

from tiered_kv.errors import ConfigError
from tiered_kv.connector.sglang.gate import DEFAULT_READ_GBPS, check_gate_options
from tiered_kv.connector.sglang.versions import check_supported, dp_rank, storage_writer
from tiered_kv.planner.policy import POLICIES
from tiered_kv.tiers.remote.settings import RemoteKeys
from tiered_kv.values.config_keys import config_key
from tiered_kv.values.record import CODECS
from tiered_kv.values.units import parse_size

#: Keys SGLang itself reads from the extra config (or that its dynamic loader needs).
#: They reach the backend and are ignored here.
SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1",
    "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys", "tp_lcm_size", "file_storage_path",
    "prefetch_timeout_max",  # popped by 0.5.17's HiRadixCache, passed through by 0.5.23 (see versions.py)
})


@dataclass(frozen=True)
class SGLangBackendConfig(RemoteKeys):
    """Our keys in ``--hicache-storage-backend-extra-config``, one ``config_key`` each (docs/sglang.md's table
    is generated from them)."""

    disk_path: str | None = config_key(None, "directory for the disk tier (LMDB index + payload file). Each "
                                             "namespace (see below) gets its own sub-directory. Required unless "
                                             "`cpu_bytes` or `remote_url` is set; with `remote_url` alone (no "
                                             "`disk_path`, no `cpu_bytes`) pages live only in Redis")
    disk_bytes: int = config_key(64 << 30, "disk capacity **per backend instance** (per TP rank for MHA; the "
                                           "writer's for MLA). `4096`, `512MiB`, `1TiB`, `1.5GB`. A full disk evicts "
                                           "by `eviction`", "bytes")
    disk_budget: str = config_key("namespace", "`namespace`: one directory per namespace under `disk_path`; "
                                               "`shared`: every model/tenant on `disk_path` writes "
                                               "`<disk_path>/shared/<rank>` under one budget of `disk_bytes`, fair "
                                               "shares by `disk_weight` (same page size needed; docs/reliability.md)")
    disk_weight: int = config_key(1, "this backend's weight in a `shared` disk budget")
    cpu_bytes: int = config_key(0, "optional CPU tier in front of the disk (our own, besides SGLang's host pool); "
                                   "with it, a hit query also starts a disk->CPU prefetch of the hit pages. `0` = no "
                                   "CPU tier", "bytes")
    cpu_pool: str | None = config_key(None, "`host:<name>`: our CPU tier is the host pool `<name>` in `/dev/shm`, "
                                            "one pool shared by every process on the host that names it (SGLang "
                                            "data-parallel replicas or servers, vLLM replicas, Python API "
                                            "processes; docs/reliability.md, \"One host pool, many processes\"): a "
                                            "page one replica stored is a hit for the others of the same model and "
                                            "rank. Its size is `cpu_bytes`, the same in each; with `disk_path` every "
                                            "page that lands in the pool is also written to disk. `null`: a private "
                                            "CPU tier (or none)")
    cpu_pool_weight: int = config_key(1, "this backend's weight in the host pool's one budget: its namespace's fair "
                                         "share is `cpu_bytes * weight / sum(weights)`")
    compression: str = config_key("none", "`none` or `zstd` (per record, kept only when smaller)")
    eviction: str = config_key("lru", "eviction policy of the store (see the core README)")
    disk_sync: bool = config_key(False, "`true`: fdatasync every write batch (power-loss safe, slower). `false`: "
                                        "survives a process crash")
    disk_workers: int = config_key(2, "disk mover threads", "threads")
    tenant_salt: str = config_key("", "mixed into every key; two salts never read each other's pages")
    model: str = config_key("", "overrides SGLang's served model name in the namespace (e.g. to share pages between "
                                "two served names of one checkpoint)")
    reader_refresh_s: float = config_key(0.0, "MLA reader ranks: on a miss they look the missing keys up in the "
                                              "shared directory's index (one LMDB read transaction, no payload I/O); "
                                              "this throttles it to once per so many seconds. `0` = on every miss. "
                                              "(Since issue 17 the store itself asks the directory on every lookup "
                                              "of keys it does not know, so reader ranks pick up the writer's pages "
                                              "even between refreshes.)", "s")
    radix_pages: int = config_key(1 << 20, "nodes of the prefix-key radix index; `0` turns it off", "nodes")
    chunk_pages: int = config_key(16, "pages per store job inside one SGLang batch; two staging buffers of this many "
                                      "pages per SGLang thread (2 x 16 x 8 MiB for an 8B model) let the copy of one "
                                      "chunk overlap the disk I/O of the other", "pages")
    disk_load_policy: str = config_key("auto", "which held pages SGLang is told about (the load gate below): `auto` "
                                               "(memory-tier pages, then each slower tier's pages while loading them "
                                               "beats recomputing them), `always` (every page held), `never` "
                                               "(memory-tier pages only)")
    disk_read_gbps: float = config_key(DEFAULT_READ_GBPS, "the disk tier's read rate the gate starts from; it then "
                                                          "follows the reads the backend times. Left at 3.0 it is a "
                                                          "guess: the tier's own writes of 4 MiB or more lower it and "
                                                          "its first read of 4 MiB or more replaces it. Set it to your "
                                                          "disk's cold read rate (`tiered-kv bench --dir /nvme`)",
                                       "GB/s")
    remote_read_gbps: float | None = config_key(None, "the remote tier's read rate the gate starts from (then "
                                                      "measured like the disk's); `null`: `disk_read_gbps`", "GB/s")
    disk_probe_every: int = config_key(32, "`auto` reads every N-th hit it declined (wholly or in part) anyway, so "
                                           "the estimates can rise again (a faster disk, a warm page cache); `0` = "
                                           "never")
    prefill_tokens_per_s: float = config_key(30000.0, "the prefill rate at short context the gate prices a recompute "
                                                      "with (your GPU and model; 30k ~ an 8B model on an H100/H200). "
                                                      "SGLang gives a storage backend no step timing, so this value "
                                                      "is used as set, not learned", "tokens/s")
    prefill_half_rate_context: int = config_key(32768, "the context at which attention halves the prefill rate "
                                                       "(a token attending to that many costs twice a token at the "
                                                       "start); about 2 x parameters / (4 x layers x heads x "
                                                       "head_dim): 30k for Llama-3-8B, 5k for a 0.6B model, 50k "
                                                       "for 70B", "tokens")
    metrics_port: int | None = config_key(None, "serve Prometheus metrics (the store families of "
                                                "`tiered_kv.store.metrics` plus the load gate's and the split's, store "
                                                "label `sglang`) "
                                                "on `127.0.0.1`: TP rank r of pipeline stage p serves `metrics_port + p "
                                                "* tp_size + r`; a port in use is logged and that rank serves none. "
                                                "Dashboard and `tiered-kv top`: docs/observability.md")

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        set_("disk_bytes", parse_size(self.disk_bytes, "disk_bytes"))
        set_("cpu_bytes", parse_size(self.cpu_bytes, "cpu_bytes"))
        if self.disk_path is not None:
            if not isinstance(self.disk_path, str) or not self.disk_path:
                raise ConfigError(f"disk_path: expected a directory path, got {self.disk_path!r}")
            set_("disk_path", os.path.expanduser(self.disk_path))
        if self.disk_path is None and self.cpu_bytes == 0 and self.remote_url is None:
            raise ConfigError("tiered_kv needs somewhere to keep pages: set disk_path (and disk_bytes), "
                              "cpu_bytes for a memory-only store, or remote_url for a Redis Cluster")
        if self.cpu_pool is not None:
            from tiered_kv.tiers.pool.place import check_pool_size  # lazily: the pool's module needs lmdb

            check_pool_size(self.cpu_pool, self.cpu_bytes)
        if not isinstance(self.compression, str) or self.compression not in CODECS:
            raise ConfigError(f"compression: unknown value {self.compression!r}; valid: {sorted(CODECS)}")
        if not isinstance(self.eviction, str) or self.eviction not in POLICIES:
            raise ConfigError(f"eviction: unknown value {self.eviction!r}; valid: {sorted(POLICIES)}")
        if self.disk_budget not in ("namespace", "shared"):
            raise ConfigError(f"disk_budget: unknown value {self.disk_budget!r}; valid: ['namespace', 'shared']")
        if not isinstance(self.disk_weight, int) or isinstance(self.disk_weight, bool) or self.disk_weight < 1:
            raise ConfigError(f"disk_weight: expected an int >= 1, got {self.disk_weight!r}")
        if not isinstance(self.disk_sync, bool):
            raise ConfigError(f"disk_sync: expected true or false, got {self.disk_sync!r}")
        for key, lo, hi in (("disk_workers", 1, 64), ("radix_pages", 0, 1 << 30), ("chunk_pages", 1, 1024),
                            ("cpu_pool_weight", 1, 1 << 20)):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise ConfigError(f"{key}: expected an int in [{lo}, {hi}], got {v!r}")
        for key in ("tenant_salt", "model"):
            if not isinstance(getattr(self, key), str):
                raise ConfigError(f"{key}: expected a string, got {getattr(self, key)!r}")
        self.check_remote_keys()  # the URL and every remote_* value now, at server start
        r = self.reader_refresh_s
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r <= 3600:
            raise ConfigError(f"reader_refresh_s: expected seconds in [0, 3600], got {r!r}")
        check_gate_options(self.disk_load_policy, self.disk_read_gbps, self.disk_probe_every,
                           self.prefill_tokens_per_s, self.prefill_half_rate_context, self.remote_read_gbps)
        p = self.metrics_port
        if p is not None and (isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= 65535):
            raise ConfigError(f"metrics_port: expected a TCP port in [1, 65535] (or null for no metrics), got {p!r}")

    @classmethod
    def valid_keys(cls) -> list[str]:
        """Our key names."""
        return [f.name for f in fields(cls)]

    @classmethod
    def from_extra_config(cls, extra: dict | None) -> "SGLangBackendConfig":
        """Pick our keys out of SGLang's extra config; unknown keys raise ConfigError naming them."""
        extra = dict(extra or {})
        ours = set(cls.valid_keys())
        unknown = sorted((k for k in extra if k not in ours and k not in SGLANG_KEYS), key=repr)
        if unknown:
            raise ConfigError(f"tiered_kv SGLang backend: unknown extra-config key(s) {unknown}; "
                              f"tiered_kv keys: {sorted(ours)}; SGLang keys (ignored): {sorted(SGLANG_KEYS)}")
        return cls(**{k: v for k, v in extra.items() if k in ours})


@dataclass(frozen=True)
class Scope:
    """Who this backend instance is: the parts of SGLang's config that name its pages."""

    model: str
    is_mla: bool
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    cp_rank: int
    cp_size: int
    is_writer: bool
    dp_rank: int = 0

    def extras(self) -> dict[str, str]:
        """Namespace extras: TP rank only for MHA (MLA pages are the same on every rank); PP and CP when used."""
        out: dict[str, str] = {"engine": "sglang"}
        if not self.is_mla:
            out["tp"] = f"{self.tp_rank}of{self.tp_size}"
        if self.pp_size > 1:
            out["pp"] = f"{self.pp_rank}of{self.pp_size}"
        if self.cp_size > 1:
            out["cp"] = f"{self.cp_rank}of{self.cp_size}"
        if self.dp_rank > 0:  # attention-DP groups: each writes its own directory (one writer per directory)
            out["dp"] = str(self.dp_rank)
        return out

    def metrics_offset(self) -> int:
        """This rank's offset from ``metrics_port``: each TP rank of each PP stage serves its own port."""
        return self.pp_rank * self.tp_size + self.tp_rank

    def shared_dir_name(self) -> str:
        """Disk sub-directory under a shared budget: one per rank position, every namespace in it."""
        parts = [f"{k}{v}" for k, v in sorted(self.extras().items()) if k != "engine"] or ["all"]
        return "shared/" + re.sub(r"[^A-Za-z0-9._-]+", "_", "-".join(parts))[:120]

    def dir_name(self, layout_tag: str, ns_hex: str) -> str:
        """Disk sub-directory for this scope: readable parts plus the namespace prefix (unique and stable)."""
        parts = [self.model or "model", layout_tag.replace("sglang:", "")]
        parts += [f"{k}{v}" for k, v in sorted(self.extras().items()) if k != "engine"]
        safe = re.sub(r"[^A-Za-z0-9._-]+", "_", "-".join(parts))[:120]
        return f"{safe}-{ns_hex[:12]}"


def scope_from(storage_config: object, model_override: str) -> Scope:
    """A ``Scope`` from SGLang's ``HiCacheStorageConfig`` (0.5.17 or 0.5.23; ConfigError for DCP > 1)."""
    c = storage_config
    check_supported(c)
    model = model_override or (c.model_name or "")
    return Scope(model=model, is_mla=bool(c.is_mla_model), tp_rank=int(c.tp_rank), tp_size=int(c.tp_size),
                 pp_rank=int(c.pp_rank), pp_size=int(c.pp_size), cp_rank=int(c.attn_cp_rank),
                 cp_size=int(c.attn_cp_size), is_writer=storage_writer(c), dp_rank=dp_rank(c))
