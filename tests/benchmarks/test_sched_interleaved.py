"""``benchmarks/sched_interleaved.py``: every mode's real vLLM ``Scheduler`` stepped in turn in one process (CPU)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import sched_interleaved as si  # noqa: E402


def _figs(none: float, ours: float, remote: float) -> dict[str, dict]:
    return {"none": {"steps": 95, "cpu_us_per_step": none, "wall_us_per_step": none},
            "tiered": {"steps": 95, "cpu_us_per_step": ours, "wall_us_per_step": ours,
                       "paired_cpu_vs_none_pct": round(100 * (ours / none - 1), 1),
                       "paired_wall_vs_none_pct": round(100 * (ours / none - 1), 1)},
            "remote": {"steps": 95, "cpu_us_per_step": remote, "wall_us_per_step": remote,
                       "paired_cpu_vs_none_pct": round(100 * (remote / none - 1), 1),
                       "paired_wall_vs_none_pct": round(100 * (remote / none - 1), 1)}}


def test_the_rule_is_judged_on_the_median_of_paired_rounds():
    # the box's speed doubles in round 2: unpaired medians would mix speeds, paired ratios do not
    rounds = [_figs(1000.0, 1100.0, 1250.0), _figs(2000.0, 2400.0, 2300.0), _figs(1100.0, 1210.0, 1265.0)]
    s = si.summarize(rounds, ["none", "tiered", "remote"])
    assert s["tiered"]["paired_cpu_vs_none_pct"] == [10.0, 20.0, 10.0]
    assert s["tiered"]["median_paired_cpu_vs_none_pct"] == 10.0 and s["tiered"]["pass"]  # <= 15%
    assert s["remote"]["median_paired_cpu_vs_none_pct"] == 15.0 and s["remote"]["pass"]  # <= 20%
    assert s["none"]["median_cpu_us_per_step"] == 1100.0 and "pass" not in s["none"]
    s = si.summarize([_figs(1000.0, 1200.0, 1300.0)], ["none", "tiered", "remote"])
    assert not s["tiered"]["pass"] and not s["remote"]["pass"]
    assert "**over 15%**" in si.table(s) and "**over 20%**" in si.table(s)


def test_one_real_round_steps_every_mode_through_the_same_workload(tmp_path):
    drivers = si.run_round(["none", "null", "tiered"], si._model_dir(str(tmp_path)), seed=0, order_seed=1)
    steps = {m: len(d.cpu) for m, d in drivers.items()}
    # 64 prompts of 8,192 tokens at 8,256 tokens a step, then 31 decode steps: the same schedule in every mode
    assert steps["none"] > si.OUT_TOK and len(set(steps.values())) == 1, steps
    assert all(t > 0 for d in drivers.values() for t in d.cpu)
    conn = drivers["tiered"].s.connector
    st = conn.stats()
    assert type(conn).__name__ == "TieredKVConnector" and st["sched_lookups"] == si.NREQ
    assert st["sched_store_chunks"] == si.NREQ * si.PROMPT // 256 and st["tracked_requests"] == 0  # 256-token chunks
    figs = si.round_figures(drivers)
    assert set(figs) == {"none", "null", "tiered"} and "paired_cpu_vs_none_pct" in figs["tiered"]
    assert figs["tiered"]["paired_steps"] == steps["none"] and figs["tiered"]["connector"]["sched_lookups"] == si.NREQ


def test_unknown_modes_and_a_remote_mode_without_a_cluster_are_refused(tmp_path):
    with pytest.raises(SystemExit, match=r"unknown mode\(s\) \['lmcache'\]"):
        si.main(["--modes", "none,lmcache", "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match="needs a Redis Cluster"):
        si.main(["--modes", "tiered,remote", "--remote-url", "", "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match="configure the 'remote' mode"):
        si.main(["--modes", "tiered", "--start-cluster", "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


def test_main_writes_the_json_it_prints(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert si.main(["--modes", "none,tiered", "--rounds", "1", "--out", str(out), "--device", "ci"]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "sched_interleaved" and doc["device"] == "ci" and len(doc["rounds"]) == 1
    assert doc["summary"]["tiered"]["bound_pct"] == 15.0
    assert f"{doc['summary']['tiered']['median_paired_cpu_vs_none_pct']:+.1f}%" in capsys.readouterr().out
