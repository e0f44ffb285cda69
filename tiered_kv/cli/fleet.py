"""``tiered-kv inspect redis://HOST:PORT[,...]``: what a fleet's remote tier (a Redis Cluster) holds, per namespace.

Every engine of a fleet writes its blocks under ``<key_prefix><namespace hex>:...`` and announces
them on ``<key_prefix><namespace hex>|presence`` (``tiers/remote``). This reads the cluster the way an
operator would with ``redis-cli``, and only reads: per master node its keys, memory, ``maxmemory``
policy and evictions (``INFO``); per namespace its blocks and bytes (``SCAN`` of every master for the
key prefix, ``STRLEN`` pipelined per node), the layout fingerprints of a sample of its records (their
verified headers) and the length of its presence stream. A namespace is named by its hex prefix: the
model, layout, tenant salt and rank it stands for are hashed into it (the engine logs it at start).

A full ``SCAN`` visits every key of the cluster: on a large fleet use ``--max-keys`` to stop early
(the report then says it is partial).

Threading contract: a command-line helper; runs on the main thread with its own cluster client.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tiered_kv.errors import RecordError
from tiered_kv.tiers.remote.client import ClusterClient
from tiered_kv.tiers.remote.settings import RemoteSettings
from tiered_kv.values.record import HEADER_LEN, RecordHeader

_PRESENCE = b"|presence"
_BATCH = 1000
_SAMPLE = 8  # records per namespace whose header is read for its layout fingerprint


@dataclass
class NamespaceReport:
    """What the cluster holds for one namespace."""

    blocks: int = 0
    bytes: int = 0
    presence_entries: int = 0
    layouts: dict[str, int] = field(default_factory=dict)  # fingerprint (hex) -> records sampled with it
    sampled: list[bytes] = field(default_factory=list)

    def as_dict(self) -> dict:
        """JSON-able form."""
        return {"blocks": self.blocks, "bytes": self.bytes, "presence_entries": self.presence_entries,
                "layouts_sampled": self.layouts}


def fleet_report(url: str, password_env: str | None = None, user: str | None = None, tls_ca: str | None = None,
                 key_prefix: str = "tkv:", max_keys: int | None = None) -> dict:
    """Read the cluster at ``url`` (seed nodes, as ``remote_url`` takes them) and report nodes and namespaces.

    ConfigError for a bad URL or refused credentials, RemoteUnavailableError when no seed answers."""
    settings = RemoteSettings(url, password_env, user, tls_ca, key_prefix=key_prefix)
    client = ClusterClient(settings)
    try:
        nodes, spaces, seen = [], {}, 0
        for node in client.rc.get_primaries():
            conn = client.rc.get_redis_connection(node)
            nodes.append(_node_info(node.name, conn))
            seen += _scan_node(conn, settings.key_prefix.encode(), spaces, None if max_keys is None else max_keys - seen)
            if max_keys is not None and seen >= max_keys:
                break
        for rep in spaces.values():
            _sample_layouts(client, rep)
        return {"cluster": settings.describe(), "nodes": nodes, "keys_scanned": seen,
                "partial": max_keys is not None and seen >= max_keys,
                "namespaces": {ns: rep.as_dict() for ns, rep in sorted(spaces.items())}}
    finally:
        client.close()


def _node_info(name: str, conn) -> dict:
    """One master's keys, memory, policy and evictions from ``INFO``."""
    info = conn.info()
    return {"node": name, "keys": int(conn.dbsize()), "used_memory": int(info.get("used_memory", 0)),
            "maxmemory": int(info.get("maxmemory", 0)), "policy": str(info.get("maxmemory_policy", "")),
            "evicted_keys": int(info.get("evicted_keys", 0))}


def _scan_node(conn, prefix: bytes, spaces: dict[str, NamespaceReport], budget: int | None) -> int:
    """Count one master's records (and presence streams) of every namespace under ``prefix``; keys scanned."""
    pattern = prefix.replace(b"*", b"\\*").replace(b"?", b"\\?") + b"*"
    batch, seen = [], 0
    for key in conn.scan_iter(match=pattern, count=_BATCH):
        batch.append(key)
        seen += 1
        if len(batch) >= _BATCH:
            _measure(conn, prefix, batch, spaces)
            batch = []
        if budget is not None and seen >= budget:
            break
    _measure(conn, prefix, batch, spaces)
    return seen


def _measure(conn, prefix: bytes, keys: list[bytes], spaces: dict[str, NamespaceReport]) -> None:
    """Sizes of ``keys`` (one pipeline): ``STRLEN`` of records, ``XLEN`` of presence streams."""
    if not keys:
        return
    pipe = conn.pipeline(transaction=False)
    for k in keys:
        (pipe.xlen if k.endswith(_PRESENCE) else pipe.strlen)(k)
    for k, size in zip(keys, pipe.execute(raise_on_error=False)):
        if isinstance(size, Exception):
            continue
        rest = k[len(prefix):]
        if rest.endswith(_PRESENCE):
            _space(spaces, rest[:-len(_PRESENCE)]).presence_entries = int(size)
            continue
        ns, sep, _ = rest.partition(b":")
        if not sep:
            continue  # not a block record of ours
        rep = _space(spaces, ns)
        rep.blocks += 1
        rep.bytes += int(size)
        if len(rep.sampled) < _SAMPLE:
            rep.sampled.append(k)


def _space(spaces: dict[str, NamespaceReport], ns: bytes) -> NamespaceReport:
    name = ns.decode("ascii", "replace")
    return spaces.setdefault(name, NamespaceReport())


def _sample_layouts(client: ClusterClient, rep: NamespaceReport) -> None:
    """Layout fingerprints of the namespace's sampled records, from headers that verify (``bad`` otherwise)."""
    for key in rep.sampled:
        head = client.call(lambda rc, k=key: rc.getrange(k, 0, HEADER_LEN - 1), None)
        if head is None or len(head) < HEADER_LEN:
            continue  # evicted since the scan
        try:
            fp = f"{RecordHeader.unpack(key, head).layout_fp:016x}"
        except RecordError:  # a damaged value: what a read would drop
            fp = "bad"
        rep.layouts[fp] = rep.layouts.get(fp, 0) + 1
