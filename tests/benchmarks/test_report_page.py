"""benchmarks/report_page.py: docs/benchmarks.md, benchmarks/probes/README.md and the README's highlights are
what the generator writes from docs/results/*.json (no GPU, no engine), every results file belongs to one
scenario, and the results page stays short."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from benchmarks import report_page
from benchmarks.results_page import results as results_mod
from benchmarks.results_page.results import Result, load
from benchmarks.results_page.scenarios import SCENARIOS, Scenario
from scripts.doc_blocks import names, sync

ROOT = report_page.ROOT
PAGE = ROOT / "docs" / "benchmarks.md"


def test_regenerating_the_tables_and_highlights_changes_nothing(capsys):
    assert report_page.main(["--check"]) == 0, capsys.readouterr().out


def test_the_results_page_is_short_and_every_scenario_has_its_block():
    text = PAGE.read_text()
    assert len(text.splitlines()) < 400
    pages = {s.page for s in SCENARIOS}
    on_pages = {n for p in pages for n in names((ROOT / p).read_text())}
    assert {report_page.PREFIX + s.name for s in SCENARIOS} <= on_pages
    assert report_page.PREFIX + "highlights" in names((ROOT / "README.md").read_text())


#: every page the scenarios write to under docs/ (the main page and the multi-GPU one)
DOC_PAGES = sorted({ROOT / s.page for s in SCENARIOS if s.page.startswith("docs/")})


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda p: p.name)
def test_every_generated_table_names_its_result_files(page):
    text = page.read_text()
    for m in re.finditer(r"<!-- generated:(results:[\w-]+)[^\n]*-->\n(.*?)<!-- /generated", text, re.S):
        assert "Source: [`" in m.group(2), m.group(1)
        for name in re.findall(r"\]\(results/([^)]+\.json)\)", m.group(2)):
            assert (ROOT / "docs" / "results" / name).is_file(), name


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda p: p.name)
def test_the_page_links_resolve(page):
    text = page.read_text()
    for target in re.findall(r"\]\(([^)#]+?)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (page.parent / target).exists(), target


def test_a_stale_table_is_found(tmp_path):
    for rel in sorted({s.page for s in SCENARIOS} | {"README.md"}):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    page = tmp_path / "docs/benchmarks.md"
    text = page.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| **tiered_kv disk tier** |"))
    cell = row.split(" | ")[1]  # the write column: "median (rounds)"
    page.write_text(text.replace(row, row.replace(f"| {cell} |", f"| 1.40{cell[cell.index(' '):]} |", 1)))
    diffs = sync(report_page.wanted(root=tmp_path), report_page.PREFIX, check=True)
    assert len(diffs) == 1 and "1.40" in diffs[0] and "docs/benchmarks.md" in diffs[0]


def test_a_results_file_must_belong_to_exactly_one_scenario(tmp_path):
    doc = {"date": "2026-12-01", "device": "NVIDIA H200", "command": "python3 benchmarks/newbench.py"}
    stray = Result(tmp_path / "newbench_2026-12-01_h200.json", doc)
    with pytest.raises(ValueError, match="newbench_2026-12-01_h200.json: no scenario"):
        report_page.claims(load() + [stray])
    twice = SCENARIOS + (Scenario("copy", ("disk_bench_*.json",), lambda rs: ""),)
    with pytest.raises(ValueError, match="disk_bench_.*scenarios disk, copy"):
        report_page.claims(load(), twice)


def test_a_new_scenario_renders_from_its_file_alone(tmp_path):
    """What the docstring's recipe builds: a renderer, a registry entry, a file; date, device and command
    come from the JSON."""
    path = tmp_path / "newbench_2026-12-01_h200.json"
    path.write_text(json.dumps({"date": "2026-12-01T10:00:00Z", "device": "NVIDIA H200",
                                "command": "python3 benchmarks/newbench.py", "cells": [["llama3-8b", "c8", "pass"]]}))

    def newbench(rs: list[Result]) -> str:
        rows = [c for r in rs for c in r.doc["cells"]]
        return results_mod.table(["shape", "workload", "tiered"], rows) + "\n" + results_mod.source(rs)

    (r,) = results_mod.load(tmp_path)
    assert (r.date, r.device, r.command) == ("2026-12-01", "NVIDIA H200", "python3 benchmarks/newbench.py")
    claimed = report_page.claims([r], (Scenario("newbench", ("newbench_*.json",), newbench),))
    out = newbench(claimed["newbench"])
    assert "| llama3-8b | c8 | pass |" in out and "(2026-12-01); NVIDIA H200; `python3 benchmarks/newbench.py`" in out


def test_files_saved_without_their_facts_get_them_from_the_name_or_the_notes():
    by = {r.name: r for r in load()}
    sharing = by["disk_sharing_bench_2026-11-23_cpu-box.json"]  # saved without its command: RECORDED has it
    assert (sharing.date, sharing.device) == ("2026-11-23", "2-core CPU box") and "disk_sharing" in sharing.command
    assert "4 x H200" in by["neighbor_probe_2026-11-28_h200x4.json"].device
    assert all(r.command != "?" and r.date != "?" for r in by.values()), [r.name for r in by.values()
                                                                           if "?" in (r.command, r.date)]


def test_the_step_cost_row_adds_the_best_box_speed_comparison_where_a_set_has_it(tmp_path):
    """``SCHED_CALIB=1`` sets (``sched_overhead_json.summarize``): the row adds the comparison over the runs at the
    set's best box speed; older sets render as before."""
    from benchmarks.results_page.scenarios import TIERED, sched
    from benchmarks.sched_overhead_json import summarize

    rows = [{"mode": m, "us_per_step": us, "calib_us": c} for m, us, c in
            (("none", 1000.0, 100.0), (TIERED, 1100.0, 100.0), ("none", 1000.0, 100.0), (TIERED, 2200.0, 200.0))]
    sets = [{"file": "a.jsonl", "header": "2026-11-29T13:17:00Z host=vm clock=thread", "modes": summarize(rows)},
            {"file": "b.jsonl", "header": "2026-11-23T20:22:00Z host=vm clock=thread",
             "modes": summarize([{k: v for k, v in r.items() if k != "calib_us"} for r in rows])}]
    text = sched(Result(tmp_path / "sched_overhead_2026-11-29_cpu-box.json", {"sets": sets}))
    calibrated, plain = [line for line in text.splitlines() if line.startswith("| 13:17") or line.startswith("| 20:22")]
    assert "at the best box speed +10.0% (1 run)" in calibrated and "+65.0%" in calibrated  # paired: 1.1, 2.2
    assert "best box speed" not in plain


def test_the_replica_memory_table_shows_private_and_shared_pages_per_replica(tmp_path):
    from benchmarks.results_page import scenarios

    start = {"mode": "tiered-pool", "run": 0, "status": "ok", "pool_shm_bytes": 16 * 2**30,
             "replica_memory": [{"rss_anon_bytes": 3 * 2**30, "rss_shmem_bytes": 16 * 2**30, "rss_bytes": 19 * 2**30,
                                 "processes": 2}] * 2}
    doc = {"shape": "llama3-8b_rr2", "replicas": 2, "starts": [start, {"mode": "none", "run": 0, "status": "ok"}]}
    text = scenarios.replica_memory_table([Result(tmp_path / "serve_bench_llama3-8b_2026-12-01_h200x2-rr2.json", doc)])
    rows = [line for line in text.splitlines() if line.startswith("| Llama-3-8B")]
    assert rows == ["| Llama-3-8B | **ours, one host pool (`cpu_pool`)** | 0 | 3.00 / 16.00, 3.00 / 16.00 | 16.00 |"]
    assert scenarios.replica_memory_table([Result(tmp_path / "x.json", {**doc, "starts": doc["starts"][1:]})]) == ""


def test_the_tp_highlight_survives_a_missing_mode_and_an_empty_file(tmp_path):
    """The TP row reads the file it is given: without the no-connector mode it says "-" there, with no results at all
    it still renders, and a TP=1 MLA run beside does not stand for "once for all ranks"."""
    from benchmarks.results_page import highlights

    real = json.loads((ROOT / "docs/results/envelope_2026-11-29_h200x2-tp2.json").read_text())
    name = "envelope_2026-12-01_h200x2-tp2.json"
    no_none = {**real, "results": [x for x in real["results"] if x["mode"] != "none"]}
    row = highlights.tensor_parallel([Result(tmp_path / name, no_none)])
    assert row is not None and "no connector - ms" in row[3] and "of `OffloadingConnector`" in row[2]
    tp1 = {**real["results"][-1], "shape": "dsv2-lite", "mode": "tiered", "knobs": {"tp": 1},
           "stored_bytes_per_conversation": 999e6}
    row = highlights.tensor_parallel([Result(tmp_path / name, {**real, "results": real["results"] + [tp1]})])
    assert "999.0 MB" not in row[2] and "254.8 MB" in row[2]
    empty = highlights.tensor_parallel([Result(tmp_path / name, {**real, "results": []})])
    assert empty[0].startswith("TP=1")


def test_the_peers_bytes_per_conversation_keep_every_layer():
    """`OffloadingConnector`'s column: every layer of the prefix (Gemma-2: 42 layers x 8 KV heads x 256 x K and V,
    bf16 = 344,064 bytes a token), where ours keeps the window layers' window only; unknown shapes: no figure."""
    from benchmarks.serving.shapes import every_layer_bytes

    assert every_layer_bytes("gemma2", 12288) == 344064 * 12288
    assert round(2**30 / every_layer_bytes("gemma2", 12288), 3) == 0.254
    assert every_layer_bytes("no-such-shape", 8192) is None and every_layer_bytes("gemma2", None) is None


def _call_start(mode: str, call, c8: float | None, status: str = "ok") -> dict:
    phases = [] if c8 is None else [{"name": "c8", "concurrency": 8, "ttft_ms": {"p50": c8, "p90": c8, "p99": c8},
                                     "itl_ms": {"p50": 5.0}, "output_tok_s": 1000.0, "errors": 0}]
    return {"mode": mode, "run": 0, "status": status, "call": call, "repeats": [{"seed": 0, "phases": phases}]}


def test_paired_ratio_sets_a_mode_against_the_floor_of_its_own_call():
    """Per call with both modes: median of the mode's starts over the median of the floor's; the median over calls.
    A call without the floor, a start without ``call`` (merged before calls were recorded) or not ok, count for
    nothing."""
    from benchmarks.results_page.highlights import paired_ratio

    doc = {"starts": [_call_start("none-resident", 0, 40.0), _call_start("tiered", 0, 60.0),
                      _call_start("tiered", 0, 64.0), _call_start("none-resident", 1, 50.0),
                      _call_start("tiered", 1, 55.0), _call_start("tiered", 2, 99.0),
                      _call_start("none-resident", None, 10.0), _call_start("tiered", None, 500.0),
                      _call_start("none-resident", 3, 1.0, status="skipped"), _call_start("tiered", 3, 80.0)]}
    got, calls = paired_ratio(doc, "tiered", "none-resident", "c8")
    assert calls == 2 and got == pytest.approx((62.0 / 40.0 + 55.0 / 50.0) / 2)  # a pooled median says 62/40
    assert paired_ratio(doc, "tiered", "none-resident", "c32") is None
    assert paired_ratio(doc, "tiered-staged", "none-resident", "c8") is None


def test_the_floor_highlight_sets_each_mode_against_the_floor_of_its_own_call(tmp_path):
    """Issue 31's row: ours' TTFT against the floor's of the same call, per phase, from each ``*-floor`` file; a file
    without a floor run gives no part, and no floor anywhere no row."""
    from benchmarks.results_page import highlights

    name = "serve_bench_llama3-8b-floor_2026-12-01_h200-compile.json"
    real = json.loads((ROOT / "docs" / "results" / name).read_text())
    s = real["summary"]
    row = highlights.serve_floor([Result(tmp_path / name, real)])
    c8, n8 = highlights.paired_ratio(real, "tiered-staged", "none-resident", "c8")
    c32, n32 = highlights.paired_ratio(real, "tiered-staged", "none-resident", "c32")
    want = f"every copy staged ({s['tiered-staged']['starts_ok']}): "
    assert want in row[2] and f"**{c8:.2f}x / {c32:.2f}x** (calls: {n8} / {n32})" in row[2]
    assert "the floor: Llama-3-8B" in row[3]
    legacy = {**real, "starts": [{k: v for k, v in st.items() if k != "call"} for st in real["starts"]]}
    old_row = highlights.serve_floor([Result(tmp_path / name, legacy)])  # no calls recorded: the pooled medians
    pooled = s["tiered-staged"]["phases"]["c8"]["ttft_p50_ms"]["median"] / s["none-resident"]["phases"]["c8"][
        "ttft_p50_ms"]["median"]
    assert f"= {pooled:.2f}x / " in old_row[2] and "no call recorded" in old_row[2] and "**-" not in old_row[2]
    no_floor = {**real, "summary": {k: v for k, v in s.items() if k != "none-resident"}}
    assert highlights.serve_floor([Result(tmp_path / name, no_floor)]) is None
    assert highlights.serve_floor([]) is None
    older = Result(tmp_path / name.replace("2026-12-01", "2026-11-30"), no_floor)  # the same shape, an older file
    row2 = highlights.serve_floor([older, Result(tmp_path / name, real)])
    assert row2[2] == row[2] and row2[3].count("Llama-3-8B") == 1
