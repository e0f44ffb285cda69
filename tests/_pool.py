"""Host pools for the tests: unique names in the real ``/dev/shm``, and a check that none is left behind.

Pools live in ``/dev/shm/tiered_kv-<uid>/``, shared by every test run of this user on the machine (other
engineers' runs too), so each test's pool name carries the pid and a counter: two runs never meet.
``pool_spec(tag)`` makes such a name; ``pool_path(spec)`` is where it lives; ``assert_gone(spec)`` checks
that the last close (or a test's cleanup) removed it.

Threading contract: test code; ``pool_spec`` may be called from any thread (``itertools.count``).
"""
from __future__ import annotations

import itertools
import os
import re
from pathlib import Path

from tiered_kv.tiers.pool import SHM_DIR, pool_name

_seq = itertools.count()


def pool_spec(tag: str = "t") -> str:
    """A ``cpu_pool`` value no other test (nor another run) uses: ``host:tkvtest-<tag>-<pid>-<n>``."""
    tag = re.sub(r"[^A-Za-z0-9._-]", "-", tag)[:24]
    return f"host:tkvtest-{tag}-{os.getpid()}-{next(_seq)}"


def pool_path(spec: str) -> Path:
    """The directory of pool ``spec``."""
    return Path(SHM_DIR) / f"tiered_kv-{os.getuid()}" / pool_name(spec)


def assert_gone(spec: str) -> None:
    """The pool's directory (and so its memory) is gone."""
    assert not pool_path(spec).exists(), f"{pool_path(spec)} was left behind"


def mapping_usage(path: Path, pid: int | str = "self") -> dict[str, int]:
    """How process ``pid`` holds the mapping of file ``path`` (summed over its mappings), in bytes, from
    ``/proc/<pid>/smaps``: ``Rss``, ``Pss``, ``Shared_Clean``, ``Shared_Dirty``, ``Private_Clean``,
    ``Private_Dirty``, and ``mappings``. Shared pages count in every mapper's Rss and 1/n in its Pss."""
    fields = ("Rss", "Pss", "Shared_Clean", "Shared_Dirty", "Private_Clean", "Private_Dirty")
    out = dict.fromkeys(fields, 0)
    out["mappings"] = 0
    inside = False
    target = str(path)
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):  # a mapping's first line
                inside = len(head) >= 6 and head[5] == target
                out["mappings"] += inside
            elif inside and head and head[0].rstrip(":") in fields:
                out[head[0].rstrip(":")] += int(head[1]) * 1024
    return out
