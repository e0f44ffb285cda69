"""Scheduler side of the vLLM connector: the planner in vLLM's EngineCore process.

``SchedulerPlanner`` owns a ``TierChain`` ([cpu, disk]; ``EXT`` = the engine's GPU blocks)
and turns vLLM's scheduler callbacks into ``TransferJob``s for the workers:

- ``match``: how many tokens beyond the local prefix hit the tiers hold (n-1 rule: at
  least one prompt token is always left to compute; disk hits only when loading them is
  estimated faster than recomputing), and whether the load runs inside the step
  (``load_mode`` "layerwise"/"sync": every chunk in the CPU tier and at most
  ``sync_max_tokens``; vLLM then schedules the request at once and the workers load before
  or alongside the forward; "adaptive": the same while the step's in-step bytes stay within
  a per-step budget, ``admission.py``) or between steps (asynchronous: disk hits, big hits,
  "async", hits past the budget);
- ``allocated``: after vLLM allocated GPU blocks for an async hit, plan the loads into them;
- ``build``: once per step, plan eager stores of newly computed prompt blocks, add fences
  (jobs that must finish on the GPU before a re-allocated block is overwritten) and hand
  out every job planned since the last step as a ``StepPlan``;
- ``apply_reports``: apply the workers' completions (a job is done when every TP rank
  reported it) and plan whatever they unblocked.

GPU source blocks are protected without delaying vLLM's frees: a store job is only handed
out if none of its blocks was re-allocated since the store was planned, and a block that is
re-allocated while a job still reads or writes it puts that job in the next plan's fences.

Hybrid models (several KV cache groups, ``Geometry.parts``): each group's share of a chunk is a
record of its own (a *part*), and ``parts.PartPlanner`` decides which parts a hit reads and a store
writes (full attention: every chunk; a sliding window: only the window before a stored prefix's end;
Mamba: the state where one was kept), so a tier's bytes hold what later hits can use. A job's GPU ids
per item are ``Geometry.slot_blocks`` (the item's group's blocks in its section, -1 elsewhere). vLLM
frees a running request's out-of-window blocks without telling the connector, so table entries
re-allocated since are zeroed before any store reads them. With several groups vLLM takes no
per-block load errors, so every load comes from a ready CPU copy (disk hits are promoted to the CPU
tier first; ``match`` answers "ask again" while they move) and the worker falls back to a plain copy
rather than report a block.

Tail pieces (``tail_chunks``, one full-attention or MLA group): a prompt rarely ends on a chunk
boundary, so the full blocks after its last whole chunk are stored too, once its prefill is
complete (``on_finish``: when it finishes), as one *tail* record: a chunk slot whose first ``m``
blocks hold them (the job's other GPU ids are -1, so the rest of the slot is neither written nor
read). Its key is the namespace prefix, ``TAIL_MARK`` and vLLM's block hash of its last block,
which chains the whole prefix: equal keys name equal KV, across restarts too (disk records are
adopted like any other). ``match`` probes tails where the walk over whole chunks stopped, longest
first; a later turn that holds the same prefix hits the whole chunks and then the tail, so only
what lies after the earlier prompt's last full block is computed again.

Threading contract: every method runs on vLLM's scheduler thread (EngineCore); not
thread-safe and needs no lock. No torch, no I/O (DESIGN invariant 7) except opening the
disk index read-only once at start-up to adopt what a previous engine stored.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Protocol

from tiered_kv.planner.chain import TierChain, TierSpec
from tiered_kv.planner.gate import DECLINED, PROBE, LoadGate
from tiered_kv.errors import ConfigError
from tiered_kv.values.keys import Namespace
from tiered_kv.planner.policy import PlacementPolicy
from tiered_kv.values.jobs import Completion, JobKind, TransferJob
from tiered_kv.connector.vllm.admission import StepLoadBudget
from tiered_kv.connector.vllm.config import ConnectorConfig, Geometry
from tiered_kv.connector.vllm.parts import PartHit, PartPlanner


class PresenceSource(Protocol):
    """What the planner needs of the remote tier's presence feed (``tiers.remote.PresenceFeed``)."""

    def pending(self) -> bool: ...

    def take(self) -> tuple[list[bytes], list[bytes]]: ...

log = logging.getLogger(__name__)

CPU, DISK = 0, 1  # DISK only when a disk tier is configured: tier_indices gives the real layout
#: Tail keys are ``namespace prefix + TAIL_MARK + vLLM's block hash``: 8 + 1 + 16..32 bytes, never the 32 of a
#: whole chunk's key. No keyed hash: a lookup probes up to ``chunk_blocks - 1`` of them.
TAIL_MARK = b"T"


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
    fill (reported as load errors, so vLLM recomputes them).
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


class _Req:
    """What the planner follows of one request. A plain class with ``__slots__`` (one object per request, two
    lists made only once used): every object that outlives a step brings the garbage collector's next run closer,
    and on vLLM's scheduler thread that run lands inside a step."""

    __slots__ = ("request", "keys", "tables", "stored", "lookup", "hit_keys", "hit_tail", "tail_done", "seen_tail",
                 "sync", "promoting", "promoted", "parts", "owned")

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


class _Put:
    """One planned store (a ``TierChain.put`` handle): where its items' KV sits on the GPU."""

    __slots__ = ("gpu", "step", "reqs", "holes")

    def __init__(self, gpu: list[int], step: int, reqs: Sequence[str], holes: bool) -> None:
        self.gpu = gpu  # Geometry.slot_blocks GPU block ids per item, flat
        self.step = step  # the step the source blocks were last known to hold this KV
        self.reqs = reqs  # the requests whose blocks it reads ((): already freed, e.g. on_finish)
        self.holes = holes  # gpu may hold -1 (a block to leave alone); False: every id is a block


@dataclass
class PlannerCounters:
    """Scheduler-side counters (monotonic)."""

    lookups: int = 0
    hit_tokens_cpu: int = 0
    hit_tokens_disk: int = 0
    sync_loads: int = 0
    disk_hits_declined: int = 0
    disk_probes: int = 0
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
    stale_blocks_dropped: int = 0  # table entries vLLM re-allocated before a store read them
    chunks_not_storable: int = 0  # chunks skipped: a block a hit needs was already freed
    tail_stores: int = 0  # tail pieces offered to the store (full blocks after a prompt's last whole chunk)
    tail_hits: int = 0  # loads that ended with a tail piece
    hit_tokens_tail: int = 0  # tokens of those hits that came from tail pieces (also in hit_tokens_<tier>)
    tails_superseded: int = 0  # older tail pieces dropped once a request stored what covers them


class SchedulerPlanner:
    """The planner behind ``TieredKVConnector``'s scheduler role; works in chunks of blocks."""

    def __init__(self, cfg: ConnectorConfig, geo: Geometry, ns: Namespace, cpu_chunks: int, disk_chunks: int,
                 adopted: Sequence[bytes] = (), presence: PresenceSource | None = None) -> None:
        self.cfg, self.geo = cfg, geo
        self.bs = geo.block_size
        self.k = geo.chunk_blocks
        self.w = geo.slot_blocks  # GPU ids per item of a job
        self.chunk = geo.chunk_tokens
        self._hashes_per_chunk = geo.chunk_tokens // geo.hash_block_size
        self._groups = geo.groups
        # one full-attention (or MLA) group: a record is a chunk; else a record is one group's part of a chunk
        self._single = not geo.parts
        self._parts = PartPlanner(geo, ns.key, cfg.swa_store) if geo.parts else None
        # sliding-window groups lose blocks mid-request: watch table entries for re-allocation
        self._swa = [i for i, g in enumerate(geo.groups) if g.kind == "swa"]
        specs = [TierSpec("cpu", cpu_chunks)]
        if disk_chunks:
            # shared budget without a remote tier below: the directory evicts by itself (governed); a load of a
            # chunk it evicted fails and vLLM recomputes. With a remote tier, the planner evicts (demotes) as before.
            shared = cfg.disk_budget == "shared" and presence is None
            specs.append(TierSpec("disk", disk_chunks, slotted=False, governed=shared))
        # the remote tier (a Redis Cluster shared by the fleet) is governed: Redis keeps its budget
        _, self.remote = tier_indices(bool(disk_chunks), presence is not None)
        if self.remote is not None:
            specs.append(TierSpec("remote", 0, slotted=False, governed=True))
        self._presence = presence
        # chunks the fleet stored in the remote tier, adopted into the chain only when a lookup reaches one:
        # a set insert per announced chunk keeps the feed's cost off the scheduler thread's steps
        self._remote_known: set[bytes] = set()
        write_policy = cfg.write_policy
        if disk_chunks and write_policy == "write_back" and any(g.kind in ("swa", "mamba") for g in geo.groups):
            # write-back makes a store wait for a demotion when the CPU tier is full, and vLLM re-uses
            # sliding-window and Mamba blocks within a step or two: the store would be dropped. With
            # write-through CPU copies are clean, so room is made at once; in steady state (CPU full)
            # both write each chunk to disk once.
            log.info("TieredKVConnector: hybrid model with a disk tier: write_through instead of write_back "
                     "(sliding-window and Mamba blocks do not live long enough to wait for a demotion)")
            write_policy = "write_through"
        copy_to = (self.remote,) if self.remote is not None and cfg.remote_write == "through" else ()
        self.chain = TierChain(specs, cfg.eviction, PlacementPolicy(write_policy, cfg.promote_on_hit, copy_to=copy_to))
        self._event_meta: dict[bytes, tuple] | None = None  # chunk key -> what a KV event names (enable_events)
        self.key = ns.key  # prefix and keyed hasher cached on the namespace
        self._keys = ns.keys
        # tail pieces: one full-attention (or MLA) group only, and only when a chunk has several blocks
        self._tails = cfg.tail_chunks and self._single and self.k > 1
        self._tail_prefix = ns.prefix + TAIL_MARK
        self.counters = PlannerCounters()
        self._step = 0
        self._reqs: dict[str, _Req] = {}
        self._storing: dict[str, _Req] = {}  # requests with prompt chunks still to store (eager)
        self._owner: dict[int, tuple[_Req, int, int]] = {}  # sliding-window GPU block -> (request, group, position)
        self._puts: dict[int, _Put] = {}
        self._gets: dict[int, list[int]] = {}  # handle -> its items' GPU ids, flat
        self._promotions: dict[int, _Req] = {}  # prefetch handle -> the request waiting for it
        self._handle_ids = iter(range(1, 1 << 62))
        self._early: list[TransferJob] = []
        self._stores: list[TransferJob] = []
        self._ext: dict[int, list[int]] = {}  # job id -> its items' GPU ids (flat), until handed out
        self._loads: dict[str, list[int]] = {}
        self._load_fail: dict[str, list[int]] = {}
        self._sync: list[int] = []
        self._sync_fail: list[int] = []
        self._finish_puts: list[tuple[list[bytes], list[int], int]] = []
        self._alloc_step: dict[int, int] = {}  # GPU block -> last step it was (re)allocated (while watching)
        self._watching = False
        # GPU block id -> newest published in-flight job touching it, 0 for none (job ids start at 1): a list indexed
        # by block id, grown on demand, so publishing a job's blocks is a store per block with no hashing
        self._gpu_busy: list[int] = []
        self._job_gpu: dict[int, list[int]] = {}
        # One full-attention group: vLLM re-allocates a block only after the request holding it finished or
        # was preempted, so a job's blocks are published to _gpu_busy only then (most jobs end first: no
        # per-block dictionary work). Sliding windows free blocks mid-request: those publish at once.
        self._lazy_busy = self._single
        self._published: set[int] = set()  # in-flight jobs whose blocks are in _gpu_busy
        self._req_jobs: dict[str, list[int]] = {}  # request -> its unpublished in-flight jobs (may list ended ones)
        self._routing_req: str | None = None  # the request whose blocks the jobs being routed touch (loads)
        self._fenced_jobs: set[int] = set()  # jobs named in a fence: a store among them may come back cancelled
        self._reports: dict[int, JobReport] = {}
        # disk and remote chunks load only while reading them beats recomputing them (shared with SGLang's backend)
        self._gate = LoadGate(cfg.disk_load_policy, cfg.disk_read_gbps, cfg.disk_probe_every,
                              cfg.prefill_tokens_per_s, geo.chunk_tokens, geo.chunk_nbytes)
        # load_mode adaptive: the in-step load bytes (per rank) each step may take; None in the other modes
        self._budget = (StepLoadBudget(None if cfg.step_load_bytes == "auto" else cfg.step_load_bytes, cfg.load_gbps)
                        if cfg.load_mode == "adaptive" else None)
        self._async_cpu_loads: set[int] = set()  # adaptive: asynchronous CPU-tier loads (their rate feeds the budget)
        if adopted and disk_chunks:
            self._route(self.chain.adopt(DISK, list(adopted)))
            log.info("TieredKVConnector: adopted %d chunks from disk", len(adopted))

    # ------------------------------------------------------------------ keys
    def _state(self, request) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None or st.request is not request:
            st = self._reqs[request.request_id] = _Req(request)
        return st

    def _chunk_keys(self, st: _Req, upto: int) -> list[bytes]:
        """Keys of chunks ``[0, upto)``: chunk c is named by the hash at its last token (which chains the prefix)."""
        keys = st.keys
        if len(keys) < upto:
            hashes = st.request.block_hashes
            m = self._hashes_per_chunk
            keys += self._keys(hashes[len(keys) * m + m - 1:upto * m:m])  # only the chunks not named yet
        return keys

    def _tables(self, block_ids) -> list[list[int]]:
        """Our groups' block-id lists out of one of vLLM's per-group tuples (copies: we extend them)."""
        if self._single:
            return [list(block_ids[self._groups[0].index])]
        return [list(block_ids[g.index]) for g in self._groups]

    def _load_ids(self, tables: list[list[int]], c0: int, n: int, local: int) -> list[int]:
        """One group: GPU ids a load of chunks ``[c0, c0+n)`` fills, ``chunk_blocks`` per chunk; -1 for the
        blocks vLLM holds already (``local`` tokens)."""
        k = self.k
        out = list(tables[0][c0 * k:(c0 + n) * k])
        skip = local // self.bs - c0 * k
        if skip > 0 and out:
            out[:skip] = [-1] * skip
        return out

    # ------------------------------------------------------------------ lookups and loads
    def match(self, request, num_computed_tokens: int) -> int | None:
        """Tokens beyond ``num_computed_tokens`` that can be loaded (0 if none; None: ask again next step)."""
        self.counters.lookups += 1
        if self._presence is not None and self._presence.pending():
            self.sync_remote()  # what the fleet stored since the last step, before this lookup
        bs, chunk = self.bs, self.chunk
        if num_computed_tokens % bs:
            return 0
        c0 = num_computed_tokens // chunk
        # n-1 rule: leave at least one prompt token to compute. It caps the lookup itself (not the
        # answer), so a sliding window or a Mamba state is only ever taken at the boundary it was stored for.
        avail = min(len(request.block_hashes) * self.geo.hash_block_size, request.num_tokens - 1)
        usable = avail // chunk - c0
        if usable <= 0 and not (self._tails and avail // bs > num_computed_tokens // bs):
            return 0
        st = self._state(request)
        st.sync = False
        st.hit_tail = 0
        if st.promoting:
            return None  # its disk chunks are still moving up to the CPU tier
        if self._parts is not None:
            return self._match_parts(st, c0, usable, num_computed_tokens)
        keys, where = self._walk(st, c0, usable)
        tail = 0
        if self._tails:
            tail = self._probe_tail(request, c0 + len(keys), avail // bs, num_computed_tokens // bs, keys, where)
            if tail:  # dropped once this request stores past it (each turn would otherwise leave one behind)
                st.seen_tail = (keys[-1], (c0 + len(keys) - 1) * self.k + tail)
        if not where:  # nothing held (a new prompt's usual answer): none of what follows could find a hit
            log.debug("match %s: computed %d, none of %d chunks held", request.request_id, num_computed_tokens, usable)
            return 0
        n = self._worth_loading(where)
        if tail and n < len(where):
            tail = 0  # the tail's tier was declined (or a chunk before it was)
        log.debug("match %s: computed %d, %d of %d chunks held %s, %d worth loading", request.request_id,
                  num_computed_tokens, len(where), usable, where[:4], n)
        whole = n - (1 if tail else 0)
        tokens = (c0 + whole) * chunk + tail * bs - num_computed_tokens
        if n == 0 or tokens // bs < self.cfg.min_hit_blocks:
            return 0
        st.lookup = (c0, whole, num_computed_tokens)
        st.hit_tail = tail
        st.hit_keys = keys[:n]
        st.sync = (self.cfg.load_mode != "async" and tokens <= self.cfg.sync_max_tokens
                   and all(t == CPU for t in where[:n]))
        if st.sync and self._budget is not None:
            st.sync = self._budget.admit(self.geo.hit_nbytes(tokens))
        return tokens

    def _match_parts(self, st: _Req, c0: int, usable: int, computed: int) -> int | None:
        """``match`` for hybrid models: the longest hit over parts, its disk parts promoted to the CPU tier first."""
        parts, hashes = self._parts, st.request.block_hashes

        def chunk_key(c: int) -> bytes:
            return self._chunk_keys(st, c + 1)[c]

        hit = parts.find(hashes, chunk_key, c0, usable, self._best)
        if hit is not None:
            n = self._worth_loading(hit.chunk_tiers(c0))
            if n < hit.end - c0:  # disk chunks declined: a shorter hit needs its own window and state
                hit = parts.find(hashes, chunk_key, c0, n, self._best) if n else None
        if hit is not None and any(t != CPU for t in hit.tiers):
            if not st.promoted:  # load only from the CPU tier, so a bad disk record is a plain miss
                if len(hit.keys) > self.chain.specs[CPU].capacity:
                    # its last promotions would evict its first, and a shorter hit lacks the window it ends at
                    log.debug("match %s: a hit of %d parts exceeds the CPU tier", st.request.request_id,
                              len(hit.keys))
                    return 0
                self._promote(st, hit.keys)
                return None
            n = next(i for i, t in enumerate(hit.chunk_tiers(c0)) if t != CPU)
            hit = parts.find(hashes, chunk_key, c0, n, self._best) if n else None
            if hit is not None and any(t != CPU for t in hit.tiers):
                hit = None
        if hit is None:
            log.debug("match %s: computed %d, no hit over parts", st.request.request_id, computed)
            return 0
        tokens = hit.end * self.chunk - computed
        if tokens // self.bs < self.cfg.min_hit_blocks:
            return 0
        st.lookup = (c0, hit.end - c0, computed)
        st.hit_keys = hit.keys
        st.parts = hit
        st.sync = self.cfg.load_mode != "async" and tokens <= self.cfg.sync_max_tokens
        if st.sync and self._budget is not None:
            st.sync = self._budget.admit(self.geo.hit_nbytes(tokens))
        return tokens

    def _best(self, key: bytes) -> int | None:
        """The fastest tier holding ``key``; a chunk the fleet announced is adopted here, when a lookup reaches it."""
        best = self.chain.index.best(key)
        known = self._remote_known
        if best is None and known and key in known and key not in self.chain.index:
            best = self._adopt_remote(key)
        return best

    def _walk(self, st: _Req, c0: int, usable: int) -> tuple[list[bytes], list[int]]:
        """Keys and fastest tiers of the leading run of held chunks from c0 (keys made lazily: a miss stops)."""
        index = self.chain.index
        best_of, known = index.best, self._remote_known
        keys: list[bytes] = []
        where: list[int] = []
        for c in range(c0, c0 + usable):
            key = self._chunk_keys(st, c + 1)[c]
            best = best_of(key)
            if best is None and known and key in known and key not in index:  # the fleet stored it: adopt it
                best = self._adopt_remote(key)
            if best is None:
                break
            keys.append(key)
            where.append(best)
        return keys, where

    def _probe_tail(self, request, c: int, avail_blocks: int, local_blocks: int, keys: list[bytes],
                    where: list[int]) -> int:
        """Look for a tail piece in chunk c (the first one not held whole), longest first; on a hit
        append its key and tier to ``keys``/``where`` and return its blocks (0: none).

        A piece of m blocks ends at block ``c*k + m - 1``: at most ``avail_blocks`` (the n-1 rule),
        and past what vLLM already holds (``local_blocks``), or it would add nothing.
        """
        base = c * self.k
        hi = min(self.k - 1, avail_blocks - base)
        lo = max(1, local_blocks - base + 1)
        if hi < lo:
            return 0
        prefix = self._tail_prefix
        index = self.chain.index
        probes = [prefix + h for h in request.block_hashes[base + lo - 1:base + hi]]  # m = lo..hi
        if index.holds_none_of(probes):  # the usual answer, in one C-speed pass
            return 0
        best_of = index.best
        for m in range(hi, lo - 1, -1):
            key = probes[m - lo]
            best = best_of(key)
            if best is not None:
                keys.append(key)
                where.append(best)
                return m
        return 0

    def _promote(self, st: _Req, keys: list[bytes]) -> None:
        """Start moving a hit's disk chunks up to the CPU tier; ``match`` answers "ask again" until done."""
        hid = next(self._handle_ids)
        got, jobs = self.chain.prefetch(keys, CPU, hid)
        st.promoting = hid
        self._promotions[hid] = st
        self.counters.promotions += 1
        log.debug("request %s: promoting %d of %d chunks to the CPU tier before loading", st.request.request_id,
                  sum(1 for j in jobs if j.dst_tier == CPU), got)
        self._route(jobs)
        self._drain_finished()

    def load_async(self, request) -> bool:
        """Whether the hit the last ``match`` of ``request`` found loads between steps (else inside the step)."""
        st = self._reqs.get(request.request_id)
        return st is None or not st.sync

    def _worth_loading(self, where: list[int]) -> int:
        """Leading chunks worth loading: disk chunks only while reading beats recomputing."""
        n_cpu = next((i for i, t in enumerate(where) if t != CPU), len(where))
        hits, outcome = self._gate.decide(n_cpu, len(where))
        if outcome == PROBE:  # a declined disk is read now and then, so the estimate follows it
            self.counters.disk_probes += 1
        elif outcome == DECLINED:
            self.counters.disk_hits_declined += 1
        return hits

    def allocated(self, request, block_ids, num_external_tokens: int) -> None:
        """vLLM allocated ``block_ids`` (all of the request's blocks, one list per KV cache group) after a
        hit of ``num_external_tokens``."""
        st = self._state(request)
        if num_external_tokens <= 0:
            return
        if self._parts is not None:
            self._allocated_parts(st, block_ids, num_external_tokens)
            return
        c0, whole, local = st.lookup
        end_blocks = (local + num_external_tokens) // self.bs
        n = min(whole, end_blocks // self.k - c0)
        tables = self._tables(block_ids)
        gpu = self._load_ids(tables, c0, n, local)
        keys = st.hit_keys[:n]
        tail = st.hit_tail if n == whole and end_blocks >= (c0 + n) * self.k + st.hit_tail else 0
        if tail:  # the piece's m blocks, then -1 for the rest of its slot
            base = (c0 + n) * self.k
            piece = tables[0][base:base + tail]
            skip = local // self.bs - base
            if skip > 0:
                piece[:skip] = [-1] * skip
            gpu = gpu + piece + [-1] * (self.k - tail)
            keys.append(st.hit_keys[n])
            self.counters.tail_hits += 1
        items = n + (1 if tail else 0)
        hid = next(self._handle_ids)
        self._gets[hid] = gpu
        got, jobs = self.chain.get(keys, hid)
        rid = request.request_id
        if got < items:  # a chunk vanished since the lookup: report its blocks, vLLM recomputes from there
            lost = [g for g in gpu[got * self.w:] if g >= 0]
            if st.sync:
                self._sync_fail.extend(lost)
            else:
                self._load_fail[rid] = lost
            self.counters.failed_load_blocks += len(lost)
        loads = self._plan_loads(st, jobs, num_external_tokens)
        chunk = self.chunk
        for j in loads:
            tokens = 0
            for i in j.dst_slots:
                start = (c0 + i) * chunk
                end = start + (chunk if i < n else tail * self.bs)
                part = end - max(start, min(local, end))
                tokens += part
                if i >= n:
                    self.counters.hit_tokens_tail += part
            if j.src_tier == CPU:
                self.counters.hit_tokens_cpu += tokens
            else:
                self.counters.hit_tokens_disk += tokens
        st.stored = max(st.stored, c0 + min(got, n))
        self._refresh(st)
        self._route_loads(rid, jobs)

    def _allocated_parts(self, st: _Req, block_ids, num_external_tokens: int) -> None:
        """``allocated`` for hybrid models: load the parts the last match found, every one a ready CPU copy."""
        c0, _, local = st.lookup
        hit, rid = st.parts, st.request.request_id
        if local + num_external_tokens != hit.end * self.chunk:
            raise RuntimeError(f"TieredKVConnector: vLLM allocated {num_external_tokens} external tokens for request "
                               f"{rid} after {local} local ones, but the hit over parts ends at token "
                               f"{hit.end * self.chunk}; this vLLM version schedules hybrid hits differently")
        gpu = self._parts.load_ids(self._tables(block_ids), hit, c0, local)
        hid = next(self._handle_ids)
        self._gets[hid] = gpu
        got, jobs = self.chain.get(hit.keys, hid)
        if got < len(hit.keys):  # vLLM calls match and this back to back: cannot happen
            raise RuntimeError(f"TieredKVConnector: {len(hit.keys) - got} part(s) of request {rid} vanished between "
                               f"the lookup and the load; with several KV cache groups vLLM takes no block errors")
        self._plan_loads(st, jobs, num_external_tokens)
        self.counters.hit_tokens_cpu += num_external_tokens  # several groups load only from the CPU tier
        st.stored = max(st.stored, hit.end)
        st.parts = None
        st.owned += hit.keys
        self._refresh(st)
        self._route_loads(rid, jobs)

    def _refresh(self, st: _Req) -> None:
        """Order the request's prefix in the CPU tier's eviction policy deepest first (its first chunk the most
        recently used): a full tier then evicts the least recently used prefix from its end, so it still
        hits what is left. (In chunk order, eviction took each prefix's first chunk, which makes the rest
        useless, and the next recompute evicted the next prefix's first chunk: under a cyclic workload
        every lookup missed.)"""
        keys = st.owned if self._parts is not None else st.keys[:st.stored]
        if keys:
            self.chain.touch(reversed(keys))

    def _plan_loads(self, st: _Req, jobs: list[TransferJob], tokens: int) -> list[TransferJob]:
        """Hand a hit's load jobs to this step (in-step) or to the request's asynchronous loads; returns them."""
        loads = [j for j in jobs if j.kind is JobKind.EGRESS]
        if st.sync:
            # matched in this same schedule() call, so every chunk is still a READY CPU copy: one
            # EGRESS job from the CPU tier, which the workers run before/alongside this step's forward
            self._sync.extend(j.job_id for j in loads)
            self.counters.sync_loads += len(loads)
            st.sync = False
            if self._budget is not None:
                self._budget.charge(self.geo.hit_nbytes(tokens))
        else:
            self._loads.setdefault(st.request.request_id, []).extend(j.job_id for j in loads)
            if self._budget is not None:
                self._async_cpu_loads.update(j.job_id for j in loads if j.src_tier == CPU)
        self.counters.load_jobs += len(loads)
        return loads

    def _route_loads(self, rid: str, jobs: list[TransferJob]) -> None:
        self._routing_req = rid  # the loads write blocks this request holds
        try:
            self._route(jobs)
        finally:
            self._routing_req = None
        self._drain_finished()

    # ------------------------------------------------------------------ per step
    def build(self, scheduler_output) -> StepPlan:
        """Plan this step: track block tables, plan stores, add fences, hand out all pending jobs."""
        self._step += 1
        step = self._step
        if self._budget is not None:
            total = scheduler_output.total_num_scheduled_tokens
            # more tokens than requests: some request prefills (or verifies speculative tokens) in this step
            self._budget.next_step(total > 0, total > len(scheduler_output.num_scheduled_tokens))
        if self._presence is not None and self._presence.pending():
            self.sync_remote()
        fences: set[int] = set()
        keys_out: list[bytes] = []
        gpu_out: list[int] = []
        tails = self.counters.tail_stores  # a tail piece adds -1 ids to gpu_out (one group: the only way)
        eager = self.cfg.store_policy == "eager"
        scheduled = scheduler_output.num_scheduled_tokens
        # Stores planned in an earlier step (waiting for room, granted since, or planned at a
        # request's finish) are checked against re-allocations: record those only while any exist.
        self._watching = bool(self._stores or self._finish_puts or self.chain.waiting())
        storing = self._storing if eager else {}
        cached = scheduler_output.scheduled_cached_reqs
        single = self._single
        preempted = scheduler_output.preempted_req_ids  # a set, or None (vLLM 0.26 and 0.32 alike)
        if preempted and self._req_jobs:  # their blocks may be re-allocated in this very step
            for rid in preempted:
                self._release(rid)
        writers: list[str] = []  # requests whose blocks this step's store reads
        # One group: a block allocation matters only to re-allocation dates (while watching) and to published
        # in-flight jobs (fences); with neither, decode steps skip the scan of every running request's new blocks.
        # With either, every block handed out this step is checked in one call (a set of fences, one date each).
        if single and (self._watching or self._published):
            gi = self._groups[0].index
            fresh: list[int] = []
            for new in scheduler_output.scheduled_new_reqs:
                fresh += new.block_ids[gi]
            for new_ids in filter(None, cached.new_block_ids):  # None: no new block (most requests, most steps)
                fresh += new_ids[gi]
            if fresh:
                self._allocated_now({gi: fresh}, step, fences)
        elif not single:  # first every block handed out this step: stale table entries go before a store reads them
            for new in scheduler_output.scheduled_new_reqs:
                self._allocated_now(new.block_ids, step, fences)
            for new_ids in cached.new_block_ids:
                if new_ids is not None:
                    self._allocated_now(new_ids, step, fences)
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None or not eager:
                continue
            self._set_tables(st, self._tables(new.block_ids))
            storing[new.req_id] = st
            end = new.num_computed_tokens + scheduled.get(new.req_id, 0)
            before = len(keys_out)
            self._plan_store(st, end, keys_out, gpu_out)
            if len(keys_out) > before:
                writers.append(new.req_id)
        # Decode steps list every running request: visit only those with chunks still to store (prompt-only stores
        # finish with the prefill), in the step's order, found by a C-speed search of the step's list for each.
        todo: list[tuple[int, str]] = []
        if storing and cached.req_ids:
            req_ids = cached.req_ids
            for rid in storing:
                if rid in req_ids:
                    todo.append((req_ids.index(rid), rid))
            todo.sort()
        resumed = _resumed_ids(cached) if todo else ()
        for i, rid in todo:
            st = storing[rid]
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if rid in resumed:
                    self._set_tables(st, self._tables(new_ids))
                else:
                    self._extend_tables(st, new_ids)
            before = len(keys_out)
            self._plan_store(st, cached.num_computed_tokens[i] + scheduled.get(rid, 0), keys_out, gpu_out)
            if len(keys_out) > before:
                writers.append(rid)
        self._put(keys_out, gpu_out, step, writers, not single or self.counters.tail_stores != tails)
        if self._finish_puts:  # planned when their requests finished, i.e. in an earlier step
            first = min(s for _, _, s in self._finish_puts)
            self._put([k for ks, _, _ in self._finish_puts for k in ks],
                      [g for _, gs, _ in self._finish_puts for g in gs], first)
            self._finish_puts = []
        stores = self._valid_stores()
        self._drain_finished()
        self.counters.fences += len(fences)
        ext = {j.job_id: self._ext.pop(j.job_id) for j in stores}
        if self._early:
            ext.update((j.job_id, self._ext.pop(j.job_id)) for j in self._early if j.job_id in self._ext)
        plan = StepPlan(step, self._early, stores, ext, sorted(fences), self._loads, self._load_fail, self._sync,
                        self._sync_fail)
        if (plan.early or plan.stores or plan.fences) and log.isEnabledFor(logging.DEBUG):
            log.debug("step %d: %d early jobs, %d store jobs (%d keys), %d fences, %d in flight", step,
                      len(plan.early), len(stores), sum(len(j) for j in stores), len(plan.fences),
                      self.chain.inflight())
        self._early, self._loads, self._load_fail, self._sync, self._sync_fail = [], {}, {}, [], []
        return plan

    def _put(self, keys: list[bytes], gpu: list[int], step: int, reqs: Sequence[str] = (), holes: bool = True) -> None:
        """Plan storing ``keys`` from ``gpu`` (``holes``: it may hold -1); both lists are kept, not copied."""
        if not keys:
            return
        hid = next(self._handle_ids)
        self._puts[hid] = _Put(gpu, step, reqs, holes)
        self.counters.store_chunks += len(keys)
        self._route(self.chain.put(keys, hid))

    def _allocated_now(self, block_ids, step: int, fences: set[int]) -> None:
        """Blocks vLLM (re-)allocated this step, one list per KV cache group: fence in-flight jobs on them,
        and zero the stale entries sliding-window tables still hold for them."""
        for g in self._groups:
            ids = block_ids[g.index]
            if not ids:
                continue
            if self._watching:  # only stores planned in an earlier step need re-allocation dates
                self._alloc_step.update(dict.fromkeys(ids, step))
            if self._published:  # rare: jobs usually end before the requests holding their blocks let go
                hit = self._busy_jobs(ids)
                if hit:
                    fences.update(hit)
                    self._fenced_jobs.update(hit)
            owner = self._owner
            if owner and not owner.keys().isdisjoint(ids):
                for b in ids:
                    o = owner.pop(b, None)
                    if o is not None and o[0].tables[o[1]][o[2]] == b:
                        o[0].tables[o[1]][o[2]] = 0  # vLLM freed it from that request and handed it on
                        self.counters.stale_blocks_dropped += 1

    def _set_tables(self, st: _Req, tables: list[list[int]]) -> None:
        if not self._swa:  # no sliding window: no block owners to keep
            st.tables = tables
            return
        self._disown(st)
        st.tables = tables
        self._own(st, [0] * len(tables))

    def _extend_tables(self, st: _Req, block_ids) -> None:
        if self._single:
            st.tables[0].extend(block_ids[self._groups[0].index])
            return
        starts = [len(t) for t in st.tables]
        for t, g in zip(st.tables, self._groups):
            t.extend(block_ids[g.index])
        self._own(st, starts)

    def _own(self, st: _Req, starts: list[int]) -> None:
        """Remember which request holds each sliding-window block not stored yet (see ``_allocated_now``)."""
        for gi in self._swa:
            table, k = st.tables[gi], self._groups[gi].chunk_blocks
            owner = self._owner
            for pos in range(max(starts[gi], st.stored * k), len(table)):
                b = table[pos]
                if b:
                    owner[b] = (st, gi, pos)

    def _disown(self, st: _Req) -> None:
        owner = self._owner
        if not owner:
            return
        for gi in self._swa:
            if gi < len(st.tables):
                for b in st.tables[gi]:
                    o = owner.get(b)
                    if o is not None and o[0] is st:
                        del owner[b]

    def _plan_store(self, st: _Req, computed: int, keys_out: list[bytes], gpu_out: list[int]) -> None:
        """Plan stores of the chunks ``st`` completed up to token ``computed`` (this step's end)."""
        req = st.request
        end = computed
        if not self.cfg.store_decode_tokens:
            computed = min(computed, req.num_prompt_tokens)
        if self._single:
            block_ids = st.tables[0]
            blocks = min(computed // self.bs, len(req.block_hashes), len(block_ids))
            n = blocks // self.k
            if n > st.stored:
                keys = self._chunk_keys(st, n)
                keys_out.extend(keys[st.stored:n])
                gpu_out.extend(block_ids[st.stored * self.k:n * self.k])
                if self._event_meta is not None:
                    self._remember(st, st.stored, n)
                st.stored = n
            if self._tails and not st.tail_done and end >= req.num_prompt_tokens and st.stored == n:
                st.tail_done = True  # the prefill is complete: its full blocks after the last whole chunk
                self._offer_tail(req, block_ids, blocks, keys_out, gpu_out)
                if st.seen_tail is not None:
                    self._drop_superseded_tail(st, blocks)
            if st.seen_tail is not None:
                self._drop_superseded_tail(st, st.stored * self.k)
        else:
            chunk = self.chunk
            n = min(computed // chunk, len(req.block_hashes) // self._hashes_per_chunk,
                    *(len(t) // g.chunk_blocks for t, g in zip(st.tables, self._groups)))
            if n > st.stored:
                keys = self._chunk_keys(st, n)
                for c in range(st.stored, n):
                    self._offer(st, c, keys[c], end == (c + 1) * chunk, keys_out, gpu_out)
                st.stored = n
        if not self.cfg.store_decode_tokens and st.stored >= req.num_prompt_tokens // self.chunk and \
                (st.tail_done or not self._tails):
            if self._storing.pop(req.request_id, None) is not None:  # every prompt chunk offered
                self._disown(st)

    def _drop_superseded_tail(self, st: _Req, stored_blocks: int) -> None:
        """Drop the older tail piece ``st``'s lookup found once ``st`` stored blocks past its end (a whole
        chunk over it, or a longer tail piece); a tail piece of the same length is the same key, kept."""
        key, end = st.seen_tail
        if stored_blocks > end:
            st.seen_tail = None
            if self._event_meta is not None:
                # no KV event retracts it: the chunk or piece that covers it holds the same block hashes
                self._event_meta.pop(key, None)
            if key in self.chain.index:
                self.counters.tails_superseded += 1
                self._route(self.chain.delete([key]))

    def _offer_tail(self, req, block_ids: list[int], blocks: int, keys_out: list[bytes], gpu_out: list[int]) -> None:
        """Add the tail piece (the ``blocks`` leading blocks past the last whole chunk) to a store, if any."""
        k = self.k
        base = blocks - blocks % k
        m = blocks - base
        if not m:
            return
        hashes = req.block_hashes
        key = self._tail_prefix + hashes[blocks - 1]
        keys_out.append(key)
        gpu_out.extend(block_ids[base:blocks])
        gpu_out.extend([-1] * (k - m))
        self.counters.tail_stores += 1
        if self._event_meta is not None:  # a KV event names the piece's blocks like a chunk's
            bs = self.bs
            self._event_meta[key] = (list(hashes[base:blocks]), hashes[base - 1] if base else None,
                                     list(req.all_token_ids[base * bs:blocks * bs]),
                                     req.lora_request.lora_int_id if req.lora_request is not None else None)

    def _offer(self, st: _Req, c: int, key: bytes, state_at_end: bool, keys_out: list[bytes],
               gpu_out: list[int], tables: list[list[int]] | None = None) -> None:
        """Several groups: add chunk c's parts to a store (``PartPlanner.store`` says which); none when a
        full-attention block of it is gone already."""
        req = st.request
        final = self._parts.final_boundaries(req.num_prompt_tokens, self.cfg.store_decode_tokens)
        parts = self._parts.store(req.block_hashes, c, key, tables or st.tables, state_at_end, final)
        if parts is None:
            if key not in self.chain.index:
                self.counters.chunks_not_storable += 1
            return
        for part_key, ids in parts:
            keys_out.append(part_key)
            gpu_out.extend(ids)
            st.owned.append(part_key)
        if self._event_meta is not None and any(k is key for k, _ in parts):
            self._remember(st, c, c + 1, key)  # the chunk's event rides on its main part

    def _valid_stores(self) -> list[TransferJob]:
        """Stores whose GPU source blocks were not re-allocated since planned; the rest fail now."""
        out: list[TransferJob] = []
        alloc = self._alloc_step
        while self._stores:  # failing a store can grant a waiting one: loop until none is left
            job = self._stores.pop()
            put = self._puts.get(job.handle)
            ids = self._ext[job.job_id]
            # a store planned in this step reads blocks computed in this step: valid by construction
            if put is not None and (put.step == self._step or all(alloc.get(g, 0) <= put.step for g in ids)):
                # planned in this step: its requests still hold the blocks; later: they may have let go since
                self._track(job.job_id, ids if self._single and not put.holes else [g for g in ids if g >= 0],
                            put.reqs if put.step == self._step else ())
                out.append(job)
                continue
            self.counters.stores_dropped_reused += len(job)
            self._ext.pop(job.job_id, None)
            self._route(self.chain.complete(Completion.failed(job, "GPU block re-allocated before the store")))
        return out

    # ------------------------------------------------------------------ routing
    def _route(self, jobs: Iterable[TransferJob]) -> None:
        """Record each job's GPU side (per item, from its handle) and queue it for the next plan."""
        for job in jobs:
            if job.kind is JobKind.INGRESS:
                self._ext[job.job_id] = self._items(self._puts[job.handle].gpu, job.src_slots)
                self._stores.append(job)
            elif job.kind is JobKind.EGRESS:
                ext = self._ext[job.job_id] = self._items(self._gets[job.handle], job.dst_slots)
                rid = self._routing_req
                self._track(job.job_id, [g for g in ext if g >= 0], (rid,) if rid is not None else ())
                self._early.append(job)
            else:
                self._early.append(job)

    def _items(self, gpu: list[int], items: list[int]) -> list[int]:
        """The flat GPU ids of ``items`` (indices into a handle's keys), in item order."""
        k = self.w
        if items and len(items) * k == len(gpu) and items[0] == 0 and items[-1] == len(items) - 1:
            return gpu  # the whole handle in order: the common case, no copy
        out: list[int] = []
        for i in items:
            out.extend(gpu[i * k:(i + 1) * k])
        return out

    def _track(self, job_id: int, gpu_ids: list[int], reqs: Sequence[str] = ()) -> None:
        """Remember that ``job_id`` touches ``gpu_ids``, which ``reqs`` hold (() or several groups: publish
        them to ``_gpu_busy`` now; else when one of ``reqs`` finishes or is preempted, see ``_release``)."""
        self._job_gpu[job_id] = gpu_ids
        if self._lazy_busy and reqs:
            req_jobs = self._req_jobs
            for rid in reqs:
                jobs = req_jobs.get(rid)
                if jobs is None:
                    req_jobs[rid] = [job_id]
                else:
                    jobs.append(job_id)
        else:
            self._publish(job_id, gpu_ids)

    def _publish(self, job_id: int, gpu_ids: list[int]) -> None:
        """Put ``gpu_ids`` in ``_gpu_busy`` under ``job_id`` (the newest job wins: an older job on a block was
        fenced when vLLM re-allocated that block, which is the only way a block gets a new job)."""
        busy = self._gpu_busy
        try:
            for g in gpu_ids:
                busy[g] = job_id
        except IndexError:  # a block id past the list: grow it to the largest one and store them all
            self._cover(gpu_ids)
            for g in gpu_ids:
                busy[g] = job_id
        self._published.add(job_id)

    def _cover(self, ids: list[int]) -> None:
        """Grow ``_gpu_busy`` (0: no job) so that every block id in ``ids`` indexes it, to twice that: vLLM hands
        out fresh block ids in rising order, and each miss costs an exception and a second look."""
        busy = self._gpu_busy
        busy.extend([0] * (2 * (max(ids) + 1) - len(busy)))

    def _busy_jobs(self, ids: list[int]) -> set[int]:
        """The published in-flight jobs touching any of the GPU blocks ``ids``."""
        busy = self._gpu_busy
        try:
            jobs = itemgetter(*ids)(busy) if len(ids) > 1 else (busy[ids[0]],)
        except IndexError:  # an id past every published block (not busy): grow the list to cover it, look again
            self._cover(ids)
            jobs = itemgetter(*ids)(busy) if len(ids) > 1 else (busy[ids[0]],)
        if jobs.count(0) == len(jobs):  # none busy (the usual answer): no set to build
            return set()
        hit = set(jobs)
        hit.discard(0)
        return hit

    def _release(self, rid: str) -> None:
        """Request ``rid`` let its blocks go (finished, aborted, preempted): publish its in-flight jobs' blocks,
        so a re-allocation of any of them fences the job."""
        jobs = self._req_jobs.pop(rid, None)
        if jobs:
            job_gpu, published = self._job_gpu, self._published
            for job_id in jobs:
                ids = job_gpu.get(job_id)
                if ids is not None and job_id not in published:
                    self._publish(job_id, ids)

    def _untrack(self, job_id: int) -> None:
        ids = self._job_gpu.pop(job_id, ())
        if job_id in self._published:
            self._published.discard(job_id)
            busy = self._gpu_busy
            for g in ids:
                if busy[g] == job_id:
                    busy[g] = 0

    def _drain_finished(self) -> None:
        for hid, _ in self.chain.take_finished():
            self._puts.pop(hid, None)
            self._gets.pop(hid, None)
            st = self._promotions.pop(hid, None)
            if st is not None:  # its next match takes what the CPU tier holds now
                st.promoting = 0
                st.promoted = True

    # ------------------------------------------------------------------ completions
    def apply_reports(self, reports: dict[int, JobReport]) -> None:
        """Fold in worker reports; a job completes once all TP ranks reported it."""
        tp = self.geo.tp_size
        for job_id, rep in reports.items():
            acc = self._reports.get(job_id)
            if acc is None:
                acc = self._reports[job_id] = JobReport(0, list(rep.ok), list(rep.corrupt),
                                                        missing=[False] * len(rep.ok) if rep.missing else [])
            acc.merge(rep)
            if acc.count < tp:
                continue
            del self._reports[job_id]
            self._complete(job_id, acc)
        self._drain_finished()

    def _complete(self, job_id: int, rep: JobReport) -> None:
        job = self.chain.job(job_id)  # every job the chain plans is routed here, and leaves it only completed
        if job is None:
            log.warning("TieredKVConnector: report for unknown job %d ignored", job_id)
            return
        if self._remote_known and (any(rep.missing) or any(rep.corrupt)) and job.src_tier == self.remote:
            # gone from Redis: never adopt it again
            self._remote_known.difference_update(
                k for k, m, c in zip(job.keys, rep.missing or [False] * len(job), rep.corrupt) if m or c)
        unreadable = self._unreadable_remote(job, rep)
        kind, src = job.kind, job.src_tier
        fenced = job_id in self._fenced_jobs
        self._fenced_jobs.discard(job_id)
        self._untrack(job_id)
        if kind is JobKind.EGRESS:
            self.counters.bytes_loaded += rep.nbytes
            if self._async_cpu_loads and job_id in self._async_cpu_loads:
                self._async_cpu_loads.discard(job_id)
                if all(rep.ok):  # the ranks loaded in parallel: per-rank bytes over the slowest rank's time
                    self._budget.observe(rep.nbytes // max(1, rep.count), rep.seconds)
            if src == DISK:
                self._gate.observe(rep.nbytes, rep.seconds)  # ranks read their shares in parallel
        elif kind is JobKind.INGRESS:
            self.counters.bytes_stored += rep.nbytes
        if not all(rep.ok) and kind is JobKind.INGRESS and fenced:
            log.debug("store job %d dropped %d of %d chunks: vLLM re-allocated its blocks before the copy began",
                      job_id, len(rep.ok) - sum(rep.ok), len(rep.ok))
        elif not all(rep.ok):
            log.warning("TieredKVConnector: %s job %d: %d of %d items failed", kind.name, job_id,
                        len(rep.ok) - sum(rep.ok), len(rep.ok))
        else:
            log.debug("job %d (%s) done: %d items, %d bytes", job_id, kind.name, len(rep.ok), rep.nbytes)
        self._route(self.chain.complete(Completion(job_id, rep.ok, rep.corrupt, rep.nbytes, rep.seconds,
                                                   missing=rep.missing, evicted=rep.evicted)))
        if unreadable:
            self._route(self.chain.forget(self.remote, unreadable, unreadable=True))
        if kind is JobKind.INGRESS:  # the stored keys are the most recently used now: put the prefix back in order
            put = self._puts.get(job.handle)
            for rid in put.reqs if put is not None else ():
                st = self._reqs.get(rid)
                if st is not None:
                    self._refresh(st)

    def _unreadable_remote(self, job: TransferJob, rep: JobReport) -> list[bytes]:
        """Chunks a load from the remote tier could not read although Redis may still hold them (their node down
        or slow). vLLM recomputes them and would at once ask for the same load again, and again: forget those
        copies and their announcements, so the next lookup misses and the recompute stores the chunk anew."""
        if job.kind is not JobKind.EGRESS or job.src_tier != self.remote or all(rep.ok):
            return []
        n = len(job)
        gone = [m or c for m, c in zip(rep.missing or [False] * n, rep.corrupt or [False] * n)]
        keys = [k for k, ok, g in zip(job.keys, rep.ok, gone) if not (ok or g)]
        self._remote_known.difference_update(keys)
        return keys

    # ------------------------------------------------------------------ lifecycle
    def finished(self, request, block_ids) -> None:
        """A request finished (or was aborted): forget it; with ``on_finish`` stores, plan its chunks.

        ``block_ids``: one list per KV cache group, as vLLM frees them (0 where a sliding window
        or a Mamba group already let a block go).
        """
        st = self._reqs.pop(request.request_id, None)
        self._storing.pop(request.request_id, None)
        if self._req_jobs:
            self._release(request.request_id)
        if st is not None:
            self._disown(st)
        if st is None or self.cfg.store_policy != "on_finish":
            return
        computed = request.num_computed_tokens
        if not self.cfg.store_decode_tokens:
            computed = min(computed, request.num_prompt_tokens)
        tables = self._tables(block_ids)
        if self._single:
            ids = tables[0]
            blocks = min(computed // self.bs, len(request.block_hashes), len(ids))
            n = blocks // self.k
            keys = self._chunk_keys(st, n)[st.stored:n]
            gpu = ids[st.stored * self.k:n * self.k]
            if self._tails and not st.tail_done and st.stored <= n:
                self._offer_tail(request, ids, blocks, keys, gpu)
                if st.seen_tail is not None:
                    self._drop_superseded_tail(st, blocks)
        else:
            n = min(computed // self.chunk, len(request.block_hashes) // self._hashes_per_chunk,
                    *(len(t) // g.chunk_blocks for t, g in zip(tables, self._groups)))
            keys, gpu = [], []
            all_keys = self._chunk_keys(st, n)
            for c in range(st.stored, n):  # only chunks whose needed blocks are still held
                self._offer(st, c, all_keys[c], False, keys, gpu, tables)
        if keys and self._event_meta is not None and self._single:
            self._remember(st, st.stored, n)
        if keys:
            # vLLM frees the blocks now: the store stays valid only while they are not re-allocated
            # after this step, which _valid_stores checks
            self._finish_puts.append((keys, gpu, self._step))

    # ------------------------------------------------------------------ remote tier and KV events
    def sync_remote(self) -> None:
        """Take what the presence feed reported since the last call: chunks the fleet stored in the remote tier
        (remembered, adopted when a lookup reaches one) and removed (forgotten). Set work: the feed did the
        network I/O on its own thread."""
        stored, removed = self._presence.take()
        known = self._remote_known
        known.update(stored)
        if removed:
            known.difference_update(removed)
            self._route(self.chain.forget(self.remote, removed))
        self.counters.remote_announced += len(stored)

    def _adopt_remote(self, key: bytes) -> int | None:
        """Adopt one announced chunk as a copy in the remote tier; the fastest tier now holding it readable."""
        self.counters.remote_adopted += 1
        self._route(self.chain.adopt(self.remote, [key]))
        return self.chain.index.best(key)

    def enable_events(self) -> None:
        """Record what each chunk this engine stores names in vLLM's terms, for ``take_events``."""
        if self._event_meta is None:
            self._event_meta = {}
            self.chain.record_events()

    def _remember(self, st: _Req, c0: int, c1: int, key: bytes | None = None) -> None:
        """Event metadata of chunks ``[c0, c1)`` of ``st``: their block hashes, the parent hash, their tokens."""
        req, m, chunk = st.request, self._hashes_per_chunk, self.chunk
        hashes, tokens = req.block_hashes, req.all_token_ids
        keys = st.keys
        lora = req.lora_request.lora_int_id if req.lora_request is not None else None
        for c in range(c0, c1):
            self._event_meta[key if key is not None else keys[c]] = (
                list(hashes[c * m:(c + 1) * m]), hashes[c * m - 1] if c else None,
                list(tokens[c * chunk:(c + 1) * chunk]), lora)

    def take_events(self) -> list[tuple[bool, str, tuple]]:
        """``(stored, tier name, event metadata)`` for every chunk this engine stored that landed in or left a tier
        since the last call; metadata is dropped once no tier holds the chunk."""
        meta = self._event_meta
        if meta is None:
            return []
        out = []
        names = [s.name for s in self.chain.specs]
        index = self.chain.index
        for stored, t, key in self.chain.take_events():
            m = meta.get(key)
            if m is None:
                continue  # a chunk another engine stored (adopted from the remote tier): not ours to report
            out.append((stored, names[t], m))
            if not stored and key not in index:
                del meta[key]
        return out

    def has_pending_work_to_ship(self) -> bool:
        """True while planned jobs wait for the next plan (in-flight jobs do not count: no busy stepping)."""
        return bool(self._early or self._stores or self._finish_puts or self._loads)

    def store_stats(self) -> dict:
        """The planner's numbers in ``TieredStore.stats()``'s shape, for ``tiered_kv.store.metrics`` (Prometheus).

        Block counts are chunks; bytes are whole-engine (all TP ranks). Adds the load gate's ``report()``
        (``gate``); the remote tier's own error counters live in the workers (failed remote transfers show in
        ``tiers["remote"]``).
        """
        c, cc, nb = self.chain, self.chain.counters, self.geo.chunk_nbytes
        tiers = {}
        for i, spec in enumerate(c.specs):
            tc = c.tier_counters[i]
            tiers[spec.name] = {
                "hits": tc.hits, "blocks_in": tc.blocks_in, "blocks_out": tc.blocks_out,
                "bytes_in": tc.blocks_in * nb, "bytes_out": tc.blocks_out * nb, "evictions": tc.evictions,
                "failed_transfers": tc.failed_transfers, "corrupt_dropped": tc.corrupt_dropped,
                "refused": tc.refused, "resident_blocks": c.resident(i), "capacity_blocks": spec.capacity,
                "queue_depth": c.inflight(),
            }
        return {"lookups": cc.lookups, "hits": cc.hits, "misses": cc.misses, "puts_refused": cc.puts_refused,
                "bytes_in": self.counters.bytes_stored, "bytes_out": self.counters.bytes_loaded,
                "resident_bytes": sum(c.resident(i) for i in range(c.num_tiers)) * nb,
                "inflight_jobs": c.inflight(), "tiers": tiers, "transfers": c.transfers.snapshot(nb),
                "gate": self._gate.report()}

    def stats(self) -> dict:
        """Planner state for tests, logs and vLLM's connector stats (zero in flight when idle)."""
        c = self.chain
        out = {f"sched_{k}": v for k, v in vars(self.counters).items()}
        out.update({
            "inflight_jobs": c.inflight(), "pinned": c.pinned(), "waiting": c.waiting(),
            "gpu_blocks_busy": len(self._gpu_busy) - self._gpu_busy.count(0) + len(self._job_gpu),
            "tracked_requests": len(self._reqs) + len(self._storing) + len(self._req_jobs),
            "tracked_window_blocks": len(self._owner), "promotions_pending": len(self._promotions),
            "open_puts": len(self._puts), "open_gets": len(self._gets), "unshipped_ext": len(self._ext),
            "resident_cpu": c.resident(CPU),
            "resident_disk": c.resident(DISK) if c.num_tiers > 1 and c.specs[DISK].name == "disk" else 0,
            "resident_remote": c.resident(self.remote) if self.remote is not None else 0,
            "remote_known": len(self._remote_known),
            "disk_gbps_estimate": round(self._gate.gbps, 3),
        })
        if self._budget is not None:
            out.update(self._budget.stats())
        for i, tc in enumerate(c.tier_counters):
            name = c.specs[i].name
            out.update({f"{name}_{k}": v for k, v in vars(tc).items()})
        return out


def _resumed_ids(cached) -> set[str]:
    """Requests whose ``new_block_ids`` replace (not extend) their block table, in both vLLM versions."""
    resumed = getattr(cached, "resumed_req_ids", None)  # version probe, kept to this one function
    if resumed is not None:
        return resumed if isinstance(resumed, (set, frozenset)) else set(resumed)
    flags = getattr(cached, "resumed_from_preemption", None)  # older vLLM: one bool per cached request
    if flags is not None:
        return {rid for rid, f in zip(cached.req_ids, flags) if f}
    raise ConfigError("TieredKVConnector: this vLLM's CachedRequestData has neither resumed_req_ids nor "
                      "resumed_from_preemption; unsupported vLLM version")
