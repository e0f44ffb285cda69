"""``TIERED_KV_PROFILE``: the worker hooks' profile, on vLLM's real Scheduler with the worker side on CPU tensors.

With the variable set, a turn 2 that loads turn 1's prefix leaves a ``pstats`` file and a text summary naming the
hooks (calls per hook) and our functions under them; unset, the connector has no profile and nothing is written.
"""
from __future__ import annotations

import os
import pstats

import pytest

pytest.importorskip("vllm")

from tests.connector.vllm.harness import BS, Engine  # noqa: E402
from tests.connector.vllm.test_connector import cfg, model_dir, prompt, turn2  # noqa: E402,F401
from tiered_kv.connector.vllm import hook_profile  # noqa: E402


def test_the_hooks_of_a_loading_turn_are_profiled_into_the_directory(model_dir, tmp_path, monkeypatch):
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
        prof.dump()
    finally:
        eng.close()
    assert prof.calls["start_load_kv"] >= 2 and prof.calls["wait_for_layer_load"] >= 2  # two layers, each step
    assert prof.calls["get_finished"] == prof.calls["start_load_kv"]
    base = out / f"hooks_{os.getpid()}"
    text = (base.with_suffix(".txt")).read_text()
    assert "start_load_kv |" in text and "by tottime:" in text and "by cumulative:" in text
    funcs = {f"{name}" for (_, _, name) in pstats.Stats(str(base.with_suffix(".prof"))).stats}
    assert {"before_forward", "wait_layer", "poll"} <= funcs  # our worker's code, under the hooks


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
