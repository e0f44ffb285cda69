"""The engine command lines in README.md (and docs) parse with the engines' own parsers and our validators,
so the documented commands stay true. Runs in whichever test environment has the engine installed:
the vLLM part in .venv, the SGLang part in .venv-sglang (scripts/run_tests.sh runs this file in both)."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _shell_blocks(text: str, needle: str) -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    return [b.replace("\\\n", " ") for b in blocks if needle in b]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM lives in .venv (run there too)")
def test_readme_vllm_serve_command_is_valid():
    from vllm.config import KVTransferConfig

    from tiered_kv.connector.vllm.config import ConnectorConfig

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from tiered_kv.connector.vllm.connector import TieredKVConnector
    from tiered_kv.connector.vllm.plugin import register

    (block,) = _shell_blocks(README, "vllm serve")
    argv = shlex.split(block.strip())
    raw = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    ktc = KVTransferConfig(**raw)
    # the short form: the name alone, which the installed package's vLLM plugin registers
    assert ktc.kv_connector == "TieredKVConnector" and ktc.kv_connector_module_path is None
    register()
    assert KVConnectorFactory.get_connector_class(ktc) is TieredKVConnector
    cfg = ConnectorConfig.from_extra_config(ktc.kv_connector_extra_config)
    assert cfg.disk_path == "/nvme/kv"


def _launch_argv(source: str, tmp_path: Path) -> list[list[str]]:
    """argv lists after ``sglang.launch_server`` in a doc's bash blocks, or as the example script runs it."""
    if source.endswith(".sh"):  # run the script with a stand-in `python` that prints the argv it got
        fake = tmp_path / "python"
        fake.write_text("#!/usr/bin/env python3\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
        fake.chmod(0o755)
        out = subprocess.run(["bash", str(ROOT / source), "MODEL", "/tmp/kv"], capture_output=True, text=True,
                             env=dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}"), timeout=60)
        assert out.returncode == 0, out.stderr
        return [json.loads(out.stdout)[2:]]  # drop "-m sglang.launch_server"
    argvs = []
    for block in _shell_blocks((ROOT / source).read_text(), "sglang.launch_server"):
        argv = shlex.split(block.strip())
        argvs.append(argv[argv.index("sglang.launch_server") + 1:])
    return argvs


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang lives in .venv-sglang (run there)")
@pytest.mark.parametrize("source", ["README.md", "docs/sglang.md", "examples/sglang_launch.sh"])
def test_sglang_launch_commands_parse(source, tmp_path):
    import argparse

    from sglang.srt.server_args import ServerArgs

    from tiered_kv.connector.sglang.config import SGLangBackendConfig

    argvs = _launch_argv(source, tmp_path)
    assert argvs, f"no launch command in {source}"
    for argv in argvs:
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        args = parser.parse_args(argv)
        assert args.hicache_storage_backend == "dynamic" and args.enable_hierarchical_cache
        extra = json.loads(args.hicache_storage_backend_extra_config)
        assert extra["module_path"] == "tiered_kv.connector.sglang" and extra["class_name"] == "TieredHiCacheStorage"
        SGLangBackendConfig.from_extra_config(extra)  # our keys validate (SGLang's own are accepted)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM lives in .venv (run there too)")
def test_vllm_host_pool_commands_are_valid():
    """docs/vllm.md, "One host pool for several replicas": two replicas, one GPU and port each, one pool of one
    size, with configs the connector accepts."""
    from vllm.config import KVTransferConfig

    from tiered_kv.connector.vllm.config import ConnectorConfig

    (block,) = _shell_blocks((ROOT / "docs" / "vllm.md").read_text(), '"cpu_pool"')
    lines = [line for line in block.strip().splitlines() if "vllm serve" in line]
    assert len(lines) == 2
    seen = []
    for line in lines:
        argv = shlex.split(line.rstrip("& "))
        env = dict(a.split("=", 1) for a in argv[:argv.index("vllm")])
        raw = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        cfg = ConnectorConfig.from_extra_config(KVTransferConfig(**raw).kv_connector_extra_config)
        seen.append((env["CUDA_VISIBLE_DEVICES"], argv[argv.index("--port") + 1], cfg.cpu_pool, cfg.cpu_bytes))
        assert env["PYTHONHASHSEED"] == "0" and raw["kv_load_failure_policy"] == "recompute"
    (gpu_a, port_a, pool_a, size_a), (gpu_b, port_b, pool_b, size_b) = seen
    assert gpu_a != gpu_b and port_a != port_b and pool_a == pool_b == "host:kv" and size_a == size_b
