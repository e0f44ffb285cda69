"""The integrity check's child process finds ``lmdb`` where its parent did, and a child without ``lmdb``
is a skipped check, never damage.

Seen on the GPU machine (2026-11-23): SGLang's engine ran with ``PYTHONPATH=/tmp/sglang-site``, the only
place ``lmdb`` was installed; the check's ``python -I`` child ignores ``PYTHONPATH``, failed to import
``lmdb``, and the second engine moved a sound disk tier aside as damaged. These tests rebuild that with a
bare virtual environment (no packages) whose only ``lmdb`` comes through ``PYTHONPATH``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import lmdb
import pytest

from tests.reliability._common import SHAPE
from tiered_kv.tiers.disk import DiskTier
from tiered_kv.values.layout import BlockLayout
from tiered_kv.tiers.disk import check as check_mod

CHECK_PY = Path(check_mod.__file__).resolve()

# runs check.py's check_index by file path, so the bare interpreter needs no tiered_kv (nor its imports)
RUNNER = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("tkv_check", sys.argv[1])
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
print(json.dumps(m.check_index(sys.argv[2])))
"""


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> str:
    """A virtual environment with nothing installed (no lmdb)."""
    root = tmp_path_factory.mktemp("bare-venv")
    venv.EnvBuilder(with_pip=False, system_site_packages=False).create(root)
    py = root / "bin" / "python"
    probe = subprocess.run([str(py), "-c", "import lmdb"], capture_output=True)
    if probe.returncode == 0:  # the base interpreter itself has lmdb: this set-up cannot show anything
        pytest.fail(f"{py} imports lmdb without PYTHONPATH; the test needs an interpreter without it")
    return str(py)


def _sound_index(tmp_path: Path) -> Path:
    tier = DiskTier(BlockLayout(SHAPE, "bfloat16"), tmp_path / "disk", 4 << 20)
    tier.close()
    return tmp_path / "disk" / "index"


def _run(py: str, idx: Path, pythonpath: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    r = subprocess.run([py, "-c", RUNNER, str(CHECK_PY), str(idx)], capture_output=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    return json.loads(r.stdout.decode().strip().splitlines()[-1])


def test_lmdb_only_on_pythonpath_is_found_by_the_isolated_child(tmp_path, bare_python):
    site = tmp_path / "site"
    site.mkdir()
    (site / "lmdb").symlink_to(Path(lmdb.__file__).resolve().parent, target_is_directory=True)
    report = _run(bare_python, _sound_index(tmp_path), str(site))
    assert report["ok"] is True, report
    assert not report.get("skipped"), report
    assert report["entries"], report  # it really walked the databases


def test_no_lmdb_in_the_child_is_a_skipped_check_not_damage(tmp_path, bare_python):
    report = _run(bare_python, _sound_index(tmp_path), None)
    assert report["ok"] is True and report.get("skipped") is True, report
    assert "lmdb" in report["error"], report


def test_the_child_command_names_where_this_process_found_lmdb():
    cmd = check_mod.child_command("x")
    assert cmd[:3] == [sys.executable, "-I", str(CHECK_PY)]
    assert cmd[3] == "--lmdb-from" and Path(cmd[4]) == Path(lmdb.__file__).resolve().parent.parent
    assert cmd[-1] == "x"


GROW = """
import lmdb, sys
env = lmdb.open(sys.argv[1], map_size=1 << 30, max_dbs=16, subdir=True)
meta = env.open_db(b"meta", create=False)
with env.begin(write=True, db=meta) as txn:
    txn.put(b"__grown_by_another_process__", b"x" * (4 << 20))
with env.begin(write=True, db=meta) as txn:
    txn.delete(b"__grown_by_another_process__")
env.close()
"""


def test_a_store_another_process_grows_during_the_check_is_not_truncated(tmp_path, monkeypatch):
    """Another process sharing the directory commits (and grows data.mdb by 4 MiB) while the check has
    the index open: the check must not call the live file truncated. Found in the four-process sharing
    test (2026-11-23): the child measured the file before reading the meta page, a commit landed in
    between, and the worker moved the whole shared directory aside as damaged."""
    idx = _sound_index(tmp_path)
    before = (idx / "data.mdb").stat().st_size
    real_open = lmdb.open
    grown = []

    def open_then_grow(path, **kw):
        env = real_open(path, **kw)
        if kw.get("readonly") and not grown:  # the check's first, read-only open: the other process commits now
            subprocess.run([sys.executable, "-c", GROW, str(path)], check=True, timeout=60)
            grown.append((idx / "data.mdb").stat().st_size)
        return env

    monkeypatch.setattr(lmdb, "open", open_then_grow)
    report = check_mod._walk(idx)
    assert grown and grown[0] >= before + (4 << 20), (before, grown)  # the file really grew mid-check
    assert report["ok"] is True, report
    assert report["index_bytes"] >= grown[0], report
