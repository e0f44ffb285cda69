"""Remote tier: blocks as checksummed records in a Redis Cluster shared by a fleet of engines.

A block is one Redis string under ``<key_prefix><namespace hex>:[<part>:]<key>``: the disk tier's 64-byte
``RecordHeader`` (magic, version, layout fingerprint, lengths, payload checksum, and a header
checksum that also covers the Redis key) followed by the payload. A read verifies both
checksums before a byte reaches the caller: a damaged value, a value of another layout, a value
copied to another key or written by something else is never served (damaged ones are deleted
and reported corrupt; foreign ones are misses).

Redis owns the capacity (``maxmemory`` + ``allkeys-lru`` on every node): the tier is *governed*
(``TierSpec.governed``): the planner never counts room there, never evicts there, and treats
its copies as hints: a record that vanished is reported ``missing`` (the planner forgets it), a
record whose node is down or slow is a failed read (kept for a later try). Nothing raises out of
``read``/``write``/``delete`` for a network fault; waits are bounded by the client's timeouts.

Every successful write and delete is announced on the namespace's presence stream
(``presence.py``), so the other engines' planners learn of it without asking Redis per lookup.

Threading contract: as ``Tier``: ``read``/``write``/``delete`` may run on several mover threads at
once (the client is thread-safe); ``close()`` once, after the movers stopped.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from tiered_kv.errors import RecordError, StoreClosedError
from tiered_kv.tiers.base import Tier
from tiered_kv.tiers.remote.client import ClusterClient
from tiered_kv.tiers.remote.presence import PresenceFeed, publish, stream_key
from tiered_kv.tiers.remote.settings import RemoteSettings
from tiered_kv.values.layout import BlockLayout
from tiered_kv.values.record import CODEC_NONE, HEADER_LEN, RecordHeader, payload_checksum

log = logging.getLogger(__name__)

_DOWN = object()  # a read whose node failed or is skipped


class RemoteTier(Tier):
    """Keyed, governed tier on a Redis Cluster (``slotted = False``, ``governed = True``)."""

    name = "remote"
    slotted = False
    governed = True

    def __init__(self, layout: BlockLayout, settings: RemoteSettings, namespace_prefix: bytes,
                 capacity_bytes: int = 0, client: ClusterClient | None = None, publish_writes: bool = True,
                 part: str = "") -> None:
        super().__init__(layout, capacity_bytes // (layout.nbytes + HEADER_LEN) if capacity_bytes else 0)
        self.settings = settings
        self.namespace_prefix = namespace_prefix
        self._own_client = client is None
        self.client = client if client is not None else ClusterClient(settings)
        # ``part`` splits one namespace's records (a TP rank's share); the presence stream stays per namespace
        self._base = settings.key_prefix.encode() + namespace_prefix.hex().encode() + b":" \
            + (part.encode() + b":" if part else b"")
        self.stream = stream_key(settings.key_prefix, namespace_prefix)
        self.publish_writes = publish_writes
        self._closed = False
        self._feed: PresenceFeed | None = None
        self.counters = {"corrupt": 0, "foreign": 0, "missing": 0, "unavailable": 0, "write_failed": 0}

    def redis_key(self, key: bytes) -> bytes:
        """The Redis key a block key is stored under (namespace-prefixed)."""
        return self._base + key

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("remote tier is closed")

    # ------------------------------------------------------------------ Tier API
    def write(self, keys: Sequence[bytes], slots: Sequence[int], rows) -> list[bool]:
        """Store ``rows[i]`` as a checksummed record under ``keys[i]``; False where its node did not take it."""
        self._check_open()
        rkeys = [self.redis_key(k) for k in keys]
        fp, n = self.layout.fingerprint, self.block_nbytes

        def parts_of(i: int) -> tuple[bytes, memoryview]:  # header + a view of the row: sent with no copy
            row = rows[i]
            payload = memoryview((row if row.device.type == "cpu" else row.cpu()).contiguous().numpy()).cast("B")
            return RecordHeader(CODEC_NONE, fp, 0, n, n, payload_checksum(payload)).pack(rkeys[i]), payload

        ok = self.client.set_many(rkeys, parts_of)
        self.counters["write_failed"] += len(ok) - sum(ok)
        if self.publish_writes:
            publish(self.client, self.stream, [k for k, good in zip(keys, ok) if good],
                    maxlen=self.settings.stream_maxlen)
        return ok

    def read(self, keys: Sequence[bytes], slots: Sequence[int], out) -> tuple[list[bool], list[bool]]:
        """Read and verify each block into ``out[i]``; damaged records are deleted and reported corrupt."""
        ok, corrupt, _ = self.read_ex(keys, slots, out)
        return ok, corrupt

    def read_ex(self, keys: Sequence[bytes], slots: Sequence[int], out) -> tuple[list[bool], list[bool], list[bool]]:
        """``read`` plus ``missing[i]``: Redis holds no record of ``keys[i]`` (evicted, deleted, never written).

        A key whose node is down or slow is neither ok nor missing (a failed read; the caller may try
        again later). ``out`` is a ``(n, block_nbytes)`` uint8 tensor or a list of 1-D rows, any device.
        """
        self._check_open()
        n = len(keys)
        ok, corrupt, missing = [False] * n, [False] * n, [False] * n
        rkeys = [self.redis_key(k) for k in keys]
        fp, nb = self.layout.fingerprint, self.block_nbytes

        views: dict[int, memoryview] = {}

        def into(i: int) -> memoryview | None:  # a host row of exactly one block: the socket fills it directly
            dst = out[i]
            if dst.device.type != "cpu" or dst.dtype != torch.uint8 or not dst.is_contiguous() or dst.numel() != nb:
                return None
            views[i] = memoryview(dst.numpy()).cast("B")
            return views[i]

        def verify(i: int, value) -> object:  # as each answer is read: the other nodes keep sending meanwhile
            if value is None:
                missing[i] = True
                return None
            direct = isinstance(value, tuple)  # (header,): the payload is already in out[i]
            head = value[0] if direct else value
            try:
                total = HEADER_LEN + nb if direct else len(value)
                if len(head) < HEADER_LEN:
                    raise RecordError(f"value of {len(head)} bytes is shorter than a record header")
                hdr = RecordHeader.unpack(rkeys[i], memoryview(head)[:HEADER_LEN])
                if hdr.layout_fp != fp:
                    return "foreign"  # another layout under our key: not ours to serve, not damage either
                if hdr.codec != CODEC_NONE or hdr.raw_len != nb or total != HEADER_LEN + hdr.payload_len \
                        or hdr.payload_len != nb:
                    raise RecordError(f"record of {total} bytes does not hold one {nb}-byte block")
                payload = views[i] if direct else memoryview(value)[HEADER_LEN:]
                if payload_checksum(payload) != hdr.payload_xxh:
                    raise RecordError("payload checksum mismatch")
            except RecordError as exc:
                log.warning("remote tier: dropping damaged record %s: %s", keys[i].hex()[:16], exc)
                return "corrupt"
            if not direct:
                src = np.frombuffer(value, dtype=np.uint8, count=nb, offset=HEADER_LEN)
                dst = out[i]
                if dst.device.type == "cpu":
                    dst.numpy()[:] = src
                else:
                    dst.copy_(torch.from_numpy(src.copy()))
            ok[i] = True
            return None

        res = self.client.get_into(rkeys, HEADER_LEN, into, verify, unavailable=_DOWN)
        bad = [rkeys[i] for i, r in enumerate(res) if r == "corrupt"]
        for i, r in enumerate(res):
            if r is _DOWN:
                self.counters["unavailable"] += 1
            elif r == "corrupt":
                corrupt[i] = True
            elif r == "foreign":
                missing[i] = True
                self.counters["foreign"] += 1
        self.counters["corrupt"] += len(bad)
        self.counters["missing"] += sum(missing)
        if bad:
            self.client.delete_many(bad)
        return ok, corrupt, missing

    def open_ranges(self, keys: Sequence[bytes]) -> "RemoteRangeReads":
        """Records read by byte range, then verified whole (``RemoteRangeReads``: the in-step load's reads under the
        forward, as ``DiskTier.open_ranges``); the headers come now, in one round trip per node."""
        self._check_open()
        rkeys = [self.redis_key(k) for k in keys]
        heads = [bytearray(HEADER_LEN) for _ in keys]
        got = self.client.getrange_into(rkeys, lambda i: ((0, HEADER_LEN),), lambda i: (memoryview(heads[i]),),
                                        unavailable=_DOWN)
        return RemoteRangeReads(self, list(keys), rkeys, heads, got)

    def delete(self, keys: Sequence[bytes]) -> None:
        """Delete records (best effort) and announce it on the presence stream."""
        self._check_open()
        if not keys:
            return
        self.client.delete_many([self.redis_key(k) for k in keys])
        if self.publish_writes:
            publish(self.client, self.stream, removed=list(keys), maxlen=self.settings.stream_maxlen)

    def has(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether Redis holds a record of each key now (one pipelined ``EXISTS`` per node; no payload)."""
        self._check_open()
        return self.client.exists_many([self.redis_key(k) for k in keys])

    def stored_keys(self) -> list[bytes]:
        """Keys of this namespace Redis holds now, by ``SCAN`` of every master (for tools and tests: a store
        learns what the fleet holds from the presence feed, not from a scan of the whole cluster)."""
        self._check_open()
        out: list[bytes] = []
        pattern = self._base.replace(b"*", b"\\*").replace(b"?", b"\\?") + b"*"
        for node in self.client.rc.get_primaries():
            r = self.client.rc.get_redis_connection(node)
            out += [k[len(self._base):] for k in r.scan_iter(match=pattern, count=1000)]
        return out

    # ------------------------------------------------------------------ presence
    def feed(self) -> PresenceFeed:
        """Start (once) and return the presence feed of this tier's namespace."""
        if self._feed is None:
            self._feed = PresenceFeed(self.client, self.stream)
        return self._feed

    def describe(self) -> dict:
        """Adds the cluster (never the password) and the tier's counters."""
        d = super().describe()
        d.update(self.settings.describe(), nodes=self.client.nodes(), **self.counters,
                 **{f"client_{k}": v for k, v in self.client.counters.items()})
        return d

    def close(self) -> None:
        """Stop the presence feed and close the client (if this tier opened it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._feed is not None:
            self._feed.close()
        if self._own_client:
            self.client.close()


class RemoteRangeReads:
    """The remote tier's ``RangeReads`` (see ``tiers.disk.indexed.RangeReads``): ``GETRANGE`` of a record's payload
    ranges, the record verified whole once every range is in. ``headers[i]`` None: nothing of ours to read
    (``missing[i]``: no record; else its node is down, another layout's, or damaged). ``read_many`` may run on
    several threads at once (the client is thread-safe); ``close`` deletes the damaged records."""

    def __init__(self, tier: RemoteTier, keys: list[bytes], rkeys: list[bytes], heads: list[bytearray],
                 got: list) -> None:
        self.tier, self.keys, self._rkeys = tier, keys, rkeys
        self.missing = [False] * len(keys)
        self.headers: list[RecordHeader | None] = []
        self._bad: set[int] = set()  # damaged: deleted at close
        self._unavailable: set[int] = set()  # a range read found its node down: neither damaged nor missing
        nb = tier.block_nbytes
        for i, (head, g) in enumerate(zip(heads, got)):
            hdr = None
            if g is _DOWN:
                tier.counters["unavailable"] += 1
            elif g is not True:
                self.missing[i] = True  # GETRANGE of no key: empty
            else:
                try:
                    hdr = RecordHeader.unpack(rkeys[i], memoryview(head))
                    if hdr.layout_fp != tier.layout.fingerprint:
                        hdr = None  # another layout under our key: not ours, not damage either
                    elif hdr.codec != CODEC_NONE or hdr.raw_len != nb or hdr.payload_len != nb:
                        raise RecordError(f"record of {hdr.payload_len} payload bytes does not hold one {nb}-byte "
                                          "block")
                except RecordError as exc:
                    log.warning("remote tier: dropping damaged record %s: %s", keys[i].hex()[:16], exc)
                    hdr = None
                    self._bad.add(i)
            self.headers.append(hdr)

    def read_many(self, i: int, ranges: Sequence[tuple[int, int]], image: torch.Tensor) -> bool:
        """Payload bytes ``[a, b)`` of record i into the same bytes of ``image``, for each range; False when it has
        no header of ours, a range came short (the value is gone since: ``missing``) or its node failed (neither
        missing nor damaged: the record stays for a later read)."""
        return self.read_group((i,), ranges, (image,))[0]

    def read_group(self, items: Sequence[int], ranges: Sequence[tuple[int, int]],
                   images: Sequence[torch.Tensor]) -> list[bool]:
        """The same payload ``ranges`` of each record in ``items`` into its image (``images``, in order), in one
        exchange: one pipelined round trip per node for all of them (a layer group of a step's records). Per item as
        ``read_many``. One thread reading this way holds the GIL far less than threads doing ``read_many`` a few
        ranges at a time (``benchmarks/probes/remote_ranges.py``)."""
        todo = [(k, i) for k, i in enumerate(items) if self.headers[i] is not None and i not in self._bad]
        out = [False] * len(items)
        if not todo:
            return out
        arrs = [memoryview(images[k].numpy()).cast("B") for k, _ in todo]
        spans = [(HEADER_LEN + a, HEADER_LEN + b) for a, b in ranges]
        got = self.tier.client.getrange_into([self._rkeys[i] for _, i in todo], lambda _: spans,
                                             lambda t: [arrs[t][a:b] for a, b in ranges], unavailable=_DOWN)
        for (k, i), g in zip(todo, got):
            out[k] = self._landed(i, g)
        return out

    def _landed(self, i: int, got) -> bool:
        """Record i's ranges came: True whole; ``_DOWN`` (its node failed or is skipped: not damage, the record
        stays for a later read); else short (evicted or deleted since its header was read: ``missing``)."""
        if got is True:
            return True
        if got is _DOWN:
            self._unavailable.add(i)
            self.tier.counters["unavailable"] += 1
        else:
            self.missing[i] = True
        return False

    def read(self, i: int, start: int, end: int, image: torch.Tensor) -> bool:
        """One range (``read_many`` of one)."""
        return self.read_many(i, ((start, end),), image)

    def verify(self, i: int, image: torch.Tensor) -> bool:
        """Whether record i's ``image`` is the payload its header describes (every range of it read)."""
        hdr = self.headers[i]
        if hdr is None or i in self._bad or i in self._unavailable or self.missing[i]:
            return False
        if not hdr.payload_matches(image.numpy()):
            self._bad.add(i)
            return False
        return True

    def corrupt(self, i: int) -> bool:
        """Record i was there and found damaged."""
        return i in self._bad

    def close(self) -> None:
        """Delete the damaged records (as a whole-record read does)."""
        bad = [self._rkeys[i] for i in sorted(self._bad)]
        if bad:
            self.tier.counters["corrupt"] += len(bad)
            self.tier.client.delete_many(bad)
