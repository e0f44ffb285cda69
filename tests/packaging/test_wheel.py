"""The built wheel, installed into a fresh venv, works with the engine: ``pip install "tiered_kv[vllm]"`` and
``[sglang]`` as a user does it, without the checkout.

What is built and how (fast and honest on a 2-core CI box with no wish to download vLLM again):

- the wheel is built from a copy of the sources (``pyproject.toml``, ``README.md``, ``LICENSE``,
  ``tiered_kv/``) with pip's own ``pip wheel --no-build-isolation`` (setuptools of the test's venv), so a
  stale ``build/`` in the checkout cannot leak into it;
- the venv is new (``python -m venv``) and gets exactly one package installed, the wheel. It sees the
  engine through a ``.pth`` line naming the test venv's site-packages, where vLLM 0.32 (or SGLang)
  is installed: the same view ``--system-site-packages`` gives of a system Python, but over the
  engine's venv. The checkout is on no path of it: ``tiered_kv`` must come from the wheel (checked);
- the install is ``--no-index --no-deps``, then every requirement the wheel declares for the extra
  (``tiered_kv[vllm]``: vLLM 0.26-0.33, prometheus-client, lmdb...) is checked against what that
  venv sees. pip's own resolver cannot do this check here: the engine venvs are built with recipes that
  drop some of the engines' declared dependencies on purpose (CPU torch: no torchvision/torchaudio;
  SGLang: ``--no-deps``), so it would try to download them.

Then, in that venv: ``tiered-kv --version`` and ``tiered-kv demo`` run from the console script, and
vLLM's real ``Scheduler`` builds the connector named only ``TieredKVConnector`` (the entry point's
plugin registered it; ``venv_checks.py`` says how), or SGLang's loader imports our backend.

Threading contract: test code; runs on pytest's thread.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKS = Path(__file__).with_name("venv_checks.py")
#: the README's short form, with a small CPU tier
SHORT_FORM = {"kv_connector": "TieredKVConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes": "1MiB"}}


def _version() -> str:
    import ast

    tree = ast.parse((ROOT / "tiered_kv" / "version.py").read_text())
    return next(n.value.value for n in tree.body if isinstance(n, ast.Assign)
                and any(getattr(t, "id", "") == "__version__" for t in n.targets))


def _env() -> dict:
    """The test's environment without anything that would put the checkout on the venv's path (PYTHONPATH keeps
    only entries without a ``tiered_kv`` package: ``scripts/cpu_stubs`` for SGLang)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    keep = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and not (Path(p).resolve() / "tiered_kv").exists()]
    if keep:
        env["PYTHONPATH"] = os.pathsep.join(str(Path(p).resolve()) for p in keep)
    env.setdefault("PYTHONHASHSEED", "0")
    return env


def _run(argv: list, cwd: Path, timeout: float = 300, env: dict | None = None) -> str:
    out = subprocess.run([str(a) for a in argv], cwd=cwd, env=env or _env(), capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, f"{argv[:3]} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a clean copy of the sources."""
    from importlib.metadata import version

    have = version("setuptools")
    assert int(have.split(".")[0]) >= 77, (f"building the wheel needs setuptools >= 77 (PEP 639 license fields; torch "
                                           f"requires it too), this venv has {have}: pip install -U setuptools")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "tiered_kv", src / "tiered_kv", ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", dist, src], cwd=src)
    (whl,) = dist.glob("tiered_kv-*.whl")
    return whl


def _venv_with(wheel: Path, root: Path) -> Path:
    """A new venv holding only ``wheel``, seeing this test venv's packages (the engine) through a .pth line."""
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=root)
    py = venv / "bin" / "python"
    purelib = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root).strip()
    Path(purelib, "engine_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-index", "--no-deps", wheel], cwd=root)
    return venv


def _check(venv: Path, cwd: Path, *args: str) -> dict:
    out = _run([venv / "bin" / "python", CHECKS, *args], cwd=cwd)
    return json.loads(out.strip().splitlines()[-1])


def _assert_installed_and_demo(venv: Path, extra: str, cwd: Path) -> None:
    found = _check(venv, cwd, "requirements", extra)
    assert found["from_wheel"], found  # not the checkout, not the engine venv's editable install
    assert found["version"] == _version()
    assert any(r.startswith(extra) for r in found["checked"]), found  # the extra's engine requirement was checked
    assert found["unmet"] == [], found
    assert _run([venv / "bin" / "tiered-kv", "--version"], cwd=cwd).split() == ["tiered-kv", _version()]
    demo = _run([venv / "bin" / "tiered-kv", "demo", "--blocks", "64", "--dir", cwd / "demo"], cwd=cwd)
    assert "bit-exact: True" in demo, demo


def test_wheel_metadata_declares_plugin_extras_license(wheel):
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        info = next(n for n in names if n.endswith(".dist-info/METADATA")).rsplit("/", 1)[0]
        meta = z.read(f"{info}/METADATA").decode()
        entry_points = z.read(f"{info}/entry_points.txt").decode()
    assert f"Version: {_version()}" in meta and "License-Expression: Apache-2.0" in meta
    assert f"{info}/licenses/LICENSE" in names
    for extra in ("vllm", "sglang"):
        assert f"Provides-Extra: {extra}" in meta
    assert "[vllm.general_plugins]\ntiered_kv = tiered_kv.connector.vllm.plugin:register" in entry_points
    assert "tiered-kv = tiered_kv.cli:main" in entry_points
    assert not [n for n in names if n.startswith("tests/")]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM lives in .venv (run there too)")
def test_wheel_in_fresh_venv_vllm_scheduler_builds_connector_by_name(wheel, tmp_path):
    venv = _venv_with(wheel, tmp_path)
    _assert_installed_and_demo(venv, "vllm", tmp_path)
    found = _check(venv, tmp_path, "vllm", str(ROOT), json.dumps(SHORT_FORM))
    assert found["from_wheel"] and found["class_from_wheel"], found
    assert found["module_path"] is None
    assert found["known_before_plugins"] is False  # the name comes from our entry point, nothing else
    assert found["class"] == "tiered_kv.connector.vllm.connector.TieredKVConnector"
    assert found["scheduler"] == "Scheduler" and found["scheduler_connector_is_class"], found
    assert found["hit_tokens_cpu"] == 8 * found["block_size"], found  # turn 2's 8 blocks loaded from the CPU tier
    assert found["verified_blocks"] > 0, found  # and checked bit for bit by the harness


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang lives in .venv-sglang (run there)")
def test_wheel_in_fresh_venv_sglang_loads_backend(wheel, tmp_path):
    venv = _venv_with(wheel, tmp_path)
    _assert_installed_and_demo(venv, "sglang", tmp_path)
    found = _check(venv, tmp_path, "sglang")
    assert found["from_wheel"] and found["class_from_wheel"] and found["is_hicache"], found
