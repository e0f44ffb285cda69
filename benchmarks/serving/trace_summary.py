"""Summaries of our connector's per-step load trace (``trace_path``, ``tiered_kv/connector/vllm/trace.py``) per phase.

``serve_bench.py --trace`` gives every ``tiered*`` start ``trace_path = $OUT/trace_<shape>_<mode>_r<run>``;
each worker rank appends ``<trace_path>.rank<r>.jsonl``. After the start, ``summarize_phase`` reads the
lines whose wall time falls inside a phase (plus a second for loads that land after its last request
started) and reports, per phase: loading steps, in-step and asynchronous loads and bytes, bytes per
loading step, how long ``start_load_kv`` held vLLM's thread (p50/p90/max/sum), and per kind of load its
GPU time and host latency (submission to ``get_finished``) p50/p90 with the GB/s the GPU times imply
(bytes / summed GPU time: a rate only while one step's loads do not overlap in time).

``big_step_hold_gbps``: for each step that loaded at least ``BIG_STEP_BYTES`` in-step, its in-step bytes
over the time ``start_load_kv`` held vLLM's thread. Near the PCIe rate it says the submission itself
lasted about as long as the transfer (the driver spends ~1 us of the calling thread per descriptor), so
the forward launched only after the bytes had (nearly) landed: no layer-by-layer overlap in that step
(H200, 2026-11-28: 46-70 GB/s per start on per-layer tensors with every group submitted before the
forward, docs/benchmarks.md).

``steps_by_tokens``: the same split for the phase's most frequent step sizes, in 16-token buckets: a closed-loop
phase repeats a few (round 23's c8 waves were 1,121-token steps of seven loads and 160-167-token steps of one), so a
loading step can be set against a step of the same size without loads, ``tiered-resident``'s being the floor's.

``steps``: the forward of each lined step, ``loading`` (steps whose forward waits for in-step loads) beside
``recompute`` (steps of at least ``PREFILL_LINE_TOKENS`` scheduled tokens without in-step loads): tokens scheduled,
``launch_ms`` (vLLM's thread launching the forward: ``bind_connector_metadata`` to ``wait_for_save`` less
``start_load_kv``'s hold) and ``gpu_fwd_ms`` (the forward on the GPU, ``prefill_learn``'s clock). A GPU time about
equal to the launch time says the GPU waited for the host's launches: such a step costs its launch, whatever it
computes.

``timeline`` (in ``steps`` and ``steps_by_tokens``, where the scheduler's trace is there: ``read_sched``): a step's
time in the engine core, from the first of our hooks in its ``schedule()`` to its output being applied (about what
vLLM's prefill time measures for the requests the step starts, which begins at ``schedule()``'s start, a little
earlier), cut at the wall clock of the step's slowest rank: ``schedule_ms`` (our first hook to the end of
``schedule()``; steps where none of our hooks ran before the build have none, and their ``sched_ms`` starts at the
build), ``to_worker_ms`` (``schedule()`` done to the rank taking the step: the scheduler output crossing to the worker,
and the worker finishing the step before), ``worker_ms`` (the rank taking it to its ``get_finished`` returning: launch,
our hooks, any wait for in-step loads), ``after_ms`` (from there to the output applied: the GPU finishing the step, the
output crossing back, the engine core scheduling the next step first), ``sched_ms`` (the whole), ``hooks_ms`` (our
scheduler hooks inside that ``schedule()``) and ``apply_ms`` (our ``update_connector_output``).

Threading contract: plain functions, no state.
"""
from __future__ import annotations

import glob
import json

from serving.stats import percentile

#: lines up to this long after a phase's end still count for it (its last loads land and are reported then)
TAIL_S = 1.0
#: in-step bytes from which a step counts for ``big_step_hold_gbps``
BIG_STEP_BYTES = 1_000_000_000
#: scheduled tokens from which a step without loads counts as a recomputing prefill step: the size from which the
#: connector's trace writes such steps (``tiered_kv/connector/vllm/trace.py``; a test keeps the two equal; not
#: imported, so that reading traces does not import torch)
PREFILL_LINE_TOKENS = 128
#: ``steps_by_tokens``: this many of a phase's most frequent step sizes, in buckets of ``BY_TOKENS_BUCKET`` tokens (a
#: one-load c8 step schedules its 160 new tokens and the batch's decodes: 160-167)
BY_TOKENS = 4
BY_TOKENS_BUCKET = 16


def _jsonl(pattern: str, src) -> list[dict]:
    """Every readable line of the files ``pattern`` matches (a line cut short when the server was stopped is
    skipped), each with ``_src = src(path)``."""
    out = []
    for path in sorted(glob.glob(pattern)):
        with open(path, encoding="utf-8", errors="replace") as f:
            for raw in f:
                try:
                    line = json.loads(raw)
                except ValueError:
                    continue
                line["_src"] = src(path)
                out.append(line)
    return out


def read_lines(trace_path: str) -> list[dict]:
    """Every line of every rank's file of ``trace_path`` (unreadable lines skipped), sorted by time; each line gets
    ``_src``, its file's path (step numbers are an engine's own, and a rank's GPU times its own)."""
    out = _jsonl(glob.escape(trace_path) + ".rank*.jsonl", lambda path: path)
    return sorted(out, key=lambda x: x.get("t", 0.0))


def read_sched(trace_path: str) -> list[dict]:
    """The scheduler's lines of ``trace_path`` (``<trace_path>.sched.jsonl``; none: ``[]``), each with ``_src``: the
    trace path, which the workers' lines share (``_base``)."""
    return _jsonl(glob.escape(trace_path) + ".sched.jsonl", lambda path: trace_path)


def _base(src: str | None) -> str | None:
    """The trace path of a worker's file (``<trace_path>.rank<r>.jsonl``), which its scheduler's lines carry."""
    if src is None:
        return None
    head, sep, tail = src.rpartition(".rank")
    return head if sep and tail.endswith(".jsonl") else src


def _timeline(steps: list[dict], sched: dict[tuple, dict]) -> dict:
    """``timeline`` of ``steps`` (see the module): one step once, cut at the line of its slowest rank (the latest
    ``get_finished``: the step's output waits for every rank) among those with ``t_begin``."""
    slowest: dict[tuple, dict] = {}
    for x in steps:
        key = (_base(x.get("_src")), x.get("step"))
        if key in sched and x.get("t_begin") and (key not in slowest or x["t"] > slowest[key]["t"]):
            slowest[key] = x
    parts: dict[str, list[float]] = {k: [] for k in ("schedule_ms", "to_worker_ms", "worker_ms", "after_ms",
                                                      "sched_ms", "hooks_ms", "apply_ms")}
    for key, x in slowest.items():
        s = sched[key]
        if s.get("t_applied") is None:
            continue
        start = s.get("t_hook") or s["t"]
        if s.get("t_hook"):
            parts["schedule_ms"].append((s["t"] - s["t_hook"]) * 1e3)
        parts["to_worker_ms"].append((x["t_begin"] - s["t"]) * 1e3)
        parts["worker_ms"].append((x["t"] - x["t_begin"]) * 1e3)
        parts["after_ms"].append((s["t_applied"] - x["t"]) * 1e3)
        parts["sched_ms"].append((s["t_applied"] - start) * 1e3)
        parts["hooks_ms"].append(s.get("hooks_ms", 0.0))
        parts["apply_ms"].append(s.get("apply_ms", 0.0))
    return {k: _dist(v) for k, v in parts.items()}


def _dist(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50": round(percentile(values, 50), 3), "p90": round(percentile(values, 90), 3),
            "max": round(max(values), 3), "sum": round(sum(values), 3)}


def forward_times(lines: list[dict]) -> dict[tuple, float]:
    """``{(file, step): GPU forward ms}`` from every line's ``fwd``: a step's time as the rank (and engine) that
    wrote its line measured it (lines without ``_src``: one file)."""
    out: dict[tuple, float] = {}
    for x in lines:
        for step, ms in (x.get("fwd") or {}).items():
            out[(x.get("_src"), int(step))] = ms
    return out


def _forwards(steps: list[dict], fwd: dict[tuple, float], sched: dict[tuple, dict] | None = None) -> dict:
    """Tokens, launch and GPU forward times of ``steps`` (one line per rank: a TP engine's step counts once a rank);
    with the scheduler's lines (``{(trace path, step): line}``), their ``timeline`` too."""
    timed = [fwd[key] for x in steps if (key := (x.get("_src"), x.get("step"))) in fwd]
    out = {"n": len(steps), "tokens": _dist([x["tokens"] for x in steps if x.get("tokens") is not None]),
           "launch_ms": _dist([x["launch_ms"] for x in steps if x.get("launch_ms") is not None]),
           "gpu_fwd_ms": _dist(timed)}
    if sched:
        out["timeline"] = _timeline(steps, sched)
    return out


def summarize_phase(lines: list[dict], t_start: float, t_end: float, sched: list[dict] | None = None) -> dict:
    """The trace of one phase (lines with ``t_start <= t <= t_end + TAIL_S``; ``lines``: the whole start's, where
    the GPU forward times of a phase's last steps may sit in a later line); ``sched``: the scheduler's lines
    (``read_sched``), for the steps' ``timeline``."""
    mine = [x for x in lines if t_start <= x.get("t", 0.0) <= t_end + TAIL_S]
    loading = [x for x in mine if x["in_step"]["loads"] or x["async"]["loads"]]
    out: dict = {"lines": len(mine), "loading_steps": len(loading)}
    for kind, key in (("in_step", "in_step"), ("async", "async")):
        loads = sum(x[key]["loads"] for x in mine)
        nbytes = sum(x[key]["bytes"] for x in mine)
        per_step = [x[key]["bytes"] / 1e6 for x in loading if x[key]["loads"]]
        landed = [y for x in mine for y in x.get("landed", ()) if y["kind"] == kind]
        gpu = [y["gpu_ms"] for y in landed]
        gpu_bytes = sum(y["bytes"] for y in landed)
        out[kind] = {"loads": loads, "bytes": nbytes, "mb_per_step": _dist(per_step), "gpu_ms": _dist(gpu),
                     "host_ms": _dist([y["host_ms"] for y in landed]),
                     "gbps": round(gpu_bytes / sum(gpu) / 1e6, 2) if sum(gpu) > 0 else None}
    out["start_load_ms"] = _dist([x["start_load_ms"] for x in loading])
    out["big_step_hold_gbps"] = _dist([x["in_step"]["bytes"] / x["start_load_ms"] / 1e6 for x in loading
                                       if x["in_step"]["bytes"] >= BIG_STEP_BYTES and x["start_load_ms"] > 0])
    out["fence_ms"] = _dist([x["fence_ms"] for x in loading if x.get("fence_ms")])
    # load_submit pipelined: vLLM's thread in wait_for_layer_load submitting later layer groups (older traces: none)
    out["forward_submit_ms"] = _dist([x["forward_submit_ms"] for x in loading if "forward_submit_ms" in x])
    # in_step_copy staged / auto: steps whose in-step copy went through the staging buffer (older traces: none)
    out["staged_steps"] = sum(1 for x in loading if x["in_step"].get("staged"))
    # in_step_copy sm_kernel / auto in small steps (in_step_sm_max_tokens): steps whose copy took the SM kernel
    out["sm_steps"] = sum(1 for x in loading if x["in_step"].get("sm"))
    # staging buffers allocated inside loading steps, and what those steps held vLLM's thread (a first large load)
    grew = [x for x in loading if x["in_step"].get("staging_allocs")]
    out["staging_alloc_steps"] = {"n": len(grew), "start_load_ms": [x.get("start_load_ms") for x in grew][:8]}
    # loading steps whose start_load_kv began with front-mover jobs (stores) queued or running, and the others: their
    # holds and launches side by side (the movers' Python competes with vLLM's thread for the GIL; older traces: none)
    out["beside_stores"] = {k: {"start_load_ms": _dist([x["start_load_ms"] for x in g]),
                                "launch_ms": _dist([x["launch_ms"] for x in g if x.get("launch_ms") is not None])}
                            for k, g in (("busy", [x for x in loading if x.get("front_jobs")]),
                                         ("idle", [x for x in loading if x.get("front_jobs") == 0]))}
    fwd = forward_times(lines)
    # a loading step: its forward waits for in-step loads; a recomputing one: a prefill without them (a step that
    # only starts asynchronous loads computes beside them, and counts here)
    waits = [x for x in mine if x["in_step"]["loads"] and "launch_ms" in x]
    recompute = [x for x in mine if not x["in_step"]["loads"] and (x.get("tokens") or 0) >= PREFILL_LINE_TOKENS]
    by_step = {(x.get("_src"), x.get("step")): x for x in (sched or ())}
    out["steps"] = {"loading": _forwards(waits, fwd, by_step), "recompute": _forwards(recompute, fwd, by_step)}
    out["steps_by_tokens"] = by_tokens(waits, recompute, fwd, by_step)
    return out


def by_tokens(loading: list[dict], recompute: list[dict], fwd: dict[tuple, float],
              sched: dict[tuple, dict] | None = None) -> dict[str, dict]:
    """The ``BY_TOKENS`` most frequent step sizes (scheduled tokens, in buckets of ``BY_TOKENS_BUCKET``) of a phase's
    loading and recomputing steps, each ``{"loading": ..., "recompute": ...}`` as ``_forwards`` gives them: a loading
    step against a step of the same size without loads (the same start's, or ``tiered-resident``'s: the floor's
    steps), keyed by the bucket's first size as a string ("160": 160-175 tokens); ties go to the smaller size."""
    bucket = lambda x: x["tokens"] // BY_TOKENS_BUCKET * BY_TOKENS_BUCKET  # noqa: E731
    counts: dict[int, int] = {}
    for x in loading + recompute:
        if x.get("tokens") is not None:
            counts[bucket(x)] = counts.get(bucket(x), 0) + 1
    top = sorted(counts, key=lambda b: (-counts[b], b))[:BY_TOKENS]
    pick = lambda steps, b: [x for x in steps if x.get("tokens") is not None and bucket(x) == b]  # noqa: E731
    return {str(b): {"loading": _forwards(pick(loading, b), fwd, sched),
                     "recompute": _forwards(pick(recompute, b), fwd, sched)} for b in sorted(top)}


def _steps_text(s: dict) -> str:
    parts = []
    for kind, v in (s.get("steps") or {}).items():
        if v.get("n"):
            tl = (v.get("timeline") or {}).get("sched_ms", {})
            parts.append(f"{kind} {v['n']} steps: tokens p50 {v['tokens'].get('p50')}, launch p50 "
                         f"{v['launch_ms'].get('p50')} ms, GPU forward p50 {v['gpu_fwd_ms'].get('p50')} ms"
                         + (f", scheduled to applied p50 {tl['p50']} ms (schedule "
                            f"{v['timeline']['schedule_ms'].get('p50')}, to worker "
                            f"{v['timeline']['to_worker_ms'].get('p50')}, worker "
                            f"{v['timeline']['worker_ms'].get('p50')}, after {v['timeline']['after_ms'].get('p50')})"
                            if tl.get("n") else ""))
    return (" | " + "; ".join(parts)) if parts else ""


def _stores_part(b: dict | None) -> str:
    """`` | beside stores n: start_load_kv p50 x, launch p50 y ms; without n: ...`` where both kinds of step ran."""
    if not b or not b["busy"]["start_load_ms"].get("n") or not b["idle"]["start_load_ms"].get("n"):
        return ""
    part = lambda g: (f"{g['start_load_ms']['n']}: start_load_kv p50 {g['start_load_ms'].get('p50')}, "  # noqa: E731
                      f"launch p50 {g['launch_ms'].get('p50')} ms")
    return f" | beside stores {part(b['busy'])}; without {part(b['idle'])}"


def line(mode: str, phase: str, s: dict) -> str:
    """One printable line of a phase's trace summary."""
    i, a, h = s["in_step"], s["async"], s["start_load_ms"]
    return (f"[{mode}] {phase:>6} trace: {s['loading_steps']} loading steps | in-step {i['loads']} loads "
            f"{i['bytes'] / 1e9:.2f} GB gpu p50 {i['gpu_ms'].get('p50')} ms | async {a['loads']} loads "
            f"{a['bytes'] / 1e9:.2f} GB gpu p50 {a['gpu_ms'].get('p50')} ms host p50 {a['host_ms'].get('p50')} ms | "
            f"start_load_kv p50 {h.get('p50')} max {h.get('max')} ms"
            + (f" | between layers p50 {s['forward_submit_ms'].get('p50')} max {s['forward_submit_ms'].get('max')} ms"
               if s.get("forward_submit_ms", {}).get("n") else "")
            + (f" | staged in {s['staged_steps']} steps" if s.get("staged_steps") else "")
            + (f" | SM kernel in {s['sm_steps']} steps" if s.get("sm_steps") else "")
            + (f" | staging allocated in {s['staging_alloc_steps']['n']} steps (start_load_kv "
               f"{s['staging_alloc_steps']['start_load_ms']} ms)" if s.get("staging_alloc_steps", {}).get("n") else "")
            + _stores_part(s.get("beside_stores"))
            + (f" | steps >= {BIG_STEP_BYTES / 1e9:g} GB in-step: {s['big_step_hold_gbps']['n']}, held the thread "
               f"for bytes / {s['big_step_hold_gbps']['p50']} GB/s (p50)" if s.get("big_step_hold_gbps", {}).get("n")
               else "")
            + _steps_text(s))
