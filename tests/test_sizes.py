"""Size limits, checked from the source: no module of ``tiered_kv/`` above 600 lines, no class above 400.

A reader should be able to hold a module or a class in their head (``tiered_kv/README.md``: a folder grows
into a package of parts, modules stay a few hundred lines). Lines are physical lines, docstrings and
comments included; a class counts from its ``class`` line to its last line (nested classes count in their
outer class too). Past a limit, split by responsibility: a part with one job and a small interface that its
owner composes (as ``connector/vllm/scheduler.py`` composes ``lookup``, ``loads``, ``stores``, ``blocks``
and ``routing``), not a mixin sharing all of the class's state. Pure Python, no package import needed.
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "tiered_kv"
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 400


def _modules() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def _name(path: Path) -> str:
    return str(path.relative_to(PKG.parent))


def _classes(path: Path) -> list[tuple[str, int]]:
    """``(qualified name, lines)`` of every class defined in ``path``, nested ones included."""
    out: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                name = f"{prefix}{child.name}"
                out.append((name, child.end_lineno - child.lineno + 1))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(), str(path)), "")
    return out


def test_no_module_is_longer_than_the_limit():
    offenders = sorted(((n, _name(p)) for p in _modules()
                        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES), reverse=True)
    assert not offenders, (f"modules over {MAX_MODULE_LINES} lines (split them by responsibility; tiered_kv/README.md):\n"
                           + "\n".join(f"  {name}: {n} lines" for n, name in offenders))


def test_no_class_is_longer_than_the_limit():
    offenders = sorted(((n, f"{_name(p)}:{cls}") for p in _modules() for cls, n in _classes(p)
                        if n > MAX_CLASS_LINES), reverse=True)
    assert not offenders, (f"classes over {MAX_CLASS_LINES} lines (give a part of the work to a class the owner "
                           f"composes; tiered_kv/README.md):\n" + "\n".join(f"  {name}: {n} lines" for n, name in offenders))


def test_the_checks_see_the_package():
    """The walk finds the package's modules and classes (so the limits above are not checked on nothing)."""
    names = {_name(p) for p in _modules()}
    assert "tiered_kv/planner/chain.py" in names and len(names) > 50
    chain = dict(_classes(PKG / "planner" / "chain.py"))
    assert 100 < chain["TierChain"] <= MAX_CLASS_LINES
    nested = dict(_classes(PKG / "connector" / "vllm" / "connector.py"))
    assert "TieredKVConnector" in nested
