"""Probe: how many prompt tokens does a multi-turn workload recompute with and without tail pieces?

CPU only. vLLM's real Scheduler (the vLLM in this venv) with our connector and the test harness's
CPU "model runner" (``tests/connector/vllm/harness.py``: every block a forward reads is checked
byte for byte), serving ``benchmarks/serving/workload.py``'s conversations (a shared system
prompt, a private context, 128 new tokens and a 32-token stand-in answer per turn) with a GPU KV
cache smaller than the users' history, so each turn's prefix must come from the connector or be
recomputed. Per mode (``tail_chunks`` on / off) it counts the prompt tokens each request found
already computed when vLLM first scheduled it (GPU prefix cache + connector) and the rest, which
the engine computes.

``--shape``: ``dense`` (the harness's tiny Llama, one KV cache group), or a sliding-window hybrid of
``tests/connector/vllm/models.py`` (``gptoss``: a 32-token window beside full attention; ``gemma2``: a
256-token window), whose tail pieces are stored per group (2026-11-30).

Usage (from the repo root)::

    PYTHONPATH=. .venv/bin/python benchmarks/probes/tail_sim.py [--users 16] [--turns 3] [--shape dense] [--out DIR]

Prints a table and writes ``tail_sim.json`` to ``--out`` (default ``$OUT`` or ``bench_out``).
Threading contract: a single-threaded script (the connector's movers run their own threads).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks.serving.workload import Workload, WorkloadParams  # noqa: E402
import tiered_kv.connector.vllm.worker as worker  # noqa: E402
from tests.connector.vllm.harness import BS, Engine, write_model_dir  # noqa: E402

# A fence cancels a store that has not started within 2 ms; on a shared CPU box the mover thread
# is often slower than that, and a cancelled store is a later miss. This probe counts what the
# store policy leaves to recompute, not the box's load: give every store a second.
worker.FENCE_PATIENCE_S = 1.0

CHUNK_BLOCKS = 16  # the connector's default: 256-token chunks


def run_mode(model_dir: str, extra: dict, wl: Workload, turns: int, num_blocks: int, shape: str | None = None) -> dict:
    """Serve every user's turns 0..turns-1, turn by turn (``shape``: a hybrid of the tests' models, None: the tiny
    Llama); returns token counts."""
    # a hybrid's block pool serves every group: its model length is what one request may hold beside the windows
    eng = Engine.create(model_dir, extra, num_blocks=num_blocks, max_batched=2048, shape=shape,
                        max_model_len=4096 if shape is None else 3072)
    prompt_tokens = cached = 0
    t0 = time.perf_counter()
    try:
        for turn in range(turns):
            reqs = [eng.add(f"u{u}-t{turn}", wl.prompt(u, turn), max_tokens=wl.p.answer_tokens)
                    for u in range(wl.p.users)]
            eng.run(max_steps=20000, timeout=600)
            eng.settle()
            if turn == 0:
                continue  # turn 0 is cold in every mode
            for r in reqs:
                prompt_tokens += r.num_prompt_tokens
                cached += eng.cached_at_start[r.request_id]
        st = eng.connector.stats()
    finally:
        eng.close()
    return {"prompt_tokens": prompt_tokens, "cached_tokens": cached, "computed_tokens": prompt_tokens - cached,
            "connector_hit_tokens": st["sched_hit_tokens_cpu"] + st["sched_hit_tokens_disk"],
            "tail_hit_tokens": st["sched_hit_tokens_tail"], "tail_stores": st["sched_tail_stores"],
            "resident_cpu_chunks": st["resident_cpu"], "verified_blocks": eng.verified_blocks,
            "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3, help="turns per user (turn 0 is cold and not counted)")
    ap.add_argument("--gpu-blocks", type=int, default=512, help="vLLM's KV cache (16-token blocks)")
    ap.add_argument("--shape", choices=("dense", "gptoss", "gemma2"), default="dense",
                    help="dense: one KV cache group; gptoss / gemma2: sliding window + full attention")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    a = ap.parse_args()
    params = WorkloadParams(users=a.users, concurrency=(8,), turns=a.turns - 1, vocab_size=4096)
    wl = Workload(params, seed=0)
    modes = {"tail_chunks on": {"tail_chunks": True}, "tail_chunks off": {"tail_chunks": False}}
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        shape = None if a.shape == "dense" else a.shape
        if shape is None:
            model_dir = write_model_dir(os.path.join(tmp, "tiny-llama"))
        else:  # the harness's model computes KV from token prefixes: ids past the config's vocab are fine
            from tests.connector.vllm import models
            model_dir = models.write_model_dir(os.path.join(tmp, shape), shape)
        for name, kw in modes.items():
            extra = {"chunk_blocks": CHUNK_BLOCKS, "cpu_bytes": "1GiB", **kw}
            rows[name] = run_mode(model_dir, extra, wl, a.turns, a.gpu_blocks, shape)
    print(f"{a.shape}: {a.users} users x {a.turns} turns (turns 1..{a.turns - 1} counted), GPU cache "
          f"{a.gpu_blocks} blocks x {BS} tokens, {CHUNK_BLOCKS}-block chunks")
    print("| mode | prompt tokens | found computed (GPU + connector) | computed | from the connector | of it tails |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['prompt_tokens']} | {r['cached_tokens']} | {r['computed_tokens']} | "
              f"{r['connector_hit_tokens']} | {r['tail_hit_tokens']} |")
    os.makedirs(a.out, exist_ok=True)
    doc = {"bench": "tail_sim", "date": time.strftime("%Y-%m-%d", time.gmtime()), "device": "cpu-box",
           "command": f"PYTHONPATH=. .venv/bin/python benchmarks/probes/tail_sim.py --shape {a.shape} --users {a.users} "
                      f"--turns {a.turns} --gpu-blocks {a.gpu_blocks}",
           "shape": a.shape, "users": a.users, "turns": a.turns, "gpu_blocks": a.gpu_blocks, "block_size": BS,
           "chunk_blocks": CHUNK_BLOCKS, "workload": vars(params) | {"concurrency": list(params.concurrency)},
           "modes": rows}
    path = os.path.join(a.out, "tail_sim.json" if a.shape == "dense" else f"tail_sim_{a.shape}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
