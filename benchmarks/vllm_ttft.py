"""Turn-2 time-to-first-token of a multi-turn workload: no connector vs vLLM's connectors vs tiered_kv.

Models (``--model``, dummy weights, configs written here):
  llama3-8b   Llama-3-8B shape: 32 layers, 8 KV heads x 128, bf16 (one full-attention KV cache group)
  gemma3      Gemma-3-4B text shape: 34 layers, 29 sliding-window (1,024 tokens) : 5 full, 4 KV heads x 256
              (7 KV cache groups with vLLM's hybrid KV cache manager)
  gpt-oss     gpt-oss-20b shape in bf16 (no MXFP4): 24 layers alternating sliding window (128) and full,
              8 KV heads x 64, 32 experts top-4 (2 KV cache groups)
  dsv2-lite   DeepSeek-V2-Lite shape: 27 MLA layers (one 576-wide latent per token), 64 experts top-6
  qwen2.5-7b  Qwen2.5-7B shape: 28 layers, 4 KV heads x 128 (32 KiB per layer-block), bf16
  qwen2.5-32b Qwen2.5-32B shape (serving/shapes.py's): 64 layers, 8 KV heads x 128 (256 KiB per token),
              ~65.5 GB of bf16 weights: one H200 (gpu_memory_utilization 0.8); 2,048 GPU blocks = 8 GiB
              against a 16 GiB working set

Workload: N_CONV conversations with distinct PREFIX-token prefixes (llama3-8b: 12 x 8,192; the
others: 8 x 8,192), GPU KV cache limited to GPU_BLOCKS blocks (2,048: a few conversations), so
turn 2 of every conversation misses vLLM's own prefix cache. Turn 1 = the prefix, 2 generated
tokens (vLLM 0.26's SimpleCPUOffloadConnector stores a step's blocks one step later and has no
flush on finish: with one token it would store nothing); turn 2 = the prefix + 64 new tokens,
one request at a time; TTFT = wall time of ``generate(max_tokens=1)`` (4 tokens for the first
two conversations, whose greedy tokens are compared across modes; they are left out of the median).

Modes (each in its own process):
  none          no connector (turn 2 recomputes the prefix)
  floor         no connector, each conversation's turn 2 right after its own turn 1, so vLLM's GPU
                prefix cache still holds the prefix: the best any connector can do (its TTFT is the
                64 new tokens' prefill plus the step overhead; a CPU hit adds at least the copy)
  offloading    vLLM's OffloadingConnector, ``kv_offloading_size`` = CPU_GIB
  simple        vLLM's SimpleCPUOffloadConnector: the same with VLLM_USE_SIMPLE_KV_OFFLOAD=1
  tiered-cpu    TieredKVConnector, cpu_bytes = CPU_GIB (the working set fits in CPU), defaults
  tiered-cpu-swa-all  tiered-cpu with swa_store "all": sliding-window groups store every block of
                a chunk instead of the window's tail (the comparison behind the default, docs/vllm.md)
  tiered-disk   TieredKVConnector, cpu_bytes = DISK_CPU_GIB (< the working set) + disk tier at
                DISK_PATH, so turn-2 hits come from disk (disk_load_policy DISK_POLICY: "auto"
                lets the connector decline a disk slower than recompute; "always" forces reads)
  tiered-disk-overlap  tiered-disk with ``disk_overlap_bytes`` = OVERLAP_GIB (default: a prefix and 1 GiB):
                a disk hit's first part read under the forward while the rest is recomputed (issue 32 item 2:
                against ``none`` and ``tiered-disk-always`` in the same call)
  tiered-remote, tiered-remote-always, tiered-remote-overlap  the same three with the remote tier instead of the
                disk: a 3-master Redis Cluster on loopback started for each engine start (``redis-server`` and
                ``redis-cli`` on PATH; REDIS_MAXMEMORY per master, default 8gb), cpu_bytes = DISK_CPU_GIB
  tiered-disk-always, tiered-cpu-async/-sync/-layerwise, tiered-cpu-gN (N = 1, 2, 8, 32),
  tiered-cpu-perlayer, tiered-cpu-sm, tiered-cpu-staged, tiered-cpu-perlayer-staged, *-v1runner
                (only with --modes) one-setting variants of the above (load_mode, load_groups,
                cross_layer_blocks false, in_step_copy sm_kernel or staged, vLLM's V1 model runner)

Per mode it reports: turn-2 median TTFT and speed-up over ``none``, turn-2 hit rate (vLLM's cached
tokens), whether the greedy tokens equal ``none``'s, and for tiered_kv the bytes its loads moved
per turn-2 hit (GB and bytes per hit token: with sliding windows only the window at the hit
boundary moves), the bytes and seconds its turn-1 stores took, and (``prefill_model``) the prefill model
the connector learned from the engine's steps against turn 1's measured time. The connector's counters are
read from the engine core, which therefore runs in the benchmark's process
(VLLM_ENABLE_V1_MULTIPROCESSING=0; INPROC=0 keeps vLLM's separate engine-core process, as the
2026-11-22 runs did, and reports no byte counts).

Issue 14 item 2 (CPU-hit TTFT within 1.3x of its floor, spread over engine starts <= 1.2), one call:
``--starts N`` starts every mode N times, the order rotated by one mode per start (``--start-offset``
goes on rotating in a later call); ``--deadline-s S`` begins no start whose estimate (its own longest
start so far, else 1.25x any mode's, else a guess) would end later than S seconds after the call began,
records it as skipped, and kills a start still running at S. When ``floor`` is among the modes, a
child process first measures the PCIe ceiling (benchmarks/gpu_copy.py ``pcie_ceiling``: 8 contiguous
pinned 1 GiB copies per direction, best and median GB/s; again after the last start if time is left).
Then floor_s = hit bytes / best h2d GB/s + mode ``floor``'s turn-2 median (median over starts), hit
bytes = tiered-cpu's own counters (bytes loaded per turn-2 hit; else prefix blocks x KV bytes per token,
and it says which), ratio = a mode's turn-2 median over starts / floor_s, also per start, spread = max /
min of a mode's per-start medians. ``--merge A.json B.json`` combines calls (each start keeps its own
call's ceiling). The JSON gains ``pcie``, ``skipped``, ``schedule``, ``item2`` (all of the above) and
``item2_table``; every result gets ``start`` and ``wall_s``.

Usage (GPU machine, vLLM importable, tiered_kv on PYTHONPATH):
  python benchmarks/vllm_ttft.py --model gemma3        # the model's default modes, one subprocess each
  python benchmarks/vllm_ttft.py --model gpt-oss --modes none,tiered-cpu
  python benchmarks/vllm_ttft.py --model dsv2-lite --one tiered-cpu   # one mode in this process
  python benchmarks/vllm_ttft.py --model gpt-oss --dry-run             # CPU: configs, KV groups, bytes
  python benchmarks/vllm_ttft.py --model qwen2.5-32b --modes floor,offloading,tiered-cpu --starts 3 \
      --deadline-s 560                                                  # item 2 (add --dry-run: the plan)
  python benchmarks/vllm_ttft.py --merge call1/vllm_ttft_qwen2.5-32b.json call2/vllm_ttft_qwen2.5-32b.json
Default modes: llama3-8b: none, offloading, simple, tiered-cpu, tiered-disk; gemma3, dsv2-lite and
qwen2.5-7b: none, floor, offloading, simple, tiered-cpu; gpt-oss: those and tiered-cpu-swa-all;
qwen2.5-32b: none, floor, offloading, tiered-cpu. All modes of one
model take about 5-8 minutes on an H200 (start-up with dummy weights dominates).
Environment: N_CONV, PREFIX, GPU_BLOCKS (2048; gemma3 8192, gpt-oss 4096), GPU_UTIL (0.6; qwen2.5-32b 0.8),
CPU_GIB (24; the working set must fit: the dry run says), DISK_CPU_GIB (2), DISK_PATH
(/tmp/tkv-ttft-disk; a real disk, not tmpfs), DISK_GIB (24), DISK_POLICY (auto), PREFILL_TPS (37000),
CHUNK_BLOCKS (16), MAX_BATCHED (PREFIX + 512: a turn-1 prefill in one step; e.g. 2048 for chunked prefill,
where hybrid models hand window blocks on while the previous step's stores may still copy them),
SETTLE_S (2; 6 for tiered-disk), TURN1_GAP_S (0: seconds between turn 1s; at PREFIX=32768 a turn 1 stores
4.3 GB, and a CPU tier of DISK_CPU_GIB must move it down to the disk before the next one or drop stores), INPROC (1), OUT (directory for the JSON), BASELINE (a
vllm_ttft_<model>.json whose "none" result the table compares against when this run has none).
PYTHONHASHSEED is set to 0 in every mode's process (same hashes in every mode).
Threading: a script; the main thread only (each engine start and each PCIe probe is a child process).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from serving.shapes import DSV2_LITE, GEMMA2_9B, GEMMA3_4B, GPTOSS_20B  # noqa: E402 (sglang_ttft imports DSV2_LITE here)
from serving.shapes import SHAPES as _SERVE_SHAPES, kv_bytes_of  # noqa: E402

MODES = ("none", "offloading", "simple", "tiered-cpu", "tiered-cpu-swa-all", "tiered-disk")
#: tiered-cpu variants: one extra ``kv_connector_extra_config`` setting each
CPU_VARIANTS = {
    "tiered-cpu-swa-all": {"swa_store": "all"},
    "tiered-cpu-async": {"load_mode": "async"},
    "tiered-cpu-sync": {"load_mode": "sync"},
    "tiered-cpu-layerwise": {"load_mode": "layerwise"},
    "tiered-cpu-g1": {"load_groups": 1},
    "tiered-cpu-g2": {"load_groups": 2},
    "tiered-cpu-g8": {"load_groups": 8},
    "tiered-cpu-g32": {"load_groups": 32},
    "tiered-cpu-perlayer": {"cross_layer_blocks": False},
    "tiered-cpu-sm": {"in_step_copy": "sm_kernel"},
    # issue 12: one DMA per run of slots into a device buffer, then an on-device scatter
    "tiered-cpu-staged": {"in_step_copy": "staged", "load_staging_bytes": "512MiB"},
    "tiered-cpu-perlayer-staged": {"cross_layer_blocks": False, "in_step_copy": "staged",
                                   "load_staging_bytes": "512MiB"},
}
#: any mode with this suffix runs on vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0)
V1_RUNNER = "-v1runner"
EXTRA_MODES = ("floor", "tiered-disk-always", "tiered-disk-overlap", "tiered-remote", "tiered-remote-always",
               "tiered-remote-overlap", *(m for m in CPU_VARIANTS if m not in MODES),
               *(m + V1_RUNNER for m in ("none", "offloading", "tiered-cpu")))
FOLLOW = 64

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 16384, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
    "bos_token_id": 1, "eos_token_id": 2, "attention_bias": False, "mlp_bias": False,
}
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
    "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "max_position_embeddings": 32768,
    "max_window_layers": 28, "use_sliding_window": False, "sliding_window": 131072,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 152064, "bos_token_id": 151643, "eos_token_id": 151643,
}
#: the 64-layer shape of issue 14 (Qwen2.5-32B: 8 KV heads x 128, hidden 5,120, 40 query heads, MLP 27,648,
#: vocabulary 152,064; ~65.5 GB of bf16 weights): the serving benchmark's copy, so both run the same model
QWEN25_32B = dict(_SERVE_SHAPES["qwen2.5-32b"])
MODELS = {"llama3-8b": LLAMA3_8B, "gemma3": GEMMA3_4B, "gemma2": GEMMA2_9B, "gpt-oss": GPTOSS_20B, "dsv2-lite": DSV2_LITE,
          "qwen2.5-7b": QWEN25_7B, "qwen2.5-32b": QWEN25_32B}
DEFAULT_MODES = {
    "llama3-8b": ("none", "offloading", "simple", "tiered-cpu", "tiered-disk"),
    "gemma3": ("none", "floor", "offloading", "simple", "tiered-cpu"),
    "gpt-oss": ("none", "floor", "offloading", "simple", "tiered-cpu", "tiered-cpu-swa-all"),
    "dsv2-lite": ("none", "floor", "offloading", "simple", "tiered-cpu"),
    "qwen2.5-7b": ("none", "floor", "offloading", "simple", "tiered-cpu"),
    "qwen2.5-32b": ("none", "floor", "offloading", "tiered-cpu"),
}
DEFAULT_N_CONV = {"llama3-8b": 12}
#: vLLM's KV cache pool in blocks: hybrid models spread a token over several groups' blocks, and the
#: engine refuses to start when the pool cannot hold one max-length request (gemma3: 7 groups)
DEFAULT_GPU_BLOCKS = {"gemma3": 8192, "gpt-oss": 4096}
#: vLLM's gpu_memory_utilization: 0.6 everywhere but the 32B shape, whose 61 GiB of weights, 8 GiB KV
#: cache (2,048 blocks x 4 MiB) and an 8.7k-token prefill's activations need more than 0.6 x 139 GiB leaves
DEFAULT_GPU_UTIL = {"qwen2.5-32b": 0.8}
#: tokens per vLLM block (vLLM's default for these attention backends; the dry run's geometry uses it too)
BLOCK = 16


def _overlap_gib(model: str, prefix: int) -> int:
    """GiB of overlap staging that hold a whole ``prefix`` of ``model`` (1 GiB more, at least 2)."""
    per_token = kv_bytes_per_token(model) or 256 << 10
    return max(2, -(-prefix * per_token // (1 << 30)) + 1)


def workload(model: str) -> dict:
    """The knobs of one model's run (environment overrides the defaults)."""
    env = os.environ
    return {
        "n_conv": int(env.get("N_CONV", DEFAULT_N_CONV.get(model, 8))),
        "prefix": int(env.get("PREFIX", "8192")),
        "gpu_blocks": int(env.get("GPU_BLOCKS", DEFAULT_GPU_BLOCKS.get(model, 2048))),
        "gpu_util": float(env.get("GPU_UTIL", DEFAULT_GPU_UTIL.get(model, 0.6))),
        "cpu_gib": int(env.get("CPU_GIB", "24")),
        "disk_cpu_gib": int(env.get("DISK_CPU_GIB", "2")),
        "disk_path": env.get("DISK_PATH", "/tmp/tkv-ttft-disk"),
        "disk_gib": int(env.get("DISK_GIB", "24")),
        "disk_policy": env.get("DISK_POLICY", "auto"),
        "prefill_tps": float(env.get("PREFILL_TPS", "37000")),  # H200, 8B, 8k prefill: 8192 / 0.2175 s
        # tiered-disk-overlap: pinned staging per rank for the disk part read under the forward (a whole prefix)
        "overlap_gib": int(env.get("OVERLAP_GIB", str(_overlap_gib(model, int(env.get("PREFIX", "8192")))))),
        # tiered-remote*: each of the 3 loopback masters' maxmemory (a whole working set fits)
        "redis_maxmemory": env.get("REDIS_MAXMEMORY", "8gb"),
        "chunk_blocks": int(env.get("CHUNK_BLOCKS", "16")),
        # tokens per step: default one step per turn-1 prefill; lower it (e.g. 2048) for chunked prefill
        "max_batched": int(env.get("MAX_BATCHED", str(int(env.get("PREFIX", "8192")) + 512))),
    }


def mode_env(mode: str) -> dict:
    """Environment variables a mode's process needs on top of the benchmark's."""
    env = {"PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "0")}
    if os.environ.get("INPROC", "1") == "1":
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core (and its connector) in this process
    if mode.endswith(V1_RUNNER):
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    if mode.removesuffix(V1_RUNNER) == "simple":
        env["VLLM_USE_SIMPLE_KV_OFFLOAD"] = "1"
    return env


@contextlib.contextmanager
def loopback_cluster(w: dict):
    """A 3-master Redis Cluster on 127.0.0.1 for a ``tiered-remote*`` start (``tests/_redis.py``, which needs
    ``redis-server`` and ``redis-cli`` on PATH), its seed list in ``TKV_REMOTE_URL`` while it runs."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests._redis import RedisCluster, _running

    root = tempfile.mkdtemp(prefix="tkv-ttft-redis-")
    with _running(RedisCluster(Path(root), maxmemory=w["redis_maxmemory"])) as cluster:
        os.environ["TKV_REMOTE_URL"] = cluster.url
        yield cluster


def tiered_extra(mode: str, w: dict) -> dict:
    """``kv_connector_extra_config`` of a tiered mode."""
    extra = {"cpu_bytes": f"{w['cpu_gib']}GiB", "chunk_blocks": w["chunk_blocks"]}
    extra.update(CPU_VARIANTS.get(mode, {}))
    if mode.startswith("tiered-disk"):
        extra.update(cpu_bytes=f"{w['disk_cpu_gib']}GiB", disk_path=os.path.join(w["disk_path"], "run"),
                     disk_bytes=f"{w['disk_gib']}GiB",
                     disk_load_policy="always" if mode == "tiered-disk-always" else w["disk_policy"],
                     prefill_tokens_per_s=w["prefill_tps"])
        if mode == "tiered-disk-overlap":  # issue 32 item 2: the disk part read under the forward, the split
            extra["disk_overlap_bytes"] = f"{w['overlap_gib']}GiB"
    if mode.startswith("tiered-remote"):  # issue 32 item 2, Redis: hits from the remote tier on loopback
        extra.update(cpu_bytes=f"{w['disk_cpu_gib']}GiB",
                     remote_url=os.environ.get("TKV_REMOTE_URL", "<the loopback cluster of each start>"),
                     remote_password_env="TKV_TEST_REDIS_PASSWORD", remote_timeout_s=5.0,
                     disk_load_policy="always" if mode == "tiered-remote-always" else w["disk_policy"],
                     prefill_tokens_per_s=w["prefill_tps"])
        if mode == "tiered-remote-overlap":
            extra["disk_overlap_bytes"] = f"{w['overlap_gib']}GiB"
    return extra


def engine_kwargs(mode: str, model_dir: str, w: dict) -> dict:
    """``LLM(...)`` arguments of one mode (everything but the connector is the same in every mode)."""
    mode = mode.removesuffix(V1_RUNNER)
    kw = dict(model=model_dir, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
              gpu_memory_utilization=w["gpu_util"], max_model_len=w["prefix"] + 512, seed=0,
              num_gpu_blocks_override=w["gpu_blocks"], enable_prefix_caching=True,
              max_num_batched_tokens=w["max_batched"])
    if mode in ("offloading", "simple"):  # "simple": VLLM_USE_SIMPLE_KV_OFFLOAD=1 picks SimpleCPUOffloadConnector
        kw.update(kv_offloading_size=w["cpu_gib"], kv_offloading_backend="native")
    elif mode.startswith("tiered"):
        from vllm.config import KVTransferConfig

        extra = tiered_extra(mode, w)
        if mode.startswith("tiered-disk"):
            shutil.rmtree(extra["disk_path"], ignore_errors=True)  # a cold disk tier: hits come from this run
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="TieredKVConnector", kv_connector_module_path="tiered_kv.connector.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    elif mode not in ("none", "floor"):
        raise SystemExit(f"unknown mode {mode!r}; valid: {', '.join(MODES + EXTRA_MODES)}")
    return kw


def write_model(model: str, max_len: int = 0) -> str:
    """The shape's config.json in a temp dir; ``max_position_embeddings`` raised to ``max_len`` where it is less
    (PREFIX=32768 on the 16k Llama-3-8B shape: vLLM refuses a longer ``max_model_len``; dummy weights, and a
    longer RoPE range changes no timing)."""
    model_dir = tempfile.mkdtemp(prefix=f"{model}-shape-")
    cfg = dict(MODELS[model])
    cfg["max_position_embeddings"] = max(cfg.get("max_position_embeddings", 0), max_len)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    return model_dir


def _tiered_counters(llm) -> dict:
    """tiered_kv's planner and rank-0 counters, when the engine core runs in this process."""
    out: dict = {}
    try:
        core = llm.llm_engine.engine_core.engine_core  # InprocClient -> EngineCore
        out.update(core.scheduler.connector.stats())
    except AttributeError:
        return out
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        group = get_kv_transfer_group()
        out.update({f"rank0_{k}": v for k, v in group.stats().items()})
        disk = group.worker.disk
        if disk is not None:  # buffered reads would come from the page cache: a "disk" hit that is not one
            out["rank0_disk_direct_io"] = bool(disk.slots.direct)
    except Exception:  # noqa: BLE001 - the worker is in another process (TP > 1): planner numbers only
        pass
    return out


def _prefill_check(llm, w: dict, turn1_s: float) -> dict:
    """The prefill model the connector learned from this engine's steps against turn 1 timed directly (issue 32,
    must-show 3): turn 1 is a cold prefill of the prefix plus one decode step, the model's prediction is
    ``seconds(prefix, 0) + step_seconds([(1, prefix)])``. Empty when the engine core runs elsewhere."""
    try:
        meter = llm.llm_engine.engine_core.engine_core.scheduler.connector.planner.steps
    except AttributeError:
        return {}
    est = meter.estimator
    m, rep = est.model(), est.report()
    pred = m.seconds(w["prefix"], 0) + m.step_seconds([(1, w["prefix"])])
    # the last steps by both clocks: (step, tokens computed, scheduler's s, workers' forward s, waited for loads)
    recent = [[step, tokens, None if a is None else round(a, 5), None if b is None else round(b, 5), loaded]
              for step, tokens, a, b, loaded in list(meter.recent)]
    return {"source": rep["source"], "clock": "workers" if meter.worker_clock else "scheduler",
            "steps_loaded": meter.loaded_steps, "recent_steps": recent,
            "samples": rep["samples"], "coefficients": list(m.coefficients()),
            "turn1_predicted_s": round(pred, 4), "turn1_measured_s": round(turn1_s, 4),
            "predicted_over_measured": round(pred / turn1_s, 3) if turn1_s else None,
            "tokens_per_s_at_0": round(m.tokens_per_s(w["prefix"], 0))}


def run_one(mode: str, model: str) -> dict:
    """Start an engine in this process, run the workload, return the result dict."""
    import torch
    from vllm import LLM, SamplingParams

    w = workload(model)
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(mode, write_model(model, w["prefix"] + 512), w))
    startup = time.perf_counter() - t0
    rng = random.Random(0)
    vocab = min(120000, MODELS[model]["vocab_size"] - 1)
    convs = [[rng.randrange(1000, vocab) for _ in range(w["prefix"])] for _ in range(w["n_conv"])]
    follows = [[rng.randrange(1000, vocab) for _ in range(FOLLOW)] for _ in range(w["n_conv"])]
    one = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True)
    two = SamplingParams(max_tokens=2, temperature=0.0, detokenize=False, ignore_eos=True)
    four = SamplingParams(max_tokens=4, temperature=0.0, detokenize=False, ignore_eos=True)

    def generate(tokens, sp):
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": tokens}], sp, use_tqdm=False)[0]
        return time.perf_counter() - t, list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)

    generate(convs[0][:512], one)  # warm-up (kernels, allocator)
    tiered = mode.startswith("tiered")
    before1 = _tiered_counters(llm) if tiered else {}
    floor = mode == "floor"
    # 2 tokens: every connector gets a step to store; "floor" runs each turn 1 just before its turn 2
    gap = float(os.environ.get("TURN1_GAP_S", "0"))  # a 32k prefix stores 4.3 GB: let the disk take it first
    turn1 = []
    for c in ([] if floor else convs):
        turn1.append(generate(c, two)[0])
        time.sleep(gap)
    time.sleep(float(os.environ.get("SETTLE_S", "6" if mode.startswith(("tiered-disk", "tiered-remote")) else "2")))
    before2 = _tiered_counters(llm) if tiered else {}
    turn2, cached, tokens = [], [], []
    for i, (c, f) in enumerate(zip(convs, follows)):
        if floor:
            turn1.append(generate(c, two)[0])  # the prefix now sits in vLLM's GPU prefix cache
        t_start = time.time()
        dt, toks, hit = generate(c + f, four if i < 2 else one)
        if os.environ.get("TIERED_KV_LOG"):  # wall-clock marks to line up with the connector's debug log
            print(f"{t_start:.3f} turn2 {i} start; {t_start + dt:.3f} end ({dt * 1e3:.1f} ms, {hit} cached)",
                  flush=True)
        turn2.append(dt)
        cached.append(hit)
        if i < 2:
            tokens.append(toks)
    after2 = _tiered_counters(llm) if tiered else {}
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    n = w["n_conv"]
    result = {"mode": mode, "model": model, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available()
              else "cpu", "startup_s": round(startup, 1), "n_conv": n, "prefix": w["prefix"],
              "gpu_blocks": w["gpu_blocks"], "engine_core": "in-process" if os.environ.get("INPROC", "1") == "1"
              else "separate process",
              "cpu_gib": w["disk_cpu_gib"] if mode.startswith("tiered-disk") else w["cpu_gib"],
              "turn1_median_s": round(med(turn1), 4), "turn2_median_s": round(med(turn2[2:]), 4),
              "turn2_s": [round(x, 4) for x in turn2],
              "turn2_hit_rate": round(sum(cached) / (n * (w["prefix"] + FOLLOW)), 4),
              "turn2_cached_tokens": cached, "first_tokens": tokens}
    if after2:
        d = lambda key, a=after2, b=before2: a.get(key, 0) - b.get(key, 0)  # noqa: E731
        hit_tokens = d("sched_hit_tokens_cpu") + d("sched_hit_tokens_disk")
        loaded = d("sched_bytes_loaded")
        hits = sum(1 for x in cached if x > 0)
        result.update({
            "turn2_bytes_loaded": loaded, "turn2_hit_tokens": hit_tokens,
            "bytes_per_hit": round(loaded / hits) if hits else 0,
            "bytes_per_hit_token": round(loaded / hit_tokens, 1) if hit_tokens else 0,
            "turn1_bytes_stored": d("sched_bytes_stored", before2, before1),
            "turn1_store_seconds": round(d("rank0_store_seconds", before2, before1), 4),
            "turn1_chunks_stored": d("sched_store_chunks", before2, before1),
            "connector_counters": {k: v for k, v in after2.items() if isinstance(v, (int, float)) and v},
            "prefill_model": _prefill_check(llm, w, med(turn1)) if turn1 else {},
        })
    return result


# ------------------------------------------------------------------------ engine starts, deadline
#: wall seconds of one engine start (process start, LLM(), workload, exit) before any was measured
START_GUESS_S = {"qwen2.5-32b": 150.0}
START_GUESS_DEFAULT_S = 75.0
PCIE_GUESS_S = 30.0  # the PCIe probe's process: torch and CUDA start, 2 GiB pinned, 16 copies of 1 GiB
STOP_MARGIN_S = 10.0  # after the last start: the table and the JSON


def schedule(modes: list[str], starts: int, offset: int = 0) -> list[tuple[int, str]]:
    """(start index, mode) in run order: every mode once per start, the order rotated by one mode per start
    (start k begins with ``modes[k % len(modes)]``), so no mode always runs first on a fresh machine."""
    out = []
    for s in range(offset, offset + starts):
        k = s % len(modes)
        out += [(s, m) for m in modes[k:] + modes[:k]]
    return out


def start_need_s(walls: dict[str, list[float]], mode: str, model: str) -> float:
    """Seconds one more start of ``mode`` should be given: its longest start so far in this call, else 1.25x
    the longest start of any mode (the connector modes also pin their CPU tier), else a per-model guess."""
    if walls.get(mode):
        return max(walls[mode])
    seen = [x for v in walls.values() for x in v]
    return 1.25 * max(seen) if seen else START_GUESS_S.get(model, START_GUESS_DEFAULT_S)


def _die_with_parent() -> None:
    """Runs in a child before exec: Linux sends it SIGKILL when the benchmark's process dies (PR_SET_PDEATHSIG),
    so a call killed from outside (its own process group no longer reaches the child) leaves no engine behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux/glibc: the deadline kill still works
        pass


def run_child(argv: list[str], env: dict, timeout_s: float | None) -> tuple[int | None, str, str]:
    """Run ``argv`` in its own process group (it dies with this process); past ``timeout_s`` kill the whole
    group (an engine and its helpers) and return rc None. Returns (rc, stdout, stderr)."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_die_with_parent)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        return None, out, err + f"\n[vllm_ttft] killed after {timeout_s:.0f} s (--deadline-s)\n"


def _result_line(stdout: str) -> dict | None:
    line = next((ln for ln in stdout.splitlines() if ln.startswith("RESULT ")), None)
    return json.loads(line[len("RESULT "):]) if line else None


def pcie_probe(when: str, timeout_s: float | None) -> dict:
    """benchmarks/gpu_copy.py's ``pcie_ceiling`` in a child process (its buffers never share the GPU with an
    engine): contiguous pinned 1 GiB copies, best and median GB/s per direction."""
    t0 = time.perf_counter()
    rc, out, err = run_child([sys.executable, os.path.abspath(__file__), "--pcie-probe"], dict(os.environ), timeout_s)
    rec = _result_line(out) or {"error": f"rc={rc}", "log_tail": (out + err)[-1500:]}
    rec.update(when=when, wall_s=round(time.perf_counter() - t0, 1))
    if "h2d" in rec:
        print(f"[pcie {when}] h2d best {rec['h2d']['best_gbps']:.2f} GB/s, median {rec['h2d']['median_gbps']:.2f}; "
              f"d2h best {rec['d2h']['best_gbps']:.2f}, median {rec['d2h']['median_gbps']:.2f} "
              f"({rec['reps']} x {rec['bytes'] / 2**30:.0f} GiB, {rec['wall_s']:.0f} s)", flush=True)
    else:
        print(f"[pcie {when}] no rate: {rec['error']}", flush=True)
    return rec


def run_all(model: str, modes: list[str], starts: int = 1, deadline_s: float = 0.0, offset: int = 0,
            pcie: bool = False) -> dict:
    """Each mode in its own process (a fresh GPU), one after the other, ``starts`` times (order rotated per
    start); with ``pcie`` the PCIe probe runs before the first start and, if time is left, after the last.

    ``deadline_s`` > 0: no start (or probe) begins unless its estimate fits before ``deadline_s`` seconds
    after this call began (a skipped start is recorded with the reason), and a running start is killed at
    the deadline. Returns ``{"results", "pcie", "skipped", "schedule"}``."""
    t_begin = time.monotonic()
    left = (lambda: deadline_s - STOP_MARGIN_S - (time.monotonic() - t_begin)) if deadline_s else (lambda: float("inf"))
    out_dir = os.environ.get("OUT", ".")
    plan = schedule(modes, starts, offset)
    doc: dict = {"results": [], "pcie": [], "skipped": [], "schedule": [[s, m] for s, m in plan]}
    walls: dict[str, list[float]] = {}

    def save_partial() -> None:
        with open(os.path.join(out_dir, f"vllm_ttft_{model}_partial.json"), "w") as f:
            json.dump(doc, f, indent=1)  # what a run cut short still leaves behind

    if pcie:
        if left() >= PCIE_GUESS_S:
            doc["pcie"].append(pcie_probe("before", None if left() == float("inf") else left()))
        else:
            doc["skipped"].append({"what": "pcie before", "reason": f"deadline: {left():.0f} s left"})
    for start, mode in plan:
        need = start_need_s(walls, mode, model)
        if left() < need:
            reason = f"deadline: {left():.0f} s left, ~{need:.0f} s needed"
            doc["skipped"].append({"what": "start", "mode": mode, "start": start, "reason": reason})
            print(f"[{model} {mode} start {start}] skipped ({reason})", flush=True)
            continue
        t0 = time.perf_counter()
        rc, out, err = run_child([sys.executable, os.path.abspath(__file__), "--model", model, "--one", mode],
                                 dict(os.environ, **mode_env(mode)), None if left() == float("inf") else left())
        wall = time.perf_counter() - t0
        walls.setdefault(mode, []).append(wall)
        suffix = f"_s{start}" if (starts > 1 or offset) else ""
        with open(os.path.join(out_dir, f"vllm_ttft_{model}_{mode}{suffix}.log"), "w") as f:
            f.write(out + "\n--- stderr ---\n" + err)  # the engine's own log, per start
        r = _result_line(out)
        if r is None:
            tail = (out + err)[-3000:]
            why = "killed at the deadline" if rc is None else f"rc={rc}"
            doc["results"].append({"mode": mode, "model": model, "start": start, "error": why, "log_tail": tail,
                                   "wall_s": round(wall, 1)})
            print(f"[{model} {mode} start {start}] FAILED {why} after {wall:.0f}s\n{tail}", flush=True)
            save_partial()
            continue
        r.update(start=start, wall_s=round(wall, 1))
        doc["results"].append(r)
        if rc:  # measured, then died on the way out: keep the numbers, say so
            r["exit_rc"] = rc
            print(f"[{model} {mode}] WARNING: exited with rc={rc} after printing its result; "
                  f"stderr tail: {err[-300:]!r}", flush=True)
        print(f"[{model} {mode} start {start}] done in {wall:.0f}s: turn-2 median {r['turn2_median_s']:.4f} s, "
              f"hit rate {100 * r['turn2_hit_rate']:.1f}%, turn-1 median {r['turn1_median_s']:.4f} s, "
              f"LLM() {r['startup_s']:.0f} s", flush=True)
        direct = (r.get("connector_counters") or {}).get("rank0_disk_direct_io")
        if direct is not None:
            how = "O_DIRECT (the disk itself)" if direct else "BUFFERED: the page cache may serve them, not the disk"
            print(f"[{model} {mode} start {start}] disk reads {how}", flush=True)
        pm = r.get("prefill_model") or {}
        if pm.get("predicted_over_measured") is not None:  # issue 32 item 3: the learned model against turn 1
            print(f"[{model} {mode} start {start}] prefill model ({pm['source']}, {pm['clock']} clock, "
                  f"{pm['samples']} samples): turn 1 predicted {pm['turn1_predicted_s']:.4f} s = "
                  f"{pm['predicted_over_measured']:.3f}x of measured", flush=True)
        save_partial()
    if pcie:
        if left() >= PCIE_GUESS_S:
            doc["pcie"].append(pcie_probe("after", None if left() == float("inf") else left()))
        else:
            doc["skipped"].append({"what": "pcie after", "reason": f"deadline: {left():.0f} s left"})
    return doc


# ------------------------------------------------------------------- issue 14 item 2: the floor
RATIO_GOAL = 1.3  # CPU-hit TTFT / floor
SPREAD_GOAL = 1.2  # max / min of a mode's turn-2 median over engine starts


def kv_bytes_per_token(model: str) -> int | None:
    """KV bytes one token occupies over all layers (bf16): K and V per KV head, or MLA's one latent. None for
    the sliding-window hybrids, where what a hit loads depends on the window (the dry run computes that)."""
    c = MODELS[model]
    if "kv_lora_rank" not in c and any(t != "full_attention" for t in c.get("layer_types", ())):
        return None
    return kv_bytes_of(c)


def expected_hit_tokens(w: dict) -> int:
    """Prefix tokens a turn-2 CPU hit should load: the turn-1 prefix's whole blocks (tiered_kv stores whole
    chunks plus a tail piece of the remaining whole blocks, docs/vllm.md), within vLLM's rule that the
    last prompt token is always computed."""
    return min(w["prefix"] // BLOCK * BLOCK, (w["prefix"] + FOLLOW - 1) // BLOCK * BLOCK)


def _ceilings(pcie: list[dict]) -> dict[str, float]:
    """The h2d ceiling (best GB/s over every probe) per call."""
    out: dict[str, float] = {}
    for p in pcie:
        if "h2d" in p:
            call = p.get("call", "")
            out[call] = max(out.get(call, 0.0), max(p["h2d"]["samples_gbps"]))
    return out


def item2_summary(results: list[dict], pcie: list[dict], model: str, w: dict) -> dict:
    """Issue 14 item 2 from one call's (or several merged calls') results.

    Per mode: the turn-2 median of every engine start, their min / median / max and spread = max / min
    (goal <= SPREAD_GOAL; needs >= 2 starts). The floor: ``floor_s`` = hit bytes / PCIe h2d ceiling + the
    median over starts of mode ``floor``'s turn-2 median (the new tokens' prefill with the prefix already
    in vLLM's GPU cache). Hit bytes: tiered-cpu's own counters (bytes loaded / turn-2 hits, median over its
    starts; another tiered-cpu-* mode's without it) when present, else expected_hit_tokens x
    kv_bytes_per_token. The ceiling: the best contiguous pinned h2d copy of the same call (merged calls: the
    median of the calls' ceilings). Every mode other than ``none`` and ``floor`` gets ratio = its median over
    starts / floor_s (goal <= RATIO_GOAL) and, per start that also ran ``floor``, the same ratio with that
    start's floor and its call's ceiling."""
    ok = [r for r in results if "error" not in r and "turn2_median_s" in r]
    modes = list(dict.fromkeys(r["mode"] for r in ok))
    out: dict = {"goals": {"ratio": RATIO_GOAL, "spread": SPREAD_GOAL}, "modes": {}}
    for m in modes:
        xs = [r["turn2_median_s"] for r in ok if r["mode"] == m]
        spread = max(xs) / min(xs) if len(xs) >= 2 and min(xs) > 0 else None
        out["modes"][m] = {"starts": len(xs), "turn2_median_s": xs, "min_s": min(xs),
                           "median_s": round(statistics.median(xs), 5), "max_s": max(xs),
                           "spread": round(spread, 3) if spread else None,
                           "spread_ok": spread <= SPREAD_GOAL if spread else None}
    counted = next((m for m in ["tiered-cpu", *modes] if m.startswith("tiered-cpu")
                    and any(r.get("bytes_per_hit") for r in ok if r["mode"] == m)), None)
    loaded = [r["bytes_per_hit"] for r in ok if r["mode"] == counted and r.get("bytes_per_hit")]
    per_token = kv_bytes_per_token(model)
    if loaded:
        hit_bytes = statistics.median(loaded)
        source = f"{counted} counters (sched_bytes_loaded / turn-2 hits), median of {len(loaded)} start(s)"
    elif per_token:
        hit_bytes = expected_hit_tokens(w) * per_token
        source = (f"computed: {expected_hit_tokens(w)} prefix tokens (whole {BLOCK}-token blocks) x "
                  f"{per_token} KV bytes per token (no tiered-cpu counters in these results)")
    else:
        hit_bytes, source = None, "unknown: no tiered-cpu counters and a hybrid model (run tiered-cpu)"
    ceilings = _ceilings(pcie)
    ceiling = statistics.median(ceilings.values()) if ceilings else None
    samples = [x for p in pcie if "h2d" in p for x in p["h2d"]["samples_gbps"]]
    out.update(hit_bytes=hit_bytes, hit_bytes_source=source, kv_bytes_per_token=per_token,
               pcie_h2d_ceiling_gbps=ceiling, pcie_h2d_median_gbps=statistics.median(samples) if samples else None,
               pcie_calls=ceilings)
    floor = out["modes"].get("floor")
    missing = [what for what, have in (("hit bytes", hit_bytes), ("a PCIe rate", ceiling), ("mode floor", floor))
               if not have]
    if missing:
        out["floor_s"] = None
        out["floor_missing"] = missing
        return out
    copy_s = hit_bytes / (ceiling * 1e9)
    out.update(copy_s=round(copy_s, 5), floor_ttft_s=floor["median_s"], floor_s=round(copy_s + floor["median_s"], 5))
    floors = {(r.get("call", ""), r.get("start")): r["turn2_median_s"] for r in ok if r["mode"] == "floor"}
    for m, rec in out["modes"].items():
        if m in ("none", "floor"):
            continue
        rec["ratio"] = round(rec["median_s"] / out["floor_s"], 3)
        rec["ratio_ok"] = rec["ratio"] <= RATIO_GOAL
        per_start = []
        for r in ok:
            key = (r.get("call", ""), r.get("start"))
            if r["mode"] == m and key in floors and key[0] in ceilings:
                f_s = hit_bytes / (ceilings[key[0]] * 1e9) + floors[key]
                per_start.append(round(r["turn2_median_s"] / f_s, 3))
        rec["ratio_per_start"] = per_start
    return out


def item2_table(s: dict) -> str:
    """The item-2 summary as text: the floor's parts, then one row per mode."""
    gb = lambda x: f"{x / 1e9:.3f} GB" if x else "n/a"  # noqa: E731
    ceiling = s.get("pcie_h2d_ceiling_gbps")
    calls = s.get("pcie_calls") or {}
    where = "same call" if len(calls) <= 1 else f"median of {len(calls)} calls' bests: " + ", ".join(
        f"{c} {g:.2f}" for c, g in calls.items())
    rate = (f"{'best' if len(calls) <= 1 else 'ceiling'} {ceiling:.2f} GB/s, median of all copies "
            f"{s['pcie_h2d_median_gbps']:.2f} GB/s" if ceiling else "not measured")
    lines = [f"PCIe h2d ceiling (contiguous pinned 1 GiB copies, {where}): {rate}",
             f"hit bytes per turn 2: {gb(s.get('hit_bytes'))} ({s['hit_bytes_source']})"]
    if s.get("floor_s") is None:
        lines.append(f"floor: n/a (missing: {', '.join(s.get('floor_missing', []))})")
    else:
        lines.append(f"floor_s = {s['copy_s'] * 1e3:.1f} ms (hit bytes / ceiling) + {s['floor_ttft_s'] * 1e3:.1f} ms "
                     f"(mode floor: prefix in vLLM's GPU cache) = {s['floor_s'] * 1e3:.1f} ms")
    lines += ["", f"| mode | starts | turn-2 median over starts: min / median / max (s) | spread max/min "
                  f"(goal <= {SPREAD_GOAL}) | median / floor_s (goal <= {RATIO_GOAL}) | per start |",
              "|---|---|---|---|---|---|"]
    mark = lambda ok: "" if ok is None else (" ok" if ok else " MISSED")  # noqa: E731
    for m, r in s["modes"].items():
        spread = f"{r['spread']:.3f}{mark(r['spread_ok'])}" if r["spread"] else "n/a (1 start)"
        ratio = f"{r['ratio']:.3f}{mark(r['ratio_ok'])}" if "ratio" in r else "-"
        per = ", ".join(f"{x:.3f}" for x in r.get("ratio_per_start", [])) or "-"
        lines.append(f"| {m} | {r['starts']} | {r['min_s']:.4f} / {r['median_s']:.4f} / {r['max_s']:.4f} "
                     f"| {spread} | {ratio} | {per} |")
    return "\n".join(lines)


def table(results: list[dict]) -> str:
    """Side-by-side markdown table; speed-up and token equality are relative to ``none`` (this run's, or
    the one in the JSON file named by BASELINE when the modes were split over several runs); without
    any ``none``, tokens are compared with ``floor``'s (no connector either: the same numbers)."""
    base = next((r for r in results if r["mode"] == "none" and "error" not in r), None)
    if base is None and os.environ.get("BASELINE"):
        with open(os.environ["BASELINE"]) as f:
            base = next((r for r in json.load(f)["results"] if r["mode"] == "none" and "error" not in r), None)
    ref = base or next((r for r in results if r["mode"] == "floor" and "error" not in r), None)
    rows = ["| mode | turn-2 median (s) | vs recompute | turn-2 hit rate | greedy tokens = "
            f"{'none' if base or not ref else 'floor'} | loaded per hit "
            "(GB) | B per hit token | turn-1 stored (GB) | turn-1 store s |",
            "|---|---|---|---|---|---|---|---|---|"]
    several = len({(r.get("call"), r.get("start")) for r in results}) > 1
    for r in results:
        label = r["mode"]
        if several:  # several engine starts (or merged calls): say which row is which
            label += f" (start {r.get('start')}{', ' + r['call'] if r.get('call') else ''})"
        if "error" in r:
            rows.append(f"| {label} | failed ({r['error']}) | | | | | | | |")
            continue
        speed = f"{base['turn2_median_s'] / r['turn2_median_s']:.2f}x" if base else "-"
        same = "-" if ref is None or r is ref else ("yes" if r["first_tokens"] == ref["first_tokens"] else "NO")
        if "bytes_per_hit" in r:
            moved = (f"{r['bytes_per_hit'] / 1e9:.3f} | {r['bytes_per_hit_token']:.0f} | "
                     f"{r['turn1_bytes_stored'] / 1e9:.3f} | {r['turn1_store_seconds']:.3f}")
        else:
            moved = "n/a | n/a | n/a | n/a"
        rows.append(f"| {label} | {r['turn2_median_s']:.4f} | {speed} | {100 * r['turn2_hit_rate']:.1f}% "
                    f"| {same} | {moved} |")
    return "\n".join(rows)


def overlap_summary(results: list[dict], tier: str = "disk", chunk_blocks: int = 16,
                    step_tokens: int = 0) -> dict | None:
    """Issue 32 item 2: ``tiered-<tier>-overlap``'s turn-2 median (median over starts) against min(recompute =
    ``none``, full load = ``tiered-<tier>-always``) of the same call; None without those three modes."""
    def med(mode: str) -> float | None:
        xs = sorted(r["turn2_median_s"] for r in results if r["mode"] == mode and "error" not in r)
        return xs[len(xs) // 2] if xs else None

    split, recompute, load_all = med(f"tiered-{tier}-overlap"), med("none"), med(f"tiered-{tier}-always")
    if None in (split, recompute, load_all):
        return None
    best = min(recompute, load_all)
    out = {"tier": tier, "overlap_s": split, "recompute_s": recompute, "load_all_s": load_all,
           "ratio": round(split / best, 3), "goal": 0.8, "met": split <= 0.8 * best}
    floor = split_floor([r for r in results if r["mode"] == f"tiered-{tier}-overlap" and "error" not in r], tier,
                        recompute, chunk_blocks * BLOCK, step_tokens)
    if floor is not None:
        out.update(floor, floor_ratio=round(split / floor["floor_s"], 3))
    return out


def split_floor(runs: list[dict], tier: str, recompute_s: float, chunk: int, step_tokens: int = 0) -> dict | None:
    """The best a split can do at the read rate the overlap mode's own reads got (its loaded bytes over its read
    seconds, all starts together) and its learned prefill model: ``planner.split.plan_split`` with the overlap (the
    fill of ``config.overlap_spans``, ``chunk`` tokens the unit, ``step_tokens`` a step: vLLM's
    ``max_num_batched_tokens``) for the prefix, scaled so the model's recompute time is the measured one
    (``recompute_s``). None when no start read anything under the forward or none learned a model."""
    from tiered_kv.connector.vllm.config import overlap_fill_layers
    from tiered_kv.planner.rates import PrefillModel
    from tiered_kv.planner.split import Segment, plan_split

    nbytes = secs = 0.0
    coeffs = per_token = prefix = None
    for r in runs:
        c = r.get("connector_counters") or {}
        # the ranks read at once: the slowest rank's seconds for all ranks' bytes
        read_s = max((v for k, v in c.items() if k.endswith("_overlap_read_seconds")), default=0.0)
        if read_s > 0 and r.get("bytes_per_hit_token"):
            nbytes += c.get(f"split_{tier}_loaded_tokens", 0) * r["bytes_per_hit_token"]
            secs += read_s
            per_token, prefix = r["bytes_per_hit_token"], r["prefix"]
        coeffs = coeffs or (r.get("prefill_model") or {}).get("coefficients")
    if not (nbytes > 0 and secs > 0 and coeffs and prefix):
        return None
    gbps = nbytes / secs / 1e9
    held = prefix // chunk * chunk
    plan = plan_split([Segment(tier, held, per_token, gbps)], prefix - held + FOLLOW, 0, PrefillModel(*coeffs),
                      overlap=True, unit_tokens=chunk, step_tokens=step_tokens or prefix + 512,
                      layers=overlap_fill_layers(MODELS[runs[0]["model"]]["num_hidden_layers"]))
    return {"read_gbps": round(gbps, 3), "floor_load_tokens": plan.load_tokens,
            "floor_s": round(recompute_s * plan.seconds / plan.seconds_recompute, 4)}


def overlap_line(o: dict | None) -> str:
    """``overlap_summary`` as one line ('' without it)."""
    if o is None:
        return ""
    t = o.get("tier", "disk")
    line = (f"issue 32 item 2: tiered-{t}-overlap {o['overlap_s']:.4f} s against min(recompute "
            f"{o['recompute_s']:.4f}, full {t} load {o['load_all_s']:.4f}) = {o['ratio']:.3f}x "
            f"(goal <= {o['goal']}: {'met' if o['met'] else 'MISSED'})")
    if "floor_s" in o:
        line += (f"; the split's floor at the {o['read_gbps']:.2f} GB/s its reads got: {o['floor_s']:.4f} s "
                 f"(loading {o['floor_load_tokens']} tokens) = {o['floor_s'] / o['recompute_s']:.3f}x of recompute; "
                 f"ours {o['floor_ratio']:.3f}x of that floor (goal <= 1.1)")
    return line


# ------------------------------------------------------------------------------------------- dry run
def kv_specs(model_config, block_size: int) -> dict:
    """Each layer's KV cache spec as vLLM's attention layers report it (no model needed)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    text = model_config.hf_text_config
    dtype = torch.bfloat16
    specs = {}
    if model_config.use_mla:
        extra = {"max_tp_shards": 1} if "max_tp_shards" in MLAAttentionSpec.__dataclass_fields__ else {}
        for i in range(text.num_hidden_layers):
            specs[f"model.layers.{i}.self_attn.attn"] = MLAAttentionSpec(
                block_size=block_size, num_kv_heads=1, head_size=model_config.get_head_size(), dtype=dtype,
                cache_dtype_str="auto", **extra)
        return specs
    heads, head = model_config.get_total_num_kv_heads(), model_config.get_head_size()
    types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    for i, kind in enumerate(types):
        name = f"model.layers.{i}.self_attn.attn"
        if kind == "sliding_attention":
            specs[name] = SlidingWindowSpec(block_size=block_size, num_kv_heads=heads, head_size=head, dtype=dtype,
                                            sliding_window=int(text.sliding_window))
        else:
            specs[name] = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head, dtype=dtype)
    return specs


def dry_run(model: str, modes: list[str]) -> dict:
    """Print every mode's engine arguments, and the KV cache groups and tiered_kv's per-chunk bytes that
    vLLM's own grouping code gives this model (CPU only: no weights, no GPU)."""
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core import kv_cache_utils as ku

    from tiered_kv.connector.vllm.config import ConnectorConfig
    from tiered_kv.connector.vllm.geometry import geometry

    w = workload(model)
    model_dir = write_model(model, w["prefix"] + 512)
    report: dict = {"model": model, "workload": w, "modes": {}}
    print(f"== {model}: workload {w}")
    for mode in modes:
        kw = {k: v for k, v in engine_kwargs(mode, model_dir, w).items() if k != "kv_transfer_config"}
        if mode.startswith("tiered"):
            kw["kv_connector_extra_config"] = tiered_extra(mode, w)
        print(f"  {mode}: env {mode_env(mode)} LLM({kw})")
        report["modes"][mode] = {"env": mode_env(mode), "kwargs": {k: str(v) for k, v in kw.items()}}
    mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                     max_model_len=w["prefix"] + 512)
    block = 16
    for store in ("window", "all"):
        extra = tiered_extra("tiered-cpu", w)
        extra["swa_store"] = store
        cfg = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=block, enable_prefix_caching=True),
                         scheduler_config=SchedulerConfig(max_num_batched_tokens=w["max_batched"],
                                                          max_model_len=w["prefix"] + 512, is_encoder_decoder=False),
                         kv_transfer_config=KVTransferConfig(kv_connector="TieredKVConnector", kv_role="kv_both",
                                                             kv_connector_module_path="tiered_kv.connector.vllm",
                                                             kv_connector_extra_config=extra),
                         device_config=DeviceConfig("cpu"))
        cfg.scheduler_config.disable_hybrid_kv_cache_manager = False  # what a GPU platform does; CPU turns it off
        if "kv_cache_layout" in vars(cfg.cache_config):
            cfg.cache_config.kv_cache_layout = "NHD"
        specs = kv_specs(mc, block)
        page = max(s.page_size_bytes for s in specs.values())
        kvc = ku.get_kv_cache_configs(cfg, [specs], [page * len(specs) * (w["prefix"] // block + 256)])[0]
        geo = geometry(cfg, kvc, ConnectorConfig.from_extra_config(extra).chunk_blocks, store)
        hit_chunks = w["prefix"] // geo.chunk_tokens

        def blocks_loaded(g, hit_blocks):  # what vLLM allocates (and a load fills) for a hit of hit_blocks
            if g.kind == "swa":
                window = int(kvc.kv_cache_groups[g.index].kv_cache_spec.sliding_window)
                return min(hit_blocks, -(-(window - 1) // g.block_size))
            return 1 if g.kind == "mamba" else hit_blocks

        loaded = sum(blocks_loaded(g, hit_chunks * g.chunk_blocks) * g.block_nbytes for g in geo.groups)
        groups = [{"kind": g.kind, "layers": len(g.layer_names), "block_bytes": g.block_nbytes,
                   "blocks_per_chunk": g.chunk_blocks, "stored": g.stored, "window_blocks": g.window_blocks} for g in geo.groups]
        probe = store_probe(geo, ConnectorConfig.from_extra_config(extra))
        print(f"  swa_store={store}: {len(geo.groups)} KV cache group(s), chunk {geo.chunk_tokens} tokens, "
              f"{geo.rank_chunk_nbytes / 2**20:.2f} MiB stored per chunk, a {hit_chunks}-chunk hit loads "
              f"{loaded / 2**20:.1f} MiB ({loaded / (hit_chunks * geo.chunk_tokens):.0f} B per hit token); "
              f"CPU-side store of {probe['chunks']} chunks: {probe['ms_per_chunk']:.2f} ms per chunk "
              f"(median of {probe['repeats']})")
        for g in groups:
            print(f"    {g}")
        report[f"swa_store_{store}"] = {"groups": groups, "chunk_tokens": geo.chunk_tokens,
                                        "bytes_per_chunk": geo.rank_chunk_nbytes, "bytes_per_hit": loaded,
                                        "cpu_store_probe": probe}
    return report


def store_probe(geo, cfg, chunks: int = 16, repeats: int = 5) -> dict:
    """CPU-side cost of storing ``chunks`` chunks of this geometry: tiered_kv's worker copying from
    CPU tensors shaped like the model's KV into its slab (no GPU: torch indexing copies, so the time
    follows the bytes). Returns bytes and the median milliseconds per chunk."""
    import torch

    from tiered_kv.connector.vllm.common import CPU, StepPlan
    from tiered_kv.connector.vllm.worker import WorkerRuntime
    from tiered_kv.values.jobs import EXT, JobKind, TransferJob
    from tiered_kv.values.keys import Namespace

    blocks = {g.index: chunks * g.chunk_blocks for g in geo.groups}
    num_blocks = 2 + sum(blocks.values())
    rt = WorkerRuntime(cfg, geo, Namespace("probe"), 0, chunks, 0)
    try:
        kv = {}
        for g in geo.groups:
            per_layer = g.block_nbytes // len(g.layer_names)
            for name in g.layer_names:
                kv[name] = torch.full((num_blocks, per_layer), 7, dtype=torch.uint8)
        rt.register(kv)
        # disjoint block ids per group (vLLM's groups share one pool), chunk after chunk
        first, ids = 1, {}
        for g in geo.groups:
            ids[g.index] = list(range(first, first + blocks[g.index]))
            first += blocks[g.index]
        ext = []
        for c in range(chunks):
            for g in geo.groups:
                ext += ids[g.index][(c + 1) * g.chunk_blocks - g.stored:(c + 1) * g.chunk_blocks]  # its stored blocks
        times = []
        for rep in range(repeats):
            job = TransferJob(rep + 1, JobKind.INGRESS, EXT, CPU, [b"%d" % c for c in range(chunks)],
                              list(range(chunks)), list(range(chunks)))
            rt.on_plan(StepPlan(rep + 1, stores=[job], ext={rep + 1: ext}))
            t0 = time.perf_counter()
            rt.after_forward()
            while not rt.poll().reports:
                time.sleep(0.0005)
            times.append(time.perf_counter() - t0)
        return {"chunks": chunks, "bytes_per_chunk": geo.rank_chunk_nbytes, "repeats": repeats,
                "ms_per_chunk": sorted(times)[repeats // 2] / chunks * 1e3}
    finally:
        rt.close()


def plan(model: str, modes: list[str], starts: int, deadline_s: float, offset: int = 0, pcie: bool = True) -> dict:
    """What a call would do, with the time estimates the deadline check uses before anything was measured
    (CPU only): the start order, which starts the guesses say fit, the working set against the GPU cache
    and the CPU tier, and the hit bytes the floor will use if the tiered mode reports none."""
    w = workload(model)
    guess = START_GUESS_S.get(model, START_GUESS_DEFAULT_S)
    order = schedule(modes, starts, offset)
    budget = (deadline_s - STOP_MARGIN_S - (2 * PCIE_GUESS_S if pcie else 0)) if deadline_s else float("inf")
    fit = int(budget // guess) if deadline_s else len(order)
    per_token = kv_bytes_per_token(model)
    conv_tokens = w["prefix"] + FOLLOW
    working = w["n_conv"] * conv_tokens * per_token if per_token else None
    return {
        "model": model, "modes": modes, "starts": starts, "start_offset": offset, "deadline_s": deadline_s,
        "schedule": [[s_, m] for s_, m in order], "start_guess_s": guess, "pcie_probes": 2 if pcie else 0,
        "pcie_probe_command": f"{sys.executable} {os.path.abspath(__file__)} --pcie-probe" if pcie else None,
        "estimated_s": round(len(order) * guess + (2 * PCIE_GUESS_S if pcie else 0) + STOP_MARGIN_S),
        "starts_that_fit_by_guess": min(fit, len(order)),
        "expected_hit_tokens": expected_hit_tokens(w), "kv_bytes_per_token": per_token,
        "expected_hit_bytes": expected_hit_tokens(w) * per_token if per_token else None,
        "working_set_bytes": working, "gpu_cache_bytes": w["gpu_blocks"] * BLOCK * per_token if per_token else None,
        "cpu_tier_bytes": w["cpu_gib"] << 30,
        "working_set_exceeds_gpu_cache": working > w["gpu_blocks"] * BLOCK * per_token if per_token else None,
        "working_set_fits_cpu_tier": working <= w["cpu_gib"] << 30 if per_token else None,
    }


def merge(paths: list[str]) -> dict:
    """Several calls' JSON files of one model as one document: every start's result and every PCIe probe,
    each tagged with its call (the file's ``call``, else its name), and the item-2 summary over all of them."""
    docs = []
    for p in paths:
        with open(p) as f:
            docs.append(json.load(f))
    models = {d["model"] for d in docs}
    if len(models) != 1:
        raise SystemExit(f"--merge needs files of one model, got {sorted(models)} from {paths}")
    model = models.pop()
    results, pcie = [], []
    commands = []
    for p, d in zip(paths, docs):
        call = d.get("call") or os.path.basename(p)
        # an already merged file keeps its starts' calls (a results file can take a later round's calls)
        results += [dict(r, call=r.get("call") or call) for r in d["results"]]
        pcie += [dict(x, call=x.get("call") or call) for x in d.get("pcie", [])]
        commands += [c for c in str(d.get("command") or "").split("; ") if c and c not in commands]
    w = docs[0].get("workload") or workload(model)
    summary = item2_summary(results, pcie, model, w)
    overlap = {t: o for t in ("disk", "remote")
               if (o := overlap_summary(results, t, w.get("chunk_blocks", 16), w.get("max_batched", 0))) is not None}
    overlap = overlap or None
    return {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model": model, "merged_from": paths,
            "device": next((r["device"] for r in results if r.get("device")), "unknown"),
            "command": "; ".join(commands),
            "workload": w, "results": results, "pcie": pcie, "item2": summary, "overlap": overlap,
            "table": table(results), "item2_table": item2_table(summary)}


def main() -> None:
    """CLI entry point."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="llama3-8b", help="model shape (dummy weights)")
    ap.add_argument("--modes", default=None, help="comma-separated modes (default: the model's default modes)")
    ap.add_argument("--one", choices=MODES + EXTRA_MODES, help="run a single mode in this process and print RESULT")
    ap.add_argument("--dry-run", action="store_true", help="print configs, KV cache groups and bytes per chunk; no GPU")
    ap.add_argument("--starts", type=int, default=1, help="engine starts per mode (order rotated per start)")
    ap.add_argument("--start-offset", type=int, default=0,
                    help="index of this call's first start (rotates the order; label starts across calls)")
    ap.add_argument("--deadline-s", type=float, default=0.0,
                    help="begin no start that would end later than this many s after the call began; 0: no limit")
    ap.add_argument("--no-pcie", action="store_true",
                    help="skip the PCIe probe (it runs by default when mode floor is among the modes)")
    ap.add_argument("--call", default="", help="a label for this call in the JSON (--merge tells calls apart by it)")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="merge calls' JSON files of one model; no GPU")
    ap.add_argument("--pcie-probe", action="store_true", help=argparse.SUPPRESS)  # the probe's own process
    args = ap.parse_args()
    if args.one:
        if args.one.startswith("tiered-remote"):  # a Redis Cluster on loopback for this start, then gone
            with loopback_cluster(workload(args.model)):
                print("RESULT " + json.dumps(run_one(args.one, args.model)), flush=True)
            return
        print("RESULT " + json.dumps(run_one(args.one, args.model)), flush=True)
        return
    if args.pcie_probe:
        from gpu_copy import pcie_ceiling

        print("RESULT " + json.dumps(pcie_ceiling()), flush=True)
        return
    if args.merge:
        doc = merge(args.merge)
        print(doc["table"] + "\n\n" + doc["item2_table"]
              + "".join("\n" + overlap_line(o) for o in (doc["overlap"] or {}).values()))
        out_dir = os.environ.get("OUT") or "."
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"vllm_ttft_{doc['model']}_merged.json"), "w") as f:
            json.dump(doc, f, indent=1)
        return
    if args.starts < 1:
        raise SystemExit(f"--starts must be >= 1, got {args.starts}")
    modes = [m for m in (args.modes or ",".join(DEFAULT_MODES[args.model])).split(",") if m]
    bad = [m for m in modes if m not in MODES + EXTRA_MODES]
    if bad:
        raise SystemExit(f"unknown mode(s) {bad}; valid: {', '.join(MODES + EXTRA_MODES)}")
    out_dir = os.environ.get("OUT") or "."
    os.makedirs(out_dir, exist_ok=True)
    pcie = "floor" in modes and not args.no_pcie
    if args.dry_run:
        p = plan(args.model, modes, args.starts, args.deadline_s, args.start_offset, pcie)
        print(f"== plan: {len(p['schedule'])} engine start(s) in this order {p['schedule']}; "
              f"~{p['start_guess_s']:.0f} s "
              f"each before one is measured; {p['pcie_probes']} PCIe probe(s) ({p['pcie_probe_command']}); "
              f"estimated {p['estimated_s']} s; by the guesses {p['starts_that_fit_by_guess']} start(s) fit "
              f"--deadline-s {args.deadline_s or 'none'} (the deadline check then uses measured start times)")
        if p["kv_bytes_per_token"]:
            print(f"   turn-2 hit: {p['expected_hit_tokens']} tokens x {p['kv_bytes_per_token']} B = "
                  f"{p['expected_hit_bytes'] / 1e9:.3f} GB; working set {p['working_set_bytes'] / 2**30:.1f} GiB "
                  f"vs GPU "
                  f"cache {p['gpu_cache_bytes'] / 2**30:.1f} GiB (exceeds: {p['working_set_exceeds_gpu_cache']}) "
                  f"and CPU tier {p['cpu_tier_bytes'] >> 30} GiB (fits: {p['working_set_fits_cpu_tier']})")
        report = dry_run(args.model, modes)
        report["plan"] = p
        with open(os.path.join(out_dir, f"vllm_ttft_{args.model}_dry_run.json"), "w") as f:
            json.dump(report, f, indent=1)
        return
    date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    doc = run_all(args.model, modes, args.starts, args.deadline_s, args.start_offset, pcie)
    w = workload(args.model)
    summary = item2_summary(doc["results"], doc["pcie"], args.model, w)
    text, text2 = table(doc["results"]), item2_table(summary)
    overlap = {t: o for t in ("disk", "remote")
               if (o := overlap_summary(doc["results"], t, w["chunk_blocks"], w["max_batched"])) is not None}
    overlap = overlap or None
    print(text + "\n\n" + text2 + "".join("\n" + overlap_line(o) for o in (overlap or {}).values()))
    for s_ in doc["skipped"]:
        print(f"skipped: {s_}")
    device = next((x["device"] for x in doc["pcie"] + doc["results"] if x.get("device")), None)
    with open(os.path.join(out_dir, f"vllm_ttft_{args.model}.json"), "w") as f:
        json.dump({"date": date, "model": args.model, "device": device, "call": args.call or date,
                   "command": " ".join(["python3", "benchmarks/vllm_ttft.py"] + sys.argv[1:]), "workload": w,
                   "modes": modes, "starts": args.starts, "start_offset": args.start_offset,
                   "deadline_s": args.deadline_s, **doc, "item2": summary, "table": text, "item2_table": text2,
                   "overlap": overlap},
                  f, indent=1)


if __name__ == "__main__":
    main()
