"""``TIERED_KV_PROFILE=<dir>``: where the time our worker-side hooks hold vLLM's thread goes, function by function.

The trace (``trace_path``) says how long each loading step's hooks held vLLM's thread (``start_load_ms``,
``forward_submit_ms``); this says where that time goes. With the variable set, each worker process keeps one
``HookProfile``: every worker-side hook of the connector (``bind_connector_metadata``, ``handle_preemptions``,
``start_load_kv``, ``wait_for_layer_load``, ``wait_for_save``, ``get_finished``) is counted (calls, wall
seconds), and while one runs a sampler thread reads the hook thread's Python stack every ``SAMPLE_EVERY_S``
(``sys._current_frames``). A sampler rather than ``cProfile``: from Python 3.12 cProfile instruments every
thread of the process (``sys.monitoring``), so the movers' threads would land in the hooks' profile, and
switching it on and off per layer re-instruments code inside the forward. A sample names Python frames only:
time in a C call (a CUDA driver call, a torch op) counts to the Python function that made it.

Every ``DUMP_EVERY_S`` seconds (on the sampler thread) and at exit, ``<dir>/hooks_<host>_<pid>.txt`` (per hook:
calls, seconds, ms per call, samples; then the functions by own samples, the innermost frame, and by inclusive
samples, anywhere on the stack) and ``hooks_<host>_<pid>.json`` (the same numbers and the most frequent stacks)
are replaced whole. The sampler takes the GIL about every sample while a hook runs: expect the hooks a little
slower than unprofiled, and compare shares within a profile. Unset (the default), the hooks pay one attribute
check and no thread runs.

Threading contract: ``call`` on the threads vLLM runs the hooks on (one at a time, as vLLM calls them);
the sampler thread reads the current hook and thread id they publish and owns the sample tables under a lock;
``dump`` from either, or at exit; ``close`` stops the sampler.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: the environment variable naming the directory the profiles go to
ENV = "TIERED_KV_PROFILE"
#: seconds between two samples of the hook thread's stack while a hook runs
SAMPLE_EVERY_S = 0.0005
#: seconds between two dumps (a server stopped by a signal keeps the last one)
DUMP_EVERY_S = 10.0
#: frames kept per sample (innermost first), functions listed per ordering, stacks kept in the JSON
MAX_DEPTH, TOP, TOP_STACKS = 48, 40, 200

_instance: HookProfile | None = None
_instance_lock = threading.Lock()


def _where(code) -> str:
    """``package/module.py:function`` for a code object (the last two path parts)."""
    parts = code.co_filename.replace(os.sep, "/").rsplit("/", 2)
    return f"{'/'.join(parts[-2:])}:{code.co_name}"


class HookProfile:
    """One process's hook profile (see the module): call counts and seconds per hook, stack samples per hook."""

    def __init__(self, directory: str, sample_every_s: float = SAMPLE_EVERY_S, dump_every_s: float = DUMP_EVERY_S
                 ) -> None:
        """Profile into ``directory`` (made if missing: OSError when it cannot be, which ``from_env`` turns into a
        warning, so a run is never stopped by its profile); starts the sampler thread."""
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.base = os.path.join(directory, f"hooks_{socket.gethostname()}_{os.getpid()}")
        self.calls: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.samples: dict[str, Counter] = {}  # hook -> Counter of stacks (tuples of frames, innermost first)
        self._hook: str | None = None  # the hook running now, published for the sampler
        self._tid = 0  # the thread running it
        self._lock = threading.Lock()
        self._sample_every, self._dump_every = float(sample_every_s), float(dump_every_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tkv-hook-profile", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the hooks' side
    def call(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` as hook ``name``: sampled while it runs, its call and wall seconds counted (a
        hook called from inside another counts, its samples go to the outer one)."""
        outer = self._hook is None
        if outer:
            self._tid = threading.get_ident()
            self._hook = name
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            if outer:
                self._hook = None
            with self._lock:
                self.calls[name] = self.calls.get(name, 0) + 1
                self.seconds[name] = self.seconds.get(name, 0.0) + dt

    # ------------------------------------------------------------------ the sampler
    def _run(self) -> None:
        last_dump = time.monotonic()
        while not self._stop.wait(self._sample_every):
            hook, tid = self._hook, self._tid
            if hook is not None:
                frame = sys._current_frames().get(tid)
                stack = []
                while frame is not None and len(stack) < MAX_DEPTH:
                    stack.append(_where(frame.f_code))
                    frame = frame.f_back
                if stack:
                    with self._lock:
                        self.samples.setdefault(hook, Counter())[tuple(stack)] += 1
            if time.monotonic() - last_dump > self._dump_every:
                last_dump = time.monotonic()
                self.dump()

    # ------------------------------------------------------------------ reading it
    def tables(self) -> dict:
        """Per hook calls / seconds / samples; functions by own and by inclusive samples; the top stacks."""
        with self._lock:
            calls, seconds = dict(self.calls), dict(self.seconds)
            samples = {h: Counter(c) for h, c in self.samples.items()}
        own: Counter = Counter()
        inclusive: Counter = Counter()
        stacks: Counter = Counter()
        for hook, counter in samples.items():
            for stack, n in counter.items():
                own[stack[0]] += n
                for fn in set(stack):
                    inclusive[fn] += n
                stacks[(hook, stack)] += n
        total = sum(own.values())
        hooks = {h: {"calls": calls[h], "seconds": round(seconds[h], 6),
                     "ms_per_call": round(seconds[h] / calls[h] * 1e3, 4),
                     "samples": sum(samples.get(h, Counter()).values())} for h in calls}
        return {"samples": total, "sample_every_s": self._sample_every, "hooks": hooks,
                "own": own.most_common(TOP), "inclusive": inclusive.most_common(TOP),
                "stacks": [{"hook": h, "samples": n, "frames": list(s)} for (h, s), n in stacks.most_common(TOP_STACKS)]}

    def summary(self, t: dict | None = None) -> str:
        """The text summary of ``tables()``."""
        t = self.tables() if t is None else t
        lines = [f"{t['samples']} samples, one per {t['sample_every_s'] * 1e3:.2f} ms of hook time at most", "",
                 "hook | calls | seconds | ms per call | samples"]
        for name, h in sorted(t["hooks"].items(), key=lambda kv: -kv[1]["seconds"]):
            lines.append(f"{name} | {h['calls']} | {h['seconds']:.3f} | {h['ms_per_call']:.3f} | {h['samples']}")
        total = max(1, t["samples"])
        for title, rows in (("own samples (innermost Python frame)", t["own"]),
                            ("inclusive samples (anywhere on the stack)", t["inclusive"])):
            lines += ["", f"by {title}:"]
            lines += [f"{n:8d} {100 * n / total:5.1f}%  {fn}" for fn, n in rows]
        return "\n".join(lines) + "\n"

    def dump(self) -> None:
        """Replace ``<base>.txt`` and ``<base>.json`` (through temporary files); a write error is a warning."""
        try:
            t = self.tables()
            for ext, text in ((".json", json.dumps(t)), (".txt", self.summary(t))):
                with open(self.base + ext + ".tmp", "w", encoding="utf-8") as f:
                    f.write(text)
                os.replace(self.base + ext + ".tmp", self.base + ext)
        except OSError as exc:  # a full disk must not stop the engine
            log.warning("%s: could not write the hook profile to %s: %s", ENV, self.directory, exc)

    def close(self) -> None:
        """Stop the sampler and write the last dump."""
        self._stop.set()
        self._thread.join(timeout=5)
        self.dump()


def from_env() -> HookProfile | None:
    """This process's ``HookProfile`` when ``TIERED_KV_PROFILE`` names a directory (one per process, shared by every
    worker connector in it; written at exit too), else None. A directory that cannot be made: a warning, and None."""
    global _instance
    directory = os.environ.get(ENV, "").strip()
    if not directory:
        return None
    with _instance_lock:
        if _instance is not None and _instance.directory == directory:
            return _instance
        try:
            prof = HookProfile(directory)
        except OSError as exc:
            log.warning("%s=%s: cannot profile there (%s); running without the hook profile", ENV, directory, exc)
            return None
        if _instance is not None:
            _instance.close()
        else:
            atexit.register(lambda: _instance is not None and _instance.close())
        _instance = prof
    log.info("%s: sampling the worker hooks of process %d into %s", ENV, os.getpid(), directory)
    return prof
