"""Turn-2 time-to-first-token of a multi-turn workload: no connector vs vLLM's OffloadingConnector vs tiered_kv.

Workload (the 2026-11-21 baseline's): a Llama-3-8B-shaped model with dummy weights, 12
conversations with distinct 8,192-token prefixes, GPU KV cache limited to 32,768 tokens, so turn 2
of every conversation misses the GPU prefix cache. Turn 1 = the prefix; turn 2 = the prefix + 64
new tokens, one request at a time; TTFT = wall time of ``generate(max_tokens=1)`` (4 tokens for the
first two conversations, whose greedy tokens are compared across modes).

Modes:
  none          no connector (turn 2 recomputes the prefix)
  offloading    vLLM's OffloadingConnector, ``kv_offloading_size`` = CPU_GIB
  tiered-cpu    TieredKVConnector, cpu_bytes = CPU_GIB (the working set fits in CPU)
  tiered-disk   TieredKVConnector, cpu_bytes = DISK_CPU_GIB (< the working set) + disk tier at
                DISK_PATH, so turn-2 hits come from disk (disk_load_policy DISK_POLICY: "auto"
                lets the connector decline a disk slower than recompute; "always" forces reads)
  tiered-disk-always  (only with --modes) tiered-disk with disk_load_policy "always": raw disk speed
  tiered-cpu-async, tiered-cpu-sync, tiered-cpu-layerwise  (only with --modes) tiered-cpu with
                load_mode "async" (CPU hits load between steps, the first session's behaviour),
                "sync" (in-step, the forward waits for the whole load) or "layerwise" (the
                default, spelled out)
  tiered-cpu-gN  (only with --modes; N = 1, 2, 8, 32) tiered-cpu with load_groups N (layer groups
                of an in-step load; 32 = one per layer)
  tiered-cpu-perlayer  (only with --modes) tiered-cpu with cross_layer_blocks false (vLLM's
                separate per-layer KV tensors)
  tiered-cpu-sm  (only with --modes) tiered-cpu with in_step_copy sm_kernel
  none-v1runner, offloading-v1runner, tiered-cpu-v1runner  (only with --modes) the same on vLLM's
                V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0; 0.26 runs Llama on the V2 runner,
                which never hands a connector the cross-layer KV tensor)

Usage (GPU machine, vLLM importable, tiered_kv on PYTHONPATH):
  python benchmarks/vllm_ttft.py                      # every mode, one subprocess each, table + JSON
  python benchmarks/vllm_ttft.py --modes none,tiered-cpu
  python benchmarks/vllm_ttft.py --one tiered-cpu     # a single mode in this process (prints RESULT)
Environment: N_CONV (12), PREFIX (8192), GPU_BLOCKS (2048), CPU_GIB (24), DISK_CPU_GIB (2),
DISK_PATH (/tmp/tkv-ttft-disk; must be a real disk, not tmpfs), DISK_GIB (24), DISK_POLICY (auto), PREFILL_TPS (37000), CHUNK_BLOCKS (16),
SETTLE_S (2; 6 for tiered-disk), OUT (directory for vllm_ttft.json; default: current dir).
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

MODES = ("none", "offloading", "tiered-cpu", "tiered-disk")
#: tiered-cpu variants run on request: one extra ``kv_connector_extra_config`` setting each
CPU_VARIANTS = {
    "tiered-cpu-async": {"load_mode": "async"},
    "tiered-cpu-sync": {"load_mode": "sync"},
    "tiered-cpu-layerwise": {"load_mode": "layerwise"},
    "tiered-cpu-g1": {"load_groups": 1},
    "tiered-cpu-g2": {"load_groups": 2},
    "tiered-cpu-g8": {"load_groups": 8},
    "tiered-cpu-g32": {"load_groups": 32},
    "tiered-cpu-perlayer": {"cross_layer_blocks": False},
    "tiered-cpu-sm": {"in_step_copy": "sm_kernel"},
}
#: any mode with this suffix runs on vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0)
V1_RUNNER = "-v1runner"
EXTRA_MODES = ("tiered-disk-always", *CPU_VARIANTS,  # run on request (disk-always: disk hits even where recompute is faster)
               *(m + V1_RUNNER for m in ("none", "offloading", "tiered-cpu")))
N_CONV = int(os.environ.get("N_CONV", "12"))
PREFIX = int(os.environ.get("PREFIX", "8192"))
FOLLOW = 64
GPU_BLOCKS = int(os.environ.get("GPU_BLOCKS", "2048"))
CPU_GIB = int(os.environ.get("CPU_GIB", "24"))
DISK_CPU_GIB = int(os.environ.get("DISK_CPU_GIB", "2"))
DISK_PATH = os.environ.get("DISK_PATH", "/tmp/tkv-ttft-disk")
DISK_GIB = int(os.environ.get("DISK_GIB", "24"))
DISK_POLICY = os.environ.get("DISK_POLICY", "auto")
PREFILL_TPS = float(os.environ.get("PREFILL_TPS", "37000"))  # H200, 8B, 8k prefill: 8192 / 0.2175 s
CHUNK_BLOCKS = int(os.environ.get("CHUNK_BLOCKS", "16"))

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 16384, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
    "bos_token_id": 1, "eos_token_id": 2, "attention_bias": False, "mlp_bias": False,
}


def engine_kwargs(mode: str, model_dir: str) -> dict:
    """``LLM(...)`` arguments of one mode (everything but the connector is the same in every mode)."""
    mode = mode.removesuffix(V1_RUNNER)
    kw = dict(model=model_dir, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
              gpu_memory_utilization=0.6, max_model_len=PREFIX + 512, seed=0,
              num_gpu_blocks_override=GPU_BLOCKS, enable_prefix_caching=True,
              max_num_batched_tokens=PREFIX + 512)
    if mode == "offloading":
        kw.update(kv_offloading_size=CPU_GIB, kv_offloading_backend="native")
    elif mode.startswith("tiered"):
        from vllm.config import KVTransferConfig

        extra = {"cpu_bytes": f"{CPU_GIB}GiB", "chunk_blocks": CHUNK_BLOCKS}
        extra.update(CPU_VARIANTS.get(mode, {}))
        if mode.startswith("tiered-disk"):
            path = os.path.join(DISK_PATH, "run")
            shutil.rmtree(path, ignore_errors=True)  # a cold disk tier: hits come from this run
            extra.update(cpu_bytes=f"{DISK_CPU_GIB}GiB", disk_path=path, disk_bytes=f"{DISK_GIB}GiB",
                         disk_load_policy="always" if mode == "tiered-disk-always" else DISK_POLICY,
                         prefill_tokens_per_s=PREFILL_TPS)
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="TieredKVConnector", kv_connector_module_path="tiered_kv.connector.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    elif mode != "none":
        raise SystemExit(f"unknown mode {mode!r}; valid: {', '.join(MODES + EXTRA_MODES)}")
    return kw


def run_one(mode: str) -> dict:
    """Start an engine in this process, run the workload, return the result dict."""
    from vllm import LLM, SamplingParams

    model_dir = tempfile.mkdtemp(prefix="llama3-8b-shape-")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(LLAMA3_8B, f)
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(mode, model_dir))
    startup = time.perf_counter() - t0
    rng = random.Random(0)
    convs = [[rng.randrange(1000, 120000) for _ in range(PREFIX)] for _ in range(N_CONV)]
    follows = [[rng.randrange(1000, 120000) for _ in range(FOLLOW)] for _ in range(N_CONV)]
    one = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    four = SamplingParams(max_tokens=4, temperature=0.0, detokenize=False)

    def generate(tokens, sp):
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": tokens}], sp, use_tqdm=False)[0]
        return time.perf_counter() - t, list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)

    generate(convs[0][:512], one)  # warm-up (kernels, allocator)
    turn1 = [generate(c, one)[0] for c in convs]
    time.sleep(float(os.environ.get("SETTLE_S", "6" if mode.startswith("tiered-disk") else "2")))
    turn2, cached, tokens = [], [], []
    for i, (c, f) in enumerate(zip(convs, follows)):
        t_start = time.time()
        dt, toks, hit = generate(c + f, four if i < 2 else one)
        if os.environ.get("TIERED_KV_LOG"):  # wall-clock marks to line up with the connector's debug log
            print(f"{t_start:.3f} turn2 {i} start; {t_start + dt:.3f} end ({dt * 1e3:.1f} ms, {hit} cached)", flush=True)
        turn2.append(dt)
        cached.append(hit)
        if i < 2:
            tokens.append(toks)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"mode": mode, "startup_s": round(startup, 1), "n_conv": N_CONV, "prefix": PREFIX,
            "gpu_blocks": GPU_BLOCKS, "cpu_gib": DISK_CPU_GIB if mode.startswith("tiered-disk") else CPU_GIB,
            "turn1_median_s": round(med(turn1), 4), "turn2_median_s": round(med(turn2[2:]), 4),
            "turn2_s": [round(x, 4) for x in turn2],
            "turn2_hit_rate": round(sum(cached) / (N_CONV * (PREFIX + FOLLOW)), 4),
            "turn2_cached_tokens": cached, "first_tokens": tokens}


def run_all(modes: list[str]) -> list[dict]:
    """Each mode in its own process (a fresh GPU), one after the other."""
    results = []
    env = dict(os.environ, PYTHONHASHSEED=os.environ.get("PYTHONHASHSEED", "0"))
    for mode in modes:
        t0 = time.perf_counter()
        mode_env = dict(env, VLLM_USE_V2_MODEL_RUNNER="0") if mode.endswith(V1_RUNNER) else env
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", mode], env=mode_env,
                              capture_output=True, text=True)
        line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
        with open(os.path.join(os.environ.get("OUT", "."), f"vllm_ttft_{mode}.log"), "w") as f:
            f.write(proc.stdout + "\n--- stderr ---\n" + proc.stderr)  # the engine's own log, per mode
        if proc.returncode or line is None:
            tail = (proc.stdout + proc.stderr)[-3000:]
            results.append({"mode": mode, "error": f"rc={proc.returncode}", "log_tail": tail})
            print(f"[{mode}] FAILED rc={proc.returncode} after {time.perf_counter() - t0:.0f}s\n{tail}", flush=True)
            continue
        results.append(json.loads(line[len("RESULT "):]))
        r = results[-1]
        print(f"[{mode}] done in {time.perf_counter() - t0:.0f}s: turn-2 median {r['turn2_median_s']:.4f} s, "
              f"hit rate {100 * r['turn2_hit_rate']:.1f}%, turn-1 median {r['turn1_median_s']:.4f} s", flush=True)
        with open(os.path.join(os.environ.get("OUT", "."), "vllm_ttft_partial.json"), "w") as f:
            json.dump(results, f, indent=1)  # what a run cut short still leaves behind
    return results


def table(results: list[dict]) -> str:
    """Side-by-side markdown table; speed-up and token equality are relative to ``none``."""
    base = next((r for r in results if r["mode"] == "none" and "error" not in r), None)
    rows = ["| mode | turn-2 median (s) | vs recompute | turn-2 hit rate | turn-1 median (s) | greedy tokens = none |",
            "|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['mode']} | failed ({r['error']}) | | | | |")
            continue
        speed = f"{base['turn2_median_s'] / r['turn2_median_s']:.2f}x" if base else "-"
        same = "-" if base is None or r is base else ("yes" if r["first_tokens"] == base["first_tokens"] else "NO")
        rows.append(f"| {r['mode']} | {r['turn2_median_s']:.4f} | {speed} | {100 * r['turn2_hit_rate']:.1f}% "
                    f"| {r['turn1_median_s']:.4f} | {same} |")
    return "\n".join(rows)


def main() -> None:
    """CLI entry point."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated modes to run (subprocess each)")
    ap.add_argument("--one", choices=MODES + EXTRA_MODES, help="run a single mode in this process and print RESULT")
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one)), flush=True)
        return
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES + EXTRA_MODES]
    if bad:
        raise SystemExit(f"unknown mode(s) {bad}; valid: {', '.join(MODES + EXTRA_MODES)}")
    results = run_all(modes)
    text = table(results)
    print(text)
    out_dir = os.environ.get("OUT") or "."
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "vllm_ttft.json"), "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": results,
                   "table": text}, f, indent=1)


if __name__ == "__main__":
    main()
