"""The performance envelope (issue 28): model shapes x workloads x modes, pass or fail against the promise.

The promise: with tiered_kv on, a request is never slower than without it and never slower than vLLM's own
connector. The rule, per cell: ours <= 1.05x of no connector and <= 1.05x of ``OffloadingConnector`` (the
median over engine starts of the cell's value: a turn-2 TTFT p50, or a batch's wall time), and greedy outputs
identical to no connector's. A cell within 10% of a bound wants 3 starts (the table says so). A greedy
difference is explained, and passes, only where the ``none-chunked`` control (no connector, prefill in 2,048-token
pieces) flips the same requests, or where no connector's own two likeliest first tokens tie (top-2 margin 0.0 in
every start that recorded it: greedy then answers whichever rounding favours) and ours answered one of the two.

Shapes (dummy weights; ``--shapes``): llama3-8b, qwen2.5-7b (4 KV heads), qwen2.5-32b (64 layers), gpt-oss
(20b: 24 layers alternating a 128-token window and full attention), gemma3 (4B text: 5 window layers per full
one), gemma2 (9B: 42 layers alternating a 4,096-token window and full attention, 8 KV heads of 256), dsv2-lite
(MLA), and mamba: on vLLM 0.26 no Mamba / linear-attention hybrid can run with a KV connector that stores
prefixes, see ``NOT_RUNNABLE``.

Workloads, all run by one engine start per (shape, mode, GPU cache), one after the other, after a warm-up
(``kernel_jit.py``: two prefills per band of vLLM's fused-MoE tiles, a turn-2-shaped step over a GPU-cached context,
a decode of N sequences, all from an RNG of its own) so that no mode pays the machine's first Triton compilations
inside a measured phase; the start's ``jit`` record counts what still compiled, per phase, and a slow compilation in
turn2 or batch is printed with its line:
  turn2    N conversations of PREFIX tokens; turn 1 of each one at a time, then turn 2 of each one at a time
           (the prefix + FOLLOW new tokens): TTFT p50 (``generate(max_tokens=1)`` wall time; the first two
           conversations generate 4 tokens, compared across modes, and are left out of the p50)
  batch    then U unrelated PREFIX-token prompts (pressure), then turn 3 of all N in one ``generate`` call
           (4 tokens each, compared across modes): its wall time. The GPU KV cache holds about GPU_FIT
           requests of the batch's length, so its prefixes can only come from a CPU tier.
  restart  (mode ``tiered-disk-restart``, after a ``tiered-disk`` start of the same call: a new engine on the disk
           tier that start wrote) turn 1 is a hit: ``turn1_cached_tokens`` (plan order puts it right after
           its ``tiered-disk``)
  disk     (mode ``tiered-disk`` only, compared with none and with OffloadingConnector at the same small CPU
           tier) turn 2 whose prefix sits in our disk tier on this machine's disk: TTFT p50
  serving  multi-turn serving at concurrency 8 and 32: ``benchmarks/serve_bench.py`` (``vllm serve``); its
           result files are folded in with ``--serving FILE``.
GPU caches (``--gpu``): ``tight`` holds 1.8 requests of the batch's length, ``roomy`` about 4; the turn-2 cell
runs in every start (reported per GPU cache).

Modes: ``none`` (no connector), ``offloading`` (vLLM's OffloadingConnector, CPU_GIB), ``tiered`` (ours, CPU_GIB,
defaults otherwise), ``tiered-disk`` (ours, DISK_CPU_GIB of CPU tier + a disk tier at DISK_PATH; its
comparison ``offloading-small`` has the same small CPU tier).

For ours, each start also records: the batch's loads from our connector's counters and its load trace
(``trace_path``: steps that loaded, bytes, GB/s), the bytes stored per conversation beside what a later hit
can use (full-attention layers x the prefix + sliding-window layers x the window) and conversations held per
GiB of CPU tier. A PCIe probe (contiguous pinned 1 GiB copies) runs first in every call: the batch's load rate
is reported against that ceiling.

Usage (GPU machine; vLLM on PYTHONPATH):
  python benchmarks/envelope.py --shapes gemma2 --modes none,offloading,tiered --starts 3 --deadline-s 560
  python benchmarks/envelope.py --shapes gpt-oss,llama3-8b --deadline-s 560
  python benchmarks/envelope.py --shapes gpt-oss --modes offloading,tiered,tiered+in_step_copy=copy_engine
  python benchmarks/envelope.py --merge a/envelope.json b/envelope.json --out docs/results/envelope_<date>_h200.json
  python benchmarks/envelope.py --table docs/results/envelope_2026-11-28_h200.json
  python benchmarks/envelope.py --dry-run --shapes gemma2     # CPU: the plan, GPU cache sizes, nothing run
Environment: N_CONV (10), U_UNRELATED (3), PREFIX (gemma2 12288, else 8192), TP (1: tensor_parallel_size; each
rank's load GB/s over turn 2 goes into ``turn2_rank_gbps``), CPU_GIB (40), DISK_CPU_GIB (2),
DISK_PATH (/tmp/tkv-envelope-disk), DISK_GIB (48), WORKLOADS (turn2,batch; ``turn2`` alone skips the pressure
and the batch), OUT (directory for the JSON and logs), PYTHONHASHSEED (0).
Threading: a script; the main thread only (each engine start and the PCIe probe run in child processes).
"""
from __future__ import annotations

import argparse
import json
import operator
import os
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernel_jit import JitWatch, slow_in, warm_prompts  # noqa: E402
from serving import report  # noqa: E402
from serving.shapes import every_layer_bytes, kv_groups_of  # noqa: E402
from vllm_ttft import (  # noqa: E402
    MODELS,
    _result_line,
    _tiered_counters,
    pcie_probe,
    run_child,
)

FOLLOW = 64
BOUND = 1.05  # ours / none and ours / offloading, per cell
NEAR = 1.10  # a cell whose ratio is within 10% of a bound wants 3 starts
GPU_FIT = {"tight": 1.8, "roomy": 4.0}
#: the phases of a start whose times the verdict uses (compilations inside them are printed with the start's line)
MEASURED_PHASES = ("turn2", "batch")
SHAPES = ("llama3-8b", "qwen2.5-7b", "qwen2.5-32b", "gpt-oss", "gemma3", "gemma2", "dsv2-lite")
MODES = ("none", "offloading", "tiered", "tiered-disk", "offloading-small", "tiered-disk-restart", "none-chunked")
#: ``none-chunked``: no connector, prompts prefilled in pieces of this many tokens; a control for the greedy check
#: (recompute in other pieces is just as right: where its tokens differ from ``none``'s, bf16 decides, not a load)
CONTROL_CHUNK = 2048
#: where a mode names one setting of ours beside the defaults: ``tiered+in_step_copy=copy_engine+load_mode=async``


def split_mode(mode: str) -> tuple[str, dict]:
    """``tiered+key=value+...`` -> (``tiered``, {key: value}): a variant of one of our modes, for an A/B of a setting.
    A value is read as JSON where it is JSON (``4``, ``false``, ``2``), else kept as a string (``copy_engine``),
    as the connector's extra config would carry it. Raises SystemExit naming a malformed part."""
    base, *parts = mode.split("+")
    extra = {}
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or not key or not base.startswith("tiered"):
            raise SystemExit(f"mode {mode!r}: expected tiered[-disk]+key=value[+key=value...], got part {part!r}")
        try:
            extra[key] = json.loads(value)
        except ValueError:
            extra[key] = value
    return base, extra
#: shapes the matrix names that cannot run here, and why (printed as cells that did not run)
NOT_RUNNABLE = {
    "mamba": "vLLM 0.26 hands a KV connector the longest local hit of any KV cache group for Mamba hybrids "
             "(0.32 added supports_divergent_local_hybrid_hits), so a stored prefix could resume on a stale "
             "recurrent state: TieredKVConnector refuses them on 0.26 (tests/connector/vllm/test_hybrid.py "
             "test_mamba_on_vllm_026_is_refused); vLLM 0.26's OffloadingConnector has no Mamba support either. "
             "Runs once the GPU machine has vLLM >= 0.32.",
}
DEFAULT_PREFIX = {"gemma2": 12288}
DEFAULT_GPU_UTIL = {"qwen2.5-32b": 0.8}
BLOCK = 16


def knobs(shape: str) -> dict:
    """The workload of one shape (environment overrides the defaults)."""
    env = os.environ
    prefix = int(env.get("PREFIX", DEFAULT_PREFIX.get(shape, 8192)))
    return {"n_conv": int(env.get("N_CONV", "10")), "unrelated": int(env.get("U_UNRELATED", "3")),
            "prefix": prefix, "cpu_gib": int(env.get("CPU_GIB", "40")),
            "disk_cpu_gib": int(env.get("DISK_CPU_GIB", "2")),
            "disk_path": env.get("DISK_PATH", "/tmp/tkv-envelope-disk"), "disk_gib": int(env.get("DISK_GIB", "48")),
            "gpu_util": float(env.get("GPU_UTIL", DEFAULT_GPU_UTIL.get(shape, 0.6))),
            "max_len": prefix + 4 * FOLLOW + 64, "tp": int(env.get("TP", "1")),
            "workloads": env.get("WORKLOADS", "turn2,batch").split(",")}


def kv_groups(shape: str) -> int:
    """KV cache groups vLLM's hybrid manager makes (``serving.shapes.kv_groups_of``; full attention and MLA: one)."""
    return len(kv_groups_of(MODELS[shape]))


def gpu_blocks(shape: str, fit: float, max_len: int) -> int:
    """GPU KV cache blocks holding ``fit`` requests of ``max_len`` tokens, as vLLM counts them (a token takes a
    block in every KV cache group)."""
    return int(fit * kv_groups(shape) * -(-max_len // BLOCK))


def engine_kwargs(shape: str, mode: str, gpu: str, w: dict, model_dir: str, trace_path: str | None) -> dict:
    """``LLM(...)`` arguments of one start; only the connector differs between modes."""
    mode, variant = split_mode(mode)
    kw = dict(model=model_dir, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
              gpu_memory_utilization=w["gpu_util"], max_model_len=w["max_len"], seed=0,
              num_gpu_blocks_override=gpu_blocks(shape, GPU_FIT[gpu], w["max_len"]), enable_prefix_caching=True,
              max_num_batched_tokens=w["prefix"] + 512, tensor_parallel_size=w["tp"])
    if mode == "none-chunked":
        kw["max_num_batched_tokens"] = CONTROL_CHUNK
    if mode in ("offloading", "offloading-small"):
        kw.update(kv_offloading_size=w["cpu_gib"] if mode == "offloading" else w["disk_cpu_gib"],
                  kv_offloading_backend="native")
    elif mode in ("tiered", "tiered-disk", "tiered-disk-restart"):
        from vllm.config import KVTransferConfig

        extra: dict = {"cpu_bytes": f"{w['cpu_gib']}GiB"}
        if mode in ("tiered-disk", "tiered-disk-restart"):
            path = os.path.join(w["disk_path"], "run")
            if mode == "tiered-disk":
                shutil.rmtree(path, ignore_errors=True)  # a cold disk tier: its hits come from this start
            # tiered-disk-restart keeps it: a new engine on what the last tiered-disk start wrote
            extra.update(cpu_bytes=f"{w['disk_cpu_gib']}GiB", disk_path=path, disk_bytes=f"{w['disk_gib']}GiB")
        if trace_path:
            extra["trace_path"] = trace_path
        extra.update(variant)
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="TieredKVConnector", kv_connector_module_path="tiered_kv.connector.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    elif mode not in ("none", "none-chunked"):
        raise SystemExit(f"unknown mode {mode!r}; valid: {', '.join(MODES)}")
    return kw


def _stored_per_conversation(llm, prefix: int) -> dict:
    """Our geometry's bytes for one stored prefix: what a later hit can use (full-attention layers x the prefix's
    whole chunks + sliding-window layers x the window, on every TP rank; once for MLA, whose ranks hold the same
    latent KV: ``geo.replicated``) and what the parts take in slots."""
    try:
        geo = llm.llm_engine.engine_core.engine_core.scheduler.connector.geo
    except AttributeError:
        return {}
    chunks = prefix // geo.chunk_tokens
    usable = 0
    for g in geo.groups:
        if g.kind == "swa":
            usable += g.window_blocks * g.block_nbytes
        elif g.kind != "mamba":
            usable += chunks * g.chunk_blocks * g.block_nbytes
    ranks = 1 if geo.replicated else geo.tp_size
    return {"usable_bytes_per_conversation": usable * ranks, "slot_bytes": geo.chunk_nbytes,
            "chunk_tokens": geo.chunk_tokens}


def rank_rates(trace: str, t0: float, t1: float) -> dict[str, float]:
    """Per TP rank: bytes its loads moved over their summed GPU time (GB/s), for trace lines in ``[t0, t1 + 1 s]``
    (a rate only while one rank's loads do not overlap in time: turn 2 runs one request at a time). The trace
    holds CPU-tier loads (in-step and asynchronous), not the front mover's disk loads."""
    import glob

    out: dict = {}
    for path in sorted(glob.glob(glob.escape(trace) + ".rank*.jsonl")):
        nbytes = ms = 0.0
        with open(path, encoding="utf-8", errors="replace") as f:
            for raw in f:
                try:
                    line = json.loads(raw)
                except ValueError:
                    continue
                if t0 <= line.get("t", 0) <= t1 + 1.0:
                    for x in line.get("landed", ()):
                        if x.get("gpu_ms"):
                            nbytes += x["bytes"]
                            ms += x["gpu_ms"]
        rank = path.rsplit(".rank", 1)[1].split(".")[0]
        out[rank] = round(nbytes / ms / 1e6, 2) if ms else 0.0
    return out


def run_one(shape: str, mode: str, gpu: str) -> dict:
    """One engine start in this process: every workload of ``mode`` in turn; returns the result record."""
    import torch
    from vllm import LLM, SamplingParams

    w = knobs(shape)
    # one path per shape in every start: the connector's namespace names the model by its path, so a restarted
    # engine (tiered-disk-restart) finds what the last one wrote only under the same path
    model_dir = os.path.join(tempfile.gettempdir(), "tkv-envelope-models", shape)
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(MODELS[shape], f)
    trace = (os.path.join(os.environ.get("OUT", "."), f"trace_{shape}_{mode.replace('=', '-').replace('+', '.')}_{gpu}")
             if mode.startswith("tiered") else None)
    jit = JitWatch()
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(shape, mode, gpu, w, model_dir, trace))
    startup = time.perf_counter() - t0
    jit.install()  # after LLM(): vLLM's own JIT monitor hooks in at the end of its start, ours chains after it
    rng = random.Random(0)
    vocab = min(120000, MODELS[shape]["vocab_size"] - 1)
    toks = lambda n: [rng.randrange(1000, vocab) for _ in range(n)]  # noqa: E731
    convs = [toks(w["prefix"]) for _ in range(w["n_conv"])]
    follows = [toks(FOLLOW) for _ in range(w["n_conv"])]
    thirds = [toks(FOLLOW) for _ in range(w["n_conv"])]
    unrelated = [toks(w["prefix"]) for _ in range(w["unrelated"])]
    sp = {n: SamplingParams(max_tokens=n, temperature=0.0, detokenize=False, ignore_eos=True) for n in (1, 2, 4)}

    def generate(prompts, n):
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp[n], use_tqdm=False)
        return time.perf_counter() - t, outs

    # warm-up, from an RNG of its own (the measured prompts stay those of earlier rounds): two prefills per fused-MoE
    # tile band, a turn-2-shaped step over a GPU-cached context and a decode of n_conv sequences, so no mode pays the
    # machine's first kernel compilations inside a measured phase (kernel_jit.py); what still compiles is recorded
    jit.phase("warm-up")
    singles, followup, warm_batch = warm_prompts(vocab, w["max_len"], w["n_conv"], FOLLOW)
    for p in singles + [followup]:
        generate([p], 1)
    generate(warm_batch, 4)
    ours = mode.startswith("tiered")
    jit.phase("turn1")
    c0 = _tiered_counters(llm) if ours else {}
    turn1_runs = [generate([c], 2) for c in convs]
    turn1 = [o[0] for _, o in turn1_runs]
    turn1_extra = {"turn1_s": [round(dt, 4) for dt, _ in turn1_runs],
                   "turn1_cached_tokens": [int(o.num_cached_tokens or 0) for o in turn1]}
    time.sleep(2.0)  # stores land
    generate([convs[0][:BLOCK]], 1)  # a step, so the planner applies the last stores' completions (an idle engine
    # takes none; the 2026-11-28 runs counted 9 of 10 conversations' stores without it)
    c1 = _tiered_counters(llm) if ours else {}
    turn2_s, first_tokens, cached, firsts = [], [], [], []
    seconds = []
    t_turn2 = time.time()
    jit.phase("turn2")
    for i, (out1, f) in enumerate(zip(turn1, follows)):
        prompt = list(out1.prompt_token_ids) + list(out1.outputs[0].token_ids) + f
        dt, outs = generate([prompt], 4 if i < 2 else 1)
        turn2_s.append(dt)
        cached.append(int(outs[0].num_cached_tokens or 0))
        if i < 2:
            first_tokens.append(list(outs[0].outputs[0].token_ids))
        firsts.append(outs[0].outputs[0].token_ids[0])
        seconds.append(prompt + list(outs[0].outputs[0].token_ids))
    rec: dict = {"shape": shape, "mode": mode, "gpu": gpu, "device": torch.cuda.get_device_name(0),
                 "startup_s": round(startup, 1), "knobs": w,
                 "gpu_blocks": gpu_blocks(shape, GPU_FIT[gpu], w["max_len"]),
                 "turn2_p50_s": round(statistics.median(turn2_s[2:]), 4), "turn2_s": [round(x, 4) for x in turn2_s],
                 "turn2_cached_tokens": cached, "turn2_tokens": first_tokens,
                 "turn2_tokens_all": firsts, **turn1_extra, "jit": jit.summary()}
    if trace:  # each TP rank's own load rate over turn 2 (its bytes over its loads' GPU time)
        rec["turn2_rank_gbps"] = rank_rates(trace, t_turn2, time.time())
    if split_mode(mode)[0] in ("tiered-disk", "offloading-small", "tiered-disk-restart") or "batch" not in w["workloads"]:
        return _finish(rec, llm, c0, c1, None, None, None)
    jit.phase("pressure")
    for p in unrelated:
        generate([p], 2)
    time.sleep(2.0)
    c2 = _tiered_counters(llm) if ours else {}
    batch = [s + t for s, t in zip(seconds, thirds)]
    t_batch = time.time()
    jit.phase("batch")
    sp[4] = SamplingParams(max_tokens=4, temperature=0.0, detokenize=False, ignore_eos=True, logprobs=2)
    dt, outs = generate(batch, 4)
    rec.update(batch_s=round(dt, 4), batch_tokens=[list(o.outputs[0].token_ids) for o in outs],
               batch_cached_tokens=[int(o.num_cached_tokens or 0) for o in outs],
               batch_margins=[first_margin(o) for o in outs], batch_top2=[first_top2(o) for o in outs],
               jit=jit.summary())
    time.sleep(1.0)
    return _finish(rec, llm, c0, c1, c2, trace, (t_batch, t_batch + dt))


def _first_ranked(out) -> list[tuple[int, float]] | None:
    """The first output token's candidates from vLLM's ``logprobs=2`` as (token id, logprob), likeliest first; None
    when fewer than two came back."""
    lp = (out.outputs[0].logprobs or [None])[0]
    if not lp or len(lp) < 2:
        return None
    return sorted(((int(t), v.logprob) for t, v in lp.items()), key=lambda tv: -tv[1])


def first_margin(out) -> float | None:
    """The first output token's logprob lead over the runner-up (vLLM's ``logprobs=2``): how close greedy was."""
    ranked = _first_ranked(out)
    return None if ranked is None else round(ranked[0][1] - ranked[1][1], 5)


def first_top2(out) -> list[int] | None:
    """The first output token's two most likely token ids, the likelier first (vLLM's ``logprobs=2``): with
    ``first_margin`` 0.0 the two tie, and which one greedy answers is a matter of rounding."""
    ranked = _first_ranked(out)
    return None if ranked is None else [t for t, _ in ranked[:2]]


def _finish(rec: dict, llm, c0: dict, c1: dict, c2: dict | None, trace: str | None,
            window: tuple[float, float] | None) -> dict:
    """Add our connector's counters (stores per conversation, the batch's loads, its trace) to ``rec``."""
    if not c0:
        return rec
    c3 = _tiered_counters(llm)
    d = lambda a, b, key: a.get(key, 0) - b.get(key, 0)  # noqa: E731
    n = rec["knobs"]["n_conv"]
    stored = d(c1, c0, "sched_bytes_stored") / n
    rec.update(stored_bytes_per_conversation=round(stored), **_stored_per_conversation(llm, rec["knobs"]["prefix"]))
    if "workers_bytes_to_disk" in c1:  # every rank's disk writes, summed by vLLM (MLA at TP>1: rank 0's alone)
        rec["disk_bytes_per_conversation"] = round(d(c1, c0, "workers_bytes_to_disk") / n)
    if rec.get("usable_bytes_per_conversation"):
        rec["stored_vs_usable"] = round(stored / rec["usable_bytes_per_conversation"], 3)
        rec["conversations_per_gib"] = round(2**30 / stored, 3) if stored else None
    if c2 is not None:
        rec.update(batch_hit_tokens=d(c3, c2, "sched_hit_tokens_cpu") + d(c3, c2, "sched_hit_tokens_disk"),
                   batch_bytes_loaded=d(c3, c2, "sched_bytes_loaded"), batch_load_jobs=d(c3, c2, "sched_load_jobs"),
                   cpu_evictions=c3.get("cpu_evictions", 0))
    if trace and window:
        from serving.trace_summary import read_lines, summarize_phase

        rec["batch_trace"] = summarize_phase(read_lines(trace), *window)
    rec["counters"] = {k: v for k, v in c3.items() if isinstance(v, (int, float)) and v}
    return rec


# ------------------------------------------------------------------------------------------ the matrix
def plan(shapes: list[str], modes: list[str], gpus: list[str], starts: int,
         offset: int = 0) -> list[tuple[str, str, str, int]]:
    """(shape, mode, gpu, start) in run order: per shape and GPU cache every mode once per start, the order rotated
    by one mode per start, so no mode always runs first (``offset``: the first start's number, for a later call)."""
    out = []
    for shape in shapes:
        for gpu in gpus:
            for s in range(offset, offset + starts):
                k = s % len(modes)
                order = [m for m in modes[k:] + modes[:k] if "restart" not in m]
                for m in modes:  # a restart reads what its tiered-disk start wrote: right after it
                    if "restart" in m:
                        disk = m.replace("tiered-disk-restart", "tiered-disk", 1)
                        order.insert(order.index(disk) + 1 if disk in order else len(order), m)
                out += [(shape, m, gpu, s) for m in order]
    return out


def jit_note(jit: dict | None) -> str:
    """``", compiled in turn2: 2 kernels 840 ms (...)"`` for Triton compilations over ``SLOW_MS`` inside a measured
    phase of a start's ``jit`` record (kernel_jit.py), else ``""``."""
    slow = slow_in(jit, MEASURED_PHASES)
    out = []
    for phase in MEASURED_PHASES:
        mine = [(fn, ms) for p, fn, ms in slow if p == phase]
        if mine:
            names = ", ".join(sorted({fn for fn, _ in mine}))
            out.append(f"{phase}: {len(mine)} kernel(s) {sum(ms for _, ms in mine):.0f} ms ({names})")
    return f", compiled in {'; '.join(out)}" if out else ""


def run_matrix(shapes, modes, gpus, starts, deadline_s: float, offset: int = 0) -> dict:
    """Every start of the plan in its own process; none begins unless its estimate fits the deadline."""
    t_begin = time.monotonic()
    left = lambda: deadline_s - 10 - (time.monotonic() - t_begin) if deadline_s else float("inf")  # noqa: E731
    out_dir = os.environ.get("OUT", ".")
    doc: dict = {"results": [], "skipped": [], "pcie": [], "not_runnable": NOT_RUNNABLE,
                 "command": " ".join(["python", "benchmarks/envelope.py", *sys.argv[1:]]),
                 "date": time.strftime("%Y-%m-%d"), "rule": {"bound": BOUND, "near": NEAR}}
    doc["pcie"].append(pcie_probe("before", None if left() == float("inf") else left()))
    walls: dict[str, float] = {}
    for shape, mode, gpu, start in plan(shapes, modes, gpus, starts, offset):
        need = walls.get(shape, 90.0) * (1.2 if mode.startswith("tiered") else 1.0)
        if left() < need:
            doc["skipped"].append({"shape": shape, "mode": mode, "gpu": gpu, "start": start,
                                   "reason": f"deadline: {left():.0f} s left, ~{need:.0f} s needed"})
            print(f"[{shape} {mode} {gpu} #{start}] skipped ({left():.0f} s left)", flush=True)
            continue
        t0 = time.perf_counter()
        env = dict(os.environ, PYTHONHASHSEED=os.environ.get("PYTHONHASHSEED", "0"), VLLM_ENABLE_V1_MULTIPROCESSING="0")
        rc, out, err = run_child([sys.executable, os.path.abspath(__file__), "--one", shape, mode, gpu], env,
                                 None if left() == float("inf") else left())
        wall = time.perf_counter() - t0
        walls[shape] = max(walls.get(shape, 0.0), wall)
        with open(os.path.join(out_dir, f"envelope_{shape}_{mode.replace('=', '-').replace('+', '.')}_{gpu}_s{start}.log"), "w") as f:
            f.write(out[-20000:] + "\n--- stderr ---\n" + err[-20000:])
        r = _result_line(out)
        if r is None:
            r = {"shape": shape, "mode": mode, "gpu": gpu, "error": f"rc={rc}", "log_tail": (out + err)[-2000:]}
            print(f"[{shape} {mode} {gpu} #{start}] FAILED rc={rc}\n{(out + err)[-1500:]}", flush=True)
        else:
            first = ", ".join(f"{x * 1e3:.0f}" for x in r.get("turn2_s", [])[:2])
            print(f"[{shape} {mode} {gpu} #{start}] {wall:.0f} s: turn-2 p50 {r['turn2_p50_s'] * 1e3:.1f} ms"
                  f" (the first two, 4 tokens each, left out: {first} ms)"
                  + (f", batch {r['batch_s']:.3f} s" if "batch_s" in r else "")
                  + (f", batch hit tokens {r['batch_hit_tokens']}" if "batch_hit_tokens" in r else "")
                  + jit_note(r.get("jit")), flush=True)
        r.update(start=start, wall_s=round(wall, 1))
        doc["results"].append(r)
        with open(os.path.join(out_dir, "envelope_partial.json"), "w") as f:
            json.dump(doc, f)
    return doc


# ------------------------------------------------------------------------------------------ the verdict
CELLS = (("turn2", "turn2_p50_s", "turn2_tokens", ("none", "offloading", "tiered")),
         ("batch", "batch_s", "batch_tokens", ("none", "offloading", "tiered")),
         ("disk", "turn2_p50_s", "turn2_tokens", ("none", "offloading-small", "tiered-disk")))


def refold_command(command: str, argv: list[str]) -> str:
    """``command`` (a table's calls, ``; ``-joined) with its serving refold replaced by this one (``argv``): the file
    names the serving files its cells came from, once."""
    calls = [c for c in command.split("; ") if c and "--serving" not in c]
    return "; ".join(calls + ["python benchmarks/envelope.py " + " ".join(shlex.quote(x) for x in argv)])


def serving_cells(path: str) -> list[dict]:
    """Cells of one ``serve_bench.py`` result file (its ``summary``: per mode and phase the TTFT p50 over starts):
    workload ``serving c8`` / ``serving c32`` / ``serving c1``, GPU cache ``serve``, greedy equality from its own
    comparison with no connector (``greedy_vs_none``). The issue's matrix names c8 and c32; c1 (one request in flight)
    is judged too, since the promise is "never slower than recompute" at any load. A file whose starts ran vLLM's
    own compilation (``serve_bench.py --graphs compile``: torch.compile and its CUDA graphs, what ``vllm serve`` does
    unasked) gives cells of GPU cache ``serve, compiled``: a separate configuration, where a small prefill step is
    not held by the host's eager launches (docs/notes/2026-11-30-gpu-round12.md). A phase where neither no connector
    nor ``OffloadingConnector`` ran gives no cell (a cell with no bound to judge would pass unjudged). Each cell
    carries its file's ``date`` (``verdict`` judges only the newest file's cell of a configuration)."""
    with open(path) as f:
        doc = json.load(f)
    date = file_date(doc)
    graphs = {s.get("graphs") for s in doc.get("starts", ()) if s.get("status") == "ok"}
    gpu = "serve, compiled" if graphs == {"compile"} else "serve" if "compile" not in graphs else "serve, mixed graphs"
    out = []
    # the summary again from the starts' rows: files written before a summary field existed get it too
    starts = doc.get("starts") or []
    summary = report.summarize(starts) if any(s.get("repeats") for s in starts) else doc.get("summary", {})
    # the warm phase loads nothing (every prompt is new; ours stores them): ours against no connector there is the
    # engine starts' own difference plus our stores, the context of a cell near a bound (``warm_note``)
    warm = {m: summary.get(m, {}).get("phases", {}).get("warm") for m in ("none", "tiered")}
    warm_s = {m: p["ttft_p50_ms"]["median"] / 1e3 for m, p in warm.items() if p and p.get("ttft_p50_ms")}
    warm_c = {p.get("concurrency") for p in warm.values() if p}
    for phase in ("c8", "c32", "c1"):
        got = {m: summary.get(m, {}).get("phases", {}).get(phase) for m in ("none", "offloading", "tiered")}
        if not got["tiered"] or not (got["none"] or got["offloading"]):
            continue  # nothing of ours, or nothing to judge it against (a file of our own modes only)
        med = {m: p["ttft_p50_ms"]["median"] / 1e3 for m, p in got.items() if p}
        span = {m: (p["ttft_p50_ms"]["min"] / 1e3, p["ttft_p50_ms"]["max"] / 1e3) for m, p in got.items() if p}
        g = got["tiered"].get("greedy_vs_none") or {}
        d = got["tiered"].get("greedy_reference_outputs")
        outputs = ([d, got["tiered"].get("greedy_requests", g["compared"])] if g.get("compared") and d is not None
                   else None)
        out.append({"shape": doc.get("shape", "?"), "workload": f"serving {phase}", "gpu": gpu,
                    "median_s": med, "min_max_s": span, "starts": {m: p["ttft_p50_ms"]["n"] for m, p in got.items() if p},
                    "greedy_equal": (g.get("compared") == g.get("equal")) if g.get("compared") else None,
                    "greedy_outputs": outputs,
                    "source": os.path.basename(path), "date": date})
        if len(warm_s) == 2 and warm_c == {p.get("concurrency") for p in got.values() if p}:
            out[-1]["warm_s"] = dict(warm_s)  # only beside a phase at the warm phase's concurrency
    return out


def warm_note(row: dict) -> str:
    """For a judged serving cell that fails or wants more starts, ours over no connector in the same starts' warm
    phase at the cell's concurrency, which loads nothing (``"; warm phase, nothing loaded: ours 1.21x none"``); else
    "". A ratio far from 1 there is the engine starts' own difference (the host's speed in an uncompiled engine) or
    our stores, not a load: one start per mode cannot tell it from the cell's ratio (round 18's gpt-oss c1: 1.14x,
    its warm phase 1.21x)."""
    w = row.get("warm_s") or {}
    if row.get("pass") is None or not w.get("none") or "tiered" not in w or \
            (row.get("pass") and not row.get("wants_3_starts")):
        return ""
    return f"; warm phase, nothing loaded: ours {w['tiered'] / w['none']:.2f}x none"


def file_date(doc: dict) -> str | None:
    """A result file's date (ISO, UTC): its ``date``, or a merged file's latest of ``dates``; None if it has none."""
    dates = [d for d in doc.get("dates") or () if d]
    return max(dates) if dates else doc.get("date")


def newest_serving(cells: list[dict]) -> list[dict | None]:
    """Per serving cell, the cell that supersedes it (the newest file's of the same shape, workload and GPU cache
    that measured every mode this one did: a file of ours and ``OffloadingConnector`` only does not replace a cell
    judged against no connector too), or None where none does. Newest by ``date`` (ISO strings compare as dates; no
    date: oldest); on a tie the later cell (the later file on the command line) wins."""
    out: list[dict | None] = []
    for i, c in enumerate(cells):
        key, modes, best = (c["shape"], c["workload"], c["gpu"]), set(c["median_s"]), None
        for j, n in enumerate(cells):
            if j == i or (n["shape"], n["workload"], n["gpu"]) != key or not modes <= set(n["median_s"]):
                continue
            if ((n.get("date") or ""), j) > ((c.get("date") or ""), i) and \
                    (best is None or ((n.get("date") or ""), j) > ((best[1].get("date") or ""), best[0])):
                best = (j, n)
        out.append(best[1] if best else None)
    return out


def _tokens(r: dict, ref: dict, key: str) -> tuple[list, list]:
    """The greedy tokens to compare of a start and its no-connector reference: every conversation's first turn-2
    token where both recorded them (``turn2_tokens_all``, since round 5), else ``key``'s."""
    if f"{key}_all" in r and f"{key}_all" in ref:
        key = f"{key}_all"
    return r[key], ref[key]


def _differences(ok: list[dict], got: dict, refs: dict, shape: str, gpu: str, tok_key: str, none: str,
                 mine: str) -> dict:
    """Where ours' greedy tokens differ from no connector's: the requests, no connector's first-token margins there
    (``batch_margins``), the ones where no connector's top two tie (``ties_at``: margin 0.0 in every start of no
    connector that recorded it, and, where its top two ids were recorded, ours answered one of them), and where the
    ``none-chunked`` control (recompute in other pieces) differs too."""
    def diff(rs):
        return sorted({i for r in rs if _prompts(r) in refs
                       for i, (t, u) in enumerate(zip(*_tokens(r, refs[_prompts(r)], tok_key))) if t != u})

    out = {"differs_at": diff(got[mine])}
    nones = [r for r in got[none] if r.get("batch_margins") and _prompts(r) in refs]
    if nones and tok_key == "batch_tokens":
        at = out["differs_at"]
        out["none_margins_there"] = [nones[0]["batch_margins"][i] for i in at]
        ours = [r[tok_key] for r in got[mine] if _prompts(r) in refs]

        def tie(i: int) -> bool:
            if any(r["batch_margins"][i] != 0.0 for r in nones):
                return False
            tops = [top[i] for r in nones if (top := r.get("batch_top2")) and top[i]]
            return all(toks[i][0] in top for top in tops for toks in ours)

        out["ties_at"] = [i for i in at if tie(i)]
    control = [r for r in ok if r["shape"] == shape and r["gpu"] == gpu and r["mode"] == "none-chunked" and tok_key in r]
    if control:
        out["control_differs_at"] = diff(control)
    return out


def _judge(row: dict, none: str, peer: str, mine: str) -> dict:
    """Ratios of ``mine`` over ``none`` and ``peer`` medians, the pass/fail verdict and the near-a-bound flag."""
    med, starts = row["median_s"], row["starts"]
    fails = []
    for m, name in ((none, "none"), (peer, "peer")):
        if m in med:
            ratio = med[mine] / med[m]
            row[f"vs_{name}"] = round(ratio, 3)
            if ratio > BOUND:
                fails.append(f"{ratio:.2f}x {m}")
            if ratio > BOUND / NEAR and min(starts.get(mine, 0), starts.get(m, 0)) < 3:
                row.setdefault("wants_3_starts", True)
    if row["greedy_equal"] is False:
        at, ctl = row.get("differs_at", []), row.get("control_differs_at")
        where = f" at request(s) {at}" if at else ""
        if ctl is not None and at and set(at) <= set(ctl):
            row["greedy_explained"] = "control"  # recompute in other pieces flips the same requests: bf16, not a load
        elif at and set(at) <= set(row.get("ties_at", ())):
            row["greedy_explained"] = "tie"  # no connector's own top two tie there: rounding picks, not a load
        else:
            fails.append(f"greedy outputs differ{where}" + (f" (none-chunked control differs at {ctl})"
                                                             if ctl is not None else " (no control run)"))
    row["pass"] = not fails
    row["why"] = "; ".join(fails)
    return row


def _prompts(r: dict) -> tuple:
    """What a start's prompts depend on: its workload's knobs (the number of conversations, prefix and lengths)."""
    k = r.get("knobs") or {}
    return tuple((name, k.get(name)) for name in ("n_conv", "unrelated", "prefix", "max_len"))


def verdict(results: list[dict], serving: list[dict] = ()) -> list[dict]:
    """One row per (shape, workload, GPU cache) that ran: medians over starts, ratios, greedy equality, pass/fail
    (``serving``: cells of ``serving_cells``, judged by the same rule; a serving cell a newer file measured again
    stays a row, with its ratios, but is not judged: ``pass`` None, ``superseded_by`` the newer file)."""
    ok = [r for r in results if "error" not in r]
    rows = []
    for shape in dict.fromkeys(r["shape"] for r in ok):
        for gpu in dict.fromkeys(r["gpu"] for r in ok if r["shape"] == shape):
            for work, key, tok_key, (none, peer, mine) in CELLS:
                got = {m: [r for r in ok if r["shape"] == shape and r["gpu"] == gpu and r["mode"] == m and key in r]
                       for m in (none, peer, mine)}
                if not got[mine] or not (got[none] or got[peer]):
                    continue
                med = {m: statistics.median(r[key] for r in rs) for m, rs in got.items() if rs}
                spread = {m: (min(r[key] for r in rs), max(r[key] for r in rs)) for m, rs in got.items() if rs}
                # greedy tokens are compared within one workload (calls with other knobs draw other prompts)
                refs = {_prompts(r): r for r in got[none]}
                checked = [r for r in got[mine] + got[peer] if _prompts(r) in refs]
                ours_checked = any(_prompts(r) in refs for r in got[mine])  # else the cell says nothing of ours
                equal = all(operator.eq(*_tokens(r, refs[_prompts(r)], tok_key)) for r in checked) if ours_checked else None
                row = {"shape": shape, "workload": work, "gpu": gpu, "starts": {m: len(rs) for m, rs in got.items()},
                       "median_s": med, "min_max_s": spread, "greedy_equal": equal,
                       "greedy_outputs": greedy_outputs(list(refs.values()), tok_key)}
                if equal is False:
                    row.update(_differences(ok, got, refs, shape, gpu, tok_key, none, mine))
                rows.append(_judge(row, none, peer, mine))
    for c, newer in zip(serving, newest_serving(list(serving))):
        row = _judge(dict(c), "none", "offloading", "tiered")
        if newer is not None:  # measured again later (on newer code): neither pass nor fail
            row.pop("wants_3_starts", None)
            src = newer.get("source", "?")
            row.update({"pass": None, "why": f"superseded by {src}", "superseded_by": src})
        rows.append(row)
    return rows


def greedy_outputs(refs: list[dict], tok_key: str) -> list[int] | None:
    """[distinct outputs, requests] of the no-connector start (of ``refs``) whose requests' outputs differ most:
    how much an equality of ours with it can say (None: no outputs recorded)."""
    best = None
    for ref in refs:
        key = f"{tok_key}_all" if f"{tok_key}_all" in ref else tok_key
        seqs = [tuple(t) if isinstance(t, list) else t for t in ref.get(key, ())]
        if seqs and (best is None or len(set(seqs)) > best[0]):
            best = [len(set(seqs)), len(seqs)]
    return best


def greedy_text(row: dict) -> str:
    """A verdict row's greedy-equality cell: yes, NO, or which requests differ and what explains it; a "yes" over
    outputs that hardly differ from request to request (fewer distinct than a quarter of them, from 4 on: dummy
    weights make the sliding-window hybrids answer alike) says so."""
    how = {"control": "as the none-chunked control",
           "tie": "where no connector's top two tie (margin 0)"}.get(row.get("greedy_explained"))
    if how:
        return f"no at {row['differs_at']}, {how}"
    text = {True: "yes", False: "NO", None: "-"}[row["greedy_equal"]]
    d, n = row.get("greedy_outputs") or (None, 0)
    if row["greedy_equal"] and report.weak_greedy(n, d):
        text += f" (weak: {d} distinct of {n} outputs)"
    return text


def table(doc: dict) -> str:
    """The envelope as markdown: one row per cell that ran (a serving cell a newer file measured again reads
    "superseded" and by which file, neither pass nor fail), then the cells that did not."""
    rows = verdict(doc["results"], doc.get("serving", ()))
    lines = ["| shape | workload | GPU cache | none | OffloadingConnector | ours | ours/none | ours/peer | greedy "
             "equal | starts (ours) | verdict |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    peer = {"disk": "offloading-small"}
    mine = {"disk": "tiered-disk"}
    for r in rows:
        p, m = peer.get(r["workload"], "offloading"), mine.get(r["workload"], "tiered")
        cell = lambda mode: f"{r['median_s'][mode]:.3f}" if mode in r["median_s"] else "-"  # noqa: E731
        verdict_ = ("pass" if r["pass"] else f"FAIL ({r['why']}{warm_note(r)})" if r["pass"] is False
                    else f"superseded ({r['why']})")  # None: a newer file measured the cell again
        if r.get("wants_3_starts") and r["pass"]:
            verdict_ += f" (near a bound: wants 3 starts{warm_note(r)})"
        eq = greedy_text(r)
        lines.append(f"| {r['shape']} | {r['workload']} | {r['gpu']} | {cell('none')} | {cell(p)} | {cell(m)} | "
                     f"{r.get('vs_none', '-')} | {r.get('vs_peer', '-')} | {eq} | {r['starts'].get(m, 0)} | {verdict_} |")
    for shape, why in doc.get("not_runnable", {}).items():
        lines.append(f"| {shape} | all | - | - | - | - | - | - | - | 0 | not run: {why} |")
    for s in doc.get("skipped", []):
        lines.append(f"| {s['shape']} | start {s['start']} of {s['mode']} | {s['gpu']} | | | | | | | | skipped: "
                     f"{s['reason']} |")
    return "\n".join(lines)


def stores_table(doc: dict) -> str:
    """Bytes stored per conversation and conversations per GiB, ours and (every layer of the prefix, as vLLM's
    ``OffloadingConnector`` keeps it: from its code, not measured) the peer's, per shape."""
    lines = ["| shape | stored per conversation (MB) | full layers x prefix + window layers x window (MB) | "
             "ratio | conversations per GiB | `OffloadingConnector`'s (every layer x prefix, from its code) |",
             "|---|---|---|---|---|---|"]
    seen = set()
    for r in doc["results"]:
        if r.get("mode") != "tiered" or "stored_vs_usable" not in r or r["shape"] in seen:
            continue
        seen.add(r["shape"])
        lines.append(f"| {r['shape']} | {r['stored_bytes_per_conversation'] / 1e6:.1f} | "
                     f"{r['usable_bytes_per_conversation'] / 1e6:.1f} | {r['stored_vs_usable']:.3f} | "
                     f"{r['conversations_per_gib']:.3f} | "
                     f"{2**30 / every_layer_bytes(r['shape'], r['knobs']['prefix']):.3f} |")
    return "\n".join(lines)


def merge(paths: list[str]) -> dict:
    """Combine several calls' documents (each start keeps its call's name; a start one call skipped and a later
    one ran is no longer listed as skipped)."""
    out: dict = {"results": [], "skipped": [], "pcie": [], "not_runnable": NOT_RUNNABLE, "calls": []}
    for p in paths:
        with open(p) as f:
            doc = json.load(f)
        call = os.path.basename(os.path.dirname(os.path.abspath(p))) or p
        # an already merged document keeps its calls' names (so a results file can take a later round's calls)
        out["calls"] += doc.get("calls") or [{"call": call, "command": doc.get("command"), "date": doc.get("date")}]
        for key in ("results", "skipped", "pcie"):
            out[key] += [dict(x, call=x.get("call", call)) for x in doc.get(key, [])]
        for key in ("notes", "serving"):
            if key in doc:
                out.setdefault(key, doc[key])
        out.setdefault("date", doc.get("date"))
        out.setdefault("rule", doc.get("rule"))
    ran = {(r["shape"], r["mode"], r["gpu"]) for r in out["results"] if "error" not in r}
    out["skipped"] = [x for x in out["skipped"] if (x["shape"], x["mode"], x["gpu"]) not in ran]
    out["command"] = "; ".join(c["command"] or "" for c in out["calls"])
    out["device"] = next((r["device"] for r in out["results"] if "device" in r), "unknown")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="gemma2")
    ap.add_argument("--modes", default="none,offloading,tiered")
    ap.add_argument("--gpu", default="tight", help="GPU caches: tight, roomy or both (comma-separated)")
    ap.add_argument("--starts", type=int, default=1)
    ap.add_argument("--start-offset", type=int, default=0, help="number of the first start (a later call goes on)")
    ap.add_argument("--deadline-s", type=float, default=0.0)
    ap.add_argument("--one", nargs=3, metavar=("SHAPE", "MODE", "GPU"), help="one start in this process")
    ap.add_argument("--merge", nargs="+")
    ap.add_argument("--serving", nargs="+", default=[], help="serve_bench.py result files whose c8/c32 cells join "
                    "the table (with --merge or --table)")
    ap.add_argument("--table")
    ap.add_argument("--out")
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args()
    if a.one:
        print("RESULT " + json.dumps(run_one(*a.one)), flush=True)
        return
    if a.table or a.merge:
        if a.merge:
            doc = merge(a.merge)
        else:
            with open(a.table) as f:
                doc = json.load(f)
        if a.serving:
            doc["serving"] = [c for p in a.serving for c in serving_cells(p)]
            doc["command"] = refold_command(doc.get("command", ""), sys.argv[1:])
        doc["verdict"] = verdict(doc["results"], doc.get("serving", ()))
        print(table(doc) + "\n\n" + stores_table(doc))
        if a.out:
            with open(a.out, "w") as f:
                json.dump(doc, f, indent=1)
        return
    shapes, modes, gpus = a.shapes.split(","), a.modes.split(","), a.gpu.split(",")
    for m in modes:
        if split_mode(m)[0] not in MODES:
            raise SystemExit(f"unknown mode {m!r}; valid: {', '.join(MODES)} (ours also as tiered+key=value)")
    for s in shapes:
        if s not in MODELS and s not in NOT_RUNNABLE:
            raise SystemExit(f"unknown shape {s!r}; valid: {', '.join(SHAPES)}, {', '.join(NOT_RUNNABLE)}")
    runnable = [s for s in shapes if s in MODELS]
    if a.dry_run:
        for shape, mode, gpu, start in plan(runnable, modes, gpus, a.starts, a.start_offset):
            w = knobs(shape)
            print(f"{shape} {mode} {gpu} #{start}: prefix {w['prefix']}, {kv_groups(shape)} KV cache group(s), "
                  f"{gpu_blocks(shape, GPU_FIT[gpu], w['max_len'])} GPU blocks")
        return
    doc = run_matrix(runnable, modes, gpus, a.starts, a.deadline_s, a.start_offset)
    doc["verdict"] = verdict(doc["results"])
    print(table(doc) + "\n\n" + stores_table(doc), flush=True)
    out = a.out or os.path.join(os.environ.get("OUT", "."), "envelope.json")
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
