"""``ClusterClient``: batched, bounded-time reads and writes on a Redis Cluster (redis-py + hiredis).

redis-py's ``RedisCluster`` finds the topology (which master owns which of the 16384 slots) and
keeps one connection pool per node. This wrapper uses it for that, and sends the data itself: a
batch of keys is grouped by owning node and each node gets one pipeline (``GET``/``SET``/``DEL``
per key: a cluster's ``MGET`` cannot span slots), all nodes at once on a small thread pool, so a
batch costs about one round trip of the slowest node and its bytes spread over every node's link.

Failures never raise out of a data call and never wait long:
- every socket has ``connect_timeout_s``/``op_timeout_s``; a node that failed (refused, timed
  out, reset) is skipped for ``retry_after_s`` (its keys are misses or failed writes at once), then
  tried again: a reconnect;
- a ``MOVED``/``ASK`` or ``CLUSTERDOWN`` answer (failover, resharding) marks the topology stale; the
  next call refreshes it (bounded by the same timeouts) before grouping keys;
- a wrong password or an unreachable cluster *at start-up* raises: ``ConfigError`` naming the user
  and the environment variable, ``RemoteUnavailableError`` naming the seeds. The password is never
  logged or put in a message.

Threading contract: every method may be called from several threads at once (mover threads, the
presence feed); topology refreshes are serialized by a lock; redis-py's pools are thread-safe.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from tiered_kv.errors import ConfigError, RemoteUnavailableError
from tiered_kv.tiers.remote.settings import RemoteSettings

log = logging.getLogger(__name__)


class ClusterClient:
    """One Redis Cluster, reached through its seed nodes; batched data calls that never raise."""

    def __init__(self, settings: RemoteSettings) -> None:
        import redis  # noqa: PLC0415 (lazily: only setups with a remote tier need redis-py)
        from redis.cluster import ClusterNode, RedisCluster  # noqa: PLC0415
        from redis.backoff import NoBackoff  # noqa: PLC0415
        from redis.exceptions import AuthenticationError, RedisClusterException, RedisError  # noqa: PLC0415
        from redis.retry import Retry  # noqa: PLC0415

        self.settings = settings
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
        self._redis_error = RedisError
        password = settings.password()
        kwargs = dict(password=password, username=settings.user, socket_timeout=settings.op_timeout_s,
                      socket_connect_timeout=settings.connect_timeout_s, health_check_interval=0)
        if settings.tls:
            kwargs.update(ssl=True, ssl_ca_certs=settings.tls_ca)
        seeds = settings.seeds()
        who = f"user {settings.user or 'default'!r}" + (f", password from ${settings.password_env}"
                                                          if settings.password_env else ", no password")
        try:
            self.rc = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in seeds], require_full_coverage=False,
                                   retry=Retry(NoBackoff(), 1), dynamic_startup_nodes=True, **kwargs)
            self.rc.ping(target_nodes=RedisCluster.PRIMARIES)
        except AuthenticationError as exc:
            raise ConfigError(f"remote tier: the Redis Cluster at {settings.describe()['url']} refused the "
                              f"credentials ({who}): {exc}. Check the password in that variable and the ACL user; "
                              f"see docs/remote.md") from None
        except (RedisClusterException, RedisError, OSError) as exc:
            text = str(exc)
            if any(w in text.lower() for w in ("auth", "password", "wrongpass")):
                raise ConfigError(f"remote tier: the Redis Cluster at {settings.describe()['url']} refused the "
                                  f"credentials ({who}): {text}. Check the password and the ACL user; see "
                                  f"docs/remote.md") from None
            raise RemoteUnavailableError(f"remote tier: cannot reach a Redis Cluster at {settings.describe()['url']} "
                                         f"within {settings.connect_timeout_s} s ({type(exc).__name__}: {text}). "
                                         f"Start the cluster, check remote_url and the firewall, or drop remote_url "
                                         f"to run without the remote tier") from None
        self._lock = threading.Lock()
        self._down: dict[str, float] = {}  # node name -> monotonic time until which it is skipped
        self._stale = False
        self._pool = ThreadPoolExecutor(max(2, len(self.rc.get_primaries()) + 1), thread_name_prefix="tkv-redis")
        self._closed = False
        self.counters = {"node_failures": 0, "refreshes": 0, "skipped_down": 0, "redirects": 0}

    # ------------------------------------------------------------------ topology
    def _refresh_if_stale(self) -> None:
        if not self._stale:
            return
        with self._lock:
            if not self._stale:
                return
            self._stale = False
            self.counters["refreshes"] += 1
            try:
                self.rc.nodes_manager.initialize()
            except (self._redis_error, *self._errors) as exc:  # every seed down: keep the old map, retry later
                log.info("remote tier: topology refresh failed: %s", exc)
                self._stale = True

    def _node_of(self, key: bytes):
        """The master owning ``key``'s slot, or None (slot not covered now)."""
        try:
            return self.rc.nodes_manager.get_node_from_slot(self.rc.keyslot(key))
        except self._redis_error:
            self._stale = True
            return None

    def _group(self, keys: Sequence[bytes]) -> tuple[dict[str, tuple[object, list[int]]], list[int]]:
        """Item indices per reachable node, and the items whose node is down or unknown."""
        self._refresh_if_stale()
        now = time.monotonic()
        groups: dict[str, tuple[object, list[int]]] = {}
        skipped: list[int] = []
        for i, key in enumerate(keys):
            node = self._node_of(key)
            if node is None or self._down.get(node.name, 0.0) > now:
                skipped.append(i)
                continue
            groups.setdefault(node.name, (node, []))[1].append(i)
        if skipped:
            self.counters["skipped_down"] += len(skipped)
        return groups, skipped

    def _node_failed(self, node, exc: BaseException) -> None:
        self.counters["node_failures"] += 1
        self._down[node.name] = time.monotonic() + self.settings.retry_after_s
        self._stale = True  # a failover may have moved its slots
        log.warning("remote tier: node %s failed (%s: %s); its keys are misses for %.1f s", node.name,
                    type(exc).__name__, exc, self.settings.retry_after_s)

    def _per_node(self, keys: Sequence[bytes], build: Callable, n_default, on_item: Callable | None = None) -> list:
        """Run ``build(pipe, idx)`` per node group (in parallel) and collect per-item results (``n_default`` when a
        node fails or is skipped). ``on_item(i, result)``, if given, runs on the node's thread for each answer and
        its return value is the item's result (so verifying and copying values spreads over the nodes' threads)."""
        out = [n_default] * len(keys)
        if not keys:
            return out
        groups, _ = self._group(keys)

        def run(node, idx: list[int]) -> None:
            try:
                pipe = self.rc.get_redis_connection(node).pipeline(transaction=False)
                build(pipe, idx)
                res = pipe.execute(raise_on_error=False)
            except self._errors as exc:
                self._node_failed(node, exc)
                return
            except self._redis_error as exc:
                self._stale = True
                log.info("remote tier: node %s: %s", node.name, exc)
                return
            for i, r in zip(idx, res):
                if isinstance(r, Exception):
                    self._stale = True  # MOVED / ASK / CLUSTERDOWN: the map is old
                    self.counters["redirects"] += 1
                    continue
                out[i] = r if on_item is None else on_item(i, r)

        items = list(groups.values())
        if len(items) == 1:
            run(*items[0])
        else:
            for f in [self._pool.submit(run, node, idx) for node, idx in items]:
                f.result()
        return out

    # ------------------------------------------------------------------ data
    def get_many(self, keys: Sequence[bytes], on_item: Callable | None = None, unavailable=None) -> list:
        """Value of each key: bytes, None (no such key), or ``unavailable`` (its node failed or is skipped).

        ``on_item(i, value)`` runs on the node's thread for each answer (bytes or None); its result replaces it.
        """
        return self._per_node(keys, lambda pipe, idx: [pipe.get(keys[i]) for i in idx], unavailable, on_item)

    def set_many(self, keys: Sequence[bytes], value_of: Callable[[int], object]) -> list[bool]:
        """``SET`` each key to ``value_of(i)`` (bytes or a buffer, built on the node's thread); True where the node
        acknowledged it."""
        res = self._per_node(keys, lambda pipe, idx: [pipe.set(keys[i], value_of(i)) for i in idx], False)
        return [r is True for r in res]

    def delete_many(self, keys: Sequence[bytes]) -> None:
        """``DEL`` each key (best effort: a failed node keeps its records until Redis evicts them)."""
        self._per_node(keys, lambda pipe, idx: [pipe.delete(keys[i]) for i in idx], 0)

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key exists now (one pipelined ``EXISTS`` per node; False where a node failed)."""
        return [bool(r) for r in self._per_node(keys, lambda pipe, idx: [pipe.exists(keys[i]) for i in idx], 0)]

    def call(self, fn: Callable, default=None):
        """Run ``fn(redis_cluster)`` (a single-key command redis-py routes itself); ``default`` on any failure."""
        try:
            return fn(self.rc)
        except (self._redis_error, *self._errors) as exc:
            self._stale = True
            log.debug("remote tier: %s", exc)
            return default

    def nodes(self) -> list[str]:
        """``host:port`` of every master the client knows."""
        return [n.name for n in self.rc.get_primaries()]

    def close(self) -> None:
        """Close every connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        try:
            self.rc.close()
        except self._redis_error:
            pass
