"""``FaultLog``: counts I/O faults per source (a Redis node, a disk directory) and logs at most one line per
source per interval.

A medium that fails tends to fail every call for a while (a node down, a file system full or read-only): a
log line per failed call would flood the log, and cost the movers' threads time, exactly while the store is
busiest working around the fault. So the first fault of a source is logged at once, later ones at most once
per ``interval_s`` with the number of faults since the last line; ``counts`` has every fault.

Threading contract: ``fault`` and ``counts`` may be called from any thread (one lock).
"""
from __future__ import annotations

import logging
import threading
import time


class FaultLog:
    """Per-source fault counts, and a warning for each source at most once per ``interval_s`` seconds."""

    def __init__(self, logger: logging.Logger, what: str, interval_s: float = 10.0) -> None:
        self._log = logger
        self.what = what  # names the kind of source in each line: "remote tier: node", "disk tier"
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._last: dict[str, tuple[float, int]] = {}  # source -> (time of its last line, its count then)

    def fault(self, source: str, detail: str) -> bool:
        """Count one fault of ``source`` (``detail`` says what failed); log it unless ``source`` was logged less
        than ``interval_s`` ago. True when this call logged."""
        now = time.monotonic()
        with self._lock:
            n = self._counts[source] = self._counts.get(source, 0) + 1
            last = self._last.get(source)
            if last is not None and now - last[0] < self.interval_s:
                return False
            self._last[source] = (now, n)
        since = "" if last is None else f" ({n - last[1]} faults in the last {now - last[0]:.0f} s)"
        self._log.warning("%s %s: %s%s; logged at most every %.0f s", self.what, source, detail, since,
                          self.interval_s)
        return True

    def counts(self) -> dict[str, int]:
        """Faults counted so far, per source."""
        with self._lock:
            return dict(self._counts)
