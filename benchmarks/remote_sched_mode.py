"""A TieredKVConnector whose ``kv_connector_extra_config`` comes from ``$TKV_EXTRA`` (JSON), so tools that
load a connector by ``MODULE:CLASS`` with no extra config (``../shared/tools/sched_overhead.py``) can measure
it with the remote tier configured. Used by ``benchmarks/sched_overhead_runs.sh`` (mode ``remote``).

``$TKV_FLEET_KEYS_PER_S`` (scheduler role, with ``remote_url``): a separate process plays the rest of the
fleet, announcing that many freshly stored chunks per second on this engine's presence stream, so the
measured steps include adopting what the feed brings (the keys are random: they grow the index, never
hit). A process, not a thread: the fleet's work must not take the scheduler thread's GIL time. The connector
waits until the feed has read the fleet's first announcements (the tool's measured steps last ~0.15 s, less
than the fleet process takes to start). The fleet stops when its parent exits (or after 30 minutes).

Threading contract: as ``TieredKVConnector``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def fleet(stream_hex: str, rate: str, parent: str) -> None:
    """Announce ``rate`` random chunks a second on the stream until ``parent`` exits."""
    from tiered_kv.tiers.remote import ClusterClient, RemoteSettings, publish  # noqa: PLC0415

    extra = json.loads(os.environ["TKV_EXTRA"])
    client = ClusterClient(RemoteSettings(extra["remote_url"], extra.get("remote_password_env") or None))
    stream, batch = bytes.fromhex(stream_hex), max(1, int(float(rate) / 100))  # 100 announcements a second
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        try:
            os.kill(int(parent), 0)
        except OSError:
            break
        publish(client, stream, [uuid.uuid4().bytes * 2 for _ in range(batch)])
        time.sleep(0.01)
    client.close()


if __name__ == "__main__" and sys.argv[1:2] == ["fleet"]:  # before vLLM's import: the fleet needs only redis-py
    fleet(*sys.argv[2:5])
    sys.exit(0)

from tiered_kv.connector.vllm.connector import TieredKVConnector  # noqa: E402


class ExtraFromEnvConnector(TieredKVConnector):
    """``TieredKVConnector`` with ``kv_connector_extra_config`` updated from ``$TKV_EXTRA``."""

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        extra = json.loads(os.environ.get("TKV_EXTRA", "{}"))
        ktc = vllm_config.kv_transfer_config
        ktc.kv_connector_extra_config = {**(ktc.kv_connector_extra_config or {}), **extra}
        super().__init__(vllm_config, role, kv_cache_config)
        rate = float(os.environ.get("TKV_FLEET_KEYS_PER_S", "0"))
        self._fleet = None
        if rate > 0 and self._presence is not None:
            self._fleet = subprocess.Popen([sys.executable, __file__, "fleet", self._presence.stream.hex(), str(rate),
                                           str(os.getpid())])
            # the tool's steps take ~0.15 s, less than the fleet process's start: wait until its announcements
            # arrive, so the measured steps run beside a fleet that is writing (and a feed that is reading)
            seen, deadline = self._presence.entries, time.monotonic() + 60
            while self._presence.entries < seen + 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            if self._presence.entries < seen + 2:
                raise RuntimeError("remote_sched_mode: the fleet process announced nothing within 60 s")

    def shutdown(self) -> None:
        """Stop this connector's fleet process (``benchmarks/sched_interleaved.py`` builds one connector a round in
        one process), then shut the connector down."""
        fleet, self._fleet = self._fleet, None
        try:
            if fleet is not None:
                fleet.terminate()
                try:
                    fleet.wait(10)
                except subprocess.TimeoutExpired:
                    fleet.kill()
                    fleet.wait(10)
        finally:
            super().shutdown()
