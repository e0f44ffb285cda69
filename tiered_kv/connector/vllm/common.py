"""What both sides of the vLLM connector share: the tier numbering and the messages each way.

- ``StepPlan``: scheduler -> workers, once per step (inside ``TieredKVMetadata``, pickled by vLLM);
- ``JobReport``: workers -> scheduler, one per finished job and rank (inside ``TieredKVWorkerMeta``,
  merged over ranks by vLLM's ``KVOutputAggregator`` and again by the planner).

The scheduler side's ``TierChain`` and every worker's tiers number the tiers alike: ``CPU`` first, then
the disk and the remote tier when configured (``tier_indices``); ``EXT`` (``values.jobs``) is the
engine's GPU blocks.

Threading contract: plain data and pure functions; safe from any thread.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tiered_kv.values.jobs import TransferJob

CPU, DISK = 0, 1  # DISK only when a disk tier is configured: tier_indices gives the real layout


def tier_indices(disk: bool, remote: bool) -> tuple[int | None, int | None]:
    """Chain indices of the disk and remote tiers ([cpu, disk?, remote?]; None for an absent tier)."""
    return (DISK if disk else None), ((2 if disk else 1) if remote else None)


@dataclass
class StepPlan:
    """What the workers do for one scheduler step (pickled to every worker inside the metadata).

    ``early`` jobs start at once (loads into GPU blocks, tier-to-tier moves); ``stores`` read
    GPU blocks and start after this step's forward; ``ext`` gives, for every job with a GPU
    side, its items' GPU block ids, ``chunk_blocks`` per item, flat (-1 = leave that block alone);
    ``fences`` are job ids that must have finished touching GPU memory before this step's
    forward runs; ``loads`` maps a request to its load job ids (reported in
    ``finished_recving`` when all are done) and ``load_fail`` to GPU blocks its load cannot
    fill (reported as load errors, so vLLM recomputes them). ``tokens``: every token vLLM scheduled in
    this step (its ``total_num_scheduled_tokens``; None where unknown): how much the step's forward
    computes beside its in-step loads (``in_step_sm_max_tokens``), and with 0 the step is ``idle``.
    """

    step: int
    early: list[TransferJob] = field(default_factory=list)
    stores: list[TransferJob] = field(default_factory=list)
    ext: dict[int, list[int]] = field(default_factory=dict)
    fences: list[int] = field(default_factory=list)
    loads: dict[str, list[int]] = field(default_factory=dict)
    load_fail: dict[str, list[int]] = field(default_factory=dict)
    sync: list[int] = field(default_factory=list)
    sync_fail: list[int] = field(default_factory=list)
    tokens: int | None = None

    @property
    def idle(self) -> bool:
        """vLLM scheduled no token in this step (every request waits: for its loads, a promotion...), so a worker
        with loads in flight may wait for them in ``get_finished`` (``idle.py``)."""
        return self.tokens == 0

    def empty(self) -> bool:
        """True when the workers have nothing to do."""
        return not (self.early or self.stores or self.fences or self.loads or self.sync_fail)


@dataclass
class JobReport:
    """One job's outcome as reported by ``count`` TP ranks (merged: ok = all, corrupt = any)."""

    count: int
    ok: list[bool]
    corrupt: list[bool]
    nbytes: int = 0
    seconds: float = 0.0
    missing: list[bool] = field(default_factory=list)  # the source tier no longer holds the record (any rank)
    evicted: list[bytes] = field(default_factory=list)  # records a shared disk directory dropped for room (any rank)

    def merge(self, other: "JobReport") -> None:
        """Fold another rank's report of the same job into this one."""
        self.count += other.count
        self.ok = [a and b for a, b in zip(self.ok, other.ok)]
        self.corrupt = [a or b for a, b in zip(self.corrupt, other.corrupt)]
        if other.missing:
            self.missing = [a or b for a, b in zip(self.missing or [False] * len(other.missing), other.missing)]
        self.nbytes += other.nbytes
        self.seconds = max(self.seconds, other.seconds)
        if other.evicted:
            seen = set(self.evicted)
            self.evicted += [k for k in other.evicted if k not in seen]
