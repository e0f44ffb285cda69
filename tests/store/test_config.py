"""StoreConfig: strict keys, validated values, YAML and JSON files."""
from __future__ import annotations

import pytest

from tiered_kv.errors import ConfigError
from tiered_kv.store.config import StoreConfig


def test_config_strict():
    with pytest.raises(ConfigError, match="cpu_byte") as e:
        StoreConfig.from_dict({"cpu_byte": "1GiB"})
    assert "cpu_bytes" in str(e.value)  # lists the valid keys
    cfg = StoreConfig.from_dict({"cpu_bytes": "2MiB", "block_shape": [2, 8], "dtype": "bf16"})
    assert cfg.cpu_bytes == 2 << 20 and cfg.dtype == "bfloat16" and cfg.block_shape == (2, 8)
    for bad in ({"eviction": "mru"}, {"dtype": "float64"}, {"block_shape": [0, 2]}, {"page_size": 0},
                {"cpu_bytes": 0, "gpu_bytes": 0}, {"promote_on_hit": "yes"}):
        with pytest.raises(ConfigError):
            StoreConfig.from_dict(bad)


def test_config_from_yaml_and_json(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("cpu_bytes: 4MiB\neviction: s3fifo\n")
    assert StoreConfig.from_file(y).eviction == "s3fifo"
    j = tmp_path / "c.json"
    j.write_text('{"cpu_bytes": "1MiB", "nope": 1}')
    with pytest.raises(ConfigError, match="nope"):
        StoreConfig.from_file(j)
