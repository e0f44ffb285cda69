"""``hybrid_reseed``: a hybrid model's shared prefix, once its window left the GPU, comes back into vLLM's own cache.

The watch on its own (which hits count as shared, the rate limit), then vLLM's real ``Scheduler`` with the
gpt-oss-like test model: the workload of ``benchmarks/probes/hybrid_shared_prefix.py``, where without the key no
turn 2 ever gets the shared system prompt from vLLM's cache again.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.connector.vllm import models  # noqa: E402
from tiered_kv.connector.vllm.config import ConnectorConfig  # noqa: E402
from tiered_kv.connector.vllm.reseed import SharedPrefixWatch  # noqa: E402
from tiered_kv.errors import ConfigError  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks" / "probes"))
import hybrid_shared_prefix  # noqa: E402  (the probe's workload, run here on vLLM's real scheduler)

SYSTEM, CONTEXT = hybrid_shared_prefix.SYSTEM, hybrid_shared_prefix.CONTEXT


def test_two_conversations_that_run_alike_then_diverge_share_their_common_run():
    now = [100.0]
    w = SharedPrefixWatch(2.0, clock=lambda: now[0])
    s = [b"s0", b"s1", b"s2", b"s3"]
    assert w.branch(s + [b"a0", b"a1"]) == 0  # the first hit from s0: nothing to compare with
    assert w.branch(s + [b"a0", b"a1", b"a2"]) == 0  # a later turn of the same conversation extends it
    assert w.branch(s + [b"b0"]) == 4  # another conversation: the system prompt's 4 chunks are shared
    assert w.branch([b"x0", b"x1"]) == 0 and w.branch([]) == 0
    assert w.branch([b"s0", b"s1", b"z"]) == 2
    assert w.due()
    w.fired()
    assert not w.due()
    now[0] += 2.0
    assert w.due()


def test_the_watch_forgets_the_least_recently_seen_first_chunks():
    w = SharedPrefixWatch(0.0, capacity=2)
    w.branch([b"a", b"a1"])
    w.branch([b"b", b"b1"])
    w.branch([b"a", b"a1", b"a2"])  # a seen again: b is now the oldest
    w.branch([b"c", b"c1"])  # over capacity: b goes
    assert w.branch([b"a", b"z"]) == 1  # a is still known
    assert w.branch([b"b", b"z"]) == 0  # b's path was forgotten: no branch to find


def test_the_keys_are_checked():
    assert ConnectorConfig.from_extra_config({}).hybrid_reseed is False
    cfg = ConnectorConfig.from_extra_config({"hybrid_reseed": True, "hybrid_reseed_interval_s": 0})
    assert cfg.hybrid_reseed and cfg.hybrid_reseed_interval_s == 0.0
    with pytest.raises(ConfigError, match="hybrid_reseed_interval_s: expected seconds >= 0"):
        ConnectorConfig.from_extra_config({"hybrid_reseed_interval_s": -1})
    with pytest.raises(ConfigError, match="hybrid_reseed: expected true or false"):
        ConnectorConfig.from_extra_config({"hybrid_reseed": "yes"})
    with pytest.raises(ValueError, match="hybrid_reseed_interval_s=-1"):
        SharedPrefixWatch(-1)


@pytest.fixture(autouse=True)
def patient_fences(monkeypatch):
    """Every store should land here (hits are counted): give a queued store a second before a fence cancels it, as
    ``test_hybrid.py`` does, for the same reason (a busy 2-core box may not start one within 2 ms)."""
    import tiered_kv.connector.vllm.worker as worker

    monkeypatch.setattr(worker, "FENCE_PATIENCE_S", 1.0)


@pytest.fixture(scope="module")
def gptoss_dir(tmp_path_factory):
    return models.write_model_dir(str(tmp_path_factory.mktemp("reseed") / "gptoss"), "gptoss")


def _turn2s(model_dir: str, extra: dict) -> tuple[list[tuple[int, int]], dict]:
    """(vLLM's own hit, the connector's hit) of every user's turn 2 after unrelated prompts evicted the system
    prompt (the probe's workload), and the connector's stats."""
    rows, stats = hybrid_shared_prefix.run(model_dir, extra)
    return [(r["local"], r["connector"]) for r in rows], stats


def test_without_the_key_no_turn_2_gets_the_shared_system_prompt_from_vllm_again(gptoss_dir):
    hits, stats = _turn2s(gptoss_dir, {})
    assert all(local == 0 for local, _ in hits), hits  # every turn 2 loads its whole prefix, system prompt included
    assert all(loaded >= SYSTEM + CONTEXT for _, loaded in hits) and stats["sched_hybrid_reseeds"] == 0


def test_with_the_key_one_request_recomputes_and_the_rest_hit_the_system_prompt_in_the_gpu(gptoss_dir):
    hits, stats = _turn2s(gptoss_dir, {"hybrid_reseed": True, "hybrid_reseed_interval_s": 0})
    # user 0's hit is the first from the system prompt's first chunk; user 1's runs alike for the system prompt's
    # chunks then diverges: it gets no hit and recomputes, so vLLM caches the system prompt with its window
    assert hits[0][0] == 0 and hits[0][1] >= SYSTEM + CONTEXT
    assert hits[1] == (0, 0) and stats["sched_hybrid_reseeds"] == 1
    # every later turn 2: the system prompt from vLLM's own cache, the rest loaded (the harness checks every KV
    # value the forwards read)
    assert all(local >= SYSTEM and loaded > 0 for local, loaded in hits[2:]), hits
    assert sum(loaded for _, loaded in hits) < sum(loaded for _, loaded in _turn2s(gptoss_dir, {})[0])
