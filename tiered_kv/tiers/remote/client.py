"""``ClusterClient``: batched, bounded-time reads and writes on a Redis Cluster (redis-py + hiredis).

redis-py's ``RedisCluster`` finds the topology (which master owns which of the 16384 slots) and
keeps one connection pool per node. This wrapper uses it for that, and sends the data itself: a
batch of keys is grouped by owning node and each node gets one pipelined burst (``GET``/``SET``/
``DEL`` per key: a cluster's ``MGET`` cannot span slots). Every node gets its burst before any
answer is read, so the nodes work side by side and a batch costs about one round trip of the
slowest node. ``SET`` values go out as the caller's buffers (record header, then a view of the
payload): no copy joins them.

Failures never raise out of a data call and never wait long:
- every socket has ``connect_timeout_s``/``op_timeout_s``; a node that failed (refused, timed
  out, reset) is skipped for ``retry_after_s`` (its keys are misses or failed writes at once), then
  one call at a time tries it again (a reconnect) while the others go on skipping it: a node that
  hangs (a partition, a stopped process) holds up one mover thread per try, not all of them;
- a ``MOVED``/``ASK`` or ``CLUSTERDOWN`` answer (failover, resharding), or a failed node, marks the
  topology stale; the next call refreshes it (bounded by the same timeouts; the failed node is asked
  last) before grouping keys, and calls that come while a refresh runs use the map as it is;
- failures are counted per node and logged at most once per node per ``FaultLog`` interval;
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

from tiered_kv.errors import ConfigError, RemoteUnavailableError, TieredKVError
from tiered_kv.tiers.faults import FaultLog
from tiered_kv.tiers.remote.settings import RemoteSettings

log = logging.getLogger(__name__)


class ClusterClient:
    """One Redis Cluster, reached through its seed nodes; batched data calls that never raise."""

    def __init__(self, settings: RemoteSettings) -> None:
        import redis  # noqa: PLC0415 (lazily: only setups with a remote tier need redis-py)
        from redis.cluster import ClusterNode, RedisCluster  # noqa: PLC0415
        from redis.backoff import NoBackoff  # noqa: PLC0415
        from redis.exceptions import RedisClusterException, RedisError  # noqa: PLC0415
        from redis.retry import Retry  # noqa: PLC0415

        self.settings = settings
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
        self._response_error = redis.exceptions.ResponseError
        self._redis_error = RedisError
        self._cluster_error = RedisClusterException  # redis-py's own (slot not covered, no seed answered)
        kwargs = login_kwargs(settings)
        try:
            self.rc = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in settings.seeds()],
                                   require_full_coverage=False, retry=Retry(NoBackoff(), 1),
                                   dynamic_startup_nodes=True, **kwargs)
            self.rc.ping(target_nodes=RedisCluster.PRIMARIES)
        except (RedisClusterException, RedisError, OSError) as exc:
            raise startup_error(settings, exc) from None
        self._lock = threading.Lock()  # one topology refresh at a time
        self._down_lock = threading.Lock()
        # node name -> monotonic time until which it is skipped; while one call probes it again, the end of that try
        self._down: dict[str, float] = {}
        self._probe_s = settings.connect_timeout_s + settings.op_timeout_s
        self._stale = False
        self._last_failed: str | None = None  # asked last by the next topology refresh
        self._closed = False
        self.faults = FaultLog(log, "remote tier: node")
        self.counters = {"node_failures": 0, "refreshes": 0, "skipped_down": 0, "redirects": 0}

    # ------------------------------------------------------------------ topology
    def _refresh_if_stale(self) -> None:
        """Ask the cluster for its slot map again if it is stale. A call that finds a refresh running goes on with
        the map as it is (a refresh may wait on a hung node for the timeouts; no other call should)."""
        if not self._stale or not self._lock.acquire(blocking=False):
            return
        try:
            if not self._stale:
                return
            self._stale = False
            self.counters["refreshes"] += 1
            try:
                self.rc.nodes_manager.initialize(last_failed_node_name=self._last_failed)
            except (self._redis_error, self._cluster_error, *self._errors) as exc:  # no seed answered: keep the map
                log.info("remote tier: topology refresh failed: %s", exc)
                self._stale = True
        finally:
            self._lock.release()

    def _node_of(self, key: bytes):
        """The master owning ``key``'s slot, or None (slot not covered now)."""
        try:
            return self.rc.nodes_manager.get_node_from_slot(self.rc.keyslot(key))
        except (self._redis_error, self._cluster_error):  # not covered now (a master lost, no replica yet)
            self._stale = True
            return None

    def _group(self, keys: Sequence[bytes]) -> tuple[dict[str, tuple[object, list[int]]], list[int]]:
        """Item indices per reachable node, and the items whose node is down or unknown."""
        self._refresh_if_stale()
        now = time.monotonic()
        groups: dict[str, tuple[object, list[int]]] = {}
        skipped: list[int] = []
        usable: dict[str, bool] = {}
        for i, key in enumerate(keys):
            node = self._node_of(key)
            if node is not None and node.name not in usable:
                usable[node.name] = self._usable(node.name, now)
            if node is None or not usable[node.name]:
                skipped.append(i)
                continue
            groups.setdefault(node.name, (node, []))[1].append(i)
        if skipped:
            self.counters["skipped_down"] += len(skipped)
        return groups, skipped

    def _usable(self, name: str, now: float) -> bool:
        """Whether this call may send to node ``name``: yes if it is not marked down; if its skip window ended,
        yes for this call alone (it probes the node; others skip it until that try ends)."""
        with self._down_lock:
            until = self._down.get(name)
            if until is None:
                return True
            if until > now:
                return False
            self._down[name] = now + self._probe_s
            return True

    def _node_answered(self, name: str) -> None:
        """Node ``name`` answered a whole burst: it is up (again)."""
        if name in self._down:
            with self._down_lock:
                self._down.pop(name, None)

    def _node_failed(self, node, exc: BaseException) -> None:
        self.counters["node_failures"] += 1
        with self._down_lock:
            self._down[node.name] = time.monotonic() + self.settings.retry_after_s
        self._last_failed = node.name
        self._stale = True  # a failover may have moved its slots
        self.faults.fault(node.name, f"{type(exc).__name__}: {exc}; its keys are misses (reads) and refused "
                                     f"(writes) for {self.settings.retry_after_s:.1f} s, then tried again")

    def _exchange(self, keys: Sequence[bytes], pack: Callable, default, on_item: Callable | None = None,
                  read: Callable | None = None) -> list:
        """One round trip per node for a batch: send every node its commands first (``pack(conn, i)`` gives item
        ``i``'s packed command), then read each node's answers in order, so the nodes work side by side while
        this thread reads. Per-item results; ``default`` where a node failed or was skipped, or a command was
        redirected. ``on_item(i, answer)`` replaces each answer as it is read (verifying, copying).
        ``read(wire, i)``, if given, reads item ``i``'s answer off the node's ``_Wire`` itself (bulk replies
        straight into the caller's memory) instead of redis-py's parser.
        """
        out = [default] * len(keys)
        if not keys:
            return out
        groups, _ = self._group(keys)
        sessions = []
        for node, idx in groups.values():
            pool = conn = None
            try:
                pool = self.rc.get_redis_connection(node).connection_pool
                conn = pool.get_connection()
                chunks: list = []
                for i in idx:
                    chunks += pack(conn, i)
                conn.send_packed_command(coalesced(chunks), check_health=False)
                sessions.append((node, pool, conn, idx))
            except self._errors as exc:  # the connection was closed by redis-py; the node is skipped a while
                if conn is not None:
                    pool.release(conn)
                self._node_failed(node, exc)
        for node, pool, conn, idx in sessions:
            wire = None if read is None else _Wire(conn)
            try:
                for i in idx:
                    try:
                        answer = conn.read_response() if wire is None else read(wire, i)
                    except self._response_error:  # MOVED / ASK / CLUSTERDOWN: the map is old
                        self._stale = True
                        self.counters["redirects"] += 1
                        continue
                    out[i] = answer if on_item is None else on_item(i, answer)
                self._node_answered(node.name)
            except self._errors as exc:
                if wire is not None:
                    conn.disconnect()  # a half-read reply: this connection's stream is lost
                self._node_failed(node, exc)
            except BaseException:
                conn.disconnect()  # answers left unread: never hand this connection out again as is
                raise
            finally:
                if wire is not None:
                    wire.close()
                pool.release(conn)
        return out

    # ------------------------------------------------------------------ data
    def get_many(self, keys: Sequence[bytes], on_item: Callable | None = None, unavailable=None) -> list:
        """Value of each key: bytes, None (no such key), or ``unavailable`` (its node failed or is skipped).

        ``on_item(i, value)`` runs for each answer (bytes or None) as it is read; its result replaces it.
        """
        return self._exchange(keys, lambda conn, i: [b"*2\r\n$3\r\nGET\r\n$%d\r\n%b\r\n" % (len(keys[i]), keys[i])],
                              unavailable, on_item)

    def get_into(self, keys: Sequence[bytes], head_len: int, into: Callable[[int], memoryview | None],
                 on_item: Callable, unavailable=None) -> list:
        """``GET`` each key, receiving a value of ``head_len + len(into(i))`` bytes as its first ``head_len`` bytes
        (handed to ``on_item(i, head)``) and the rest straight from the socket into the buffer ``into(i)``: no
        parser copies. A value of another length, or ``into(i)`` None, comes whole (``on_item(i, bytes)``); a
        missing key as ``on_item(i, None)``. ``unavailable`` where the node failed or was skipped."""

        def read(wire: _Wire, i: int):
            n = wire.bulk_len()
            if n < 0:
                return None
            dst = into(i)
            if dst is None or n != head_len + len(dst):
                return wire.exact(n, trailer=True)
            head = wire.exact(head_len)
            wire.fill(dst)
            wire.trailer()
            return (head,)

        return self._exchange(keys, lambda conn, i: [b"*2\r\n$3\r\nGET\r\n$%d\r\n%b\r\n" % (len(keys[i]), keys[i])],
                              unavailable, on_item, read)

    def getrange_into(self, keys: Sequence[bytes], ranges_of: Callable[[int], Sequence[tuple[int, int]]],
                      into: Callable[[int], Sequence[memoryview]], unavailable=None) -> list:
        """``GETRANGE`` byte ranges of each key's value (``ranges_of(i)``: ``(start, end)`` pairs, end exclusive)
        straight from the socket into the buffers ``into(i)`` (one of each range's length): True where every range
        came whole, False where one came short (a shorter value, or no key: empty), ``unavailable`` where the node
        failed or was skipped. One round trip per node for all of them."""

        def pack(conn, i: int) -> list:
            k = keys[i]
            out = []
            for a, b in ranges_of(i):
                sa, sb = b"%d" % a, b"%d" % (b - 1)
                out.append(b"*4\r\n$8\r\nGETRANGE\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n"
                           % (len(k), k, len(sa), sa, len(sb), sb))
            return out

        def read(wire: _Wire, i: int):
            whole, err = True, None
            for dst in into(i):
                try:
                    n = wire.bulk_len()
                except wire._response_error as exc:  # an error reply: read this item's other replies all the same,
                    err, whole = exc, False           # so the next item's start where they should
                    continue
                if n == len(dst):
                    wire.fill(dst)
                    wire.trailer()
                else:
                    whole = False
                    if n > 0:
                        wire.exact(n, trailer=True)
                    elif n == 0:
                        wire.trailer()
            if err is not None:
                raise err  # as for one reply: MOVED, ASK, CLUSTERDOWN or WRONGTYPE leaves this item unread
            return whole

        return self._exchange(keys, pack, unavailable, None, read)

    def set_many(self, keys: Sequence[bytes], parts_of: Callable[[int], tuple]) -> list[bool]:
        """``SET`` each key to the concatenation of the buffers ``parts_of(i)`` returns (say a header and a
        payload view), sent as they are: no copy joins them. True where the node acknowledged it."""

        def pack(conn, i: int) -> list:
            parts = parts_of(i)
            n = sum(len(p) for p in parts)
            head = b"*3\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n" % (len(keys[i]), keys[i], n)
            return [head, *parts, b"\r\n"]

        return [r is True or r == b"OK" for r in self._exchange(keys, pack, False)]

    def delete_many(self, keys: Sequence[bytes]) -> None:
        """``DEL`` each key (best effort: a failed node keeps its records until Redis evicts them)."""
        self._exchange(keys, lambda conn, i: conn.pack_commands([("DEL", keys[i])]), 0)

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key exists now (one pipelined ``EXISTS`` per node; False where a node failed)."""
        return [bool(r) for r in self._exchange(keys, lambda conn, i: conn.pack_commands([("EXISTS", keys[i])]), 0)]

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
        try:
            self.rc.close()
        except self._redis_error:
            pass


#: Pieces of a node's batch shorter than this are joined before they are sent (``coalesced``), up to about
#: ``SEND_JOIN_MAX`` bytes a join (a batch of many small records is not copied whole once more).
SEND_JOIN_BYTES, SEND_JOIN_MAX = 64 << 10, 1 << 20


def coalesced(chunks: Sequence) -> list:
    """``chunks`` (bytes-like pieces of packed commands, in order) with every run of pieces shorter than
    ``SEND_JOIN_BYTES`` joined, ``SEND_JOIN_MAX`` bytes or a little more a join; longer pieces (a payload's view)
    pass as they are, uncopied.

    redis-py sends each piece with its own ``sendall``, and each call lets go of the GIL and must take it back. Beside
    a thread that holds the GIL (vLLM's, launching an uncompiled forward) taking it back waits up to the switch
    interval (5 ms): an exchange of 128 ``GETRANGE``s waited ~0.6 s for its sends alone (CPU box, 2026-11-30,
    ``benchmarks/probes/remote_ranges.py``). Joined, a node's commands go in one call."""
    out: list = []
    run: list = []
    size = 0
    for c in chunks:
        if len(c) < SEND_JOIN_BYTES:
            run.append(c)
            size += len(c)
            if size < SEND_JOIN_MAX:
                continue
        if run:
            out.append(b"".join(run))
            run, size = [], 0
        if len(c) >= SEND_JOIN_BYTES:
            out.append(c)
    if run:
        out.append(b"".join(run))
    return out


#: A ``_Wire``'s buffer: what it takes from its socket in one call (a range read's replies come back to back), and
#: the payload size above which it reads the socket straight into the caller's memory instead.
READ_CHUNK = 4 << 20
_BUFFERS = threading.local()  # one idle buffer per thread, for its next ``_Wire``


class _Wire:
    """Reads RESP replies off one redis-py connection's socket, bulk strings into the caller's buffer.

    Used only inside ``ClusterClient._exchange`` for the replies of commands it sent itself on a connection it
    holds, so redis-py's own parser has nothing buffered for that connection. Any socket error propagates
    (the caller then drops the connection). ``close`` hands its buffer back to the thread for the next one.

    Each call into the socket takes whatever it holds, up to ``READ_CHUNK`` bytes: many replies at once, copied out
    of the buffer as they are parsed (a payload of ``READ_CHUNK`` or more is read straight into its destination).
    Why not straight into the destination every time: each return from the socket takes the GIL again, and beside a
    thread that holds it (vLLM's, launching an uncompiled forward) that waits up to the switch interval (5 ms); a
    layer group's 128 ranges read reply by reply took ~1,000 such waits a step (CPU box, 2026-11-30,
    ``benchmarks/probes/remote_ranges.py``: 0.01 GB/s beside a spinning thread; buffered, 0.16).
    """

    __slots__ = ("sock", "mv", "data", "lo", "hi", "_response_error", "_connection_error")

    def __init__(self, conn) -> None:
        from redis.exceptions import ConnectionError as RedisConnectionError, ResponseError  # noqa: PLC0415

        self.sock = conn._sock  # redis-py keeps the connected socket here; it was connected by the send
        mv = getattr(_BUFFERS, "idle", None)
        _BUFFERS.idle = None  # this wire's until ``close``; a second wire on this thread meanwhile makes its own
        self.mv = mv if mv is not None else memoryview(bytearray(READ_CHUNK))
        self.data = self.mv.obj  # the bytearray, for ``find``
        self.lo = self.hi = 0  # the unread bytes are data[lo:hi]
        self._response_error, self._connection_error = ResponseError, RedisConnectionError

    def close(self) -> None:
        """Done: the buffer goes back to this thread for its next wire."""
        _BUFFERS.idle = self.mv

    def _more(self) -> None:
        """Whatever the socket holds, up to the buffer's free end (the unread bytes moved to its front first)."""
        if self.lo == self.hi:
            self.lo = self.hi = 0
        elif self.hi == len(self.mv):
            if self.lo == 0:
                raise self._connection_error(f"a reply line longer than {READ_CHUNK} bytes")
            n = self.hi - self.lo
            self.mv[:n] = self.mv[self.lo:self.hi]
            self.lo, self.hi = 0, n
        got = self.sock.recv_into(self.mv[self.hi:])
        if not got:
            raise self._connection_error("connection closed by the server")
        self.hi += got

    def line(self) -> bytes:
        """One reply line, without its CRLF."""
        while True:
            end = self.data.find(b"\r\n", self.lo, self.hi)
            if end >= 0:
                out = bytes(self.mv[self.lo:end])
                self.lo = end + 2
                return out
            self._more()

    def bulk_len(self) -> int:
        """Length of the bulk string that follows (-1: nil); an error reply raises ResponseError."""
        head = self.line()
        if head[:1] == b"$":
            return int(head[1:])
        if head == b"_":  # RESP3's null (redis-py 8 speaks RESP3 by default)
            return -1
        if head[:1] == b"-":
            raise self._response_error(head[1:].decode(errors="replace"))
        raise self._connection_error(f"unexpected reply {head[:40]!r} to GET")

    def fill(self, dst: memoryview) -> None:
        """Exactly ``len(dst)`` bytes into ``dst``: what is buffered, then (a rest of ``READ_CHUNK`` or more) the socket
        straight into it, then the buffer's next takes."""
        n = self._take(dst, 0)
        while len(dst) - n >= READ_CHUNK:  # the buffer is empty here
            got = self.sock.recv_into(dst[n:])
            if not got:
                raise self._connection_error("connection closed by the server")
            n += got
        while n < len(dst):
            self._more()
            n = self._take(dst, n)

    def _take(self, dst: memoryview, n: int) -> int:
        """Buffered bytes into ``dst`` from ``n`` on, as many as it has room for; returns the new ``n``."""
        m = min(self.hi - self.lo, len(dst) - n)
        if m:
            dst[n:n + m] = self.mv[self.lo:self.lo + m]
            self.lo += m
        return n + m

    def exact(self, n: int, trailer: bool = False) -> bytes:
        """Exactly ``n`` bytes (and the CRLF after a bulk string when ``trailer``)."""
        out = bytearray(n)
        self.fill(memoryview(out))
        if trailer:
            self.trailer()
        return bytes(out)

    def trailer(self) -> None:
        """The CRLF that ends a bulk string."""
        if self.line() != b"":
            raise self._connection_error("bulk string not followed by CRLF")


def login_kwargs(settings: RemoteSettings) -> dict:
    """redis-py connection arguments for ``settings``: login, timeouts, TLS (holds the password: never log it)."""
    kwargs = dict(password=settings.password(), username=settings.user, socket_timeout=settings.op_timeout_s,
                  socket_connect_timeout=settings.connect_timeout_s, health_check_interval=0)
    if settings.tls:
        kwargs.update(ssl=True, ssl_ca_certs=settings.tls_ca)
    return kwargs


#: what OpenSSL says when a server's certificate does not verify against the CA file (text, lower case)
_CERT_REFUSED = ("certificate verify failed", "certificate_verify_failed", "hostname mismatch",
                 "doesn't match", "ip address mismatch")
#: what a TLS client sees from a server that does not speak TLS on that port
_NOT_TLS = ("wrong version number", "wrong_version_number", "record layer failure", "packet length too long",
            "unexpected eof while reading", "eof occurred in violation of protocol")


def startup_error(settings: RemoteSettings, exc: BaseException) -> TieredKVError:
    """The error to raise when the cluster cannot be used at start-up: ``ConfigError`` for refused credentials
    (naming the user and the password's variable, never the password) and for a TLS certificate that does not
    verify (naming ``remote_tls_ca``), else ``RemoteUnavailableError``."""
    from redis.exceptions import AuthenticationError  # noqa: PLC0415

    who = f"user {settings.user or 'default'!r}" + (f", password from ${settings.password_env}"
                                                      if settings.password_env else ", no password")
    url = settings.describe()["url"]
    text = str(exc).rstrip(".")
    low = text.lower()
    if settings.tls and any(w in low for w in _CERT_REFUSED):
        ca = f"remote_tls_ca={settings.tls_ca!r}" if settings.tls_ca else "the system's CAs (remote_tls_ca not set)"
        return ConfigError(f"remote tier: the TLS certificate of the Redis Cluster at {url} did not verify against "
                           f"{ca}: {text}. Set remote_tls_ca to the CA file that signed the nodes' certificates "
                           f"(their tls-ca-cert-file), and make the certificates name the hosts of remote_url "
                           f"(DNS or IP subject alternative names); see docs/remote.md (Security)")
    if settings.tls and any(w in low for w in _NOT_TLS):
        return ConfigError(f"remote tier: the seeds in remote_url ({url}) use rediss:// (TLS) but do not answer in "
                           f"TLS ({text}). Give the nodes' tls-port in remote_url, or use redis:// for a cluster "
                           f"without TLS")
    if isinstance(exc, AuthenticationError) or any(w in low for w in ("auth", "password", "wrongpass")):
        return ConfigError(f"remote tier: the Redis Cluster at {url} refused the credentials ({who}): {text}. "
                           f"Check the password in that variable and the ACL user; see docs/remote.md")
    hint = ""
    if not settings.tls and any(w in low for w in ("reset by peer", "closed by server")):
        hint = " (a cluster that speaks only TLS drops plain connections like this: then use rediss:// seeds)"
    elif settings.tls and "timeout" in low:
        hint = " (a node that does not speak TLS never answers a TLS handshake: then use redis:// seeds)"
    return RemoteUnavailableError(f"remote tier: cannot reach a Redis Cluster at {url} within "
                                  f"{settings.connect_timeout_s} s ({type(exc).__name__}: {text}){hint}. Start the "
                                  f"cluster, check remote_url and the firewall, or drop remote_url to run without "
                                  f"the remote tier")


def key_node(settings: RemoteSettings, key: bytes, max_redirects: int = 3):
    """A plain ``redis.Redis`` to the master that owns ``key``'s slot now (same login and timeouts), found by asking
    the seeds one keyed command and following its ``MOVED`` answer: for one long-lived reader (the presence feed)
    in a process that should not build the cluster's slot map (redis-py's ``RedisCluster`` makes some 20,000
    objects, which the garbage collector then scans, and leaves as many to collect when it is closed).

    Tries each seed in turn; every wait is bounded by ``connect_timeout_s``/``op_timeout_s``. None when a node
    answered but none could serve the key now (its slot is down: ``CLUSTERDOWN``, a failover): try again later.
    Raises what ``startup_error`` makes for refused credentials (``ConfigError``) or when no seed answered at all
    (``RemoteUnavailableError``).
    """
    import redis  # noqa: PLC0415
    from redis.exceptions import (AskError, AuthenticationError, NoPermissionError, RedisError,  # noqa: PLC0415
                                  ResponseError)

    from redis.backoff import NoBackoff  # noqa: PLC0415
    from redis.retry import Retry  # noqa: PLC0415

    # no retries inside redis-py (its default backs off for seconds): the caller retries after retry_after_s
    kwargs = dict(login_kwargs(settings), retry=Retry(NoBackoff(), 0))
    last: BaseException | None = None
    answered = False
    for host, port in settings.seeds():
        for _ in range(max_redirects + 1):
            conn = redis.Redis(host=host, port=port, **kwargs)
            try:
                conn.execute_command("EXISTS", key)  # the owner answers; any other master redirects
                return conn
            except AskError as exc:  # MOVED / ASK: ask the owner (an empty host: the node we asked)
                conn.close()
                host, port, last, answered = exc.host or host, int(exc.port), exc, True
            except AuthenticationError as exc:
                conn.close()
                raise startup_error(settings, exc) from None
            except NoPermissionError as exc:  # the ACL user lacks a command: retrying never helps, say so now
                conn.close()
                raise ConfigError(f"remote tier: Redis ACL user {settings.user or 'default'!r} may not run a command "
                                  f"the remote tier needs ({exc}); give it the commands of the ACL line in docs/remote.md "
                                  f"(Security)") from None
            except ResponseError as exc:  # CLUSTERDOWN and the like: the cluster is there, the slot is not now
                conn.close()
                last, answered = exc, True
                break
            except (RedisError, OSError) as exc:  # this seed is down: the next one
                conn.close()
                last = exc
                break
    if answered:
        log.info("remote tier: no node serves %r now (%s); trying again later", key, last)
        return None
    raise startup_error(settings, last or RemoteUnavailableError("no seed answered"))
