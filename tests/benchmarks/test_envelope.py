"""benchmarks/envelope.py on the CPU: the plan, GPU cache sizes and the verdict on synthetic results."""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import envelope  # noqa: E402


def _rec(shape, mode, start, turn2, batch=None, tokens=(1, 2), gpu="tight"):
    r = {"shape": shape, "mode": mode, "gpu": gpu, "start": start, "turn2_p50_s": turn2,
         "turn2_tokens": [list(tokens)]}
    if batch is not None:
        r.update(batch_s=batch, batch_tokens=[list(tokens)])
    return r


def test_kv_groups_and_gpu_blocks_follow_vllms_grouping():
    assert envelope.kv_groups("llama3-8b") == 1 and envelope.kv_groups("dsv2-lite") == 1
    assert envelope.kv_groups("gemma2") == 2 and envelope.kv_groups("gpt-oss") == 2
    assert envelope.kv_groups("gemma3") == 7  # 5 full layers: 1 group, 29 window layers: 6 groups of 5
    # Gemma-2 at 1.8 requests of 12,608 tokens: about the 3,000 blocks of the cliff's report
    assert envelope.gpu_blocks("gemma2", 1.8, 12288 + 4 * 64 + 64) == 2836


def test_plan_rotates_modes_per_start():
    p = envelope.plan(["gemma2"], ["none", "offloading", "tiered"], ["tight"], 3)
    assert [m for _, m, _, s in p if s == 0] == ["none", "offloading", "tiered"]
    assert [m for _, m, _, s in p if s == 1] == ["offloading", "tiered", "none"]
    assert len(p) == 9


def test_verdict_passes_fails_and_wants_three_starts():
    results = [_rec("gemma2", "none", 0, 0.5, 5.0), _rec("gemma2", "offloading", 0, 0.1, 1.8),
               _rec("gemma2", "tiered", 0, 0.08, 1.2),
               _rec("x", "none", 0, 0.2, 1.0), _rec("x", "offloading", 0, 0.2, 1.0),
               _rec("x", "tiered", 0, 0.3, 0.99, tokens=(1, 3))]
    rows = {(r["shape"], r["workload"]): r for r in envelope.verdict(results)}
    g = rows[("gemma2", "batch")]
    assert g["pass"] and g["vs_none"] == 0.24 and g["vs_peer"] == round(1.2 / 1.8, 3) and g["greedy_equal"]
    x2 = rows[("x", "turn2")]
    assert not x2["pass"] and "1.50x none" in x2["why"] and "greedy outputs differ" in x2["why"]
    xb = rows[("x", "batch")]
    assert not xb["pass"] and xb.get("wants_3_starts")  # 0.99 s vs 1.0: near the bound with one start
    text = envelope.table({"results": results, "not_runnable": envelope.NOT_RUNNABLE, "skipped": []})
    assert "| gemma2 | batch | tight | 5.000 | 1.800 | 1.200 | 0.24 |" in text
    assert "mamba | all" in text and "supports_divergent_local_hybrid_hits" in text


def test_greedy_tokens_are_compared_within_one_workload():
    """A call with other knobs (N_CONV=8: other follow-up prompts) is not compared with no connector's tokens of
    another workload; within one workload a difference fails the cell."""
    def rec(mode, start, tokens, n_conv):
        return dict(_rec("s", mode, start, 0.1, tokens=tokens), knobs={"n_conv": n_conv, "prefix": 8192})
    other = [rec("none", 0, (1, 2), 10), rec("offloading", 0, (1, 2), 10), rec("tiered", 0, (7, 8), 8)]
    (row,) = envelope.verdict(other)
    assert row["greedy_equal"] is None and row["pass"], row  # nothing of the tiered start's workload to compare
    same = other + [rec("tiered", 1, (1, 2), 10)]
    (row,) = envelope.verdict(same)
    assert row["greedy_equal"] is True, row
    wrong = other + [rec("tiered", 1, (1, 3), 10)]
    (row,) = envelope.verdict(wrong)
    assert row["greedy_equal"] is False and "greedy outputs differ" in row["why"], row


def test_disk_cells_compare_with_the_small_cpu_peer():
    results = [_rec("llama3-8b", "none", 0, 0.22), _rec("llama3-8b", "offloading-small", 0, 0.22),
               _rec("llama3-8b", "tiered-disk", 0, 0.2)]
    (row,) = envelope.verdict(results)
    assert row["workload"] == "disk" and row["pass"] and row["starts"]["tiered-disk"] == 1


def test_merge_keeps_each_calls_name(tmp_path):
    for name, t in (("a", 0.1), ("b", 0.2)):
        (tmp_path / name).mkdir()
        doc = {"results": [_rec("s", "tiered", 0, t)], "skipped": [], "pcie": [], "command": f"cmd {name}",
               "date": "2026-11-28"}
        (tmp_path / name / "envelope.json").write_text(json.dumps(doc))
    out = envelope.merge([str(tmp_path / "a" / "envelope.json"), str(tmp_path / "b" / "envelope.json")])
    assert [r["call"] for r in out["results"]] == ["a", "b"] and out["command"] == "cmd a; cmd b"


def test_unknown_shape_is_refused_with_the_valid_ones(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["envelope.py", "--shapes", "nope", "--dry-run"])
    with pytest.raises(SystemExit, match="unknown shape 'nope'.*gemma2"):
        envelope.main()


def test_serving_cells_are_judged_by_the_same_rule(tmp_path):
    phase = lambda ms, n=1: {"ttft_p50_ms": {"min": ms, "median": ms, "max": ms, "n": n},  # noqa: E731
                             "greedy_vs_none": {"compared": 4, "equal": 4}}
    doc = {"shape": "llama3-8b", "summary": {
        "none": {"phases": {"c8": phase(200.0), "c32": phase(500.0), "c1": phase(40.0)}},
        "offloading": {"phases": {"c8": phase(120.0), "c32": phase(300.0), "c1": phase(50.0)}},
        "tiered": {"phases": {"c8": phase(80.0, 3), "c32": phase(320.0, 3), "c1": phase(52.0, 3)}}}}
    path = tmp_path / "serve_bench_llama3-8b.json"
    path.write_text(json.dumps(doc))
    cells = envelope.serving_cells(str(path))
    rows = {r["workload"]: r for r in envelope.verdict([], cells)}
    assert rows["serving c8"]["pass"] and rows["serving c8"]["vs_peer"] == round(80 / 120, 3)
    assert not rows["serving c32"]["pass"] and "1.07x offloading" in rows["serving c32"]["why"]
    assert rows["serving c8"]["greedy_equal"] is True
    # c1 is judged too: slower than recompute fails however it compares with the peer
    assert not rows["serving c1"]["pass"] and "1.30x none" in rows["serving c1"]["why"], rows["serving c1"]
    assert {c["gpu"] for c in cells} == {"serve"}  # no starts recorded: the file's configuration is the default
    # a file whose starts all ran vLLM's own compilation is another configuration: cells of their own
    doc["starts"] = [{"mode": m, "status": "ok", "graphs": "compile"} for m in ("none", "offloading", "tiered")]
    doc["starts"].append({"mode": "tiered", "status": "skipped"})
    path.write_text(json.dumps(doc))
    assert {c["gpu"] for c in envelope.serving_cells(str(path))} == {"serve, compiled"}
    doc["starts"][0]["graphs"] = "decode"
    path.write_text(json.dumps(doc))
    assert {c["gpu"] for c in envelope.serving_cells(str(path))} == {"serve, mixed graphs"}
    # a file of our own modes only (a control: tails on and off) has nothing to judge ours by: no cells
    doc["summary"] = {"tiered": doc["summary"]["tiered"], "tiered-notail": doc["summary"]["tiered"]}
    path.write_text(json.dumps(doc))
    assert envelope.serving_cells(str(path)) == []


def test_a_serving_cell_near_a_bound_says_how_its_starts_differed_with_nothing_loaded(tmp_path):
    """Round 18's gpt-oss c1 (uncompiled, one start per mode): ours 62.6 ms against no connector's 55.1 fails, and its
    warm phase, where nothing loads, already ran 67.4 against 55.6: the cell's verdict says so, on the results page
    and in the benchmark's own table; a cell that passes clear of the bound says nothing."""
    phase = lambda ms, c=1: {"ttft_p50_ms": {"min": ms, "median": ms, "max": ms, "n": 1}, "concurrency": c}  # noqa
    doc = {"shape": "gpt-oss", "summary": {
        "none": {"phases": {"warm": phase(55.6), "c1": phase(55.1), "c8": phase(60.0, 8)}},
        "offloading": {"phases": {"warm": phase(74.2), "c1": phase(73.6), "c8": phase(80.0, 8)}},
        "tiered": {"phases": {"warm": phase(67.4), "c1": phase(62.6), "c8": phase(62.0, 8)}}}}
    path = tmp_path / "serve_bench_gpt-oss.json"
    path.write_text(json.dumps(doc))
    rows = {r["workload"]: r for r in envelope.verdict([], envelope.serving_cells(str(path)))}
    c1, c8 = rows["serving c1"], rows["serving c8"]
    assert c1["pass"] is False and c1["warm_s"] == pytest.approx({"none": 0.0556, "tiered": 0.0674})
    assert envelope.warm_note(c1) == "; warm phase, nothing loaded: ours 1.21x none"
    # c8 passes near the bound (1.03x, one start) but ran at another concurrency than the warm phase: no note
    assert c8["pass"] and c8.get("wants_3_starts") and "warm_s" not in c8 and envelope.warm_note(c8) == ""
    assert envelope.warm_note({**c1, "pass": None}) == ""  # superseded: not judged
    near = {**c1, "pass": True, "wants_3_starts": True}  # a pass near a bound carries it too
    assert envelope.warm_note(near) == "; warm phase, nothing loaded: ours 1.21x none"
    text = envelope.table({"results": [], "serving": envelope.serving_cells(str(path))})
    assert "FAIL (1.14x none; warm phase, nothing loaded: ours 1.21x none)" in text, text
    del doc["summary"]["none"]["phases"]["warm"]  # a file without the warm phase: no note
    path.write_text(json.dumps(doc))
    (c1,) = [r for r in envelope.verdict([], envelope.serving_cells(str(path))) if r["workload"] == "serving c1"]
    assert envelope.warm_note(c1) == ""


def test_only_the_newest_files_serving_cell_is_judged(tmp_path):
    """Two files measured the same shape, c1 and GPU cache: the older (slower than recompute: fails) is superseded by
    the newer (passes), neither pass nor fail; a compiled file's cell is another configuration, judged on its own."""
    phase = lambda ms: {"ttft_p50_ms": {"min": ms, "median": ms, "max": ms, "n": 3}}  # noqa: E731

    def write(name, ours_ms, graphs=None, **date):
        doc = {"shape": "llama3-8b", **date, "summary": {m: {"phases": {"c1": phase(ms)}} for m, ms in
                                                          (("none", 40.0), ("offloading", 50.0), ("tiered", ours_ms))}}
        if graphs:
            doc["starts"] = [{"mode": m, "status": "ok", "graphs": graphs} for m in ("none", "offloading", "tiered")]
        (tmp_path / name).write_text(json.dumps(doc))
        return envelope.serving_cells(str(tmp_path / name))

    # the newer file first on the command line: the date decides, not the order
    new = write("serve_bench_new.json", 39.0, dates=["2026-11-29T08:00:00Z", "2026-11-30T11:54:14Z"])
    old = write("serve_bench_old.json", 52.0, date="2026-11-29T10:00:00Z")
    compiled = write("serve_bench_compiled.json", 60.0, graphs="compile", date="2026-11-28T09:00:00Z")
    assert new[0]["date"] == "2026-11-30T11:54:14Z" and old[0]["date"] == "2026-11-29T10:00:00Z"
    rows = {(r["source"], r["gpu"]): r for r in envelope.verdict([], new + old + compiled)}
    newer, older = rows[("serve_bench_new.json", "serve")], rows[("serve_bench_old.json", "serve")]
    assert newer["pass"] is True and "superseded_by" not in newer, newer
    assert older["pass"] is None and older["superseded_by"] == "serve_bench_new.json", older
    assert older["why"] == "superseded by serve_bench_new.json" and older["vs_none"] == 1.3  # ratios still shown
    other = rows[("serve_bench_compiled.json", "serve, compiled")]
    assert other["pass"] is False and "superseded_by" not in other and "1.50x none" in other["why"], other
    text = envelope.table({"results": [], "serving": new + old + compiled, "not_runnable": {}, "skipped": []})
    assert "| superseded (superseded by serve_bench_new.json) |" in text and text.count("| FAIL (") == 1, text
    # no date counts as oldest; same date: the later file on the command line wins
    undated = write("serve_bench_undated.json", 39.0)
    (row, _, _) = envelope.verdict([], undated + old + compiled)
    assert row["superseded_by"] == "serve_bench_old.json", row
    again = write("serve_bench_again.json", 39.0, date="2026-11-29T10:00:00Z")
    first, second = envelope.verdict([], old + again)
    assert first["superseded_by"] == "serve_bench_again.json" and second["pass"] is True
    # a newer file without no connector's starts (ours and the peer only) does not replace a cell judged against it
    tails = write("serve_bench_tails.json", 39.0, date="2026-11-30T12:00:00Z")
    tails[0]["median_s"].pop("none")
    kept, judged = envelope.verdict([], old + tails)
    assert kept["pass"] is False and "superseded_by" not in kept and judged["pass"] is True


def test_rank_rates_read_each_ranks_trace_in_the_window(tmp_path):
    base = str(tmp_path / "trace")
    for rank, (b, ms) in enumerate(((2e9, 50.0), (2e9, 40.0))):
        with open(f"{base}.rank{rank}.jsonl", "w") as f:
            f.write(json.dumps({"t": 100.0, "landed": [{"bytes": b, "gpu_ms": ms}]}) + "\n")
            f.write(json.dumps({"t": 500.0, "landed": [{"bytes": 9e9, "gpu_ms": 1.0}]}) + "\n")  # outside
    assert envelope.rank_rates(base, 99.0, 101.0) == {"0": 40.0, "1": 50.0}


def _batch(mode, start, tokens, margins=None):
    r = {"shape": "g", "mode": mode, "gpu": "tight", "start": start, "turn2_p50_s": 0.1,
         "turn2_tokens": [[1, 1]], "batch_s": 1.0, "batch_tokens": [list(t) for t in tokens]}
    if margins is not None:
        r["batch_margins"] = margins
    return r


def test_a_greedy_difference_names_the_requests_and_passes_only_where_the_control_differs_too():
    """The batch's greedy check says which requests differ and no connector's first-token margin there; where the
    ``none-chunked`` control (recompute in 2,048-token pieces) flips the same requests, bf16 decided, not a load."""
    none = _batch("none", 0, [(1, 1), (2, 2), (3, 3)], margins=[2.5, 0.0625, 1.0])
    ours = _batch("tiered", 0, [(1, 1), (9, 9), (3, 3)])
    base = [none, _batch("offloading", 0, [(1, 1), (2, 2), (3, 3)]), ours]
    rows = {r["workload"]: r for r in envelope.verdict(base)}
    b = rows["batch"]
    assert b["differs_at"] == [1] and b["none_margins_there"] == [0.0625]
    assert not b["pass"] and "at request(s) [1] (no control run)" in b["why"], b
    other = base + [_batch("none-chunked", 0, [(1, 1), (2, 2), (4, 4)])]  # the control flips request 2 only
    b = {r["workload"]: r for r in envelope.verdict(other)}["batch"]
    assert not b["pass"] and b["control_differs_at"] == [2] and "control differs at [2]" in b["why"], b
    same = base + [_batch("none-chunked", 0, [(1, 1), (9, 9), (3, 3)])]
    b = {r["workload"]: r for r in envelope.verdict(same)}["batch"]
    assert b["pass"] and b["greedy_explained"] == "control" and b["greedy_equal"] is False, b
    text = envelope.table({"results": same, "not_runnable": {}, "skipped": []})
    assert "no at [1], as the none-chunked control" in text


def test_a_difference_where_no_connectors_top_two_tie_is_rounding_not_a_load():
    """No connector's first token at request 1 ties with the runner-up (margin 0.0): greedy takes whichever rounding
    favours, so ours answering the other of the two passes; a token outside that pair, or a margin above 0 in any
    start of no connector, still fails."""
    none = _batch("none", 0, [(1, 1), (2, 2), (3, 3)], margins=[2.5, 0.0, 1.0])
    none["batch_top2"] = [[1, 5], [2, 9], [3, 4]]
    ours = _batch("tiered", 0, [(1, 1), (9, 9), (3, 3)])
    base = [none, _batch("offloading", 0, [(1, 1), (2, 2), (3, 3)]), ours]
    b = {r["workload"]: r for r in envelope.verdict(base)}["batch"]
    assert b["pass"] and b["ties_at"] == [1] and b["greedy_explained"] == "tie", b
    text = envelope.table({"results": base, "not_runnable": {}, "skipped": []})
    assert "no at [1], where no connector's top two tie (margin 0)" in text
    outside = [none, ours | {"batch_tokens": [[1, 1], [7, 7], [3, 3]]}]
    b = {r["workload"]: r for r in envelope.verdict(outside)}["batch"]
    assert not b["pass"] and b["ties_at"] == [], b
    second = _batch("none", 1, [(1, 1), (2, 2), (3, 3)], margins=[2.5, 0.0039, 1.0])
    b = {r["workload"]: r for r in envelope.verdict(base + [second])}["batch"]
    assert not b["pass"] and "greedy outputs differ at request(s) [1]" in b["why"], b


def test_first_top2_orders_the_two_likeliest_ids():
    from types import SimpleNamespace as NS
    lp = {5: NS(logprob=-0.5), 9: NS(logprob=-0.2), 3: NS(logprob=-4.0)}
    assert envelope.first_top2(NS(outputs=[NS(logprobs=[lp])])) == [9, 5]
    assert envelope.first_top2(NS(outputs=[NS(logprobs=[{1: NS(logprob=0.0)}])])) is None


def test_first_margin_reads_vllms_top_two_logprobs():
    from types import SimpleNamespace as NS
    lp = {5: NS(logprob=-0.25), 7: NS(logprob=-1.5)}
    assert envelope.first_margin(NS(outputs=[NS(logprobs=[lp, {}])])) == 1.25
    assert envelope.first_margin(NS(outputs=[NS(logprobs=None)])) is None


def test_the_control_mode_prefills_in_smaller_pieces_with_no_connector():
    w = envelope.knobs("llama3-8b")
    kw = envelope.engine_kwargs("llama3-8b", "none-chunked", "tight", w, "/m", None)
    assert kw["max_num_batched_tokens"] == envelope.CONTROL_CHUNK and "kv_transfer_config" not in kw
    assert envelope.engine_kwargs("llama3-8b", "none", "tight", w, "/m", None)["max_num_batched_tokens"] > 8192


def test_turn2_compares_every_conversations_first_token_where_both_recorded_them():
    none = dict(_rec("t", "none", 0, 0.2), turn2_tokens_all=[5, 6, 7])
    same_two = dict(_rec("t", "tiered", 0, 0.1), turn2_tokens_all=[5, 6, 9])  # the first two agree, the third not
    (row,) = envelope.verdict([none, same_two])
    assert row["greedy_equal"] is False and row["differs_at"] == [2], row
    old = _rec("t", "tiered", 1, 0.1)  # a start from before round 5: only the first two conversations' tokens
    (row,) = envelope.verdict([none, old])
    assert row["greedy_equal"] is True, row


def test_usable_bytes_count_mla_once_and_other_kv_per_rank():
    """MLA's ranks hold the same latent KV (``replicated``): a conversation's usable bytes are one rank's, while a
    sharded model's are every rank's (the TP=2 MLA run once reported half of what it stored as usable)."""
    from types import SimpleNamespace

    from tiered_kv.connector.vllm.geometry import Geometry

    def usable(replicated: bool) -> int:
        geo = Geometry(block_size=16, chunk_blocks=16, layer_names=("l0", "l1"), rank_block_nbytes=4096, tp_size=2,
                       tag="t", replicated=replicated)
        sched = SimpleNamespace(connector=SimpleNamespace(geo=geo))
        llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(
            engine_core=SimpleNamespace(scheduler=sched))))
        out = envelope._stored_per_conversation(llm, 1024)
        assert out["chunk_tokens"] == 256
        return out["usable_bytes_per_conversation"]

    one_rank = (1024 // 256) * 16 * 4096
    assert usable(True) == one_rank
    assert usable(False) == 2 * one_rank


def test_a_greedy_yes_over_outputs_that_hardly_differ_says_it_is_weak():
    """Dummy weights make the sliding-window hybrids answer nearly every prompt alike: equal outputs then say little,
    and the table says so (fewer distinct outputs than a quarter of the requests, from 4 requests on)."""
    alike = [{"turn2_tokens_all": [[7, 8]] * 9 + [[7, 9]]}, {"turn2_tokens_all": [[7, 8]] * 10}]
    assert envelope.greedy_outputs(alike, "turn2_tokens") == [2, 10]  # the start whose outputs differ most
    assert envelope.greedy_outputs([{"batch_tokens": [[i, 1] for i in range(10)]}], "batch_tokens") == [10, 10]
    assert envelope.greedy_outputs([{}], "batch_tokens") is None
    row = {"greedy_equal": True, "greedy_outputs": [2, 10]}
    assert envelope.greedy_text(row) == "yes (weak: 2 distinct of 10 outputs)"
    assert envelope.greedy_text({**row, "greedy_outputs": [3, 10]}) == "yes"  # a quarter or more: the check has power
    assert envelope.greedy_text({**row, "greedy_outputs": [1, 3]}) == "yes"  # too few requests to tell
    assert envelope.greedy_text({**row, "greedy_equal": False}) == "NO"  # a difference is a difference
    assert envelope.greedy_text({"greedy_equal": True}) == "yes"  # files without the count


def test_a_refold_names_its_serving_files_once():
    old = "python benchmarks/envelope.py --shapes a; python benchmarks/envelope.py --table t.json --serving x.json"
    got = envelope.refold_command(old, ["--table", "t.json", "--serving", "x.json", "y z.json"])
    assert got == ("python benchmarks/envelope.py --shapes a; "
                   "python benchmarks/envelope.py --table t.json --serving x.json 'y z.json'")
