"""Refactoring check of the planners: the same calls plan the same jobs, before and after a change.

Run it in two checkouts (the tree before a refactoring and the tree after it) and compare the outputs
line by line; a line is a hash of everything one run planned, so equal lines mean equal behaviour:

    PYTHONHASHSEED=0 PYTHONPATH=. .venv/bin/python benchmarks/probes/planner_diff.py chain 0 1500
    PYTHONHASHSEED=0 PYTHONPATH=. .venv/bin/python benchmarks/probes/planner_diff.py sched

- ``chain LO HI``: ``TierChain`` on random call sequences, seeds ``LO..HI-1`` (1-4 tiers, slotted, keyed
  and governed, write-back and write-through, ``copy_to``; puts, gets, prefetches, deletes, adoption,
  forgetting, touches, completions out of order with failed, corrupt and missing items, evictions of a
  governed tier): every job, handle result, room count and counter.
- ``sched [SCENARIO ...]``: the vLLM scheduler side on vLLM's real Scheduler (``tests/connector/vllm/
  harness.py``, run from the checkout's root) with a deterministic fake worker (jobs reported 0-2 steps
  late, some items failed or missing, loads reported in ``finished_recving``): every ``StepPlan``, KV
  event and ``SchedulerPlanner.stats()`` (less its clock readings) step by step, over multi-turn
  conversations in ``SCENARIOS``. ``PYTHONHASHSEED`` fixed keeps vLLM's block hashes equal across runs.

Used for issue 34's splits (docs/design.md, "Size limits"): 1,500 chain seeds and 13 scenarios, equal.
CPU only. Threading contract: a script; single-threaded but for the worker connectors the harness
builds (left idle here).
"""
from __future__ import annotations

import hashlib
import os
import pickle
import random
import sys
import tempfile
from dataclasses import asdict

sys.path.insert(0, os.getcwd())  # this checkout's tiered_kv and tests/


# ---------------------------------------------------------------------------------- TierChain
def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def chain_run(seed: int) -> str:
    """One random call sequence on a random chain; the repr of everything it planned and ended with."""
    from tiered_kv.planner.chain import TierChain, TierSpec
    from tiered_kv.planner.policy import PlacementPolicy
    from tiered_kv.values.jobs import Completion

    rng = random.Random(seed)
    nt = rng.choice([1, 2, 3, 3, 4])
    specs = []
    for i in range(nt):
        slotted = i < 2 and rng.random() < 0.85
        governed = (not slotted) and rng.random() < 0.3
        specs.append(TierSpec(f"t{i}", rng.randint(1 if i == 0 else 0, 6), slotted=slotted, governed=governed))
    copy_to = tuple(t for t in range(1, nt) if rng.random() < 0.2)
    placement = PlacementPolicy(rng.choice(["write_back", "write_through"]), rng.random() < 0.7, copy_to=copy_to)
    chain = TierChain(specs, rng.choice(["lru", "s3fifo"]), placement)
    log: list = []
    pending: list = []
    keyed = [i for i, s in enumerate(specs) if not s.slotted]

    def planned(jobs) -> None:
        for j in jobs:
            log.append(("job", j.job_id, j.kind.name, j.src_tier, j.dst_tier, [k[:4] for k in j.keys],
                        list(j.src_slots), list(j.dst_slots), j.handle))
        pending.extend(jobs)

    def complete(job, good: bool = False) -> None:
        n = len(job)
        ok = [good or rng.random() < 0.85 for _ in range(n)]
        corrupt = [(not good) and job.src_tier >= 0 and rng.random() < 0.05 for _ in range(n)]
        missing = [(not good) and job.src_tier >= 0 and not specs[job.src_tier].slotted and rng.random() < 0.05
                   for _ in range(n)]
        evicted = []
        if job.dst_tier >= 0 and specs[job.dst_tier].governed and rng.random() < 0.2:
            evicted = [_key(rng.randint(0, 20))]
        planned(chain.complete(Completion(job.job_id, ok, corrupt, 0, 0.0, missing=missing, evicted=evicted)))

    handle = 0
    for _ in range(rng.randint(20, 150)):
        op = rng.random()
        keys = [_key(rng.randint(0, 20)) for _ in range(rng.randint(0, 6))]
        if op < 0.25:
            handle += 1
            planned(chain.put(keys, handle))
        elif op < 0.38:
            handle += 1
            n, jobs = chain.get(keys, handle)
            log.append(("get", n))
            planned(jobs)
        elif op < 0.46:
            handle += 1
            n, jobs = chain.prefetch(keys, rng.randrange(nt), handle)
            log.append(("prefetch", n))
            planned(jobs)
        elif op < 0.5:
            planned(chain.delete(keys))
        elif op < 0.54 and keyed:
            planned(chain.adopt(rng.choice(keyed), keys))
        elif op < 0.58 and keyed:
            planned(chain.forget(rng.choice(keyed), keys, unreadable=rng.random() < 0.5))
        elif op < 0.62:
            chain.touch(keys)
        elif pending:
            for _ in range(rng.randint(1, 4)):
                if pending:
                    complete(pending.pop(rng.randrange(len(pending))))
        log.append(("finished", chain.take_finished()))
        log.append(("state", chain.inflight(), chain.pinned(), chain.waiting(), list(chain.used), list(chain.leaving)))
    while pending:
        complete(pending.pop(0), good=True)
    log.append(("finished", chain.take_finished()))
    log.append(("end", asdict(chain.counters), [asdict(t) for t in chain.tier_counters],
                sorted((k[:4], repr(v)) for k, v in chain.index.items()), chain.inflight(), chain.pinned(),
                chain.waiting(), [chain.resident(i) for i in range(nt)], chain.transfers.snapshot(1)))
    return repr(log)


# ---------------------------------------------------------------------------------- the vLLM scheduler side
def _h(x) -> int:
    return int(hashlib.sha256(repr(x).encode()).hexdigest()[:8], 16)


def _prompt(seed: int, n: int) -> list[int]:
    return [100 + (seed * 7919 + i * 31) % 800 for i in range(n)]


class FakeWorker:
    """Every worker rank at once, deterministic: each job reported 0-2 steps after its plan (in-step loads in
    the same step), about 1 item in 10 failed (never a load with several KV cache groups or an in-step load),
    some failed items of keyed tiers missing; records every plan, KV event and the planner's stats."""

    def __init__(self, eng, tp: int, events: bool) -> None:
        self.eng, self.tp, self.events = eng, tp, events
        self.several = not eng.connector.geo.block_level_errors
        self.held: list = []  # (due step, job, report)
        self.load_req: dict[int, str] = {}
        self.pending: dict[str, set[int]] = {}
        self.step = 0
        self.log: list = []

    def __call__(self, out):
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        from tiered_kv.connector.vllm.connector import TieredKVWorkerMeta
        from tiered_kv.values.jobs import JobKind
        try:
            from tiered_kv.connector.vllm.common import JobReport
        except ImportError:  # before issue 34's split
            from tiered_kv.connector.vllm.scheduler import JobReport

        self.step += 1
        plan = pickle.loads(pickle.dumps(out.kv_connector_metadata.plan))
        planner = self.eng.connector.planner
        self.log.append(("plan", plan.step,
                         [(j.job_id, j.kind.name, j.src_tier, j.dst_tier, [k.hex()[:12] for k in j.keys],
                           list(j.src_slots), list(j.dst_slots), j.handle) for j in plan.early + plan.stores],
                         sorted(plan.ext.items()), plan.fences, sorted(plan.loads.items()),
                         sorted(plan.load_fail.items()), plan.sync, plan.sync_fail,
                         planner.take_events() if self.events else None))
        self.log.append(("stats", sorted((k, v) for k, v in planner.stats().items() if not k.endswith("_ms"))))
        for rid, ids in plan.loads.items():
            self.pending.setdefault(rid, set()).update(ids)
            for j in ids:
                self.load_req[j] = rid
        sync = set(plan.sync)
        invalid = set(plan.sync_fail)
        for blocks in plan.load_fail.values():
            invalid.update(blocks)
        for job in plan.early + plan.stores:
            n = len(job)
            if job.kind is JobKind.EGRESS and (self.several or job.job_id in sync):
                ok = [True] * n
            else:
                ok = [_h((job.job_id, i)) % 10 != 0 for i in range(n)]
            missing = [(not ok[i]) and job.src_tier > 0 and _h(("m", job.job_id, i)) % 2 == 0 for i in range(n)]
            rep = JobReport(self.tp, ok, [False] * n, 1000 * sum(ok), 0.001 * n, missing if any(missing) else [])
            if job.kind is JobKind.EGRESS and not all(ok):
                ext = plan.ext[job.job_id]
                k = len(ext) // n
                invalid.update(g for i in range(n) if not ok[i] for g in ext[i * k:(i + 1) * k] if g >= 0)
            due = self.step if job.job_id in sync else self.step + _h(("r", job.job_id)) % 3
            self.held.append((due, job, rep))
        reports, recving, keep = {}, set(), []
        for due, job, rep in self.held:
            if due > self.step:
                keep.append((due, job, rep))
                continue
            reports[job.job_id] = rep
            rid = self.load_req.pop(job.job_id, None)
            if rid is not None:
                left = self.pending[rid]
                left.discard(job.job_id)
                if not left:
                    del self.pending[rid]
                    recving.add(rid)
        self.held = keep
        rows = [(new.req_id, new.num_computed_tokens) for new in out.scheduled_new_reqs]
        cached = out.scheduled_cached_reqs
        rows += [(rid, cached.num_computed_tokens[i]) for i, rid in enumerate(cached.req_ids)]
        ids = [rid for rid, _ in rows]
        reqs = self.eng.requests
        sampled = [[10 + (len(reqs[rid].output_token_ids) * 37 + len(rid)) % 900]
                   if done + out.num_scheduled_tokens[rid] >= reqs[rid].num_prompt_tokens else [] for rid, done in rows]
        kv_out = KVConnectorOutput(finished_sending=None, finished_recving=recving or None, invalid_block_ids=invalid,
                                   kv_connector_worker_meta=TieredKVWorkerMeta(reports) if reports else None)
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                                 pooler_output=None, kv_connector_output=kv_out)


def sched_run(name: str, root: str, shape: str | None, extra: dict, tp: int = 1, async_sched: bool = False,
              convs: int = 6, turns: int = 3, first: int = 150, more: int = 40, max_len: int = 1024) -> list:
    """One scenario: ``convs`` conversations of ``turns`` turns (prefixes shared between conversations, one
    aborted), vLLM's own prefix cache reset between turns so later turns hit the tiers."""
    from tests.connector.vllm import models
    from tests.connector.vllm.harness import Engine, write_model_dir

    extra = {**extra, "model_id": "planner-diff"}  # the namespace must not name the temporary model directory
    where = os.path.join(root, name)
    if shape is None:
        eng = Engine.create(write_model_dir(where), extra, num_blocks=96, async_sched=async_sched, tp=tp)
    else:
        eng = Engine.create(models.write_model_dir(where, shape), extra, shape=shape, num_blocks=96,
                            async_sched=async_sched, tp=tp, max_model_len=max_len)
    fake = FakeWorker(eng, tp, events=True)
    eng.connector.planner.enable_events()
    eng._run_workers = fake
    prompts = {i: _prompt(i % 4, first + 16 * (i % 3)) for i in range(convs)}
    for turn in range(turns):
        for i in range(convs):
            eng.add(f"c{i}t{turn}", prompts[i], max_tokens=3 + i % 4)
            if i % 2:
                eng.step()
        if turn == 1:
            eng.abort(f"c{convs - 1}t1")
        for _ in range(400):
            if not eng.sched.has_requests():
                eng.flush()
                if not eng.sched.has_requests():
                    break
            eng.step()
        for _ in range(3):
            eng.step()
            eng.flush()
        eng.sched.reset_prefix_cache()
        for i in range(convs):
            r = eng.requests[f"c{i}t{turn}"]
            prompts[i] = list(r.prompt_token_ids) + list(r.output_token_ids) + _prompt(100 + i + turn, more)
    for _ in range(5):
        eng.step()
        eng.flush()
    fake.log.append(("end", sorted(eng.connector.planner.store_stats().items())))
    for w in eng.workers:
        w.connector.shutdown()
    return fake.log


def _disk() -> str:
    return os.path.join(tempfile.mkdtemp(), "kv")


SCENARIOS = {  # name -> (model shape of tests/connector/vllm/models.py or None: the tiny Llama, extra config, kw)
    "dense": (None, {"chunk_blocks": 4, "cpu_bytes": "1MiB", "disk_path": _disk, "disk_bytes": "64MiB"}, {}),
    "dense_async": (None, {"chunk_blocks": 4, "cpu_bytes": "1MiB", "load_mode": "async"}, {"async_sched": True}),
    "adaptive": (None, {"chunk_blocks": 2, "cpu_bytes": "2MiB", "load_mode": "adaptive", "step_load_bytes": 40000},
                 {}),
    "on_finish": (None, {"chunk_blocks": 4, "cpu_bytes": "1MiB", "store_policy": "on_finish", "disk_path": _disk,
                         "disk_bytes": "64MiB", "write_policy": "write_through"}, {}),
    "tails_decode": (None, {"chunk_blocks": 4, "cpu_bytes": "1MiB", "store_decode_tokens": True},
                     {"async_sched": True}),
    "tp2": (None, {"chunk_blocks": 4, "cpu_bytes": "1MiB", "disk_path": _disk, "disk_bytes": "64MiB"}, {"tp": 2}),
    "gptoss": ("gptoss", {"chunk_blocks": 4, "cpu_bytes": "4MiB", "disk_path": _disk, "disk_bytes": "64MiB"}, {}),
    "gptoss_async": ("gptoss", {"chunk_blocks": 4, "cpu_bytes": "4MiB", "load_mode": "async", "swa_store": "all"},
                     {"async_sched": True, "max_len": 960}),
    "mamba": ("mamba", {"chunk_blocks": 1, "cpu_bytes": "8MiB", "disk_path": _disk, "disk_bytes": "64MiB"}, {}),
    "dsv2": ("dsv2", {"chunk_blocks": 4, "cpu_bytes": "2MiB"}, {}),
    "disk_always": (None, {"chunk_blocks": 2, "cpu_bytes": "256KiB", "disk_path": _disk, "disk_bytes": "64MiB",
                           "disk_load_policy": "always", "min_hit_blocks": 2}, {"async_sched": True}),
    "disk_hits": (None, {"chunk_blocks": 1, "cpu_bytes": "64KiB", "disk_path": _disk, "disk_bytes": "64MiB",
                         "disk_load_policy": "always", "tail_chunks": False}, {}),
    "lru_small": (None, {"chunk_blocks": 1, "cpu_bytes": "128KiB", "eviction": "lru", "tail_chunks": False}, {}),
}


def main(argv: list[str]) -> None:
    if argv[:1] == ["chain"] and len(argv) == 3:
        for seed in range(int(argv[1]), int(argv[2])):
            print(seed, hashlib.sha256(chain_run(seed).encode()).hexdigest()[:16])
        return
    if argv[:1] != ["sched"]:
        raise SystemExit("usage: planner_diff.py chain LO HI | sched [SCENARIO ...]")
    root = tempfile.mkdtemp()
    for name in argv[1:] or list(SCENARIOS):
        shape, extra, kw = SCENARIOS[name]
        extra = {k: v() if callable(v) else v for k, v in extra.items()}  # a fresh disk directory per run
        log = sched_run(name, root, shape, extra, **kw)
        end = dict(log[-1][1])
        print(name, hashlib.sha256(repr(log).encode()).hexdigest()[:16],
              "steps", sum(1 for x in log if x[0] == "plan"), "jobs", sum(len(x[2]) for x in log if x[0] == "plan"),
              "lookups", end["lookups"], "hits", end["hits"], flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
