"""Probe: what our scheduler-side hooks cost in the one ``schedule()`` that admits a wave of CPU-tier hits.

The H200 trace of a 31-request loading step (vLLM 0.26) had our hooks at 9.2 ms against 2.9 ms of vLLM's own
``schedule()`` work, all of it on vLLM's one engine thread and so on every admitted request's time to first token.
This probe rebuilds that step on the CPU with vLLM's real ``Scheduler`` and the tests' harness
(``tests/connector/vllm/harness.py``: worker-role connectors over CPU tensors, every loaded block checked):

- warm phase: ``--users`` requests (prompts of ``--min-tokens``..``--max-tokens`` tokens, 16-token blocks, chunks of
  ``chunk_blocks``) are computed and stored in our CPU tier, every store job completed through the workers' output
  (``Engine.settle``), then vLLM's GPU prefix cache is dropped (``reset_prefix_cache``);
- each round: a new turn of every user arrives (its warm prompt plus ``--new`` new tokens, so its prefix is a CPU-tier
  hit, a tail piece last), and one ``schedule()`` admits them; our hooks in it (``get_num_new_matched_tokens``,
  ``update_state_after_alloc``, ``build_connector_meta``) and in that step's ``update_from_output()``
  (``update_connector_output``: the in-step loads' completions) are timed on the calling thread's CPU clock
  (``time.thread_time``; wall clock beside it), and so is the whole ``schedule()``. The round then runs the turns
  to their end (``--answer`` tokens: ``request_finished`` of the wave is timed in the step they finish in), settles
  the connector and drops vLLM's prefix cache again.

Prints one row per hook (median ms per round over ``--rounds``, after ``--skip`` untimed rounds, with p10 and p90)
and writes every round's numbers with ``--out FILE`` (JSON). ``--profile FILE`` runs one more round under cProfile
(the measured ``schedule()`` and ``update_from_output()``) and writes its stats to FILE (by own time, then ours by
cumulative time).

Before each measured ``schedule()`` the collector runs a full collection and freezes the heap, as vLLM's EngineCore
does after start-up (``freeze_gc_heap``), so rounds start alike; collections inside the step stay (they are part
of what the hooks cost).

Usage (from the repo root)::

    PYTHONPATH=. .venv/bin/python benchmarks/probes/sched_wave_probe.py --rounds 15 --out /tmp/sched_wave.json

Threading contract: a script; vLLM's scheduler and our hooks run on its one thread (the workers' movers run their
own threads and are idle while a step is timed: each round settles them first).
"""
from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import json
import os
import platform
import pstats
import random
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.connector.vllm.harness import BS, TINY_LLAMA, Engine  # noqa: E402

#: the hooks timed: the three of ``schedule()``, then those of ``update_from_output()``
SCHEDULE_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta")
OUTPUT_HOOKS = ("update_connector_output", "request_finished", "request_finished_all_groups")


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 1000) for _ in range(n)]


class HookClock:
    """Wraps the connector instance's hooks with the thread's CPU clock and the wall clock; ``on``: the hooks timed
    now (the others run untimed)."""

    def __init__(self, connector) -> None:
        self.on: tuple[str, ...] = ()
        self.cpu: dict[str, float] = {}
        self.wall: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        for name in SCHEDULE_HOOKS + OUTPUT_HOOKS:
            fn = getattr(connector, name, None)
            if fn is not None:
                setattr(connector, name, self._wrap(name, fn))

    def _wrap(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*a, **kw):
            if name not in self.on:
                return fn(*a, **kw)
            c0, w0 = time.thread_time(), time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.cpu[name] = self.cpu.get(name, 0.0) + time.thread_time() - c0
                self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - w0
                self.calls[name] = self.calls.get(name, 0) + 1
        return timed

    def reset(self) -> None:
        """Start a round."""
        self.cpu, self.wall, self.calls = {}, {}, {}


def build(a, model_dir: str) -> tuple[Engine, list[list[int]]]:
    """The engine with every user's warm prompt stored in the CPU tier and vLLM's prefix cache dropped."""
    rng = random.Random(a.seed)
    lens = [rng.randrange(a.min_tokens, a.max_tokens + 1) for _ in range(a.users)]
    blocks = sum(-(-(n + a.new + 64) // BS) for n in lens) + 64
    with open(os.path.join(model_dir, "config.json"), "w") as f:  # the tests' tiny Llama, long enough
        json.dump({**TINY_LLAMA, "max_position_embeddings": a.max_tokens + a.new + 64}, f)
    extra = {"cpu_bytes": a.cpu_bytes, "chunk_blocks": a.chunk_blocks}
    if a.load_mode:
        extra["load_mode"] = a.load_mode
    users = a.users
    eng = Engine.create(model_dir, extra, num_blocks=blocks, max_batched=a.max_batched,
                        max_model_len=a.max_tokens + a.new + 64,
                        tweak=lambda c: setattr(c.scheduler_config, "max_num_seqs", users))
    prompts = [_prompt(rng, n) for n in lens]
    for u, p in enumerate(prompts):
        eng.add(f"warm-{u}", p, max_tokens=1)
    eng.run(max_steps=20000, timeout=1800)
    eng.settle()
    assert eng.sched.reset_prefix_cache(), "vLLM's prefix cache still holds blocks in use"
    return eng, prompts


def round_(eng: Engine, clock: HookClock, prompts: list[list[int]], r: int, a, prof: cProfile.Profile | None = None
           ) -> dict:
    """One wave: add every user's next turn, time the ``schedule()`` that admits them and that step's output, then
    run the turns to their end (``request_finished`` of the wave timed there too)."""
    rng = random.Random(a.seed * 1000 + r)
    for u, p in enumerate(prompts):
        eng.add(f"r{r}-{u}", p + _prompt(rng, a.new), max_tokens=a.answer)
    gc.collect()
    gc.freeze()
    clock.reset()
    clock.on = SCHEDULE_HOOKS + OUTPUT_HOOKS
    if prof is not None:
        prof.enable()
    c0, w0 = time.thread_time(), time.perf_counter()
    out = eng.sched.schedule()
    sched_cpu, sched_wall = time.thread_time() - c0, time.perf_counter() - w0
    if prof is not None:
        prof.disable()
    clock.on = ()
    mro = eng._run_workers(out)
    clock.on = SCHEDULE_HOOKS + OUTPUT_HOOKS
    if prof is not None:
        prof.enable()
    c0 = time.thread_time()
    eng.sched.update_from_output(out, mro)
    out_cpu = time.thread_time() - c0
    if prof is not None:
        prof.disable()
    clock.on = ()
    eng.steps += 1
    plan = out.kv_connector_metadata.plan
    row = {"round": r, "admitted": len(out.scheduled_new_reqs),
           "hit_tokens": sum(n.num_computed_tokens for n in out.scheduled_new_reqs),
           "in_step_jobs": len(plan.sync), "async_requests": len(plan.loads),
           "schedule_ms": sched_cpu * 1e3, "schedule_wall_ms": sched_wall * 1e3, "update_from_output_ms": out_cpu * 1e3,
           "hooks_ms": {k: v * 1e3 for k, v in clock.cpu.items()},
           "hooks_wall_ms": {k: v * 1e3 for k, v in clock.wall.items()}, "calls": dict(clock.calls)}
    in_sched = sum(clock.cpu.get(k, 0.0) for k in SCHEDULE_HOOKS) * 1e3
    row["hooks_in_schedule_ms"] = in_sched
    row["vllm_schedule_ms"] = row["schedule_ms"] - in_sched
    row["hooks_total_ms"] = sum(clock.cpu.get(k, 0.0) for k in SCHEDULE_HOOKS + OUTPUT_HOOKS) * 1e3
    gc.unfreeze()
    clock.reset()
    clock.on = OUTPUT_HOOKS[1:]  # the wave's requests finish in a later step
    eng.run(max_steps=20000, timeout=600)
    clock.on = ()
    row["wave_finished_ms"] = sum(clock.cpu.values()) * 1e3
    row["wave_finished_calls"] = sum(clock.calls.values())
    eng.settle()
    assert eng.sched.reset_prefix_cache(), "vLLM's prefix cache still holds blocks in use"
    return row


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(rows: list[dict]) -> list[dict]:
    """Median, p10 and p90 (ms per round) of each hook and of the totals."""
    names = [(h, lambda r, h=h: r["hooks_ms"].get(h, 0.0), lambda r, h=h: r["calls"].get(h, 0))
             for h in SCHEDULE_HOOKS + OUTPUT_HOOKS[:1]]
    names += [("hooks in schedule()", lambda r: r["hooks_in_schedule_ms"], None),
              ("hooks of the step, all", lambda r: r["hooks_total_ms"], None),
              ("vLLM's own schedule() work", lambda r: r["vllm_schedule_ms"], None),
              ("schedule()", lambda r: r["schedule_ms"], None),
              ("request_finished (the wave's, a later step)", lambda r: r["wave_finished_ms"],
               lambda r: r["wave_finished_calls"])]
    out = []
    for name, get, calls in names:
        xs = [get(r) for r in rows]
        out.append({"what": name, "median_ms": round(statistics.median(xs), 3), "p10_ms": round(_q(xs, 0.1), 3),
                    "p90_ms": round(_q(xs, 0.9), 3), "calls": calls(rows[-1]) if calls is not None else ""})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, default=32, help="requests of the wave (and warm prompts)")
    ap.add_argument("--min-tokens", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--new", type=int, default=96, help="new tokens of each turn after its warm prompt")
    ap.add_argument("--answer", type=int, default=2, help="output tokens of each turn")
    ap.add_argument("--chunk-blocks", type=int, default=16)
    ap.add_argument("--load-mode", default="", help="load_mode (default: the connector's)")
    ap.add_argument("--cpu-bytes", type=int, default=1 << 30)
    ap.add_argument("--max-batched", type=int, default=8192, help="vLLM's max_num_batched_tokens")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--skip", type=int, default=2, help="untimed rounds first (warm-up)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--profile", default="", help="write cProfile stats of one more round's measured step here")
    ap.add_argument("--out", default="", help="write the rounds and the summary as JSON here")
    a = ap.parse_args()
    t0 = time.monotonic()
    model_dir = tempfile.mkdtemp(prefix="sched-wave-")
    eng, prompts = build(a, model_dir)
    print(f"warm phase: {len(prompts)} prompts stored ({sum(map(len, prompts))} tokens) in "
          f"{time.monotonic() - t0:.1f} s; CPU tier holds {eng.connector.stats()['resident_cpu']} chunks", flush=True)
    clock = HookClock(eng.connector)
    rows = []
    try:
        for r in range(a.skip + a.rounds):
            row = round_(eng, clock, prompts, r, a)
            if r >= a.skip:
                rows.append(row)
            print(f"round {r}: admitted {row['admitted']}, hooks of the step {row['hooks_total_ms']:.2f} ms "
                  f"({row['hooks_in_schedule_ms']:.2f} in schedule() of {row['schedule_ms']:.2f})", flush=True)
        if a.profile:
            prof = cProfile.Profile()
            round_(eng, clock, prompts, a.skip + a.rounds, a, prof)
            with open(a.profile, "w") as f:
                stats = pstats.Stats(prof, stream=f)
                stats.sort_stats("tottime").print_stats(40)
                stats.sort_stats("cumulative").print_stats("tiered_kv", 60)
            print(f"wrote {a.profile}")
    finally:
        eng.close()
        shutil.rmtree(model_dir, ignore_errors=True)
    summary = summarize(rows)
    last = rows[-1]
    print(f"\n{len(rows)} rounds; the step admits {last['admitted']} requests, {last['hit_tokens']} tokens from the "
          f"connector, {last['in_step_jobs']} in-step load jobs, {last['async_requests']} requests loading between "
          "steps; thread CPU time, ms per step\n")
    cols = ["what", "median_ms", "p10_ms", "p90_ms", "calls"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for s in summary:
        print("| " + " | ".join(str(s[c]) for c in cols) + " |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "host": platform.node(), "cpus": os.cpu_count(),
                       "command": " ".join(sys.argv), "params": vars(a), "summary": summary, "rounds": rows},
                      f, indent=1)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
