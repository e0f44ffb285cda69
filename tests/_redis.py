"""Real Redis Clusters for the tests, on 127.0.0.1, each started once per session and stopped at its end.

``redis_cluster``: three masters with a password, no replicas. ``redis_replicas``: three masters and three
replicas (``--cluster-replicas 1``, node timeout 1 s), for failover tests; ``replica_cluster`` hands it to a
test healed (every node running, each master with a synced replica). ``redis_tls``: three masters speaking
only TLS (``rediss://``; a CA and node certificates made by ``make_tls_files`` with the ``openssl`` command,
and a second CA that did not sign them).

``RedisCluster`` starts ``redis-server`` (Debian's package; ``scripts/setup_venvs.sh`` installs it) once per
node in cluster mode on free loopback ports, joins the nodes with ``redis-cli --cluster create``, waits for
``cluster_state:ok`` and stops every process at the end. Each node has ``requirepass``/``masterauth``,
``maxmemory`` with ``allkeys-lru`` (Redis owns the remote tier's capacity), ``cluster-require-full-coverage
no`` (a dead master turns only its own slots into misses) and no persistence, so a restarted node comes back
empty. Faults: ``stop(i)`` (SIGKILL) and ``start(i)`` (the same port and cluster identity: its
``nodes.conf`` survives), ``pause(i)``/``resume(i)`` (SIGSTOP/SIGCONT: a node cut off by a partition).
Without ``redis-server`` the remote tests are skipped with a message that says how to install it; under
``CI`` or ``scripts/run_tests.sh`` (``TKV_REQUIRE_REDIS``) they fail.

Threading contract: test code; each cluster is driven from the test thread.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

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


class TlsFiles(NamedTuple):
    """PEM files of a test CA and of the certificate (and key) it signed for the nodes."""

    ca: Path
    cert: Path
    key: Path


def _openssl(*args: str) -> None:
    r = subprocess.run(["openssl", *args], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {r.stderr[-2000:]}")


def make_tls_files(root: Path, name: str) -> TlsFiles:
    """A fresh CA ``name`` and a node certificate it signed for 127.0.0.1 and localhost (EC P-256 keys, 2 days).

    The node certificate serves as the nodes' server and cluster-bus client certificate alike."""
    root.mkdir(parents=True, exist_ok=True)
    ca, ca_key = root / f"{name}.crt", root / f"{name}.key"
    cert, key, csr, ext = root / f"{name}-node.crt", root / f"{name}-node.key", root / f"{name}-node.csr", \
        root / f"{name}-node.ext"
    curve = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *curve, "-keyout", str(ca_key), "-out", str(ca), "-days", "2",
             "-subj", f"/CN=tkv test CA {name}", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    _openssl("req", *curve, "-keyout", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1")
    ext.write_text("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyAgreement\n"
                   "extendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n"
                   "authorityKeyIdentifier=keyid\nsubjectKeyIdentifier=hash\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
             "-out", str(cert), "-days", "2", "-extfile", str(ext))
    for f in (ca_key, key):
        f.chmod(0o600)
    return TlsFiles(ca, cert, key)


class RedisCluster:
    """Redis masters (and replicas) on 127.0.0.1: processes this object started and stops.

    ``replicas`` per master (``--cluster-replicas``); ``node_timeout_ms`` is how long the others wait before
    they fail a silent node over; ``tls`` makes every node speak only TLS (clients, replication, cluster bus).
    """

    def __init__(self, root: Path, masters: int = 3, maxmemory: str = "256mb", replicas: int = 0,
                 node_timeout_ms: int = 1500, tls: TlsFiles | None = None) -> None:
        self.root = root
        self.masters = masters
        self.replicas = replicas
        n = masters * (1 + replicas)
        self.ports = [_free_port() for _ in range(n)]
        self.maxmemory = maxmemory
        self.node_timeout_ms = node_timeout_ms
        self.tls = tls
        self.procs: list[subprocess.Popen | None] = [None] * n
        self.paused: set[int] = set()
        self.password = PASSWORD
        self.wrong_ca: Path | None = None  # a CA that did not sign the nodes' certificates (TLS tests)

    @property
    def url(self) -> str:
        """The seed-node list as the ``remote_url`` config key takes it."""
        scheme = "rediss" if self.tls else "redis"
        return ",".join(f"{scheme}://127.0.0.1:{p}" for p in self.ports)

    def _tls_args(self) -> list[str]:
        t = self.tls
        return [] if t is None else ["--port", "0", "--tls-port", "PORT", "--tls-cert-file", str(t.cert),
                                     "--tls-key-file", str(t.key), "--tls-ca-cert-file", str(t.ca),
                                     "--tls-auth-clients", "no", "--tls-cluster", "yes", "--tls-replication", "yes"]

    def start(self, i: int) -> None:
        """Start node ``i`` (again): same port, same directory, same cluster identity, no data."""
        d = self.root / f"node{i}"
        d.mkdir(parents=True, exist_ok=True)
        port = self.ports[i]
        listen = [a.replace("PORT", str(port)) for a in self._tls_args()] or ["--port", str(port)]
        args = ["redis-server", *listen, "--bind", "127.0.0.1", "--dir", str(d),
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms),
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
        self.paused.discard(i)

    def pause(self, i: int) -> None:
        """Stop node ``i`` with SIGSTOP: it keeps its sockets but answers nothing (a network partition)."""
        self.procs[i].send_signal(signal.SIGSTOP)
        self.paused.add(i)

    def resume(self, i: int) -> None:
        """SIGCONT a paused node: it answers again (and learns what the cluster decided meanwhile)."""
        self.procs[i].send_signal(signal.SIGCONT)
        self.paused.discard(i)

    def live(self) -> list[int]:
        """Nodes running and not paused."""
        return [i for i, p in enumerate(self.procs) if p is not None and p.poll() is None and i not in self.paused]

    def cli(self, i: int, *args: str, check: bool = True) -> str:
        """Run ``redis-cli`` against node ``i`` (password passed in the environment, not argv)."""
        env = dict(os.environ, REDISCLI_AUTH=self.password)
        tls = [] if self.tls is None else ["--tls", "--cacert", str(self.tls.ca)]
        r = subprocess.run(["redis-cli", *tls, "-h", "127.0.0.1", "-p", str(self.ports[i]), *args], env=env,
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

    # ------------------------------------------------------------------ topology
    def nodes(self) -> list[dict]:
        """``CLUSTER NODES`` as a live node sees it: per node its index here, id, flags, master id and slots."""
        text = self.cli(self.live()[0], "cluster", "nodes")
        out = []
        for line in text.splitlines():
            f = line.split()
            if len(f) < 8 or "@" not in f[1]:  # not a node line: an error ("LOADING ..." while a replica syncs)
                continue
            port = int(f[1].split("@")[0].rsplit(":", 1)[-1] or 0)
            if port not in self.ports:  # a node whose address is not known yet (noaddr)
                continue
            out.append({"index": self.ports.index(port), "id": f[0], "flags": set(f[2].split(",")),
                        "master": None if f[3] == "-" else f[3], "slots": f[8:]})
        return out

    def serving(self) -> list[int]:
        """Nodes that are masters serving slots now (by a live node's view)."""
        return sorted(n["index"] for n in self.nodes() if "master" in n["flags"] and "fail" not in n["flags"]
                      and n["slots"])

    def replica_of(self, i: int) -> int | None:
        """The node that replicates master ``i`` (None without one)."""
        ids = {n["index"]: n["id"] for n in self.nodes()}
        return next((n["index"] for n in self.nodes() if n["master"] == ids[i]), None)

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Wait until every live node reports ``cluster_state:ok`` and knows every slot."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = [self.cli(i, "cluster", "info", check=False) for i in self.live()]
            if states and all("cluster_state:ok" in s and "cluster_slots_assigned:16384" in s for s in states):
                return
            time.sleep(0.1)
        raise RuntimeError(f"Redis cluster not ok after {timeout} s")

    def wait_failover(self, dead: int, timeout: float = 30.0) -> float:
        """Wait until node ``dead``'s slots are served by another master and every live node is ok; the seconds."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            if dead not in self.serving() and len(self.serving()) == self.masters:
                self.wait_ok(max(1.0, deadline - time.monotonic()))
                return time.monotonic() - t0
            time.sleep(0.05)
        raise RuntimeError(f"no replica took over node {dead}'s slots within {timeout} s")

    def wait_replicated(self, timeout: float = 30.0) -> None:
        """Wait until every replica has every write its master had when this was called (replication offsets)."""
        want = {}
        for i in self.serving():
            info = self.cli(i, "info", "replication")
            want[i] = int(info.split("master_repl_offset:")[1].split()[0])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            behind = [i for i, off in want.items() if (r := self.replica_of(i)) is not None and
                      self._replica_offset(r) < off]
            if not behind:
                return
            time.sleep(0.02)
        raise RuntimeError(f"replicas of {behind} did not catch up within {timeout} s")

    def _replica_offset(self, r: int) -> int:
        info = self.cli(r, "info", "replication")
        if "master_link_status:up" not in info:
            return -1
        return int(info.split("slave_repl_offset:")[1].split()[0])

    def heal(self, timeout: float = 60.0) -> None:
        """Every node running again (restarted ones rejoin, empty, as replicas), the cluster ok, and each serving
        master with a replica in sync."""
        for i in list(self.paused):
            self.resume(i)
        for i, p in enumerate(self.procs):
            if p is None or p.poll() is not None:
                self.start(i)
        deadline = time.monotonic() + timeout
        self.wait_ok(timeout)
        while self.replicas and time.monotonic() < deadline:
            masters = self.serving()
            if len(masters) == self.masters and all(
                    (r := self.replica_of(m)) is not None and self._replica_offset(r) >= 0 for m in masters):
                return
            time.sleep(0.1)
        if self.replicas:
            raise RuntimeError(f"Redis cluster not healed (masters with synced replicas) within {timeout} s")

    def create(self) -> None:
        """Start every node and join them: ``masters`` masters, each with ``replicas`` replicas."""
        for i in range(len(self.ports)):
            self.start(i)
        env = dict(os.environ, REDISCLI_AUTH=self.password)
        tls = [] if self.tls is None else ["--tls", "--cacert", str(self.tls.ca)]
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        r = subprocess.run(["redis-cli", *tls, "--cluster", "create", *nodes, "--cluster-replicas",
                            str(self.replicas), "--cluster-yes"], env=env, capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {r.stdout[-2000:]} {r.stderr[-2000:]}")
        self.heal()

    def flush(self) -> None:
        """Drop every key on every serving master."""
        for i in self.serving():
            self.cli(i, "flushall")

    def close(self) -> None:
        """Stop every node and remove the directory."""
        for i in range(len(self.procs)):
            if i in self.paused:
                self.resume(i)
            self.stop(i)
        shutil.rmtree(self.root, ignore_errors=True)


def _need_redis() -> None:
    """Skip (fail under CI or scripts/run_tests.sh) when redis-server or redis-cli is missing."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        msg = "redis-server is not installed: run scripts/setup_venvs.sh (it runs apt-get install redis-server)"
        if os.environ.get("CI") or os.environ.get("TKV_REQUIRE_REDIS"):
            pytest.fail(msg)  # CI and scripts/run_tests.sh never skip the remote tier for want of Redis
        pytest.skip(msg)


@contextlib.contextmanager
def _running(cluster: RedisCluster):
    """Create ``cluster``, export its password in ``$TKV_TEST_REDIS_PASSWORD``, stop it at the end."""
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


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """A running 3-master Redis Cluster with a password; the password is also in ``$TKV_TEST_REDIS_PASSWORD``."""
    _need_redis()
    with _running(RedisCluster(tmp_path_factory.mktemp("redis"))) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def redis_replicas(tmp_path_factory):
    """A running cluster of 3 masters and 3 replicas, node timeout 1 s (use ``replica_cluster`` in a test)."""
    _need_redis()
    with _running(RedisCluster(tmp_path_factory.mktemp("redis-replicas"), replicas=1, node_timeout_ms=1000)) as c:
        yield c


@pytest.fixture
def replica_cluster(redis_replicas):
    """``redis_replicas`` healed for this test: every node up, each master with a replica in sync."""
    redis_replicas.heal()
    return redis_replicas


@pytest.fixture(scope="session")
def redis_tls(tmp_path_factory):
    """A running 3-master cluster that speaks only TLS; ``.tls.ca`` signed its certificates, ``.wrong_ca`` did not."""
    _need_redis()
    if shutil.which("openssl") is None:
        pytest.fail("the TLS test needs the openssl command (Debian package openssl) to make its certificates")
    root = tmp_path_factory.mktemp("redis-tls")
    cluster = RedisCluster(root / "nodes", tls=make_tls_files(root / "pki", "good"))
    cluster.wrong_ca = make_tls_files(root / "pki", "other").ca
    with _running(cluster) as c:
        yield c
