"""Serving load: ``vllm serve`` with concurrent multi-turn users, per KV-connector mode (issue 14).

For each engine start (one mode, one run) the script writes a dummy-weight model directory
(``config.json`` of the shape; vLLM fills the weights), starts ``python3 -m
vllm.entrypoints.cli.main serve`` in its own process group, waits for ``/health``, sends warm-up
requests (two prefills per fused-MoE tile band, a follow-up, a batch: ``warmup``), drives the workload (``serving/workload.py``: a shared system prompt, per-user
history growing each turn, a warm phase, then closed-loop phases at concurrency 32, 8 and 1;
history larger than the GPU KV cache), scrapes ``/metrics`` (and our connector's metrics
endpoint) around each phase, then kills the process group and waits for the GPU to empty before
the next start. Modes are interleaved: run r starts every mode once, in an order rotated by r
(and by ``--call-index`` across device calls).

Per mode and phase: TTFT p50/p90/p99, inter-token latency p50, output tokens/s, requests,
prompt tokens by source (recomputed / GPU prefix cache / connector: vLLM's
``vllm:prompt_tokens_by_source_total``), our per-tier loads (``tiered_kv_tier_hits_total``), what our
workers cost vLLM's thread (``phase["worker_time"]``: ms per engine step inside our hooks, summed over TP
ranks, by hook, fence waits, stores cancelled, in-step copies by mechanism: ``tiered_kv_worker_*``; a rank ships
a quiet step's counters within a second, so up to about a second of them lands in the next phase), greedy-output
equality with mode ``none`` (same prompts, dummy weights seeded), and min / median /
max over engine starts. Output: a table on stdout, ``$OUT/serve_bench_<shape>[_<tag>].json`` (and
a ``.partial.json`` rewritten after every phase), a PNG of TTFT p50 vs concurrency per mode, and
one server log per start (``serve_<shape>_<mode>_r<run>.log``; ``--pack-logs``: the run's logs and traces packed into
``serve_logs_<shape>[_<tag>].tgz`` at the end, the ``.partial.json`` dropped: a device call brings back 8 files).
``--trace``: every ``tiered*`` start writes our connector's per-step load trace
(``trace_<shape>_<mode>_r<run>.rank<r>.jsonl``, and the scheduler's ``trace_<shape>_<mode>_r<run>.sched.jsonl``),
summarised per phase (``phase["trace"]``, ``serving/trace_summary.py``).

``--replicas N`` (issue 33, default 1): every start is N servers, server i on GPU i with its own port,
one model path, and a round-robin router: turn t of user u goes to replica (u + t) % N, so every turn after
the first lands on another replica than the user's previous one (``serving/replicas.py``). Counters are
summed over the replicas, each replica's share is in ``phase["replicas"]``; files get ``_rr<N>``, the
server logs are packed into ``serve_logs_<shape>_rr<N>.tgz``. Modes: ``tiered-pool`` = ours with one host
pool per start (``cpu_pool: host:<name>``, every replica the same name), ``cpu_bytes`` = the same X GiB as
``tiered``'s private tier (``--cpu-gib``, default 1.25x a run's stored KV, which each private tier and the
pool can hold whole): one shared X against N private X, so the pool must win with 1/N of the host
memory, and what differs is only whether a replica finds the prefix the other one stored. ``none`` gives
the greedy reference. The floor ``none-resident`` (and any mode with its GPU cache, ``tiered-resident``) is refused
with replicas: each replica's GPU cache holds only what that replica computed, so under this router it is no floor.

GPU machine (vLLM 0.26 + LMCache 0.5.3 installed into /tmp/site by scripts/gpu/serve_setup.sh):
  PYTHONPATH=/tmp/site:. python3 benchmarks/serve_bench.py --shape llama3-8b --deadline-s 540
  PYTHONPATH=/tmp/site:. python3 benchmarks/serve_bench.py --shape qwen2.5-32b --modes tiered,offloading
Shapes (``serving/shapes.py``): llama3-8b, qwen2.5-7b, qwen2.5-32b, the sliding-window hybrids gpt-oss, gemma2
(96 users: 336 KiB a token) and gemma3, and dsv2-lite (MLA). ``--gpu-blocks`` is the history the GPU holds in
16-token blocks of sequence; for a hybrid, vLLM's ``--num-gpu-blocks-override`` adds its window groups' blocks
(``pool_blocks``; the dry run prints both), so every shape evicts about as much as Llama-3-8B:
  PYTHONPATH=/tmp/site:. python3 benchmarks/serve_bench.py --shape gpt-oss --modes none,offloading,tiered --trace
Two replicas (kind nvidia-h200-x2, after scripts/gpu/README.md's install calls 1-5, ~2 min; the dry run
guesses ~420 s of the 540: per start ~60 s start-up, +15 s while the pool reserves its 30 GiB, ~20 s of
workload, ~20 s to stop both; ~10 min of device time in all). The pool needs 30 GiB in /dev/shm (the dry
run prints what is free; if less, give every mode a smaller --cpu-gib, >= the run's 23.4 GiB of KV), the
private tiers pin 2 x 30 GiB. If the deadline skips ``none``, greedy outputs are compared with offloading's:
  PYTHONPATH=/tmp/site:. python3 benchmarks/serve_bench.py --shape llama3-8b --replicas 2 \
      --modes tiered-pool,tiered,offloading,none --deadline-s 540
Anywhere (no GPU):
  python3 benchmarks/serve_bench.py --shape llama3-8b --dry-run [--validate]   # commands, env, sizes
  python3 benchmarks/serve_bench.py --plot-from a.json b.json --out-dir docs/img  # merge calls, table, PNG
"""
from __future__ import annotations

import argparse
import asyncio
import atexit
import glob
import hashlib
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from serving import replicas, report, server, stats, trace_summary  # noqa: E402
from serving.modes import (ModeRegistry, ServerOptions, Sizes, pool_of, serve_env, shell_line,  # noqa: E402
                           validate_argv)
from serving.shapes import (  # noqa: E402
    DEFAULT_GPU_BLOCKS,
    DEFAULT_USERS,
    SHAPES,
    kv_bytes_per_token,
    kv_groups,
    pool_blocks,
    weight_bytes,
    stable_model_dir,
    write_model_dir,
    write_wordlevel_tokenizer,
)
from serving.workload import Workload, WorkloadParams, plan_phases, resident_gpu_blocks, sizes  # noqa: E402

T0 = time.monotonic()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODES = "none,offloading,tiered,lmcache"
#: rough H200 rates for the time estimate (prefill tokens/s, decode step ms at small batch)
RATES = {"llama3-8b": (37000, 8.0), "qwen2.5-7b": (40000, 8.0), "qwen2.5-32b": (9000, 22.0),
         # guesses from the envelope's turn-2 recomputes (8k tokens: gemma2 12k in 0.49 s, gpt-oss 0.135 s, ...)
         "gemma2": (25000, 10.0), "gemma3": (50000, 8.0), "gpt-oss": (60000, 10.0), "dsv2-lite": (80000, 10.0)}
STARTUP_GUESS_S = {"llama3-8b": 60.0, "qwen2.5-7b": 60.0, "qwen2.5-32b": 120.0, "gemma2": 75.0, "gemma3": 60.0,
                   "gpt-oss": 90.0, "dsv2-lite": 75.0}
STOP_MARGIN_S = 25.0  # stop the server, wait for the GPU, write the files
#: ``--graphs compile``: extra start-up of a start, torch.compile and the capture of vLLM's default graph sizes (a
#: guess: vLLM caches the compiled graphs per configuration, so a mode's later starts take less)
COMPILE_GUESS_S = 60.0
#: what LMCache logs when its compiled CUDA ops did not load and it runs on pure-torch ops (0.5.3; 0.5.1)
LMCACHE_FALLBACK_LINES = ("compiled extension not found", "Failed to import backend lmcache.c_ops")


# ============================================================================== arguments
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES))
    ap.add_argument("--modes", default=DEFAULT_MODES, help=f"comma-separated (default {DEFAULT_MODES})")
    ap.add_argument("--define", action="append", default=[], metavar="NAME=JSON",
                    help='a mode derived from the known mode its name starts with, e.g. tiered-g1=\'{"load_groups":1}\'')
    for fam in ("tiered", "offloading", "simple", "lmcache"):
        ap.add_argument(f"--{fam}-extra", default="{}", metavar="JSON", help=f"settings for every {fam}* mode")
    g = ap.add_argument_group("runs")
    g.add_argument("--runs", type=int, default=1, help="engine starts per mode in this call (default 1)")
    g.add_argument("--repeats", type=int, default=1, help="workload runs per engine start, fresh conversations each")
    g.add_argument("--run-offset", type=int, default=0, help="index of this call's first run (seeds the conversations)")
    g.add_argument("--call-index", type=int, default=None, help="rotates the mode order (default: --run-offset)")
    g.add_argument("--order", choices=("rotate", "fixed"), default="rotate")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--deadline-s", type=float, default=0, help="end cleanly (partial results) this many s after start")
    g.add_argument("--tag", default="", help="suffix of the result file names (e.g. call2)")
    g.add_argument("--replicas", type=int, default=1,
                   help="servers per start, server i on GPU i, round robin per turn (serving/replicas.py)")
    w = ap.add_argument_group("workload")
    w.add_argument("--users", type=int, default=0, help="default per shape: 128 (32B and gemma2: 96)")
    w.add_argument("--turns", type=int, default=1, help="turns per user in each measured phase")
    w.add_argument("--concurrency", default="32,8,1", help="levels, one measured phase each, in this order")
    w.add_argument("--c1-users", type=int, default=16, help="users served in a concurrency-1 phase")
    w.add_argument("--warm-concurrency", type=int, default=0)
    w.add_argument("--system-tokens", type=int, default=1024)
    w.add_argument("--context-tokens", type=int, default=1024)
    w.add_argument("--turn-tokens", type=int, default=128)
    w.add_argument("--answer-tokens", type=int, default=32)
    w.add_argument("--phase-gap-s", type=float, default=1.2,
                   help="pause + one tiny request after each phase, every mode (our metrics snapshot refreshes <= 1/s)")
    w.add_argument("--request-timeout-s", type=float, default=300)
    w.add_argument("--preset", choices=("smoke",), help="smoke: 24 users, concurrency 8,1, 4 users at c1, 1536 GPU blocks")
    s = ap.add_argument_group("server")
    s.add_argument("--gpu-blocks", type=int, default=0,
                   help="16-token blocks of sequence the GPU holds: vLLM's --num-gpu-blocks-override for one KV "
                        "cache group (a hybrid's window groups add theirs); default 6912 (32B: 6144, gemma2: 5760)")
    s.add_argument("--max-model-len", type=int, default=8192)
    s.add_argument("--max-num-seqs", type=int, default=0,
                   help="default max(64, highest concurrency); with --graphs compile vLLM's own (1,024 on an H200), "
                        "which sets its CUDA graph sizes: up to min(2 x max-num-seqs, 512) tokens unless the model "
                        "sets its own (gpt-oss: 1,024)")
    s.add_argument("--max-num-batched-tokens", type=int, default=8192)
    s.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    s.add_argument("--graphs", choices=("auto", "decode", "eager", "compile"), default="auto",
                   help="compile: vLLM's defaults (torch.compile and piecewise + full CUDA graphs, vLLM's own "
                        "--max-num-seqs: what a user of vllm serve gets; a start compiles or reads vLLM's compile "
                        "cache, ~60 s more); decode: -cc.mode=none + FULL_DECODE_ONLY graphs (starts in a minute; "
                        "prefill steps launched op by op from Python: a c1 step costs its launch whatever it "
                        "computes); auto (default): compile, then decode, then eager while no start has succeeded")
    s.add_argument("--enforce-eager", action="store_true", help="same as --graphs eager")
    s.add_argument("--tokenizer", choices=("auto", "skip", "word"), default="auto",
                   help="skip: --skip-tokenizer-init; word: offline word-level tokenizer; auto: skip, word on failure")
    s.add_argument("--serve-arg", action="append", default=[], help="extra argument for vllm serve (repeatable)")
    s.add_argument("--python", default=sys.executable)
    s.add_argument("--start-timeout-s", type=float, default=0, help="default 300 (32B: 420)")
    s.add_argument("--tkv-log", default="", help="TIERED_KV_LOG level for our connector (debug|info)")
    t = ap.add_argument_group("tiers")
    t.add_argument("--cpu-gib", type=int, default=0, help="CPU tier of every mode; default 1.25x a run's stored KV")
    t.add_argument("--disk-cpu-gib", type=int, default=0, help="CPU tier of the disk variants; default 25%% of it")
    t.add_argument("--disk-gib", type=int, default=0, help="disk tier of the disk variants; default 1.5x")
    t.add_argument("--disk-root", default="/root/tkv/serve-bench", help="must be a real disk (not tmpfs)")
    o = ap.add_argument_group("output")
    o.add_argument("--out-dir", default=os.environ.get("OUT") or "bench_out")
    o.add_argument("--dry-run", action="store_true", help="print commands, env and sizes; start nothing")
    o.add_argument("--validate", action="store_true", help="with --dry-run: parse each command with vLLM's parser")
    o.add_argument("--plot-from", nargs="+", metavar="JSON", help="merge result files: table, merged JSON, PNG")
    o.add_argument("--no-plot", action="store_true")
    o.add_argument("--pack-logs", action="store_true",
                   help="at the end (also when stopped), pack this run's server logs and traces into "
                        "serve_logs_<shape>[_<tag>].tgz, and drop the .partial.json once the final JSON is written (a "
                        "device call brings back at most 8 files); --replicas alone packs the servers' logs")
    o.add_argument("--trace", action="store_true",
                   help="tiered* modes: our per-step load trace ($OUT/trace_<shape>_<mode>_r<run>.rank<r>.jsonl), "
                        "summarised per phase in the JSON (phase 'trace')")
    o.add_argument("--attach", metavar="URL[,URL...]",
                   help="drive servers already running (one mode, no start/stop; several: round robin)")
    a = ap.parse_args(argv)
    if a.attach:
        a.replicas = len([u for u in a.attach.split(",") if u])
    if a.replicas < 1:
        ap.error("--replicas must be >= 1")
    if a.replicas > 1 and (resident := [m for m in a.modes.split(",") if m and resident_mode(a, m)]):
        ap.error(f"{', '.join(resident)}: a resident mode (the floor's GPU cache: none-resident, tiered-resident, "
                 "gpu_resident) is no floor with --replicas: each replica's GPU cache holds only what it computed")
    if a.enforce_eager:
        a.graphs = "eager"
    if a.preset == "smoke":  # plumbing check in ~15 s per start; still evicts prefixes from the GPU
        a.users, a.concurrency, a.c1_users, a.gpu_blocks = a.users or 24, "8,1", 4, a.gpu_blocks or 1536
    if not a.plot_from and not a.shape:
        ap.error("--shape is required (or --plot-from)")
    if a.shape and not a.gpu_blocks:
        a.gpu_blocks = DEFAULT_GPU_BLOCKS[a.shape]
    return a


def workload_params(a) -> WorkloadParams:
    return WorkloadParams(
        users=a.users or DEFAULT_USERS[a.shape], system_tokens=a.system_tokens, context_tokens=a.context_tokens,
        turn_tokens=a.turn_tokens, answer_tokens=a.answer_tokens,
        concurrency=tuple(int(c) for c in a.concurrency.split(",") if c), turns=a.turns, c1_users=a.c1_users,
        warm_concurrency=a.warm_concurrency, vocab_size=SHAPES[a.shape]["vocab_size"])


def tier_sizes(a, wp: WorkloadParams) -> Sizes:
    stored_gib = sizes(wp, kv_bytes_per_token(a.shape), a.gpu_blocks)["stored_bytes"] / (1 << 30)
    return Sizes(cpu_gib=a.cpu_gib or math.ceil(1.25 * stored_gib),
                 disk_cpu_gib=a.disk_cpu_gib or max(1, math.ceil(0.25 * stored_gib)),
                 disk_gib=a.disk_gib or math.ceil(1.5 * stored_gib), disk_root=a.disk_root)


def resident_mode(a, mode: str) -> bool:
    """Whether ``mode`` (with ``a``'s definitions and family extras) gets the floor's GPU cache; an unknown mode is
    not (``Bench.run`` refuses it before any start)."""
    try:
        return registry(a).spec(mode, Sizes(1, 1, 1, a.disk_root)).gpu_resident
    except ValueError:
        return report.is_resident(mode)


def registry(a) -> ModeRegistry:
    reg = ModeRegistry({f: json.loads(getattr(a, f"{f}_extra")) for f in ("tiered", "offloading", "simple", "lmcache")})
    for d in a.define:
        name, _, js = d.partition("=")
        reg.define(name.strip(), json.loads(js) if js.strip() else {})
    return reg


#: ``--graphs auto``: the setting a call starts with, and the next one to try while no start has succeeded
GRAPHS_AUTO_FIRST = "compile"
GRAPHS_AUTO_NEXT = {"compile": "decode", "decode": "eager"}


def first_graphs(a) -> str:
    """The graph setting a call's first start uses: ``--graphs``, with ``auto`` resolved (``GRAPHS_AUTO_FIRST``)."""
    return GRAPHS_AUTO_FIRST if a.graphs == "auto" else a.graphs


def default_max_num_seqs(wp: WorkloadParams, graphs: str) -> int:
    """``--max-num-seqs`` when not given: 0 (vLLM's own default, no flag) when serving compiled, as a user's
    ``vllm serve`` does; else 64 or the highest concurrency. vLLM derives its largest CUDA graph from it
    (2 x max-num-seqs, at most 512 tokens, unless the model sets its own): 64 gave Gemma-2 graphs of at most 128
    tokens on 2026-11-30 (GPU round 12), where vLLM's default on an H200 gives 512, and its c1 prefill steps of 192
    tokens ran without one."""
    return 0 if graphs == "compile" else max(64, max(wp.concurrency + (wp.warm_c,)))


def server_options(a, wp: WorkloadParams, graphs: str, tokenizer: str) -> ServerOptions:
    if wp.max_seq_len > a.max_model_len:
        raise SystemExit(f"the longest turn needs {wp.max_seq_len} tokens > --max-model-len {a.max_model_len}")
    return ServerOptions(python=a.python, max_model_len=a.max_model_len,
                         max_num_seqs=a.max_num_seqs or default_max_num_seqs(wp, graphs),
                         max_num_batched_tokens=a.max_num_batched_tokens, gpu_blocks=vllm_blocks(a, wp, a.gpu_blocks),
                         gpu_memory_utilization=a.gpu_memory_utilization, graphs=graphs, tokenizer=tokenizer,
                         extra_args=tuple(a.serve_arg))


def mode_options(a, wp: WorkloadParams, spec, opts: ServerOptions) -> ServerOptions:
    """``opts`` for one mode: ``none-resident`` gets a GPU KV cache that holds the run's whole history."""
    if not spec.gpu_resident:
        return opts
    return replace(opts, gpu_blocks=vllm_blocks(a, wp, resident_history_blocks(a, wp)))


def resident_history_blocks(a, wp: WorkloadParams) -> int:
    """16-token blocks of sequence a ``none-resident`` GPU cache holds: the run's whole history, at least
    ``--gpu-blocks``."""
    return max(resident_gpu_blocks(wp, sizes(wp, kv_bytes_per_token(a.shape), a.gpu_blocks)), a.gpu_blocks)


def vllm_blocks(a, wp: WorkloadParams, history_blocks: int) -> int:
    """``--num-gpu-blocks-override`` for a GPU cache holding ``history_blocks`` 16-token blocks of sequence:
    the same number for one KV cache group; a hybrid's pool adds its window groups' blocks
    (``serving.shapes.pool_blocks``)."""
    running = max(wp.concurrency + (wp.warm_c,))
    return pool_blocks(a.shape, history_blocks, running, wp.max_seq_len, a.max_num_batched_tokens)


def workload_id(wp: WorkloadParams) -> str:
    """Greedy outputs are compared only between starts that ran the same workload."""
    return hashlib.sha1(json.dumps(wp.__dict__, sort_keys=True, default=list).encode()).hexdigest()[:10]


def estimate_s(shape: str, wp: WorkloadParams, connector: bool, replicas: int = 1) -> float:
    """Rough workload seconds of one start (H200 rates in RATES): prefill + decode, phase by phase
    (``replicas`` servers share the prefill and each decodes 1/N of the batch)."""
    tps, step_ms = RATES[shape]
    tps *= replicas
    total = 0.0
    for ph in plan_phases(wp):
        lens = [wp.prompt_len(t) for _, t in ph.items]
        if ph.name == "warm" or not connector:
            computed = sum(n - wp.system_tokens for n in lens)
        else:  # new tokens + the stand-in answer + half a 256-token chunk recomputed on average
            computed = len(lens) * (wp.turn_tokens + wp.answer_tokens + 128)
        waves = math.ceil(len(lens) / ph.concurrency)
        total += computed / tps + waves * wp.answer_tokens * step_ms * (1 + ph.concurrency / replicas / 64) / 1e3
    return total + len(plan_phases(wp)) * 1.5


# ============================================================================== dry run
def dry_run(a) -> None:
    wp = workload_params(a)
    kvb = kv_bytes_per_token(a.shape)
    sz = sizes(wp, kvb, a.gpu_blocks)
    ts = tier_sizes(a, wp)
    reg = registry(a)
    modes = [m for m in a.modes.split(",") if m]
    graphs = first_graphs(a)
    tok = "skip" if a.tokenizer == "auto" else a.tokenizer
    opts = server_options(a, wp, graphs, tok)
    gib = lambda b: b / (1 << 30)  # noqa: E731
    print(f"# shape {a.shape}: KV {kvb / 1024:.0f} KiB/token, bf16 weights ~{weight_bytes(a.shape) / 1e9:.1f} GB; "
          f"GPU KV cache {a.gpu_blocks} blocks = {sz['gpu_cache_tokens']} tokens ({gib(sz['gpu_cache_tokens'] * kvb):.1f} GiB)"
          + ("" if len(kv_groups(a.shape)) == 1 else
             f"; KV cache groups {kv_groups(a.shape)} (None: full attention, else the window): vLLM's pool "
             f"{opts.gpu_blocks} blocks"))
    print(f"# workload {workload_id(wp)}: {wp.users} users, system {wp.system_tokens}, context {wp.context_tokens}, "
          f"+{wp.turn_tokens} per turn, {wp.answer_tokens} output tokens; longest sequence {sz['max_seq_len']}")
    for ph in sz["phases"]:
        print(f"#   phase {ph['name']:>6}: concurrency {ph['concurrency']:>2}, {ph['requests']:>4} requests, prompts "
              f"{ph['prompt_len_min']}-{ph['prompt_len_max']} tokens ({ph['prompt_tokens']} in all), "
              f"{ph['output_tokens']} output tokens")
    print(f"# per run: {sz['stored_tokens']} distinct prompt tokens = {gib(sz['stored_bytes']):.1f} GiB of KV; "
          f"history / GPU cache = {sz['history_over_gpu']}; other users between two turns / GPU cache = "
          f"{sz['evict_ratio']} (> 1: prefixes leave the GPU); running at most {sz['running_tokens_max']} tokens "
          f"({'fits' if sz['running_tokens_max'] <= sz['gpu_cache_tokens'] else 'DOES NOT FIT: preemptions'})")
    print(f"# tiers: CPU {ts.cpu_gib} GiB in every mode; disk variants: CPU {ts.disk_cpu_gib} GiB + disk "
          f"{ts.disk_gib} GiB under {ts.disk_root}/<mode>")
    n = a.replicas
    if n > 1:
        shm = replicas.shm_free_gib()
        print(f"# replicas: {n} servers per start on GPUs {replicas.gpu_ids(n)}, one model path; round robin per turn: "
              f"turn t of user u -> replica (u + t) % {n}; /dev/shm free here: "
              f"{'-' if shm is None else f'{shm:.1f} GiB'} (a host pool needs {ts.cpu_gib} GiB)")
    est_none, est_conn = estimate_s(a.shape, wp, False, n), estimate_s(a.shape, wp, True, n)
    # a host pool's first replica reserves its pages (~0.5 s per GiB); several servers stop and free their GPUs
    per_start = [STARTUP_GUESS_S[a.shape] + COMPILE_GUESS_S * (first_graphs(a) == "compile")
                 + (est_none if m == "none" else est_conn) + 15 + 5 * (n > 1)
                 + (0.5 * ts.cpu_gib if pool_of(reg.spec(m, ts)) else 0) for m in modes]
    print(f"# time guess (H200): workload ~{est_none:.0f} s (none) / ~{est_conn:.0f} s (connector) per start, "
          f"start-up ~{STARTUP_GUESS_S[a.shape]:.0f} s, stop ~15 s: ~{sum(per_start) * a.runs * a.repeats:.0f} s "
          f"for {a.runs} run(s) x {len(modes)} mode(s)")
    print(f"# order: {[m for _, m in schedule(a, modes)]}")
    problems = 0
    for k, m in enumerate(modes):
        trace = os.path.join(a.out_dir, f"trace_{a.shape}_{m}_r0") if a.trace else None
        reps = plan_start(a, reg, ts, wp, opts, m, stable_model_dir(a.shape), [8000 + i for i in range(n)],
                          [9400 + i for i in range(n)], replicas.pool_name(k), trace, "serve.log",
                          {"PYTHONPATH": os.environ.get("PYTHONPATH", "")})
        spec = reps[0].spec
        print(f"\n## mode {m} ({spec.family}{', disk ' + spec.disk_dir if spec.disk_dir and n == 1 else ''})")
        if spec.gpu_resident:
            mopts = mode_options(a, wp, spec, opts)
            hist = resident_history_blocks(a, wp)
            print(f"# {m}: GPU KV cache {hist} blocks = {hist * 16} tokens ({gib(hist * 16 * kvb):.1f} GiB) so that no "
                  f"prefix leaves the GPU" + ("" if mopts.gpu_blocks == hist else f"; vLLM's pool {mopts.gpu_blocks} blocks"))
        if n > 1:
            print(f"# {m}: " + (f"one host pool host:{reps[0].pool} of {ts.cpu_gib} GiB for all {n} replicas"
                                if reps[0].pool else "each replica its own tiers" if spec.kv_transfer else "no connector"))
        for r in reps:
            if n > 1:
                print(f"# replica {r.index}: GPU {r.gpu}, port {r.port}"
                      + (f", metrics port {r.spec.metrics_port}" if r.spec.metrics_port else "")
                      + (f", disk {r.spec.disk_dir}" if r.spec.disk_dir else ""))
            print(shell_line(r.argv, r.delta))
        if a.validate:
            try:
                validate_argv(reps[0].argv)
                print(f"# {m}: vLLM's parser accepts it")
            except Exception as e:  # noqa: BLE001 - report every mode's problem, then fail
                problems += 1
                print(f"# {m}: REJECTED: {type(e).__name__}: {e}")
    if problems:
        raise SystemExit(f"{problems} mode(s) rejected")


def plan_start(a, reg: ModeRegistry, ts: Sizes, wp: WorkloadParams, opts: ServerOptions, mode: str, model_dir: str,
               ports: list[int], metrics_ports: list[int], pool: str, trace: str | None, log: str,
               base_env: dict[str, str]) -> list:
    """The ``--replicas`` servers (``serving/replicas.py``'s ``Replica``) of one start of ``mode``."""
    return replicas.plan(reg, mode, ts, a.replicas, gpus=replicas.gpu_ids(a.replicas) if a.replicas > 1 else [],
                         ports=ports, metrics_ports=metrics_ports if mode.startswith("tiered") else None, pool=pool,
                         trace=trace, opts_for=lambda spec: mode_options(a, wp, spec, opts), model_dir=model_dir,
                         repo=REPO, base_env=base_env, extra_env={"TIERED_KV_LOG": a.tkv_log} if a.tkv_log else {},
                         log=log)


def schedule(a, modes: list[str]) -> list[tuple[int, str]]:
    """(run index, mode) in start order: every mode once per run, rotated per run and per call."""
    call = a.run_offset if a.call_index is None else a.call_index
    out = []
    for r in range(a.runs):
        k = (call + r) % len(modes) if a.order == "rotate" else 0
        out += [(a.run_offset + r, m) for m in modes[k:] + modes[:k]]
    return out


# ============================================================================== one engine start
class Bench:
    """State of one call: settings, the result document, what the fallbacks decided."""

    def __init__(self, a) -> None:
        self.a = a
        self.wp = workload_params(a)
        self.wid = workload_id(self.wp)
        self.sizes = tier_sizes(a, self.wp)
        self.reg = registry(a)
        self.graphs = first_graphs(a)
        self.tokenizer = "skip" if a.tokenizer == "auto" else a.tokenizer
        self.settled = False  # a start succeeded: no more fallbacks
        self.model_dir = write_model_dir(a.shape, stable_model_dir(a.shape), tokenizer=self.tokenizer == "word")
        self.tokenizer_written = self.tokenizer == "word"
        self.startups: list[float] = []
        self.workloads: list[float] = []
        self.n_starts = 0  # servers launched in this call (names each start's host pool)
        suffix = (f"_rr{a.replicas}" if a.replicas > 1 else "") + (f"_{a.tag}" if a.tag else "")
        self.path = os.path.join(a.out_dir, f"serve_bench_{a.shape}{suffix}.json")
        self.doc = {"schema": "serve_bench/1", "shape": a.shape, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "device": server.device_name(), "gpu_share": server.gpu_share(), "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
                    "workload": {**self.wp.__dict__, "id": self.wid}, "sizes": {**sizes(self.wp, kv_bytes_per_token(a.shape), a.gpu_blocks),
                              "vllm_gpu_blocks": vllm_blocks(a, self.wp, a.gpu_blocks), "kv_groups": kv_groups(a.shape)},
                    "tiers_gib": self.sizes.__dict__, "replicas": a.replicas, "starts": []}

    # ---------------------------------------------------------------- time
    def left_s(self) -> float:
        return math.inf if not self.a.deadline_s else self.a.deadline_s - (time.monotonic() - T0)

    def need_s(self, mode: str) -> float:
        start = max(self.startups, default=STARTUP_GUESS_S[self.a.shape]
                    + COMPILE_GUESS_S * (self.graphs == "compile"))
        work = max(self.workloads, default=estimate_s(self.a.shape, self.wp, mode != "none", self.a.replicas)) * self.a.repeats
        return start + work + STOP_MARGIN_S

    def save_partial(self) -> None:
        report.write_json(self.path.replace(".json", ".partial.json"), self.doc)

    # ---------------------------------------------------------------- starts
    def run(self) -> None:
        modes = [m for m in self.a.modes.split(",") if m]
        missing = {}  # mode family -> why its engines cannot start (a peer's package the servers' python lacks)
        for m in modes:
            spec = self.reg.spec(m, self.sizes)  # unknown modes fail before any GPU time is spent
            if spec.family == "lmcache" and "lmcache" not in missing:
                missing["lmcache"] = module_missing(self.a.python, serve_env(spec, REPO, dict(os.environ))[0],
                                                    "lmcache")
        host_gpus = self.doc["gpu_share"]["host_gpus"]
        if self.a.replicas > 1 and 0 < host_gpus < self.a.replicas:
            raise SystemExit(f"--replicas {self.a.replicas}: this machine has {host_gpus} GPU(s)")
        for run_idx, mode in schedule(self.a, modes):
            spec = self.reg.spec(mode, self.sizes)
            rec = {"mode": mode, "run": run_idx, "workload_id": self.wid, "status": "running"}
            rec["gpu_resident"] = spec.gpu_resident  # then set against the floor only
            self.doc["starts"].append(rec)  # filled in place: partial files show the start in progress
            why = missing.get(spec.family)
            if why:
                rec.update(status="skipped", reason=why)
                print(f"[{mode} r{run_idx}] skipped ({why})", flush=True)
            elif self.left_s() < self.need_s(mode):
                rec.update(status="skipped", reason=f"deadline: {self.left_s():.0f} s left, ~{self.need_s(mode):.0f} s needed")
                print(f"[{mode} r{run_idx}] skipped ({rec['reason']})", flush=True)
            else:
                try:
                    self.start_with_fallbacks(mode, run_idx, rec)
                except Exception as e:  # noqa: BLE001 - one broken start must not lose the others
                    rec.update(status="failed", error=f"{type(e).__name__}: {e}")
                    print(f"[{mode} r{run_idx}] FAILED: {rec['error']}", flush=True)
            self.save_partial()

    def start_with_fallbacks(self, mode: str, run_idx: int, rec: dict) -> None:
        """Start ``mode``; until a first start of this call succeeds, retry a failure with the other
        tokenizer or graph setting (``auto``), at most twice. What works is kept for every later start."""
        cur = (self.graphs, self.tokenizer)
        tried = []
        while True:
            if self.one_start(mode, run_idx, rec, *cur, attempt=len(tried)):
                if cur != (self.graphs, self.tokenizer):
                    print(f"[fallback] every later start uses graphs={cur[0]} tokenizer={cur[1]}", flush=True)
                    self.doc["fallback"] = {"graphs": cur[0], "tokenizer": cur[1], "after": rec.get("failed_tries")}
                self.graphs, self.tokenizer, self.settled = cur[0], cur[1], True
                return
            tried.append(cur)
            rec.setdefault("failed_tries", []).append({"graphs": cur[0], "tokenizer": cur[1], "error": rec.get("error")})
            cur = None if self.settled or len(tried) > 2 else self.next_try(tried, rec.get("error", "") + rec.get("log_tail", ""))
            if cur is None or self.left_s() < self.need_s(mode):
                return

    def next_try(self, tried: list[tuple[str, str]], failure: str) -> tuple[str, str] | None:
        """The next (graphs, tokenizer) to try: the tokenizer first when the failure names it."""
        graphs, tok = tried[-1]
        alt_g = GRAPHS_AUTO_NEXT.get(graphs, graphs) if self.a.graphs == "auto" else graphs
        alt_t = "word" if self.a.tokenizer == "auto" and tok == "skip" else tok
        # only error lines count: the log's command line and vLLM's "non-default args" name the tokenizer too
        named = any("tokeniz" in line and "error" in line for line in failure.lower().splitlines())
        order = [(graphs, alt_t), (alt_g, tok)] if named else [(alt_g, tok), (graphs, alt_t)]
        return next((c for c in order + [(alt_g, alt_t)] if c not in tried), None)

    def one_start(self, mode: str, run_idx: int, rec: dict, graphs: str, tok: str, attempt: int) -> bool:
        a = self.a
        n = a.replicas
        if tok == "word" and not self.tokenizer_written:
            write_wordlevel_tokenizer(self.model_dir, SHAPES[a.shape]["vocab_size"])
            self.tokenizer_written = True
        opts = server_options(a, self.wp, graphs, tok)
        tail = f"_try{attempt}" if attempt else ""
        trace = os.path.join(a.out_dir, f"trace_{a.shape}_{mode}_r{run_idx}{tail}") if a.trace else None
        ports = replicas.free_ports(2 * n)
        self.n_starts += 1
        reps = plan_start(a, self.reg, self.sizes, self.wp, opts, mode, self.model_dir, ports[:n], ports[n:],
                          replicas.pool_name(self.n_starts), trace, os.path.join(a.out_dir, f"serve_{a.shape}_{mode}_r{run_idx}{tail}.log"),
                          dict(os.environ))
        specs = [r.spec for r in reps]
        pool = reps[0].pool
        if trace is not None and specs[0].family == "tiered":
            for i in range(n):
                base = glob.escape(replicas.suffixed(trace, i, n))
                for old in glob.glob(base + ".rank*.jsonl") + glob.glob(base + ".sched.jsonl"):
                    os.remove(old)  # a previous call's file of the same name
            rec["trace_path"] = os.path.basename(trace)
        else:
            trace = None
        for key in ("error", "log_tail", "startup_s", "warmup_s", "repeats", "pool_shm_bytes",
                    "replica_memory"):  # left by a failed try
            rec.pop(key, None)
        rec.update(status="running", graphs=graphs, tokenizer=tok, command=shell_line(reps[0].argv, reps[0].delta),
                   log=os.path.basename(reps[0].log), disk_dir=specs[0].disk_dir)
        if n > 1:
            rec.update(replicas=[{"gpu": r.gpu, "port": r.port, "command": shell_line(r.argv, r.delta),
                                  "log": os.path.basename(r.log), "disk_dir": r.spec.disk_dir} for r in reps], pool=pool)
        for s in specs:
            _wipe(s.disk_dir)
            if s.disk_dir:
                os.makedirs(s.disk_dir, exist_ok=True)
        if pool and replicas.shm_problem(self.sizes.cpu_gib):
            raise RuntimeError(replicas.shm_problem(self.sizes.cpu_gib))  # no start-up setting would help
        started_at = time.time()  # the servers' logs are appended to: this start's lines come after this
        srvs = [server.ServerProcess(r.argv, r.env, r.log) for r in reps]
        bad = 0  # the replica whose log tells why a start failed
        try:
            t0 = time.monotonic()
            for srv in srvs:
                srv.start()
            timeout = min(a.start_timeout_s or (420 if a.shape == "qwen2.5-32b" else 300), max(10.0, self.left_s() - STOP_MARGIN_S))
            for r, srv in zip(reps, srvs):
                ok, why = srv.wait_healthy(r.base, max(1.0, timeout - (time.monotonic() - t0)))
                if not ok:
                    bad, why = r.index, why if n == 1 else f"replica {r.index} (GPU {r.gpu}): {why}"
                    break
            if ok:
                rec["startup_s"] = round(time.monotonic() - t0, 1)
                print(f"[{mode} r{run_idx}] healthy after {rec['startup_s']} s (graphs={graphs}, tokenizer={tok}"
                      f"{f', {n} replicas' if n > 1 else ''})", flush=True)
                if specs[0].family == "lmcache":
                    rec["lmcache_native_ops"] = all([lmcache_native_ops(r.log) for r in reps])
                # each replica its own prompts: with one host pool a replica would load another's instead of computing
                warm = [_run_async(warmup(r.base, self.wp, self.a.max_model_len, seed=1 + i)) for i, r in enumerate(reps)]
                rec["warmup_s"] = [round(x, 3) for w in warm for x in w[0]]
                err = next((w[1] for w in warm if w[1]), None)
                if err:
                    ok, why = False, f"warm-up request failed: {err}"
            if ok:
                rec["vllm_version"] = _version(reps[0].base)
                self.startups.append(rec["startup_s"])
                t1 = time.monotonic()
                rec["repeats"] = []
                for rep in range(a.repeats):
                    seed = a.seed * 1_000_003 + 1000 * run_idx + rep
                    rec["repeats"].append({"seed": seed, "phases": []})
                    _run_async(self.drive([r.base for r in reps], specs, Workload(self.wp, seed), rec["repeats"][-1]["phases"]))
                    if self.left_s() < STOP_MARGIN_S:
                        break
                self.workloads.append((time.monotonic() - t1) / max(1, len(rec["repeats"])))
                if pool:
                    rec["pool_shm_bytes"] = replicas.pool_bytes(pool)  # every replica up: one pool's memory
                # each server's resident memory, private vs shared (issue 33: one pool, no per-replica copy)
                rec["replica_memory"] = [None if srv.proc is None else replicas.group_memory(srv.proc.pid)
                                         for srv in srvs]  # in replica order (None: no process)
                dead = [i for i, srv in enumerate(srvs) if not srv.alive]
                if not dead:
                    rec["status"] = "ok"
                    return True
                codes = ", ".join(f"{'' if n == 1 else f'replica {i} '}code {srvs[i].proc.returncode}" for i in dead)
                ok, why, bad = False, f"server exited ({codes}) during the workload", dead[0]
                self.settled = True  # it did start: not a start-up setting to fall back from
            rec.update(status="failed", error=why, log_tail=srvs[bad].log_tail(40))
            print(f"[{mode} r{run_idx}] FAILED: {why}\n--- last lines of {reps[bad].log} ---\n{rec['log_tail']}\n---", flush=True)
            return False
        finally:
            rec["stop_s"] = round(replicas.stop_servers(srvs), 1)
            rec["gpu_free_wait_s"] = round(server.wait_gpu_free(), 1)
            replicas.remove_pool(pool)
            for s in specs:
                _wipe(s.disk_dir)
            if trace is not None:
                add_trace(rec, [replicas.suffixed(trace, i, n) for i in range(n)], mode)
            add_jit(rec, [r.log for r in reps], mode, started_at, graphs)
            rec["cudagraph_max_tokens"] = graph_capture_max(reps[0].log)
            if rec["cudagraph_max_tokens"] is not None:
                print(f"[{mode} r{run_idx}] CUDA graphs up to {rec['cudagraph_max_tokens']} tokens a step", flush=True)

    async def drive(self, bases: list[str], specs: list, wl: Workload, out: list) -> None:
        """The phases of one workload run over the start's servers (round robin per turn when several),
        with Prometheus scrapes between them."""
        from serving import client

        a = self.a
        n = len(bases)
        stop_at = None if not a.deadline_s else T0 + a.deadline_s - STOP_MARGIN_S
        url_of = bases[0] if n == 1 else replicas.router(bases)
        before = [_scrape(b, s) for b, s in zip(bases, specs)]
        async with client.make_session(max(self.wp.concurrency + (self.wp.warm_c,)), a.request_timeout_s) as session:
            for ph in wl.phases():
                t_start = time.time()
                run = await client.run_phase(session, url_of, ph.items, wl.prompt, ph.concurrency, self.wp.answer_tokens, stop_at)
                t_end = time.time()
                await asyncio.sleep(a.phase_gap_s)
                for i, b in enumerate(bases):  # every replica's metrics snapshot refreshes
                    tag = f"flush:{wl.seed}:{ph.name}" + (f":{i}" if n > 1 else "")
                    await client.stream_completion(session, b, _fresh_ids(self.wp, 16, tag), 1)
                after = [_scrape(b, s) for b, s in zip(bases, specs)]
                rec = phase_record(ph, run, replicas.combine(before), replicas.combine(after), specs[0])
                if n > 1:
                    rec["replicas"] = replicas.per_replica(run.results, before, after, specs)
                rec["t_start"], rec["t_end"] = round(t_start, 3), round(t_end, 3)  # wall clock: the trace's lines
                out.append(rec)
                before = after
                _print_phase(specs[0].name, rec)
                self.save_partial()
                if run.truncated:
                    print(f"[{specs[0].name}] deadline: phase {ph.name} cut short, later phases skipped", flush=True)
                    break


def add_trace(rec: dict, trace_paths: list[str], mode: str) -> None:
    """Summarise the start's load trace per phase (``phase["trace"]``), from the files its ranks (of every
    replica) wrote."""
    lines = sorted((x for p in trace_paths for x in trace_summary.read_lines(p)), key=lambda x: x.get("t", 0.0))
    sched = [x for p in trace_paths for x in trace_summary.read_sched(p)]  # the engines' side (sched_trace.py)
    rec["trace_lines"] = len(lines)
    for rep in rec.get("repeats", ()):
        for ph in rep["phases"]:
            if "t_start" in ph:
                ph["trace"] = trace_summary.summarize_phase(lines, ph["t_start"], ph["t_end"], sched)
                print(trace_summary.line(mode, ph["name"], ph["trace"]), flush=True)


#: vLLM's JIT monitor (``--jit-monitor-verbose``: one line per compilation): ``<MM-DD HH:MM:SS> [jit_monitor.py:N]
#: <backend> kernel JIT compilation during inference: <kernel>``, the time in the server's local time
JIT_LINE = re.compile(r"(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)(?:\.\d+)? \[jit_monitor\.py:\d+\] (\w+) .*? during "
                      r"inference: ([\w.<>-]+)")


def jit_events(log_path: str, year: int) -> list[tuple[float, str]]:
    """(epoch seconds, "<backend>:<kernel>") of every kernel JIT compilation vLLM's monitor logged in ``log_path``
    (a missing log: none). ``year``: the log's lines carry month and day only."""
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return []
    out = []
    for m in JIT_LINE.finditer(text):
        mon, day, hh, mm, ss = (int(x) for x in m.groups()[:5])
        out.append((time.mktime((year, mon, day, hh, mm, ss, 0, 0, -1)), f"{m.group(6)}:{m.group(7)}"))
    return out


#: vLLM's engine config line: ``compilation_config={... 'max_cudagraph_capture_size': 512, ...}``
CAPTURE_SIZE = re.compile(r"""["']max_cudagraph_capture_size["']\s*:\s*(\d+)""")


def graph_capture_max(log_path: str) -> int | None:
    """The largest step (tokens) vLLM captured a CUDA graph for, from the last engine config line of ``log_path``
    (the start just ended: a log of the same name from an earlier call is appended to); None when no line says
    (eager, or a log without it). A prefill step above it runs without a graph, op by op from Python."""
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            found = CAPTURE_SIZE.findall(f.read())
    except OSError:
        return None
    return int(found[-1]) if found else None


def add_jit(rec: dict, log_paths: list[str], mode: str, since: float = 0.0, graphs: str = "decode") -> None:
    """Kernel compilations inside each measured phase (``phase["jit"]``: count and kernels), from the servers' logs
    (``--jit-monitor-verbose``). The log's times have whole seconds, so a compilation up to a second either side of a
    phase counts for it. A first compilation inside a phase stalls every request in flight (2026-11-30, GPU round 12:
    likely the four 1.0-1.4 s steps of a call's first start, whose c32 read 818 ms against 315 a round earlier; vLLM
    logged only the first compilation per kernel then, so the logs could not tell). The warm-up (``warmup``) exists
    to make these rare; where one remains, the phase line says so. Only lines from ``since`` on count (a log of the
    same name from an earlier call is appended to); with ``graphs`` eager vLLM turns its monitor off, so every phase
    records ``jit: null`` (unknown) rather than zero. Two phases less than two seconds apart may both count one
    compilation; Triton's autotuning is not a compilation the monitor logs."""
    phases = [ph for rep in rec.get("repeats", ()) for ph in rep["phases"] if "t_start" in ph]
    if not phases:
        return
    if graphs == "eager":
        for ph in phases:
            ph["jit"] = None
        return
    year = time.localtime(phases[0]["t_start"]).tm_year
    events = [e for p in log_paths for e in jit_events(p, year) if e[0] >= since - 1.0]
    rec["jit_compiles"] = len(events)
    for ph in phases:
        inside = [k for t, k in events if ph["t_start"] - 1.0 <= t <= ph["t_end"] + 1.0]
        ph["jit"] = {"n": len(inside), "kernels": sorted(set(inside))}
        if inside:
            print(f"[{mode}] {ph['name']:>6}: {len(inside)} kernel compilation(s) inside the phase "
                  f"({', '.join(ph['jit']['kernels'])}): its requests in flight waited for them", flush=True)


def phase_record(ph, run, before: dict, after: dict, spec) -> dict:
    """One phase's numbers, the Prometheus deltas and one compact row per request."""
    results = [r.as_dict() for r in run.results]
    vdelta = stats.prom_delta(before["vllm"], after["vllm"])
    tdelta = stats.prom_delta(before["tkv"], after["tkv"])
    rows = [[r.user, r.turn, r.prompt_len, None if r.ttft_s is None else round(r.ttft_s * 1e3, 2), r.cached_tokens,
             r.queue_ms, hashlib.sha1(json.dumps(r.token_ids).encode()).hexdigest()[:12], r.token_ids[:8],
             round(r.sent_at * 1e3, 2)]
            for r in sorted(run.results, key=lambda r: (r.user, r.turn))]
    errors = sorted({r.error for r in run.results if r.error})[:3]
    return {"name": ph.name, "concurrency": ph.concurrency, "truncated": run.truncated,
            **stats.summarize(results, run.wall_s), "error_samples": errors,
            "sources": stats.token_sources(vdelta), "engine_ms": stats.engine_times(vdelta),
            "tiers": stats.tier_hits(tdelta, spec.chunk_tokens) if spec.metrics_port else {},
            "worker_time": stats.worker_time(tdelta, vdelta), "load_costs": stats.load_costs(tdelta),
            "waves": stats.first_token_waves(results, ph.concurrency),
            "vllm_metrics": vdelta, "tiered_kv_metrics": tdelta,
            "rows_columns": ["user", "turn", "prompt_len", "ttft_ms", "cached", "queue_ms", "out_sha1", "first_ids",
                             "sent_ms"],
            "rows": rows}


def _print_phase(mode: str, r: dict) -> None:
    src = r["sources"]
    tiers = " ".join(f"{k}={v:.0f}" for k, v in r["tiers"].items())
    print(f"[{mode}] {r['name']:>6}: {r['requests']} req ({r['errors']} err) in {r['wall_s']:.1f} s | TTFT ms p50 "
          f"{r['ttft_ms']['p50']} p90 {r['ttft_ms']['p90']} p99 {r['ttft_ms']['p99']} | ITL p50 {r['itl_ms']['p50']} ms "
          f"| {r['output_tok_s']} tok/s | tokens computed {src['computed']:.0f} gpu {src['gpu_hit']:.0f} "
          f"connector {src['connector_hit']:.0f} {tiers}{_engine_line(r.get('engine_ms'))}"
          f"{_worker_line(r.get('worker_time'))}{_wave_line(r.get('waves'), r.get('concurrency'))}"
          f"{_cost_line(r.get('load_costs'))}", flush=True)


def _wave_line(w: dict | None, concurrency: int | None) -> str:
    """`` | first tokens in N waves, mean k (max m), x% in waves >= c/2``: the phase's shape
    (``stats.first_token_waves``); starts whose waves differ are not comparable at one TTFT, however alike their
    modes."""
    if not w or not concurrency or concurrency < 2:
        return ""
    return (f" | first tokens in {w['waves']} waves, mean {w['mean']} (max {w['max']}), {w['together'] * 100:.0f}% in "
            f"waves >= {max(2, concurrency // 2)}")


def _engine_line(e: dict | None) -> str:
    """`` | vLLM prefill X ms (mean)``, where the server's histograms moved (``stats.engine_times``)."""
    return f" | vLLM prefill {e['prefill']:.1f} ms (mean)" if e and "prefill" in e else ""


def _cost_line(c: dict | None) -> str:
    """`` | load floor X ms, N hits recomputed, disk overlap Y s/GB`` where the split measured any (``load_costs``)."""
    if not c:
        return ""
    parts = [f"load floor {c['load_floor_ms']:.1f} ms, {c['recomputed_hits']:.0f} hits recomputed"]
    parts += [f"{t} overlap {v:.3f} s/GB" for t, v in sorted(c["overlap_s_per_gb"].items()) if v]
    return " | " + ", ".join(parts)


def _worker_line(w: dict | None) -> str:
    """`` | hooks X ms/step (fences Y ms, W ms to submit a load), movers Z ms CPU``, where the workers' counters came
    (``stats.worker_time``)."""
    if not w or w.get("hook_ms_per_step") is None:
        return ""
    per_load = w.get("submit_ms_per_load")
    return (f" | hooks {w['hook_ms_per_step']:.2f} ms/step (fences {w['fence_wait_ms']:.0f} ms"
            f"{f', {per_load:.2f} ms to submit a load' if per_load is not None else ''}), movers "
            f"{w.get('mover_cpu_ms', 0.0):.0f} ms CPU")


def _scrape(base: str, spec) -> dict:
    vllm_text = server.http_get(base + "/metrics", timeout=10)[1]
    tkv_text = server.http_get(f"http://127.0.0.1:{spec.metrics_port}/metrics", timeout=5)[1] if spec.metrics_port else ""
    return {"vllm": stats.parse_prometheus(vllm_text), "tkv": stats.parse_prometheus(tkv_text)}


def _version(base: str) -> str | None:
    status, body = server.http_get(base + "/version")
    try:
        return json.loads(body).get("version") if status == 200 else None
    except ValueError:
        return None


def _fresh_ids(wp: WorkloadParams, n: int, tag: str) -> list[int]:
    rng = random.Random(tag)
    return [rng.randrange(1000, wp.vocab_size - 1000) for _ in range(n)]


async def warmup(base: str, wp: WorkloadParams, max_len: int, seed: int = 1) -> tuple[list[float], str | None]:
    """Requests before the first phase, not measured: two prefills per band of vLLM's fused-MoE tiles that fits
    ``max_len``, of a multiple of 16 tokens and one more (``kernel_jit.warm_prompts``, the envelope's warm-up), a follow-up over the longest one's GPU-cached
    context, then the workload's highest concurrency of short prompts at once (decode of that many sequences), all
    from an RNG of their own (``seed``: one per replica). So no mode pays the machine's first Triton compilations
    inside a measured phase: on 2026-11-30 (GPU round 12, gpt-oss) the first start of a call held four steps 1.0-1.4 s (two warm-phase steps
    without loads, two c32 steps with), likely such compilations, and its c32 TTFT p50 read 818 ms where round 11
    read 315. Returns each request's seconds (the batch as one) and the first error, if any."""
    from kernel_jit import warm_prompts
    from serving import client

    batch = max(wp.concurrency)
    singles, followup, many = warm_prompts(wp.vocab_size - 1000, max_len, batch, seed=seed)
    times, err = [], None
    async with client.make_session(batch, 120) as session:
        for prompt in [*singles, followup]:
            t = time.perf_counter()
            r = await client.stream_completion(session, base, prompt, 4)
            times.append(time.perf_counter() - t)
            err = err or r.error
        t = time.perf_counter()
        rs = await asyncio.gather(*(client.stream_completion(session, base, p, 4) for p in many))
        times.append(time.perf_counter() - t)
        err = err or next((r.error for r in rs if r.error), None)
    return times, err


def _run_async(coro):
    try:
        import uvloop
    except ImportError:
        uvloop = None
    run = getattr(uvloop, "run", None)  # uvloop >= 0.18
    return run(coro) if run is not None else asyncio.run(coro)


def module_missing(python: str, env: dict[str, str], module: str) -> str | None:
    """None when ``python`` with the server's ``env`` finds ``module``; else why not, and what to do (the lmcache
    modes: round 25's setup ran with ``SERVE_ONLY=1`` and an LMCache start failed in vLLM's engine start-up)."""
    probe = f"import importlib.util, sys; sys.exit(0 if importlib.util.find_spec({module!r}) else 3)"
    try:
        rc = subprocess.run([python, "-c", probe], env=env, timeout=60, capture_output=True).returncode
    except (OSError, subprocess.SubprocessError) as e:
        return f"cannot run {python} to look for {module}: {e}"
    if rc == 0:
        return None
    if rc != 3:  # the interpreter itself failed: say so, not that the package is missing
        return f"{python} could not look for {module} (exit {rc}): check the interpreter and the server's PYTHONPATH"
    return (f"{module} is not importable by {python} with the server's PYTHONPATH: install it (on the GPU machine "
            f"`bash scripts/gpu/serve_setup.sh`, not SERVE_ONLY=1) or leave its modes out")


def lmcache_native_ops(log_path: str) -> bool:
    """False (and a warning) when LMCache logged in ``log_path`` that it fell back to its torch ops:
    those numbers are not LMCache's (scripts/gpu/README.md, "LMCache's compiled ops")."""
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as e:
        print(f"WARNING: cannot read {log_path} to check LMCache's native ops: {e}", flush=True)
        return False
    hit = next((line for line in text.splitlines() if any(m in line for m in LMCACHE_FALLBACK_LINES)), None)
    if hit:
        print(f"WARNING: LMCache runs on its torch fallback, don't report this start: {hit.strip()[:200]}", flush=True)
    return hit is None


def _wipe(path: str | None) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)


# ============================================================================== entry points
def finish(doc: dict, path: str, plot: bool) -> None:
    """Summary, table, final JSON and plot of one result document."""
    doc["summary"] = report.summarize(doc["starts"])
    text = report.table(doc["summary"])
    mixed = {(s.get("graphs"), s.get("tokenizer")) for s in doc["starts"] if s.get("status") == "ok"}
    if len(mixed) > 1:
        text += f"\n\nWARNING: starts ran with different server settings (graphs, tokenizer): {sorted(mixed)}"
    doc["table"] = text
    print(text, flush=True)
    report.write_json(path, doc)
    print(f"wrote {path}", flush=True)
    if plot:
        try:
            png = report.plot(doc["summary"], f"{doc['shape']} | {', '.join(doc.get('devices') or [doc.get('device', '')])} "
                              f"| TTFT p50 vs concurrency", path.replace(".json", ".png"))
            print(f"wrote {png}", flush=True)
        except ImportError as e:
            print(f"no plot ({e}); redraw anywhere with --plot-from {path}", flush=True)


def plot_from(a) -> None:
    docs = []
    for p in a.plot_from:
        with open(p) as f:
            docs.append({**json.load(f), "path": p})
    for shape, m in report.merge(docs).items():
        out = os.path.join(a.out_dir, f"serve_bench_{shape}{f'_{a.tag}' if a.tag else ''}.merged.json")
        finish(m, out, plot=not a.no_plot)


def attach(a) -> None:
    """Drive running servers (``--attach URL[,URL...]``, several: round robin per turn) as mode ``--modes``
    (one name): for debugging and the tests."""
    bench = Bench(a)
    mode = a.modes.split(",")[0]
    spec = bench.reg.spec(mode, bench.sizes)
    bases = [u.rstrip("/") for u in a.attach.split(",") if u]
    rec = {"mode": mode, "run": a.run_offset, "workload_id": bench.wid, "status": "ok", "attached": a.attach,
           "startup_s": 0.0, "repeats": []}
    bench.doc["starts"].append(rec)
    for rep in range(a.repeats):
        seed = a.seed * 1_000_003 + 1000 * a.run_offset + rep
        rec["repeats"].append({"seed": seed, "phases": []})
        _run_async(bench.drive(bases, [spec] * len(bases), Workload(bench.wp, seed), rec["repeats"][-1]["phases"]))
    finish(bench.doc, bench.path, plot=not a.no_plot)


def main(argv=None) -> None:
    global T0
    T0 = time.monotonic()  # --deadline-s counts from here
    a = parse_args(argv)
    if a.plot_from:
        return plot_from(a)
    if a.dry_run:
        return dry_run(a)
    os.makedirs(a.out_dir, exist_ok=True)
    if a.attach:
        return attach(a)
    atexit.register(server.stop_all)

    def on_signal(signum, frame):  # the device call's time limit: leave no server behind
        server.stop_all()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    bench = Bench(a)
    began = time.time() - 1.0  # the file system's clock may lag this one by a tick
    finished = False
    try:
        bench.run()  # the model directory stays (stable_model_dir: vLLM's compile cache is keyed on its path)
        finish(bench.doc, bench.path, plot=not a.no_plot)
        finished = True
    finally:  # also when the device call's time limit stops the run: its logs are wanted most then
        if a.replicas > 1 or a.pack_logs:  # a device call brings back a few files: one archive for the logs
            name = os.path.basename(bench.path).replace("serve_bench_", "serve_logs_").replace(".json", ".tgz")
            tgz = replicas.pack_logs(a.out_dir, a.shape, name, since=began, every_start=a.pack_logs)
            if tgz:
                print(f"wrote {tgz} (the servers' logs{' and traces' if a.trace else ''})", flush=True)
        partial = bench.path.replace(".json", ".partial.json")
        if a.pack_logs and finished and os.path.exists(partial):  # the final JSON holds all of it
            os.remove(partial)


if __name__ == "__main__":
    main()
