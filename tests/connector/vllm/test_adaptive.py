"""``load_mode: adaptive``: a step's CPU hits load in-step up to a byte budget, the rest asynchronously.

vLLM's real Scheduler/AsyncScheduler with the harness of ``harness.py`` (every block a forward
reads is checked byte for byte against its token prefix), as in ``test_connector.py``.
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tests.connector.vllm.harness import BS, Engine, write_model_dir  # noqa: E402
from tests.connector.vllm.test_connector import BLOCK_BYTES, K, assert_no_leaks, cfg, prompt, turn2  # noqa: E402
from tiered_kv.connector.vllm import admission  # noqa: E402
from tiered_kv.connector.vllm.admission import START_STEP_S, StepLoadBudget  # noqa: E402
from tiered_kv.connector.vllm.config import ConnectorConfig  # noqa: E402
from tiered_kv.errors import ConfigError  # noqa: E402

#: turn 1: two whole chunks (8 blocks) and 4 tokens: turn 2 hits 8 blocks = 32 KiB per request
TURN1 = 2 * K * BS + 4
HIT_BYTES = 2 * K * BLOCK_BYTES
USERS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(str(tmp_path_factory.mktemp("tiny-llama-adaptive")))


def _burst(eng: Engine, users: int = USERS) -> list:
    """Turn 1 of ``users`` conversations one after the other, the GPU prefix cache dropped, then every
    turn 2 added at once (a wave of a closed-loop benchmark): returns the turn-2 requests in arrival order."""
    firsts = []
    for u in range(users):
        firsts.append(eng.add(f"u{u}-t1", prompt(u + 1, TURN1), max_tokens=3))
        eng.run()
    eng.settle()
    assert eng.connector.stats()["resident_cpu"] == 2 * users
    assert eng.sched.reset_prefix_cache()  # the GPU forgets turn 1: every turn 2 is a CPU hit
    return [eng.add(f"u{u}-t2", turn2(eng, a), max_tokens=2) for u, a in enumerate(firsts)]


def _more_seqs(c) -> None:
    c.scheduler_config.max_num_seqs = 16


@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async"])
def test_burst_loads_first_hits_in_step_up_to_the_budget_and_the_rest_async(model_dir, async_sched):
    """A budget of 2.5 hits: the first two turn-2 requests load in their step, the other four wait for async
    loads; every request's KV is bit-exact and every one finishes."""
    budget = int(2.5 * HIT_BYTES)
    eng = Engine.create(model_dir, cfg(load_mode="adaptive", step_load_bytes=budget), async_sched=async_sched,
                        num_blocks=160, tweak=_more_seqs)
    try:
        reqs = _burst(eng)
        before = eng.connector.stats()
        verified = eng.verified_blocks
        eng.step()
        status = [r.status.name for r in reqs]
        assert status[:2] == ["RUNNING"] * 2, status
        assert status[2:] == ["WAITING_FOR_REMOTE_KVS"] * (USERS - 2), status
        st = eng.connector.stats()
        assert st["admit_in_step"] - before["admit_in_step"] == 2, st
        assert st["admit_deferred"] - before["admit_deferred"] == USERS - 2, st
        assert st["admit_budget_bytes"] == budget
        eng.run()
        eng.settle()
        st = eng.connector.stats()
        assert st["sched_sync_loads"] - before["sched_sync_loads"] == 2, st
        assert st["sched_hit_tokens_cpu"] - before["sched_hit_tokens_cpu"] == USERS * 2 * K * BS, st
        # each turn 2 started with its whole hit counted as computed (loaded, not recomputed) ...
        assert all(eng.cached_at_start[r.request_id] == 2 * K * BS for r in reqs)
        # ... and the harness checked the loaded blocks of every one byte for byte before its forward
        assert eng.verified_blocks - verified >= USERS * 2 * K
        ws = eng.workers[0].connector.stats()
        assert ws["sync_loads"] == 2, ws
        assert all(r.is_finished() for r in reqs)
        assert_no_leaks(eng)
    finally:
        eng.close()


def test_layerwise_loads_the_whole_burst_in_one_step(model_dir):
    """The control: ``layerwise`` (the default) puts every hit of the burst into the step that schedules it."""
    eng = Engine.create(model_dir, cfg(), num_blocks=160, tweak=_more_seqs)
    try:
        reqs = _burst(eng)
        eng.step()
        assert [r.status.name for r in reqs] == ["RUNNING"] * USERS
        assert "admit_in_step" not in eng.connector.stats()
        eng.run()
        eng.settle()
        assert eng.workers[0].connector.stats()["sync_loads"] == USERS
        assert_no_leaks(eng)
    finally:
        eng.close()


@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async"])
def test_lone_request_loads_in_step_even_past_the_budget(model_dir, async_sched):
    """The first hit of a step always loads in-step (c1 keeps the in-step win), whatever the budget."""
    eng = Engine.create(model_dir, cfg(load_mode="adaptive", step_load_bytes=1), async_sched=async_sched)
    try:
        a = eng.add("c-t1", prompt(7, TURN1), max_tokens=3)
        eng.run()
        eng.settle()
        assert eng.sched.reset_prefix_cache()
        b = eng.add("c-t2", turn2(eng, a), max_tokens=2)
        eng.step()
        assert b.status.name == "RUNNING", b.status
        eng.run()
        eng.settle()
        st = eng.connector.stats()
        assert st["sched_sync_loads"] == 1 and st["admit_first_of_step"] == 1 and st["admit_deferred"] == 0, st
        assert eng.cached_at_start["c-t2"] == 2 * K * BS
        assert_no_leaks(eng)
    finally:
        eng.close()


def test_every_hit_past_the_first_goes_async_with_a_one_byte_budget(model_dir):
    """Budget 1 byte: one in-step load per step; a burst of 6 = 1 in-step + 5 async loads, all bit-exact."""
    eng = Engine.create(model_dir, cfg(load_mode="adaptive", step_load_bytes=1), num_blocks=160, tweak=_more_seqs)
    try:
        reqs = _burst(eng)
        eng.step()
        assert [r.status.name for r in reqs] == ["RUNNING"] + ["WAITING_FOR_REMOTE_KVS"] * (USERS - 1)
        eng.run()
        eng.settle()
        assert all(eng.cached_at_start[r.request_id] == 2 * K * BS for r in reqs)
        assert eng.workers[0].connector.stats()["sync_loads"] == 1
        assert_no_leaks(eng)
    finally:
        eng.close()


def test_auto_budget_is_rate_times_step_time():
    """``auto``: measured H2D rate x the engine's recent step time (running averages, idle gaps clamped)."""
    now = [0.0]
    b = StepLoadBudget(None, start_gbps=10.0, clock=lambda: now[0])
    assert b.budget == int(10e9 * START_STEP_S)
    b.observe(2_000_000_000, 0.05)  # 40 GB/s: the first measurement replaces the guess
    assert b.gbps == pytest.approx(40.0)
    for _ in range(60):  # busy steps 10 ms apart: the step estimate converges to 10 ms
        b.next_step(busy=True)
        now[0] += 0.010
    assert b.step_s == pytest.approx(0.010, rel=1e-3)
    assert b.budget == pytest.approx(40e9 * 0.010, rel=1e-3)
    now[0] += 30.0  # an idle gap of 30 s: clamped, and the interval after an idle step is not counted
    b.next_step(busy=False)
    now[0] += 30.0
    b.next_step(busy=True)
    assert b.step_s == pytest.approx(0.010, rel=1e-3)
    # within a step: the first hit always, then while the charged bytes fit
    cap = b.budget
    assert b.admit(cap * 2)
    b.charge(cap * 2)
    assert not b.admit(1)
    now[0] += 0.010
    b.next_step(busy=True)
    cap = b.budget
    assert b.admit(cap // 2)
    b.charge(cap // 2)
    assert b.admit(cap // 2)
    b.charge(cap // 2)
    assert not b.admit(1)
    assert b.counters.first_of_step == 1 and b.counters.deferred == 2 and b.counters.in_step == 3


def _steps(b: StepLoadBudget, now: list, kinds: str, order: str, prefill_s: float = 0.025) -> None:
    """Drive ``b`` through steps: ``kinds`` one letter a step, ``p`` a prefill step (``prefill_s``), ``d`` a decode
    step (5 ms). ``order`` ``sync``: the interval after a step's build is that step's forward; ``async``: the next
    one (vLLM schedules a step while the previous one runs)."""
    cost = [prefill_s if k == "p" else 0.005 for k in kinds]
    for i, k in enumerate(kinds):
        b.next_step(busy=True, prefill=k == "p")
        j = i if order == "sync" else i - 1
        now[0] += cost[j] if j >= 0 else 0.005


@pytest.mark.parametrize("order", ["sync", "async"])
def test_auto_budget_prices_the_prefill_steps_pace_not_the_decode_steps(order):
    """A hit loads in-step only in a step that prefills; vLLM runs decode-only steps as a CUDA graph (fast) and
    steps with a prefill eagerly (slow). The budget is rate x the prefill steps' time, read as the longest of the
    two intervals after a prefill step's build (either scheduling order); before one was measured, all steps'."""
    now = [0.0]
    b = StepLoadBudget(None, start_gbps=40.0, clock=lambda: now[0])
    _steps(b, now, "dddddddddd", order)
    assert b.prefill_s is None and b.pace_s == b.step_s
    assert b.budget == int(40e9 * b.step_s)
    _steps(b, now, "pddd" * 15 + "d", order)
    assert b.prefill_s == pytest.approx(0.025)
    assert b.step_s < 0.015  # the all-steps average is mostly decode steps: the old budget, ~40 % of this one
    assert b.budget == int(40e9 * 0.025) and b.stats()["admit_prefill_step_ms"] == pytest.approx(25.0)
    # back-to-back prefill steps make one sample; an idle gap inside a window drops that window's sample
    _steps(b, now, "pp", order)
    b.next_step(busy=False)
    now[0] += 30.0
    b.next_step(busy=True)
    assert b.prefill_s == pytest.approx(0.025)
    # a faster prefill pace (shorter prompts, a smaller model) pulls the budget down within a few prefill steps
    _steps(b, now, "pddd" * 30 + "d", order, prefill_s=0.010)
    assert b.prefill_s == pytest.approx(0.010, rel=1e-3)
    assert b.budget == pytest.approx(40e9 * 0.010, rel=1e-3)


def test_load_bound_prefill_steps_do_not_grow_the_budget():
    """An in-step load longer than the forward lengthens its step to the load's copy time, at most budget / rate:
    such a sample never raises the pace, so the budget cannot feed on its own loads."""
    now = [0.0]
    b = StepLoadBudget(None, start_gbps=40.0, clock=lambda: now[0])
    _steps(b, now, "pddd" * 20, "sync")
    cap = b.budget
    for _ in range(40):  # every prefill step carries a full budget: its forward takes cap / rate
        b.next_step(busy=True, prefill=True)
        b.charge(cap)
        now[0] += cap / 40e9
        for _ in range(3):
            b.next_step(busy=True)
            now[0] += 0.005
    assert b.budget <= cap


@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async"])
def test_real_scheduler_marks_prefill_steps_for_the_budget(model_dir, async_sched):
    """vLLM's real Scheduler: the budget is told ``prefill`` exactly in the steps where some request has more than
    one scheduled token (the O(1) test, tokens > requests, agrees with the per-request one), and with a model clock
    (a prefill step 25 ms, a decode step 5 ms) it prices the prefill steps."""
    eng = Engine.create(model_dir, cfg(load_mode="adaptive", load_gbps=25), async_sched=async_sched,
                        num_blocks=160, tweak=_more_seqs)
    try:
        planner = eng.connector.planner
        budget = planner._budget
        now = [0.0]
        budget._clock = lambda: now[0]
        expected, told = [], []
        build, next_step = planner.build, budget.next_step

        def timed_build(so):
            prefill = any(n > 1 for n in so.num_scheduled_tokens.values())
            expected.append(prefill and so.total_num_scheduled_tokens > 0)
            plan = build(so)
            now[0] += 0.025 if prefill else 0.005
            return plan

        def record(busy, prefill=False):
            told.append(prefill and busy)
            next_step(busy, prefill)

        planner.build, budget.next_step = timed_build, record
        for u in range(4):
            eng.add(f"u{u}", prompt(u + 1, TURN1), max_tokens=6)
            eng.run()
        eng.settle()
        assert told == expected and sum(told) >= 4 and len(told) - sum(told) >= 12, (told, expected)
        assert budget.prefill_s == pytest.approx(0.025)
        st = eng.connector.stats()
        assert st["admit_prefill_step_ms"] == pytest.approx(25.0) and st["admit_budget_bytes"] == int(25e9 * 0.025)
        assert_no_leaks(eng)
    finally:
        eng.close()


@pytest.mark.parametrize("bad", [0, -5, "lots", True])
def test_step_load_bytes_is_validated(bad):
    with pytest.raises(ConfigError, match="step_load_bytes"):
        ConnectorConfig.from_extra_config({"load_mode": "adaptive", "step_load_bytes": bad})


def test_adaptive_keys_parse():
    c = ConnectorConfig.from_extra_config({"load_mode": "adaptive", "step_load_bytes": "512MiB", "load_gbps": 40})
    assert c.step_load_bytes == 512 << 20 and c.load_gbps == 40.0
    assert ConnectorConfig().step_load_bytes == "auto" and ConnectorConfig().load_mode == "layerwise"
    with pytest.raises(ConfigError, match="load_gbps"):
        ConnectorConfig.from_extra_config({"load_gbps": 0})


def _first_running_step(eng: Engine, reqs: list, steps: int = 40) -> dict[str, int]:
    """Step the engine; the step at which each request was first seen RUNNING (or finished)."""
    first: dict[str, int] = {}
    for s in range(steps):
        eng.step()
        for r in reqs:
            if r.request_id not in first and (r.status.name == "RUNNING" or r.is_finished()):
                first[r.request_id] = s
        if len(first) == len(reqs):
            break
    return first


@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async"])
def test_async_loads_are_reported_one_by_one_in_arrival_order(model_dir, async_sched):
    """Asynchronous loads go to the worker's AsyncLoader in one batch per step; each request is reported to
    vLLM as soon as its own load landed. Here they land one per step (the CPU copies land at submission, so
    the test lets each poll see only the oldest load in flight): vLLM's real scheduler then
    runs the requests one step apart, in arrival order, each with its loaded KV checked byte for byte."""
    eng = Engine.create(model_dir, cfg(load_mode="async"), async_sched=async_sched, num_blocks=160,
                        tweak=_more_seqs)
    try:
        reqs = _burst(eng, users=4)
        loader = eng.workers[0].connector.worker.async_loads
        real = loader.landed

        def one_per_poll():  # only the oldest load may have landed by this poll
            rest = loader.pending[1:]
            loader.pending = loader.pending[:1]
            out = real()
            loader.pending += rest
            return out

        loader.landed = one_per_poll
        ws0 = eng.workers[0].connector.stats()
        first = _first_running_step(eng, reqs)
        steps = [first[r.request_id] for r in reqs]
        assert steps == sorted(steps) and len(set(steps)) == len(reqs), first  # one by one, first come first
        ws = eng.workers[0].connector.stats()
        assert ws["async_loads"] - ws0["async_loads"] == 4 and ws["async_batches"] - ws0["async_batches"] == 1, ws
        eng.run()
        eng.settle()
        assert all(eng.cached_at_start[r.request_id] == 2 * K * BS for r in reqs)
        assert_no_leaks(eng)
    finally:
        eng.close()


def test_async_loader_hands_loads_back_in_submission_order_with_bytes(model_dir):
    """On CPU tensors every load of a batch lands in ``start``: ``landed`` returns all of them, in order,
    each with its own bytes; a second call returns nothing."""
    eng = Engine.create(model_dir, cfg(load_mode="async"), num_blocks=160, tweak=_more_seqs)
    try:
        reqs = _burst(eng, users=3)
        loader = eng.workers[0].connector.worker.async_loads
        seen = []
        real = loader.landed

        def spy():
            out = real()
            seen.extend(out)
            return out

        loader.landed = spy
        eng.run()
        eng.settle()
        jobs = [j for j, _ in seen]
        assert [j.job_id for j in jobs] == sorted(j.job_id for j in jobs) and len(jobs) == len(reqs)
        assert all(c.nbytes == HIT_BYTES and all(c.ok) and c.seconds >= 0 for _, c in seen)
        assert real() == []
        assert_no_leaks(eng)
    finally:
        eng.close()


FORWARD_S = 0.003  # what each forward of the trace test takes on the host


def _traced_burst(model_dir, tmp_path, monkeypatch, async_sched: bool = False) -> Engine:
    """Run the burst with ``trace_path = tmp_path / "trace"``, each forward sleeping FORWARD_S; returns the closed
    engine."""
    import time as _time

    real_forward = Engine._forward

    def slow_forward(self, w, rows):
        _time.sleep(FORWARD_S)
        return real_forward(self, w, rows)

    monkeypatch.setattr(Engine, "_forward", slow_forward)
    eng = Engine.create(model_dir, cfg(load_mode="adaptive", step_load_bytes=int(2.5 * HIT_BYTES),
                                       trace_path=str(tmp_path / "trace")), num_blocks=160, tweak=_more_seqs,
                        async_sched=async_sched)
    try:
        _burst(eng)
        eng.run()
        eng.settle()
    finally:
        eng.close()
    return eng


def test_trace_path_writes_one_line_per_loading_step_with_every_load_landed(model_dir, tmp_path, monkeypatch):
    """``trace_path``: the burst's step lists 2 in-step and 4 async loads with their bytes and the time
    start_load_kv held the thread; every load shows up once under ``landed`` with its kind, bytes and times."""
    _traced_burst(model_dir, tmp_path, monkeypatch)
    import json

    from tiered_kv.connector.vllm.trace import PREFILL_LINE_TOKENS

    lines = [json.loads(x) for x in (tmp_path / "trace.rank0.jsonl").read_text().splitlines()]
    burst = [ln for ln in lines if ln["in_step"]["loads"] == 2]
    assert len(burst) == 1, lines
    b = burst[0]
    assert b["in_step"]["bytes"] == 2 * HIT_BYTES
    assert b["async"] == {"loads": USERS - 2, "bytes": (USERS - 2) * HIT_BYTES}
    assert b["start_load_ms"] >= b["fence_ms"] >= 0
    landed = [x for ln in lines for x in ln["landed"] if x["step"] == b["step"]]
    assert sorted(x["kind"] for x in landed) == ["async"] * (USERS - 2) + ["in_step"] * 2
    assert all(x["bytes"] == HIT_BYTES and x["gpu_ms"] >= 0 and x["host_ms"] >= 0 for x in landed)
    assert len({x["job"] for x in landed}) == USERS
    # turn 1's steps loaded nothing: lined as prefill steps (tokens scheduled, the forward's launch on the host);
    # decode steps write nothing, or only the GPU forward times (``fwd``) of lined steps that resolved since
    loads = lambda ln: ln["in_step"]["loads"] or ln["async"]["loads"]  # noqa: E731
    prefill = [ln for ln in lines if not loads(ln) and (ln["tokens"] or 0) >= PREFILL_LINE_TOKENS]
    assert prefill and all(ln["launch_ms"] >= 0 for ln in prefill) and b["launch_ms"] >= 0
    assert all(loads(ln) or ln["landed"] or ln in prefill or ln["fwd"] for ln in lines)
    lined = {ln["step"] for ln in lines if loads(ln) or ln in prefill}
    timed = {int(k) for ln in lines for k in ln["fwd"]}
    assert b["step"] in timed and timed <= lined and len(timed) >= len(lined) - 1  # the last may end after the run
    # the launch holds the forward (each one here sleeps FORWARD_S) whichever side of it vLLM calls start_load_kv (the
    # harness, like vLLM 0.33, calls it after the forward in steps without in-step loads), and not start_load_kv's hold
    assert all(ln["launch_ms"] >= FORWARD_S * 1e3 for ln in prefill + [b]), [ln["launch_ms"] for ln in prefill]
    assert all(ln["launch_ms"] < FORWARD_S * 1e3 + 200 for ln in prefill)


@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async-scheduling"])
def test_trace_path_has_the_schedulers_side_of_every_lined_step(model_dir, tmp_path, monkeypatch, async_sched):
    """``<trace_path>.sched.jsonl``: each step the worker lined for loads or a prefill has the scheduler's line, with
    the loads the plan gave it (as the worker counted them) and when vLLM scheduled it and applied its output, around
    the worker's own stamps; the summary's ``timeline`` cuts that interval at the worker's clock into parts that add
    up to it, the worker's part holding the forward (each one here sleeps FORWARD_S)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
    from serving import trace_summary

    path = tmp_path / "trace"
    eng = _traced_burst(model_dir, tmp_path, monkeypatch, async_sched)
    assert eng.workers[0].connector.worker.trace is not None and eng.sched.connector._sched_trace is not None
    worker = trace_summary.read_lines(str(path))
    sched = trace_summary.read_sched(str(path))
    by = {s["step"]: s for s in sched}
    assert len(by) == len(sched)  # one line a step
    loads = lambda ln: ln["in_step"]["loads"] or ln["async"]["loads"]  # noqa: E731
    lined = [ln for ln in worker if ln.get("t_begin") and (loads(ln) or (ln["tokens"] or 0) >= 128)]
    assert any(ln["in_step"]["loads"] == 2 for ln in lined) and len(lined) >= 3
    for ln in lined:
        s = by[ln["step"]]
        assert s["loads"] == ln["in_step"]["loads"] and s["tokens"] == ln["tokens"]
        assert s["t"] <= ln["t_begin"] + 1e-4 and ln["t_begin"] <= ln["t"] <= s["t_applied"] + 1e-4
        assert s["hooks_ms"] >= 0 and s["apply_ms"] >= 0
    burst = by[next(ln["step"] for ln in lined if ln["in_step"]["loads"] == 2)]
    assert burst["async_loads"] == USERS - 2 and burst["new"] == 2  # the others wait for their loads
    summary = trace_summary.summarize_phase(worker, 0.0, 1e12, sched)
    tl = summary["steps"]["loading"]["timeline"]
    assert tl["sched_ms"]["n"] >= 1 and tl["worker_ms"]["p50"] >= FORWARD_S * 1e3
    assert all(s["t_hook"] is not None and s["t_hook"] <= s["t"] for s in sched if s["new"])  # our hooks ran first
    assert tl["schedule_ms"]["n"] == tl["sched_ms"]["n"]  # every loading step took new requests
    parts = sum(tl[k]["sum"] for k in ("schedule_ms", "to_worker_ms", "worker_ms", "after_ms"))
    assert abs(parts - tl["sched_ms"]["sum"]) <= 0.4 * tl["sched_ms"]["n"]  # the stamps are rounded to 0.1 ms
    assert summary["steps"]["recompute"]["timeline"]["sched_ms"]["n"] >= 1
    assert "scheduled to applied p50" in trace_summary.line("tiered", "burst", summary)


def test_no_trace_file_by_default(model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    eng = Engine.create(model_dir, cfg(load_mode="adaptive"))
    try:
        assert eng.workers[0].connector.worker.trace is None and eng.sched.connector._sched_trace is None
    finally:
        eng.close()
    assert list(tmp_path.iterdir()) == []


MiB = 1 << 20


def test_rate_estimate_is_bytes_weighted_ignores_tiny_loads_and_is_clamped():
    """A sequence of loads the old estimate (first sample replaces the guess, then a 0.2 EMA per sample whatever
    its size) got wrong: a 4 KiB load at 0.1 GB/s took the 25 GB/s guess to 0.1 GB/s (a 2 MB budget at 20 ms
    steps); a 2 MiB straggler among 144 MiB loads moved it as much as a 144 MiB load."""
    b = StepLoadBudget(None, start_gbps=25.0)
    start_budget = b.budget
    b.observe(4096, 4096 / 0.1e9)  # 4 KiB at 0.1 GB/s: the fixed cost of a load, not PCIe
    assert b.gbps == 25.0 and b.budget == start_budget  # old code: 0.1 GB/s, budget 2 MB
    assert b.rate.ignored == 1 and b.rate.samples == 0
    b.observe(2 * MiB, 2 * MiB / 5e9)  # a small load at 5 GB/s: the guess still counts as 62 MiB of loads
    expected = (2 * MiB + 62 * MiB) / (2 * MiB / 5e9 + 62 * MiB / 25e9) / 1e9
    assert b.gbps == pytest.approx(expected) and 20.0 < b.gbps < 25.0  # old code: 5 GB/s
    for _ in range(3):  # three 144 MiB loads at 50 GB/s: the measured bytes now fill the window, the guess is out
        b.observe(144 * MiB, 144 * MiB / 50e9)
    expected = (2 * MiB + 432 * MiB) / (2 * MiB / 5e9 + 432 * MiB / 50e9) / 1e9
    assert b.gbps == pytest.approx(expected) and b.gbps > 45.0
    before = b.gbps
    b.observe(MiB, MiB / 2e9)  # a 1 MiB straggler at 2 GB/s: weighted by its bytes
    assert before - b.gbps < 0.12 * before  # old code: -19% (0.2 x the gap) from one small load
    for _ in range(admission.RATE_WINDOW):  # the window moves on: only the last loads count
        b.observe(64 * MiB, 64 * MiB / 12e9)
    assert b.gbps == pytest.approx(12.0) and b.rate.samples == admission.RATE_WINDOW
    assert b.budget == int(12e9 * b.step_s)
    glitch = StepLoadBudget(None, start_gbps=25.0)
    glitch.observe(1 << 30, 1e-6)  # a timing glitch: 1 GiB in 1 us
    assert glitch.gbps == admission.MAX_GBPS
    stall = StepLoadBudget(None, start_gbps=25.0)
    stall.observe(1 << 30, 20.0)  # a stalled copy: 1 GiB in 20 s
    assert stall.gbps == admission.MIN_GBPS
    assert StepLoadBudget(None, start_gbps=1e6).gbps == admission.MAX_GBPS  # the guess is clamped too
    ignored = StepLoadBudget(None, start_gbps=25.0)
    ignored.observe(0, 1.0)
    ignored.observe(64 * MiB, 0.0)
    assert ignored.gbps == 25.0 and ignored.rate.samples == 0


def _async_burst(eng: Engine, users: int) -> list:
    """``_burst`` with every turn 2 loaded asynchronously (``sync_max_tokens`` below a hit), run to the end."""
    reqs = _burst(eng, users)
    eng.run()
    eng.settle()
    assert all(eng.cached_at_start[r.request_id] == 2 * K * BS for r in reqs)
    return reqs


@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async"])
def test_tiny_asynchronous_loads_leave_the_rate_guess_and_budget_alone(model_dir, async_sched):
    """vLLM's real Scheduler: six 32 KiB asynchronous CPU loads (their CPU copy time is mostly fixed cost) are
    reported to the budget and ignored; ``admit_gbps`` stays at ``load_gbps`` (the old estimate took the first
    one's rate, a fraction of a GB/s, and the budget with it)."""
    eng = Engine.create(model_dir, cfg(load_mode="adaptive", load_gbps=25, sync_max_tokens=BS),
                        async_sched=async_sched, num_blocks=160, tweak=_more_seqs)
    try:
        _async_burst(eng, USERS)
        st = eng.connector.stats()
        assert st["sched_sync_loads"] == 0 and st["admit_gbps"] == 25.0, st
        assert st["admit_budget_bytes"] == int(25e9 * eng.connector.planner._budget.pace_s), st
        assert st["admit_rate_ignored"] == USERS and st["admit_rate_samples"] == 0, st
        assert_no_leaks(eng)
    finally:
        eng.close()


@pytest.mark.parametrize("tp", [1, 2])
def test_counted_asynchronous_loads_set_the_rate_by_bytes_per_rank(model_dir, tp, monkeypatch):
    """With the size floor lowered to 0, the real Scheduler's reports reach the estimate: one sample per load, its
    bytes per rank (the ranks' summed bytes over the ranks that reported: one rank's share of the hit), its
    measured seconds, and the estimate is the bytes-weighted rate of those samples and the 64 MiB pseudo-load
    of the guess."""
    monkeypatch.setattr(admission, "MIN_SAMPLE_BYTES", 0)
    seen: list[tuple[int, float]] = []
    real = admission.LoadRate.observe

    def spy(self, nbytes, seconds):
        seen.append((nbytes, seconds))
        return real(self, nbytes, seconds)

    monkeypatch.setattr(admission.LoadRate, "observe", spy)
    eng = Engine.create(model_dir, cfg(load_mode="adaptive", load_gbps=25, sync_max_tokens=BS), tp=tp,
                        num_blocks=160, tweak=_more_seqs)
    try:
        _async_burst(eng, 4)
        st = eng.connector.stats()
        per_rank = eng.connector.geo.hit_nbytes(2 * K * BS)
        assert per_rank * tp == sum(w.connector.worker.kv.block_nbytes for w in eng.workers) * 2 * K
        assert [n for n, _ in seen] == [per_rank] * 4, seen
        assert all(s > 0 for _, s in seen)
        measured, secs = sum(n for n, _ in seen), sum(s for _, s in seen)
        prior = admission.PRIOR_BYTES - measured
        expected = (measured + prior) / (secs + prior / 25e9) / 1e9
        rate = eng.connector.planner._budget.gbps
        assert rate == pytest.approx(min(admission.MAX_GBPS, max(admission.MIN_GBPS, expected)))
        assert st["admit_rate_samples"] == 4 and st["admit_rate_ignored"] == 0, st
        assert_no_leaks(eng)
    finally:
        eng.close()
