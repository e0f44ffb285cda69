"""What a prefill's store costs the step that made it (issue 28: the Llama-3-8B eager c1 cell), on the GPU machine.

Round 19 saw vLLM's own prefill time ~1.5 ms longer with our connector on steps that loaded nothing: the only work
ours adds to such a step is the store of the prefill's KV, submitted in ``wait_for_save`` (after the forward's
launch, before the sampler's) and run by the mover thread. Two ways it could reach the step's end: the store's
device-to-host DMA could hold up the sampler's tiny device-to-host copy of the token ids (copy engines take copies
of one direction in order), or the mover's Python could hold the GIL while vLLM's thread launches the sampler.

This probe times a step shaped like vLLM's eager prefill of a 1,312-token Llama-3-8B prompt (32 layers of the
model's matmuls on one set of weights, then the LM head, argmax, and a non-blocking copy of the token into pinned
memory on a copy stream that waits for the sampler, as vLLM 0.26's asynchronous output does, waited on by an
event), from its launch to the token on the host, with:

- ``none``: no store;
- ``dma``: one contiguous copy of the store's bytes on a side stream, issued by the step's own thread after the
  forward (the DMA alone, no second thread);
- ``gil``: a second thread running Python for ``GIL_MS`` once the forward is launched (the GIL alone, no DMA);
- ``copier``: our mover's way: a thread runs ``BlockCopier.gpu_to_cpu`` of the prompt's 82 blocks on a side stream
  that waits for the forward (both);
- ``gated``: the same, but the store is handed over only after the sampler and the next step's input copies were
  enqueued, with an event recorded there that its side stream waits for too (``store_gate.py``: the store opens at
  the next step's ``bind_connector_metadata``);
- ``gated_spin``: ``gated`` with a one-block sleep kernel of ``SPIN_CYCLES`` before the copy on its stream;
- ``copier_pieces``: the same copy in pieces of ``PIECE_BLOCKS`` blocks, each issued once the previous landed.

Variants run interleaved, ``REPS`` steps each; a step starts once the last one's store landed. Prints the median
step time and its excess over ``none``; writes ``store_beside_step_<TOKEN_COPY>.json`` to ``$OUT``.
Usage: ``[TOKEN_COPY=async|main] python3 benchmarks/probes/store_beside_step.py``. Threading: a script; the store
thread is its own.
"""
from __future__ import annotations

import os
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tiered_kv.copy import BlockCopier, Mechanism, vllm_layer_layout  # noqa: E402
from tiered_kv.copy.testing import vllm026_tensors  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_report import LLAMA3_8B, emit  # noqa: E402

TOKENS = 1312
BLOCKS = TOKENS // LLAMA3_8B.block_size  # 82
REPS = int(os.environ.get("REPS", "30"))
GIL_MS = float(os.environ.get("GIL_MS", "0.6"))
PIECE_BLOCKS = int(os.environ.get("PIECE_BLOCKS", "8"))
HIDDEN, QKV, MLP, VOCAB = 4096, 6144, 14336, 128256
VARIANTS = ("none", "dma", "gil", "copier", "gated", "gated_spin", "copier_pieces")
#: ``async``: the token's copy on its own stream (vLLM 0.26 with asynchronous scheduling, its default); ``main``: on
#: the forward's stream (synchronous scheduling)
TOKEN_COPY = os.environ.get("TOKEN_COPY", "async")
SPIN_CYCLES = 100_000  # ``gated_spin``: a one-block sleep kernel before the copy (~50 us at 2 GHz)
INPUT_COPIES = 6  # the next step's small host-to-device input copies (ids, positions, block table, ...)


class Model:
    """One layer's weights used for all 32 layers, the LM head, and the step's pinned token buffer."""

    def __init__(self) -> None:
        dev, dt = "cuda", torch.bfloat16
        self.wqkv = torch.randn(HIDDEN, QKV, device=dev, dtype=dt) * 0.01
        self.wo = torch.randn(HIDDEN, HIDDEN, device=dev, dtype=dt) * 0.01
        self.wup = torch.randn(HIDDEN, 2 * MLP, device=dev, dtype=dt) * 0.01
        self.wdown = torch.randn(MLP, HIDDEN, device=dev, dtype=dt) * 0.01
        self.lm = torch.randn(HIDDEN, VOCAB, device=dev, dtype=dt) * 0.01
        self.x0 = torch.randn(TOKENS, HIDDEN, device=dev, dtype=dt)
        self.token = torch.empty(1, dtype=torch.int64, pin_memory=True)
        self.copy_stream = torch.cuda.Stream()
        self.inputs = [(torch.zeros(4096, dtype=torch.int32, pin_memory=True),
                        torch.empty(4096, dtype=torch.int32, device=dev)) for _ in range(INPUT_COPIES)]

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype)

    def forward(self) -> torch.Tensor:
        """The 32 layers' matmuls, launched eagerly (a few small kernels each, like an uncompiled model)."""
        x = self.x0
        for _ in range(LLAMA3_8B.layers):
            h = self._norm(x) @ self.wqkv
            x = x + h[:, :HIDDEN] @ self.wo
            g = self._norm(x) @ self.wup
            x = x + (torch.nn.functional.silu(g[:, :MLP]) * g[:, MLP:]) @ self.wdown
        return x

    def sample(self, x: torch.Tensor) -> torch.cuda.Event:
        """LM head of the last token, argmax, and its copy to pinned memory; the event marks the copy's end."""
        logits = (self._norm(x[-1:]) @ self.lm).float()
        tok = torch.argmax(torch.softmax(logits, dim=-1), dim=-1)
        main = torch.cuda.current_stream()
        copy = self.copy_stream if TOKEN_COPY == "async" else main
        with torch.cuda.stream(copy):
            copy.wait_stream(main)
            self.token.copy_(tok, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
        return ev

    def next_inputs(self) -> torch.cuda.Event:
        """The next step's input copies on vLLM's stream, and the event ``StoreGate.open`` records after them."""
        for host, dev in self.inputs:
            dev.copy_(host, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return ev


class StoreThread:
    """The mover's stand-in: runs each store it is given on its own thread and side stream."""

    def __init__(self, copier: BlockCopier, ids: list[int], slots: list[int]) -> None:
        self.copier, self.ids, self.slots = copier, ids, slots
        self.stream = torch.cuda.Stream()
        self.jobs: queue.Queue = queue.Queue()
        self.done = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="store-probe").start()

    def submit(self, how: str, after: torch.cuda.Event, gate: torch.cuda.Event | None = None) -> None:
        """Queue one store (``how``: copier, pieces or gil); ``gate``: an event its copy waits for too."""
        self.done.clear()
        self.jobs.put((how, after, gate))

    def _run(self) -> None:
        while True:
            how, after, gate = self.jobs.get()
            if how == "gil":
                end = time.perf_counter() + GIL_MS / 1e3
                n = 0
                while time.perf_counter() < end:
                    n += 1
                self.done.set()
                continue
            self.stream.wait_event(after)
            if gate is not None:
                self.stream.wait_event(gate)
                if how == "spin":
                    with torch.cuda.stream(self.stream):
                        torch.cuda._sleep(SPIN_CYCLES)
            step = PIECE_BLOCKS if how == "pieces" else len(self.ids)
            for i in range(0, len(self.ids), step):
                self.copier.gpu_to_cpu(self.ids[i:i + step], self.slots[i:i + step], stream=self.stream,
                                       mechanism=Mechanism.COPY_ENGINE).wait()
            self.done.set()


def step(model: Model, variant: str, store: StoreThread, big_src: torch.Tensor, big_dst: torch.Tensor,
         side: torch.cuda.Stream) -> float:
    """One prefill step with ``variant``'s store; ms from launch to the token on the host."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    x = model.forward()
    fwd = torch.cuda.Event()
    fwd.record()
    if variant == "dma":
        side.wait_event(fwd)
        with torch.cuda.stream(side):
            big_dst.copy_(big_src, non_blocking=True)
    elif variant == "gil":
        store.submit("gil", fwd)
    elif variant.startswith("copier"):
        store.submit("pieces" if variant == "copier_pieces" else "copier", fwd)
    ev = model.sample(x)
    after = model.next_inputs()
    if variant.startswith("gated"):
        store.submit("spin" if variant == "gated_spin" else "copier", fwd, after)
    ev.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    if variant not in ("none", "dma"):
        store.done.wait()
    torch.cuda.synchronize()
    return ms


def main() -> None:
    """Run the variants interleaved, print the table, write the JSON."""
    shape = LLAMA3_8B
    layout = vllm_layer_layout(vllm026_tensors("NHD", shape, torch.bfloat16, "cuda"), "vllm:NHD")
    for t in layout.tensors:
        t.normal_()
    slab = torch.empty((BLOCKS, layout.block_nbytes), dtype=torch.uint8, pin_memory=True)
    copier = BlockCopier(layout, slab)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randperm(shape.num_blocks, generator=gen)[:BLOCKS].tolist()
    slots = list(range(BLOCKS))
    store = StoreThread(copier, ids, slots)
    nbytes = BLOCKS * layout.block_nbytes
    big_src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    big_dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream()
    model = Model()
    for v in VARIANTS:  # warm every path (cuBLAS, the copier's descriptors, the threads)
        for _ in range(3):
            step(model, v, store, big_src, big_dst, side)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(REPS):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        for v in order:
            times[v].append(step(model, v, store, big_src, big_dst, side))
    base = statistics.median(times["none"])
    rows = []
    for v in VARIANTS:
        ts = sorted(times[v])
        med = statistics.median(ts)
        rows.append({"variant": v, "median_ms": round(med, 3), "p10_ms": round(ts[len(ts) // 10], 3),
                     "p90_ms": round(ts[(9 * len(ts)) // 10], 3), "excess_ms": round(med - base, 3)})
    copier.close()
    emit(f"store_beside_step_{TOKEN_COPY}", rows, ["variant", "median_ms", "p10_ms", "p90_ms", "excess_ms"],
         store_bytes=nbytes, tokens=TOKENS, reps=REPS, gil_ms=GIL_MS, piece_blocks=PIECE_BLOCKS)


if __name__ == "__main__":
    main()
