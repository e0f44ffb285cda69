"""vLLM connector configuration: ``kv_connector_extra_config`` -> a validated, frozen ``ConnectorConfig``.

Also derives, from vLLM's own config objects, everything both sides of the connector must
agree on without talking to each other: block geometry, the key ``Namespace`` (model,
block layout, hash algorithm and seed, TP size, tenant salt), tier capacities in blocks and
the per-rank disk directory. The scheduler process and every worker compute these from
the same ``VllmConfig`` and ``KVCacheConfig`` and so get equal answers.

Block hashes are only stable across engine restarts if vLLM's ``NONE_HASH`` is: vLLM 0.26
draws it from ``os.urandom`` unless ``PYTHONHASHSEED`` is set, and newer versions do the
same for the xxhash algorithms. ``hash_identity`` detects that case; the connector then
warns loudly and puts a random nonce in the namespace, so a restarted engine never reads
blocks it cannot name (it simply misses).

Threading contract: pure functions and frozen values; safe from any thread.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields
from pathlib import Path

from tiered_kv.errors import ConfigError
from tiered_kv.values.keys import Namespace
from tiered_kv.values.layout import BlockLayout
from tiered_kv.planner.policy import POLICIES, WRITE_POLICIES
from tiered_kv.values.record import CODECS
from tiered_kv.values.units import parse_size

log = logging.getLogger(__name__)

STORE_POLICIES = ("eager", "on_finish", "none")
DISK_LOAD_POLICIES = ("auto", "always", "never")
LOAD_MODES = ("layerwise", "sync", "async")
IN_STEP_COPIES = ("copy_engine", "sm_kernel")


@dataclass(frozen=True)
class ConnectorConfig:
    """Every ``kv_connector_extra_config`` key the connector accepts (docs/vllm.md has the table)."""

    cpu_bytes: int = 8 << 30
    disk_path: str | None = None
    disk_bytes: int = 64 << 30
    eviction: str = "lru"
    write_policy: str = "write_back"
    promote_on_hit: bool = True
    store_policy: str = "eager"
    store_decode_tokens: bool = False
    min_hit_blocks: int = 1
    load_mode: str = "layerwise"
    sync_max_tokens: int = 65536
    load_groups: int = 0
    in_step_copy: str = "copy_engine"
    cross_layer_blocks: bool = True
    disk_load_policy: str = "auto"
    disk_read_gbps: float = 3.0
    disk_probe_every: int = 32
    prefill_tokens_per_s: float = 30000.0
    compression: str = "none"
    zstd_level: int = 1
    disk_sync: bool = False
    disk_workers: int = 2
    chunk_blocks: int = 16
    staging_chunks: int = 8
    model_id: str = ""
    tenant_salt: str = ""
    metrics_port: int | None = None

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        for key in ("cpu_bytes", "disk_bytes"):
            set_(key, parse_size(getattr(self, key), key))
        _choice(self.eviction, "eviction", POLICIES)
        _choice(self.write_policy, "write_policy", WRITE_POLICIES)
        _choice(self.store_policy, "store_policy", STORE_POLICIES)
        _choice(self.disk_load_policy, "disk_load_policy", DISK_LOAD_POLICIES)
        _choice(self.load_mode, "load_mode", LOAD_MODES)
        _choice(self.in_step_copy, "in_step_copy", IN_STEP_COPIES)
        _choice(self.compression, "compression", CODECS)
        for key in ("promote_on_hit", "store_decode_tokens", "disk_sync", "cross_layer_blocks"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{key}: expected true or false, got {getattr(self, key)!r}")
        _int(self.min_hit_blocks, "min_hit_blocks", 1)
        _int(self.sync_max_tokens, "sync_max_tokens", 0)
        _int(self.load_groups, "load_groups", 0, 4096)
        _int(self.disk_probe_every, "disk_probe_every", 0)
        _int(self.zstd_level, "zstd_level", -7, 22)
        _int(self.disk_workers, "disk_workers", 1, 64)
        _int(self.chunk_blocks, "chunk_blocks", 1, 4096)
        _int(self.staging_chunks, "staging_chunks", 1, 4096)
        for key in ("disk_read_gbps", "prefill_tokens_per_s"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ConfigError(f"{key}: expected a number > 0, got {v!r}")
            set_(key, float(v))
        if self.metrics_port is not None:
            _int(self.metrics_port, "metrics_port", 1, 65535)
        for key in ("model_id", "tenant_salt"):
            if not isinstance(getattr(self, key), str):
                raise ConfigError(f"{key}: expected a string, got {getattr(self, key)!r}")
        if self.disk_path is not None:
            if not isinstance(self.disk_path, (str, os.PathLike)) or not str(self.disk_path):
                raise ConfigError(f"disk_path: expected a directory path or null, got {self.disk_path!r}")
            set_("disk_path", str(self.disk_path))
        if self.cpu_bytes == 0:
            raise ConfigError("cpu_bytes: must be > 0 (the CPU tier stages every load and store); got 0")

    @classmethod
    def valid_keys(cls) -> list[str]:
        """Names accepted in ``kv_connector_extra_config``."""
        return [f.name for f in fields(cls)]

    @classmethod
    def from_extra_config(cls, extra: dict | None) -> "ConnectorConfig":
        """Build from vLLM's ``kv_connector_extra_config``; an unknown key raises ConfigError naming it."""
        extra = dict(extra or {})
        valid = set(cls.valid_keys())
        unknown = sorted(k for k in extra if k not in valid)
        if unknown:
            raise ConfigError(f"TieredKVConnector: unknown kv_connector_extra_config key(s) {unknown}; "
                              f"valid keys: {sorted(valid)}")
        try:
            return cls(**extra)
        except TypeError as exc:  # a value of a type the dataclass cannot take at all
            raise ConfigError(f"TieredKVConnector: bad kv_connector_extra_config: {exc}") from None


def _choice(value: object, name: str, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{name}: unknown value {value!r}; valid: {sorted(choices)}")


def _int(value: object, name: str, lo: int, hi: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ConfigError(f"{name}: expected an int {rng}, got {value!r}")


# ---------------------------------------------------------------------------------- hashing
@dataclass(frozen=True)
class HashIdentity:
    """Which block-hash function and seed produced ``request.block_hashes``; ``stable`` across restarts."""

    algo: str
    seed: str
    stable: bool


def hash_identity(algo: str, env: dict | None = None) -> HashIdentity:
    """Decide whether vLLM's block hashes survive a restart, given the hash algorithm name.

    Stable when ``PYTHONHASHSEED`` is set (every version seeds NONE_HASH from it), or when
    the installed vLLM derives NONE_HASH from a fixed seed for this algorithm (newer
    versions do for the sha256 family). vLLM 0.26 without ``PYTHONHASHSEED`` is unstable.
    """
    env = os.environ if env is None else env
    seed = env.get("PYTHONHASHSEED")
    if seed is not None:
        return HashIdentity(algo, f"env:{seed}", True)
    from vllm.v1.core import kv_cache_utils  # noqa: PLC0415 (vllm only inside connector/)

    fixed_seed_versions = "resolve_none_hash_seed" in vars(kv_cache_utils)
    if fixed_seed_versions and algo in ("sha256", "sha256_cbor"):
        return HashIdentity(algo, "vllm-fixed", True)
    return HashIdentity(algo, "random:" + os.urandom(8).hex(), False)


UNSTABLE_HASH_WARNING = (
    "TieredKVConnector: vLLM's block hashes change at every engine start with this setup "
    "(hash algo %r, PYTHONHASHSEED unset): blocks on disk can NOT be found again after a "
    "restart. Set PYTHONHASHSEED to the same value for every start (e.g. PYTHONHASHSEED=0) "
    "to make the disk tier persistent.")


# ---------------------------------------------------------------------------------- geometry
@dataclass(frozen=True)
class Geometry:
    """What both sides agree on: block and chunk size, per-rank bytes, TP, layer names, tags.

    The tiers hold *chunks* of ``chunk_blocks`` consecutive GPU blocks (one key, one CPU slot,
    one disk record each): per-chunk planner work is what keeps the scheduler cheap.
    """

    block_size: int
    chunk_blocks: int
    layer_names: tuple[str, ...]
    rank_block_nbytes: int
    tp_size: int
    tag: str

    @property
    def chunk_tokens(self) -> int:
        """Tokens per chunk."""
        return self.block_size * self.chunk_blocks

    @property
    def rank_chunk_nbytes(self) -> int:
        """Bytes of one chunk on one rank (a CPU slot, a disk record)."""
        return self.rank_block_nbytes * self.chunk_blocks

    @property
    def chunk_nbytes(self) -> int:
        """Bytes of one chunk summed over TP ranks (what the byte budgets are divided by)."""
        return self.rank_chunk_nbytes * self.tp_size

    def rank_layout(self, rank: int) -> BlockLayout:
        """The ``BlockLayout`` of one rank's slab rows and disk records (one chunk each)."""
        return BlockLayout((self.rank_chunk_nbytes,), "uint8", f"{self.tag}|rank{rank}/{self.tp_size}")


def geometry(vllm_config, kv_cache_config, chunk_blocks: int = 1) -> Geometry:
    """Block geometry from vLLM's configs; ConfigError for models this connector cannot serve."""
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        raise ConfigError(f"TieredKVConnector supports one KV cache group (full attention); this model has "
                          f"{len(groups)}. Hybrid models need a SupportsHMA connector.")
    spec = groups[0].kv_cache_spec
    layers = tuple(groups[0].layer_names)
    block_size = int(spec.block_size)
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    layout_name = (vars(vllm_config.cache_config).get("kv_cache_layout")
                   or os.environ.get("VLLM_KV_CACHE_LAYOUT") or "default")
    desc = ",".join(f"{k}={v}" for k, v in sorted(_spec_fields(spec).items()))
    tag = f"vllm|{type(spec).__name__}|{desc}|layers={len(layers)}|layout={layout_name}|chunk={chunk_blocks}"
    return Geometry(block_size, chunk_blocks, layers, int(spec.page_size_bytes) * len(layers), tp, tag)


def _spec_fields(spec) -> dict:
    out = {}
    for name in ("block_size", "num_kv_heads", "head_size", "head_size_v", "dtype", "sliding_window"):
        v = getattr(spec, name, None)  # spec classes differ between versions and attention kinds
        if v is not None:
            out[name] = str(v).removeprefix("torch.")
    return out


def namespace(cfg: ConnectorConfig, geo: Geometry, model: str, ident: HashIdentity) -> Namespace:
    """The key namespace: equal on every rank (the planner is shared); rank goes into the disk path."""
    layout = BlockLayout((geo.rank_chunk_nbytes,), "uint8", geo.tag)
    return Namespace(cfg.model_id or model, layout.fingerprint, cfg.tenant_salt,
                     (("engine", "vllm"), ("hash", ident.algo), ("seed", ident.seed), ("tp", str(geo.tp_size))))


def rank_disk_dir(cfg: ConnectorConfig, ns: Namespace, rank: int, tp_size: int) -> Path | None:
    """Directory of one rank's disk tier (None without ``disk_path``)."""
    if cfg.disk_path is None:
        return None
    return Path(cfg.disk_path) / ns.prefix.hex() / f"rank{rank}-of-{tp_size}"


def capacities(cfg: ConnectorConfig, geo: Geometry) -> tuple[int, int]:
    """(cpu chunks, disk chunks) for the whole engine; each rank holds its share of every chunk."""
    cpu = cfg.cpu_bytes // geo.chunk_nbytes
    if cpu == 0:
        raise ConfigError(f"cpu_bytes={cfg.cpu_bytes} is smaller than one chunk ({geo.chunk_nbytes} bytes = "
                          f"{geo.chunk_blocks} blocks over {geo.tp_size} rank(s)); raise cpu_bytes or lower chunk_blocks")
    disk = 0
    if cfg.disk_path is not None:
        disk = (cfg.disk_bytes // geo.tp_size) // disk_slot_nbytes(geo)
        if disk == 0:
            raise ConfigError(f"disk_bytes={cfg.disk_bytes} is smaller than one chunk per rank "
                              f"({disk_slot_nbytes(geo)} bytes)")
    return cpu, disk


def disk_slot_nbytes(geo: Geometry) -> int:
    """Bytes one chunk takes in a rank's disk payload file (records are 4 KiB aligned)."""
    from tiered_kv.tiers.disk import ALIGN  # lazily: the disk tier needs lmdb and zstandard, the CPU-only setup does not

    return -(-geo.rank_chunk_nbytes // ALIGN) * ALIGN
