"""Parsing and printing of byte sizes ("64GiB", "1.5 GB", 4096).

Threading contract: pure functions, safe from any thread.
"""
from __future__ import annotations

import re

from tiered_kv.errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str, name: str = "size") -> int:
    """Return ``value`` as a byte count. Accepts ints and strings like ``"64GiB"``, ``"1.5GB"``, ``"512 MiB"``.

    Raises ConfigError naming ``name`` for negative numbers, bools and unknown units.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a size such as 4096 or '64GiB', got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ConfigError(f"{name}: expected a finite size, got {value!r}")
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(
                f"{name}: cannot parse size {value!r}; use a number with an optional unit "
                f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '64GiB'")
        f = float(m.group(1)) * _UNITS[m.group(2).lower()]
        if f != f or f == float("inf"):
            raise ConfigError(f"{name}: size {value[:40]!r}... is too large")
        n = int(f)
    else:
        raise ConfigError(f"{name}: expected a size such as 4096 or '64GiB', got {type(value).__name__} {value!r}")
    if n < 0:
        raise ConfigError(f"{name}: size must be >= 0, got {value!r}")
    return n


def format_size(n: int | float) -> str:
    """Human-readable binary size, e.g. ``format_size(3 << 30) == '3.0 GiB'``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
