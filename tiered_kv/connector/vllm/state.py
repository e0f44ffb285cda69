"""What every part of the vLLM scheduler side shares: the requests it follows, the keys naming their KV, counters.

- ``RequestState``: what the planner follows of one request (its chunk keys, block tables, how far it was
  stored, what its last lookup found);
- ``RequestTable``: those states by request id, and the names of a request's KV: chunk keys (the hash at a
  chunk's last token, keyed by the namespace) and tail keys (``TAIL_MARK``, see ``scheduler.py``), and its
  GPU block tables out of vLLM's per-group block ids;
- ``PlannerCounters``: the scheduler side's monotonic counters (``sched_*`` in the connector's stats); each
  part counts its own.

Threading contract: vLLM's scheduler thread only, like every scheduler-side part; no I/O, no torch.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tiered_kv.values.keys import Namespace
from tiered_kv.connector.vllm.geometry import Geometry

if TYPE_CHECKING:
    from tiered_kv.connector.vllm.parts import PartHit
    from tiered_kv.planner.split import Split

#: Tail keys are ``namespace prefix + TAIL_MARK + vLLM's block hash``: 8 + 1 + 16..32 bytes, never the 32 of a
#: whole chunk's key. No keyed hash: a lookup probes up to ``chunk_blocks - 1`` of them.
TAIL_MARK = b"T"


class RequestState:
    """What the planner follows of one request. A plain class with ``__slots__`` (one object per request, two
    lists made only once used): every object that outlives a step brings the garbage collector's next run closer,
    and on vLLM's scheduler thread that run lands inside a step."""

    __slots__ = ("request", "keys", "tables", "stored", "lookup", "hit_keys", "hit_tail", "tail_done", "seen_tail",
                 "sync", "promoting", "promoted", "parts", "owned", "split")

    def __init__(self, request) -> None:
        self.request = request  # vllm.v1.request.Request
        self.keys: list[bytes] = []  # chunk keys, computed lazily
        self.tables: Sequence[list[int]] = ()  # GPU block ids per group (0: none / freed), once allocated
        self.stored = 0  # leading chunks already offered to the store
        self.lookup: tuple[int, int, int] = (0, 0, 0)  # (first chunk, whole chunks, tokens held locally)
        self.hit_keys: Sequence[bytes] = ()  # the keys the last match would load (tail last)
        self.hit_tail = 0  # blocks of the tail piece after the whole chunks of the last match (0: none)
        self.tail_done = False  # the tail piece of this request's stored range was offered
        self.seen_tail: tuple[bytes, int] | None = None  # an older turn's tail piece its lookup found: (key, end)
        self.sync = False  # the last match is loaded inside the step (all chunks in the CPU tier)
        self.promoting = 0  # handle of a disk->CPU promotion this request waits for (several groups)
        self.promoted = False  # its promotion ran: take what the CPU tier holds now
        self.parts: PartHit | None = None  # hybrid models: the parts the last match would load
        self.owned: list[bytes] = []  # hybrid models: the part keys it loaded or stored, in chunk order
        self.split: tuple[Split, str] | None = None  # the split gate's plan for the last match, counted once allocated


class RequestTable:
    """The requests the planner follows, by id, and the keys and block tables of each."""

    def __init__(self, geo: Geometry, ns: Namespace) -> None:
        self.reqs: dict[str, RequestState] = {}
        # hybrid models: requests whose hit vLLM allocated for a load between steps and has not scheduled since
        # (``LookupPlanner.match`` admits one at a time: see lookup.py, "Hybrid loads between steps")
        self.async_waiting: set[str] = set()
        self._keys = ns.keys  # keyed hasher cached on the namespace
        self._hashes_per_chunk = geo.chunk_tokens // geo.hash_block_size
        self._groups = geo.groups
        self._single = not geo.parts
        self.tail_prefix = ns.prefix + TAIL_MARK

    def state(self, request) -> RequestState:
        """The state of ``request``, made anew when the id is new or names another request object."""
        st = self.reqs.get(request.request_id)
        if st is None or st.request is not request:
            st = self.reqs[request.request_id] = RequestState(request)
        return st

    def chunk_keys(self, st: RequestState, upto: int) -> list[bytes]:
        """Keys of chunks ``[0, upto)``: chunk c is named by the hash at its last token (which chains the prefix)."""
        keys = st.keys
        if len(keys) < upto:
            hashes = st.request.block_hashes
            m = self._hashes_per_chunk
            keys += self._keys(hashes[len(keys) * m + m - 1:upto * m:m])  # only the chunks not named yet
        return keys

    def tables(self, block_ids) -> list[list[int]]:
        """Our groups' block-id lists out of one of vLLM's per-group tuples (copies: we extend them)."""
        if self._single:
            return [list(block_ids[self._groups[0].index])]
        return [list(block_ids[g.index]) for g in self._groups]


@dataclass
class PlannerCounters:
    """Scheduler-side counters (monotonic)."""

    lookups: int = 0
    hit_tokens_cpu: int = 0
    hit_tokens_disk: int = 0
    sync_loads: int = 0
    async_hybrid_deferred: int = 0  # hybrid hits asked to wait a step: another one's load between steps was pending
    hybrid_reseeds: int = 0  # hybrid hits answered "no hit" so vLLM recomputes and caches a shared prefix (reseed.py)
    disk_hits_declined: int = 0  # split decisions that left held disk or remote chunks to recompute (wholly or in part)
    disk_probes: int = 0  # such decisions that loaded everything anyway, to re-measure the tiers (disk_probe_every)
    cpu_hits_recomputed: int = 0  # hits left whole to recompute: their loading steps measured slower (SplitGate)
    load_jobs: int = 0
    store_chunks: int = 0
    stores_dropped_reused: int = 0
    fences: int = 0
    failed_load_blocks: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    promotions: int = 0  # disk hits moved to the CPU tier before loading (several groups)
    remote_announced: int = 0  # chunks the presence feed reported stored by the fleet
    remote_adopted: int = 0  # of those, chunks a lookup reached (adopted into the chain then)
    pool_adopted: int = 0  # chunks other processes stored in the host pool, adopted as CPU copies
    pool_forgotten: int = 0  # CPU copies forgotten because the host pool no longer held them (the watch saw it)
    stale_blocks_dropped: int = 0  # table entries vLLM re-allocated before a store read them
    chunks_not_storable: int = 0  # chunks skipped: a block a hit needs was already freed
    tail_stores: int = 0  # tail pieces offered to the store (full blocks after a prompt's last whole chunk)
    tail_hits: int = 0  # loads that ended with a tail piece
    hit_tokens_tail: int = 0  # tokens of those hits that came from tail pieces (also in hit_tokens_<tier>)
    tails_superseded: int = 0  # older tail pieces dropped once a request stored what covers them
    # the reads from the disk or remote tier that fed the split's read rates (``SplitGate.observe_reads``), by where
    # they went: into GPU blocks (in-step, overlapped or not, and asynchronous loads) or up to the CPU tier
    # (promotions); bytes over seconds of each is the rate that kind of read showed
    rate_reads_gpu: int = 0
    rate_read_bytes_gpu: int = 0
    rate_read_seconds_gpu: float = 0.0
    rate_reads_cpu: int = 0
    rate_read_bytes_cpu: int = 0
    rate_read_seconds_cpu: float = 0.0
