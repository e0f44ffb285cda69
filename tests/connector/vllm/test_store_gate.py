"""A step's stores wait for the next step (``store_gate.py``): the gate itself, and on vLLM's real Scheduler.

On the H200 a store's device-to-host copy started at the forward's end held up the sampler's copy of the tokens to
the host (+3.8 ms a 1,312-token Llama-3-8B prefill step with our mover, +3.0 ms the copy alone:
``benchmarks/probes/store_beside_step.py``). The CPU box has no copy engine to show that; these tests show the
order: a store is not copied before the next step's ``bind_connector_metadata`` (or, with no next step, shortly after
its forward ended), and every stored byte is still right.
"""
from __future__ import annotations

import threading
import time

import pytest

from tiered_kv.connector.vllm import store_gate
from tiered_kv.connector.vllm.store_gate import StoreGate


class _ForwardAt:
    """Stands in for the forward's ``torch.cuda.Event`` (no CUDA here): ``query`` is true from ``at`` on."""

    def __init__(self, at: float) -> None:
        self.at = at

    def query(self) -> bool:
        return time.monotonic() >= self.at


def _wait_in_thread(gate: StoreGate, job_id: int, forward=None):
    out: dict = {}

    def run():
        t0 = time.monotonic()
        out["after"] = gate.wait(job_id, forward)
        out["end"] = time.monotonic()
        out["seconds"] = out["end"] - t0

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_a_held_store_waits_until_the_gate_opens(monkeypatch):
    monkeypatch.setattr(store_gate, "HOLD_MAX_S", 30.0)
    gate = StoreGate(None)
    gate.hold([7])
    assert gate.holding == 1
    t, out = _wait_in_thread(gate, 7, _ForwardAt(time.monotonic() + 30.0))  # the forward has not ended
    time.sleep(0.05)
    assert t.is_alive(), "the store went before the next step"
    gate.open()
    t.join(5)
    assert not t.is_alive() and out["after"] is None  # no CUDA: no event to wait for
    assert gate.counters.stores_held_opened == 1 and gate.counters.stores_held_timed_out == 0
    assert gate.holding == 0


def test_a_job_never_held_passes_at_once():
    gate = StoreGate(None)
    gate.hold([1])
    t0 = time.monotonic()
    assert gate.wait(2, None) is None
    assert time.monotonic() - t0 < 0.05
    assert gate.holding == 1  # job 1 still waits for its step


def test_with_no_next_step_a_store_goes_shortly_after_its_forward_ended():
    gate = StoreGate(None)
    gate.hold([3])
    ends = time.monotonic() + 0.08
    t, out = _wait_in_thread(gate, 3, _ForwardAt(ends))
    t.join(5)
    assert not t.is_alive()
    assert out["end"] >= ends + store_gate.HOLD_AFTER_FORWARD_S * 0.9, out  # held past the forward's end
    assert out["end"] < ends + 2.0, out
    assert gate.counters.stores_held_timed_out == 1 and gate.holding == 0


def test_a_store_whose_mover_comes_after_the_gate_opened_goes_as_opened():
    """The mover was busy with an earlier job when the next step opened the gate: the store still finds it open (with
    the event, on CUDA: tests/gpu/test_store_gate_gpu.py), not as a job never held."""
    gate = StoreGate(None)
    gate.hold([8, 9])
    gate.open()
    assert gate.holding == 0
    t0 = time.monotonic()
    assert gate.wait(8, _ForwardAt(time.monotonic() + 3600)) is None
    assert time.monotonic() - t0 < 0.5
    assert gate.counters.stores_held_opened == 2 and gate.counters.stores_held_timed_out == 0
    gate.forget(9)  # a fence cancelled it: it never reaches ``wait``
    gate.open()
    assert gate.counters.stores_held_opened == 2 and gate._held == {}


def test_hold_max_lets_a_store_go_whose_forward_never_reports(monkeypatch):
    monkeypatch.setattr(store_gate, "HOLD_MAX_S", 0.05)
    gate = StoreGate(None)
    gate.hold([4])
    t, out = _wait_in_thread(gate, 4, _ForwardAt(time.monotonic() + 3600))
    t.join(5)
    assert not t.is_alive() and 0.04 <= out["seconds"] < 2.0, out
    assert gate.counters.stores_held_timed_out == 1


# ---------------------------------------------------------------------------- vLLM's real Scheduler
vllm = pytest.importorskip("vllm")

from tests.connector.vllm.harness import BS, Engine, write_model_dir  # noqa: E402
from tests.connector.vllm.test_connector import BLOCK_BYTES, K, prompt  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(str(tmp_path_factory.mktemp("gate-llama")))


@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async"])
def test_a_prefill_store_copies_only_after_the_next_step_began(model_dir, monkeypatch, async_sched):
    """Fails on the code before the gate: the prefill's store was copied during its own step."""
    monkeypatch.setattr(store_gate, "HOLD_AFTER_FORWARD_S", 30.0)  # only the next step may open it here
    monkeypatch.setattr(store_gate, "HOLD_MAX_S", 60.0)
    eng = Engine.create(model_dir, {"chunk_blocks": K, "cpu_bytes": "1MiB"}, async_sched=async_sched)
    try:
        runtime = eng.workers[0].connector.worker
        a = eng.add("turn1", prompt(1, 8 * BS + 4), max_tokens=3)
        eng.step()  # the whole prompt: its two full chunks are stored in this step's wait_for_save
        time.sleep(0.1)
        assert runtime.counters.bytes_stored == 0, "the store was copied before the next step"
        assert runtime.store_gate.holding >= 1
        eng.step()  # its bind_connector_metadata opens the gate
        eng.run()
        eng.settle()
        assert runtime.counters.bytes_stored > 0
        assert runtime.counters.stores_held_opened >= 1 and runtime.counters.stores_held_timed_out == 0
        assert eng.connector.stats()["resident_cpu"] == 2
        assert eng.sched.reset_prefix_cache()
        verified = eng.verified_blocks
        b = eng.add("turn2", list(a.prompt_token_ids) + list(a.output_token_ids) + prompt(9, 40), max_tokens=2)
        eng.run()
        eng.settle()
        assert eng.connector.stats()["sched_hit_tokens_cpu"] == 8 * BS
        assert eng.verified_blocks - verified >= 8  # the stored bytes loaded back right
        assert b.is_finished()
    finally:
        eng.close()


def test_an_engine_that_goes_idle_still_stores_its_last_prefill(model_dir):
    """No step after the prefill (one output token, nothing else queued): the held store goes on its own."""
    eng = Engine.create(model_dir, {"chunk_blocks": K, "cpu_bytes": "1MiB"})
    try:
        runtime = eng.workers[0].connector.worker
        eng.add("only", prompt(2, 8 * BS + 4), max_tokens=1)
        eng.step()
        eng.flush()
        deadline = time.monotonic() + 10
        while runtime.counters.bytes_stored == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # no engine step in between
        assert runtime.counters.bytes_stored == 2 * K * BLOCK_BYTES  # both full chunks of the prompt
        assert runtime.counters.stores_held_timed_out >= 1
        eng.settle()
        assert eng.connector.stats()["resident_cpu"] == 2
    finally:
        eng.close()


def test_forward_end_copies_a_store_in_its_own_step(model_dir, monkeypatch):
    """``store_start: forward_end`` keeps the old order: nothing held, the copy needs no next step."""
    monkeypatch.setattr(store_gate, "HOLD_AFTER_FORWARD_S", 30.0)
    monkeypatch.setattr(store_gate, "HOLD_MAX_S", 60.0)
    eng = Engine.create(model_dir, {"chunk_blocks": K, "cpu_bytes": "1MiB", "store_start": "forward_end"})
    try:
        runtime = eng.workers[0].connector.worker
        eng.add("turn1", prompt(3, 8 * BS + 4), max_tokens=3)
        eng.step()
        assert runtime.store_gate.holding == 0
        deadline = time.monotonic() + 10
        while runtime.counters.bytes_stored < 2 * K * BLOCK_BYTES and time.monotonic() < deadline:
            time.sleep(0.01)
        assert runtime.counters.bytes_stored == 2 * K * BLOCK_BYTES
        assert runtime.counters.stores_held_opened == 0 and runtime.counters.stores_held_timed_out == 0
        eng.run()
        eng.settle()
    finally:
        eng.close()
