"""The package's layering, checked from the source: no import runs upward, no cycles, no stray engine imports.

The layers, bottom to top (``tiered_kv/README.md`` draws them):

0. ``errors``, ``version``  every error type; the version
1. ``values``              plain data shared by all
2. ``planner``              what moves where (pure Python)
3. ``tiers``, ``copy``      one medium each; the GPU edge's copy mechanism
4. ``movers``               threads that execute the planner's jobs on the tiers
5. ``store``                the Python API front end (and its metrics)
6. ``connector``            engine adapters (vLLM, SGLang)
7. ``cli``, ``testing``, the package facade

A module may import from a lower layer or from its own subpackage. Every import counts: module
level, inside functions, and under ``TYPE_CHECKING``. Pure Python, no package import needed.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "tiered_kv"

LAYERS = {  # first two name parts -> layer
    "tiered_kv.errors": 0, "tiered_kv.version": 0, "tiered_kv.values": 1,
    "tiered_kv.planner": 2,
    "tiered_kv.tiers": 3, "tiered_kv.copy": 3,
    "tiered_kv.movers": 4,
    "tiered_kv.store": 5,
    "tiered_kv.connector": 6,
    "tiered_kv.cli": 7, "tiered_kv.testing": 7, "tiered_kv": 7,
}
NO_TORCH = ("tiered_kv.errors", "tiered_kv.values", "tiered_kv.planner")
ENGINES = ("vllm", "sglang")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str:
    """The layering unit of a module: its subpackage (``tiered_kv.connector.vllm`` for adapters)."""
    parts = module.split(".")
    if parts[:2] == ["tiered_kv", "connector"] and len(parts) > 2:
        return ".".join(parts[:3])
    return ".".join(parts[:2])


def _layer(module: str) -> int:
    unit = ".".join(module.split(".")[:2])
    if unit not in LAYERS:
        raise AssertionError(f"{module}: no layer assigned; add its subpackage to LAYERS and to tiered_kv/README.md")
    return LAYERS[unit]


def _walk(tree: ast.AST, load_time_only: bool):
    """Every node of ``tree``; with ``load_time_only``, none inside a function body (run only when called)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if load_time_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            todo.append(child)


def _imports(path: Path, load_time_only: bool = False) -> list[tuple[str, int]]:
    """Every absolute module name ``path`` imports (``from x import y`` also yields ``x.y``), with line numbers."""
    me = _module_name(path)
    is_pkg = path.name == "__init__.py"
    out = []
    for node in _walk(ast.parse(path.read_text(), str(path)), load_time_only):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = me.split(".") if is_pkg else me.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out.append((base, node.lineno))
            out += [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return out


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


MODULES = _modules()


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_import_runs_upward(module):
    path = MODULES[module]
    mine, unit = _layer(module), _unit(module)
    for target, line in _imports(path):
        if not target.startswith("tiered_kv") or target not in MODULES and target.rsplit(".", 1)[0] not in MODULES:
            continue
        if target not in MODULES:  # `from pkg.mod import name`: the module is the prefix
            target = target.rsplit(".", 1)[0]
        if _unit(target) == unit or target == "tiered_kv" and module == "tiered_kv":
            continue
        theirs = _layer(target)
        assert theirs < mine, (f"{path.relative_to(PKG.parent)}:{line} imports {target} (layer {theirs}) "
                               f"from layer {mine}: imports may only run downward")


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith(NO_TORCH)))
def test_values_and_planner_never_import_torch_or_do_io(module):
    """Loading these modules imports no torch, storage library or engine (a method may import torch lazily)."""
    for target, line in _imports(MODULES[module], load_time_only=True):
        root = target.split(".")[0]
        assert root not in ("torch", "lmdb", "numpy", "redis") + ENGINES, \
            f"{module}:{line} imports {target}: the values and planner layers stay pure Python"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_only_the_adapters_import_their_engine(module):
    for target, line in _imports(MODULES[module]):
        root = target.split(".")[0]
        if root in ENGINES:
            assert module.startswith(f"tiered_kv.connector.{root}"), \
                f"{module}:{line} imports {target}: only tiered_kv.connector.{root} may import {root}"


def test_no_import_cycles_between_subpackages():
    edges: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        for target, _ in _imports(path):
            if target in MODULES or target.rsplit(".", 1)[0] in MODULES:
                t = target if target in MODULES else target.rsplit(".", 1)[0]
                if _unit(t) != _unit(module) and module != "tiered_kv":
                    edges.setdefault(_unit(module), set()).add(_unit(t))
    seen: dict[str, int] = {}

    def visit(u: str, stack: list[str]) -> None:
        seen[u] = 1
        for v in sorted(edges.get(u, ())):
            assert seen.get(v) != 1, f"import cycle: {' -> '.join(stack + [u, v])}"
            if v not in seen:
                visit(v, stack + [u])
        seen[u] = 2

    for u in sorted(edges):
        if u not in seen:
            visit(u, [])
