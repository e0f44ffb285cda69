"""The store gate on CUDA (``connector/vllm/store_gate.py``): a held store's copy waits for the event ``open`` records.

vLLM's stream is kept busy by a sleep kernel, then writes the bytes a store will read (standing in for the sampler
and the next step's inputs enqueued before ``bind_connector_metadata``), then the gate opens. The mover's copy on its
own stream must see those bytes: it waits for the event recorded at ``open``, not only for the forward's event.
"""
from __future__ import annotations

import threading

import pytest
import torch

from tiered_kv.connector.vllm import store_gate
from tiered_kv.connector.vllm.store_gate import StoreGate, order_after


@pytest.mark.parametrize("mover_first", [True, False], ids=["mover-waits-first", "gate-opens-first"])
def test_a_held_store_copies_after_the_work_enqueued_before_the_gate_opened(monkeypatch, mover_first):
    """``gate-opens-first``: the mover was still busy with an earlier job when the next step opened the gate."""
    monkeypatch.setattr(store_gate, "HOLD_AFTER_FORWARD_S", 10.0)  # only ``open`` lets it go here
    dev = torch.device("cuda", torch.cuda.current_device())
    gate = StoreGate(dev)
    src = torch.zeros(1 << 20, dtype=torch.uint8, device=dev)
    dst = torch.full((1 << 20,), 1, dtype=torch.uint8).pin_memory()
    forward = torch.cuda.Event()
    forward.record()  # the forward's end: before the work below
    gate.hold([5])
    out: dict = {}
    waiting = threading.Event()
    go = threading.Event()

    def mover():
        side = torch.cuda.Stream(device=dev)
        if not mover_first:
            go.wait(30)  # the gate has opened before this mover takes the job
        waiting.set()
        after = gate.wait(5, forward)
        out["after"] = after
        side.wait_event(forward)
        if after is not None:
            order_after(side, after)  # what the runner does: the event, then the one-block sleep kernel
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
        side.synchronize()

    t = threading.Thread(target=mover)
    t.start()
    if mover_first:
        waiting.wait(30)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of vLLM's stream (sampler, token copy, next inputs)
    src.fill_(7)
    gate.open()
    go.set()
    t.join(30)
    assert not t.is_alive()
    assert out["after"] is not None
    assert bool((dst == 7).all()), "the store copied before the work enqueued ahead of the gate"
    assert gate.counters.stores_held_opened == 1 and gate.counters.stores_held_timed_out == 0
