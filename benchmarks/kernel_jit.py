"""Triton compilations inside a benchmark's measured phases, and a warm-up that makes them rare.

Why: on a fresh GPU machine the first engine to run a step of a new size compiles Triton kernels for it inside
that step. vLLM's fused-MoE kernel picks its tiles by the step's token count M (its default config has a tile
per band: M <= 32, 64, 96, 128, 512, 4096 and above), so on a MoE shape (gpt-oss) the first batch of a call
may pay compilations that later starts find in Triton's disk cache. The likely case (not shown yet: this module
is how the next run shows it): on 2026-11-29 (GPU round 8) the first ``OffloadingConnector`` gpt-oss batch of a
call took 5.56 s against 2.20 s a round earlier, and one start of ours held the batch's first step 0.69 s (its
later layer groups are submitted as the forward reaches them, so a slow forward reads as a slow load) where the
next start took 25 ms for the same loads. A comparison between modes is fair only when no mode pays the
machine's first compilations, and a run says so only when it records them.

- ``JitWatch``: wraps Triton's ``jit_cache_hook`` / ``jit_post_compile_hook`` (keeping any hook already set,
  vLLM's JIT monitor included) and records, per phase the benchmark names, how many kernels were compiled (or
  loaded from Triton's disk cache into this process: the hooks cannot tell, the time can) and how long each
  took.
- ``slow_in``: the slow compilations of a ``summary`` (in-process, or a start's record in the parent) inside the
  phases named.
- ``warm_prompts``: two prompts per fused-MoE tile band (``MOE_BAND_LENGTHS``, and one token more: Triton compiles
  the kernel again when its token count is not a multiple of 16), a follow-up over a GPU-cached
  context (a turn 2's shape), and a batch for decode with several sequences; the benchmark runs them before its
  first measured phase, from an RNG of its own so the measured prompts stay what they were.

Threading: the hooks run on the thread that compiles (the engine's thread, in-process with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``); records are appended under a lock; ``phase`` and ``summary`` from the
benchmark's thread.
"""
from __future__ import annotations

import random
import threading
import time

#: Prefill lengths, one inside each M band of vLLM's default fused-MoE tile config (fused_moe.get_default_config:
#: M <= 32, <= 64, <= 96, <= 128, <= 512, <= 4096 with few tokens per expert, more).
MOE_BAND_LENGTHS = (16, 48, 80, 112, 320, 2048, 6144)
#: A compilation longer than this inside a measured phase is reported (a disk-cache load takes a few ms).
SLOW_MS = 50.0


class JitWatch:
    """Records Triton kernel compilations by phase; ``install`` once per process, ``phase`` as the run moves on."""

    def __init__(self) -> None:
        self.events: list[dict] = []  # {"phase", "fn", "t" (time.time() at the start), "ms"}
        self.installed = False
        self._phase = "setup"
        self._lock = threading.Lock()
        self._local = threading.local()

    def install(self) -> bool:
        """Hook Triton's JIT (chained after any hook already set); False when Triton is not importable."""
        try:
            from triton import knobs
        except ImportError:
            return False
        rt = knobs.runtime
        before_cache, before_post = rt.jit_cache_hook, rt.jit_post_compile_hook

        def on_cache(*args, **kwargs):
            self._local.t0 = (time.time(), time.perf_counter())
            return before_cache(*args, **kwargs) if before_cache else None

        def on_post(*args, **kwargs):
            started = getattr(self._local, "t0", None)
            self._local.t0 = None
            fn = kwargs.get("fn")
            name = getattr(fn, "name", None) or str(kwargs.get("repr", "?")).split("[", 1)[0]
            ms = (time.perf_counter() - started[1]) * 1e3 if started else None
            with self._lock:
                self.events.append({"phase": self._phase, "fn": name, "t": started[0] if started else time.time(),
                                    "ms": None if ms is None else round(ms, 1)})
            return before_post(*args, **kwargs) if before_post else None

        rt.jit_cache_hook, rt.jit_post_compile_hook = on_cache, on_post
        self.installed = True
        return True

    def phase(self, name: str) -> None:
        """Compilations from now on belong to phase ``name``."""
        self._phase = name

    def summary(self) -> dict:
        """Per phase: ``n`` compilations, their summed ``ms``, and ``slow``: those over ``SLOW_MS`` as [fn, ms]."""
        out: dict = {}
        with self._lock:
            events = list(self.events)
        for e in events:
            p = out.setdefault(e["phase"], {"n": 0, "ms": 0.0, "slow": []})
            p["n"] += 1
            if e["ms"] is not None:
                p["ms"] = round(p["ms"] + e["ms"], 1)
                if e["ms"] > SLOW_MS:
                    p["slow"].append([e["fn"], e["ms"]])
        return out

    def slow_in(self, phases: tuple[str, ...]) -> list[list]:
        """The slow compilations ([phase, fn, ms]) inside ``phases`` (the measured ones)."""
        return slow_in(self.summary(), phases)


def slow_in(summary: dict | None, phases: tuple[str, ...]) -> list[list]:
    """The slow compilations ([phase, fn, ms]) of a ``JitWatch.summary`` (None: none) inside ``phases``."""
    return [[p, fn, ms] for p in phases for fn, ms in (summary or {}).get(p, {}).get("slow", [])]


def warm_prompts(vocab: int, max_len: int, batch: int, follow: int = 64,
                 seed: int = 1) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """(single prompts, a follow-up, one batch) of random token ids in ``[1000, vocab)`` from ``random.Random(seed)``.

    The singles: two per ``MOE_BAND_LENGTHS`` length ``n`` that fits ``max_len`` (less room for the output), of ``n``
    and ``n + 1`` tokens, run one at a time. Triton specialises a kernel's integer arguments on being a multiple of 16
    unless told not to, and vLLM's fused-MoE kernel takes the step's routed token count (tokens x top-k) and the
    sorted ids' length as plain integers: every band has a variant for counts that are multiples of 16 and one for
    counts that are not. The band lengths are multiples of 16, so before 2026-11-30 only the first variant was warmed,
    and a serving step of, say, 3,030 tokens (x 4 experts: not a multiple of 16) compiled inside a measured phase
    (GPU round 13: two fused-MoE compilations in gpt-oss's c32 phase without a connector, the warm-up
    notwithstanding). The follow-up: the longest single plus ``follow`` new tokens, run after the singles, so its step computes
    ``follow`` tokens over a context that vLLM's GPU prefix cache holds (the shape of every turn 2 and of a loaded
    hit: attention kernels specialise on it); the batch: ``batch`` prompts of 64 tokens, run together, for decode
    steps of ``batch`` sequences.
    """
    if vocab <= 1000:
        raise ValueError(f"vocab={vocab}: the warm-up draws ids from 1000 up; pass the model's vocab size")
    rng = random.Random(seed)
    toks = lambda n: [rng.randrange(1000, vocab) for _ in range(n)]  # noqa: E731
    singles = [toks(n + odd) for n in MOE_BAND_LENGTHS if n + 1 <= max_len - 16 - follow for odd in (0, 1)]
    followup = singles[-1] + toks(follow) if singles else toks(follow)
    return singles, followup, [toks(64) for _ in range(max(1, batch))]
