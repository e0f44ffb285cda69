"""A real Redis Cluster for the tests: three masters with a password on 127.0.0.1, started once per session.

``redis_cluster`` (session fixture) starts ``redis-server`` (Debian's package; ``scripts/setup_venvs.sh``
installs it) three times in cluster mode on free loopback ports, joins them with ``redis-cli --cluster
create``, waits for ``cluster_state:ok`` and stops every process at the end. Each node has
``requirepass``/``masterauth``, ``maxmemory`` with ``allkeys-lru`` (Redis owns the remote tier's
capacity) and ``cluster-require-full-coverage no``, so a killed node turns only its own slots into
misses. ``stop(i)``/``start(i)`` kill and restart one node for the fault tests (it keeps its slots:
its ``nodes.conf`` survives). Without ``redis-server`` the remote tests are skipped with a message
that says how to install it; under ``CI`` or ``scripts/run_tests.sh`` (``TKV_REQUIRE_REDIS``) they fail.

Threading contract: test code; one cluster per pytest session, used from the test thread.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

PASSWORD = "tkv-test-secret"
PASSWORD_ENV = "TKV_TEST_REDIS_PASSWORD"


def _free_port() -> int:
    """A loopback port that is free together with its cluster-bus port (+10000)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a Redis cluster node")


class RedisCluster:
    """Three Redis masters on 127.0.0.1 (processes this object started and stops)."""

    def __init__(self, root: Path, masters: int = 3, maxmemory: str = "256mb") -> None:
        self.root = root
        self.ports = [_free_port() for _ in range(masters)]
        self.maxmemory = maxmemory
        self.procs: list[subprocess.Popen | None] = [None] * masters
        self.password = PASSWORD

    @property
    def url(self) -> str:
        """The seed-node list as the ``remote_url`` config key takes it."""
        return ",".join(f"redis://127.0.0.1:{p}" for p in self.ports)

    def start(self, i: int) -> None:
        """Start node ``i`` (again): same port, same directory, same cluster identity."""
        d = self.root / f"node{i}"
        d.mkdir(parents=True, exist_ok=True)
        port = self.ports[i]
        args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d),
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "1500",
                "--cluster-require-full-coverage", "no", "--requirepass", self.password, "--masterauth", self.password,
                "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru", "--save", "", "--appendonly", "no",
                "--protected-mode", "yes", "--logfile", str(d / "redis.log")]
        self.procs[i] = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ping(i)

    def stop(self, i: int) -> None:
        """Kill node ``i`` (SIGKILL: a crash, not a shutdown)."""
        p = self.procs[i]
        if p is not None and p.poll() is None:
            p.kill()
            p.wait(10)
        self.procs[i] = None

    def cli(self, i: int, *args: str, check: bool = True) -> str:
        """Run ``redis-cli`` against node ``i`` (password passed in the environment, not argv)."""
        env = dict(os.environ, REDISCLI_AUTH=self.password)
        r = subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(self.ports[i]), *args], env=env,
                           capture_output=True, text=True, timeout=30)
        if check and r.returncode != 0:
            raise RuntimeError(f"redis-cli {' '.join(args)} failed: {r.stderr or r.stdout}")
        return r.stdout

    def _wait_ping(self, i: int, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.procs[i] is not None and self.procs[i].poll() is not None:
                log = (self.root / f"node{i}" / "redis.log")
                raise RuntimeError(f"redis-server node {i} exited: {log.read_text()[-2000:] if log.exists() else ''}")
            if self.cli(i, "ping", check=False).strip() == "PONG":
                return
            time.sleep(0.05)
        raise RuntimeError(f"redis-server node {i} on port {self.ports[i]} did not answer within {timeout} s")

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Wait until every running node reports ``cluster_state:ok`` and knows every slot."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = [self.cli(i, "cluster", "info", check=False) for i, p in enumerate(self.procs) if p is not None]
            if states and all("cluster_state:ok" in s and "cluster_slots_assigned:16384" in s for s in states):
                return
            time.sleep(0.1)
        raise RuntimeError(f"Redis cluster not ok after {timeout} s")

    def create(self) -> None:
        """Start every node and join them into one cluster of masters (no replicas)."""
        for i in range(len(self.ports)):
            self.start(i)
        env = dict(os.environ, REDISCLI_AUTH=self.password)
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        r = subprocess.run(["redis-cli", "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
                           env=env, capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {r.stdout[-2000:]} {r.stderr[-2000:]}")
        self.wait_ok()

    def flush(self) -> None:
        """Drop every key on every running node."""
        for i, p in enumerate(self.procs):
            if p is not None:
                self.cli(i, "flushall")

    def close(self) -> None:
        """Stop every node and remove the directory."""
        for i in range(len(self.procs)):
            self.stop(i)
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """A running 3-master Redis Cluster with a password; the password is also in ``$TKV_TEST_REDIS_PASSWORD``."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        msg = "redis-server is not installed: run scripts/setup_venvs.sh (it runs apt-get install redis-server)"
        if os.environ.get("CI") or os.environ.get("TKV_REQUIRE_REDIS"):
            pytest.fail(msg)  # CI and scripts/run_tests.sh never skip the remote tier for want of Redis
        pytest.skip(msg)
    cluster = RedisCluster(tmp_path_factory.mktemp("redis"))
    try:
        cluster.create()
    except BaseException:
        cluster.close()
        raise
    old = os.environ.get(PASSWORD_ENV)
    os.environ[PASSWORD_ENV] = cluster.password
    try:
        yield cluster
    finally:
        if old is None:
            os.environ.pop(PASSWORD_ENV, None)
        else:
            os.environ[PASSWORD_ENV] = old
        cluster.close()
