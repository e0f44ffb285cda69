"""The remote tier: blocks in a Redis Cluster shared by a fleet of engines.

``RemoteTier`` (tier.py) stores checksummed records through ``ClusterClient`` (client.py: batched,
per-node pipelines with bounded waits); ``PresenceFeed`` (presence.py) tells each engine what its
fleet stored, without a round trip per lookup; ``RemoteSettings`` (settings.py) holds the config.
redis-py is imported only when a client is built, so importing this package needs no Redis.

Other modules import from here, not from the four files. Threading contract: as stated in each module.
"""
from tiered_kv.tiers.remote.client import ClusterClient
from tiered_kv.tiers.remote.presence import PresenceFeed, publish, stream_key
from tiered_kv.tiers.remote.settings import REMOTE_WRITES, RemoteSettings
from tiered_kv.tiers.remote.tier import RemoteTier

__all__ = ["REMOTE_WRITES", "ClusterClient", "PresenceFeed", "RemoteSettings", "RemoteTier", "publish", "stream_key"]
