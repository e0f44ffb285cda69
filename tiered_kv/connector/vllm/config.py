"""vLLM connector configuration: ``kv_connector_extra_config`` -> a validated, frozen ``ConnectorConfig``.

Also derives, from it and vLLM's own config objects, everything both sides of the connector must
agree on without talking to each other: the key ``Namespace`` (model, block layout, hash
algorithm and seed, TP size, tenant salt), tier capacities in blocks and the per-rank disk
directory; the block geometry itself is ``geometry.py``'s. The scheduler process and every
worker compute these from the same ``VllmConfig`` and ``KVCacheConfig`` and so get equal answers.

Block hashes are only stable across engine restarts if vLLM's ``NONE_HASH`` is: vLLM 0.26
draws it from ``os.urandom`` unless ``PYTHONHASHSEED`` is set, and newer versions do the
same for the xxhash algorithms. ``hash_identity`` detects that case; the connector then
warns loudly and puts a random nonce in the namespace, so a restarted engine never reads
blocks it cannot name (it simply misses).

Threading contract: pure functions and frozen values; safe from any thread.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path

from tiered_kv.errors import ConfigError
from tiered_kv.values.config_keys import config_key
from tiered_kv.values.keys import Namespace
from tiered_kv.values.layout import BlockLayout
from tiered_kv.planner.policy import POLICIES, WRITE_POLICIES
from tiered_kv.planner.gate import DISK_LOAD_POLICIES
from tiered_kv.planner.rates import DEFAULT_READ_GBPS
from tiered_kv.tiers.remote.settings import RemoteKeys
from tiered_kv.values.record import CODECS
from tiered_kv.values.units import parse_size
from tiered_kv.connector.vllm.geometry import Geometry

STORE_POLICIES = ("eager", "on_finish", "none")
STORE_STARTS = ("after_sampler", "forward_end")
LOAD_MODES = ("layerwise", "sync", "async", "adaptive")
IN_STEP_COPIES = ("auto", "copy_engine", "sm_kernel", "staged")
LOAD_SUBMITS = ("pipelined", "upfront")
STAGED_SCATTERS = ("index_put", "kernel")
SWA_STORES = ("window", "all")


@dataclass(frozen=True)
class ConnectorConfig(RemoteKeys):
    """Every ``kv_connector_extra_config`` key the connector accepts, one ``config_key`` each (the table in
    docs/vllm.md is generated from them: ``scripts/config_docs.py``)."""

    cpu_bytes: int = config_key(8 << 30, "pinned host memory for the CPU tier, **summed over TP ranks** (like vLLM's "
                                         "`kv_offloading_size`); each rank pins its share", "bytes")
    cpu_pool: str | None = config_key(None, "`host:<name>`: the CPU tier is the host pool `<name>` in `/dev/shm`, one "
                                            "pinned pool shared by every engine and Python API process on the host "
                                            "that names it (its size is `cpu_bytes`, the same in each): a chunk one "
                                            "replica stored is a hit for every replica of the same model. TP=1, one "
                                            "KV cache group, no `disk_path` or `remote_url` (docs/vllm.md, \"One host "
                                            "pool for several replicas\"); `null`: a private CPU tier")
    cpu_pool_weight: int = config_key(1, "this engine's weight in the host pool's one budget: its model's fair share "
                                         "is `cpu_bytes * weight / sum(weights)` (engines of one model share one "
                                         "namespace and one share)")
    cpu_pool_poll_s: float = config_key(0.02, "vLLM scheduler process with `cpu_pool`: how often a thread reads the "
                                              "pool's index for the chunks other processes stored (a chunk stored "
                                              "elsewhere is a hit here within about that long; the scheduler "
                                              "thread never reads the pool itself)", "s")
    disk_path: str | None = config_key(None, "directory of the disk tier; a sub-directory per namespace and per TP "
                                             "rank is created inside; `null`: no disk tier")
    disk_bytes: int = config_key(64 << 30, "disk budget summed over TP ranks (used only with `disk_path`)", "bytes")
    disk_budget: str = config_key("namespace", "`namespace`: one directory per model/namespace under `disk_path`; "
                                               "`shared`: every engine on `disk_path` writes "
                                               "`<disk_path>/shared/rank{r}-of-{tp}` under one budget of "
                                               "`disk_bytes`, fair shares by `disk_weight` (engines must share the "
                                               "chunk geometry; docs/reliability.md)")
    disk_weight: int = config_key(1, "this engine's weight in a `shared` disk budget")
    eviction: str = config_key("s3fifo", "eviction policy of every tier: `s3fifo` (scan-resistant: blocks stored "
                                         "once and never read again go before prefixes that were hit; each "
                                         "request's prefix is kept in order, deepest chunk first to go) or `lru` "
                                         "(least recently used; under a cyclic workload larger than the tier it "
                                         "evicts the next conversation's prefix at every recompute: docs/vllm.md "
                                         "\"Hybrid models\")")
    write_policy: str = config_key("write_back", "`write_back`: a chunk goes to disk when the CPU tier evicts it; "
                                                 "`write_through`: every stored chunk is also written to disk at "
                                                 "once (what survives a restart: everything, not only evicted "
                                                 "chunks). Hybrid models with a disk tier always use `write_through` "
                                                 "(see \"Hybrid models\")")
    promote_on_hit: bool = config_key(True, "a disk hit is also copied up into the CPU tier")
    store_policy: str = config_key("eager", "`eager`: store each full chunk of the prompt in the step that computed "
                                            "it; `on_finish`: store when the request finishes (only chunks whose GPU "
                                            "blocks were not re-used by then); `none`: never store (read-only, e.g. "
                                            "a warm disk)")
    store_start: str = config_key("after_sampler", (
        "when a step's stores start copying. `after_sampler`: held until the next step's "
        "`bind_connector_metadata`, then queued behind the sampler's copy of the tokens to the host, which a store "
        "copied from the forward's end delayed by its whole copy (H200, 1,312-token Llama-3-8B prefill: +3.8 ms a "
        "step; see \"When stores copy\"); `forward_end`: at once, as before 2026-11-30"))
    store_decode_tokens: bool = config_key(False, "also store chunks made of generated tokens")
    tail_chunks: bool | str = config_key("auto", (
        "also store the full blocks after a prompt's last whole chunk once its prefill is complete (a *tail piece*: one "
        "CPU slot / disk record, per KV cache group for hybrids) and hit them after the whole chunks; without it a turn "
        "recomputes on average half a chunk of its prefix. `auto`: for one full-attention or MLA KV cache group, not "
        "for sliding-window hybrids, where they cost more load than the compute they save (see \"Tail pieces\"); "
        "`true`: there too; `false`: never. Mamba hybrids store whole chunks only"))
    min_hit_blocks: int = config_key(1, "smallest external hit (in GPU blocks) worth a load", "GPU blocks")
    load_mode: str = config_key("layerwise", (
        "how CPU-tier hits load (disk hits load asynchronously, unless `disk_overlap_bytes` reads them under "
        "the forward). `layerwise`: inside the step vLLM schedules the request; the load is submitted before "
        "the forward, one CUDA event per group of layers, and each attention layer's stream waits (on the "
        "GPU) for its own layers only. `sync`: inside the step, the forward waits for the whole load. "
        "`async`: between steps (the request waits in `WAITING_FOR_REMOTE_KVS`, other requests keep running)."
        " `adaptive`: `layerwise` while the step's in-step bytes stay within `step_load_bytes`, asynchronous "
        "past it; a step's first hit always loads in-step (see \"Adaptive load admission\"). The default stays "
        "`layerwise` until a GPU serving run picks one"))
    sync_max_tokens: int = config_key(65536, "largest CPU hit loaded inside a step; bigger hits load "
        "asynchronously so one request cannot stall a whole batch for long", "tokens")
    step_load_bytes: int | str = config_key("auto", "`load_mode: adaptive` only: the in-step load bytes (per rank) "
                                                    "one scheduler step may take; the hits after the step's first "
                                                    "that would pass it load asynchronously. `auto`: the measured "
                                                    "H2D rate (bytes-weighted over the last 32 completed "
                                                    "asynchronous CPU loads of 1 MiB or more, `load_gbps` counting "
                                                    "as 64 MiB of them, clamped to 1-500 GB/s) x the engine's recent "
                                                    "prefill-step time (steps that schedule more tokens than "
                                                    "requests; the longest of the two step intervals after each, "
                                                    "running average; until one is measured, all busy steps' "
                                                    "interval; 2-250 ms)", "bytes")
    load_gbps: float = config_key(25.0, "`load_mode: adaptive` with `step_load_bytes: auto`: the H2D rate per rank "
                                        "(GB/s) assumed until asynchronous CPU loads were measured; it counts as a "
                                        "64 MiB load in the measured rate until 64 MiB of measured loads are in its "
                                        "window (clamped to 1-500 GB/s)", "GB/s")
    trace_path: str | None = config_key(None, "a per-step trace: each worker rank appends to `<trace_path>.rank<r>"
                                              ".jsonl` a line per step that loaded or scheduled >= 128 tokens (loads, "
                                              "their GPU times, the forward's launch and GPU time: `trace.py`), the "
                                              "scheduler to `<trace_path>.sched.jsonl` when it scheduled the step and "
                                              "applied its output. `serve_bench.py --trace` sets it, summarises per phase")
    load_groups: int = config_key(0, (
        "`layerwise`/`adaptive` only: how many layer groups (one CUDA event each) a step's in-step copy is "
        "cut into. `0` = automatic: a copy within `load_ahead_bytes` one group per 32 MiB, at most 2 (it is "
        "submitted before the forward is launched, so more groups delay the launch); a larger one "
        "(`load_submit: pipelined`) groups of half of `load_ahead_bytes`, at most one per layer"))
    load_submit: str = config_key("pipelined", (
        "`layerwise`/`adaptive`: when a step's in-step copy goes to the driver. `pipelined`: up to "
        "`load_ahead_bytes` before the forward, the rest from `wait_for_layer_load` between the forward's "
        "layers (the driver spends ~1 us of vLLM's thread per 64 KiB run, so a 4.7 GB burst submitted whole "
        "delayed the forward's launch ~70 ms); `upfront`: all of it before the forward (H200, Llama-3-8B, "
        "three paired starts: c32 TTFT p50 276.7 vs 241.5 ms pipelined, c8 90.1 vs 78.6)"))
    load_ahead_bytes: int | str = config_key(256 << 20, "`load_submit: pipelined`: the most in-step bytes submitted "
                                                        "and not yet landed; a step's copy within it goes whole "
                                                        "before the forward. 64 MiB was slower at c8 (128.9 ms, one "
                                                        "start): too little in flight between two layers of an eager "
                                                        "forward", "bytes")
    in_step_copy: str = config_key("auto", "how in-step loads move bytes: `auto` (per KV cache group and step: "
                                           "`staged` on CUDA where the copy engine is bound by its ~1 us per "
                                           "descriptor: layer-blocks of at most 32 KiB (4-KV-head models, MLA) or "
                                           "a copy of 32,768 or more of them; the SM kernel for a large copy in a "
                                           "step with few tokens (`in_step_sm_max_tokens`); `staged` for one of "
                                           "`in_step_staged_min_descriptors` or more; else `copy_engine`; a "
                                           "cross-layer KV tensor's block counts as one run; docs/vllm.md, "
                                           "\"In-step loads\") or `copy_engine` (DMA, batched descriptors; leaves "
                                           "the SMs to the forward) or `sm_kernel` (a Triton kernel reading pinned "
                                           "memory: far less time on vLLM's thread for per-layer KV tensors, ~10% "
                                           "lower PCIe rate, and it shares the SMs with the forward) or `staged` "
                                           "(one DMA per run of adjacent CPU slots into a device staging buffer, "
                                           "then an on-device scatter into the per-layer blocks; docs/gpu_copy.md, "
                                           "\"Staged loads\")")
    in_step_sm_max_tokens: int = config_key(512, "`in_step_copy: auto`: a KV cache group's in-step copy that would "
                                                 "go to the copy engine as 4,096 or more descriptors (256 MiB of 64 "
                                                 "KiB layer-blocks) goes through the SM kernel instead when the step "
                                                 "schedules at most this many tokens (every request's), and Triton "
                                                 "is present: the forward then has little to compute, so the "
                                                 "kernel's SMs cost it little, while the copy engine's descriptors "
                                                 "hold vLLM's thread ~1 us each. H200, Llama-3-8B turn 2 (1 GiB, "
                                                 "16,384 descriptors, 66 new tokens), 2026-11-29: 36.4 ms median of "
                                                 "5 starts against 49.4 (copy engine). `0` = never", "tokens")
    in_step_staged_min_descriptors: int = config_key(1 << 13, "`in_step_copy: auto`: stage an in-step copy of this "
        "many copy-engine descriptors or more the SM-kernel rule leaves (512 MiB of 64 KiB layer-blocks; H200 Llama-3-"
        "8B c8: 4-6 loads held vLLM's thread 11-26 ms on the copy engine, 7 staged 2.4-9.0). `0`: off", "descriptors")
    load_staging_bytes: int = config_key(256 << 20, "`in_step_copy: staged` (or `auto` where it stages) only: the "
                                                    "most device memory each staging buffer may take (allocated at "
                                                    "the first staged load at the size it needs, grown up to this, "
                                                    "on the thread that runs the loads); a larger load goes in "
                                                    "pieces. In-step loads (`layerwise`, `sync`, `adaptive`) have "
                                                    "one buffer per KV cache group, asynchronous CPU loads "
                                                    "(`adaptive`, `async`; one group) one more of their own: the "
                                                    "in-step ones run on vLLM's thread, the asynchronous ones on the "
                                                    "copier's submitter thread, and neither thread ever resizes the "
                                                    "other's buffer. vLLM sized its KV cache before the buffer "
                                                    "exists, so keep it within the memory `gpu_memory_utilization` "
                                                    "leaves free", "bytes")
    load_staging_buffers: int = config_key(1, "staged loads only: `1` = each piece's DMA, then its scatter, in turn "
        "on the load stream (the DMA engine idles while a piece scatters); `2` = a load of several pieces (a load "
        "larger than half of `load_staging_bytes`, or several layer groups in one call) alternates two halves of "
        "`load_staging_bytes`, its DMAs on a second stream of the same priority, so the next piece crosses PCIe "
        "while the last one scatters (no more device memory: the same cap, halved). Its CUDA tests pass on the H200 "
        "(tests/gpu/test_staged_gpu.py, 2026-11-29); the default stays `1` until a serving run compares them")
    staged_scatter: str = config_key("index_put", "staged loads only: how staged rows reach vLLM's blocks. "
        "`index_put`: an `index_put_` per layer tensor; `kernel`: one Triton launch per layer group of 8 or more "
        "chunks a block (a layer's for vLLM 0.26) over the layout's chunk table, kept on the GPU (built, compiled at "
        "start-up; fewer, or no Triton: `index_put`). H200 probe, Qwen2.5-7B, 2 groups of 14 layers, 2026-12-01: "
        "vLLM's thread 0.94 vs 0.92 ms a load of 82 blocks, 1.42 vs 1.93 of 574; GPU +4-8%. Unmeasured in serving")
    load_stream_priority: int = config_key(-1, "CUDA stream priority of the loads' side stream (lower is higher; "
        "torch maps it into the device's range; `0` = the default priority, as stores keep). Loads are what the "
        "forward waits for layer by layer; at a higher priority the staged load's scatter and the SM kernel are not "
        "queued behind the forward's pending blocks. New on 2026-11-28, unmeasured: `0` restores the old behaviour")
    cross_layer_blocks: bool = config_key(True, "vLLM 0.26 with the NHD layout: ask for one KV tensor whose blocks "
                                                "are contiguous across layers (a block is one copy run instead of "
                                                "one per layer; same stored bytes). Only vLLM's V1 model runner "
                                                "honours it: 0.26 runs dense models such as Llama on its V2 runner, "
                                                "which always hands over per-layer tensors "
                                                "(`VLLM_USE_V2_MODEL_RUNNER=0` selects V1). Set `false` to keep "
                                                "per-layer tensors")
    disk_load_policy: str = config_key("auto", "which held chunks a hit loads: `auto` the split per request (CPU "
                                               "chunks unless loading steps measured slower, the disk part, then the "
                                               "remote part, each while the estimated read beats recomputing it; see "
                                               "\"Disk or recompute\"); `always` every held chunk; `never` only CPU "
                                               "chunks")
    disk_read_gbps: float = config_key(DEFAULT_READ_GBPS, (
        "the disk tier's read rate (GB/s, all ranks together) the split starts from; then a running average "
        "of the measured disk loads. The built-in 3.0 is a guess: the tier's writes lower it, its first read "
        "replaces it; with `disk_overlap_bytes` the first hit loads one chunk, later ones <= 4x the largest "
        "read"), "GB/s")
    remote_read_gbps: float | None = config_key(None, "the remote tier's read rate (GB/s, all ranks together) the "
                                                      "split starts from, then measured like the disk's; `null`: "
                                                      "`disk_read_gbps`", "GB/s")
    disk_probe_every: int = config_key(32, "with `auto`, every Nth hit that leaves held disk or remote chunks to "
                                           "recompute loads them all anyway, so the read-rate estimates keep "
                                           "following the tiers (`0`: never)")
    prefill_tokens_per_s: float = config_key(30000.0, "the prefill rate at short context the split's start model "
                                                      "prices a recompute with (30k ~ an 8B model on an H100/H200); "
                                                      "learned from vLLM's steps from then on unless "
                                                      "`prefill_learn` is false", "tokens/s")
    prefill_half_rate_context: int = config_key(32768, (
        "the context at which attention halves the start model's prefill rate (a token attending to that many"
        " costs twice a token at the start); about 2 x parameters / (4 x layers x heads x head_dim): 30k for "
        "Llama-3-8B, 5k for a 0.6B model, 50k for 70B"), "tokens")
    prefill_learn: bool = config_key(True, "learn the prefill model from vLLM's steps (tokens scheduled and context "
                                           "per request, the step's time; see \"Disk or recompute\"); `false` "
                                           "pins it to `prefill_tokens_per_s` and `prefill_half_rate_context`")
    compression: str = config_key("none", "disk payload codec: `none` or `zstd`")
    zstd_level: int = config_key(1, "zstd level (-7..22)")
    disk_sync: bool = config_key(False, "fdatasync every disk batch (power-loss safety) instead of relying on the "
                                        "page cache")
    disk_workers: int = config_key(2, "threads per rank doing CPU<->disk transfers", "threads")
    chunk_blocks: int = config_key(16, "GPU blocks per stored chunk (scheduler blocks: with several KV cache groups, "
                                       "the LCM of their block sizes). A chunk is the unit of the tiers: one key, "
                                       "one CPU slot, one disk record. Larger chunks mean less scheduler work and "
                                       "larger disk I/O; the full blocks after a prompt's last whole chunk are "
                                       "stored as a tail piece (`tail_chunks`). Mamba hybrids always use 1 (see "
                                       "\"Hybrid models\")", "GPU blocks")
    hybrid_reseed: bool = config_key(False, "sliding-window hybrids: recompute, at most once per "
                                             "`hybrid_reseed_interval_s` (s, default 2), a prefix other conversations "
                                             "share that vLLM lost, so vLLM caches it again (\"Hybrid models\")")
    hybrid_reseed_interval_s: float = config_key(2.0, "`hybrid_reseed`: at most one such recompute this often", "s")
    swa_store: str = config_key("window", "hybrid models, sliding-window groups: `window` keeps a chunk's window part "
                                          "only inside the window before the end of a request's stored prefix (what "
                                          "the next turn's hit reads: full-attention layers x the prefix + window "
                                          "layers x the window); `all` keeps every chunk's, so a request that "
                                          "shares only an earlier part of a prefix hits there too (more bytes)")
    mla_store_once: bool = config_key(True, "MLA models with tensor parallelism: keep one copy of the latent KV for "
                                            "all TP ranks (one shared-memory CPU slab, one disk directory) instead "
                                            "of one per rank")
    staging_chunks: int = config_key(8, "chunks of pinned staging memory per rank for disk->GPU loads", "chunks")
    disk_overlap_bytes: int | str = config_key(0, "in-step disk and remote loads under the forward (`0`: off): a "
                                                  "hit's disk (or remote) part is read layer group by layer group "
                                                  "into this much pinned staging per rank while the forward "
                                                  "recomputes the rest, and the split plans with that overlap (see "
                                                  "\"Disk or recompute\"); one KV cache group, `compression: none`, "
                                                  "`load_mode` not `async`. Off by default: on the H200 host's virtio disk "
                                                  "(2026-11-29) the best split was within 5-13% of recompute", "bytes")
    disk_overlap_aio: bool = config_key(True, "read `disk_overlap_bytes` loads from an O_DIRECT disk tier with "
                                              "Linux AIO (many reads in flight a thread, unaffected by a busy GIL; "
                                              "tmpfs: several threads) where the kernel allows; `false`: threads")
    model_id: str = config_key("", "model name in the key namespace; empty: vLLM's `model` (set it when the same "
                                   "weights are served from different paths)")
    tenant_salt: str = config_key("", "extra namespace salt: engines with different salts never share blocks")
    metrics_port: int | None = config_key(None, "serve Prometheus metrics (`tiered_kv_*`, the store families of "
                                                "`tiered_kv.store.metrics`, refreshed once a second) from the "
                                                "EngineCore process on `127.0.0.1:PORT`")
    remote_feed_interval_s: float = config_key(0.1, "vLLM scheduler process: while the fleet writes, its presence "
                                                    "feed reads the stream at most once per interval (a block stored "
                                                    "elsewhere is known here within about that long; a shorter "
                                                    "interval wakes the feed thread, and takes the GIL from the "
                                                    "scheduler, more often). `0`: read as entries arrive", "s")

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        for key in ("cpu_bytes", "disk_bytes", "load_staging_bytes", "load_ahead_bytes", "disk_overlap_bytes"):
            set_(key, parse_size(getattr(self, key), key))
        if self.step_load_bytes != "auto":
            set_("step_load_bytes", parse_size(self.step_load_bytes, "step_load_bytes"))
            if self.step_load_bytes < 1:
                raise ConfigError(f"step_load_bytes: expected \"auto\" or a size > 0 (in-step load bytes per scheduler "
                                  f"step with load_mode adaptive), got {self.step_load_bytes!r}")
        _choice(self.eviction, "eviction", POLICIES)
        _choice(self.write_policy, "write_policy", WRITE_POLICIES)
        _choice(self.store_policy, "store_policy", STORE_POLICIES)
        _choice(self.store_start, "store_start", STORE_STARTS)
        _choice(self.disk_load_policy, "disk_load_policy", DISK_LOAD_POLICIES)
        _choice(self.load_mode, "load_mode", LOAD_MODES)
        _choice(self.in_step_copy, "in_step_copy", IN_STEP_COPIES)
        _choice(self.load_submit, "load_submit", LOAD_SUBMITS)
        _choice(self.staged_scatter, "staged_scatter", STAGED_SCATTERS)
        _choice(self.compression, "compression", CODECS)
        _choice(self.swa_store, "swa_store", SWA_STORES)
        _choice(self.disk_budget, "disk_budget", ("namespace", "shared"))
        _int(self.disk_weight, "disk_weight", 1, 1 << 20)
        _int(self.load_stream_priority, "load_stream_priority", -16, 0)
        for key in ("promote_on_hit", "store_decode_tokens", "disk_sync", "cross_layer_blocks", "mla_store_once",
                    "tail_chunks", "prefill_learn", "hybrid_reseed"):
            if not isinstance(getattr(self, key), bool) and (key != "tail_chunks" or self.tail_chunks != "auto"):
                raise ConfigError(f"{key}: expected true or false{' or auto' if key == 'tail_chunks' else ''}, got "
                                  f"{getattr(self, key)!r}")
        _int(self.min_hit_blocks, "min_hit_blocks", 1)
        _int(self.sync_max_tokens, "sync_max_tokens", 0)
        _int(self.load_groups, "load_groups", 0, 4096)
        _int(self.in_step_sm_max_tokens, "in_step_sm_max_tokens", 0)
        _int(self.in_step_staged_min_descriptors, "in_step_staged_min_descriptors", 0)
        _int(self.disk_probe_every, "disk_probe_every", 0)
        _int(self.zstd_level, "zstd_level", -7, 22)
        _int(self.disk_workers, "disk_workers", 1, 64)
        _int(self.chunk_blocks, "chunk_blocks", 1, 4096)
        _int(self.staging_chunks, "staging_chunks", 1, 4096)
        for key in ("disk_read_gbps", "prefill_tokens_per_s", "load_gbps", "remote_read_gbps"):
            v = getattr(self, key)
            if v is None and key == "remote_read_gbps":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                also = " or null (disk_read_gbps)" if key == "remote_read_gbps" else ""
                raise ConfigError(f"{key}: expected a number > 0{also}, got {v!r}")
            set_(key, float(v))
        _int(self.prefill_half_rate_context, "prefill_half_rate_context", 1)
        if isinstance(v := self.hybrid_reseed_interval_s, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ConfigError(f"hybrid_reseed_interval_s: expected seconds >= 0 (one recompute this often), got {v!r}")
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
                              f"halves of load_staging_bytes, DMA beside scatter); got {self.load_staging_buffers!r}")
        if self.cpu_bytes == 0:
            raise ConfigError("cpu_bytes: must be > 0 (the CPU tier stages every load and store); got 0")
        if isinstance(self.remote_feed_interval_s, bool) or not isinstance(self.remote_feed_interval_s, (int, float)) \
                or not 0 <= self.remote_feed_interval_s <= 10:
            raise ConfigError(f"remote_feed_interval_s: expected seconds in [0, 10] (0.1: the presence feed reads "
                              f"at most 10 times a second), got {self.remote_feed_interval_s!r}")
        self.check_remote_keys()
        self._check_pool()
        self._check_overlap()

    def _check_overlap(self) -> None:
        """``disk_overlap_bytes``: what the overlapped disk read needs from the other keys."""
        if not self.disk_overlap_bytes:
            return
        why = [w for w, bad in (("compression: zstd (a compressed record cannot be read layer group by layer group)",
                                 self.compression != "none" and self.disk_path is not None),
                                ("load_mode: async (the overlap is an in-step load)", self.load_mode == "async"),
                                ("no disk_path or remote_url", self.disk_path is None and self.remote_url is None))
               if bad]
        if why:
            raise ConfigError(f"disk_overlap_bytes: {self.disk_overlap_bytes} bytes of overlap staging cannot be used "
                              f"with {'; '.join(why)}; set disk_overlap_bytes: 0 or change those keys")

    def _check_pool(self) -> None:
        """``cpu_pool``: a valid name, and none of the tiers the pool does not take below it yet."""
        _int(self.cpu_pool_weight, "cpu_pool_weight", 1, 1 << 20)
        v = self.cpu_pool_poll_s
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 10:
            raise ConfigError(f"cpu_pool_poll_s: expected seconds in (0, 10] (how often the scheduler process reads "
                              f"the host pool's index), got {v!r}")
        object.__setattr__(self, "cpu_pool_poll_s", float(v))
        if self.cpu_pool is None:
            return
        from tiered_kv.tiers.pool.place import pool_name  # lazily: a pool needs lmdb, the CPU-only setup does not

        pool_name(self.cpu_pool)
        below = [k for k in ("disk_path", "remote_url") if getattr(self, k) is not None]
        if below:
            raise ConfigError(f"cpu_pool={self.cpu_pool!r} with {' and '.join(below)}: a host pool evicts by itself "
                              f"and the vLLM connector does not yet copy each chunk below it at once, so the tier "
                              f"below would only get what this engine stored; drop {' and '.join(below)} or "
                              f"cpu_pool (docs/vllm.md, \"One host pool for several replicas\")")

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

POOL_UNSTABLE_HASH_WARNING = (
    "TieredKVConnector: vLLM's block hashes differ in every process with this setup (hash algo %r, "
    "PYTHONHASHSEED unset): replicas on cpu_pool %s will never hit each other's chunks. Set PYTHONHASHSEED to the "
    "same value for every replica (e.g. PYTHONHASHSEED=0).")


def namespace(cfg: ConnectorConfig, geo: Geometry, model: str, ident: HashIdentity) -> Namespace:
    """The key namespace: equal on every rank (the planner is shared); rank goes into the disk path.

    A replicated (MLA) cache holds one copy for every rank, so it is valid for any TP size.
    """
    tp = "replicated" if geo.replicated else str(geo.tp_size)
    return Namespace(cfg.model_id or model, namespace_layout(geo).fingerprint, cfg.tenant_salt,
                     (("engine", "vllm"), ("hash", ident.algo), ("seed", ident.seed), ("tp", tp)))


def namespace_layout(geo: Geometry) -> BlockLayout:
    """The layout whose fingerprint the key namespace carries: a record of one rank's chunk, tagged without the
    rank. A host pool's records are written with it (``cpu_pool``, TP=1 only), so a ``TieredStore`` of the same
    layout and namespace (``pool_store_config``) reads and writes them."""
    return BlockLayout((geo.rank_chunk_nbytes,), "uint8", geo.tag)


def check_pool(cfg: ConnectorConfig, geo: Geometry) -> None:
    """``cpu_pool`` serves one TP rank and one KV cache group for now: ConfigError naming what to change otherwise.

    TP>1 would need one pool per rank (``host:<name>.rank<r>-of-<tp>``) and a chunk held only where every rank's
    pool holds its share (the scheduler's watch intersecting the ranks' records); MLA's replicated slab would
    need one pool all ranks read and rank 0 writes. Several KV cache groups: vLLM takes no per-block load errors
    there, so every load must come from a copy that cannot vanish before its lease, which a pool other processes
    evict from does not promise (it would need the lease taken at the lookup, by the scheduler process).
    """
    if cfg.cpu_pool is None:
        return
    if geo.tp_size > 1:
        raise ConfigError(f"cpu_pool={cfg.cpu_pool!r} with tensor_parallel_size={geo.tp_size}: the host pool serves "
                          f"TP=1 engines for now (one replica per GPU); drop cpu_pool or run TP=1 replicas")
    if not geo.block_level_errors:
        raise ConfigError(f"cpu_pool={cfg.cpu_pool!r} with {len(geo.groups)} KV cache groups: vLLM takes no "
                          f"per-block load errors for this model, and a chunk another replica evicts between the "
                          f"lookup and the load could then only fail the engine; drop cpu_pool for this model")


def pool_store_config(cfg: ConnectorConfig, geo: Geometry, ns: Namespace) -> dict:
    """The ``StoreConfig`` keys of a Python API process that shares this engine's chunks in its host pool (the same
    pool, size and namespace). A chunk is a ``(rank_chunk_nbytes,)`` uint8 row in the engine's slab layout, named
    ``store.key(h)`` by vLLM's block hash ``h`` of its last block."""
    return {"cpu_pool": cfg.cpu_pool, "cpu_bytes": cfg.cpu_bytes, "cpu_pool_weight": cfg.cpu_pool_weight,
            "block_shape": [geo.rank_chunk_nbytes], "dtype": "uint8", "layout_tag": geo.tag, "model": ns.model,
            "tenant_salt": ns.salt, "namespace_extra": dict(ns.extra)}


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


#: Layer groups of an overlapped disk load (``in_step_disk``, ``overlap_spans``): at most this many, equal. The
#: pipeline's fill (the forward's first layer waits for the first group's read; the last group computes after the
#: last read) is the largest group's share of the overlapped time: with load L and compute C, groups read and
#: computed in order take ``max_g (L * end_g + C * (n - start_g)) / n``, which for equal groups of n/G layers is
#: ``max(L, C) + min(L, C) / G`` exactly (``planner.split``'s model with ``layers=G``). Smaller edge groups do not
#: help where the split sits (L about C: a middle group sets the fill). More groups mean smaller ranges, and small
#: ranges read slower beside vLLM's thread (Llama-3-8B, 8 groups: 256 KiB per block and group; 512 KiB read 1.6x
#: faster on the H200 host, docs/notes/2026-11-29-gpu-round4.md)
OVERLAP_GROUPS = 8


def layer_spans(n: int, count: int) -> list[tuple[int, int]]:
    """``n`` tensors as consecutive spans ``[a, b)`` of ``ceil(n / count)`` each (the last may be shorter), at most
    ``count`` (>= 1) of them: the layer groups of an in-step load (``in_step.layer_groups``)."""
    if n <= 0:
        return []
    per = -(-n // min(n, count))
    return [(a, min(n, a + per)) for a in range(0, n, per)]


def overlap_spans(n: int) -> list[tuple[int, int]]:
    """Tensor spans an overlapped load of ``n`` tensors reads and copies group by group: ``OVERLAP_GROUPS`` groups
    (``in_step_disk``'s reads; its ``InStepLoader``, pipelined with that many groups, copies the same ones)."""
    return layer_spans(n, OVERLAP_GROUPS)


def overlap_fill_layers(n: int) -> int:
    """``planner.split``'s ``layers`` for an overlapped load of ``n`` layers: the fill is ``1 / this`` of the
    overlapped time, the largest group's share (``overlap_spans``; rounded down: never an optimistic fill)."""
    spans = overlap_spans(n)
    return max(1, n // max((b - a for a, b in spans), default=n or 1))


def overlap_possible(cfg: ConnectorConfig, groups: int, rank_chunk_nbytes: int) -> str | None:
    """Why this engine cannot read disk hits under the forward (None: it can): ``disk_overlap_bytes`` off, several
    KV cache groups (their disk parts are promoted to the CPU tier first), a chunk record that is not a whole number
    of 4 KiB pages (O_DIRECT ranges), or staging smaller than one chunk. The scheduler and the workers both ask."""
    if not cfg.disk_overlap_bytes:
        return "disk_overlap_bytes is 0"
    if groups != 1:
        return f"{groups} KV cache groups"
    if rank_chunk_nbytes % 4096:
        return f"a chunk record of {rank_chunk_nbytes} bytes is not a multiple of 4 KiB"
    if cfg.disk_overlap_bytes < rank_chunk_nbytes:
        return f"disk_overlap_bytes {cfg.disk_overlap_bytes} is less than one chunk ({rank_chunk_nbytes} bytes)"
    return None
