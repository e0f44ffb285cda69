"""Does a sliding-window hybrid keep its GPU prefix hit on a shared system prompt when a connector serves the rest?

Round 11 (2026-11-29, H200, gpt-oss-20b shape, ``vllm serve``) counted no GPU prefix hit at all at c8 and c1 with a
connector (ours and ``OffloadingConnector``), where no connector hit the 1,024-token system prompt. The hypothesis:
vLLM's hybrid prefix hit at a point needs the window layers' blocks just before it; a request that loads its whole
prefix from a connector gets window blocks only at the end of its hit, so once the system prompt's last window left
the GPU nothing puts it back, while without a connector the next request recomputes it and re-caches it.

This probe drives vLLM's real ``Scheduler`` (CPU, the test harness's gpt-oss-like model: 4 layers alternating a
32-token window and full attention, 16-token blocks, 4-block chunks) through one workload three times: ours with its
defaults, ours with ``store_policy: none`` (the connector present, nothing stored: vLLM's own prefix cache alone,
as without a connector), and ours with ``hybrid_reseed`` (``tiered_kv/connector/vllm/reseed.py``). Every user's prompt is a shared system prompt of ``SYSTEM`` tokens and a context of its own;
turn 1 of every user, then unrelated prompts that push the system prompt's window blocks (and more) out of the GPU
cache, then turn 2 of every user, one at a time. Per turn 2 it records the local hit vLLM found (what the scheduler
passes the connector as ``num_computed_tokens``) and the connector's hit.

Usage: ``PYTHONPATH=. .venv/bin/python benchmarks/probes/hybrid_shared_prefix.py`` (CPU only, a few seconds;
prints a table; with ``$OUT`` set also writes ``hybrid_shared_prefix.json`` there). Threading contract: a script;
the harness's engine on this thread, the connector's movers on theirs.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.connector.vllm import models  # noqa: E402
from tests.connector.vllm.harness import BS, Engine  # noqa: E402

SYSTEM = 16 * BS  # the shared system prompt: 4 chunks
CONTEXT = 8 * BS  # each user's own context: 2 chunks
USERS = 6
NOISE = 8  # unrelated prompts of SYSTEM + CONTEXT tokens between turn 1 and turn 2
NUM_BLOCKS = 96  # per KV cache group: about 3 users' prompts
MODES = {"ours (defaults)": {}, "ours, stores off (vLLM's prefix cache alone)": {"store_policy": "none"},
         "ours, `hybrid_reseed`": {"hybrid_reseed": True, "hybrid_reseed_interval_s": 0}}


def _tokens(seed: int, n: int) -> list[int]:
    return [100 + (seed * 7919 + i * 31) % 800 for i in range(n)]


def run(model_dir: str, extra: dict) -> tuple[list[dict], dict]:
    """Turn 2 of every user after the noise: ``{"user", "prompt", "local", "connector"}`` tokens each, and the
    connector's stats at the end (``tests/connector/vllm/test_reseed.py`` asserts on both)."""
    eng = Engine.create(model_dir, {"chunk_blocks": 4, "cpu_bytes": "8MiB", **extra}, shape="gptoss",
                        num_blocks=NUM_BLOCKS, max_model_len=1024)
    seen: dict[str, list[int]] = {}
    conn = eng.sched.connector
    asked = conn.get_num_new_matched_tokens

    def spy(request, num_computed_tokens):
        n, load_async = asked(request, num_computed_tokens)
        if n is not None:  # None: "ask again next step" (a disk hit being promoted): the later answer counts
            seen[request.request_id] = [num_computed_tokens, n]
        return n, load_async

    conn.get_num_new_matched_tokens = spy
    system = _tokens(1, SYSTEM)
    try:
        firsts = []
        for u in range(USERS):
            firsts.append(eng.add(f"t1-{u}", system + _tokens(100 + u, CONTEXT), max_tokens=2))
            eng.run()
            eng.settle()
        for k in range(NOISE):
            eng.add(f"noise-{k}", _tokens(500 + k, SYSTEM + CONTEXT), max_tokens=2)
            eng.run()
            eng.settle()
        out = []
        for u, first in enumerate(firsts):
            prompt = list(first.prompt_token_ids) + list(first.output_token_ids) + _tokens(900 + u, 40)
            eng.add(f"t2-{u}", prompt, max_tokens=2)
            eng.run()
            eng.settle()
            local, connector = seen[f"t2-{u}"]
            out.append({"user": u, "prompt": len(prompt), "local": local, "connector": connector})
        return out, eng.connector.stats()
    finally:
        eng.close()


def main() -> None:
    root = tempfile.mkdtemp(prefix="hybrid-shared-prefix-")
    try:
        _main(models.write_model_dir(os.path.join(root, "gptoss"), "gptoss"))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _main(model_dir: str) -> None:
    import tiered_kv.connector.vllm.worker as worker

    worker.FENCE_PATIENCE_S = 1.0  # every store lands (a busy box may not start one within 2 ms): hits are counted
    doc = {"system_tokens": SYSTEM, "context_tokens": CONTEXT, "users": USERS, "noise_prompts": NOISE,
           "num_blocks_per_group": NUM_BLOCKS, "modes": {}}
    print(f"system prompt {SYSTEM} tokens, context {CONTEXT}, {USERS} users, {NOISE} unrelated prompts between the "
          f"turns, {NUM_BLOCKS} GPU blocks per KV cache group")
    print("| mode | turn 2 of user | prompt | GPU prefix hit (vLLM) | connector hit | recomputed |")
    print("|---|---|---|---|---|---|")
    for name, extra in MODES.items():
        rows, _ = run(model_dir, extra)
        doc["modes"][name] = rows
        for r in rows:
            print(f"| {name} | {r['user']} | {r['prompt']} | {r['local']} | {r['connector']} | "
                  f"{r['prompt'] - r['local'] - r['connector']} |")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "hybrid_shared_prefix.json"), "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
