"""Presence: how an engine learns, without a network round trip on its hot path, what the remote tier holds.

Every writer of a namespace appends the keys it stored (and deleted) to one Redis stream per
namespace (``<key_prefix><namespace hex>|presence``, capped at ``stream_maxlen`` entries with
``XADD MAXLEN ~``). A ``PresenceFeed`` thread in each reader process tails that stream with a
blocking ``XREAD`` (first the whole retained stream, so a new engine learns what its fleet stored
before it started, then every new entry) and queues what it reads. The planner's owner drains the
queue with ``take()``, which is a list swap: the vLLM scheduler thread adopts those keys as copies
in the governed remote tier (dictionary work) and so answers lookups from memory.

What the feed says are hints, not truths: Redis may have evicted a block since (``allkeys-lru``),
a node may be down. A read that finds a record missing is a miss and the planner forgets that
copy; a read whose node is down fails and the copy is kept for the next try. The stream lives
in one slot, so on one node: while that node is down the feed pauses and retries every
``retry_after_s``; the data calls of the other nodes go on.

Threading contract: ``publish`` may be called from any thread (mover threads); the feed runs
on its own daemon thread; ``take`` may be called from any thread (one consumer at a time is
expected); ``close`` once.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from tiered_kv.errors import TieredKVError
from tiered_kv.tiers.remote.client import ClusterClient, key_node
from tiered_kv.tiers.remote.settings import RemoteSettings

log = logging.getLogger(__name__)

STORED, REMOVED = b"+", b"-"


def stream_key(key_prefix: str, namespace_prefix: bytes) -> bytes:
    """The presence stream's Redis key for one namespace."""
    return key_prefix.encode() + namespace_prefix.hex().encode() + b"|presence"


def publish(client: ClusterClient, stream: bytes, stored: Sequence[bytes] = (), removed: Sequence[bytes] = (),
            maxlen: int = 200_000) -> bool:
    """Append one entry naming ``stored`` and ``removed`` keys; False if the stream's node did not take it."""
    if not stored and not removed:
        return True
    fields = {STORED + str(i).encode(): k for i, k in enumerate(stored)}
    fields.update({REMOVED + str(i).encode(): k for i, k in enumerate(removed)})
    return client.call(lambda rc: rc.xadd(stream, fields, maxlen=maxlen, approximate=True), None) is not None


class PresenceFeed:
    """Tails one namespace's presence stream on a daemon thread; ``take()`` hands over what arrived.

    With a ``ClusterClient`` it reads through it (``TieredStore``, which has one for its data anyway).
    ``PresenceFeed.standalone`` keeps only one plain connection to the stream's node, found through the seeds
    (``client.key_node``) at start and again after a failure, and never builds the cluster's slot map: what
    vLLM's scheduler process uses, where that map (some 20,000 objects, and their garbage when it is closed)
    would make the garbage collector's passes, and so the scheduler's steps, slower.
    """

    def __init__(self, client: ClusterClient | None, stream: bytes, block_ms: int = 500, batch: int = 1000,
                 settings: RemoteSettings | None = None, node=None, min_interval_s: float = 0.0) -> None:
        self.client = client
        self.settings = client.settings if client is not None else settings
        self._node = node  # standalone: a redis.Redis to the stream's node (None: find it)
        self._conn = None  # standalone: the one connection of _node the feed reads on
        self.stream = stream
        # the blocking read must end before the socket's own timeout would cut it
        self.block_ms = max(10, min(block_ms, int(self.settings.op_timeout_s * 1000 / 2)))
        self.batch = batch
        # after a read that brought entries, wait this long before the next: a busy fleet then wakes this
        # thread (and takes the GIL from the engine's scheduler thread) a few times a second, not per write
        self.min_interval_s = min_interval_s
        self._lock = threading.Lock()
        self._stored: list[bytes] = []
        self._removed: list[bytes] = []
        self._last = b"0"
        self._stop = threading.Event()
        self.entries = 0
        self.caught_up = threading.Event()  # set once the retained stream was read through
        self._thread = threading.Thread(target=self._run, name="tkv-remote-presence", daemon=True)
        self._thread.start()

    def take(self) -> tuple[list[bytes], list[bytes]]:
        """Keys stored and removed since the last call (each list in stream order)."""
        with self._lock:
            if not self._stored and not self._removed:
                return [], []
            out = (self._stored, self._removed)
            self._stored, self._removed = [], []
            return out

    def pending(self) -> bool:
        """Whether ``take`` has anything (a cheap check for a hot path)."""
        return bool(self._stored or self._removed)

    @classmethod
    def standalone(cls, settings: RemoteSettings, stream: bytes, **kw) -> "PresenceFeed":
        """A feed holding one plain connection to ``stream``'s node. Finding it checks the login: a wrong password
        raises ``ConfigError`` and an unreachable cluster ``RemoteUnavailableError`` here, at start-up; a cluster
        that answers without serving the stream's slot now starts the feed without a node (it retries)."""
        return cls(None, stream, settings=settings, node=key_node(settings, stream), **kw)

    def _read(self, block: int | None):
        """One ``XREAD`` from the last id: the reply (None: nothing new), or False when the stream's node could not
        answer. Standalone, the command goes out on the feed's own connection and the reply comes back as Redis
        sent it (hiredis' lists, no redis-py dict per entry): a third of the CPU time of ``Redis.xread`` per read,
        time this thread holds the GIL that vLLM's scheduler thread wants."""
        if self.client is not None:
            return self.client.call(lambda rc: rc.xread({self.stream: self._last}, count=self.batch, block=block),
                                    default=False)
        from redis.exceptions import RedisError  # noqa: PLC0415

        try:
            if self._conn is None:  # the stream's node failed or moved: find it again
                if self._node is None:
                    self._node = key_node(self.settings, self.stream)
                    if self._node is None:
                        return False
                self._conn = self._node.connection_pool.get_connection()
            wait = () if block is None else ("BLOCK", block)
            self._conn.send_command("XREAD", "COUNT", self.batch, *wait, "STREAMS", self.stream, self._last)
            return self._conn.read_response()
        except (RedisError, OSError, TieredKVError) as exc:  # MOVED after a failover is a RedisError too
            log.info("remote tier: presence feed: %s; retrying", exc)
            self._drop_node()
            return False

    def _drop_node(self) -> None:
        if self._conn is not None:
            self._conn.disconnect()
            self._conn = None
        if self._node is not None:
            self._node.close()
            self._node = None

    def _run(self) -> None:
        retry = self.settings.retry_after_s
        while not self._stop.is_set():
            block = self.block_ms if self.caught_up.is_set() else None
            res = self._read(block)
            if res is False:  # the stream's node is down or slow: try again later
                self._stop.wait(retry)
                continue
            got, stored, removed = 0, [], []
            # the reply: {stream: entries} or [[stream, entries]]; an entry: [id, fields], its fields a flat
            # [name, value, ...] list as Redis sends it, or a dict (redis-py's parsed reply, through a ClusterClient)
            for entries in (res.values() if isinstance(res, dict) else [e for _, e in res]) if res else ():
                for entry_id, fields in entries:
                    pairs = fields.items() if isinstance(fields, dict) else zip(fields[::2], fields[1::2])
                    for f, v in pairs:
                        tag = f[:1]
                        if tag == STORED:
                            stored.append(v)
                        elif tag == REMOVED:
                            removed.append(v)
                    self._last = entry_id
                    got += 1
            if stored or removed:  # one hand-over per read, not per entry
                with self._lock:
                    self._stored += stored
                    self._removed += removed
            self.entries += got
            if got < self.batch:
                self.caught_up.set()
                if got and self.min_interval_s:
                    self._stop.wait(self.min_interval_s)

    def close(self) -> None:
        """Stop the thread (returns within one blocking read). Idempotent."""
        self._stop.set()
        self._thread.join(timeout=self.block_ms / 1000 + self.settings.op_timeout_s + 1)
        if not self._thread.is_alive():
            self._drop_node()
