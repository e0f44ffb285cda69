"""TieredStore with the remote tier on a real Redis Cluster: two "hosts" (processes with their own CPU and
disk tiers) share blocks bit-exact; a node killed mid-run gives misses, never errors, and hits again once it
is back; two namespaces never read each other; remote_write "evict" writes only what leaves the tiers above."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests._redis import PASSWORD_ENV
from tiered_kv.errors import ConfigError
from tiered_kv.store.config import StoreConfig
from tiered_kv.store.tiered_store import TieredStore

WORKER = Path(__file__).with_name("_remote_worker.py")
SHAPE = (2, 4, 8, 64)


def run_host(role: str, path: Path, url: str, n: int, seed: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    r = subprocess.run([sys.executable, str(WORKER), role, str(path), url, str(n), str(seed)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("DONE ")][-1]
    return json.loads(line[5:])


def test_two_hosts_share_blocks_bit_exact_through_the_remote_tier(redis_cluster, tmp_path):
    a = run_host("write", tmp_path / "host-a", redis_cluster.url, 12, 1234)
    assert a == {"accepted": 12, "drained": True, "remote": 12}
    b = run_host("read", tmp_path / "host-b", redis_cluster.url, 12, 1234)
    assert b["caught_up"] and b["held"] == ["remote"] * 12
    assert b["served"] == 12 and b["exact"] == 12 and b["remote_hits"] == 12


def store_cfg(cluster, **over) -> dict:
    cfg = dict(block_shape=list(SHAPE), dtype="bfloat16", model=f"m-{time.monotonic_ns()}", cpu_bytes=2 * 8192,
               remote_url=cluster.url, remote_password_env=PASSWORD_ENV, remote_timeout_s=1.0,
               remote_connect_timeout_s=0.3)
    cfg.update(over)
    return cfg


def blocks(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *SHAPE), generator=g).to(torch.bfloat16)


def test_a_node_killed_mid_run_gives_misses_then_hits_again(redis_cluster):
    with TieredStore(store_cfg(redis_cluster)) as store:
        keys = [bytes([i]) * 32 for i in range(24)]
        data = blocks(24, 5)
        assert all(store.put(keys, data).wait(30)) and store.drain(30)
        assert store.locate(keys).count("remote") >= 22  # the CPU tier holds 2
        remote = store.tiers[-1]
        owner = [remote.client._node_of(remote.redis_key(k)).port for k in keys]
        victim_port = next(owner[i] for i, t in enumerate(store.locate(keys)) if t == "remote")
        victim = redis_cluster.ports.index(victim_port)
        redis_cluster.stop(victim)
        try:
            out = torch.zeros((1, *SHAPE), dtype=torch.bfloat16)
            for _ in range(2):
                for i, k in enumerate(keys):
                    where = store.locate([k])[0]
                    n = store.get([k], out).wait(10)  # never raises
                    if where == "remote" and owner[i] == victim_port:
                        assert n == 0
                    else:
                        assert n == 1 and torch.equal(out[0], data[i])
            assert store.stats()["tiers"]["remote"]["failed_transfers"] > 0
        finally:
            redis_cluster.start(victim)
            redis_cluster.wait_ok()
        deadline = time.monotonic() + 20
        served = 0
        while time.monotonic() < deadline:  # the node is back (empty: the test cluster keeps no data on disk)
            served = 0
            for i, k in enumerate(keys):
                if store.get([k], out).wait(10) == 1:
                    assert torch.equal(out[0], data[i])
                    served += 1
            # until every block of the restarted node was read there and found gone (one found gone is not enough:
            # the node may have answered only part of a pass, the rest skipped while it was still marked down)
            if served == 24 or all(store.locate([k])[0] != "remote" for k, o in zip(keys, owner) if o == victim_port):
                break
            time.sleep(0.3)
        lost = [k for k in keys if store.locate([k])[0] is None]
        assert all(owner[keys.index(k)] == victim_port for k in lost)
        assert all(store.put(lost, data[[keys.index(k) for k in lost]]).wait(30)) and store.drain(30)
        got = torch.zeros_like(data)
        assert store.get(keys, got).wait(30) == 24 and torch.equal(got, data)  # hits again, bit-exact


def test_two_namespaces_never_read_each_other(redis_cluster):
    with TieredStore(store_cfg(redis_cluster, model="ns-a")) as a, \
            TieredStore(store_cfg(redis_cluster, model="ns-b")) as b:
        keys = [bytes([7, i]) * 16 for i in range(6)]
        assert all(a.put(keys, blocks(6)).wait(30)) and a.drain(30)
        assert b.wait_remote_sync(10)
        time.sleep(0.3)
        assert b.contains(keys) == [False] * 6
        assert b.get(keys, torch.zeros((6, *SHAPE), dtype=torch.bfloat16)).wait(10) == 0
        assert b.tiers[-1].has(keys) == [False] * 6 and a.tiers[-1].has(keys) == [True] * 6


def test_remote_write_evict_writes_only_what_leaves_the_tiers_above(redis_cluster):
    with TieredStore(store_cfg(redis_cluster, remote_write="evict")) as store:
        keys = [bytes([9, i]) * 16 for i in range(5)]
        assert all(store.put(keys, blocks(5)).wait(30)) and store.drain(30)
        where = store.locate(keys)
        assert where.count("cpu") == 2 and where.count("remote") == 3  # demoted ones only
        assert store.tiers[-1].has(keys) == [w == "remote" for w in where]


def test_remote_config_keys_are_checked():
    with pytest.raises(ConfigError, match="remote_write"):
        StoreConfig(remote_url="redis://127.0.0.1:1", remote_write="sometimes")
    with pytest.raises(ConfigError, match="remote_password_env"):
        StoreConfig(remote_url="redis://:secret@127.0.0.1:1")
    with pytest.raises(ConfigError, match="op_timeout_s"):
        StoreConfig(remote_url="redis://127.0.0.1:1", remote_timeout_s=0)
