"""Regenerate the results page (docs/benchmarks.md), the probes' answers (benchmarks/probes/README.md) and
the README's highlights from docs/results/*.json.

The pages are prose written by hand (how we measure, one section per scenario with a takeaway) with
generated blocks between ``<!-- generated:results:NAME -->`` and ``<!-- /generated:results:NAME -->``;
this script rewrites only those blocks (a scenario's ``page`` says which file holds its markers) and
the README's ``<!-- generated:results:highlights -->`` table, from the result files. ``--check``
changes nothing and exits 1 with a diff when a block is stale, or when a results file belongs to no
scenario (or to two); ``tests/benchmarks/test_report_page.py`` runs it.

Usage (repo root, any Python with the repo on the path; no GPU, no engine)::

    python benchmarks/report_page.py            # rewrite the blocks
    python benchmarks/report_page.py --check    # what the test runs

How to add a scenario (e.g. the envelope: model shapes x workloads x modes, pass/fail):

1. The benchmark writes one JSON per run to ``docs/results/<bench>_<date>_<device>.json``
   (``envelope_2026-12-01_h200.json``) with ``date``, ``device`` and ``command`` keys (or the
   per-start records ``serve_bench`` keeps); ``results_page/results.py`` reads those three from
   the JSON, then from the file name (``RECORDED`` is only for old files saved without them).
2. In ``benchmarks/results_page/scenarios.py`` write a renderer ``def envelope(results: list[Result])
   -> str`` that returns Markdown: a ``table(header, rows)`` of numbers read from ``r.doc``, then
   ``source([r])`` (the line naming the file, date, device and command). Keep the table's format
   fixed (one row per model shape x workload, one column per mode: ``pass`` / ``FAIL``) so a new run
   changes cells, not the layout. Register it in ``SCENARIOS``:
   ``Scenario("envelope", ("envelope_*.json",), envelope)``. A file must match exactly one scenario.
3. In ``docs/benchmarks.md`` add a section: the one sentence of method that is new, the two marker
   lines ``<!-- generated:results:envelope -->`` and ``<!-- /generated:results:envelope -->``, and one
   or two sentences of takeaway. A README highlight, if it earns one: a row function in
   ``results_page/highlights.py`` added to ``HIGHLIGHTS``.
4. Run ``python benchmarks/report_page.py``, read the diff, commit the JSON, the code and the page
   together; the chronological story of the run goes to ``docs/notes/<date>-<topic>.md``.

Threading contract: a script; main thread only.
"""
from __future__ import annotations

import argparse
import fnmatch
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.results_page import highlights  # noqa: E402
from benchmarks.results_page.results import RESULTS, Result, load  # noqa: E402
from benchmarks.results_page.scenarios import SCENARIOS, Scenario  # noqa: E402
from scripts.doc_blocks import report, sync  # noqa: E402

#: the names of this script's blocks start with it
PREFIX = "results:"


def claims(results: list[Result], scenarios: tuple[Scenario, ...] = SCENARIOS) -> dict[str, list[Result]]:
    """Scenario name -> its result files. ValueError names a file that no scenario, or two, would show."""
    out: dict[str, list[Result]] = {s.name: [] for s in scenarios}
    problems = []
    for r in results:
        mine = [s.name for s in scenarios if any(fnmatch.fnmatch(r.name, p) for p in s.patterns)]
        if len(mine) != 1:
            problems.append(f"{r.name}: {'no scenario' if not mine else 'scenarios ' + ', '.join(mine)}")
        for name in mine:
            out[name].append(r)
    if problems:
        raise ValueError("every docs/results file must belong to exactly one scenario of "
                         "benchmarks/results_page/scenarios.py (how to add one: benchmarks/report_page.py): "
                         + "; ".join(problems))
    return out


def blocks(results: list[Result]) -> dict[str, dict[str, str]]:
    """Page (from the repo root) -> {block name: generated Markdown}, for every scenario."""
    out: dict[str, dict[str, str]] = {}
    claimed = claims(results)
    for s in SCENARIOS:
        files = claimed[s.name]
        text = s.render(files) if files else f"(no results file matches {', '.join(s.patterns)} yet)\n"
        # renderers link the files as docs/ sees them ("results/NAME"); other pages need another path
        rel = os.path.relpath(RESULTS, (ROOT / s.page).parent).replace(os.sep, "/")
        out.setdefault(s.page, {})[PREFIX + s.name] = text.replace("](results/", f"]({rel}/")
    return out


def wanted(results_dir: Path = RESULTS, root: Path = ROOT) -> dict[Path, dict[str, str]]:
    """File -> {block name: content} for everything this script writes."""
    results = load(results_dir)
    out = {root / page: content for page, content in blocks(results).items()}
    out.setdefault(root / "README.md", {})[PREFIX + "highlights"] = highlights.render(results)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 when a block is stale")
    args = ap.parse_args(argv)
    try:
        diffs = sync(wanted(), PREFIX, check=args.check)
    except ValueError as exc:
        print(exc)
        return 1
    return report(diffs, args.check, "python benchmarks/report_page.py")


if __name__ == "__main__":
    sys.exit(main())
