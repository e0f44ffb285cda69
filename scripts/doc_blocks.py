"""Generated blocks inside hand-written Markdown: find them, refill them, check them.

A block is the text between ``<!-- generated:NAME -->`` and ``<!-- /generated:NAME -->`` (each marker
on a line of its own; anything after NAME in the opening marker is a note to the reader, e.g. which
script writes it). Everything outside the markers is prose and is never touched. Used by
``scripts/config_docs.py`` (the tables of config keys) and ``benchmarks/report_page.py`` (the
results page and the README's highlights).

``sync`` rewrites the files (or, with ``check``, only reports them): a file whose blocks would change
is stale; a marker with no content to put there, or content with no marker, is an error (a block
was renamed on one side only).

Threading contract: a script helper; main thread only.
"""
from __future__ import annotations

import difflib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"(?P<open><!-- generated:(?P<name>[\w.:-]+)(?: [^\n]*?)? -->\n)(?P<body>.*?)"
                    r"(?P<close><!-- /generated:(?P=name) -->)", re.S)


class BlockError(ValueError):
    """Markers and generated contents do not match up."""


def names(text: str) -> list[str]:
    """The names of the generated blocks in ``text``, in order."""
    return [m["name"] for m in _BLOCK.finditer(text)]


def fill(text: str, contents: dict[str, str], where: str = "text", prefix: str = "") -> str:
    """``text`` with the body of every block named ``prefix...`` replaced by ``contents[name]`` (a trailing
    newline is added). Blocks of other names belong to other generators and are left alone."""
    found = [n for n in names(text) if n.startswith(prefix)]
    if len(found) != len(set(found)):
        raise BlockError(f"{where}: a generated block name appears twice: {sorted(found)}")
    opened = [n for n in re.findall(r"<!-- generated:([\w.:-]+)", text) if n.startswith(prefix)]
    if sorted(opened) != sorted(found):
        raise BlockError(f"{where}: marker(s) {sorted(set(opened) - set(found))} have no matching "
                         f"<!-- /generated:NAME --> line")
    unknown = [n for n in found if n not in contents]
    if unknown:
        raise BlockError(f"{where}: no generator writes block(s) {unknown}; remove the markers or add the block")
    missing = [n for n in contents if n not in found]
    if missing:
        raise BlockError(f"{where}: block(s) {missing} have no <!-- generated:NAME --> marker here")

    def body(m: re.Match) -> str:
        if m["name"] not in contents:
            return m[0]
        new = contents[m["name"]]
        return m["open"] + new + ("" if new.endswith("\n") else "\n") + m["close"]

    return _BLOCK.sub(body, text)


def sync(wanted: dict[Path, dict[str, str]], prefix: str, check: bool = False) -> list[str]:
    """Refill the ``prefix...`` blocks of each file (``{path: {block name: content}}``); return a unified
    diff per stale file. With ``check`` nothing is written."""
    diffs, writes = [], []
    for path, contents in wanted.items():  # every file first: an error leaves all of them as they were
        rel = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
        old = path.read_text()
        new = fill(old, contents, rel, prefix)
        if new != old:
            diffs.append("".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                      f"a/{rel}", f"b/{rel}", n=1)))
            writes.append((path, new))
    if not check:
        for path, new in writes:
            path.write_text(new)
    return diffs


def report(diffs: list[str], check: bool, regenerate: str) -> int:
    """Print what ``sync`` found; the exit status for a script's ``main``."""
    if not diffs:
        print("generated blocks up to date")
        return 0
    if check:
        print("".join(diffs))
        print(f"{len(diffs)} file(s) differ from what the generator writes; run: {regenerate}")
        return 1
    print(f"rewrote {len(diffs)} file(s)")
    return 0
