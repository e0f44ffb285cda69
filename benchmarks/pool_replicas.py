"""Two vLLM replicas on one host, one CPU tier (issue 33): replica B's turn 2 of a conversation replica A served.

Setup (GPU machine with two GPUs, vLLM on PYTHONPATH, dummy weights, Llama-3-8B shape unless ``--model``):
replica A on GPU 0 and replica B on GPU 1, each a ``LLM(...)`` in its own process with a GPU KV cache too
small to keep the conversations (``GPU_BLOCKS``), so turn 2 can only hit a CPU tier.

Modes, each its own pair of engine starts:
  pool     both replicas join the host pool ``cpu_pool: host:<name>`` (``cpu_bytes`` = CPU_GIB, one pool).
           A runs turn 1 (the prefix + 2 tokens) of conversations 0..N-1 and hands B their prompts; then B
           runs turn 2 of each (the prefix + A's 2 tokens + FOLLOW new ones): a *cross* hit, chunks A stored.
           B runs turn 1 of its own conversations N..2N-1 first (so its engine is as warm for both kinds of
           hit as in ``private``), then the cross turn 2s, then turn 2 of its own (its own hits, through the pool).
  private  B alone with its own CPU tier (``cpu_bytes`` = CPU_GIB, no pool): turn 1 and turn 2 of
           conversations 0..N-1 (B's own CPU hit, the yardstick), then turn 2 of N fresh prompts of the same
           length that nobody stored (recompute).
TTFT = wall time of ``generate(max_tokens=1)``, one request at a time; the first two turn-2 requests of each
set generate 4 tokens, compared across modes (greedy), and are left out of the medians. While B measures, A is
idle (engines on one host share its host link; a comparison runs one engine at a time).

Host memory: each process's VmRSS and the pool's files in /dev/shm (their allocated bytes) after the run;
with ``private`` a second replica would pin its own CPU_GIB, with ``pool`` both map one.

Usage:  python benchmarks/pool_replicas.py [--modes pool,private] [--starts 1]
Environment: N_CONV (6), PREFIX (8192), CPU_GIB (16), GPU_BLOCKS (1024), OUT (directory for the JSON).
Output: a table and ``$OUT/pool_replicas.json``.
Threading: a script; the main thread only (each replica runs in a child process; the two replicas of a pool
run meet through files in a temporary directory).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from serving.replicas import pool_bytes, remove_pool  # noqa: E402
from vllm_ttft import MODELS, _result_line, _tiered_counters  # noqa: E402

FOLLOW = 64
MODES = ("pool", "private")


def knobs() -> dict:
    """The workload (environment overrides the defaults)."""
    e = os.environ
    prefix = int(e.get("PREFIX", "8192"))
    return {"n_conv": int(e.get("N_CONV", "6")), "prefix": prefix, "cpu_gib": int(e.get("CPU_GIB", "16")),
            "gpu_blocks": int(e.get("GPU_BLOCKS", "1024")), "max_len": prefix + 4 * FOLLOW + 64}


def conversations(model: str, w: dict, first: int, n: int) -> list[tuple[list[int], list[int]]]:
    """(prefix, follow) token lists of conversations ``first..first+n-1``, the same in every process."""
    vocab = min(120000, MODELS[model]["vocab_size"] - 1)
    out = []
    for i in range(first, first + n):
        rng = random.Random(1000 + i)
        out.append(([rng.randrange(1000, vocab) for _ in range(w["prefix"])],
                    [rng.randrange(1000, vocab) for _ in range(FOLLOW)]))
    return out


def _wait_for(path: str, timeout_s: float) -> None:
    t = time.monotonic()
    while not os.path.exists(path):
        if time.monotonic() - t > timeout_s:
            raise SystemExit(f"waited {timeout_s:.0f} s for {path}: the other replica did not get there (its log "
                             "says why)")
        time.sleep(0.2)


def _memory() -> dict:
    """This process's resident bytes from /proc/self/status: ``rss_bytes`` (VmRSS: the shared pool's pages count
    in every process that touched them), ``rss_anon_bytes`` (private memory: a private CPU tier's pinned pages)
    and ``rss_shmem_bytes`` (shared memory: the host pool)."""
    from serving.replicas import status_memory  # noqa: PLC0415 (benchmarks/ is this script's sys.path[0])

    with open("/proc/self/status") as f:
        return status_memory(f.read().splitlines())


def replica(model: str, mode: str, role: str, sync_dir: str, pool: str) -> dict:
    """One replica's engine start and its part of ``mode`` (``role``: ``a`` or ``b``); returns its record."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    w = knobs()
    # one path for both replicas: the connector's namespace names the model by its path, so replicas of one
    # model (as a router deploys them: the same path or name) share chunks, two temporary copies would not
    model_dir = os.path.join(tempfile.gettempdir(), "tkv-bench-models", model)
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, f"config.json.{role}"), "w") as f:
        json.dump(MODELS[model], f)
    os.replace(os.path.join(model_dir, f"config.json.{role}"), os.path.join(model_dir, "config.json"))
    extra: dict = {"cpu_bytes": f"{w['cpu_gib']}GiB"}
    if mode == "pool":
        extra["cpu_pool"] = f"host:{pool}"
    t0 = time.perf_counter()
    llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
              gpu_memory_utilization=0.6, max_model_len=w["max_len"], seed=0,
              num_gpu_blocks_override=w["gpu_blocks"], enable_prefix_caching=True,
              max_num_batched_tokens=w["prefix"] + 512,
              kv_transfer_config=KVTransferConfig(kv_connector="TieredKVConnector",
                                                  kv_connector_module_path="tiered_kv.connector.vllm",
                                                  kv_role="kv_both", kv_connector_extra_config=extra))
    startup = time.perf_counter() - t0
    sp = {n: SamplingParams(max_tokens=n, temperature=0.0, detokenize=False, ignore_eos=True) for n in (1, 2, 4)}

    def generate(prompt: list[int], n: int):
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], sp[n], use_tqdm=False)[0]
        return time.perf_counter() - t, out

    def turn1(convs) -> list[list[int]]:
        """Turn 1 of each; returns each conversation's turn-2 prompt."""
        return [p + list(generate(p, 2)[1].outputs[0].token_ids) + f for p, f in convs]

    def turn2(prompts) -> dict:
        secs, cached, tokens = [], [], []
        for i, p in enumerate(prompts):
            dt, out = generate(p, 4 if i < 2 else 1)
            secs.append(dt)
            cached.append(int(out.num_cached_tokens or 0))
            if i < 2:
                tokens.append(list(out.outputs[0].token_ids))
        return {"p50_s": round(statistics.median(secs[2:] or secs), 4), "s": [round(x, 4) for x in secs],
                "cached_tokens": cached, "tokens": tokens}

    generate(conversations(model, w, 9999, 1)[0][0][:512], 1)  # warm-up
    rec: dict = {"mode": mode, "role": role, "device": torch.cuda.get_device_name(0), "startup_s": round(startup, 1),
                 "knobs": w}
    n = w["n_conv"]
    if mode == "pool" and role == "a":
        prompts = turn1(conversations(model, w, 0, n))
        time.sleep(2.0)  # the stores land in the pool
        generate(conversations(model, w, 9998, 1)[0][0][:16], 1)  # a step: the planner applies the completions
        with open(os.path.join(sync_dir, "a_prompts.json.tmp"), "w") as f:
            json.dump(prompts, f)
        os.rename(os.path.join(sync_dir, "a_prompts.json.tmp"), os.path.join(sync_dir, "a_prompts.json"))
        _wait_for(os.path.join(sync_dir, "b_done"), 900)  # stay up (the pool's chunks stay) until B has measured
    elif mode == "pool":
        _wait_for(os.path.join(sync_dir, "a_prompts.json"), 900)
        with open(os.path.join(sync_dir, "a_prompts.json")) as f:
            prompts = json.load(f)
        own = turn1(conversations(model, w, n, n))  # first: B's engine is as warm for both kinds of hit
        time.sleep(2.0)  # B's stores land; the pool watcher (cpu_pool_poll_s) has long seen A's chunks
        rec["cross"] = turn2(prompts)
        rec["own"] = turn2(own)
        rec["pool_shm_bytes"] = pool_bytes(pool)  # both replicas alive: one pool's memory
        open(os.path.join(sync_dir, "b_done"), "w").close()
    else:
        own = turn1(conversations(model, w, 0, n))
        time.sleep(2.0)
        rec["own"] = turn2(own)
        rec["recompute"] = turn2([p + f for p, f in conversations(model, w, 5000, n)])
    rec.update(_memory())
    rec["counters"] = {k: v for k, v in _tiered_counters(llm).items() if isinstance(v, (int, float)) and v}
    return rec


def run_pair(model: str, mode: str, start: int) -> dict:
    """One start of ``mode``: the replicas it needs, each in a child process on its own GPU."""
    sync_dir = tempfile.mkdtemp(prefix="tkv-replicas-")
    pool = f"tkvbench{os.getpid()}s{start}"
    roles = ("a", "b") if mode == "pool" else ("b",)
    procs = {}
    logs = {}
    for role in roles:  # output to files: a replica blocked on a full pipe would never let the other finish
        env = dict(os.environ, PYTHONHASHSEED="0", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                   CUDA_VISIBLE_DEVICES="0" if role == "a" else "1")
        logs[role] = os.path.join(os.environ.get("OUT", sync_dir), f"replica_{mode}_{role}_s{start}.log")
        with open(logs[role], "w") as log:
            procs[role] = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--one", model, mode, role,
                                            sync_dir, pool], env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)  # its own group: killed with its helpers
    deadline = time.monotonic() + 1200
    while any(p.poll() is None for p in procs.values()):  # one replica failing ends the other (it would wait)
        failed = any(p.returncode not in (None, 0) for p in procs.values())
        if failed or time.monotonic() > deadline:
            for p in procs.values():
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
        time.sleep(0.5)
    remove_pool(pool)  # every process of it is gone
    out = {}
    for role, p in procs.items():
        with open(logs[role], errors="replace") as f:
            text = f.read()
        r = _result_line(text)
        if r is None:
            print(f"[{mode} #{start} replica {role}] FAILED rc={p.returncode}\n{text[-3000:]}", flush=True)
            r = {"error": f"rc={p.returncode}", "log_tail": text[-2000:]}
        out[role] = r
    shutil.rmtree(sync_dir, ignore_errors=True)  # (the logs too, unless OUT is set)
    return {"mode": mode, "start": start, "replicas": out}


def summary(doc: dict) -> str:
    """The table: B's turn-2 TTFT per kind of hit, medians over starts."""
    rows: dict[str, list[float]] = {}
    for run in doc["runs"]:
        b = run["replicas"].get("b", {})
        for kind in ("cross", "own", "recompute"):
            if kind in b:
                rows.setdefault(f"{run['mode']}/{kind}", []).append(b[kind]["p50_s"])
    lines = ["| B's turn 2 | TTFT p50 ms (min / median / max over starts) | starts |", "|---|---|---|"]
    for k, v in rows.items():
        lines.append(f"| {k} | {min(v) * 1e3:.1f} / {statistics.median(v) * 1e3:.1f} / {max(v) * 1e3:.1f} | "
                     f"{len(v)} |")
    own = rows.get("private/own")
    cross = rows.get("pool/cross")
    if own and cross:
        lines.append(f"\npool cross hit / private own hit: {statistics.median(cross) / statistics.median(own):.3f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama3-8b", choices=sorted(MODELS))
    ap.add_argument("--modes", default="pool,private")
    ap.add_argument("--starts", type=int, default=1)
    ap.add_argument("--one", nargs=5, metavar=("MODEL", "MODE", "ROLE", "SYNC_DIR", "POOL"))
    a = ap.parse_args()
    if a.one:
        print("RESULT " + json.dumps(replica(*a.one)), flush=True)
        return
    modes = a.modes.split(",")
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"unknown mode {m!r}; valid: {', '.join(MODES)}")
    doc: dict = {"date": time.strftime("%Y-%m-%d"), "model": a.model, "knobs": knobs(),
                 "command": " ".join(["python", "benchmarks/pool_replicas.py", *sys.argv[1:]]), "runs": []}
    for s in range(a.starts):
        for m in (modes[s % len(modes):] + modes[:s % len(modes)]):
            t0 = time.perf_counter()
            run = run_pair(a.model, m, s)
            run["wall_s"] = round(time.perf_counter() - t0, 1)
            b = run["replicas"].get("b", {})
            print(f"[{m} #{s}] {run['wall_s']:.0f} s: "
                  + ", ".join(f"{k} {b[k]['p50_s'] * 1e3:.1f} ms (cached {b[k]['cached_tokens'][2:4]})"
                              for k in ("cross", "own", "recompute") if k in b), flush=True)
            doc["runs"].append(run)
    pool_b = [r["replicas"]["b"] for r in doc["runs"] if r["mode"] == "pool" and "cross" in r["replicas"].get("b", {})]
    priv_b = [r["replicas"]["b"] for r in doc["runs"] if r["mode"] == "private" and "own" in r["replicas"].get("b", {})]
    if pool_b and priv_b:
        doc["greedy_cross_equals_private_own"] = all(p["cross"]["tokens"] == q["own"]["tokens"]
                                                     for p in pool_b for q in priv_b)
    print(summary(doc), flush=True)
    if "greedy_cross_equals_private_own" in doc:
        print(f"greedy tokens of B's cross hits == B's own private hits: {doc['greedy_cross_equals_private_own']}")
    out = os.path.join(os.environ.get("OUT", "."), "pool_replicas.json")
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
