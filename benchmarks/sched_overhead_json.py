"""Collect ``benchmarks/sched_overhead_runs.sh`` sets into one results JSON (``docs/results/sched_overhead_*.json``).

Each set is the ``.jsonl`` the script wrote (one ``RESULT`` line per run, modes alternating) with its ``.log``
header line beside it (date, host, clock). Per set and mode the JSON holds the runs, their median, the
median against ``none``, and the paired median: the median over repetitions of ``mode / none`` within the
same repetition, which cancels the box's slow drifts (the script prints the same numbers).

Usage::

    python benchmarks/sched_overhead_json.py --out docs/results/sched_overhead_DATE_DEVICE.json \\
        --device "cpu-box (...)" --code "main at abc1234" --command "..." bench_out/sched_overhead_*.jsonl

Threading contract: a script; single-threaded.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

TOOL = "/work/shared/tools/sched_overhead.py (vLLM's real Scheduler, 64 x 8,192-token prompts, 32 output tokens)"


def summarize(rows: list[dict]) -> dict:
    """Runs, median, median vs ``none`` and paired median vs ``none`` (percent) per mode of one set."""
    by: dict[str, list[float]] = {}
    for r in rows:
        by.setdefault(r["mode"], []).append(float(r["us_per_step"]))
    if "none" not in by:
        raise SystemExit(f"a set needs the 'none' mode to compare against; it has {sorted(by)}")
    base = statistics.median(by["none"])
    reps = min(len(xs) for xs in by.values())
    out = {}
    for mode, xs in by.items():
        med = statistics.median(xs)
        paired = statistics.median(xs[i] / by["none"][i] for i in range(reps))
        out[mode] = {"runs_us_per_step": xs, "median_us_per_step": round(med, 1),
                     "median_vs_none_pct": round(100 * (med / base - 1), 1),
                     "paired_median_vs_none_pct": round(100 * (paired - 1), 1)}
    return out


def load_set(path: Path) -> dict:
    """One set: its header (from the ``.log`` beside it, if any) and the per-mode summary."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    log = path.with_name(path.name + ".log")
    header = log.read_text().splitlines()[0].lstrip("# ") if log.exists() else ""
    return {"file": path.name, "header": header, "modes": summarize(rows)}


def main(argv: list[str] | None = None) -> int:
    """Write the JSON named by ``--out`` from the ``.jsonl`` sets given."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sets", nargs="+", type=Path, help="sched_overhead_*.jsonl files, one per set")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", required=True, help="the machine, in words")
    ap.add_argument("--code", required=True, help="the code measured (branch and commit)")
    ap.add_argument("--command", required=True, help="the command that produced the sets")
    ap.add_argument("--date", default="", help="date of the sets (default: from the first set's header)")
    ap.add_argument("--extra", type=Path, help="a JSON file whose object is merged in (e.g. hook times)")
    a = ap.parse_args(argv)
    sets = [load_set(p) for p in a.sets]
    doc = {"bench": "sched_overhead", "date": a.date or sets[0]["header"][:10], "device": a.device,
           "tool": TOOL, "code": a.code, "command": a.command, "sets": sets}
    if a.extra is not None:
        doc.update(json.loads(a.extra.read_text()))
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    for s in sets:
        paired = {m: v["paired_median_vs_none_pct"] for m, v in s["modes"].items() if m != "none"}
        print(s["file"], "paired median vs none (%):", paired)
    return 0


if __name__ == "__main__":
    sys.exit(main())
