"""Transfer jobs and completions: the plain records the planner and the movers exchange.

The planner (``TierChain``) emits ``TransferJob`` records and applies ``Completion``
records; both are plain data (``to_dict``/``from_dict`` give JSON-able dicts) so the
planner and the tiers can live in different processes (vLLM's scheduler vs. workers).
The threads that execute jobs are in ``tiered_kv.movers``.

Tier index ``EXT`` (-1) names the caller's side of a job: the caller's tensor for the
Python API, the engine's GPU blocks for a connector. Slots on that side are indices into
the caller's buffer (or engine block ids).

Threading contract: plain values; a job is owned by one thread at a time (the planner
that built it, then the mover that runs it).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

EXT = -1
NO_SLOT = -1


class JobKind(enum.IntEnum):
    """What a job does. Loads (toward the caller) are served before stores."""

    INGRESS = 0    # caller -> tier (a put)
    EGRESS = 1     # tier -> caller (a get)
    DEMOTE = 2     # tier i -> tier i+1, source released after commit (eviction)
    PROMOTE = 3    # tier j -> tier j-1, source kept (hit promotion, prefetch)
    COPY_DOWN = 4  # tier i -> tier i+1, source kept (write-through)
    DELETE = 5     # remove records from a keyed tier

    @property
    def is_load(self) -> bool:
        """True for jobs a caller waits on to read data."""
        return self in (JobKind.EGRESS, JobKind.PROMOTE)


@dataclass(slots=True)
class TransferJob:
    """One batched transfer between two tiers (or a tier and the caller).

    ``keys[i]`` moves from ``src_slots[i]`` in ``src_tier`` to ``dst_slots[i]`` in
    ``dst_tier``. Slots are ``NO_SLOT`` for keyed tiers (the disk tier finds records by key).
    A job's lists are never changed once it is planned; ``src_slots`` may be a tuple (a bulk put's
    items ``0..n-1``, shared between jobs).
    """

    job_id: int
    kind: JobKind
    src_tier: int
    dst_tier: int
    keys: list[bytes]
    src_slots: list[int] | tuple[int, ...]
    dst_slots: list[int]
    handle: int = 0

    @property
    def priority(self) -> int:
        """0 for loads, 1 for stores (lower runs first)."""
        return 0 if self.kind.is_load else 1

    def __len__(self) -> int:
        return len(self.keys)

    def to_dict(self) -> dict:
        """Plain, JSON-able form (keys as hex) for crossing process boundaries."""
        return {"job_id": self.job_id, "kind": int(self.kind), "src_tier": self.src_tier,
                "dst_tier": self.dst_tier, "keys": [k.hex() for k in self.keys],
                "src_slots": list(self.src_slots), "dst_slots": list(self.dst_slots), "handle": self.handle}

    @classmethod
    def from_dict(cls, d: dict) -> "TransferJob":
        """Inverse of ``to_dict``."""
        return cls(int(d["job_id"]), JobKind(int(d["kind"])), int(d["src_tier"]), int(d["dst_tier"]),
                   [bytes.fromhex(k) for k in d["keys"]], [int(s) for s in d["src_slots"]],
                   [int(s) for s in d["dst_slots"]], int(d.get("handle", 0)))


@dataclass(slots=True)
class Completion:
    """Outcome of one job: per-item success, and which source records failed verification.

    ``corrupt[i]`` means the source tier found item i's record damaged and already removed it;
    ``missing[i]`` that the source tier no longer has the record at all (removed by another
    process sharing the medium). Either way the planner forgets that copy. ``evicted`` lists keys
    whose records a governed destination tier dropped to make room for this job's writes (the
    planner forgets those copies too).
    """

    job_id: int
    ok: list[bool]
    corrupt: list[bool] = field(default_factory=list)
    nbytes: int = 0
    seconds: float = 0.0
    error: str = ""
    missing: list[bool] = field(default_factory=list)
    evicted: list[bytes] = field(default_factory=list)

    @classmethod
    def failed(cls, job: TransferJob, error: str) -> "Completion":
        """A completion in which every item failed."""
        return cls(job.job_id, [False] * len(job), [False] * len(job), error=error)

    def to_dict(self) -> dict:
        """Plain, JSON-able form."""
        return {"job_id": self.job_id, "ok": list(self.ok), "corrupt": list(self.corrupt),
                "nbytes": self.nbytes, "seconds": self.seconds, "error": self.error, "missing": list(self.missing),
                "evicted": [k.hex() for k in self.evicted]}

    @classmethod
    def from_dict(cls, d: dict) -> "Completion":
        """Inverse of ``to_dict``."""
        return cls(int(d["job_id"]), [bool(x) for x in d["ok"]], [bool(x) for x in d.get("corrupt", [])],
                   int(d.get("nbytes", 0)), float(d.get("seconds", 0.0)), str(d.get("error", "")),
                   [bool(x) for x in d.get("missing", [])], [bytes.fromhex(k) for k in d.get("evicted", [])])
