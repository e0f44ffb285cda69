"""Block geometry of the vLLM connector: what both sides agree on, derived from vLLM's own config objects.

``geometry(vllm_config, kv_cache_config, chunk_blocks)`` reads vLLM's KV cache groups into a frozen
``Geometry``: the scheduler's block size, blocks per stored chunk, bytes per block and per record on one
rank, TP size, the layout tag that goes into the key namespace, and one ``GroupGeo`` per KV cache group
(full attention, MLA, sliding window, Mamba). The scheduler process and every worker compute it from the
same ``VllmConfig`` and ``KVCacheConfig`` and so get equal answers. Models the connector cannot serve
raise ``ConfigError`` here, at start-up, with what to change.

Threading contract: pure functions and frozen values; safe from any thread.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

from tiered_kv.errors import ConfigError
from tiered_kv.values.layout import BlockLayout

log = logging.getLogger(__name__)

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
    step_tokens: int = 0  # vLLM's max_num_batched_tokens: the most tokens one step computes (0: not known)

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
        step = int(getattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens", 0) or 0)
        return Geometry(bs, k, layers, nbytes, tp, tag, (group,), replicated=replicated, step_tokens=step)
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
