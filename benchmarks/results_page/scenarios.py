"""The results page's scenarios: one renderer per kind of result file, and the registry ``SCENARIOS``.

A renderer takes the ``Result``s its patterns matched (sorted by file name) and returns the Markdown
that goes between ``<!-- generated:results:NAME -->`` and ``<!-- /generated:results:NAME -->`` in
docs/benchmarks.md: one or more fixed-format tables, each followed by its ``source()`` line (file,
date, device, command). Every number comes from the files; labels and column names are the only text.
How to add one: ``benchmarks/report_page.py``'s docstring.

Threading contract: pure functions; main thread only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from benchmarks.results_page.results import Result, each, median, num, ratio, source, spread, table
from benchmarks.serving import report as serve_report
from benchmarks.serving.shapes import every_layer_bytes


@dataclass(frozen=True)
class Scenario:
    """A section's generated block: ``name`` in the markers, the result files it shows, how to draw them,
    and the page it goes on (the one-time probes' answers go next to the probes)."""

    name: str
    patterns: tuple[str, ...]  # fnmatch globs over the file names in docs/results/
    render: Callable[[list[Result]], str]
    page: str = "docs/benchmarks.md"  # the file holding its markers, from the repo root


# ------------------------------------------------------------------------------------ serving load
SHAPES = {"llama3-8b": "Llama-3-8B", "qwen2.5-7b": "Qwen2.5-7B", "qwen2.5-32b": "Qwen2.5-32B", "gpt-oss": "gpt-oss-20b",
          "gemma2": "Gemma-2-9B", "gemma3": "Gemma-3-4B", "dsv2-lite": "DeepSeek-V2-Lite"}
#: the modes the serving table shows, in order, with their labels (the other modes stay in the files)
SERVE_MODES = {"none": "no connector", "none-resident": "the floor (`none-resident`)",
               "offloading": "`OffloadingConnector`", "lmcache": "LMCache", "tiered": "**ours, `auto` (default)**",
               "tiered-copyengine": "ours, copy engine only", "tiered-staged": "ours, staged only"}
#: what ours is compared with in the same call
SERVE_PEERS = ("offloading", "lmcache", "none-resident")
OURS = "tiered"


def _shape(doc: dict) -> str:
    """A serving file's shape as the tables name it (a replicas run's merged name ``<shape>_rr<N>`` without the
    suffix: its table says it is N replicas)."""
    shape = doc.get("shape", "")
    n = doc.get("replicas") or 1
    shape = shape[:-len(f"_rr{n}")] if n > 1 and shape.endswith(f"_rr{n}") else shape
    return SHAPES.get(shape, shape)


def _shape_key(r: Result) -> tuple[int, str]:
    order = list(SHAPES.values())
    shape = _shape(r.doc)
    return (order.index(shape) if shape in order else len(order), shape)


def _phase(summary: dict, mode: str, phase: str, what: str) -> dict | None:
    return summary.get(mode, {}).get("phases", {}).get(phase, {}).get(what)


def _med(summary: dict, mode: str, phase: str, what: str) -> float | None:
    d = _phase(summary, mode, phase, what)
    return None if d is None else d["median"]


def serve_table(results: list[Result], modes: dict[str, str] = SERVE_MODES) -> str:
    """Per shape and mode (those of ``modes``, with their labels): starts, TTFT p50 and output tok/s at c32 and c8,
    TTFT p50 at c1."""
    rows = []
    for r in sorted(results, key=_shape_key):
        summary, first = r.doc["summary"], True
        for mode, label in modes.items():
            if mode not in summary:
                continue
            cell = lambda p, what, d=1: spread(_phase(summary, mode, p, what), d)  # noqa: E731
            rows.append([_shape(r.doc) if first else "", label,
                         summary[mode]["starts_ok"], cell("c32", "ttft_p50_ms"), cell("c32", "output_tok_s", 0),
                         cell("c8", "ttft_p50_ms"), cell("c8", "output_tok_s", 0), cell("c1", "ttft_p50_ms")])
            first = False
    head = ["shape", "mode", "starts", "c32 TTFT p50 ms", "c32 tok/s", "c8 TTFT p50 ms", "c8 tok/s", "c1 TTFT p50 ms"]
    return table(head, rows)


def same_call(doc: dict, mode: str = OURS) -> tuple[int, dict] | None:
    """The last call that started ``mode``: its run index and the summary of that call's starts alone."""
    ours = [s for s in doc["starts"] if s["mode"] == mode and s.get("status") == "ok"]
    if not ours:
        return None
    last = ours[-1]
    starts = [s for s in doc["starts"] if s["run"] == last["run"] and s.get("code") == last.get("code")]
    return last["run"], serve_report.summarize(starts)


def same_call_table(results: list[Result], ours: str = OURS, peers: tuple[str, ...] = SERVE_PEERS,
                    modes: dict[str, str] = SERVE_MODES) -> str:
    """``ours`` against each of ``peers`` started in the same call (one start each): TTFT p50 and tok/s, c32 and
    c8."""
    rows = []
    for r in sorted(results, key=_shape_key):
        call = same_call(r.doc, ours)
        if call is None:
            continue
        run, summary = call
        for peer in peers:
            if peer not in summary:
                continue
            cells = []
            for phase in ("c32", "c8"):
                for what, d in (("ttft_p50_ms", 1), ("output_tok_s", 0)):
                    a, b = _med(summary, ours, phase, what), _med(summary, peer, phase, what)
                    cells.append(f"{num(a, d)} vs {num(b, d)}: {ratio(a, b)}")
            rows.append([_shape(r.doc), run, modes[peer], *cells])
    head = ["shape", "run", "ours vs", "c32 TTFT p50 ms", "c32 tok/s", "c8 TTFT p50 ms", "c8 tok/s"]
    return table(head, rows) if rows else ""


def serve(results: list[Result]) -> str:
    """The serving table, then ours against the peers of its last call (left out where no peer ran beside ours)."""
    results = sorted(results, key=_shape_key)
    same = same_call_table(results)
    return (serve_table(results) + "\n" + source(results) + ("\nOurs (`auto`) against the peers started in the same "
            "call (the last call with an `auto` start; one start each):\n\n" + same if same else ""))


#: the modes of serving runs in other configurations and of controls: ours with stores off is the connector doing
#: nothing; ``none-resident`` of a sliding-window hybrid computes what no connector computes (no floor there)
CONTROL_MODES = {**SERVE_MODES, "none-resident": "`none-resident` (the floor; on the hybrids another no-connector start)",
                 "tiered-nostore": "ours, stores off (`store_policy: none`: nothing stored or loaded)",
                 "tiered-notail": "ours, tail pieces off (`tail_chunks: false`: hits end at a whole chunk)",
                 "tiered-tails": "ours, tail pieces on sliding-window hybrids too (`tail_chunks: true`)",
                 "tiered-fe": "ours, stores copied from the forward's end (`store_start: forward_end`, the old order)",
                 "tiered-hold": "ours, stores held to the next step without the sleep kernel (code c7aee46)",
                 "tiered-ewma": "ours, the load floor an average of the loading steps (code up to c0a1cbb)",
                 "tiered-ce": "ours, `auto` up to round 23 (a step's 1.2 GB copy on the copy engine; code up to "
                              "3c4e0e9, or `in_step_staged_min_descriptors: 0`)",
                 "tiered-cex": "ours, every in-step copy on the copy engine (`in_step_copy: copy_engine`)",
                 "tiered-up": "ours, every layer group submitted before the forward (`load_submit: upfront`)",
                 "tiered-staged": "ours, every in-step copy staged (`in_step_copy: staged`)",
                 "tiered-smk": "ours, every in-step copy through the SM kernel (`in_step_copy: sm_kernel`)",
                 "tiered-resident": "ours beside the floor's GPU cache (nothing leaves the GPU: nothing loads)",
                 "tiered-g1": "ours, a step's copy in one layer group before the forward (`load_groups: 1`, "
                              "`load_ahead_bytes: 2GiB`)",
                 "tiered-g2": "ours, a step's copy in two layer groups before the forward (`load_groups: 2`, "
                              "`load_ahead_bytes: 2GiB`)"}


def serve_configs(results: list[Result]) -> str:
    """The serving table with the control modes (no same-call comparison: these runs answer a question each)."""
    results = sorted(results, key=_shape_key)
    return serve_table(results, CONTROL_MODES) + "\n" + source(results)


#: the tail-piece runs (rounds 14-15): their ``tiered`` starts ran with pieces on sliding-window hybrids, the default
#: then; ``auto`` has left them off there since (docs/vllm.md, "Tail pieces")
TAIL_MODES = {**CONTROL_MODES, "tiered": "ours, tail pieces on (`tail_chunks: true`; the default in these rounds)",
              "tiered-notail": "ours, tail pieces off (`tail_chunks: false`, as `auto` since: hits end at a whole chunk)"}


def serve_tails(results: list[Result]) -> str:
    """The serving table of the tail-piece runs, their modes named for what they ran."""
    results = sorted(results, key=_shape_key)
    return serve_table(results, TAIL_MODES) + "\n" + source(results)


#: the round-robin replica runs' modes (issue 33): every mode is one engine per GPU, its counters summed
REPLICA_MODES = {"none": "no connector", "offloading": "`OffloadingConnector`, one per replica",
                 "tiered": "ours, a private CPU tier per replica", "tiered-pool": "**ours, one host pool (`cpu_pool`)**"}


def serve_replicas(results: list[Result]) -> str:
    """Replicas behind a round-robin router: the serving table of their modes, then the host pool against each
    other mode of its last call."""
    results = sorted(results, key=_shape_key)
    out = (serve_table(results, REPLICA_MODES) + "\n" + source(results) + "\nOne host pool against the others "
           "started in the same call:\n\n" + same_call_table(results, "tiered-pool", ("tiered", "offloading", "none"),
                                                               REPLICA_MODES))
    memory = replica_memory_table(results)
    return out + ("\nEach replica's resident memory at the end of its workload (private pages / shared pages, GiB; "
                  "the pool's pages count in every replica that touched them, once in /dev/shm):\n\n" + memory
                  if memory else "")


def replica_memory_table(results: list[Result]) -> str:
    """Per start that recorded it: each replica's RssAnon / RssShmem (its server's process group) and the host
    pool's bytes in /dev/shm; empty when no start did."""
    gib = lambda b: num(b / 2**30, 2)  # noqa: E731
    rows = [[_shape(r.doc), REPLICA_MODES.get(s["mode"], s["mode"]), s["run"],
             ", ".join("-" if m is None else f"{gib(m['rss_anon_bytes'])} / {gib(m['rss_shmem_bytes'])}"
                       for m in s["replica_memory"]),
             gib(s["pool_shm_bytes"]) if s.get("pool_shm_bytes") else "-"]
            for r in results for s in r.doc["starts"] if s.get("replica_memory")]
    return table(["shape", "mode", "run", "per replica: private / shared GiB", "host pool in /dev/shm GiB"],
                 rows) if rows else ""


def serve_shared(results: list[Result]) -> str:
    """The serving table alone (calls of several engines at once pair nothing)."""
    results = sorted(results, key=_shape_key)
    return serve_table(results) + "\n" + source(results)


# ------------------------------------------------------------------------ single-request turn-2 TTFT
MODELS = {**SHAPES, "gpt-oss": "gpt-oss-20b shape", "dsv2-lite": "DeepSeek-V2-Lite (MLA)",
          "gemma3": "Gemma-3-4B (7 KV cache groups)"}
TTFT_MODES = ("none", "floor", "offloading", "simple", "tiered-cpu")


def ttft_floor_table(results: list[Result]) -> str:
    """Item 2: per model and mode, turn-2 TTFT over engine starts against floor_s (hit bytes / PCIe + floor)."""
    rows = []
    for r in results:
        it = r.doc["item2"]
        floor = (f"{num(it['copy_s'] * 1e3)} + {num(it['floor_ttft_s'] * 1e3)} = {num(it['floor_s'] * 1e3)} ms "
                 f"({num(it['hit_bytes'] / 1e9, 3)} GB at {num(it['pcie_h2d_ceiling_gbps'], 2)} GB/s)")
        for mode, m in it["modes"].items():
            rows.append([MODELS.get(r.doc["model"], r.doc["model"]), floor, mode, m["starts"],
                         " / ".join(num(m[k] * 1e3) for k in ("min_s", "median_s", "max_s")),
                         f"{m['ratio']:.2f}" if "ratio" in m else "-",
                         f"{m['spread']:.2f}" if m.get("spread") is not None else "- (1 start)"])
            floor = ""
    head = ["model", "floor_s = copy + floor mode", "mode", "starts", "turn-2 ms: min / median / max of starts",
            "median / floor_s (goal <= 1.3)", "spread max/min (goal <= 1.2)"]
    return table(head, rows)


def ttft_modes_table(results: list[Result]) -> str:
    """Per model: each mode's turn-2 median (one start each), ours over vLLM's connector, bytes per hit token."""
    rows = []
    for r in results:
        by = {x["mode"]: x for x in r.doc["results"]}
        cells = [num(by[m]["turn2_median_s"] * 1e3) if m in by else "-" for m in TTFT_MODES]
        ours, peer = by.get("tiered-cpu"), by.get("offloading")
        others = [f"{m} {num(x['turn2_median_s'] * 1e3)}" for m, x in by.items() if m not in TTFT_MODES]
        later = r.doc.get("later_session")
        if later:
            others += [f"later session: {x['mode']} {num(x['turn2_median_s'] * 1e3)}" for x in later["results"]]
        rows.append([MODELS.get(r.doc["model"], r.doc["model"]), *cells,
                     ratio(ours and ours["turn2_median_s"], peer and peer["turn2_median_s"]),
                     num(ours.get("bytes_per_hit_token"), 0) if ours else "-", "; ".join(others) or "-"])
    head = ["model", *(f"{m} ms" for m in TTFT_MODES), "tiered-cpu / offloading", "B per hit token", "other modes, ms"]
    return table(head, rows)


def vllm_ttft_split(results: list[Result]) -> str:
    """Issue 32 item 2 beyond the 8k disk row: per run (a longer prefix, another slow tier), each mode's turn-2
    median (one start each), the split against min(recompute, load all), and the split's floor at its reads' rate."""
    rows = []
    for r in results:
        w = r.doc["workload"]
        size = f"{w['prefix']:,} x {w['n_conv']}, CPU tier {w['disk_cpu_gib']} GiB"
        for tier, o in (r.doc.get("overlap") or {}).items():
            floor = (f"{num(o['floor_s'] / o['recompute_s'], 3)}x at {num(o['read_gbps'], 2)} GB/s"
                     if o.get("floor_s") else "-")
            rows.append([r.doc["model"], size, tier, num(o["recompute_s"] * 1e3),
                         num(o["load_all_s"] * 1e3), num(o["overlap_s"] * 1e3), f"{o['ratio']:.3f}x", floor])
        if not r.doc.get("overlap"):  # a lone split start (no recompute beside it): its time and where it read
            for x in r.doc["results"]:
                if x["mode"].endswith("-overlap"):
                    rows.append([r.doc["model"], size, f"{x['mode'].split('-')[1]} at {w['disk_path']}", "-", "-",
                                 num(x["turn2_median_s"] * 1e3), "-", f"- (hit rate {x['turn2_hit_rate']:.1%})"])
    head = ["model", "prefix tokens x conversations", "slow tier", "none (recompute) ms", "load all ms", "split ms",
            "split / min(both) (goal <= 0.8)", "the split's floor / recompute"]
    return table(head, rows) + "\n" + source(results)


def vllm_ttft(results: list[Result]) -> str:
    floor = [r for r in results if "item2" in r.doc]
    modes = [r for r in results if "item2" not in r.doc]
    out = ""
    if floor:
        out += ttft_floor_table(floor) + "\n" + source(floor)
    if modes:
        out += ("\n" if out else "") + ttft_modes_table(modes) + "\n" + source(modes)
    return out


# ------------------------------------------------------------------------------------------ the envelope
ENVELOPE_WORK = {"turn2": "turn 2 TTFT p50", "batch": "batch of turn 3 (wall)", "disk": "turn 2 from disk",
                 "serving c8": "serving, c8 TTFT p50", "serving c32": "serving, c32 TTFT p50",
                 "serving c1": "serving, c1 TTFT p50"}


def envelope(r: Result) -> str:
    """The envelope's cells (shape x workload x GPU cache: none, the peer, ours, the ratios, the verdict), the
    cells that did not run, and the bytes each shape stores per conversation."""
    from benchmarks import envelope as env  # the verdict is the benchmark's own

    rows = []
    for v in env.verdict(r.doc["results"], r.doc.get("serving", ())):
        peer, mine = ("offloading-small", "tiered-disk") if v["workload"] == "disk" else ("offloading", "tiered")
        s = lambda m: num(v["median_s"][m], 3) if m in v["median_s"] else "-"  # noqa: E731
        span = v["min_max_s"].get(mine)
        verdict = ("pass" if v["pass"] else f"**FAIL** ({v['why']})" if v["pass"] is False
                   else v["why"])  # None: superseded by a newer file's cell
        if v.get("wants_3_starts"):
            verdict += ", near a bound"
        verdict += env.warm_note(v)
        rows.append([v["shape"], ENVELOPE_WORK.get(v["workload"], v["workload"]), v["gpu"], s("none"), s(peer),
                     f"{s(mine)} [{num(span[0], 3)}-{num(span[1], 3)}]" if span else s(mine),
                     v.get("vs_none", "-"), v.get("vs_peer", "-"),
                     env.greedy_text(v), v["starts"].get(mine, 0), verdict])
    for shape, why in r.doc.get("not_runnable", {}).items():
        rows.append([shape, "all", "-", "-", "-", "-", "-", "-", "-", 0, f"not run: {why}"])
    out = table(["shape", "workload", "GPU cache", "none s", "`OffloadingConnector` s", "ours s [min-max]",
                 "ours / none", "ours / peer", "greedy equal", "starts (ours)", "verdict (<= 1.05x both)"], rows)
    stores = []
    seen = set()
    for x in r.doc["results"]:
        if (x.get("mode") == "tiered" and x.get("stored_vs_usable") and x["shape"] not in seen
                and x.get("knobs", {}).get("tp", 1) == 1):  # TP stores the same bytes, split over ranks
            seen.add(x["shape"])
            every = every_layer_bytes(x["shape"], x.get("knobs", {}).get("prefix"))
            stores.append([x["shape"], num(x["stored_bytes_per_conversation"] / 1e6, 1),
                           num(x["usable_bytes_per_conversation"] / 1e6, 1), num(x["stored_vs_usable"], 3),
                           num(x["conversations_per_gib"], 3), num(2**30 / every, 3) if every else "-"])
    if stores:
        out += "\n" + table(["shape", "stored per conversation MB", "full layers x prefix + window layers x window MB",
                             "ratio (goal <= 1.1)", "conversations per GiB",
                             "`OffloadingConnector`'s (every layer x prefix; from its code, not measured)"], stores)
    tp_shapes = {x["shape"] for x in r.doc["results"] if x.get("knobs", {}).get("tp", 1) > 1}
    ranks = [[x["shape"], x["mode"], x["knobs"].get("tp", 1), x.get("call", "-"), num(x["turn2_p50_s"] * 1e3, 1),
              ", ".join(f"{k}: {num(v, 1)}" for k, v in sorted(x["turn2_rank_gbps"].items())) or "-",
              num(x["stored_bytes_per_conversation"] / 1e6, 1) if x["mode"] == "tiered" else
              (f"disk {num(x['disk_bytes_per_conversation'] / 1e6, 1)}" if "disk_bytes_per_conversation" in x else "-"),
              f"{x['turn1_cached_tokens'][0]:,}" if "restart" in x["mode"] else "-",
              f"{x['counters'].get('sched_hit_tokens_disk', 0):,}" if "disk" in x["mode"] else "-"]
             for x in r.doc["results"] if "turn2_rank_gbps" in x and (x.get("knobs", {}).get("tp", 1) > 1 or (
                 x["shape"] in tp_shapes and "disk_bytes_per_conversation" in x))  # a TP=1 run beside, for its bytes
             and (x["mode"] == "tiered" or "restart" in x["mode"] or "=always" in x["mode"])]
    if ranks:
        out += "\n" + table(["shape", "mode", "TP", "call", "turn 2 p50 ms", "per-rank load GB/s (turn 2)",
                             "stored per conversation MB (all ranks)", "restart: turn 1's first hit tokens",
                             "disk-hit tokens"], ranks)
    return out


def pool_replicas(r: Result) -> str:
    """Replica B's turn 2 per kind of hit (issue 33): a conversation replica A served (through the host pool),
    its own (through the pool, and with a private CPU tier), and recompute; median [min-max] over starts, with B's
    resident memory (private / shared pages, the median over the starts that recorded them: since 2026-11-29)."""
    got: dict[tuple[str, str], list[float]] = {}
    memory: dict[tuple[str, str], list[tuple[int, int]]] = {}  # B's (RssAnon, RssShmem), recorded since 2026-11-29
    for run in r.doc["runs"]:
        b = run["replicas"].get("b", {})
        for kind in ("cross", "own", "recompute"):
            if kind in b:
                order = run.get("b_order", "warm") if run["mode"] == "pool" else "-"
                got.setdefault((f"{run['mode']} / {kind}", order), []).append(b[kind]["p50_s"] * 1e3)
                if "rss_anon_bytes" in b and "rss_shmem_bytes" in b:
                    memory.setdefault((f"{run['mode']} / {kind}", order), []).append(
                        (b["rss_anon_bytes"], b["rss_shmem_bytes"]))
    label = {"pool / cross": "host pool: A's conversation", "pool / own": "host pool: B's own conversation",
             "private / own": "private CPU tier: B's own conversation", "private / recompute": "recompute"}
    shm = max((run["replicas"]["b"].get("pool_shm_bytes", 0) for run in r.doc["runs"] if "b" in run["replicas"]),
              default=0)

    def resident(key: tuple[str, str]) -> str:
        got_memory = memory.get(key)
        if not got_memory:
            return "-"
        return (f"{num(median(a for a, _ in got_memory) / 2**30, 2)} / "
                f"{num(median(sh for _, sh in got_memory) / 2**30, 2)}")

    rows = [[label.get(k, k), order, len(v), spread({"min": min(v), "max": max(v), "median": median(v),
                                                      "n": len(v)}),
             num(shm / 2**30, 2) if k.startswith("pool") else "-", resident((k, order))]
            for (k, order), v in got.items()]
    return table(["replica B's turn 2", "B's order", "starts", "TTFT p50 ms", "one pool in /dev/shm, GiB",
                  "B's private / shared pages, GiB (median)"], rows)


# --------------------------------------------------------------------------------- scheduler step cost
NULL = "benchmarks.probes.null_connector:NullConnector"
TIERED = "tiered_kv.connector.vllm:TieredKVConnector"
REMOTE = "benchmarks.remote_sched_mode:ExtraFromEnvConnector"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:+.1f}%"


def sched(r: Result) -> str:
    """One row per set: each mode's median us per step and its paired median over ``none``."""
    notes = r.doc.get("set_notes", {})
    rows = []
    for s in r.doc["sets"]:
        header = s.get("header", "")
        when = header.split()[0][11:16] if header else "?"
        clock = next((w.split("=", 1)[1] for w in header.split() if w.startswith("clock=")), "?")
        m = s["modes"]

        def cell(k: str) -> str:
            if k not in m:
                return "-"
            out = f"{num(m[k]['median_us_per_step'], 0)}, {_pct(m[k]['paired_median_vs_none_pct'])}"
            quiet = m[k].get("quiet_runs_us_per_step")  # SCHED_CALIB=1 sets: the runs at the set's best box speed
            if quiet and m[k].get("quiet_median_vs_none_pct") is not None:
                out += (f"; at the best box speed {_pct(m[k]['quiet_median_vs_none_pct'])} ({len(quiet)} "
                        f"run{'s' if len(quiet) != 1 else ''})")
            return out

        rows.append([when, clock, notes.get(s["file"], ""), num(m["none"]["median_us_per_step"], 0),
                     cell(NULL), cell(TIERED)])
    head = ["set (UTC)", "clock", "code", "`none` us/step", "`NullConnector` us/step, paired vs none",
            "ours us/step, **paired vs none**"]
    out = table(head, rows)
    hooks = r.doc.get("hooks_ab")
    if hooks:
        out += (f"\nOur hooks' own CPU time per step (`hook_clock.py`, median of {len(hooks['before'])} "
                f"alternating rounds): {num(median(hooks['before']))} us before, {num(median(hooks['after']))} "
                "us after.\n")
    return out


def sched_remote(r: Result) -> str:
    """One row per set: paired medians over ``none`` of the NullConnector, ours, ours with the remote tier."""
    rows = []
    for s in r.doc["sets"]:
        sm = s["summary"]
        paired = lambda k: _pct(sm[k].get("paired_vs_none_pct")) if k in sm else "-"  # noqa: E731
        rows.append([s["name"], s["started_utc"][11:16], s["commit"], s["clock"],
                     num(sm["none"]["median_us_per_step"], 0), paired(NULL), paired(TIERED),
                     f"**{paired(REMOTE)}**", _pct(sm.get("remote_over_ours_per_round_pct"))])
    head = ["set", "UTC", "code", "clock", "`none` us/step", "`NullConnector`", "ours", "ours + remote tier",
            "remote over ours, per round"]
    return table(head, rows)


def sched_interleaved(r: Result) -> str:
    """One row per set of ``benchmarks/sched_interleaved.py``: every mode's paired median over ``none`` (the per-round
    range beside it), the rule's bound where one applies."""
    names = {"null": "`NullConnector`", "tiered": "**ours**", "remote": "**ours + remote tier**",
             "offloading": "`OffloadingConnector`"}
    sets = r.doc.get("sets", [r.doc])
    shown = [m for m in names if any(m in s["summary"] for s in sets)]

    def cell(v: dict | None) -> str:
        if v is None:
            return "-"
        per = v["paired_cpu_vs_none_pct"]
        bound = f", bound {v['bound_pct']:+.0f}%" if "bound_pct" in v else ""
        return f"{_pct(v['median_paired_cpu_vs_none_pct'])} ({min(per):+.1f}..{max(per):+.1f}{bound})"

    rows = []
    for s in sets:
        none = s["summary"]["none"]["cpu_us_per_step"]
        rows.append([s["started"][11:16], s["code"], len(s["rounds"]),
                     f"{num(median(none), 0)} ({num(min(none), 0)}..{num(max(none), 0)})",
                     *[cell(s["summary"].get(m)) for m in shown]])
    head = ["set (UTC)", "code", "rounds", "`none` us/step (rounds' range)", *[names[m] for m in shown]]
    return table(head, rows)


# ------------------------------------------------------------------------------------ GPU <-> CPU copies
def _gbps(row: dict | None) -> str:
    return "-" if row is None else f"{num(row['gbps'])} ({row['ratio']:.2f})"


def gpu_copy(r: Result) -> str:
    """256 random blocks per call: one call, and 8 calls back to back, per mechanism; GB/s (ratio to contiguous)."""
    rows, extra, pick = [], [], {}
    for c in r.doc["copies"] + r.doc.get("rect_streamed", []):
        variant = "2d" if c["opts"].get("rect_copies") else c["mechanism"]
        pick.setdefault((c["case"], c["direction"], c["calls"], c["blocks"], variant), c)
    for c in r.doc.get("rect_streamed", []):
        if not c["opts"].get("rect_copies"):
            extra.append(f"{c['case']} {c['direction']}, {c['calls']} calls of {c['blocks']:,} blocks: {_gbps(c)}")
    for case in dict.fromkeys(c["case"] for c in r.doc["copies"]):
        for d in ("d2h", "h2d", "both"):
            k = lambda calls, v: pick.get((case, d, calls, 256, v))  # noqa: E731
            eight = k(8, "copy_engine")
            rows.append([case, d, num(eight and eight["contiguous_gbps"]), _gbps(k(1, "copy_engine")),
                         _gbps(eight), _gbps(k(8, "sm_kernel")), _gbps(k(8, "2d"))])
    head = ["model / layout", "direction", "contiguous pinned, same bytes", "one call: copy engine",
            "8 calls: **copy engine**", "8 calls: SM kernel", "8 calls: 2-D copies"]
    out = table(head, rows)
    if extra:
        out += "\nAlso in the file (second samples): " + "; ".join(extra) + ".\n"
    return out


STAGED_VARIANTS = ("copy_engine", "sm_kernel", "staged", "staged 2 groups", "staged scattered", "staged inline")


def gpu_copy_staged(r: Result) -> str:
    """512-block loads into per-layer blocks, per mechanism: GB/s (ratio to contiguous), ms."""
    by = {(c["case"], c["variant"]): c for c in r.doc["copies"]}
    rows = []
    for case in dict.fromkeys(c["case"] for c in r.doc["copies"]):
        any_ = by[(case, "copy_engine")]
        label = f"{case}, {any_['blocks']} blocks x {any_['layers']} layers x {any_['layer_block_bytes'] // 1024} KiB"
        rows.append([label] + [_gbps(by.get((case, v))) + (f", {num(by[(case, v)]['total_ms'])} ms"
                                                           if (case, v) in by else "") for v in STAGED_VARIANTS])
    out = table(["shape (h2d)", *STAGED_VARIANTS], rows)
    mm = "; ".join(f"{m['mechanism']} {m['slowdown_pct']:+.2f}%" for m in r.doc.get("matmul", []))
    if mm:
        out += f"\nA bf16 matmul beside the copies, slowdown: {mm}.\n"
    return out


def copy_probe(r: Result) -> str:
    """Where a 256-block call's time goes (ms), and 8 calls back to back (GB/s)."""
    cols = (("engine_ms", "copy engine alone"), ("contig_ms", "contiguous alone"), ("call_ms_default", "one call"),
            ("contig_call_ms", "contiguous call"), ("call_ms_inline_submit", "one call, caller's thread"),
            ("call_ms_one_driver_call", "one call, one driver call"), ("stream_gbps", "8 calls GB/s"),
            ("contig_stream_gbps", "8 contiguous GB/s"))
    rows = [[f"`{x['layout']}` {x['direction']} ({x['runs']:,} runs)"] + [num(x[k], 2) for k, _ in cols]
            for x in r.doc["rows"]]
    return table(["layout, direction", *(c for _, c in cols)], rows)


def in_step_probe(r: Result) -> str:
    """A 1 GiB in-step load: host time of the call and GPU time until it landed, per layer-group count and
    mechanism (the staged load as one call, as one call per group and from slots in runs of 16, in files that
    measured them)."""
    by = {(x["kv"], x["groups"], x["mechanism"], x.get("calls", "one"), x.get("slots", "random")): x
          for x in r.doc["rows"]}

    def cell(key: tuple) -> str:
        x = by.get(key)
        return "-" if x is None else f"{num(x['call_ms'])} / {num(x['landed_ms'])} ({num(x['gbps'])})"

    cols = [("copy_engine", "one", "random", "copy engine"), ("sm_kernel", "one", "random", "SM kernel"),
            ("staged", "one", "random", "staged"), ("staged", "one per group", "random", "staged, a call per group"),
            ("staged", "one", "runs of 16", "staged, slots in runs of 16"),
            ("staged", "one, 2-D calls", "random", "staged, a 2-D call a run"),
            ("staged", "one, 2-D calls", "runs of 16", "staged, runs of 16, a 2-D call a run"),
            ("staged", "one, one-launch scatter", "random", "staged, scatter in one launch"),
            ("staged", "one, one-launch scatter", "runs of 16", "staged, runs of 16, scatter in one launch")]
    cols = [c for c in cols if any(k[2:] == c[:3] for k in by)]
    rows = [[kv, g, *(cell((kv, g, *c[:3])) for c in cols)]
            for kv, g in dict.fromkeys((x["kv"], x["groups"]) for x in r.doc["rows"])]
    head = ["KV tensors", "groups", *(f"{c[3]}: call / landed ms (GB/s)" for c in cols)]
    first = r.doc["rows"][0] if r.doc["rows"] else {}
    cold = "" if "cold_call_ms" not in first else (
        f"\nThe process's first in-step load ({first['mechanism'].replace('_', ' ')}, {first['kv']}, {first['groups']} "
        f"group{'s' if first['groups'] > 1 else ''}, a new copier"
        f"{', warmed at start-up' if r.name.startswith('in_step_probe_warm') else ''}): "
        f"call {num(first['cold_call_ms'])} ms, landed {num(first['cold_landed_ms'])} ms, against "
        f"{num(first['call_ms'])} / {num(first['landed_ms'])} ms for the same load later.\n")
    return table(head, rows) + cold


def scatter_probe(r: Result) -> str:
    """A staged in-step load's host and GPU time with each scatter (``index_put_`` per layer, one launch)."""
    by = {(x["blocks"], x["groups"], x["scatter"]): x for x in r.doc["rows"]}

    def cell(x: dict | None) -> str:
        if x is None or "call_ms" not in x:
            return "-" if x is None else x.get("error", "-")
        return f"{num(x['call_ms'], 2)} / {num(x['landed_ms'], 2)}{'' if x.get('equal') else ' (bytes differ)'}"

    keys = dict.fromkeys((x["blocks"], x["mb"], x["groups"]) for x in r.doc["rows"])
    rows = [[f"{b:,} ({mb} MB)", g, cell(by.get((b, g, "index_put"))), cell(by.get((b, g, "kernel")))]
            for b, mb, g in keys]
    return table(["blocks loaded", "layer groups", "`index_put_` per layer: host / landed ms",
                  "one launch: host / landed ms"], rows)


HOST_MEMORY = {"torch_pinned": "torch `pin_memory=True`", "tier_4k": "our CPU tier (`cudaHostRegister`)",
               "tier_thp": "our CPU tier, transparent huge pages"}


def host_memory(r: Result) -> str:
    rows = [[HOST_MEMORY.get(x["kind"], x["kind"]), f"{num(x['pin_s'], 2)} s",
             *(f"{num(x[f'{k}_h2d_gbps'])} / {num(x[f'{k}_d2h_gbps'])}" for k in ("contig", "BLHNC", "LBNHC"))]
            for x in r.doc["rows"]]
    head = ["host memory", f"pinning {r.doc['rows'][0]['slab_gib']} GiB", "contiguous h2d / d2h GB/s",
            "`BLHNC` runs h2d / d2h", "`LBNHC` runs h2d / d2h"]
    return table(head, rows)


def gpu_probes(results: list[Result]) -> str:
    """The copy-path probes, each file by its own renderer (by name)."""
    parts = {"copy_probe": copy_probe, "in_step_probe": in_step_probe, "host_memory_probe": host_memory,
             "scatter_probe": scatter_probe}
    return "\n".join(each(render)([r for r in results if r.name.startswith(prefix + "_")])
                     for prefix, render in parts.items() if any(r.name.startswith(prefix + "_") for r in results))


def neighbor(r: Result) -> str:
    """Each GPU's pinned copies alone and with every GPU of the host copying at once."""
    rows = [[x["gpu"], num(x["h2d_alone"], 2), num(x["h2d_together"], 2), num(x.get("h2d_ratio"), 2),
             num(x["d2h_alone"], 2), num(x["d2h_together"], 2), num(x.get("d2h_ratio"), 2)] for x in r.doc["rows"]]
    head = ["GPU", "H2D alone GB/s", "H2D all at once", "ratio", "D2H alone", "D2H all at once", "ratio"]
    return table(head, rows)


# ---------------------------------------------------------------------------------------------- SGLang
def sglang_ttft(results: list[Result]) -> str:
    """Turn-2 TTFT in a real SGLang engine per mode, L3 hits, greedy equality."""
    rows, cal = [], []
    for r in results:
        c = r.doc["calibration"]
        rate = c.get("prefill_tokens_per_s") or c.get("prefill_tokens_per_s_mla")
        cal.append(f"`{r.name}`: disk cold read {num(c['disk']['gbps'], 2)} GB/s, prefill {num(rate, 0)} tokens/s")
        for x in r.doc["results"]:
            if "before_restart" in x:
                b = x["before_restart"]
                rows.append(["restart, engine A (writes)", x["model"], num(b["turn2_median_s"], 4), "-", "-",
                             f"{b['l3_hit_tokens']:,}", "-"])
                greedy = "= engine A" if x.get("greedy_equal_across_restart") else "differs"
                mode = "restart, engine B (new process)"
            else:
                greedy = "= none" if x.get("greedy_equal_none") else "differs"
                mode = x["mode"]
            rows.append([mode, x["model"], f"{num(x['turn2_median_s'], 4)} [{num(x['turn2_min_s'], 4)}-"
                         f"{num(x['turn2_max_s'], 4)}]", f"{x['vs_none']:.2f}x" if "vs_none" in x else "-",
                         f"{x['vs_file']:.2f}x" if "vs_file" in x else "-", f"{x['l3_hit_tokens']:,}", greedy])
    head = ["mode", "model", "turn-2 median [min-max] s", "speed vs none", "speed vs file", "L3 hit tokens",
            "greedy"]
    return table(head, rows) + "\nCalibration: " + "; ".join(cal) + ".\n\n" + source(results)


def sglang_bench(r: Result) -> str:
    rows = [[x["path"], x["layout"], num(x["pages_s"], 0), num(x["gbps"], 2),
             f"{num(x['gbps_min'], 2)}-{num(x['gbps_max'], 2)}", num(x["ratio"], 2)] for x in r.doc["summary"]]
    return table(["path", "layout", "pages/s", "GB/s, median", "min-max", "ratio to raw (same repeat)"], rows)


# ------------------------------------------------------------------------------------ disk and remote
DISK_PATHS = {"raw_odirect": "raw O_DIRECT (ceiling)", "lmdb_values": "LMDB, 2 MiB values",
              "tiered_disk_none": "**tiered_kv disk tier**", "tiered_disk_zstd": "tiered_kv disk tier + zstd",
              "tiered_disk_ranges": "tiered_kv, read by layer group (overlap)"}


def disk(r: Result) -> str:
    rows = []
    for k, label in DISK_PATHS.items():
        x = r.doc.get(k)
        if x is None:  # a file from before that path was measured
            continue
        rounds = lambda what: " / ".join(num(rd[what], 2) for rd in x["rounds"])  # noqa: E731
        if x.get("bytes_saved_ratio") is not None:
            label += f" (level 1: {x['bytes_saved_ratio']:.1%} fewer bytes)"
        rows.append([label, f"{num(x['write_GBps'], 2)} ({rounds('write_GBps')})",
                     f"{num(x['read_GBps'], 2)} ({rounds('read_GBps')})", num(x.get("write_ratio", 1.0), 2),
                     num(x.get("read_ratio", 1.0), 2)])
    return table(["path", "write GB/s, median (rounds)", "cold read GB/s, median (rounds)", "write / raw",
                  "read / raw"], rows)


def disk_sharing(r: Result) -> str:
    d = r.doc
    check = [[f"{x['records']:,}", num(x["index_mib"]), num(x["check_s"], 2), num(x["open_with_check_s"], 2)]
             for x in d["integrity_check"]]
    leases = [[x["batch"], num(x["lease_unlease_us"], 0), num(x["headers_only_us"], 0), num(x["per_block_us"], 0)]
              for x in d["leases"]]
    evict = [[x["processes"], x["budget_slots"], f"{x['puts_per_s']:,}", f"{x['evictions_per_s']:,}",
              num(x["mib_per_s"]), ", ".join(f"{k} {v}" for k, v in sorted(x["per_namespace_used"].items()))]
             for x in d["eviction"]]
    return "\n".join([table(["records", "index MiB", "integrity check s", "open with check s"], check),
                      table(["read batch", "lease + unlease us", "headers only us", "us per block"], leases),
                      table(["processes", "budget slots", "puts/s", "evictions/s", "MiB/s", "slots held at the end"],
                            evict)])


def remote(r: Result) -> str:
    d, p = r.doc, r.doc["presence"]
    rows = [["raw redis-py cluster pipeline", num(d["raw"]["write_gbps"], 3), num(d["raw"]["read_gbps"], 3)],
            ["`RemoteTier` (checked records)", num(d["tier"]["write_gbps"], 3), num(d["tier"]["read_gbps"], 3)],
            ["tier / raw", f"**{num(d['tier_over_raw']['write_gbps'], 2)}**",
             f"**{num(d['tier_over_raw']['read_gbps'], 2)}**"]]
    return (table(["path", "write GB/s", "read GB/s"], rows)
            + f"\nPresence: a block one client wrote reaches another client's feed in {p['feed_latency_ms_median']} "
            f"ms (median; max {p['feed_latency_ms_max']}); adopting 1,000 announced keys takes "
            f"{num(p['adopt_us_per_1000_keys'] / 1000, 1)} us each; a 64-key lookup with 100,000 remote keys "
            f"known {num(p['lookup_us_64_keys_100k_known'])} us.\n")


# --------------------------------------------------------------------------------- CPU models of a GPU run
def burst_sim(r: Result) -> str:
    rows = []
    for wave in ("c8", "c32"):
        w = r.doc.get(wave)
        for mode, x in (w["results"].items() if w else ()):
            rows.append([f"{w['model']['users']}-wave", mode, num(x["ttft_ms_p50"]), num(x["ttft_ms_p90"]),
                         num(x["wave_ms_mean"]), x["prefill_steps"], x["in_step_loads"], x["async_loads"],
                         num(x["budget_mb"], 0)])
    head = ["wave", "mode", "TTFT p50 ms", "TTFT p90 ms", "wave ms", "prefill steps", "in-step loads",
            "async loads", "budget MB"]
    return table(head, rows)


def tail_sim(r: Result) -> str:
    shape = {"dense": "Llama-like (one KV cache group)", "gptoss": "gpt-oss-like (32-token window + full)",
             "gemma2": "Gemma-2-like (256-token window + full)"}.get(r.doc.get("shape", "dense"), r.doc.get("shape"))
    rows = [[shape, mode.replace("tail_chunks ", ""), f"{x['prompt_tokens']:,}", f"{x['computed_tokens']:,}",
             f"{x['connector_hit_tokens']:,}", f"{x['tail_hit_tokens']:,}", x["tail_stores"],
             x["resident_cpu_chunks"]] for mode, x in r.doc["modes"].items()]
    head = ["shape", "`tail_chunks`", "prompt tokens", "computed", "from the connector", "of it tail pieces",
            "tail pieces stored", "CPU slots at the end"]
    return table(head, rows)


def disk_sweep(r: Result) -> str:
    d = r.doc
    raw16 = d["raw"]["16"] if "16" in d["raw"] else d["raw"][16]
    rows = [[c["reader"], c["in_flight"], c["groups"], c["range_bytes"] >> 10, "yes" if c["busy_python_thread"] else "no",
             num(c["read_GBps"], 2), num(c["read_GBps"] / raw16, 2)] for c in d["cells"]]
    raws = ", ".join(f"{q} in flight {num(g, 2)}" for q, g in d["raw"].items())
    return table(["reader", "in flight", "layer groups", "range KiB", "busy Python thread", "read GB/s",
                  "/ raw (16 in flight)"], rows) + f"\nRaw O_DIRECT 2 MiB reads, same run: {raws} GB/s.\n"


def remote_ranges(r: Result) -> str:
    d = r.doc
    rows = [[x["reader"], "yes" if x["busy"] else "no", num(x["read_GBps"], 2),
             num(x["spinner_kept"], 2) if x.get("spinner_kept") is not None else "-", x["reps"]] for x in d["rows"]]
    return table(["reader", "busy Python thread", "read GB/s (median)", "its rate during the reads / alone",
                  "reps"], rows) + (f"\n{d['records']} records of {d['blocks']} x {d['block_bytes'] >> 10} KiB, "
                                    f"{d['groups']} layer groups.\n")


def aio_lanes(r: Result) -> str:
    """The AIO lanes probe's rows: read rate, group 0's readiness and step time per step size, reader and load."""
    d = r.doc
    rows = [[x["step_bytes"] >> 20, x["reader"], "yes" if x["busy"] else "no", num(x["read_GBps"], 2),
             num(x["group0_ms"], 1), num(x["wall_ms"], 1), x["reps"]] for x in d["rows"]]
    return table(["MiB a step", "reader", "busy Python thread", "read GB/s (median)", "group 0 ready ms", "step ms",
                  "reps"], rows) + f"\n{d['machine']}, disk tier in {d['dir']} ({d['fs']}).\n"


def store_beside_step(r: Result) -> str:
    """The probe's steps with a store started in each way, per place of the token's copy (rows as written)."""
    d = r.doc
    rows = [[x["token_copy"], x["variant"], num(x["median_ms"], 2), num(x["p10_ms"], 2), num(x["p90_ms"], 2),
             num(x["excess_ms"], 2)] for x in d["rows"]]
    return table(["token copy", "store", "step ms (median)", "p10", "p90", "over no store, ms"], rows) + (
        f"\n{d['device']}: a {d['tokens']:,}-token Llama-3-8B-shaped prefill step, a {d['store_bytes'] / 1e6:.0f} MB "
        f"store, {d['reps']} steps a variant, the variants interleaved.\n")


#: the probes' README: their answers, from the same files
PROBES = "benchmarks/probes/README.md"
#: the page of runs on several GPUs of one host (TP, replicas, engines side by side)
MULTI_GPU = "docs/benchmarks-multi-gpu.md"
#: the page of serving runs in other configurations (vLLM's own compilation) and of controls
SERVING_CONFIGS = "docs/benchmarks-serving-configs.md"
#: every section's block, by the result files it shows; each file in docs/results/ must match exactly one
SCENARIOS: tuple[Scenario, ...] = (
    Scenario("serve", ("serve_bench_*_h200.json",), serve),
    Scenario("serve-compiled", ("serve_bench_*_h200-compile.json",), serve_configs, SERVING_CONFIGS),
    Scenario("serve-controls", ("serve_bench_*_h200-ctl.json",), serve_configs, SERVING_CONFIGS),
    Scenario("serve-tails", ("serve_bench_*_h200-tails*.json",), serve_tails, SERVING_CONFIGS),
    Scenario("serve-shared-host", ("serve_bench_*_h200x4-shared.json",), serve_shared, MULTI_GPU),
    Scenario("serve-tp", ("serve_bench_*_h200x*-tp*.json",), serve, MULTI_GPU),
    Scenario("serve-replicas", ("serve_bench_*_h200x*-rr*.json",), serve_replicas, MULTI_GPU),
    Scenario("neighbor", ("neighbor_probe_*.json",), each(neighbor), MULTI_GPU),
    Scenario("vllm-ttft", ("vllm_ttft_*_h200.json",), vllm_ttft),
    Scenario("vllm-ttft-split", ("vllm_ttft_*_h200-*.json",), vllm_ttft_split, PROBES),
    Scenario("envelope", ("envelope_*_h200.json",), each(envelope)),
    Scenario("envelope-tp", ("envelope_*_h200x*-tp*.json",), each(envelope), MULTI_GPU),
    Scenario("pool-replicas", ("pool_replicas_*.json",), each(pool_replicas), MULTI_GPU),
    Scenario("sched", ("sched_overhead_2*.json",), each(sched)),
    Scenario("sched-remote", ("sched_overhead_remote_*.json",), each(sched_remote)),
    Scenario("sched-interleaved", ("sched_interleaved_*.json",), each(sched_interleaved)),
    Scenario("gpu-copy", ("gpu_copy_2*.json",), each(gpu_copy)),
    Scenario("gpu-copy-staged", ("gpu_copy_staged_*.json",), each(gpu_copy_staged)),
    Scenario("gpu-probes", ("copy_probe_*.json", "in_step_probe_*.json", "host_memory_probe_*.json",
                            "scatter_probe_*.json"), gpu_probes, PROBES),
    Scenario("sglang-ttft", ("sglang_ttft_*.json",), sglang_ttft),
    Scenario("sglang-bench", ("sglang_bench_*.json",), each(sglang_bench)),
    Scenario("disk", ("disk_bench_*.json",), each(disk)),
    Scenario("disk-sweep", ("disk_sweep_*.json",), each(disk_sweep), PROBES),
    Scenario("remote-ranges", ("remote_ranges_*.json",), each(remote_ranges), PROBES),
    Scenario("aio-lanes", ("aio_lanes_*.json",), each(aio_lanes), PROBES),
    Scenario("store-beside-step", ("store_beside_step_*.json",), each(store_beside_step), PROBES),
    Scenario("disk-sharing", ("disk_sharing_bench_*.json",), each(disk_sharing)),
    Scenario("remote", ("remote_bench_*.json",), each(remote)),
    Scenario("burst-sim", ("burst_sim_*.json",), each(burst_sim), PROBES),
    Scenario("tail-sim", ("tail_sim_*.json",), each(tail_sim), PROBES),
)
