"""``benchmarks/sched_overhead_json.py``: the results JSON of ``sched_overhead_runs.sh`` sets (runs on the CPU)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from sched_overhead_json import main, summarize, table  # noqa: E402


def _rows(runs: dict[str, list[float]]) -> list[dict]:
    reps = len(next(iter(runs.values())))
    return [{"mode": m, "steps": 95, "us_per_step": xs[i]} for i in range(reps) for m, xs in runs.items()]


def test_medians_and_paired_medians():
    s = summarize(_rows({"none": [1000.0, 2000.0, 1100.0], "ours": [1100.0, 2100.0, 1320.0]}))
    assert s["none"]["median_us_per_step"] == 1100.0 and s["none"]["paired_median_vs_none_pct"] == 0.0
    assert s["ours"]["runs_us_per_step"] == [1100.0, 2100.0, 1320.0]
    assert s["ours"]["median_vs_none_pct"] == 20.0  # 1320 / 1100
    assert s["ours"]["paired_median_vs_none_pct"] == 10.0  # ratios 1.10, 1.05, 1.20


def test_a_set_without_none_is_refused():
    with pytest.raises(SystemExit, match="needs the 'none' mode"):
        summarize(_rows({"ours": [1.0]}))


def test_main_writes_one_json_for_several_sets(tmp_path):
    paths = []
    for i, ours in enumerate(([1100.0, 1150.0], [1200.0, 1250.0])):
        p = tmp_path / f"sched_overhead_2026112{i}T000000Z.jsonl"
        p.write_text("".join(json.dumps(r) + "\n" for r in _rows({"none": [1000.0, 1000.0], "ours": ours})))
        (tmp_path / (p.name + ".log")).write_text(f"# 2026-11-2{i}T00:00:00Z host=vm cpus=2 clock=thread\n")
        paths.append(str(p))
    extra = tmp_path / "extra.json"
    extra.write_text(json.dumps({"hooks": {"sum_us_per_step": 108.0}}))
    out = tmp_path / "out.json"
    assert main(["--out", str(out), "--device", "cpu-box", "--code", "main at x", "--command", "c",
                 "--extra", str(extra), *paths]) == 0
    doc = json.loads(out.read_text())
    assert doc["date"] == "2026-11-20" and doc["hooks"] == {"sum_us_per_step": 108.0}
    assert [s["modes"]["ours"]["paired_median_vs_none_pct"] for s in doc["sets"]] == [12.5, 22.5]
    assert doc["sets"][1]["header"].startswith("2026-11-21T00:00:00Z host=vm")


def test_sets_with_a_box_speed_also_compare_the_quiet_runs():
    """``SCHED_CALIB=1`` sets: the runs at (within 10% of) the set's fastest box speed, compared alone. Here the box
    ran two of ours' three rounds at half speed (calibration 200 us against 100): raw, ours is +120%; quiet, +10%."""
    rows = [{"mode": "none", "us_per_step": 1000.0, "calib_us": 100.0},
            {"mode": "ours", "us_per_step": 1100.0, "calib_us": 105.0},
            {"mode": "none", "us_per_step": 1000.0, "calib_us": 109.0},
            {"mode": "ours", "us_per_step": 2200.0, "calib_us": 200.0},
            {"mode": "none", "us_per_step": 1000.0, "calib_us": 100.0},
            {"mode": "ours", "us_per_step": 2200.0, "calib_us": 200.0}]
    s = summarize(rows)
    assert s["ours"]["median_vs_none_pct"] == 120.0 and s["ours"]["paired_median_vs_none_pct"] == 120.0
    assert s["ours"]["calib_us"] == [105.0, 200.0, 200.0] and s["ours"]["calib_fastest_us"] == 100.0
    assert s["none"]["quiet_runs_us_per_step"] == [1000.0] * 3 and s["ours"]["quiet_runs_us_per_step"] == [1100.0]
    assert s["ours"]["quiet_median_vs_none_pct"] == 10.0 and s["none"]["quiet_median_vs_none_pct"] == 0.0
    text = table(s)
    assert "| `ours` | 1100, 2200, 2200 | 2200 | +120.0% | +120.0% | 105, 200, 200 | 1100 | 1100 | +10.0% |" in text
    # no quiet run of none: nothing to compare the quiet runs with
    slow_none = summarize([dict(r, calib_us=300.0) if r["mode"] == "none" else r for r in rows])
    assert slow_none["ours"]["quiet_median_vs_none_pct"] is None and "quiet_runs_us_per_step" not in slow_none["none"]
    assert "| `none` | 1000, 1000, 1000 | 1000 | +0.0% | +0.0% | 300, 300, 300 | - | - | - |" in table(slow_none)
    # a set without box speeds has no quiet columns
    plain = summarize([{k: v for k, v in r.items() if k != "calib_us"} for r in rows])
    assert "quiet_median_us_per_step" not in plain["ours"] and "quiet" not in table(plain)


def test_table_mode_prints_and_writing_needs_its_arguments(tmp_path, capsys):
    p = tmp_path / "sched_overhead_20261129T000000Z.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in _rows({"none": [1000.0], "ours": [1200.0]})))
    assert main(["--table", str(p)]) == 0
    assert "| `ours` | 1200 | 1200 | +20.0% | +20.0% |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "o.json"), str(p)])
    assert "needs --device, --code, --command" in capsys.readouterr().err
