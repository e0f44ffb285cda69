"""Counters of the SGLang backend: failures, pages moved, and SGLang's per-interval metric windows.

Batch calls never raise into SGLang; instead each failure bumps a counter here (and logs
a warning, at most once per operation per 30 s so a dead disk does not flood the log).

Threading contract: every method takes the object's lock; safe from SGLang's prefetch,
prefetch-IO and backup threads at once.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter

log = logging.getLogger("tiered_kv.connector.sglang")

_LOG_EVERY_S = 30.0


class BackendCounters:
    """Monotonic counters plus the windows SGLang's ``get_stats`` drains."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: Counter[str] = Counter()
        self._last_log: dict[str, float] = {}
        self._windows: dict[str, list] = {"get_pages": [], "get_gbps": [], "set_pages": [], "set_gbps": []}
        self.last_error = ""

    def add(self, **counts: int) -> None:
        """Add to named counters."""
        with self._lock:
            self._c.update(counts)

    def fail(self, op: str, exc: BaseException) -> None:
        """Count a failed call of ``op`` (and log it, rate-limited)."""
        now = time.monotonic()
        with self._lock:
            self._c[f"{op}_errors"] += 1
            self._c["errors"] += 1
            self.last_error = f"{op}: {type(exc).__name__}: {exc}"
            noisy = now - self._last_log.get(op, -_LOG_EVERY_S) >= _LOG_EVERY_S
            if noisy:
                self._last_log[op] = now
        if noisy:
            log.warning("tiered_kv SGLang backend: %s failed (counted, reported to SGLang as a miss/failure): %s: %s",
                        op, type(exc).__name__, exc)

    def transfer(self, kind: str, ok_pages: int, failed_pages: int, nbytes: int, seconds: float,
                 zero_copy: bool, deduplicated: int = 0) -> None:
        """Record one batch ``kind`` ("get" or "set")."""
        with self._lock:
            c = self._c
            c[f"{kind}_calls"] += 1
            c[f"{kind}_pages"] += ok_pages
            c[f"{kind}_pages_failed"] += failed_pages
            c[f"{kind}_bytes"] += nbytes
            c[f"{kind}_zero_copy_calls"] += int(zero_copy)
            c["set_pages_deduplicated"] += deduplicated
            if ok_pages:
                self._windows[f"{kind}_pages"].append(ok_pages)
                self._windows[f"{kind}_gbps"].append(nbytes / max(seconds, 1e-9) / 1e9)

    def drain_windows(self) -> tuple[list[int], list[float], list[int], list[float]]:
        """(prefetch pages, prefetch GB/s, backup pages, backup GB/s) since the last drain; resets them."""
        with self._lock:
            w = self._windows
            out = (w["get_pages"], w["get_gbps"], w["set_pages"], w["set_gbps"])
            self._windows = {k: [] for k in w}
        return out

    def snapshot(self) -> dict:
        """All counters (missing ones read as 0 in ``get``) and the last error text."""
        with self._lock:
            out = dict(self._c)
            out["last_error"] = self.last_error
        return out
