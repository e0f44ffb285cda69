"""``benchmarks/probes/probe_report.emit``: the table and JSON every GPU probe writes (runs on the CPU)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "probes"))

from probe_report import emit  # noqa: E402


def test_emit_prints_a_table_and_writes_the_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    rows = [{"kind": "a", "gbps": 55.1}, {"kind": "b", "error": "no CUDA"}]
    path = emit("some_probe", rows, ["kind", "gbps"], thp="never")
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["| kind | gbps |", "|---|---|", "| a | 55.1 |", "| b | no CUDA |"]
    data = json.loads(path.read_text())
    assert path == tmp_path / "out" / "some_probe.json"
    assert data["rows"] == rows and data["thp"] == "never"
    assert data["command"] == "python3 benchmarks/probes/some_probe.py" and data["device"]
