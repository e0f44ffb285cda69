"""``tiered-kv inspect redis://...``: what the fleet's remote tier holds per namespace, read from a real Redis Cluster."""
from __future__ import annotations

import json

import torch

from tests._redis import PASSWORD_ENV
from tiered_kv import TieredStore
from tiered_kv.cli.fleet import fleet_report
from tiered_kv.cli.main import main
from tiered_kv.values.record import HEADER_LEN

SHAPE = (2, 4, 64)


def _store(cluster, model: str) -> TieredStore:
    return TieredStore(dict(block_shape=list(SHAPE), dtype="float32", model=model, cpu_bytes=4 * 2048,
                            remote_url=cluster.url, remote_password_env=PASSWORD_ENV))


def test_report_counts_blocks_and_bytes_per_namespace(redis_cluster):
    redis_cluster.flush()
    with _store(redis_cluster, "fleet-a") as a, _store(redis_cluster, "fleet-b") as b:
        for store, n in ((a, 10), (b, 3)):
            keys = [bytes([i]) * 32 for i in range(n)]
            assert all(store.put(keys, torch.randn((n, *SHAPE))).wait(30)) and store.drain(30)
        ns_a, ns_b, fp = a.namespace.prefix.hex(), b.namespace.prefix.hex(), f"{a.layout.fingerprint:016x}"
    rep = fleet_report(redis_cluster.url, password_env=PASSWORD_ENV)
    assert set(rep["namespaces"]) == {ns_a, ns_b}
    block = HEADER_LEN + 2048
    assert rep["namespaces"][ns_a]["blocks"] == 10 and rep["namespaces"][ns_a]["bytes"] == 10 * block
    assert rep["namespaces"][ns_b]["blocks"] == 3 and rep["namespaces"][ns_b]["bytes"] == 3 * block
    assert rep["namespaces"][ns_a]["layouts_sampled"] == {fp: 8}  # verified headers of a sample
    assert rep["namespaces"][ns_a]["presence_entries"] >= 1  # the writes were announced to the fleet
    assert len(rep["nodes"]) == 3 and sum(n["keys"] for n in rep["nodes"]) >= 13
    assert all(n["policy"] == "allkeys-lru" for n in rep["nodes"]) and not rep["partial"]


def test_cli_table_and_json(redis_cluster, capsys):
    redis_cluster.flush()
    with _store(redis_cluster, "fleet-cli") as s:
        assert all(s.put([b"k" * 32], torch.randn((1, *SHAPE))).wait(30)) and s.drain(30)
        ns = s.namespace.prefix.hex()
    assert main(["inspect", redis_cluster.url, "--password-env", PASSWORD_ENV]) == 0
    out = capsys.readouterr().out
    assert "namespaces (what the fleet holds)" in out and ns in out and "allkeys-lru" in out
    assert main(["inspect", redis_cluster.url, "--password-env", PASSWORD_ENV, "--json", "--max-keys", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["partial"] is True


def test_refused_credentials_name_the_variable(redis_cluster, monkeypatch, capsys):
    monkeypatch.setenv("TKV_WRONG_PW", "nope")
    assert main(["inspect", redis_cluster.url, "--password-env", "TKV_WRONG_PW"]) == 2
    assert "TKV_WRONG_PW" in capsys.readouterr().out
