"""benchmarks/serving/plot.py on the committed H200 result files (no GPU, no vLLM)."""
from __future__ import annotations

import glob
import importlib.util
import statistics

import pytest

from benchmarks.serving import plot

RESULTS = sorted(glob.glob("docs/results/serve_bench_*_h200.json"))


def test_curves_are_the_summaries_ttft_medians_by_concurrency():
    by_shape = plot.load(RESULTS)
    assert {"llama3-8b", "qwen2.5-7b"} <= set(by_shape)
    cur = plot.curves(by_shape["llama3-8b"]["summary"])
    # ours: the files' starts of the copy-engine default (``tiered`` = in_step_copy auto has none yet)
    assert set(cur) >= {"none", "offloading", "tiered-copyengine"}
    for mode, pts in cur.items():
        assert [c for c, *_ in pts] == [1, 8, 32], (mode, pts)  # warm left out, sorted by concurrency
        for _, med, lo, hi in pts:
            assert lo <= med <= hi
    # every point is the median over the file's engine starts of that phase's TTFT p50, recomputed here from
    # the raw starts (so the test follows whichever H200 run docs/results holds)
    starts = by_shape["llama3-8b"]["starts"]
    for mode in ("tiered-copyengine", "offloading"):
        raw = [ph["ttft_ms"]["p50"] for st in starts if st["mode"] == mode and st.get("status") == "ok"
               for rep in st["repeats"] for ph in rep["phases"] if ph["name"] == "c32" and not ph.get("truncated")]
        assert raw, mode
        assert dict((c, m) for c, m, _, _ in cur[mode])[32] == pytest.approx(statistics.median(raw), abs=0.01)
        lo_hi = [(lo, hi) for c, _, lo, hi in cur[mode] if c == 32][0]
        assert lo_hi == pytest.approx((min(raw), max(raw)), abs=0.01)

@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib not installed (.[bench])")
def test_one_png_with_a_panel_per_shape(tmp_path, capsys):
    out = tmp_path / "img" / "ttft.png"
    assert plot.main([*RESULTS, "--out", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width = int.from_bytes(data[16:20], "big")
    assert width >= 2 * 5 * 120  # two panels side by side
    printed = capsys.readouterr().out
    assert "llama3-8b" in printed and "qwen2.5-7b" in printed and "wrote" in printed


def test_default_modes_are_the_ones_a_reader_compares():
    by_shape = plot.load(RESULTS)
    default = plot.drawn_modes(by_shape, plot.DEFAULT_MODES)
    assert {"none", "offloading", "tiered-copyengine", "tiered-staged"} <= set(default) <= set(plot.DEFAULT_MODES)
    everything = plot.drawn_modes(by_shape, None)
    assert set(default) < set(everything)  # the result files hold variants (tiered-staged, -v1runner, ...)
    assert plot.drawn_modes(by_shape, ("tiered-staged",)) == ["tiered-staged"]
