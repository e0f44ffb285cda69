"""Summary over engine starts, the printed tables, the JSON files and the TTFT-vs-concurrency plot.

A result file holds ``starts``: one record per engine start (mode, run index, status, start-up
seconds, and per repeat of the workload its phases' numbers). ``summarize`` pools the samples of
each (mode, phase) over starts, from one file or several (``--plot-from`` merges calls), and gives
min / median / max of each number. Greedy equality: every request's output ids are hashed; a
request is compared with the same request (same workload, seed, phase, user, turn) in mode
``none``.

Threading contract: pure functions plus file writes; main thread only.
"""
from __future__ import annotations

import json
import os
import statistics
from collections import defaultdict

from .modes import BUILTIN  # relative: this module is imported as serving.report and as benchmarks.serving.report

#: the peers a ``tiered*`` mode is compared with in the ratio table, and the issue's goals
PEERS = ("offloading", "lmcache", "none")
#: the mode whose GPU cache holds the whole history (benchmarks/serving/modes.py): the engine's floor
FLOOR = "none-resident"
GOAL_TTFT_VS_PEER = 0.7
GOAL_TOKS_VS_PEER = 1.1
#: name suffix of the modes on vLLM's V1 model runner (modes.py); they are compared with the same runner's
#: floor and peers where those ran (``tiered-v1runner`` against ``offloading-v1runner``)
RUNNER_SUFFIX = "-v1runner"
#: the floor on each runner; their greedy outputs also stand in for ``none``'s where a call ran no ``none``
#: (the same engine and prompts, only a larger GPU cache)
FLOOR_MODES = (FLOOR, FLOOR + RUNNER_SUFFIX)
#: where a call ran neither ``none`` nor the floor, greedy outputs are compared with this peer's of the
#: same call (vLLM's own connector: its outputs matched ``none``'s wherever both ran), labelled as such
GREEDY_PEER = "offloading"


#: the built-in modes with the floor's GPU cache
RESIDENT_BUILTINS = tuple(name for name, (_, settings, _) in BUILTIN.items() if settings.get("gpu_resident"))


def is_resident(mode: str, summary: dict | None = None) -> bool:
    """A mode given the floor's GPU cache (``gpu_resident`` in ``serving/modes.py``): its summary says so (starts
    record it since 2026-12-01); older files, and a name alone, by the built-in modes with that setting and the
    modes defined from them (``none-resident``, ``tiered-resident``, ...)."""
    if summary is not None and "resident" in summary.get(mode, {}):
        return summary[mode]["resident"]
    return any(mode == b or mode.startswith(b + "-") for b in RESIDENT_BUILTINS)


def counterpart(summary: dict, mode: str, base: str) -> str | None:
    """The mode named ``base`` on the same model runner as ``mode``, if it ran (else ``base`` if it ran)."""
    if mode.endswith(RUNNER_SUFFIX) and base + RUNNER_SUFFIX in summary:
        return base + RUNNER_SUFFIX
    return base if base in summary else None


def spread(values: list[float]) -> dict | None:
    """min / median / max (None without values)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"min": round(min(vals), 3), "median": round(statistics.median(vals), 3), "max": round(max(vals), 3),
            "n": len(vals)}


def _phase_samples(starts: list[dict]):
    """Yield (mode, start, repeat, phase) for every finished phase of every successful start."""
    for s in starts:
        if s.get("status") != "ok":
            continue
        for rep in s.get("repeats", ()):
            for ph in rep.get("phases", ()):
                yield s["mode"], s, rep, ph


def _greedy_index(starts: list[dict], modes: tuple[str, ...]) -> dict:
    """(workload id, seed, phase, user, turn) -> output hash, from the starts of ``modes``."""
    idx = {}
    for mode, s, rep, ph in _phase_samples(starts):
        if mode not in modes:
            continue
        for row in ph.get("rows", ()):
            idx[(s.get("workload_id"), rep["seed"], ph["name"], row[0], row[1])] = row[6]
    return idx


def summarize(starts: list[dict]) -> dict:
    """``{mode: {"startup_s": spread, "failed": n, "phases": {phase: numbers}}}`` over all starts."""
    base = _greedy_index(starts, ("none",))
    floor_base = _greedy_index(starts, FLOOR_MODES)
    peer_base = _greedy_index(starts, (GREEDY_PEER,))
    acc: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    # compared, equal, reference outputs, the requests compared (merged calls may compare one request several times)
    greedy: dict = defaultdict(lambda: defaultdict(lambda: [0, 0, set(), set()]))
    greedy_peer: dict = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    concurrency: dict = {}
    for mode, s, rep, ph in _phase_samples(starts):
        if ph.get("truncated"):
            continue  # a phase cut by the deadline is not a sample
        a = acc[mode][ph["name"]]
        concurrency[ph["name"]] = ph["concurrency"]
        a["ttft_p50_ms"].append(ph["ttft_ms"]["p50"])
        a["ttft_p90_ms"].append(ph["ttft_ms"]["p90"])
        a["ttft_p99_ms"].append(ph["ttft_ms"]["p99"])
        a["itl_p50_ms"].append(ph["itl_ms"]["p50"])
        a["output_tok_s"].append(ph["output_tok_s"])
        a["errors"].append(ph["errors"])  # summed below: a failed request is not a spread
        for k, v in (ph.get("sources") or {}).items():
            a["tokens_" + k].append(v)
        for tier, v in (ph.get("tiers") or {}).items():
            a["tier_" + tier].append(v)
        hooks = (ph.get("worker_time") or {}).get("hook_ms_per_step")
        if hooks is not None:  # our workers' time on vLLM's thread (stats.worker_time; files from 2026-11-29 on)
            a["hook_ms_per_step"].append(hooks)
        if mode != "none":
            g = greedy[mode][ph["name"]]
            for row in ph.get("rows", ()):
                key = (s.get("workload_id"), rep["seed"], ph["name"], row[0], row[1])
                ref = base.get(key)
                if ref is None and mode not in FLOOR_MODES:
                    ref = floor_base.get(key)
                if ref is not None:
                    g[0] += 1
                    g[1] += int(ref == row[6])
                    g[2].add(ref)
                    g[3].add(key)
                elif mode not in FLOOR_MODES and mode != GREEDY_PEER and key in peer_base:
                    gp = greedy_peer[mode][ph["name"]]
                    gp[0] += 1
                    gp[1] += int(peer_base[key] == row[6])
    out = {}
    for mode in mode_order(dict.fromkeys(s["mode"] for s in starts)):
        ms = [s for s in starts if s["mode"] == mode]
        phases = {}
        for name, a in acc.get(mode, {}).items():
            phases[name] = {"concurrency": concurrency[name], **{k: spread(v) for k, v in a.items() if k != "errors"},
                            "errors": sum(a["errors"])}
            if mode != "none":
                cmp_, eq, refs, keys = greedy[mode][name]
                phases[name]["greedy_vs_none"] = {"compared": cmp_, "equal": eq}
                if cmp_:  # how many different outputs the requests compared had in the reference: the check's power
                    phases[name]["greedy_reference_outputs"] = len(refs)
                    phases[name]["greedy_requests"] = len(keys)
                cmp_, eq = greedy_peer[mode][name]
                if cmp_:  # outputs no `none` or floor start shares (calls that ran neither)
                    phases[name]["greedy_vs_peer"] = {"peer": GREEDY_PEER, "compared": cmp_, "equal": eq}
        out[mode] = {"startup_s": spread([s.get("startup_s") for s in ms if s.get("status") == "ok"]),
                     "starts_ok": sum(s.get("status") == "ok" for s in ms),
                     "failed": sum(s.get("status") == "failed" for s in ms),
                     "skipped": sum(s.get("status") == "skipped" for s in ms), "phases": phases}
        if any("gpu_resident" in s for s in ms):  # the floor's GPU cache (``ModeSpec.gpu_resident``; since 2026-12-01)
            out[mode]["resident"] = any(s.get("gpu_resident") for s in ms)
    return out


def weak_greedy(requests: int, distinct: int | None) -> bool:
    """Whether the reference's outputs of the ``requests`` compared are so alike that equal outputs say little:
    fewer ``distinct`` than a quarter of them, from 4 requests on (None: not counted). With dummy weights the
    sliding-window hybrids answer nearly every prompt alike: on 2026-11-30 (H200) gpt-oss gave 1-3 distinct outputs
    to 128 requests, Gemma-2 one, where Llama-3-8B gave 128. The envelope's table uses the same rule."""
    return distinct is not None and (requests or 0) >= 4 and 4 * distinct < requests


def weak_check(requests: int, distinct: int | None) -> str:
    """`` (N distinct outputs: a weak check)`` for the serving table's greedy cell when ``weak_greedy``, else ""."""
    if not weak_greedy(requests, distinct):
        return ""
    return f" ({distinct} distinct output{'s' if distinct != 1 else ''}: a weak check)"


def _med(d: dict | None) -> float | None:
    return None if d is None else d["median"]


def _fmt(d: dict | None, digits: int = 1) -> str:
    if d is None:
        return "-"
    if d["n"] == 1:
        return f"{d['median']:.{digits}f}"
    return f"{d['median']:.{digits}f} [{d['min']:.{digits}f}-{d['max']:.{digits}f}]"


def _k(d: dict | None) -> str:
    if d is None:
        return "-"
    return f"{d['median'] / 1000:.0f}k" if d["median"] >= 10000 else f"{d['median']:.0f}"


def phase_order(summary: dict) -> list[str]:
    """Phase names in run order (warm first), as they appear in the summary."""
    names = list(dict.fromkeys(name for m in summary.values() for name in m["phases"]))
    return [n for n in names if n == "warm"] + [n for n in names if n != "warm"]


def mode_order(modes) -> list[str]:
    """Baseline first, then the peers, ours last (each group by name)."""
    rank = {"none": 0, "offloading": 1, "simple": 2, "lmcache": 3, "tiered": 4}
    return sorted(modes, key=lambda m: (rank.get(m.split("-")[0], 5), m))


def table(summary: dict) -> str:
    """Markdown: one row per phase and mode (median [min-max] over starts), then start-ups and ratios."""
    rows = ["| phase | mode | n | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | ITL p50 ms | output tok/s "
            "| prompt tokens computed / GPU hit / connector | ours per tier | greedy = no connector |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in phase_order(summary):
        for mode, m in summary.items():
            ph = m["phases"].get(name)
            if ph is None:
                continue
            tiers = ", ".join(f"{k[5:]} {_k(v)}" for k, v in ph.items() if k.startswith("tier_")) or "-"
            if ph.get("hook_ms_per_step"):
                tiers += f"; hooks {_fmt(ph['hook_ms_per_step'], 2)} ms/step"
            g, gp = ph.get("greedy_vs_none"), ph.get("greedy_vs_peer")
            greedy = "-" if not g or not g["compared"] else (
                f"{g['equal']}/{g['compared']}" + weak_check(ph.get("greedy_requests", g["compared"]),
                                                             ph.get("greedy_reference_outputs")))
            if gp:
                more = f"{gp['equal']}/{gp['compared']} vs {gp['peer']}"
                greedy = more if greedy == "-" else f"{greedy}; {more}"
            n = f"{(ph['ttft_p50_ms'] or {}).get('n', 0)}" + (f" ({ph['errors']} failed requests)" if ph["errors"] else "")
            label = f"{name} (cold)" if name == "warm" else name
            rows.append(f"| {label} | {mode} | {n} | {_fmt(ph['ttft_p50_ms'])} | {_fmt(ph['ttft_p90_ms'])} "
                        f"| {_fmt(ph['ttft_p99_ms'])} | {_fmt(ph['itl_p50_ms'], 2)} | {_fmt(ph['output_tok_s'], 0)} "
                        f"| {_k(ph.get('tokens_computed'))} / {_k(ph.get('tokens_gpu_hit'))} / "
                        f"{_k(ph.get('tokens_connector_hit'))} | {tiers} | {greedy} |")
    rows += ["", "| mode | starts ok | failed | skipped | start-up s |", "|---|---|---|---|---|"]
    for mode, m in summary.items():
        rows.append(f"| {mode} | {m['starts_ok']} | {m['failed']} | {m['skipped']} | {_fmt(m['startup_s'])} |")
    floor = floor_rows(summary)
    if floor:
        rows += ["", f"Against the engine's floor ({FLOOR}: a GPU KV cache that holds the whole history, so every "
                 "prefix is a GPU hit; no connector can beat it), and what the goal asks (0.7x of offloading's "
                 "TTFT p50) next to that floor:", "",
                 "| phase | mode | TTFT p50 / floor | output tok/s / floor | floor TTFT p50 ms | 0.7x offloading ms |",
                 "|---|---|---|---|---|---|"]
        rows += floor
    ratios = ratio_rows(summary)
    if ratios:
        rows += ["", f"Ours vs each peer (medians; goal at c8/c32: TTFT p50 <= {GOAL_TTFT_VS_PEER}x of offloading "
                 f"and lmcache, output tok/s >= {GOAL_TOKS_VS_PEER}x, never worse than none):", "",
                 "| phase | ours | peer | TTFT p50 ratio | output tok/s ratio | goal met |", "|---|---|---|---|---|---|"]
        rows += ratios
    return "\n".join(rows)


def floor_rows(summary: dict) -> list[str]:
    """One row per (measured phase, mode other than a floor) against the floor on the same model runner."""
    rows = []
    for name in phase_order(summary):
        if name == "warm":
            continue
        for mode in mode_order(summary):
            fl_name = counterpart(summary, mode, FLOOR)
            o = summary[mode]["phases"].get(name)
            if mode in FLOOR_MODES or fl_name is None or o is None:
                continue
            f = summary[fl_name]["phases"].get(name)
            t_f, k_f = (_med(f["ttft_p50_ms"]), _med(f["output_tok_s"])) if f else (None, None)
            t_o, k_o = _med(o["ttft_p50_ms"]), _med(o["output_tok_s"])
            if not t_f or not k_f or None in (t_o, k_o):
                continue
            off_name = counterpart(summary, mode, "offloading")
            off = summary[off_name]["phases"].get(name) if off_name else None
            goal = "-" if off is None or _med(off["ttft_p50_ms"]) is None else f"{GOAL_TTFT_VS_PEER * _med(off['ttft_p50_ms']):.1f}"
            label = mode if fl_name == FLOOR else f"{mode} (vs {fl_name})"
            rows.append(f"| {name} | {label} | {t_o / t_f:.2f}x | {k_o / k_f:.2f}x | {t_f:.1f} | {goal} |")
    return rows


def ratio_rows(summary: dict) -> list[str]:
    """One row per (measured phase, tiered* mode, peer present)."""
    rows = []
    for name in phase_order(summary):
        if name == "warm":
            continue
        for ours, m in summary.items():
            # a resident mode holds the whole history in vLLM's GPU cache: set it against the floor only
            if not ours.startswith("tiered") or is_resident(ours, summary) or name not in m["phases"]:
                continue
            for base in PEERS:
                peer = counterpart(summary, ours, base)
                p = summary[peer]["phases"].get(name) if peer else None
                if p is None:
                    continue
                o = m["phases"][name]
                t_o, t_p = _med(o["ttft_p50_ms"]), _med(p["ttft_p50_ms"])
                k_o, k_p = _med(o["output_tok_s"]), _med(p["output_tok_s"])
                if None in (t_o, t_p, k_o, k_p) or not t_p or not k_p:
                    continue
                tr, kr = t_o / t_p, k_o / k_p
                met = (tr <= 1.0 and kr >= 1.0) if base == "none" else (tr <= GOAL_TTFT_VS_PEER and kr >= GOAL_TOKS_VS_PEER)
                rows.append(f"| {name} | {ours} | {peer} | {tr:.2f}x | {kr:.2f}x | {'yes' if met else 'no'} |")
    return rows


def write_json(path: str, doc: dict) -> str:
    """Write atomically (a reader never sees half a file), compact: a merged file holds every request of every start
    (megabytes), and the checkout travels to the GPU machine under a size cap."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
    os.replace(tmp, path)
    return path


def merge(docs: list[dict]) -> dict[str, dict]:
    """Result files -> one document per shape with every start (each labelled with its device and ``call``: the index
    in ``files`` of the run it came from, None for a merged file's start that had none, so that a mode is set against
    the floor of its own call: sessions differ). Files of several replicas per start (``--replicas N``) merge apart
    from the others, under ``<shape>_rr<N>``."""
    out: dict[str, dict] = {}
    for doc in docs:
        n = doc.get("replicas") or 1
        shape = doc["shape"] if n == 1 or doc["shape"].endswith(f"_rr{n}") else f"{doc['shape']}_rr{n}"
        m = out.setdefault(shape, {"shape": shape, "replicas": n, "devices": [], "dates": [], "files": [], "starts": []})
        # a merged document (devices/dates/files lists) merges again: its starts keep their own device
        m["devices"] = sorted(set(m["devices"]) | set(doc.get("devices") or [doc.get("device", "?")]))
        m["dates"] += doc.get("dates") or [doc.get("date")]
        first = len(m["files"])  # each start's ``call``: its file's index in ``files`` (merged: offset)
        m["files"] += doc.get("files") or [doc.get("path")]
        m["starts"] += [{**s, "device": s.get("device") or doc.get("device"),
                         "call": first + s["call"] if s.get("call") is not None else (None if doc.get("files")
                                                                                        else first)}
                        for s in doc.get("starts", ())]
    for m in out.values():
        m["summary"] = summarize(m["starts"])
    return out


def plot(summary: dict, title: str, path: str) -> str:
    """TTFT p50 (median over starts, bars min-max) vs concurrency, one line per mode; PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    levels: set[int] = set()
    for mode, m in summary.items():
        pts = sorted((ph["concurrency"], ph["ttft_p50_ms"]) for name, ph in m["phases"].items()
                     if name != "warm" and "-" not in name and ph.get("ttft_p50_ms"))
        if not pts:
            continue
        xs = [c for c, _ in pts]
        med = [d["median"] for _, d in pts]
        err = [[d["median"] - d["min"] for _, d in pts], [d["max"] - d["median"] for _, d in pts]]
        ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, label=mode,
                    linewidth=2.2 if mode.startswith("tiered") else 1.4)
        levels |= set(xs)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sorted(levels))
    ax.set_xticklabels([str(c) for c in sorted(levels)])
    ax.set_xlabel("concurrent users (closed loop)")
    ax.set_ylabel("TTFT p50 (ms, log)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
