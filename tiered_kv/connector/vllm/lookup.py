"""Prefix lookups on the vLLM scheduler side: how many tokens beyond vLLM's own hit the tiers can load.

``LookupPlanner.match`` walks a request's chunk keys from the first chunk vLLM does not hold, the fastest tier
of each, until one misses (keys are made lazily: a miss at the first chunk stops the hashing too; past a held
first chunk the rest are named in one call, as stores would name them); a chunk the fleet announced in the remote
tier is adopted when the walk reaches it (``RemotePresence``). Then:

- n-1 rule: at least one prompt token is always left to compute; it caps the lookup itself, so a sliding
  window or a Mamba state is only ever taken at the boundary it was stored for;
- tail pieces (one full-attention or MLA group, or sliding windows and full attention): where the walk over
  whole chunks stopped, the tail keys of that chunk are probed, longest first (hybrids: ``PartPlanner.find``,
  every group's part of the piece and the windows before its end);
- the split (``planner.gate.SplitGate``, shared with SGLang's backend; built in ``prefill.py``): the held chunks
  as runs per tier (CPU, then disk, then remote, as the walk found them), after the tokens vLLM holds, before
  the request's tokens still to compute; CPU chunks load (unless the engine's in-step loading steps have a floor
  above the hit's recompute: ``SplitGate``'s load floor), a disk or remote run loads only while reading it is
  estimated faster than recomputing it (no overlap: per tier all or nothing). The plan waits on the request's
  state until vLLM allocates it (``LoadPlanner.allocated`` counts it), so a request vLLM asks about
  again is counted once;
- whether the load runs inside the step (every chunk in the CPU tier, or with ``disk_overlap_bytes`` CPU chunks
  then disk chunks read under the forward, at most the staging's room of them; at most ``sync_max_tokens``, and
  with ``load_mode`` adaptive within the step's budget, ``admission.py``) or between steps;
- hybrid models (``parts.PartPlanner``): the longest hit over parts; its disk parts are promoted to the CPU
  tier first (``match`` answers None, "ask again", while they move), because vLLM takes no per-block load
  errors with several KV cache groups. With ``hybrid_reseed`` a hit that runs alike with another conversation's
  over chunks vLLM does not hold (a shared system prompt whose window left the GPU) is answered "no hit", at most
  once per ``hybrid_reseed_interval_s``, so vLLM recomputes and caches that prefix for the rest (``reseed.py``).

Hybrid loads between steps (``load_mode: async``, or a hit above ``sync_max_tokens``): vLLM allocates such a hit's
blocks alone, admits it if the whole request fits the free blocks at that moment, and allocates the rest when the
load has landed. For one KV cache group the last request admitted can always go on, but with sliding-window groups
the rest needs more than that check counted (the window groups' blocks for every token of the next prefill chunk):
on vLLM's real Scheduler (a Gemma-3-like shape, 9 groups, 400 blocks, ten hits) five loads were admitted, each held
60 blocks and needed 144 more with 99 free, and no request ever ran again. So a hybrid model has at most one such
hit between its allocation and its first scheduled step; ``match`` answers None ("ask again next step") for the
next ones meanwhile (``async_hybrid_deferred``). Loads inside the step allocate the whole request at once and are
not held back.

What a match found stays on the request's ``RequestState`` (``lookup``, ``hit_keys``, ``hit_tail``,
``parts``, ``sync``, ``split``) for ``LoadPlanner.allocated``.

Threading contract: vLLM's scheduler thread only; no I/O, no torch.
"""
from __future__ import annotations

import logging
from itertools import groupby

from tiered_kv.planner.chain import TierChain
from tiered_kv.planner.gate import DECLINED, PROBE, RECOMPUTE, SPLIT, SplitGate
from tiered_kv.planner.split import MEMORY_TIERS
from tiered_kv.connector.vllm.admission import StepLoadBudget
from tiered_kv.connector.vllm.common import CPU
from tiered_kv.connector.vllm.config import ConnectorConfig
from tiered_kv.connector.vllm.geometry import Geometry
from tiered_kv.connector.vllm.parts import PartPlanner
from tiered_kv.connector.vllm.prefill import tier_names
from tiered_kv.connector.vllm.presence import RemotePresence
from tiered_kv.connector.vllm.reseed import SharedPrefixWatch
from tiered_kv.connector.vllm.routing import JobRouter
from tiered_kv.connector.vllm.state import PlannerCounters, RequestState, RequestTable

log = logging.getLogger(__name__)


class LookupPlanner:
    """``match``: the tokens a request can load from the tiers, and how (see the module)."""

    def __init__(self, cfg: ConnectorConfig, geo: Geometry, chain: TierChain, requests: RequestTable,
                 router: JobRouter, parts: PartPlanner | None, tails: bool, gate: SplitGate,
                 budget: StepLoadBudget | None, presence: RemotePresence | None, counters: PlannerCounters,
                 reseed: SharedPrefixWatch | None = None) -> None:
        self.cfg, self.geo = cfg, geo
        self.bs = geo.block_size
        self.k = geo.chunk_blocks
        self.chunk = geo.chunk_tokens
        self.chain = chain
        self._requests = requests
        self._chunk_keys = requests.chunk_keys
        self._router = router
        self._parts = parts
        self._tails = tails
        self._gate = gate
        self._tier_names = tier_names(chain)
        self._budget = budget
        self._presence = presence
        self._known: set[bytes] = presence.known if presence is not None else set()  # announced, not adopted
        self.counters = counters
        self._reseed = reseed  # hybrid models with sliding windows and ``hybrid_reseed`` (reseed.py)
        # chunks of the slow tiers an in-step load may read under the forward: with the gate planning the overlap
        # (``prefill.split_gate``: ``disk_overlap_bytes``), as many as the staging holds; else none (those load
        # between steps)
        self._overlap_tiers = frozenset(i for i, n in enumerate(self._tier_names) if n not in MEMORY_TIERS)
        self._overlap_chunks = cfg.disk_overlap_bytes // geo.rank_chunk_nbytes if gate.overlap else 0
        self._overlap_left = self._overlap_chunks  # staging rows the step being scheduled has not given out yet

    def match(self, request, num_computed_tokens: int) -> int | None:
        """Tokens beyond ``num_computed_tokens`` that can be loaded (0 if none; None: ask again next step)."""
        self.counters.lookups += 1
        presence = self._presence
        if presence is not None and presence.pending():
            presence.sync()  # what the fleet stored since the last step, before this lookup
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
        st = self._requests.state(request)
        st.sync = False
        st.hit_tail = 0
        if not (st.promoting or st.promoted):  # a hybrid hit's promotion keeps the plan that started it
            st.split = None
        if st.promoting:
            return None  # its disk chunks are still moving up to the CPU tier
        if self._parts is not None:
            tokens = self._match_parts(st, c0, usable, num_computed_tokens, avail // bs)
            waiting = self._requests.async_waiting
            if tokens and not st.sync and waiting and request.request_id not in waiting:
                self.counters.async_hybrid_deferred += 1  # the module's "Hybrid loads between steps"
                return None
            return tokens
        keys, where = self._walk(st, c0, usable)
        tail = 0
        if self._tails:
            tail = self._probe_tail(request, c0 + len(keys), avail // bs, num_computed_tokens // bs, keys, where)
            if tail:  # dropped once this request stores past it (each turn would otherwise leave one behind)
                st.seen_tail = (keys[-1], (c0 + len(keys) - 1) * self.k + tail)
        if not where:  # nothing held (a new prompt's usual answer): none of what follows could find a hit
            log.debug("match %s: computed %d, none of %d chunks held", request.request_id, num_computed_tokens, usable)
            return 0
        full = (keys, where, tail)
        overlap = self._overlap_left > 0  # the staging is per rank and per step: shared by this step's hits
        if overlap:  # read under the forward: no more disk chunks than the staging holds, none after
            keys, where, tail = self._overlap_cut(keys, where, tail)
        plan = self._plan_hit(st, where, tail, num_computed_tokens, c0, overlap)
        if plan is not None and overlap and not plan[3] and any(t != CPU for t in where[:plan[0]]):
            # the overlapped plan needs the in-step load this hit does not get (too big for sync_max_tokens, or the
            # step's load budget is spent): plan it again as a load between steps, all or nothing per tier
            keys, where, tail = full
            plan = self._plan_hit(st, where, tail, num_computed_tokens, c0, False)
        if plan is None:
            return 0
        n, tail, tokens, st.sync = plan
        if st.sync and overlap:
            self._overlap_left -= sum(1 for t in where[:n] if t in self._overlap_tiers)
        log.debug("match %s: computed %d, %d of %d chunks held %s, %d worth loading%s", request.request_id,
                  num_computed_tokens, len(where), usable, where[:4], n, " in-step" if st.sync else "")
        st.lookup = (c0, n - (1 if tail else 0), num_computed_tokens)
        st.hit_tail = tail
        st.hit_keys = keys[:n]
        return tokens

    def next_step(self) -> None:
        """The step being scheduled is complete (``build``): the next one has the whole staging again."""
        self._overlap_left = self._overlap_chunks

    def _plan_hit(self, st: RequestState, where: list[int], tail: int, computed: int, c0: int,
                  overlap: bool) -> tuple[int, int, int, bool] | None:
        """The split's plan for the held chunks ``where`` (a tail piece of ``tail`` blocks last): chunks to load,
        the tail kept, tokens to report, and whether the load runs inside the step (``overlap``: disk chunks may,
        read under the forward); None when nothing is worth loading."""
        n = self._worth_loading(st, where, tail, computed, c0, overlap)
        if tail and n < len(where):
            tail = 0  # the tail's tier was declined (or a chunk before it was)
        tokens = (c0 + n - (1 if tail else 0)) * self.chunk + tail * self.bs - computed
        if n == 0 or tokens // self.bs < self.cfg.min_hit_blocks:
            if n:
                st.split = None  # too small to load: not a plan vLLM takes
            return None
        sync = (self.cfg.load_mode != "async" and tokens <= self.cfg.sync_max_tokens
                and all(t == CPU or (overlap and t in self._overlap_tiers) for t in where[:n]))
        if sync and self._budget is not None:
            sync = self._budget.admit(self.geo.hit_nbytes(tokens))
        return n, tail, tokens, sync

    def _overlap_cut(self, keys: list[bytes], where: list[int], tail: int) -> tuple[list[bytes], list[int], int]:
        """A hit as far as an overlapped in-step load can take it: CPU chunks, then at most the staging rows this step
        has left of disk and remote chunks; the rest is left to recompute (it goes to the split as not held)."""
        room, n, slow = self._overlap_left, 0, self._overlap_tiers
        for t in where:
            if t != CPU and (t not in slow or room == 0):
                break
            room -= t in slow
            n += 1
        if n < len(where):
            return keys[:n], where[:n], 0  # a tail piece is the last entry: cut with the rest
        return keys, where, tail

    def _match_parts(self, st: RequestState, c0: int, usable: int, computed: int, avail_blocks: int) -> int | None:
        """``match`` for hybrid models: the longest hit over parts (with ``tail_chunks`` it may end with a tail
        piece), its disk parts promoted to the CPU tier first."""
        parts, hashes = self._parts, st.request.block_hashes

        def chunk_key(c: int) -> bytes:
            return self._chunk_keys(st, c + 1)[c]

        tails = (self._requests.tail_prefix, computed // self.bs, avail_blocks) if self._tails else None
        hit = parts.find(hashes, chunk_key, c0, usable, self._best, tails)
        if hit is not None:
            where = hit.chunk_tiers(c0)
            n = self._worth_loading(st, where, hit.tail, computed, c0)
            if n < len(where):  # disk chunks declined: a shorter hit needs its own window and state
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
        if self._reseed is not None and self._reseeds(st, c0, hit.end, chunk_key):
            st.split = None
            return 0
        tokens = hit.end * self.chunk + hit.tail * self.bs - computed
        if tokens // self.bs < self.cfg.min_hit_blocks:
            st.split = None
            return 0
        st.lookup = (c0, hit.end - c0, computed)
        st.hit_tail = hit.tail
        if hit.tail:  # dropped once this request stores past it, as with one group
            st.seen_tail = (hit.tail_key, hit.end * self.k + hit.tail)
        st.hit_keys = hit.keys
        st.parts = hit
        st.sync = self.cfg.load_mode != "async" and tokens <= self.cfg.sync_max_tokens
        if st.sync and self._budget is not None:
            st.sync = self._budget.admit(self.geo.hit_nbytes(tokens))
        return tokens

    def _reseeds(self, st: RequestState, c0: int, end: int, chunk_key) -> bool:
        """``hybrid_reseed``: whether this hit (chunks ``c0`` to ``end``, none of them in vLLM's own cache) shares its
        start with another conversation's and a reseed is due: then the request gets no hit and recomputes."""
        shared = self._reseed.branch([chunk_key(c) for c in range(c0, end)])
        if not shared or not self._reseed.due():
            return False
        self._reseed.fired()
        self.counters.hybrid_reseeds += 1
        log.info("TieredKVConnector: request %s recomputes its prompt: its first %d chunk(s) beyond vLLM's own hit "
                 "are shared with another conversation, and vLLM can cache them only from a recompute "
                 "(hybrid_reseed)", st.request.request_id, shared)
        return True

    def _best(self, key: bytes) -> int | None:
        """The fastest tier holding ``key``; a chunk the fleet announced is adopted here, when a lookup reaches it."""
        best = self.chain.index.best(key)
        known = self._known
        if best is None and known and key in known and key not in self.chain.index:
            best = self._presence.adopt(key)
        return best

    def _walk(self, st: RequestState, c0: int, usable: int) -> tuple[list[bytes], list[int]]:
        """Keys and fastest tiers of the leading run of held chunks from c0. Keys are made lazily: chunk c0 is named
        first (even with ``usable`` 0; stores name it anyway), a miss there (a new prompt's usual answer) stops the
        naming, and once it is held the other usable chunks are named in one call."""
        index = self.chain.index
        best_of, known, chunk_keys = index.best, self._known, self._chunk_keys
        keys: list[bytes] = []
        where: list[int] = []
        names = chunk_keys(st, c0 + 1)
        for c in range(c0, c0 + usable):
            key = names[c]
            best = best_of(key)
            if best is None and known and key in known and key not in index:  # the fleet stored it: adopt it
                best = self._presence.adopt(key)
            if best is None:
                break
            keys.append(key)
            where.append(best)
            if c == c0 and usable > 1:
                names = chunk_keys(st, c0 + usable)
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
        prefix = self._requests.tail_prefix
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

    def _promote(self, st: RequestState, keys: list[bytes]) -> None:
        """Start moving a hit's disk chunks up to the CPU tier; ``match`` answers "ask again" until done."""
        router = self._router
        hid = next(router.handle_ids)
        got, jobs = self.chain.prefetch(keys, CPU, hid)
        st.promoting = hid
        router.promotions[hid] = st
        self.counters.promotions += 1
        log.debug("request %s: promoting %d of %d chunks to the CPU tier before loading", st.request.request_id,
                  sum(1 for j in jobs if j.dst_tier == CPU), got)
        router.route(jobs)
        router.drain_finished()

    def _worth_loading(self, st: RequestState, where: list[int], tail: int, computed: int, c0: int,
                       overlap: bool = False) -> int:
        """Leading entries of ``where`` worth loading (the fastest tier of each held chunk from chunk ``c0``; with
        ``tail`` > 0 the last entry is a tail piece of that many blocks), after the ``computed`` tokens vLLM holds:
        the split's plan, kept on ``st`` until vLLM allocates the request (a hybrid hit's promotion keeps the plan
        that started it)."""
        chunk, names = self.chunk, self._tier_names
        runs = [[names[t], len(list(g)) * chunk] for t, g in groupby(where)]  # (tier, tokens) per run
        local = computed - c0 * chunk  # the first chunk's blocks vLLM holds: neither loaded nor computed
        runs[0][1] -= local
        if tail:  # a tail piece holds its blocks, not a whole chunk
            runs[-1][1] -= chunk - tail * self.bs
        held = sum(t for _, t in runs)
        in_step = self.cfg.load_mode != "async" and held <= self.cfg.sync_max_tokens  # the load floor is a step's
        split, outcome = self._gate.decide(runs, max(0, st.request.num_tokens - computed - held), computed,
                                           count=False, align=chunk if overlap else 0, offset=local,
                                           overlap=None if overlap else False, in_step=in_step)
        if st.split is None or not st.promoted:
            st.split = (split, outcome)
        if outcome == PROBE:  # a declined tier is read now and then, so its estimate follows it
            self.counters.disk_probes += 1
        elif outcome in (DECLINED, SPLIT):
            self.counters.disk_hits_declined += 1
        elif outcome == RECOMPUTE:  # loading steps measured slower than recomputing (an engine bound by its launch)
            self.counters.cpu_hits_recomputed += 1
        if split.load_tokens == held:
            return len(where)
        return (split.load_tokens + local) // chunk  # without overlap a plan ends at a run's end: a whole chunk's

    def load_async(self, request) -> bool:
        """Whether the hit the last ``match`` of ``request`` found loads between steps (else inside the step)."""
        st = self._requests.reqs.get(request.request_id)
        return st is None or not st.sync
