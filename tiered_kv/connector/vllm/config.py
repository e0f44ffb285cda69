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
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path

from tiered_kv.errors import ConfigError
from tiered_kv.values.keys import Namespace
from tiered_kv.values.layout import BlockLayout
from tiered_kv.planner.policy import POLICIES, WRITE_POLICIES
from tiered_kv.planner.gate import DISK_LOAD_POLICIES
from tiered_kv.tiers.remote.settings import RemoteKeys
from tiered_kv.values.record import CODECS
from tiered_kv.values.units import parse_size

log = logging.getLogger(__name__)

STORE_POLICIES = ("eager", "on_finish", "none")
LOAD_MODES = ("layerwise", "sync", "async", "adaptive")
IN_STEP_COPIES = ("auto", "copy_engine", "sm_kernel", "staged")
LOAD_SUBMITS = ("pipelined", "upfront")
SWA_STORES = ("window", "all")


@dataclass(frozen=True)
class ConnectorConfig(RemoteKeys):
    """Every ``kv_connector_extra_config`` key the connector accepts (docs/vllm.md has the table)."""

    cpu_bytes: int = 8 << 30
    disk_path: str | None = None
    disk_bytes: int = 64 << 30
    disk_budget: str = "namespace"  # "shared": one budget for every engine on disk_path (docs/reliability.md)
    disk_weight: int = 1
    eviction: str = "s3fifo"  # scan-resistant: prompts seen once go before prefixes that were hit (issue 28)
    write_policy: str = "write_back"
    promote_on_hit: bool = True
    store_policy: str = "eager"
    store_decode_tokens: bool = False
    tail_chunks: bool = True
    min_hit_blocks: int = 1
    load_mode: str = "layerwise"
    sync_max_tokens: int = 65536
    step_load_bytes: int | str = "auto"  # load_mode adaptive: in-step load bytes per step ("auto": measured)
    load_gbps: float = 25.0  # load_mode adaptive: starting estimate of the H2D rate per rank (GB/s)
    trace_path: str | None = None  # per-step load trace (JSON lines), one file per worker rank (trace.py)
    load_groups: int = 0
    load_submit: str = "pipelined"  # in-step layer groups: the first before the forward, the rest between layers
    load_ahead_bytes: int | str = 256 << 20  # load_submit pipelined: in-step bytes submitted and not landed
    in_step_copy: str = "auto"  # per KV cache group and step: staged where the copy engine is descriptor-bound
    load_staging_bytes: int = 256 << 20
    load_staging_buffers: int = 1  # 2: staged loads alternate two halves, the next piece's DMA beside the last scatter
    load_stream_priority: int = -1  # CUDA priority of the loads' side stream (0 = the default priority)
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
    swa_store: str = "window"
    mla_store_once: bool = True
    staging_chunks: int = 8
    model_id: str = ""
    tenant_salt: str = ""
    metrics_port: int | None = None
    remote_feed_interval_s: float = 0.1  # scheduler: the presence feed reads at most once per interval

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        for key in ("cpu_bytes", "disk_bytes", "load_staging_bytes", "load_ahead_bytes"):
            set_(key, parse_size(getattr(self, key), key))
        if self.step_load_bytes != "auto":
            set_("step_load_bytes", parse_size(self.step_load_bytes, "step_load_bytes"))
            if self.step_load_bytes < 1:
                raise ConfigError(f"step_load_bytes: expected \"auto\" or a size > 0 (in-step load bytes per scheduler "
                                  f"step with load_mode adaptive), got {self.step_load_bytes!r}")
        _choice(self.eviction, "eviction", POLICIES)
        _choice(self.write_policy, "write_policy", WRITE_POLICIES)
        _choice(self.store_policy, "store_policy", STORE_POLICIES)
        _choice(self.disk_load_policy, "disk_load_policy", DISK_LOAD_POLICIES)
        _choice(self.load_mode, "load_mode", LOAD_MODES)
        _choice(self.in_step_copy, "in_step_copy", IN_STEP_COPIES)
        _choice(self.load_submit, "load_submit", LOAD_SUBMITS)
        _choice(self.compression, "compression", CODECS)
        _choice(self.swa_store, "swa_store", SWA_STORES)
        _choice(self.disk_budget, "disk_budget", ("namespace", "shared"))
        _int(self.disk_weight, "disk_weight", 1, 1 << 20)
        _int(self.load_stream_priority, "load_stream_priority", -16, 0)
        for key in ("promote_on_hit", "store_decode_tokens", "disk_sync", "cross_layer_blocks", "mla_store_once",
                    "tail_chunks"):
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
        for key in ("disk_read_gbps", "prefill_tokens_per_s", "load_gbps"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ConfigError(f"{key}: expected a number > 0, got {v!r}")
            set_(key, float(v))
        if self.metrics_port is not None:
            _int(self.metrics_port, "metrics_port", 1, 65535)
        for key in ("model_id", "tenant_salt"):
            if not isinstance(getattr(self, key), str):
                raise ConfigError(f"{key}: expected a string, got {getattr(self, key)!r}")
        if self.trace_path is not None:
            if not isinstance(self.trace_path, (str, os.PathLike)) or not str(self.trace_path):
                raise ConfigError(f"trace_path: expected a file path (each worker rank appends to "
                                  f"<trace_path>.rank<r>.jsonl) or null, got {self.trace_path!r}")
            set_("trace_path", str(self.trace_path))
        if self.disk_path is not None:
            if not isinstance(self.disk_path, (str, os.PathLike)) or not str(self.disk_path):
                raise ConfigError(f"disk_path: expected a directory path or null, got {self.disk_path!r}")
            set_("disk_path", str(self.disk_path))
        if self.load_ahead_bytes < 1:
            raise ConfigError(f"load_ahead_bytes: must be > 0 (in-step load bytes submitted ahead of the forward's "
                              f"layers with load_submit: pipelined); got {self.load_ahead_bytes}")
        if self.load_staging_bytes < 1:
            raise ConfigError(f"load_staging_bytes: must be > 0 (the device buffer of in_step_copy staged, or auto "
                              f"where it stages); got {self.load_staging_bytes}")
        if isinstance(self.load_staging_buffers, bool) or self.load_staging_buffers not in (1, 2):
            raise ConfigError(f"load_staging_buffers: expected 1 (a staged load's DMA and scatter in turn) or 2 (two "
                              f"halves of load_staging_bytes, the next piece's DMA beside the last scatter); "
                              f"got {self.load_staging_buffers!r}")
        if self.cpu_bytes == 0:
            raise ConfigError("cpu_bytes: must be > 0 (the CPU tier stages every load and store); got 0")
        if isinstance(self.remote_feed_interval_s, bool) or not isinstance(self.remote_feed_interval_s, (int, float)) \
                or not 0 <= self.remote_feed_interval_s <= 10:
            raise ConfigError(f"remote_feed_interval_s: expected seconds in [0, 10] (0.1: the presence feed reads "
                              f"at most 10 times a second), got {self.remote_feed_interval_s!r}")
        self.check_remote_keys()

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
GROUP_KINDS = ("full", "mla", "swa", "mamba")


@dataclass(frozen=True)
class GroupGeo:
    """One vLLM KV cache group as the tiers see it.

    One full-attention (or MLA) group: a chunk's record holds all ``chunk_blocks`` of its blocks
    (``stored``). Several groups (hybrid models, ``Geometry.parts``): each group's share of a chunk
    is a record of its own, a *part* of ``stored`` blocks (full attention and MLA: the chunk's
    blocks; sliding window: the chunk's blocks, kept only for chunks inside the window before a
    stored prefix's end; Mamba: the state block at the chunk's end). ``window_blocks`` (sliding
    window only): the blocks before a hit boundary the window reads.
    """

    kind: str
    block_size: int
    layer_names: tuple[str, ...]
    block_nbytes: int  # one block over the group's layers, on one rank
    chunk_blocks: int
    stored: int
    window_blocks: int = 0
    desc: str = ""
    index: int = 0  # the group's index in vLLM's kv_cache_groups (its place in every block-id tuple)

    @property
    def window_chunks(self) -> int:
        """Sliding window: the chunks before a hit boundary whose parts a hit reads (0 for other kinds)."""
        return -(-self.window_blocks // self.chunk_blocks) if self.window_blocks else 0


@dataclass(frozen=True)
class Geometry:
    """What both sides agree on: block and chunk size, per-rank bytes, TP, groups, tags.

    The tiers hold *chunks* of ``chunk_blocks`` consecutive scheduler blocks (one key, one CPU
    slot, one disk record each): per-chunk planner work is what keeps the scheduler cheap. One
    full-attention or MLA group (the positional fields describe it): a chunk's record holds its
    blocks. Several groups (``parts``): a record holds one group's part of a chunk, so a tier
    spends bytes only on what a later hit reads (a sliding window's blocks only near a stored
    prefix's end, a Mamba state only where one was kept). Every part takes one slot of
    ``rank_chunk_nbytes`` (the largest part, rounded up to a whole number of every group's
    blocks); in the slot a part's blocks start at row 0 of its group's plane (the planes of all
    groups overlay the slab). ``replicated``: every TP rank holds the same bytes (MLA), so one
    copy serves all ranks.
    """

    block_size: int  # the scheduler's block size (the LCM of the groups' block sizes)
    chunk_blocks: int
    layer_names: tuple[str, ...]
    rank_block_nbytes: int  # one scheduler block over every group, on one rank
    tp_size: int
    tag: str
    groups: tuple[GroupGeo, ...] = ()
    hash_block_size: int = 0  # tokens per entry of request.block_hashes (0: block_size)
    replicated: bool = False

    def __post_init__(self) -> None:
        if not self.groups:
            k = self.chunk_blocks
            object.__setattr__(self, "groups", (GroupGeo("full", self.block_size, tuple(self.layer_names),
                                                          self.rank_block_nbytes, k, k),))
        if not self.hash_block_size:
            object.__setattr__(self, "hash_block_size", self.block_size)

    @property
    def chunk_tokens(self) -> int:
        """Tokens per chunk."""
        return self.block_size * self.chunk_blocks

    @property
    def parts(self) -> bool:
        """Records are parts (one group's share of a chunk): every model but one full-attention or MLA group."""
        return len(self.groups) > 1 or self.groups[0].kind not in ("full", "mla")

    @property
    def part_blocks(self) -> int:
        """GPU ids one group's share of a job item carries (the largest part; the whole record with one group)."""
        return max(g.stored for g in self.groups)

    @property
    def slot_blocks(self) -> int:
        """GPU ids per job item: each group's ``part_blocks`` in group order (parts: only the item's group
        holds ids, the others -1), or the record's blocks over all groups."""
        if self.parts:
            return len(self.groups) * self.part_blocks
        return sum(g.stored for g in self.groups)

    @property
    def block_level_errors(self) -> bool:
        """Whether vLLM takes per-block load errors: only with one KV cache group (0.26 crashes on
        more, 0.32 refuses them on purpose)."""
        return len(self.groups) == 1

    @property
    def has_mamba(self) -> bool:
        """A Mamba / linear-attention group is present (a hit must end where its state was kept)."""
        return any(g.kind == "mamba" for g in self.groups)

    @property
    def rank_chunk_nbytes(self) -> int:
        """Bytes of one record on one rank (a CPU slot, a disk record): a chunk, or with ``parts`` one slot
        that holds any group's part."""
        if self.parts:
            return parts_slot_nbytes(self.groups)
        return sum(g.stored * g.block_nbytes for g in self.groups)

    @property
    def chunk_nbytes(self) -> int:
        """Bytes of one record summed over the copies kept (what the byte budgets are divided by):
        one per TP rank, or one in all when ``replicated``."""
        return self.rank_chunk_nbytes * (1 if self.replicated else self.tp_size)

    @property
    def sections(self) -> list[tuple[int, int]]:
        """``(GPU ids per item, bytes per block)`` of each group, in group order."""
        if self.parts:
            p = self.part_blocks
            return [(p, g.block_nbytes) for g in self.groups]
        return [(g.stored, g.block_nbytes) for g in self.groups]

    @property
    def plane_rows(self) -> list[int]:
        """Block rows per slot in each group's plane of the slab (the planes overlay the whole slot)."""
        slot = self.rank_chunk_nbytes
        return [slot // g.block_nbytes for g in self.groups]

    def hit_nbytes(self, tokens: int) -> int:
        """About the bytes a hit of ``tokens`` moves into one rank's GPU (full attention: every block;
        sliding window: the window; Mamba: one state)."""
        if not self.parts:
            return -(-tokens // self.block_size) * self.rank_chunk_nbytes // self.chunk_blocks
        total = 0
        for g in self.groups:
            blocks = -(-tokens // g.block_size)
            if g.kind == "swa":
                blocks = min(blocks, g.window_blocks)
            elif g.kind == "mamba":
                blocks = 1
            total += blocks * g.block_nbytes
        return total

    def rank_layout(self, rank: int) -> BlockLayout:
        """The ``BlockLayout`` of one rank's slab rows and disk records (one chunk each)."""
        who = "replicated" if self.replicated else f"rank{rank}/{self.tp_size}"
        return BlockLayout((self.rank_chunk_nbytes,), "uint8", f"{self.tag}|{who}")


def parts_slot_nbytes(groups: tuple[GroupGeo, ...]) -> int:
    """One slot for any group's part: the largest part, rounded up to a whole number of every group's blocks
    (each group's plane addresses the slot in its own block rows)."""
    unit = math.lcm(*(g.block_nbytes for g in groups))
    largest = max(g.stored * g.block_nbytes for g in groups)
    return -(-largest // unit) * unit


def geometry(vllm_config, kv_cache_config, chunk_blocks: int = 1, mla_store_once: bool = True) -> Geometry:
    """Block geometry from vLLM's configs; ConfigError for models this connector cannot serve.

    One full-attention (or MLA) group keeps the geometry, tag and record bytes of the
    single-group connector, so its existing disk caches stay valid. Several groups (hybrid
    models: sliding window + full attention, Mamba + attention) store one part per group and chunk.
    """
    from vllm.v1.kv_cache_interface import MLAAttentionSpec  # noqa: PLC0415 (vllm only inside connector/)

    vllm_index = {id(g): i for i, g in enumerate(kv_cache_config.kv_cache_groups)}
    groups = [g for g in kv_cache_config.kv_cache_groups
              if vars(g).get("enable_kv_transfer", True)]  # 0.32: groups vLLM rebuilds after a load
    if not groups:
        raise ConfigError("TieredKVConnector: the model has no KV cache group to store")
    kinds = [_kind(g.kv_cache_spec) for g in groups]
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    layout_name = (vars(vllm_config.cache_config).get("kv_cache_layout")
                   or os.environ.get("VLLM_KV_CACHE_LAYOUT") or "default")
    if len(groups) == 1 and kinds[0] in ("full", "mla"):
        spec = groups[0].kv_cache_spec
        layers = tuple(groups[0].layer_names)
        desc = ",".join(f"{k}={v}" for k, v in sorted(_spec_fields(spec).items()))
        tag = f"vllm|{type(spec).__name__}|{desc}|layers={len(layers)}|layout={layout_name}|chunk={chunk_blocks}"
        replicated = (mla_store_once and isinstance(spec, MLAAttentionSpec)
                      and _mla_replicated(vllm_config, kv_cache_config, spec))
        bs, nbytes, k = int(spec.block_size), int(spec.page_size_bytes) * len(layers), chunk_blocks
        group = GroupGeo(kinds[0], bs, layers, nbytes, k, k, index=vllm_index[id(groups[0])])
        return Geometry(bs, k, layers, nbytes, tp, tag, (group,), replicated=replicated)
    return _hybrid_geometry(vllm_config, kv_cache_config, groups, kinds, chunk_blocks, layout_name, tp, vllm_index)


def _hybrid_geometry(vllm_config, kv_cache_config, groups, kinds, chunk_blocks, layout_name, tp,
                     vllm_index) -> Geometry:
    pc = vllm_config.parallel_config
    cp = [int(vars(pc).get(name, 1) or 1) for name in ("decode_context_parallel_size", "prefill_context_parallel_size")]
    if cp != [1, 1]:
        raise ConfigError("TieredKVConnector: hybrid models (several KV cache groups) with decode/prefill context "
                          "parallelism are not supported; run without DCP/PCP")
    if vllm_config.speculative_config is not None and any(k in ("swa", "mamba") for k in kinds):
        raise ConfigError("TieredKVConnector: sliding-window or Mamba KV cache groups with speculative decoding "
                          "(EAGLE/MTP) are not supported yet: a hit there needs one more block than the window; "
                          "run without speculative decoding or with --disable-hybrid-kv-cache-manager")
    sched_bs = math.lcm(*(int(g.kv_cache_spec.block_size) for g in groups))
    hash_bs = _hash_block_size(vllm_config, kv_cache_config)
    if "mamba" in kinds:
        _check_mamba(vllm_config, [g.kv_cache_spec for g, k in zip(groups, kinds) if k == "mamba"], sched_bs, hash_bs)
        if chunk_blocks != 1:
            log.info("TieredKVConnector: Mamba hybrid: a chunk is one %d-token scheduler block (chunk_blocks=%d "
                     "ignored): vLLM keeps a recurrent state only where a step ends, on block boundaries",
                     sched_bs, chunk_blocks)
        chunk_blocks = 1
    chunk_tokens = sched_bs * chunk_blocks
    out = []
    for g, kind in zip(groups, kinds):
        spec = g.kv_cache_spec
        bs = int(spec.block_size)
        k = chunk_tokens // bs
        window = 0
        if kind == "swa":
            # tokens before a boundary the window still reads (0.32 keeps extra_retained_tokens more)
            reach = int(spec.sliding_window) - 1 + int(vars(spec).get("extra_retained_tokens", 0) or 0)
            window = max(1, -(-reach // bs))
        stored = 1 if kind == "mamba" else k  # a Mamba part is the state block at the chunk's end
        layers = tuple(g.layer_names)
        fields_ = ",".join(f"{a}={b}" for a, b in sorted(_spec_fields(spec).items()))
        desc = f"{kind}:{type(spec).__name__}:{fields_}:layers={len(layers)}:part={stored}"
        out.append(GroupGeo(kind, bs, layers, _real_page_nbytes(spec) * len(layers), k, stored, window, desc,
                            index=vllm_index[id(g)]))
    tag = "vllm|parts|" + "+".join(gg.desc for gg in out) + f"|layout={layout_name}|chunk={chunk_blocks}"
    return Geometry(sched_bs, chunk_blocks, tuple(n for gg in out for n in gg.layer_names),
                    sum(gg.block_nbytes * (sched_bs // gg.block_size) for gg in out), tp, tag, tuple(out), hash_bs)


def _kind(spec) -> str:
    """The group kind of a KV cache spec, or ConfigError for kinds the connector cannot store."""
    from vllm.v1.kv_cache_interface import (  # noqa: PLC0415
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    if isinstance(spec, MambaSpec):
        return "mamba"
    if isinstance(spec, ChunkedLocalAttentionSpec):
        raise ConfigError("TieredKVConnector: chunked local attention groups (Llama 4) are not supported with vLLM's "
                          "hybrid KV cache manager; run with --disable-hybrid-kv-cache-manager (the connector then "
                          "stores them as full attention)")
    if isinstance(spec, SlidingWindowSpec):
        return "swa"
    if isinstance(spec, MLAAttentionSpec):
        return "mla"
    if isinstance(spec, FullAttentionSpec):  # incl. HMA-off specs that carry sliding_window/attention_chunk_size
        return "full"
    raise ConfigError(f"TieredKVConnector: KV cache spec {type(spec).__name__} is not supported (supported: full "
                      f"attention, MLA, sliding window, Mamba with mamba_cache_mode 'align')")


def _check_mamba(vllm_config, specs, sched_bs: int, hash_bs: int) -> None:
    """Mamba / linear-attention groups: only where vLLM itself caches their state at block boundaries."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: PLC0415

    # version probe, kept to this function: the property exists from vLLM 0.32 on
    if "supports_divergent_local_hybrid_hits" not in vars(KVConnectorBase_V1):
        raise ConfigError(
            "TieredKVConnector: Mamba/linear-attention hybrid models need vLLM >= 0.32: this vLLM gives KV "
            "connectors the longest local hit of any group for these models, so a stored prefix could resume "
            "with a stale recurrent state. Upgrade vLLM, or run without TieredKVConnector")
    cc = vllm_config.cache_config
    for spec in specs:
        mode = str(vars(spec).get("mamba_cache_mode", "none"))
        if mode != "align" or not cc.enable_prefix_caching:
            raise ConfigError(
                f"TieredKVConnector: vLLM keeps no recurrent state at block boundaries for this model "
                f"(mamba_cache_mode={mode!r}, prefix caching {'on' if cc.enable_prefix_caching else 'off'}), so "
                f"nothing can be stored. Run with --enable-prefix-caching (mamba_cache_mode 'align') or "
                f"without TieredKVConnector")
        if int(vars(spec).get("num_speculative_blocks", 0) or 0):
            raise ConfigError("TieredKVConnector: Mamba groups with speculative blocks (MTP) are not supported; "
                              "run without speculative decoding")
    if hash_bs != sched_bs:
        raise ConfigError(f"TieredKVConnector: Mamba hybrid with prefix hashes every {hash_bs} tokens but "
                          f"{sched_bs}-token blocks (prefix_match_unit): not supported; leave prefix_match_unit unset")


def _hash_block_size(vllm_config, kv_cache_config) -> int:
    """Tokens per entry of ``request.block_hashes`` (the GCD of the groups' block sizes, or vLLM's override)."""
    resolved = vars(kv_cache_config).get("hash_block_size")  # 0.32: the engine core resolved it
    if resolved:
        return int(resolved)
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes  # noqa: PLC0415

    return int(resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[1])


def _mla_replicated(vllm_config, kv_cache_config, spec) -> bool:
    """True when every TP rank holds the same MLA latent bytes, so one stored copy serves all ranks."""
    pc = vllm_config.parallel_config
    tp = int(pc.tensor_parallel_size)
    if tp <= 1 or int(spec.num_kv_heads) != 1:
        return False
    sharded = [int(vars(pc).get(name, 1) or 1) for name in ("pipeline_parallel_size", "decode_context_parallel_size",
                                                             "prefill_context_parallel_size", "nnodes")]
    if any(v != 1 for v in sharded):  # pipeline stages hold other layers; CP shards tokens; nodes share no memory
        return False
    replicas = vars(kv_cache_config).get("kv_tp_replicas")  # 0.32 says it outright
    return replicas is None or int(replicas) == tp


def _real_page_nbytes(spec) -> int:
    """Bytes of one block of one layer that hold data (vLLM pads Mamba pages to the attention page)."""
    real = getattr(spec, "real_page_size_bytes", None)  # version and spec-kind probe
    return int(real if real is not None else spec.page_size_bytes)


def _spec_fields(spec) -> dict:
    out = {}
    for name in ("block_size", "num_kv_heads", "head_size", "head_size_v", "dtype", "sliding_window"):
        v = getattr(spec, name, None)  # spec classes differ between versions and attention kinds
        if v is not None:
            out[name] = str(v).removeprefix("torch.")
    from vllm.v1.kv_cache_interface import MambaSpec  # noqa: PLC0415

    if isinstance(spec, MambaSpec):  # the tag of a state: its tensors' shapes and dtypes
        out["shapes"] = str(tuple(tuple(s) for s in spec.shapes))
        out["dtypes"] = ",".join(str(d).removeprefix("torch.") for d in spec.dtypes)
    return out


def namespace(cfg: ConnectorConfig, geo: Geometry, model: str, ident: HashIdentity) -> Namespace:
    """The key namespace: equal on every rank (the planner is shared); rank goes into the disk path.

    A replicated (MLA) cache holds one copy for every rank, so it is valid for any TP size.
    """
    layout = BlockLayout((geo.rank_chunk_nbytes,), "uint8", geo.tag)
    tp = "replicated" if geo.replicated else str(geo.tp_size)
    return Namespace(cfg.model_id or model, layout.fingerprint, cfg.tenant_salt,
                     (("engine", "vllm"), ("hash", ident.algo), ("seed", ident.seed), ("tp", tp)))


def rank_disk_dir(cfg: ConnectorConfig, ns: Namespace, rank: int, tp_size: int,
                  replicated: bool = False) -> Path | None:
    """Directory of one rank's disk tier (None without ``disk_path``); one for all ranks when ``replicated``.

    ``disk_budget`` "namespace": one directory per namespace; "shared": every namespace's rank r shares
    ``<disk_path>/shared/rank{r}-of-{tp}``, so one budget covers every engine of that geometry on the path.
    """
    if cfg.disk_path is None:
        return None
    top = "shared" if cfg.disk_budget == "shared" else ns.prefix.hex()
    return Path(cfg.disk_path) / top / ("replicated" if replicated else f"rank{rank}-of-{tp_size}")


def rank_remote_part(geo: Geometry, rank: int) -> str:
    """The part of the remote tier's Redis keys that holds one rank's share (one for all ranks when replicated)."""
    return "replicated" if geo.replicated else f"rank{rank}-of-{geo.tp_size}"


def capacities(cfg: ConnectorConfig, geo: Geometry) -> tuple[int, int]:
    """(cpu chunks, disk chunks) for the whole engine; each rank holds its share of every chunk."""
    cpu = cfg.cpu_bytes // geo.chunk_nbytes
    if cpu == 0:
        copies = "1 copy for all ranks" if geo.replicated else f"{geo.tp_size} rank(s)"
        raise ConfigError(f"cpu_bytes={cfg.cpu_bytes} is smaller than one chunk ({geo.chunk_nbytes} bytes = "
                          f"{geo.chunk_blocks} blocks over {copies}); raise cpu_bytes or lower chunk_blocks")
    disk = 0
    if cfg.disk_path is not None:
        disk = (cfg.disk_bytes // (1 if geo.replicated else geo.tp_size)) // disk_slot_nbytes(geo)
        if disk == 0:
            raise ConfigError(f"disk_bytes={cfg.disk_bytes} is smaller than one chunk per rank "
                              f"({disk_slot_nbytes(geo)} bytes)")
    return cpu, disk


def disk_slot_nbytes(geo: Geometry) -> int:
    """Bytes one chunk takes in a rank's disk payload file (records are 4 KiB aligned)."""
    from tiered_kv.tiers.disk import ALIGN  # lazily: the disk tier needs lmdb and zstandard, the CPU-only setup does not

    return -(-geo.rank_chunk_nbytes // ALIGN) * ALIGN
