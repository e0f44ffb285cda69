"""Result files and the small formatting kit every scenario renderer uses.

A ``Result`` is one ``docs/results/*.json`` file with the facts every table names: its date,
device and command, read from the JSON (``date``/``dates``, ``device``/``devices``, ``command``/
``commands``), else from its file name (``<bench>_<date>_<device>.json``), else from ``RECORDED``:
what the lab notebook wrote beside a table for the few files saved without them.

Threading contract: pure functions over files; main thread only.
"""
from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"

#: device part of a result file's name -> how the docs name the machine
DEVICES = {"cpu-box": "2-core CPU box", "h200": "H200", "h200x4": "4 x H200 host",
           "h200x4-shared": "4 x H200 host, four engines at once", "h200x2": "2 x H200 host",
           "h200x2-tp2": "2 x H200 host, one engine at TP=2",
           "h200x2-rr2": "2 x H200 host, one replica per GPU behind a round-robin router",
           "h200-compile": "H200, vLLM's compilation on"}

#: date / device / command of files saved without them, as the notes beside their tables recorded them
RECORDED: dict[str, dict[str, str]] = {
    "disk_sharing_bench_2026-11-23_cpu-box.json": {
        "command": "python benchmarks/disk_sharing_bench.py --records 1000,10000,100000 --seconds 5 "
                   "--json docs/results/disk_sharing_bench_2026-11-23_cpu-box.json"},
    "sglang_bench_2026-11-22_cpu-box.json": {
        "command": "PYTHONPATH=scripts/cpu_stubs .venv-sglang/bin/python benchmarks/sglang_bench.py --pages 128 "
                   "--repeats 3"},
    "tail_sim_2026-11-23_cpu-box.json": {
        "command": "PYTHONPATH=. .venv/bin/python benchmarks/probes/tail_sim.py --users 16 --turns 3 "
                   "--gpu-blocks 384"},
    "vllm_ttft_gpt-oss_2026-11-23_h200.json": {
        "device": "NVIDIA H200", "command": "OUT=$OUT python3 benchmarks/vllm_ttft.py --model gpt-oss"},
    "vllm_ttft_dsv2-lite_2026-11-23_h200.json": {
        "device": "NVIDIA H200", "command": "OUT=$OUT python3 benchmarks/vllm_ttft.py --model dsv2-lite"},
    "vllm_ttft_gemma3_2026-11-23_h200.json": {
        "device": "NVIDIA H200",
        "command": "OUT=$OUT python3 benchmarks/vllm_ttft.py --model gemma3 --modes floor,tiered-cpu,offloading"},
}
#: the command of a merged serving file (each start keeps its own ``vllm serve`` line and ``code``)
SERVE_COMMAND = ("python3 benchmarks/serve_bench.py --shape SHAPE --modes ... per call, merged with "
                 "serve_bench.py --plot-from (the calls: docs/notes/)")
_NAME = re.compile(r"_(\d{4}-\d{2}-\d{2})_([A-Za-z0-9.-]+)\.json$")


@dataclass
class Result:
    """One results file."""

    path: Path
    doc: dict = field(repr=False)

    @property
    def name(self) -> str:
        return self.path.name

    def _recorded(self, what: str) -> str | None:
        return RECORDED.get(self.name, {}).get(what)

    @property
    def date(self) -> str:
        """The run's date (``first..last`` for merged files), from the JSON or the file name."""
        d = self.doc
        if d.get("dates"):
            days = sorted({x[:10] for x in d["dates"]})
            return days[0] if len(days) == 1 else f"{days[0]}..{days[-1]}"
        if isinstance(d.get("date"), str):
            return d["date"][:10]
        m = _NAME.search(self.name)
        return m.group(1) if m else "?"

    @property
    def device(self) -> str:
        """The machine, from the JSON (plus what the file name adds), else the notes, else the file name."""
        d = self.doc
        m = _NAME.search(self.name)
        tag = m.group(2) if m else ""
        named = d.get("devices") and ", ".join(d["devices"]) or d.get("device") or self._recorded("device")
        if not isinstance(named, str):
            return DEVICES.get(tag, tag or "?")
        if tag and tag.lower() not in named.lower():
            named += f" ({DEVICES.get(tag, tag)})"
        return named

    @property
    def short_device(self) -> str:
        """The machine as the highlights name it (from the file name)."""
        m = _NAME.search(self.name)
        return DEVICES.get(m.group(2), m.group(2)) if m else self.device

    @property
    def command(self) -> str:
        """The command that wrote the file (the first one where the JSON lists several)."""
        d = self.doc
        if isinstance(d.get("command"), str):
            return d["command"]
        if d.get("commands"):
            return d["commands"][0]
        if d.get("starts") and d.get("summary"):
            return SERVE_COMMAND
        if d.get("sets") and isinstance(d["sets"][0].get("command"), str):
            return d["sets"][0]["command"]
        return self._recorded("command") or "?"


def load(directory: Path = RESULTS) -> list[Result]:
    """Every ``*.json`` in ``directory``, by name."""
    return [Result(p, json.loads(p.read_text())) for p in sorted(directory.glob("*.json"))]


# ---------------------------------------------------------------------------------------- formatting
def table(header: list[str], rows: list[list[object]]) -> str:
    """A Markdown table; cells are ``str()``-ed, pipes escaped."""
    cell = lambda v: str(v).replace("|", "\\|")  # noqa: E731
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(out) + "\n"


def num(v: float | None, digits: int = 1) -> str:
    """``v`` with ``digits`` decimals and thousands separators; ``-`` for None."""
    return "-" if v is None else f"{v:,.{digits}f}"


def ratio(a: float | None, b: float | None, digits: int = 2) -> str:
    """``a / b`` as ``0.74x``; ``-`` when either is missing."""
    return "-" if a is None or not b else f"{a / b:.{digits}f}x"


def spread(d: dict | None, digits: int = 1) -> str:
    """A ``{min, median, max, n}`` spread as ``median [min-max]`` (just the median for one sample)."""
    if not d:
        return "-"
    if d.get("n", 1) == 1 or d["min"] == d["max"]:
        return num(d["median"], digits)
    return f"{num(d['median'], digits)} [{num(d['min'], digits)}-{num(d['max'], digits)}]"


def median(values: list[float]) -> float:
    return statistics.median(values)


def source(results: list[Result], prefix: str = "results/") -> str:
    """The line under a table that names each file and its date, device and command (said once when shared)."""
    link = lambda r: f"[`{r.name}`]({prefix}{r.name})"  # noqa: E731
    if len({(r.device, r.command) for r in results}) == 1:
        files = ", ".join(f"{link(r)} ({r.date})" for r in results)
        return f"Source: {files}; {results[0].device}; `{results[0].command}`.\n"
    parts = [f"{link(r)} ({r.date}, {r.device}; `{r.command}`)" for r in results]
    return "Source: " + "; ".join(parts) + ".\n"


def each(render_one: Callable[[Result], str]) -> Callable[[list[Result]], str]:
    """A scenario renderer from a one-file one: each file's tables, then its source line."""
    def render(results: list[Result]) -> str:
        return "\n".join(render_one(r) + "\n" + source([r]) for r in results)
    return render
