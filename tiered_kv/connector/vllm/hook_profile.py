"""``TIERED_KV_PROFILE=<dir>``: profile the time our worker-side hooks hold vLLM's thread, function by function.

The trace (``trace_path``) says how long each loading step's hooks held vLLM's thread (``start_load_ms``,
``forward_submit_ms``); this says where that time goes. With the variable set, every worker-side hook of the
connector (``bind_connector_metadata``, ``handle_preemptions``, ``start_load_kv``, ``wait_for_layer_load``,
``wait_for_save``, ``get_finished``) runs under one ``cProfile.Profile`` per worker process, switched on for the
hook's call only, so the profile holds our code and what it calls (torch, the CUDA driver bindings) and nothing
of vLLM's forward. Every ``DUMP_EVERY_S`` seconds (checked when a hook ends) and at exit, the process writes
``<dir>/hooks_<pid>.prof`` (``pstats``; ``python -m pstats`` or snakeviz read it) and ``hooks_<pid>.txt`` (the
top functions by own time and by cumulative time, and the calls and seconds per hook), replacing the previous
pair. cProfile roughly doubles the cost of Python calls: compare shares within a profile, not its totals with an
unprofiled run. Unset (the default), the hooks pay one global lookup.

Threading contract: ``HookProfile.call`` only on vLLM's worker thread (the thread the hooks run on: cProfile
profiles the thread that enables it); ``dump`` from that thread or at exit.
"""
from __future__ import annotations

import atexit
import cProfile
import io
import logging
import os
import pstats
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: the environment variable naming the directory the profiles go to
ENV = "TIERED_KV_PROFILE"
#: seconds between two dumps (a server stopped by a signal keeps the last one)
DUMP_EVERY_S = 10.0
#: functions listed per ordering in the text summary
TOP = 40


class HookProfile:
    """One worker process's profile of the hooks (see the module)."""

    def __init__(self, directory: str) -> None:
        """Profile into ``directory`` (made if missing; OSError when it cannot be, which ``from_env`` turns into a
        warning: a run is never stopped by its profile)."""
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.profile = cProfile.Profile()
        self.calls: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self._last_dump = time.monotonic()
        self._depth = 0  # a hook calling another (wait_for_save runs before_forward's leftovers) profiles once
        atexit.register(self.dump)

    def call(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` with the profiler on; count the call and its wall seconds under ``name``."""
        outer = self._depth == 0
        t0 = time.perf_counter()
        self._depth += 1
        if outer:
            self.profile.enable()
        try:
            return fn(*args, **kwargs)
        finally:
            if outer:
                self.profile.disable()
            self._depth -= 1
            self.calls[name] = self.calls.get(name, 0) + 1
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
            if outer and time.monotonic() - self._last_dump > DUMP_EVERY_S:
                self.dump()

    def summary(self) -> str:
        """The text summary: per hook calls, seconds and ms per call; the top functions by own and cumulative time."""
        lines = ["hook | calls | seconds | ms per call"]
        for name in sorted(self.calls, key=lambda n: -self.seconds[n]):
            n, s = self.calls[name], self.seconds[name]
            lines.append(f"{name} | {n} | {s:.3f} | {s / n * 1e3:.3f}")
        for order in ("tottime", "cumulative"):
            buf = io.StringIO()
            try:
                pstats.Stats(self.profile, stream=buf).sort_stats(order).print_stats(TOP)
            except TypeError:  # nothing profiled yet
                buf.write("(no calls profiled yet)\n")
            lines += ["", f"by {order}:", buf.getvalue()]
        return "\n".join(lines)

    def dump(self) -> None:
        """Write ``hooks_<pid>.prof`` and ``hooks_<pid>.txt`` (each replaced whole, through a temporary file)."""
        self._last_dump = time.monotonic()
        base = os.path.join(self.directory, f"hooks_{os.getpid()}")
        try:
            if self.calls:
                self.profile.dump_stats(base + ".prof.tmp")
                os.replace(base + ".prof.tmp", base + ".prof")
            with open(base + ".txt.tmp", "w", encoding="utf-8") as f:
                f.write(self.summary())
            os.replace(base + ".txt.tmp", base + ".txt")
        except OSError as exc:  # a full disk must not stop the engine
            log.warning("%s: could not write the hook profile to %s: %s", ENV, self.directory, exc)


def from_env() -> HookProfile | None:
    """A ``HookProfile`` when ``TIERED_KV_PROFILE`` names a directory, else None (a directory that cannot be made:
    a warning, and None)."""
    directory = os.environ.get(ENV, "").strip()
    if not directory:
        return None
    try:
        prof = HookProfile(directory)
    except OSError as exc:
        log.warning("%s=%s: cannot profile there (%s); running without the hook profile", ENV, directory, exc)
        return None
    log.info("%s: profiling the worker hooks of process %d into %s", ENV, os.getpid(), directory)
    return prof
