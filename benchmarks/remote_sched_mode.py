"""A TieredKVConnector whose ``kv_connector_extra_config`` comes from ``$TKV_EXTRA`` (JSON), so tools that
load a connector by ``MODULE:CLASS`` with no extra config (``../shared/tools/sched_overhead.py``) can measure
it with the remote tier configured. Used by ``benchmarks/sched_overhead_runs.sh`` (mode ``remote``).

``$TKV_FLEET_KEYS_PER_S`` (scheduler role, with ``remote_url``): a thread plays the rest of the fleet,
announcing that many freshly stored chunks per second on this engine's presence stream, so the measured
steps include adopting what the feed brings (the keys are random: they grow the index, never hit).

Threading contract: as ``TieredKVConnector``; the fleet thread only writes to Redis.
"""
from __future__ import annotations

import json
import os
import threading
import time
import uuid

from tiered_kv.connector.vllm.connector import TieredKVConnector


class ExtraFromEnvConnector(TieredKVConnector):
    """``TieredKVConnector`` with ``kv_connector_extra_config`` updated from ``$TKV_EXTRA``."""

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        extra = json.loads(os.environ.get("TKV_EXTRA", "{}"))
        ktc = vllm_config.kv_transfer_config
        ktc.kv_connector_extra_config = {**(ktc.kv_connector_extra_config or {}), **extra}
        super().__init__(vllm_config, role, kv_cache_config)
        rate = float(os.environ.get("TKV_FLEET_KEYS_PER_S", "0"))
        if rate > 0 and self._presence is not None:
            threading.Thread(target=self._fleet, args=(rate,), name="tkv-bench-fleet", daemon=True).start()

    def _fleet(self, rate: float) -> None:
        from tiered_kv.tiers.remote import publish  # noqa: PLC0415

        batch = max(1, int(rate / 100))  # 100 announcements a second
        feed = self._presence
        while self._presence is not None:
            publish(feed.client, feed.stream, [uuid.uuid4().bytes * 2 for _ in range(batch)])
            time.sleep(0.01)
