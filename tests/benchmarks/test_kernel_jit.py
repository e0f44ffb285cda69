"""benchmarks/kernel_jit.py on the CPU: the watch on Triton's real hook knobs, the warm-up prompts, the envelope's note.

No Triton kernel can compile without a GPU, so the hooks are called here the way Triton's ``JITFunction._do_compile``
calls them (the cache hook before a compilation, the post-compile hook after it, keyword arguments only), on the
real ``triton.knobs.runtime`` object.
"""
from __future__ import annotations

import os
import sys
import time
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import envelope  # noqa: E402
import kernel_jit  # noqa: E402

knobs = pytest.importorskip("triton").knobs


@pytest.fixture
def hooks():
    """Triton's two JIT hooks as they were, put back after the test."""
    rt = knobs.runtime
    saved = rt.jit_cache_hook, rt.jit_post_compile_hook
    yield rt
    rt.jit_cache_hook, rt.jit_post_compile_hook = saved


def _compile(rt, name: str, seconds: float) -> None:
    kw = dict(key=("k",), repr=f"{name}[num_warps=4](x: *fp32)", fn=SimpleNamespace(name=name), compile={},
              is_manual_warmup=False, already_compiled=False)
    assert not rt.jit_cache_hook(**kw)  # falsy: Triton goes on and compiles
    time.sleep(seconds)
    rt.jit_post_compile_hook(**kw)


def test_watch_records_compilations_per_phase_and_keeps_the_hook_already_set(hooks):
    seen = []
    hooks.jit_cache_hook = None
    hooks.jit_post_compile_hook = lambda **kw: seen.append(kw["fn"].name)  # e.g. vLLM's JIT monitor
    watch = kernel_jit.JitWatch()
    assert watch.install() and watch.installed
    watch.phase("warm-up")
    _compile(hooks, "fused_moe_kernel", 0.0)
    watch.phase("batch")
    _compile(hooks, "fused_moe_kernel", kernel_jit.SLOW_MS / 1e3 + 0.03)
    _compile(hooks, "_fwd_kernel", 0.0)
    assert seen == ["fused_moe_kernel", "fused_moe_kernel", "_fwd_kernel"]  # the earlier hook still runs
    s = watch.summary()
    assert s["warm-up"]["n"] == 1 and s["warm-up"]["slow"] == []
    assert s["batch"]["n"] == 2
    (fn, ms), = s["batch"]["slow"]
    assert fn == "fused_moe_kernel" and ms >= kernel_jit.SLOW_MS
    assert watch.slow_in(("turn2", "batch")) == [["batch", "fused_moe_kernel", ms]]
    assert watch.slow_in(("turn2",)) == []


def test_a_cache_hook_that_skips_compilation_keeps_its_answer(hooks):
    hooks.jit_cache_hook = lambda **kw: True  # "already have it": Triton skips the compilation
    hooks.jit_post_compile_hook = None
    watch = kernel_jit.JitWatch()
    watch.install()
    assert hooks.jit_cache_hook(key=("k",), fn=SimpleNamespace(name="f")) is True


def test_warm_prompts_cover_every_band_that_fits_and_leave_the_measured_rng_alone():
    singles, followup, batch = kernel_jit.warm_prompts(120000, 8512, 10)
    # each band twice: a token count that is a multiple of 16 and one that is not (Triton compiles both)
    assert [len(p) for p in singles] == [n + odd for n in kernel_jit.MOE_BAND_LENGTHS for odd in (0, 1)]
    assert {len(p) * 4 % 16 == 0 for p in singles} == {True, False}  # gpt-oss routes each token to 4 experts
    # a turn 2's shape: 64 new tokens over the longest single, which the GPU prefix cache holds by then
    assert followup[:len(singles[-1])] == singles[-1] and len(followup) == len(singles[-1]) + 64
    assert len(batch) == 10 and all(len(p) == 64 for p in batch)
    assert all(1000 <= t < 120000 for p in singles + batch + [followup] for t in p)
    assert kernel_jit.warm_prompts(120000, 8512, 10) == (singles, followup, batch)  # its own seeded RNG
    short, followup, _ = kernel_jit.warm_prompts(120000, 1024, 1, follow=32)
    assert len(short) == 2 * 5 and len(followup) <= 1024 - 16
    with pytest.raises(ValueError, match="vocab=500"):
        kernel_jit.warm_prompts(500, 8512, 1)


def test_envelope_prints_slow_compilations_of_measured_phases_only():
    jit = {"warm-up": {"n": 9, "ms": 4000.0, "slow": [["fused_moe_kernel", 900.0]]},
           "batch": {"n": 2, "ms": 700.0, "slow": [["fused_moe_kernel", 450.0], ["_fwd_kernel", 240.0]]}}
    note = envelope.jit_note(jit)
    assert note == ", compiled in batch: 2 kernel(s) 690 ms (_fwd_kernel, fused_moe_kernel)"
    assert envelope.jit_note({"warm-up": jit["warm-up"]}) == ""
    assert envelope.jit_note(None) == ""
