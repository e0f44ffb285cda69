"""Turn-2 time-to-first-token of a multi-turn workload: no connector vs vLLM's connectors vs tiered_kv.

Models (``--model``, dummy weights, configs written here):
  llama3-8b   Llama-3-8B shape: 32 layers, 8 KV heads x 128, bf16 (one full-attention KV cache group)
  gemma3      Gemma-3-4B text shape: 34 layers, 29 sliding-window (1,024 tokens) : 5 full, 4 KV heads x 256
              (7 KV cache groups with vLLM's hybrid KV cache manager)
  gpt-oss     gpt-oss-20b shape in bf16 (no MXFP4): 24 layers alternating sliding window (128) and full,
              8 KV heads x 64, 32 experts top-4 (2 KV cache groups)
  dsv2-lite   DeepSeek-V2-Lite shape: 27 MLA layers (one 576-wide latent per token), 64 experts top-6
  qwen2.5-7b  Qwen2.5-7B shape: 28 layers, 4 KV heads x 128 (32 KiB per layer-block), bf16

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
  tiered-disk-always, tiered-cpu-async/-sync/-layerwise, tiered-cpu-gN (N = 1, 2, 8, 32),
  tiered-cpu-perlayer, tiered-cpu-sm, tiered-cpu-staged, tiered-cpu-perlayer-staged, *-v1runner
                (only with --modes) one-setting variants of the above (load_mode, load_groups,
                cross_layer_blocks false, in_step_copy sm_kernel or staged, vLLM's V1 model runner)

Per mode it reports: turn-2 median TTFT and speed-up over ``none``, turn-2 hit rate (vLLM's cached
tokens), whether the greedy tokens equal ``none``'s, and for tiered_kv the bytes its loads moved
per turn-2 hit (GB and bytes per hit token: with sliding windows only the window at the hit
boundary moves) and the bytes and seconds its turn-1 stores took. The connector's counters are
read from the engine core, which therefore runs in the benchmark's process
(VLLM_ENABLE_V1_MULTIPROCESSING=0; INPROC=0 keeps vLLM's separate engine-core process, as the
2026-11-22 runs did, and reports no byte counts).

Usage (GPU machine, vLLM importable, tiered_kv on PYTHONPATH):
  python benchmarks/vllm_ttft.py --model gemma3        # the model's default modes, one subprocess each
  python benchmarks/vllm_ttft.py --model gpt-oss --modes none,tiered-cpu
  python benchmarks/vllm_ttft.py --model dsv2-lite --one tiered-cpu   # one mode in this process
  python benchmarks/vllm_ttft.py --model gpt-oss --dry-run             # CPU: configs, KV groups, bytes
Default modes: llama3-8b: none, offloading, simple, tiered-cpu, tiered-disk; gemma3 and dsv2-lite:
none, floor, offloading, simple, tiered-cpu; gpt-oss: those and tiered-cpu-swa-all. All modes of one
model take about 5-8 minutes on an H200 (start-up with dummy weights dominates).
Environment: N_CONV, PREFIX, GPU_BLOCKS (2048; gemma3 8192, gpt-oss 4096), CPU_GIB (24), DISK_CPU_GIB (2), DISK_PATH
(/tmp/tkv-ttft-disk; a real disk, not tmpfs), DISK_GIB (24), DISK_POLICY (auto), PREFILL_TPS (37000),
CHUNK_BLOCKS (16), MAX_BATCHED (PREFIX + 512: a turn-1 prefill in one step; e.g. 2048 for chunked prefill,
where hybrid models hand window blocks on while the previous step's stores may still copy them),
SETTLE_S (2; 6 for tiered-disk), INPROC (1), OUT (directory for the JSON), BASELINE (a
vllm_ttft_<model>.json whose "none" result the table compares against when this run has none).
PYTHONHASHSEED is set to 0 in every mode's process (same hashes in every mode).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

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
EXTRA_MODES = ("floor", "tiered-disk-always", *(m for m in CPU_VARIANTS if m not in MODES),
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
GEMMA3_4B = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
    "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "sliding_window": 1024, "sliding_window_pattern": 6,
    "layer_types": [("full_attention" if (i + 1) % 6 == 0 else "sliding_attention") for i in range(34)],
    "query_pre_attn_scalar": 256, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "max_position_embeddings": 131072, "vocab_size": 262208, "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh", "attn_logit_softcapping": None, "final_logit_softcapping": None,
    "attention_bias": False, "torch_dtype": "bfloat16", "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
}
GPTOSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
    "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
    "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4,
    "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "rope_theta": 150000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 4096},
    "max_position_embeddings": 131072, "vocab_size": 201088, "rms_norm_eps": 1e-5,
    "attention_bias": True, "swiglu_limit": 7.0, "hidden_act": "silu", "tie_word_embeddings": False,
    "initial_context_length": 4096, "torch_dtype": "bfloat16", "eos_token_id": 200002, "pad_token_id": 199999,
}
DSV2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "topk_method": "greedy", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
    "scoring_func": "softmax", "norm_topk_prob": False, "aux_loss_alpha": 0.001, "seq_aux": True,
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    "max_position_embeddings": 163840, "vocab_size": 102400, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 100000, "eos_token_id": 100001,
}
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
    "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "max_position_embeddings": 32768,
    "max_window_layers": 28, "use_sliding_window": False, "sliding_window": 131072,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 152064, "bos_token_id": 151643, "eos_token_id": 151643,
}
MODELS = {"llama3-8b": LLAMA3_8B, "gemma3": GEMMA3_4B, "gpt-oss": GPTOSS_20B, "dsv2-lite": DSV2_LITE,
          "qwen2.5-7b": QWEN25_7B}
DEFAULT_MODES = {
    "llama3-8b": ("none", "offloading", "simple", "tiered-cpu", "tiered-disk"),
    "gemma3": ("none", "floor", "offloading", "simple", "tiered-cpu"),
    "gpt-oss": ("none", "floor", "offloading", "simple", "tiered-cpu", "tiered-cpu-swa-all"),
    "dsv2-lite": ("none", "floor", "offloading", "simple", "tiered-cpu"),
    "qwen2.5-7b": ("none", "floor", "offloading", "simple", "tiered-cpu"),
}
DEFAULT_N_CONV = {"llama3-8b": 12}
#: vLLM's KV cache pool in blocks: hybrid models spread a token over several groups' blocks, and the
#: engine refuses to start when the pool cannot hold one max-length request (gemma3: 7 groups)
DEFAULT_GPU_BLOCKS = {"gemma3": 8192, "gpt-oss": 4096}


def workload(model: str) -> dict:
    """The knobs of one model's run (environment overrides the defaults)."""
    env = os.environ
    return {
        "n_conv": int(env.get("N_CONV", DEFAULT_N_CONV.get(model, 8))),
        "prefix": int(env.get("PREFIX", "8192")),
        "gpu_blocks": int(env.get("GPU_BLOCKS", DEFAULT_GPU_BLOCKS.get(model, 2048))),
        "cpu_gib": int(env.get("CPU_GIB", "24")),
        "disk_cpu_gib": int(env.get("DISK_CPU_GIB", "2")),
        "disk_path": env.get("DISK_PATH", "/tmp/tkv-ttft-disk"),
        "disk_gib": int(env.get("DISK_GIB", "24")),
        "disk_policy": env.get("DISK_POLICY", "auto"),
        "prefill_tps": float(env.get("PREFILL_TPS", "37000")),  # H200, 8B, 8k prefill: 8192 / 0.2175 s
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


def tiered_extra(mode: str, w: dict) -> dict:
    """``kv_connector_extra_config`` of a tiered mode."""
    extra = {"cpu_bytes": f"{w['cpu_gib']}GiB", "chunk_blocks": w["chunk_blocks"]}
    extra.update(CPU_VARIANTS.get(mode, {}))
    if mode.startswith("tiered-disk"):
        extra.update(cpu_bytes=f"{w['disk_cpu_gib']}GiB", disk_path=os.path.join(w["disk_path"], "run"),
                     disk_bytes=f"{w['disk_gib']}GiB",
                     disk_load_policy="always" if mode == "tiered-disk-always" else w["disk_policy"],
                     prefill_tokens_per_s=w["prefill_tps"])
    return extra


def engine_kwargs(mode: str, model_dir: str, w: dict) -> dict:
    """``LLM(...)`` arguments of one mode (everything but the connector is the same in every mode)."""
    mode = mode.removesuffix(V1_RUNNER)
    kw = dict(model=model_dir, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
              gpu_memory_utilization=0.6, max_model_len=w["prefix"] + 512, seed=0,
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


def write_model(model: str) -> str:
    model_dir = tempfile.mkdtemp(prefix=f"{model}-shape-")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(MODELS[model], f)
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

        out.update({f"rank0_{k}": v for k, v in get_kv_transfer_group().stats().items()})
    except Exception:  # noqa: BLE001 - the worker is in another process (TP > 1): planner numbers only
        pass
    return out


def run_one(mode: str, model: str) -> dict:
    """Start an engine in this process, run the workload, return the result dict."""
    from vllm import LLM, SamplingParams

    w = workload(model)
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(mode, write_model(model), w))
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
    turn1 = [] if floor else [generate(c, two)[0] for c in convs]
    time.sleep(float(os.environ.get("SETTLE_S", "6" if mode.startswith("tiered-disk") else "2")))
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
    result = {"mode": mode, "model": model, "startup_s": round(startup, 1), "n_conv": n, "prefix": w["prefix"],
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
        })
    return result


def run_all(model: str, modes: list[str]) -> list[dict]:
    """Each mode in its own process (a fresh GPU), one after the other."""
    results = []
    out_dir = os.environ.get("OUT", ".")
    for mode in modes:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--model", model, "--one", mode],
                              env=dict(os.environ, **mode_env(mode)), capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        with open(os.path.join(out_dir, f"vllm_ttft_{model}_{mode}.log"), "w") as f:
            f.write(proc.stdout + "\n--- stderr ---\n" + proc.stderr)  # the engine's own log, per mode
        if line is None:
            tail = (proc.stdout + proc.stderr)[-3000:]
            results.append({"mode": mode, "model": model, "error": f"rc={proc.returncode}", "log_tail": tail})
            print(f"[{model} {mode}] FAILED rc={proc.returncode} after {time.perf_counter() - t0:.0f}s\n{tail}",
                  flush=True)
            continue
        results.append(json.loads(line[len("RESULT "):]))
        r = results[-1]
        if proc.returncode:  # measured, then died on the way out: keep the numbers, say so
            r["exit_rc"] = proc.returncode
            print(f"[{model} {mode}] WARNING: exited with rc={proc.returncode} after printing its result; "
                  f"stderr tail: {proc.stderr[-300:]!r}", flush=True)
        print(f"[{model} {mode}] done in {time.perf_counter() - t0:.0f}s: turn-2 median {r['turn2_median_s']:.4f} s, "
              f"hit rate {100 * r['turn2_hit_rate']:.1f}%, turn-1 median {r['turn1_median_s']:.4f} s", flush=True)
        with open(os.path.join(out_dir, f"vllm_ttft_{model}_partial.json"), "w") as f:
            json.dump(results, f, indent=1)  # what a run cut short still leaves behind
    return results


def table(results: list[dict]) -> str:
    """Side-by-side markdown table; speed-up and token equality are relative to ``none`` (this run's, or
    the one in the JSON file named by BASELINE when the modes were split over several runs)."""
    base = next((r for r in results if r["mode"] == "none" and "error" not in r), None)
    if base is None and os.environ.get("BASELINE"):
        with open(os.environ["BASELINE"]) as f:
            base = next((r for r in json.load(f)["results"] if r["mode"] == "none" and "error" not in r), None)
    rows = ["| mode | turn-2 median (s) | vs recompute | turn-2 hit rate | greedy tokens = none | loaded per hit "
            "(GB) | B per hit token | turn-1 stored (GB) | turn-1 store s |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['mode']} | failed ({r['error']}) | | | | | | | |")
            continue
        speed = f"{base['turn2_median_s'] / r['turn2_median_s']:.2f}x" if base else "-"
        same = "-" if base is None or r is base else ("yes" if r["first_tokens"] == base["first_tokens"] else "NO")
        if "bytes_per_hit" in r:
            moved = (f"{r['bytes_per_hit'] / 1e9:.3f} | {r['bytes_per_hit_token']:.0f} | "
                     f"{r['turn1_bytes_stored'] / 1e9:.3f} | {r['turn1_store_seconds']:.3f}")
        else:
            moved = "n/a | n/a | n/a | n/a"
        rows.append(f"| {r['mode']} | {r['turn2_median_s']:.4f} | {speed} | {100 * r['turn2_hit_rate']:.1f}% "
                    f"| {same} | {moved} |")
    return "\n".join(rows)


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

    from tiered_kv.connector.vllm.config import ConnectorConfig, geometry

    w = workload(model)
    model_dir = write_model(model)
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
                   "blocks_per_chunk": g.chunk_blocks, "stored": g.stored, "needed": g.needed} for g in geo.groups]
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

    from tiered_kv.connector.vllm.scheduler import CPU, StepPlan
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
                ext += ids[g.index][c * g.chunk_blocks + g.first_stored:(c + 1) * g.chunk_blocks]
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


def main() -> None:
    """CLI entry point."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="llama3-8b", help="model shape (dummy weights)")
    ap.add_argument("--modes", default=None, help="comma-separated modes (default: the model's default modes)")
    ap.add_argument("--one", choices=MODES + EXTRA_MODES, help="run a single mode in this process and print RESULT")
    ap.add_argument("--dry-run", action="store_true", help="print configs, KV cache groups and bytes per chunk; no GPU")
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args.model)), flush=True)
        return
    modes = [m for m in (args.modes or ",".join(DEFAULT_MODES[args.model])).split(",") if m]
    bad = [m for m in modes if m not in MODES + EXTRA_MODES]
    if bad:
        raise SystemExit(f"unknown mode(s) {bad}; valid: {', '.join(MODES + EXTRA_MODES)}")
    out_dir = os.environ.get("OUT") or "."
    os.makedirs(out_dir, exist_ok=True)
    if args.dry_run:
        report = dry_run(args.model, modes)
        with open(os.path.join(out_dir, f"vllm_ttft_{args.model}_dry_run.json"), "w") as f:
            json.dump(report, f, indent=1)
        return
    results = run_all(args.model, modes)
    text = table(results)
    print(text)
    with open(os.path.join(out_dir, f"vllm_ttft_{args.model}.json"), "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model": args.model,
                   "workload": workload(args.model), "results": results, "table": text}, f, indent=1)


if __name__ == "__main__":
    main()
