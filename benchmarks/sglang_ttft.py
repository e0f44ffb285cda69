"""Turn-2 time-to-first-token inside a real SGLang engine: no HiCache vs HiCache L2 vs SGLang's file L3 vs tiered_kv.

A real ``sglang.Engine`` (offline, SGLang 0.5.17 on the GPU machine) per mode, each in its own
process, with dummy weights (``load_format="dummy"``, a config.json only, no tokenizer: prompts are
token ids). Model shapes (``--model``):
  llama3-8b   Llama-3-8B: 32 layers, 8 KV heads x 128, bf16: 128 KiB of KV per token, 8 MiB per 64-token page
  dsv2-lite   DeepSeek-V2-Lite: 27 MLA layers, one 576-wide latent per token (31 KiB per token), 64 experts

Workload: N conversations (``--n-conv``, 12) with distinct PREFIX-token prefixes (``--prefix``, 8,192).
Turn 1 = prefix + 64 tokens, 2 generated tokens. Turn 2 = turn 1 + its answer + 64 new tokens, one
request at a time, in the same order, after every turn 1: the GPU KV pool (``--gpu-tokens``, 32,768)
and the host L2 pool (``--hicache-ratio`` x the GPU pool, 1.5: 49,152 tokens) are both smaller than
the working set (12 x 8,256 = 99,072 tokens), so with LRU every turn-2 prefix has left L1 and L2 and
can only come from L3 (or be recomputed). Between the turns the backups settle (``--settle-s``) and
the OS page cache is dropped (``--drop-caches``, root only), so L3 reads come from the disk, for
SGLang's buffered file backend as for our O_DIRECT disk tier. TTFT = wall time of
``generate(max_new_tokens=1)``; the median leaves out the first two conversations (warm-up).

Modes (``--modes``, comma-separated; all in one session, one engine process each):
  none           no HiCache (turn 2 recomputes the prefix)
  l2             HiCache, host pool only (no L3): turn 2 recomputes too, plus the L2 traffic
  file           HiCache + SGLang's own file backend (``--hicache-storage-backend file``) on --disk-dir
  tiered         HiCache + tiered_kv (``dynamic`` backend, interface_v1) on --disk-dir, disk only,
                 ``disk_load_policy: auto``: a disk slower than recompute is declined (never slower than none)
  tiered-always  the same with ``disk_load_policy: always`` (every disk hit is read: the disk's real speed)
  restart        tiered (always): engine A runs both turns, exits; engine B, a new process on the same
                 disk_path, runs turn 2 again: L3 hit tokens > 0 and the same greedy tokens as A
  mla-none, mla-tiered, mla-gated   DeepSeek-V2-Lite shape, no HiCache vs tiered (always) vs tiered (auto:
                 the gate's recompute rate calibrated by mla-none, so run mla-none first); if SGLang cannot run
                 it with dummy weights on one GPU the result records the error
Defaults: none,file,tiered-always,tiered,l2 (in priority order: --deadline-s skips from the end).

Per mode: turn-2 TTFT median (and min/max), speed-up over none, L3 hit tokens (SGLang's
``cached_tokens_details["storage"]``; also device/host), greedy tokens equal to none's (both turns),
engine start seconds. Goals (issue 13): tiered L3 hits >= 1.5x faster than file on the same disk;
tiered never slower than none. The table says whether each held.

Usage (GPU machine, SGLang importable, tiered_kv on PYTHONPATH; scripts/gpu/sglang/README.md):
  PYTHONPATH=/tmp/sglang-site:. python3 benchmarks/sglang_ttft.py --deadline-s 560 --tag llama
  PYTHONPATH=/tmp/sglang-site:. python3 benchmarks/sglang_ttft.py --modes restart,mla-tiered,mla-none --tag mla
  python3 benchmarks/sglang_ttft.py --dry-run      # CPU: engine arguments, pool sizes, bytes per page/turn
``--deadline-s`` stops starting modes that would not finish in time (each is skipped and says so);
``--mode-timeout-s`` kills a hung engine. JSON to --out (default
docs/results/sglang_ttft_<tag>_<date>_<device>.json; also in $OUT when that is set, for the device tool).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from vllm_ttft import DSV2_LITE as _VLLM_DSV2_LITE, LLAMA3_8B as _VLLM_LLAMA3_8B  # benchmarks/ is on sys.path
from serving.shapes import kv_bytes_of  # noqa: E402 (vllm_ttft put benchmarks/ on sys.path)

MODES = ("none", "l2", "file", "tiered", "tiered-always", "restart", "mla-none", "mla-tiered", "mla-gated")
DEFAULT_MODES = ("none", "file", "tiered-always", "tiered", "l2")
FOLLOW = 64  # new tokens per turn
SHUTDOWN_GRACE_S = 30.0  # after a mode's result is written, its engine gets this long to exit
PAGE = 64

# the model shapes of benchmarks/vllm_ttft.py (same dummy weights); SGLang gets a longer context window
LLAMA3_8B = {**_VLLM_LLAMA3_8B, "max_position_embeddings": 32768}
DSV2_LITE = _VLLM_DSV2_LITE
MODELS = {"llama3-8b": LLAMA3_8B, "dsv2-lite": DSV2_LITE}


def kv_bytes_per_token(model: str) -> int:
    """KV bytes per token of the model shape across all layers (bf16)."""
    return kv_bytes_of(MODELS[model])


def mode_model(mode: str) -> str:
    """The model shape a mode runs."""
    return "dsv2-lite" if mode.startswith("mla-") else "llama3-8b"


def storage_of(mode: str) -> str | None:
    """L3 backend of a mode: None, "file" or "tiered"."""
    if mode in ("none", "l2", "mla-none"):
        return None
    return "file" if mode == "file" else "tiered"


def tiered_extra(mode: str, disk_dir: str, a: argparse.Namespace) -> dict:
    """Our ``--hicache-storage-backend-extra-config`` for a tiered mode."""
    policy = "auto" if mode in ("tiered", "mla-gated") else "always"
    # the gate's recompute rate: calibrated per model shape by that shape's no-HiCache mode (run it first)
    tps = getattr(a, "prefill_tps_mla", 0.0) if mode_model(mode) == "dsv2-lite" else a.prefill_tps
    return {"backend_name": "tiered_kv", "module_path": "tiered_kv.connector.sglang",
            "class_name": "TieredHiCacheStorage", "interface_v1": 1, "disk_path": disk_dir,
            "disk_bytes": f"{a.disk_gib}GiB", "disk_load_policy": policy,
            "prefill_tokens_per_s": tps if tps > 0 else 30000.0,
            "disk_read_gbps": a.disk_gbps if a.disk_gbps > 0 else 3.0}


def engine_kwargs(mode: str, model_dir: str, disk_dir: str, a: argparse.Namespace) -> dict:
    """``sglang.Engine`` keyword arguments of a mode (ServerArgs fields of SGLang 0.5.17)."""
    kw = {
        "model_path": model_dir, "load_format": "dummy", "skip_tokenizer_init": True,
        "attention_backend": "triton", "sampling_backend": "pytorch", "grammar_backend": "none",
        "disable_cuda_graph": True, "page_size": PAGE, "max_total_tokens": a.gpu_tokens,
        "mem_fraction_static": a.mem_fraction, "chunked_prefill_size": a.chunked_prefill,
        "random_seed": 0, "log_level": a.log_level, "enable_cache_report": True,
        "context_length": a.prefix + 4 * FOLLOW + 64,
    }
    if mode != "none" and mode != "mla-none":
        kw.update({"enable_hierarchical_cache": True, "hicache_ratio": a.hicache_ratio,
                   "hicache_write_policy": "write_through", "hicache_mem_layout": "page_first",
                   "hicache_io_backend": "kernel", "hicache_storage_prefetch_policy": a.prefetch_policy})
    st = storage_of(mode)
    if st == "file":
        kw["hicache_storage_backend"] = "file"
    elif st == "tiered":
        kw["hicache_storage_backend"] = "dynamic"
        kw["hicache_storage_backend_extra_config"] = json.dumps(tiered_extra(mode, disk_dir, a))
    return kw


def conversations(model: str, a: argparse.Namespace) -> list[list[int]]:
    """Turn-1 prompts: distinct random prefixes + 64 tokens (seeded: the same in every mode and run)."""
    rng = random.Random(1234)
    vocab = MODELS[model]["vocab_size"]
    return [[rng.randrange(10, vocab - 10) for _ in range(a.prefix + FOLLOW)] for _ in range(a.n_conv)]


def follow_up(i: int, model: str) -> list[int]:
    """The 64 new tokens of turn 2 of conversation i."""
    rng = random.Random(10_000 + i)
    vocab = MODELS[model]["vocab_size"]
    return [rng.randrange(10, vocab - 10) for _ in range(FOLLOW)]


def write_model(model: str) -> str:
    """A directory with only the model's config.json (dummy weights need nothing else)."""
    d = tempfile.mkdtemp(prefix=f"sglang-{model}-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(MODELS[model], f)
    return d


def measure_disk_gbps(directory: str, mib: int = 1024, block_mib: int = 8) -> dict:
    """Cold sequential read rate of the L3 disk: write ``mib`` MiB, drop the page cache, read it back in
    ``block_mib`` MiB reads (what the gate's ``disk_read_gbps`` stands for; ``tiered-kv bench`` measures more)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "disk_probe.bin")
    block = os.urandom(block_mib << 20)
    try:
        with open(path, "wb") as f:
            for _ in range(mib // block_mib):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        dropped = drop_page_cache()
        fd = os.open(path, os.O_RDONLY)
        try:
            if not dropped:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            n = 0
            while True:
                chunk = os.read(fd, block_mib << 20)
                if not chunk:
                    break
                n += len(chunk)
            s = time.perf_counter() - t0
        finally:
            os.close(fd)
    finally:
        try:
            os.remove(path)
        except OSError:
            pass
    return {"gbps": round(n / s / 1e9, 3), "mib": mib, "page_cache_dropped": dropped}


def drop_page_cache() -> bool:
    """Write back and drop the OS page cache (root only). True if it worked."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


# ---------------------------------------------------------------------------- one engine (worker process)

def _details(meta: dict) -> dict:
    d = meta.get("cached_tokens_details") or {}
    return {"cached": int(meta.get("cached_tokens", 0) or 0), "device": int(d.get("device", 0) or 0),
            "host": int(d.get("host", 0) or 0), "storage": int(d.get("storage", 0) or 0)}


def run_engine(mode: str, phase: str, spec: dict, report) -> None:
    """One engine process: start, (turn 1,) settle, drop caches, turn 2, ``report(measurements)``, shut down.

    The measurements are reported before the engine shuts down, so a shutdown that hangs costs no result.
    """
    import sglang as sgl

    a = argparse.Namespace(**spec["args"])
    model = mode_model(mode)
    if storage_of(mode) == "file":
        os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = spec["disk_dir"]
    kw = engine_kwargs(mode, spec["model_dir"], spec["disk_dir"], a)
    t0 = time.perf_counter()
    engine = sgl.Engine(**kw)
    out: dict = {"start_s": round(time.perf_counter() - t0, 1), "phase": phase}
    greedy = {"temperature": 0.0}
    try:
        def gen(ids, n):
            t = time.perf_counter()
            r = engine.generate(input_ids=ids, sampling_params=dict(greedy, max_new_tokens=n, ignore_eos=True))
            return time.perf_counter() - t, list(r.get("output_ids") or []), _details(r.get("meta_info", {}))

        rng = random.Random(99)  # warm-up: compiles the Triton kernels outside the timed turns
        vocab = MODELS[model]["vocab_size"]
        for n in (PAGE * 3 + 5, 2 * PAGE + 1):
            gen([rng.randrange(10, vocab - 10) for _ in range(n)], 2)
        convs = conversations(model, a)
        turn1 = []
        if phase in ("both", "turn1"):
            for ids in convs:
                s, toks, det = gen(ids, 2)
                turn1.append({"s": round(s, 4), "tokens": toks, **det})
            out["turn1"] = turn1
            time.sleep(a.settle_s)  # let the L2 -> L3 backups finish
        if phase in ("both", "turn2"):
            prev = spec.get("turn1_tokens") or [t["tokens"] for t in turn1]
            out["page_cache_dropped"] = drop_page_cache() if a.drop_caches else False
            turn2 = []
            for i, ids in enumerate(convs):
                s, toks, det = gen(ids + prev[i] + follow_up(i, model), 1)
                turn2.append({"s": round(s, 4), "tokens": toks, **det})
            out["turn2"] = turn2
        report(out)
    finally:
        engine.shutdown()


def worker_main(mode: str, phase: str, spec_path: str, result_path: str) -> None:
    """Entry point of a mode's process: run it and write the result JSON (or the error)."""
    with open(spec_path) as f:
        spec = json.load(f)
    def report(res: dict) -> None:
        tmp = result_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f)
        os.replace(tmp, result_path)  # the parent sees a whole file or none

    try:
        run_engine(mode, phase, spec, report)
    except BaseException as exc:  # the parent records why this mode did not run
        import traceback

        if not os.path.exists(result_path):
            report({"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()[-4000:]})
    sys.stdout.flush()
    os._exit(0)  # engine threads must not keep the process alive


# ---------------------------------------------------------------------------- the session (parent process)

def spawn(mode: str, phase: str, spec: dict, timeout_s: float) -> dict:
    """Run one engine phase in its own process group; kill it at ``timeout_s``."""
    work = tempfile.mkdtemp(prefix=f"sglang-ttft-{mode}-")
    spec_path, result_path = os.path.join(work, "spec.json"), os.path.join(work, "result.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--phase", phase,
           "--spec", spec_path, "--result", result_path]
    # FlashInfer is not on the GPU machine (scripts/gpu/sglang: an import-only shim at most): never select it
    env = dict(os.environ, PYTHONUNBUFFERED="1", SGLANG_IS_FLASHINFER_AVAILABLE="false")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    res = None
    try:
        deadline, grace = t0 + max(5.0, timeout_s), None
        while proc.poll() is None and time.perf_counter() < deadline:
            time.sleep(0.5)
            if grace is None and os.path.exists(result_path):
                grace = time.perf_counter() + SHUTDOWN_GRACE_S  # measured; give the engine's shutdown a moment
                deadline = min(deadline, grace)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        try:
            with open(result_path) as f:
                res = json.load(f)
            if grace is not None and proc.returncode not in (0, None):
                res["shutdown"] = f"killed {SHUTDOWN_GRACE_S:.0f} s after its result (shutdown hung)"
        except (OSError, ValueError):
            res = {"error": f"timed out after {timeout_s:.0f} s (killed)" if proc.returncode == -signal.SIGKILL
                   else f"engine process exited {proc.returncode} without a result"}
    finally:
        try:  # engine children (scheduler, detokenizer) go with the group
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    shutil.rmtree(work, ignore_errors=True)
    return res


def summarize(mode: str, res: dict, skip: int) -> dict:
    """Medians and hit counts of one mode's turn 2."""
    out = {"mode": mode, "model": mode_model(mode), "start_s": res.get("start_s"), "wall_s": res.get("wall_s")}
    if "error" in res:
        out["error"] = res["error"]
        return out
    t2 = res.get("turn2") or []
    timed = [t["s"] for t in t2[skip:]] or [t["s"] for t in t2]
    out.update({
        "turn2_median_s": round(statistics.median(timed), 4) if timed else None,
        "turn2_min_s": min(timed) if timed else None, "turn2_max_s": max(timed) if timed else None,
        "turn1_median_s": round(statistics.median([t["s"] for t in res.get("turn1", [])]), 4)
        if res.get("turn1") else None,
        "l3_hit_tokens": sum(t["storage"] for t in t2), "host_hit_tokens": sum(t["host"] for t in t2),
        "device_hit_tokens": sum(t["device"] for t in t2),
        "page_cache_dropped": res.get("page_cache_dropped"),
        "turn1_tokens": [t["tokens"] for t in res.get("turn1", [])], "turn2_tokens": [t["tokens"] for t in t2],
    })
    return out


def run_session(modes: list[str], a: argparse.Namespace) -> dict:
    """Every mode, one after the other, inside the deadline."""
    t_start = time.monotonic()
    model_dirs = {m: write_model(m) for m in {mode_model(x) for x in modes}}
    results: list[dict] = []
    per_mode_s = 0.0
    args = {k: v for k, v in vars(a).items() if k in SPEC_ARGS}
    calibration: dict = {}
    if a.disk_gbps <= 0 and any(storage_of(m) == "tiered" for m in modes):
        calibration["disk"] = measure_disk_gbps(a.disk_dir)
        args["disk_gbps"] = calibration["disk"]["gbps"]
        print(f"[sglang_ttft] disk read probe: {calibration['disk']}", flush=True)
    for mode in modes:
        left = a.deadline_s - (time.monotonic() - t_start)
        need = per_mode_s * (2 if mode == "restart" else 1) or a.first_mode_s
        if left < need:
            results.append({"mode": mode, "model": mode_model(mode),
                            "skipped": f"deadline: {left:.0f} s left, a mode took {per_mode_s:.0f} s"})
            print(f"[sglang_ttft] {mode}: skipped ({left:.0f} s left)", flush=True)
            continue
        disk_dir = os.path.join(a.disk_dir, mode)
        shutil.rmtree(disk_dir, ignore_errors=True)
        os.makedirs(disk_dir, exist_ok=True)
        spec = {"args": args, "model_dir": model_dirs[mode_model(mode)], "disk_dir": disk_dir}
        timeout = min(a.mode_timeout_s, max(10.0, left - 5))
        t0 = time.monotonic()
        print(f"[sglang_ttft] {mode}: starting ({left:.0f} s left)", flush=True)
        if mode == "restart":
            first = spawn(mode, "both", spec, timeout)
            res = {"first": first}
            if "error" not in first:
                spec2 = dict(spec, turn1_tokens=[t["tokens"] for t in first["turn1"]])
                second = spawn(mode, "turn2", spec2, max(10.0, timeout - first["wall_s"]))
                res = dict(second, first=first)
            else:
                res["error"] = "first engine: " + first["error"]
            s = summarize(mode, res, a.skip)
            if "error" not in res:
                f = summarize(mode, first, a.skip)
                s["before_restart"] = {k: f[k] for k in ("turn2_median_s", "l3_hit_tokens", "turn2_tokens")}
                s["turn1_tokens"] = f["turn1_tokens"]
                same = s["turn2_tokens"] == f["turn2_tokens"]
                s["greedy_equal_across_restart"] = same if all(s["turn2_tokens"]) else None
        else:
            res = spawn(mode, "both", spec, timeout)
            s = summarize(mode, res, a.skip)
        if "traceback" in res:
            s["traceback"] = res["traceback"]
        elapsed = time.monotonic() - t0
        per_mode_s = max(per_mode_s, elapsed / (2 if mode == "restart" else 1))
        s["mode_s"] = round(elapsed, 1)
        results.append(s)
        if mode in ("none", "mla-none") and a.prefill_tps <= 0 and s.get("turn2_median_s"):
            # the gate's recompute rate: none's turn-2 prompt tokens per second on this GPU, per shape
            key = "prefill_tps" if mode == "none" else "prefill_tps_mla"
            args[key] = round(turn2_tokens(a) / s["turn2_median_s"], 1)
            calibration["prefill_tokens_per_s" if mode == "none" else "prefill_tokens_per_s_mla"] = args[key]
        brief = {k: v for k, v in s.items() if ("tokens" not in k or k.endswith("hit_tokens")) and k != "traceback"}
        print(f"[sglang_ttft] {mode}: {json.dumps(brief)[:800]}", flush=True)
        if "traceback" in s:  # the device tool returns only the output's tail: say where it broke, here
            print(f"[sglang_ttft] {mode} traceback (tail):\n{s['traceback'][-1500:]}", flush=True)
        if not a.keep_disk:
            shutil.rmtree(disk_dir, ignore_errors=True)
    compare(results)
    return {"results": results, "calibration": calibration, "elapsed_s": round(time.monotonic() - t_start, 1)}


def turn2_tokens(a: argparse.Namespace) -> int:
    """Prompt tokens of one turn 2 (turn 1 + 2 answer tokens + 64 new)."""
    return a.prefix + FOLLOW + 2 + FOLLOW


def compare(results: list[dict]) -> None:
    """Speed-ups over none / file and greedy equality against none (same model)."""
    by = {r["mode"]: r for r in results}
    for r in results:
        base = by.get("mla-none" if r.get("model") == "dsv2-lite" else "none")
        if base and base.get("turn2_median_s") and r.get("turn2_median_s"):
            r["vs_none"] = round(base["turn2_median_s"] / r["turn2_median_s"], 3)
            seen = all(r["turn2_tokens"]) and all(base["turn2_tokens"])
            r["greedy_equal_none"] = (r["turn2_tokens"] == base["turn2_tokens"]
                                      and r["turn1_tokens"] == base["turn1_tokens"]) if seen else None
        f = by.get("file")
        if f and f.get("turn2_median_s") and r.get("turn2_median_s") and r["mode"].startswith("tiered"):
            r["vs_file"] = round(f["turn2_median_s"] / r["turn2_median_s"], 3)


def table(session: dict) -> str:
    """The results as a Markdown table, plus the goal verdicts."""
    rows = ["| mode | model | turn-2 median | min-max | vs none | vs file | L3 hit tokens | host / device hit "
            "tokens | greedy = none | start |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in session["results"]:
        if "skipped" in r or "error" in r:
            rows.append(f"| {r['mode']} | {r['model']} | {r.get('skipped') or 'ERROR: ' + r['error'][:160]} "
                        f"| | | | | | | |")
            continue
        rows.append(f"| {r['mode']} | {r['model']} | {r['turn2_median_s']:.4f} s | {r['turn2_min_s']:.4f}-"
                    f"{r['turn2_max_s']:.4f} | {r.get('vs_none', '-')} | {r.get('vs_file', '-')} | "
                    f"{r['l3_hit_tokens']} | {r['host_hit_tokens']} / {r['device_hit_tokens']} | "
                    f"{r.get('greedy_equal_none', r.get('greedy_equal_across_restart', '-'))} | {r['start_s']} s |")
    by = {r["mode"]: r for r in session["results"]}
    notes = []
    for m in ("tiered-always", "tiered"):
        if by.get(m, {}).get("vs_file") is not None:
            notes.append(f"goal {m} >= 1.5x file: {'met' if by[m]['vs_file'] >= 1.5 else 'NOT met'} "
                         f"({by[m]['vs_file']}x)")
    if by.get("tiered", {}).get("vs_none") is not None:
        notes.append(f"goal tiered never slower than none: {'met' if by['tiered']['vs_none'] >= 0.97 else 'NOT met'}"
                     f" ({by['tiered']['vs_none']}x; 3% = run-to-run noise)")
    r = by.get("restart")
    if r and "turn2_median_s" in r:
        notes.append(f"restart: L3 hit tokens after restart {r['l3_hit_tokens']}, greedy equal across restart "
                     f"{r.get('greedy_equal_across_restart')}")
    return "\n".join(rows + [""] + notes)


SPEC_ARGS = ("prefix", "n_conv", "gpu_tokens", "hicache_ratio", "mem_fraction", "chunked_prefill", "settle_s",
             "drop_caches", "disk_gib", "prefill_tps", "disk_gbps", "prefetch_policy", "log_level", "skip")


def dry_run(modes: list[str], a: argparse.Namespace) -> dict:
    """CPU: every mode's engine arguments and the workload's sizes (no SGLang, no GPU)."""
    out = {"modes": {}, "workload": {}}
    for model in sorted({mode_model(m) for m in modes}):
        bpt = kv_bytes_per_token(model)
        turn1 = a.prefix + FOLLOW
        ws = a.n_conv * (turn1 + 2)
        out["workload"][model] = {
            "kv_bytes_per_token": bpt, "page_bytes": bpt * PAGE, "turn1_tokens": turn1,
            "working_set_tokens": ws, "working_set_gib": round(ws * bpt / 2**30, 2),
            "gpu_pool_tokens": a.gpu_tokens, "host_pool_tokens": int(a.gpu_tokens * a.hicache_ratio),
            "l3_pages_per_turn2": turn1 // PAGE, "l3_bytes_per_turn2_gib": round(turn1 // PAGE * PAGE * bpt / 2**30, 3),
            "pool_smaller_than_working_set": int(a.gpu_tokens * a.hicache_ratio) < ws,
            "break_even_disk_gbps_at_30k_tps": round(bpt * (a.prefill_tps or 30000.0) / 1e9, 2),
        }
    for m in modes:
        out["modes"][m] = engine_kwargs(m, "<model_dir>", os.path.join(a.disk_dir, m), a)
    return out


def main() -> None:
    """Command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--tag", default="llama", help="result name: sglang_ttft_<tag>_<date>_<device>.json")
    ap.add_argument("--out", default=None,
                    help="JSON path, or a directory for the default name "
                    "(default docs/results/sglang_ttft_<tag>_<date>_<device>.json)")
    ap.add_argument("--deadline-s", type=float, default=560.0, help="start no mode that would end after this")
    ap.add_argument("--first-mode-s", type=float, default=90.0, help="time a mode is assumed to need before one ran")
    ap.add_argument("--mode-timeout-s", type=float, default=300.0, help="kill an engine process after this")
    ap.add_argument("--disk-dir", default="/root/tkv/sglang_ttft", help="L3 directory (a real disk, not tmpfs)")
    ap.add_argument("--keep-disk", action="store_true", help="leave each mode's L3 directory behind")
    ap.add_argument("--prefix", type=int, default=8192)
    ap.add_argument("--n-conv", type=int, default=12)
    ap.add_argument("--gpu-tokens", type=int, default=32768, help="GPU KV pool (max_total_tokens)")
    ap.add_argument("--hicache-ratio", type=float, default=1.5, help="host L2 pool / GPU pool")
    ap.add_argument("--mem-fraction", type=float, default=0.55)
    ap.add_argument("--chunked-prefill", type=int, default=16384)
    ap.add_argument("--settle-s", type=float, default=6.0, help="pause after turn 1 for L3 backups")
    ap.add_argument("--no-drop-caches", dest="drop_caches", action="store_false")
    ap.add_argument("--disk-gib", type=int, default=40)
    ap.add_argument("--prefill-tps", type=float, default=0.0,
                    help="tiered gate's prefill_tokens_per_s; 0 = none's measured turn-2 rate (else 30000)")
    ap.add_argument("--disk-gbps", type=float, default=0.0,
                    help="tiered gate's disk_read_gbps; 0 = a cold read probe of --disk-dir before the modes")
    ap.add_argument("--prefetch-policy", default="timeout", choices=["timeout", "wait_complete", "best_effort"])
    ap.add_argument("--skip", type=int, default=2, help="turn-2 conversations left out of the median")
    ap.add_argument("--log-level", default="warning")
    ap.add_argument("--dry-run", action="store_true", help="print engine arguments and sizes; no GPU")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--phase", default="both", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker_main(a.worker, a.phase, a.spec, a.result)
        return
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown mode(s) {bad}; valid: {', '.join(MODES)}")
    if a.dry_run:
        print(json.dumps(dry_run(modes, a), indent=1))
        return
    session = run_session(modes, a)
    session.update({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
                    "args": {k: v for k, v in vars(a).items() if k not in ("worker", "phase", "spec", "result")},
                    "device": _device(), "versions": _versions()})
    text = table(session)
    print(text, flush=True)
    session["table"] = text
    dev = session["device"].lower()
    short = next((k for k in ("h100", "h200", "a100", "b200") if k in dev), re.sub(r"[^a-z0-9]+", "-", dev)[:16])
    name = f"sglang_ttft_{a.tag}_{time.strftime('%Y-%m-%d')}_{short}.json"
    path = os.path.join(a.out, name) if a.out and os.path.isdir(a.out) else a.out or os.path.join("docs", "results", f"sglang_ttft_{a.tag}_{time.strftime('%Y-%m-%d')}_{short}.json")
    for p in [path] + ([os.path.join(os.environ["OUT"], os.path.basename(path))] if os.environ.get("OUT") else []):
        os.makedirs(os.path.dirname(p) or ".", exist_ok=True)
        with open(p, "w") as f:
            json.dump(session, f, indent=1)
        print(f"[sglang_ttft] wrote {p}")


def _device() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "unknown"


def _versions() -> dict:
    out = {}
    for name in ("sglang", "sgl_kernel", "torch", "triton"):
        try:
            out[name] = getattr(__import__(name), "__version__", "?")
        except Exception as exc:  # noqa: BLE001 (report, don't fail the run)
            out[name] = f"not importable: {type(exc).__name__}"
    return out


if __name__ == "__main__":
    main()
