"""Handle: the pending result of a ``TieredStore`` put, get or prefetch.

A handle is made by the store when a call starts and set once, by whichever thread finishes
the call's last job (a mover thread, or the calling thread when nothing had to move).

Threading contract: ``wait``, ``done``, ``result`` and ``add_done_callback`` may be called from
any thread; ``await handle`` works from any event loop (the result is handed to the loop with
``call_soon_threadsafe``). Callbacks run on the thread that sets the result.
"""
from __future__ import annotations

import asyncio
import threading
import time

from tiered_kv.errors import TransferTimeout


class Handle:
    """The pending result of a put, get or prefetch."""

    def __init__(self, kind: str, n: int) -> None:
        self.kind = kind
        self.n = n
        self._event = threading.Event()
        self._result: object = None
        self._callbacks: list = []
        self._lock = threading.Lock()
        self.t_start = time.perf_counter()
        self.t_done = 0.0

    def _set(self, result: object) -> None:
        with self._lock:
            self._result = result
            self.t_done = time.perf_counter()
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(result)

    def done(self) -> bool:
        """True once the result is known."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None):
        """Block until done; returns the result (put: list[bool]; get/prefetch: int leading count)."""
        if not self._event.wait(timeout):
            raise TransferTimeout(f"{self.kind} of {self.n} blocks not done after {timeout} s; "
                                  f"it keeps running — wait again or raise the timeout")
        return self._result

    @property
    def result(self):
        """The result if done, else None."""
        return self._result if self.done() else None

    def add_done_callback(self, fn) -> None:
        """Call ``fn(result)`` when done (at once if already done), on the completing thread."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self._result)

    def __await__(self):
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def _resolve(result, fut=fut):
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(result))

        self.add_done_callback(_resolve)
        return fut.__await__()
