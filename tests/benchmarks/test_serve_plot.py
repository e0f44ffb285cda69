"""benchmarks/serving/plot.py on the committed H200 result files (no GPU, no vLLM)."""
from __future__ import annotations

import glob
import importlib.util

import pytest

from benchmarks.serving import plot

RESULTS = sorted(glob.glob("docs/results/serve_bench_*_h200.json"))


def test_curves_are_the_summaries_ttft_medians_by_concurrency():
    by_shape = plot.load(RESULTS)
    assert {"llama3-8b", "qwen2.5-7b"} <= set(by_shape)
    cur = plot.curves(by_shape["llama3-8b"]["summary"])
    assert set(cur) >= {"none", "offloading", "tiered"}
    for mode, pts in cur.items():
        assert [c for c, *_ in pts] == [1, 8, 32], (mode, pts)  # warm left out, sorted by concurrency
        for _, med, lo, hi in pts:
            assert lo <= med <= hi
    # the first H200 run (docs/benchmarks.md): tiered 340.3 ms vs offloading 281.2 ms at c32 on 8B
    assert dict((c, m) for c, m, _, _ in cur["tiered"])[32] == pytest.approx(340.3, abs=0.1)
    assert dict((c, m) for c, m, _, _ in cur["offloading"])[32] == pytest.approx(281.2, abs=0.1)


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
