"""The vLLM general plugin: registers ``TieredKVConnector`` by name, idempotently, and is harmless without vLLM.

The end-to-end path (the wheel's entry point, loaded by vLLM's own ``load_general_plugins`` in a fresh
venv, then vLLM's Scheduler building the connector by name) is ``tests/packaging/test_wheel.py``.
"""
from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402

from tiered_kv.connector.vllm import plugin  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


def test_pyproject_declares_the_entry_point():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    group = meta["project"]["entry-points"]["vllm.general_plugins"]
    assert group == {plugin.PLUGIN_NAME: "tiered_kv.connector.vllm.plugin:register"}


def test_register_makes_the_name_resolve_and_is_idempotent():
    plugin.register()  # True, or False when an earlier test in this process (or vLLM's plugin loader) did it
    assert plugin.register() is False  # a second call is a no-op, not vLLM's "already registered" error
    named = KVTransferConfig(kv_connector="TieredKVConnector", kv_role="kv_both")
    by_path = KVTransferConfig(kv_connector="TieredKVConnector", kv_connector_module_path="tiered_kv.connector.vllm",
                               kv_role="kv_both")
    from tiered_kv.connector.vllm.connector import TieredKVConnector

    assert KVConnectorFactory.get_connector_class(named) is TieredKVConnector
    assert KVConnectorFactory.get_connector_class(by_path) is TieredKVConnector  # the module-path form still works


def test_register_without_vllm_returns_false(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm.distributed.kv_transfer.kv_connector.factory", None)  # import fails
    assert plugin.register() is False
