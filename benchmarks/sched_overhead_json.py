"""Collect ``benchmarks/sched_overhead_runs.sh`` sets into one results JSON (``docs/results/sched_overhead_*.json``).

Each set is the ``.jsonl`` the script wrote (one ``RESULT`` line per run, modes alternating) with its ``.log``
header line beside it (date, host, clock). Per set and mode the JSON holds the runs, their median, the
median against ``none``, and the paired median: the median over repetitions of ``mode / none`` within the
same repetition, which cancels the box's slow drifts (the script prints the same numbers).

Sets run with ``SCHED_CALIB=1`` carry each run's box speed (``calib_us``: ``benchmarks/probes/box_speed.py``'s
fixed piece of work, timed beside every step of the run). Their summary adds the same figures over the *quiet*
runs only: those whose ``calib_us`` is within ``QUIET`` of the set's fastest, so modes are compared at one box
speed (``quiet_*`` keys; a mode with no quiet run has none). Scaling each run by its ``calib_us`` instead
over-corrects: on 2026-11-29 no connector's step went 1,454 -> 1,957-2,015 us while the calibration went 250 ->
443 us (+36% against +77%). ``--table SET.jsonl`` prints a set's table (``sched_overhead_runs.sh`` ends with it).

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

#: a run is quiet when its box speed (``calib_us``) is within this fraction of the set's fastest run's
QUIET = 0.10
TOOL = "/work/shared/tools/sched_overhead.py (vLLM's real Scheduler, 64 x 8,192-token prompts, 32 output tokens)"


def _figures(by: dict[str, list[float]]) -> dict[str, dict]:
    """Per mode: runs, median, median vs ``none`` and paired median vs ``none`` (percent)."""
    base = statistics.median(by["none"])
    reps = min(len(xs) for xs in by.values())
    out = {}
    for mode, xs in by.items():
        med = statistics.median(xs)
        paired = statistics.median(xs[i] / by["none"][i] for i in range(reps))
        out[mode] = {"runs_us_per_step": [round(x, 1) for x in xs], "median_us_per_step": round(med, 1),
                     "median_vs_none_pct": round(100 * (med / base - 1), 1),
                     "paired_median_vs_none_pct": round(100 * (paired - 1), 1)}
    return out


def summarize(rows: list[dict]) -> dict:
    """Runs, median, median vs ``none`` and paired median vs ``none`` (percent) per mode of one set; where every
    run has ``calib_us``, also each mode's ``calib_us``, the set's fastest (``calib_fastest_us``) and the
    ``quiet_`` figures (module docstring)."""
    by: dict[str, list[float]] = {}
    for r in rows:
        by.setdefault(r["mode"], []).append(float(r["us_per_step"]))
    if "none" not in by:
        raise SystemExit(f"a set needs the 'none' mode to compare against; it has {sorted(by)}")
    out = _figures(by)
    if rows and all(r.get("calib_us") for r in rows):
        fastest = min(float(r["calib_us"]) for r in rows)
        quiet: dict[str, list[float]] = {}
        for r in rows:
            out[r["mode"]].setdefault("calib_us", []).append(float(r["calib_us"]))
            if float(r["calib_us"]) <= fastest * (1 + QUIET):
                quiet.setdefault(r["mode"], []).append(float(r["us_per_step"]))
        base = statistics.median(quiet["none"]) if "none" in quiet else None
        for mode, xs in quiet.items():
            med = statistics.median(xs)
            out[mode].update(quiet_runs_us_per_step=[round(x, 1) for x in xs], quiet_median_us_per_step=round(med, 1),
                             quiet_median_vs_none_pct=None if base is None else round(100 * (med / base - 1), 1))
        for v in out.values():
            v["calib_fastest_us"] = round(fastest, 1)
    return out


def table(modes: dict) -> str:
    """A markdown table of one set's summary (``summarize``), with the quiet-run columns where it has them."""
    calib = all("calib_us" in v for v in modes.values())
    head = "| mode | runs (us/step) | median | vs none | **paired vs none** |"
    rule = "|---|---|---|---|---|"
    if calib:
        head += " box speed (calib us per run) | quiet runs | median | **vs none** |"
        rule += "---|---|---|---|"
    lines = [head, rule]
    for mode, v in modes.items():
        row = (f"| `{mode}` | {', '.join(f'{x:.0f}' for x in v['runs_us_per_step'])} | {v['median_us_per_step']:.0f} "
               f"| {v['median_vs_none_pct']:+.1f}% | {v['paired_median_vs_none_pct']:+.1f}% |")
        if calib:
            row += f" {', '.join(f'{x:.0f}' for x in v['calib_us'])} |"
            quiet, vs = v.get("quiet_runs_us_per_step"), v.get("quiet_median_vs_none_pct")
            if quiet:
                row += (f" {', '.join(f'{x:.0f}' for x in quiet)} | {v['quiet_median_us_per_step']:.0f} | "
                        f"{'-' if vs is None else f'{vs:+.1f}%'} |")
            else:
                row += " - | - | - |"
        lines.append(row)
    return "\n".join(lines)


def load_set(path: Path) -> dict:
    """One set: its header (from the ``.log`` beside it, if any) and the per-mode summary."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    log = path.with_name(path.name + ".log")
    header = log.read_text().splitlines()[0].lstrip("# ") if log.exists() else ""
    return {"file": path.name, "header": header, "modes": summarize(rows)}


def main(argv: list[str] | None = None) -> int:
    """Write the JSON named by ``--out`` from the ``.jsonl`` sets given, or (``--table``) print each set's table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sets", nargs="+", type=Path, help="sched_overhead_*.jsonl files, one per set")
    ap.add_argument("--table", action="store_true", help="print each set's table and write nothing")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--device", help="the machine, in words")
    ap.add_argument("--code", help="the code measured (branch and commit)")
    ap.add_argument("--command", help="the command that produced the sets")
    ap.add_argument("--date", default="", help="date of the sets (default: from the first set's header)")
    ap.add_argument("--extra", type=Path, help="a JSON file whose object is merged in (e.g. hook times)")
    a = ap.parse_args(argv)
    sets = [load_set(p) for p in a.sets]
    if a.table:
        for st in sets:
            print(table(st["modes"]))
        return 0
    missing = [f"--{k}" for k in ("out", "device", "code", "command") if getattr(a, k) is None]
    if missing:
        ap.error(f"writing the JSON needs {', '.join(missing)} (or --table to print the tables only)")
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
