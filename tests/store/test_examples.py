"""The Python examples in examples/ run as a user would run them (CI keeps them true)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("args", [["examples/python_api.py"], ["examples/from_yaml.py", "examples/three_tier.yaml"]])
def test_example_runs(args, tmp_path):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bit-exact" in proc.stdout


def test_cli_demo_and_inspect(tmp_path):
    demo = subprocess.run([sys.executable, "-m", "tiered_kv.cli", "demo", "--blocks", "96", "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "bit-exact: True" in demo.stdout and "summary" in demo.stdout
    insp = subprocess.run([sys.executable, "-m", "tiered_kv.cli", "inspect", str(tmp_path / "kv"), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert insp.returncode == 0, insp.stderr
    assert '"records"' in insp.stdout and '"bad_headers": 0' in insp.stdout
