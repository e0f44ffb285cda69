"""TTFT p50 vs concurrency, one panel per model shape, from ``serve_bench`` result files.

Usage (CPU machine; needs matplotlib: ``pip install -e '.[bench]'``)::

    python3 benchmarks/serving/plot.py                       # docs/results/serve_bench_*_h200.json
    python3 benchmarks/serving/plot.py a.json b.json --out docs/img/serve_ttft_vs_concurrency.png

Files of the same shape are merged (every engine start of every call counts), as
``serve_bench.py --plot-from`` does; each panel shows, per mode, the median over starts of the
phase's TTFT p50 with bars from the smallest to the largest start. Our modes (``tiered*``) are
drawn thicker, the engine's floor (``none-resident``) dashed. By default only the modes a reader
compares (``DEFAULT_MODES``: no connector, the floor, the two peers, our default, its two in-step copy
mechanisms and ``adaptive``)
are drawn; ``--modes all`` or a comma list draws others. Prints what it drew.

Threading contract: a script; main thread only.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from benchmarks.serving import report  # noqa: E402

DEFAULT_GLOB = "docs/results/serve_bench_*_h200.json"
DEFAULT_OUT = "docs/img/serve_ttft_vs_concurrency.png"
#: panel order: the issue's shapes first, anything else after
SHAPE_ORDER = ("llama3-8b", "qwen2.5-7b", "qwen2.5-32b")
#: the modes drawn unless ``--modes`` says otherwise, each with its own colour in every panel
DEFAULT_MODES = ("none", "none-resident", "offloading", "lmcache", "tiered", "tiered-copyengine", "tiered-staged",
                 "tiered-adaptive")


def curves(summary: dict) -> dict[str, list[tuple[int, float, float, float]]]:
    """Per mode: ``(concurrency, median, min, max)`` of TTFT p50 in ms, by concurrency (warm and repeated
    phases left out)."""
    out = {}
    for mode, m in summary.items():
        pts = sorted((ph["concurrency"], ph["ttft_p50_ms"]) for name, ph in m.get("phases", {}).items()
                     if name != "warm" and "-" not in name and ph.get("ttft_p50_ms"))
        if pts:
            out[mode] = [(c, d["median"], d["min"], d["max"]) for c, d in pts]
    return out


def drawn_modes(by_shape: dict[str, dict], modes: tuple[str, ...] | None) -> list[str]:
    """The modes present in any panel that ``modes`` selects (None: all), sorted by name."""
    present = sorted({mode for doc in by_shape.values() for mode in doc["summary"]})
    return [m for m in present if modes is None or m in modes]


def draw(by_shape: dict[str, dict], path: str, modes: tuple[str, ...] | None = DEFAULT_MODES) -> str:
    """One panel per shape (``report.merge`` documents), the modes in ``modes`` (None: all); writes the PNG
    and returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    shapes = sorted(by_shape, key=lambda s: (SHAPE_ORDER.index(s) if s in SHAPE_ORDER else len(SHAPE_ORDER), s))
    # one colour per mode in every panel
    colors = {mode: f"C{i % 10}" for i, mode in enumerate(drawn_modes(by_shape, modes))}
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.2 * len(shapes), 4.4), dpi=120, squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        doc = by_shape[shape]
        levels: set[int] = set()
        for mode, pts in curves(doc["summary"]).items():
            if mode not in colors:
                continue
            xs = [p[0] for p in pts]
            med = [p[1] for p in pts]
            err = [[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]]
            ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, label=mode, color=colors[mode],
                        linewidth=2.4 if mode.startswith("tiered") else 1.3,
                        linestyle="--" if mode.startswith(report.FLOOR) else "-")
            levels |= set(xs)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}" if str(v)[0] in "25" else ""))
        if levels:
            ax.set_xticks(sorted(levels))
            ax.set_xticklabels([str(c) for c in sorted(levels)])
        per_mode: dict[str, int] = {}
        for st in doc["starts"]:
            if st.get("status") == "ok" and st["mode"] in colors:
                per_mode[st["mode"]] = per_mode.get(st["mode"], 0) + 1
        lo, hi = min(per_mode.values(), default=0), max(per_mode.values(), default=0)
        starts = f"{lo}" if lo == hi else f"{lo}-{hi}"
        ax.set_title(f"{shape}\n({', '.join(doc['devices'])}; {starts} engine start(s) per mode)", fontsize=10)
        ax.set_xlabel("concurrent users (closed loop)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("TTFT p50, ms (log): median over starts, bars min-max")
    dates = sorted({d[:10] for doc in by_shape.values() for d in doc["dates"] if d})
    fig.suptitle(f"vllm serve, multi-turn users: TTFT vs concurrency ({', '.join(dates)})", fontsize=11)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def load(paths: list[str]) -> dict[str, dict]:
    """Read result files (``path`` recorded in each) and merge them by shape."""
    docs = []
    for p in paths:
        with open(p) as f:
            doc = json.load(f)
        doc["path"] = p
        docs.append(doc)
    return report.merge(docs)


def main(argv: list[str] | None = None) -> int:
    """Command line: files (default: every H200 result in docs/results) -> one PNG."""
    ap = argparse.ArgumentParser(description="TTFT p50 vs concurrency per mode, one panel per model shape")
    ap.add_argument("files", nargs="*", help=f"serve_bench JSON files (default: {DEFAULT_GLOB})")
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"PNG to write (default: {DEFAULT_OUT})")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES),
                    help="comma-separated modes to draw, or 'all' (default: %(default)s)")
    a = ap.parse_args(argv)
    modes = None if a.modes == "all" else tuple(m.strip() for m in a.modes.split(",") if m.strip())
    files = a.files or sorted(glob.glob(DEFAULT_GLOB))
    if not files:
        ap.error(f"no result files given and none match {DEFAULT_GLOB}")
    by_shape = load(files)
    for shape, doc in by_shape.items():
        for mode, pts in curves(doc["summary"]).items():
            print(f"{shape:12s} {mode:16s} " + "  ".join(f"c{c}: {m:.1f} ms [{lo:.1f}-{hi:.1f}]"
                                                         for c, m, lo, hi in pts))
    print(f"wrote {draw(by_shape, a.out, modes)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
