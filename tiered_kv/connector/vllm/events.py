"""KV events: what the connector stored and evicted, per medium, as vLLM's own ``BlockStored``/``BlockRemoved``.

vLLM publishes whatever ``take_events()`` returns with its GPU prefix-cache events (``--kv-events-config
'{"enable_kv_cache_events": true, "publisher": "zmq", ...}'``), so a cache-aware router that already
follows vLLM's events learns where a prefix lives beyond the GPU: ``medium`` is ``"CPU"``, ``"DISK"`` or
``"REMOTE"`` (our tier names, upper case). One event covers one chunk: its vLLM block hashes (one per
``hash_block_size`` tokens), the hash before it, its tokens. A chunk is reported by the engine that
stored it; chunks other engines stored in the shared remote tier are reported by them.

The event classes differ between vLLM versions (0.32 adds fields with defaults such as ``group_idx``
and ``locality``): ``make_events`` fills only the fields the installed classes declare.

Threading contract: called on vLLM's scheduler thread only (``take_events``).
"""
from __future__ import annotations

from collections.abc import Iterable

from vllm.distributed.kv_events import BlockRemoved, BlockStored

try:  # vLLM turns its internal block hashes into the published form with this (both versions have it)
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as _external
except ImportError:  # pragma: no cover - a vLLM without it publishes the raw bytes
    def _external(h):
        return h

_STORED_FIELDS = set(BlockStored.__struct_fields__)
_REMOVED_FIELDS = set(BlockRemoved.__struct_fields__)


def medium(tier_name: str) -> str:
    """The ``medium`` string of one of our tiers in vLLM's events."""
    return tier_name.upper()


def make_events(records: Iterable[tuple[bool, str, tuple]], block_size: int) -> list:
    """vLLM events for ``SchedulerPlanner.take_events()`` records ``(stored, tier name, (hashes, parent, tokens,
    lora_id))``; ``block_size`` is the tokens per block hash."""
    out = []
    for stored, tier, (hashes, parent, tokens, lora_id) in records:
        ext = [_external(h) for h in hashes]
        if stored:
            kw = dict(block_hashes=ext, parent_block_hash=None if parent is None else _external(parent),
                      token_ids=list(tokens), block_size=block_size, lora_id=lora_id, medium=medium(tier),
                      lora_name=None)
            out.append(BlockStored(**{k: v for k, v in kw.items() if k in _STORED_FIELDS}))
        else:
            kw = dict(block_hashes=ext, medium=medium(tier))
            out.append(BlockRemoved(**{k: v for k, v in kw.items() if k in _REMOVED_FIELDS}))
    return out
