"""``TIERED_KV_PROFILE``: the worker hooks' profile, on vLLM's real Scheduler with the worker side on CPU tensors.

With the variable set, a turn 2 that loads turn 1's prefix leaves a text summary and a JSON of the hooks' calls and
stack samples; the sampler attributes a hook's time to the function it spends it in; unset, the connector has no
profile.
"""
from __future__ import annotations

import json
import os
import time

import pytest

pytest.importorskip("vllm")

from tests.connector.vllm.harness import BS, Engine  # noqa: E402
from tests.connector.vllm.test_connector import cfg, model_dir, prompt, turn2  # noqa: E402,F401
from tiered_kv.connector.vllm import hook_profile  # noqa: E402


def test_the_hooks_of_a_loading_turn_are_counted_and_written(model_dir, tmp_path, monkeypatch):
    out = tmp_path / "prof"
    monkeypatch.setenv(hook_profile.ENV, str(out))
    eng = Engine.create(model_dir, cfg(load_mode="layerwise"))
    try:
        a = eng.add("p1", prompt(3, 8 * BS + 4), max_tokens=3)
        eng.run()
        eng.settle()
        assert eng.sched.reset_prefix_cache()
        eng.add("p2", turn2(eng, a), max_tokens=2)
        eng.run()
        eng.settle()
        assert eng.connector.stats()["sched_hit_tokens_cpu"] == 8 * BS
        prof = eng.workers[0].connector._profile
        assert eng.connector._profile is None  # the scheduler's hooks are not the worker's
        assert hook_profile.from_env() is prof  # one profile per process
        prof.dump()
    finally:
        eng.close()
    assert prof.calls["start_load_kv"] >= 2 and prof.calls["wait_for_layer_load"] >= 2  # two layers, each step
    assert prof.calls["get_finished"] == prof.calls["start_load_kv"]
    text = open(prof.base + ".txt").read()
    assert "start_load_kv |" in text and "by own samples" in text and "by inclusive samples" in text
    doc = json.loads(open(prof.base + ".json").read())
    assert doc["hooks"]["start_load_kv"]["calls"] == prof.calls["start_load_kv"]


def _slow_part(seconds: float) -> None:
    time.sleep(seconds)


def _hook_body(seconds: float) -> str:
    _slow_part(seconds)
    return "done"


def test_samples_name_the_function_the_hook_spends_its_time_in(tmp_path):
    """A hook that spends 0.2 s in one function: the samples land there (own) and in the hook body (inclusive); no
    sample is taken while no hook runs."""
    prof = hook_profile.HookProfile(str(tmp_path), sample_every_s=0.001)
    try:
        time.sleep(0.05)  # no hook running: nothing sampled
        assert prof.tables()["samples"] == 0
        assert prof.call("start_load_kv", _hook_body, 0.2) == "done"
        t = prof.tables()
        assert t["hooks"]["start_load_kv"]["calls"] == 1 and t["hooks"]["start_load_kv"]["seconds"] >= 0.2
        own = dict(t["own"])
        slow = next(fn for fn in own if fn.endswith(":_slow_part"))
        assert own[slow] >= 0.8 * t["samples"] and t["samples"] >= 20
        assert any(fn.endswith(":_hook_body") for fn, _ in t["inclusive"])
        assert t["stacks"][0]["hook"] == "start_load_kv" and t["stacks"][0]["frames"][0] == slow
    finally:
        prof.close()
    assert os.path.exists(prof.base + ".txt") and os.path.exists(prof.base + ".json")


def test_unset_means_no_profile(model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv(hook_profile.ENV, raising=False)
    eng = Engine.create(model_dir, cfg())
    try:
        assert eng.workers[0].connector._profile is None
    finally:
        eng.close()
    assert hook_profile.from_env() is None


def test_a_directory_that_cannot_be_made_leaves_the_run_unprofiled(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(hook_profile.ENV, str(blocker / "prof"))
    with caplog.at_level("WARNING", logger=hook_profile.log.name):
        assert hook_profile.from_env() is None
    assert "cannot profile there" in caplog.text
