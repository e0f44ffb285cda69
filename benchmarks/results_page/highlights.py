"""The README's highlights table: one row per headline result, every number read from docs/results/.

A row function takes every ``Result`` and returns ``[what, machine and date, result, baseline]`` (or
None when its files are missing); ``HIGHLIGHTS`` lists them in the README's order. Each row names
its files, linked from the README.

Threading contract: pure functions; main thread only.
"""
from __future__ import annotations

import fnmatch
from typing import Callable

from benchmarks.results_page.results import Result, median, num, ratio, table
from benchmarks.results_page.scenarios import MODELS, SHAPES, _shape_key, same_call
from benchmarks.serving import report as serve_report

Row = list[str]


def _latest(results: list[Result], pattern: str) -> Result | None:
    hits = [r for r in results if fnmatch.fnmatch(r.name, pattern)]
    return hits[-1] if hits else None


def from_latest(pattern: str) -> Callable[[Callable[[Result], Row]], Callable[[list[Result]], Row | None]]:
    """A row drawn from the latest file matching ``pattern`` (no row without one)."""
    def wrap(row: Callable[[Result], Row]) -> Callable[[list[Result]], Row | None]:
        def pick(results: list[Result]) -> Row | None:
            r = _latest(results, pattern)
            return None if r is None else row(r)
        pick.__name__ = row.__name__
        return pick
    return wrap


def _with_mode(results: list[Result], pattern: str, mode: str) -> Result | None:
    """The first file matching ``pattern`` whose ``results`` have a run of ``mode``."""
    return next((r for r in results if fnmatch.fnmatch(r.name, pattern)
                 and any(x["mode"] == mode for x in r.doc.get("results", ()))), None)


def _where(rs: list[Result], extra: str = "") -> str:
    first = rs[0]
    files = ", ".join(f"[json](docs/results/{r.name})" for r in rs)
    return f"{first.short_device}{extra}, {first.date} ({files})"


def _vllm(doc: dict) -> str:
    versions = sorted({s["vllm_version"] for s in doc.get("starts", ()) if s.get("vllm_version")})
    return f", vLLM {'/'.join(versions)}" if versions else ""


def _ttft(summary: dict, mode: str, phase: str, what: str = "ttft_p50_ms") -> float | None:
    d = summary.get(mode, {}).get("phases", {}).get(phase, {}).get(what)
    return None if d is None else d["median"]


def _pair(summary: dict, mode: str, what: str = "ttft_p50_ms", digits: int = 1) -> str:
    return f"{num(_ttft(summary, mode, 'c8', what), digits)} / {num(_ttft(summary, mode, 'c32', what), digits)}"


def _ratios(summary: dict, peer: str, what: str = "ttft_p50_ms") -> str:
    return " / ".join(ratio(_ttft(summary, "tiered", p, what), _ttft(summary, peer, p, what)) for p in ("c8", "c32"))


def serve_lone(results: list[Result]) -> Row | None:
    r = _latest(results, "serve_bench_llama3-8b_*_h200.json")
    call = r and same_call(r.doc)
    if not call:
        return None
    run, s = call
    return ["`vllm serve`, multi-turn users, Llama-3-8B shape: TTFT p50 at concurrency 8 / 32 of our default "
            "(`in_step_copy: auto`), one engine alone on the host",
            _where([r], _vllm(r.doc)),
            f"**{_pair(s, 'tiered')} ms** = **{_ratios(s, 'offloading')}** of `OffloadingConnector` with "
            f"{_ratios(s, 'offloading', 'output_tok_s')} its output tok/s; {_ratios(s, 'lmcache')} of LMCache",
            f"same call (run {run}): `OffloadingConnector` {_pair(s, 'offloading')} ms, LMCache {_pair(s, 'lmcache')},"
            f" the engine's floor (every prefix in vLLM's GPU cache, nothing loaded) {_pair(s, 'none-resident')}"]


def _by_mode(r: Result, modes: tuple[str, ...]) -> str:
    s = r.doc["summary"]
    return ", ".join(f"{label} ({s[m]['starts_ok']}) {_pair(s, m)}" for m, label in modes if m in s)


def serve_every_start(results: list[Result]) -> Row | None:
    rs = sorted((r for r in results if fnmatch.fnmatch(r.name, "serve_bench_*_h200.json")), key=_shape_key)
    if not rs:
        return None
    ours = (("tiered-copyengine", "copy engine"), ("tiered-staged", "staged"))
    peers = (("offloading", "`OffloadingConnector`"), ("lmcache", "LMCache"), ("none-resident", "floor"))
    name = lambda r: SHAPES.get(r.doc["shape"], r.doc["shape"])  # noqa: E731
    return ["the same, every lone-engine start per shape, ours with each in-step copy mechanism alone "
            "(median over starts (n), c8 / c32 ms)", _where(rs, _vllm(rs[0].doc)),
            "; ".join(f"{name(r)}: {_by_mode(r, ours)}" for r in rs if _by_mode(r, ours)),  # shapes run with both
            "; ".join(f"{name(r)}: {_by_mode(r, peers)}" for r in rs if _by_mode(r, peers))]


def call_summaries(doc: dict) -> dict[int, dict]:
    """``{call: summary of that call's starts alone}`` (``start["call"]``, ``serving.report.summarize``); starts without
    a call (merged before calls were recorded) are left out."""
    calls = sorted({s["call"] for s in doc["starts"] if s.get("call") is not None})
    return {c: serve_report.summarize([s for s in doc["starts"] if s.get("call") == c]) for c in calls}


def paired_ratio(doc: dict, mode: str, base: str, phase: str,
                 summaries: dict[int, dict] | None = None) -> tuple[float, int] | None:
    """``mode`` against ``base`` in the same call: per call with both, the median TTFT p50 of its ``mode`` starts over
    that of its ``base`` starts; returns the median over those calls and how many there were (``summaries``:
    ``call_summaries(doc)`` if the caller has it). Sessions differ (the floor's c8 ran 41.6-57.1 ms in three
    sessions), so a mode is set against its own call's."""
    per_call = []
    for summary in (call_summaries(doc) if summaries is None else summaries).values():
        a, b = _ttft(summary, mode, phase), _ttft(summary, base, phase)
        if a is not None and b:
            per_call.append(a / b)
    return (median(per_call), len(per_call)) if per_call else None


def _paired_text(paired: list[tuple[float, int] | None]) -> tuple[str, str]:
    """``paired_ratio``'s results per phase as ``("1.24x / 1.12x", "4 / 4")``: the ratios, and the calls each took."""
    return (" / ".join("-" if x is None else f"{x[0]:.2f}x" for x in paired),
            " / ".join("0" if x is None else str(x[1]) for x in paired))


def serve_floor(results: list[Result]) -> Row | None:
    """Issue 31: compiled ``vllm serve`` against the engine's floor, per shape of the ``*-floor`` files."""
    latest = {r.doc["shape"]: r for r in results  # a shape's newest file (names sort by date)
              if fnmatch.fnmatch(r.name, "serve_bench_*-floor_*_h200-compile.json")}
    rs = sorted(latest.values(), key=_shape_key)
    if not rs:
        return None
    ours = (("tiered", "ours"), ("tiered-ce", "ours, `auto` before round 23 (copy engine)"),
            ("tiered-staged", "every copy staged"))
    parts, floors = [], []
    for r in rs:
        s, name = r.doc["summary"], SHAPES.get(r.doc["shape"], r.doc["shape"])
        if "none-resident" not in s:
            continue
        floors.append(f"{name} ({s['none-resident']['starts_ok']}) {_pair(s, 'none-resident')}")
        by_call = call_summaries(r.doc)
        for m, label in ours:
            if m not in s:
                continue
            paired = [paired_ratio(r.doc, m, "none-resident", p, by_call) for p in ("c8", "c32")]
            if all(x is None for x in paired):  # starts merged before calls were recorded: pooled medians only
                rel = " / ".join(ratio(_ttft(s, m, p), _ttft(s, "none-resident", p)) for p in ("c8", "c32"))
                parts.append(f"{name}, {label} ({s[m]['starts_ok']}): {_pair(s, m)} ms = {rel} of the floor's median "
                             f"over every start (no call recorded)")
                continue
            rel, calls = _paired_text(paired)
            peers = ""
            for peer, peer_label in (("offloading", "`OffloadingConnector`"), ("lmcache", "LMCache")) \
                    if m == "tiered" else ():  # the peers beside ours in the same calls (goal 0.8x / 0.7x)
                pr = [paired_ratio(r.doc, m, peer, p, by_call) for p in ("c8", "c32")]
                if any(x is not None for x in pr):
                    peers += ", against {} of its call {} (calls: {})".format(peer_label, *_paired_text(pr))
            parts.append(f"{name}, {label} ({s[m]['starts_ok']}): {_pair(s, m)} ms; against the floor of its own "
                         f"call **{rel}** (calls: {calls}){peers}")
    if not parts:
        return None
    return ["`vllm serve` compiled (vLLM's defaults), against the engine's floor (every prefix in vLLM's GPU cache, "
            "nothing loaded): TTFT p50 c8 / c32, median over starts (n), and the median over calls of each call's "
            "ratio to its own floor start; goal <= 1.10x (issue 31)",
            _where(rs, _vllm(rs[0].doc)), "; ".join(parts), "the floor: " + "; ".join(floors) + " ms"]


def serve_shared(results: list[Result]) -> Row | None:
    rs = [r for r in results if fnmatch.fnmatch(r.name, "serve_bench_*_h200x4-shared.json")]
    rs = [r for r in rs if "tiered" in r.doc["summary"]]
    probe = _latest(results, "neighbor_probe_*.json")
    if not rs or not probe:
        return None
    gpus = [x for x in probe.doc["rows"] if x["gpu"] != "sum"]
    h2d_all = median([x["h2d_together"] for x in gpus])
    h2d_alone = median([x["h2d_alone"] for x in gpus])
    name = lambda r: SHAPES.get(r.doc["shape"], r.doc["shape"])  # noqa: E731
    mine = (("tiered", "ours `auto`"),)
    peers = (("offloading", "`OffloadingConnector`"), ("lmcache", "LMCache"))
    return [f"the same with one engine on each of the host's {len(gpus)} GPUs at once (the host link shared: "
            f"{num(h2d_all)} GB/s H2D per GPU when all copy, {num(h2d_alone)} alone)", _where(rs + [probe]),
            "; ".join(f"{name(r)}: {_by_mode(r, mine)}" for r in rs),
            "; ".join(f"{name(r)}: {_by_mode(r, peers)}" for r in rs)]


def vllm_item2(results: list[Result]) -> Row | None:
    rs = [r for r in results if fnmatch.fnmatch(r.name, "vllm_ttft_*_h200.json") and "item2" in r.doc]
    if not rs:
        return None

    def part(r: Result, mode: str) -> str:
        m = r.doc["item2"]["modes"][mode]
        return f"{num(m['median_s'] * 1e3)} ms = {m['ratio']:.2f}x (spread {m['spread']:.2f})"

    model = lambda r: SHAPES.get(r.doc["model"], r.doc["model"])  # noqa: E731
    return ["vLLM single-request turn-2 TTFT, CPU-tier hits of "
            f"{rs[0].doc['workload']['prefix']:,}-token prefixes, against their floor (hit bytes / PCIe rate + the "
            f"prefill with the prefix GPU-cached), {rs[0].doc['item2']['modes']['tiered-cpu']['starts']} starts",
            _where(rs), "; ".join(f"{model(r)} {part(r, 'tiered-cpu')}" for r in rs),
            "`OffloadingConnector` " + "; ".join(f"{model(r)} {part(r, 'offloading')}" for r in rs
                                                 if "offloading" in r.doc["item2"]["modes"])
            + "; the floor mode's own spread " + " / ".join(f"{r.doc['item2']['modes']['floor']['spread']:.2f}"
                                                           for r in rs)]


def vllm_hybrid(results: list[Result]) -> Row | None:
    rs = [r for r in results if fnmatch.fnmatch(r.name, "vllm_ttft_*_h200.json") and "item2" not in r.doc]
    if not rs:
        return None
    by = lambda r, m: next((x for x in r.doc["results"] if x["mode"] == m), None)  # noqa: E731
    ms = lambda r, m: num(by(r, m)["turn2_median_s"] * 1e3) if by(r, m) else "-"  # noqa: E731
    names = " / ".join(r.doc["model"] for r in rs)
    return [f"vLLM hybrid and MLA models ({names}), turn-2 TTFT from the CPU tier, one start per mode",
            _where(rs), f"**{' / '.join(ms(r, 'tiered-cpu') for r in rs)} ms**; bytes per hit token "
            + " / ".join(num(by(r, "tiered-cpu")["bytes_per_hit_token"], 0) for r in rs),
            f"`OffloadingConnector` {' / '.join(ms(r, 'offloading') for r in rs)} ms; prefix in vLLM's GPU cache "
            f"(floor) {' / '.join(ms(r, 'floor') for r in rs)} ms"]


@from_latest("envelope_*_h200.json")
def envelope(r: Result) -> Row:
    from benchmarks import envelope as env

    rows = env.verdict(r.doc["results"], r.doc.get("serving", ()))
    judged = [x for x in rows if x["pass"] is not None]  # a cell a newer file measured again is not judged
    passed = sum(1 for x in judged if x["pass"])
    gemma = next((x for x in rows if x["shape"] == "gemma2" and x["workload"] == "batch"), None)
    cliff = ""
    if gemma:
        m = gemma["median_s"]
        cliff = (f"; the Gemma-2 batch under GPU pressure **{num(m['tiered'], 2)} s** ({gemma['starts']['tiered']} "
                 f"starts)")
    label = lambda x: f"{x['shape']} {x['workload']}" + (f" [{x['gpu']}]" if x.get("gpu", "").startswith(  # noqa: E731
        "serve,") else "")
    fails = ", ".join(f"{label(x)} ({x['why']})" for x in judged if not x["pass"]) or "none"
    near = [label(x) for x in rows if x["pass"] and x.get("wants_3_starts")]
    if near:
        fails += f"; within 10% of a bound with fewer than 3 starts: {', '.join(near)}"
    base = (f"`OffloadingConnector` {num(gemma['median_s']['offloading'], 2)} s, no connector "
            f"{num(gemma['median_s']['none'], 2)} s" if gemma else "")
    return [f"The envelope: ours <= 1.05x of no connector and of `OffloadingConnector`, per shape and workload",
            _where([r]), f"**{passed} of {len(judged)} cells pass** ({len(rows) - len(judged)} more superseded by a newer "
            f"file's){cliff}; failing: {fails}", base]


@from_latest("envelope_*_h200x*-tp*.json")
def tensor_parallel(r: Result) -> Row:
    from benchmarks import envelope as env

    turn2 = next((x for x in env.verdict(r.doc["results"], ()) if x["workload"] == "turn2"
                  and "offloading" in x["median_s"]), None)
    tp_of = lambda x: x.get("knobs", {}).get("tp", 1)  # noqa: E731
    tp = max((tp_of(x) for x in r.doc["results"]), default=1)
    rates = [v for x in r.doc["results"] if x["mode"] == "tiered" and tp_of(x) > 1
             and x.get("shape") == (turn2 or {}).get("shape") for v in x.get("turn2_rank_gbps", {}).values()]
    mla = [x["stored_bytes_per_conversation"] for x in r.doc["results"] if x["shape"] == "dsv2-lite"
           and x["mode"] == "tiered" and tp_of(x) > 1 and "stored_bytes_per_conversation" in x]
    # MLA written through to disk: every rank's writes summed, per TP size
    disk = {tp_of(x): x["disk_bytes_per_conversation"] for x in r.doc["results"] if x["shape"] == "dsv2-lite"
            and "write_policy=write_through" in x["mode"] and "disk_bytes_per_conversation" in x}
    if turn2 is None:
        return [f"TP={tp} turn 2", _where([r]), "-", "-"]
    m = turn2["median_s"]
    result = (f"**{num(m['tiered'] * 1e3, 1)} ms** ({turn2['starts']['tiered']} starts) = "
              f"{ratio(m['tiered'], m['offloading'])} of `OffloadingConnector`")
    if rates:
        result += f"; each rank loading at {num(min(rates), 1)}-{num(max(rates), 1)} GB/s at once"
    if mla:
        result += f"; MLA (DeepSeek-V2-Lite) stores {num(mla[-1] / 1e6, 1)} MB per conversation, once for all ranks"
        if len(disk) > 1:
            result += (" (to disk: " + " / ".join(f"{num(disk[t] / 1e6, 1)} MB at TP={t}" for t in sorted(disk))
                       + ")")
    none = m.get("none")
    return [f"vLLM at TP={tp} on {tp} GPUs, {MODELS.get(turn2['shape'], turn2['shape'])} shape: turn-2 TTFT from the "
            f"CPU tier, median over starts",
            _where([r]), result, f"`OffloadingConnector` {num(m['offloading'] * 1e3, 1)} ms, no connector "
            f"{num(none * 1e3 if none is not None else None, 1)} ms"]


@from_latest("serve_bench_*_h200x*-rr*.json")
def replicas(r: Result) -> Row:
    summary = r.doc["summary"]

    def c32(mode: str) -> float | None:
        return _ttft(summary, mode, "c32")

    def starts(mode: str) -> str:
        """`` (n)``: the starts behind ``mode``'s c32 median (older files: the phase's count), or nothing."""
        d = summary.get(mode, {}).get("phases", {}).get("c32", {}).get("ttft_p50_ms")
        return f" ({d['n']})" if d and d.get("n") else ""
    n = r.doc.get("replicas", 2)
    return [f"`vllm serve`, {n} replicas (one per GPU) behind a round-robin router: TTFT p50 of the turn that lands "
            f"on a different replica from the user's last (c32), median over starts (their number in brackets)",
            _where([r]), f"one host pool (`cpu_pool`){starts('tiered-pool')}: **{num(c32('tiered-pool'), 1)} ms** = "
            f"{ratio(c32('tiered-pool'), c32('offloading'))} of `OffloadingConnector`",
            f"`OffloadingConnector`{starts('offloading')} {num(c32('offloading'), 1)} ms, ours with a private CPU "
            f"tier per replica{starts('tiered')} {num(c32('tiered'), 1)}, no connector{starts('none')} "
            f"{num(c32('none'), 1)}"]


@from_latest("gpu_copy_2*.json")
def gpu_copy(r: Result) -> Row:
    pick = {(c["case"], c["direction"]): c for c in r.doc["copies"]
            if c["calls"] == 8 and c["mechanism"] == "copy_engine" and c["case"].startswith("llama3-8b")}
    layouts = list(dict.fromkeys(case for case, _ in pick))

    def three(case: str, what: str, digits: int) -> str:
        return " / ".join(num(pick[(case, d)][what], digits) for d in ("d2h", "h2d", "both"))

    blocks = r.doc["copies"][0]["blocks"]
    return [f"GPU->CPU / CPU->GPU / both at once, Llama-3-8B blocks, 8 calls of {blocks} random blocks back to back, "
            f"layouts {' / '.join('`' + k.split('/')[1] + '`' for k in layouts)}", _where([r]),
            "; ".join(f"{three(k, 'gbps', 1)} GB/s" for k in layouts),
            "contiguous pinned copies of the same bytes: " + "; ".join(
                f"{three(k, 'contiguous_gbps', 1)} GB/s (ratios {three(k, 'ratio', 2)})" for k in layouts)]


@from_latest("gpu_copy_staged_*.json")
def staged(r: Result) -> Row:
    c = {(x["case"], x["variant"]): x for x in r.doc["copies"]}
    case = next(k for k, _ in c if "mla" in k)
    st, ce = c[(case, "staged")], c[(case, "copy_engine")]
    mm = {m["mechanism"]: m for m in r.doc.get("matmul", [])}
    return [f"staged load (one DMA per run of slots + a GPU scatter), {st['blocks']} MLA blocks x {st['layers']} "
            f"layers x {st['layer_block_bytes'] // 1024} KiB", _where([r]),
            f"{num(st['gbps'])} GB/s ({num(st['total_ms'])} ms); a bf16 matmul beside it "
            f"{mm['staged']['slowdown_pct']:+.2f}%" if "staged" in mm else f"{num(st['gbps'])} GB/s",
            f"contiguous pinned {num(st['contiguous_gbps'])} GB/s ({st['ratio']:.2f}); per-descriptor copy engine "
            f"{num(ce['gbps'])} GB/s"]


@from_latest("sched_interleaved_*.json")
def sched(r: Result) -> Row:
    sets = r.doc.get("sets", [r.doc])

    def over(mode: str) -> str:
        got = [s["summary"][mode] for s in sets if mode in s["summary"]]
        if not got:
            return "-"
        pct = sorted(v["median_paired_cpu_vs_none_pct"] for v in got)
        span = f"{pct[0]:+.1f}%" if len(pct) == 1 else f"{pct[0]:+.1f}..{pct[-1]:+.1f}%"
        bound = f", bound {got[0]['bound_pct']:+.0f}%" if "bound_pct" in got[0] else ""
        return f"{span} ({len(got)} set{'s' if len(got) != 1 else ''}{bound})"

    workload = sets[0]["workload"].split(";")[0]
    return [f"vLLM scheduler step cost, {workload} (vLLM's real `Scheduler`, every mode's steps interleaved in one "
            "process)", _where([r]),
            f"ours {over('tiered')}, with the remote tier {over('remote')} over no connector (medians of "
            f"{len(sets[0]['rounds'])} paired rounds per set)",
            f"vLLM's connector plumbing alone (`NullConnector`) {over('null')}; `OffloadingConnector` "
            f"{over('offloading')}"]


def sglang_ttft(results: list[Result]) -> Row | None:
    r = _with_mode(results, "sglang_ttft_*.json", "file")
    if not r:
        return None
    by = {x["mode"]: x for x in r.doc["results"]}
    s = lambda m: num(by[m]["turn2_median_s"], 3)  # noqa: E731
    return [f"SGLang {r.doc['versions']['sglang']} engine, HiCache L3 turn-2 TTFT, {r.doc['args']['prefix']:,}-token "
            "prefix from disk", _where([r]),
            f"every hit read {s('tiered-always')} s ({by['tiered-always']['vs_file']:.2f}x faster than `file`); "
            f"gated (disk slower than recompute) {s('tiered')} s", f"SGLang `file` backend {s('file')} s; no HiCache "
            f"{s('none')} s"]


def sglang_restart(results: list[Result]) -> Row | None:
    r = _with_mode(results, "sglang_ttft_*.json", "restart")
    if not r:
        return None
    by = {x["mode"]: x for x in r.doc["results"]}
    rs, gated, none = by["restart"], by.get("mla-gated"), by.get("mla-none")
    return [f"SGLang {r.doc['versions']['sglang']}: restart (a new engine process, same `disk_path`) and MLA",
            _where([r]), f"restart: {rs['l3_hit_tokens']:,} L3 hit tokens, greedy "
            f"{'equal' if rs.get('greedy_equal_across_restart') else 'differs'}; MLA gated "
            f"{num(gated['turn2_median_s'], 3)} s", f"MLA no HiCache {num(none['turn2_median_s'], 3)} s"]


@from_latest("sglang_bench_*.json")
def sglang_bench(r: Result) -> Row:
    rows = {(x["path"].split()[0], x["layout"]): x for x in r.doc["summary"]}
    raw = [x for x in r.doc["summary"] if x["path"].startswith("raw")]
    sg = [rows[("batch_set_v1", "page_first")], rows[("batch_get_v1", "page_first")]]
    mib = r.doc["model_shape"]["page_bytes"] >> 20
    return [f"SGLang `batch_set_v1` / `batch_get_v1`, {mib} MiB pages, a real host pool", _where([r]),
            f"{num(sg[0]['gbps'], 2)} / {num(sg[1]['gbps'], 2)} GB/s (`page_first`)",
            f"raw O_DIRECT {num(raw[0]['gbps'], 2)} / {num(raw[1]['gbps'], 2)} GB/s ({sg[0]['ratio']:.2f} / "
            f"{sg[1]['ratio']:.2f})"]


@from_latest("remote_bench_*.json")
def remote(r: Result) -> Row:
    d = r.doc
    return [f"remote tier on a Redis Cluster ({d['cluster']}), {num(d['block_mib'], 0)} MiB blocks, write / "
            "verified read", _where([r]),
            f"{num(d['tier']['write_gbps'], 2)} / {num(d['tier']['read_gbps'], 2)} GB/s",
            f"raw redis-py cluster pipeline {num(d['raw']['write_gbps'], 2)} / {num(d['raw']['read_gbps'], 2)} GB/s "
            f"({d['tier_over_raw']['write_gbps']:.2f}x / {d['tier_over_raw']['read_gbps']:.2f}x)"]


@from_latest("disk_bench_*.json")
def disk(r: Result) -> Row:
    d, t = r.doc, r.doc["tiered_disk_none"]
    return [f"disk tier, {d['block_bytes'] >> 20} MiB blocks, write (fsync incl.) / cold read", _where([r]),
            f"{num(t['write_GBps'], 2)} / {num(t['read_GBps'], 2)} GB/s",
            f"raw O_DIRECT {num(d['raw_odirect']['write_GBps'], 2)} / {num(d['raw_odirect']['read_GBps'], 2)} GB/s: "
            f"write {t['write_ratio']:.2f} of raw (LMDB values: {d['lmdb_values']['write_ratio']:.2f})"]


HIGHLIGHTS: tuple[Callable[[list[Result]], Row | None], ...] = (
    serve_lone, serve_every_start, serve_floor, serve_shared, envelope, tensor_parallel, replicas, vllm_item2, vllm_hybrid, gpu_copy, staged, sched,
    sglang_ttft, sglang_restart, sglang_bench, remote, disk)


def render(results: list[Result]) -> str:
    """The README's highlights table."""
    rows = [row for f in HIGHLIGHTS if (row := f(results)) is not None]
    return table(["what", "machine, date (results)", "result", "baseline (same run unless said)"], rows)
