"""``NullConnector``: a vLLM KV connector that does nothing, to measure vLLM's connector plumbing alone.

With any connector configured, vLLM's scheduler runs code it skips without one (a lookup per
waiting request, a metadata object per step, a ``KVConnectorOutput`` to fold in, the finish
hook); this class answers every hook with "nothing" at the least cost, so the scheduler step
cost it adds is the floor no connector can go under. ``benchmarks/sched_overhead_runs.sh``
runs it next to ``none`` and ours::

    --kv-transfer-config '{"kv_connector":"NullConnector",
      "kv_connector_module_path":"benchmarks.probes.null_connector","kv_role":"kv_both"}'

Threading contract: stateless; any thread.
"""
from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

_EMPTY = KVConnectorMetadata()


class NullConnector(KVConnectorBase_V1):
    """Never hits, never stores, never loads."""

    # ------------------------------------------------------------------ scheduler role
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """No external hit."""
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Nothing to plan."""

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        """The same empty metadata every step."""
        return _EMPTY

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        """Never delays vLLM's frees."""
        return False, None

    # ------------------------------------------------------------------ worker role
    def start_load_kv(self, forward_context, **kwargs) -> None:
        """Nothing to load."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for."""

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        """Nothing to save."""

    def wait_for_save(self) -> None:
        """Nothing to wait for."""
