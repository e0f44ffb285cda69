"""Size parsing and formatting."""
from __future__ import annotations

import pytest

from tiered_kv.errors import ConfigError
from tiered_kv.values.units import format_size, parse_size


def test_sizes():
    assert parse_size("64GiB") == 64 << 30 and parse_size("1.5 KB") == 1500 and parse_size(7) == 7
    for bad in ("12 parsecs", -1, True, "x"):
        with pytest.raises(ConfigError):
            parse_size(bad, "cpu_bytes")
    assert format_size(3 << 30) == "3.0 GiB"
