"""``tiered-kv bench --ranges-sweep``: every reader x groups x busy cell runs, reads the records back bit-exact (the
sweep asserts it) and lands in the table and the JSON."""
from __future__ import annotations

import json

from tiered_kv.cli import bench
from tiered_kv.tiers.disk.aio import aio_available


def test_the_sweep_reads_every_cell_and_writes_its_table_and_json(tmp_path, capsys):
    res = bench.ranges_sweep(tmp_path, 4 << 20, readers=(("threads", 4), ("aio", 16)), groups=(4, 2),
                             busy=(False, True), record_mib=1)
    kinds = {"threads"} | ({"aio"} if aio_available() else set())
    cells = {(c["reader"], c["groups"], c["busy_python_thread"]) for c in res["cells"]}
    assert cells == {(k, g, b) for k in kinds for g in (4, 2) for b in (False, True)}
    assert all(c["read_GBps"] > 0 and c["range_bytes"] == (1 << 20) // 16 // c["groups"] for c in res["cells"])
    assert set(res["raw"]) == {4, 16} and res["records"] == 4
    table = bench.sweep_table(res)
    assert table.count("\n| ") == len(res["cells"]) + 1  # header + one row per cell

    out = tmp_path / "s.json"
    assert bench.main(["--ranges-sweep", "--total-mib", "64", "--dir", str(tmp_path / "d"), "--json", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["command"].startswith("tiered-kv bench --ranges-sweep") and saved["cells"]
    assert "busy Python thread" in capsys.readouterr().out
