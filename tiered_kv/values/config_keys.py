"""One definition per configuration key: its default, unit and meaning sit on the dataclass field.

A config dataclass declares each key as ``name: type = config_key(default, "meaning", "unit")``
instead of a bare default, so a key cannot be added without saying what it does. The tables of keys in
README.md, docs/vllm.md, docs/sglang.md and docs/remote.md are generated from these fields
(``scripts/config_docs.py``); ``tests/test_config_docs.py`` fails when a table differs from the
code or a key has no meaning. ``key_rows`` gives the rows (key, type, default, unit, meaning) and
``markdown_table`` the table itself.

The meaning is Markdown (backticks, links relative to docs/); a unit names what a number counts
(``bytes``, ``s``, ``GB/s``, ...) or is empty. A size key (unit ``bytes``) shows its default in
binary units (``8GiB``), as a user would write it.

Threading contract: pure functions; safe from any thread.
"""
from __future__ import annotations

import copy
from dataclasses import MISSING, Field, field, fields, is_dataclass
from typing import NamedTuple

#: the metadata names ``key`` puts on a field
DOC, UNIT = "doc", "unit"


def config_key(default: object, doc: str, unit: str = "") -> Field:
    """A dataclass field holding one config key: ``default``, what it means, and its unit.

    A mutable default (a dict or list) is copied for every instance, as ``default_factory`` would.
    """
    if not isinstance(doc, str) or not doc.strip():
        raise ValueError("config_key(): every config key needs its meaning (doc)")
    meta = {DOC: doc, UNIT: unit}
    if isinstance(default, (dict, list, set)):
        return field(default_factory=lambda: copy.copy(default), metadata=meta)
    return field(default=default, metadata=meta)


class KeyRow(NamedTuple):
    """One key as the docs show it: every part already Markdown."""

    key: str
    type: str
    default: str
    unit: str
    meaning: str


def undocumented(cls: type, names: list[str] | None = None) -> list[str]:
    """The keys of ``cls`` (``names``: those only) declared without ``config_key()``'s meaning."""
    wanted = _fields(cls, names)
    return [f.name for f in wanted if not str(f.metadata.get(DOC, "")).strip()]


def key_rows(cls: type, names: list[str] | None = None) -> list[KeyRow]:
    """The rows of ``cls``'s key table: the class's own keys in declaration order, then inherited ones.

    ``names`` limits them (e.g. to ``valid_keys()``, which leaves out internal fields). ValueError
    names any key without a meaning.
    """
    missing = undocumented(cls, names)
    if missing:
        raise ValueError(f"{cls.__name__}: config key(s) {missing} have no meaning; declare them with "
                         f"tiered_kv.values.config_keys.config_key(default, doc, unit)")
    rows = []
    for f in _fields(cls, names):
        default = _default(f)
        unit = f.metadata.get(UNIT, "")
        annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        rows.append(KeyRow(f"`{f.name}`", _type(annotation, unit, default), _show(default, unit),
                           unit or "-", " ".join(f.metadata[DOC].split())))
    return rows


def markdown_table(cls: type, names: list[str] | None = None) -> str:
    """``cls``'s keys as a Markdown table: key, type, default, unit, meaning."""
    lines = ["| key | type | default | unit | meaning |", "|---|---|---|---|---|"]
    for row in key_rows(cls, names):
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
    return "\n".join(lines) + "\n"


def _fields(cls: type, names: list[str] | None) -> list[Field]:
    inherited = {f.name for base in cls.__mro__[1:] if is_dataclass(base) for f in fields(base)}
    every = [f for f in fields(cls) if names is None or f.name in names]
    return [f for f in every if f.name not in inherited] + [f for f in every if f.name in inherited]


def _default(f: Field) -> object:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None


_TYPES = {"int": "int", "float": "number", "bool": "bool", "str": "string", "dict": "mapping",
          "tuple[int, ...]": "list of int"}


def _type(annotation: str, unit: str, default: object) -> str:
    parts = [p.strip() for p in annotation.split("|")]
    nullable = "None" in parts
    parts = [p for p in parts if p != "None"]
    if unit == "bytes":
        shown = "size"
        if isinstance(default, str):  # a word besides sizes, such as "auto"
            shown += f" or `{default}`"
    else:
        shown = " or ".join(_TYPES.get(p, p) for p in parts)
    return shown + (" or null" if nullable else "")


def _show(value: object, unit: str) -> str:
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if unit == "bytes" and isinstance(value, int) and value:
        for suffix, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
            if value % (1 << shift) == 0:
                return f"`{value >> shift}{suffix}`"
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    if isinstance(value, tuple):
        return f"`{list(value)}`"
    return f"`{value!r}`"
