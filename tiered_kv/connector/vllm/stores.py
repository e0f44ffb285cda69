"""Store planning on the vLLM scheduler side: which newly computed chunks each step stores, from which GPU blocks.

``StorePlanner.plan_step`` runs once per step (``store_policy`` eager): for every request vLLM scheduled with
prompt chunks still to store, it follows the request's block tables (``BlockTracker``) and offers the chunks
this step completes; all of them become one ``TierChain.put`` (one store job when the tier has room), whose
items' GPU ids are the blocks holding them. With ``on_finish`` a request's chunks are planned when it
finishes (``on_finish``) and put in the next step, valid only while vLLM did not re-allocate their blocks.

- Tail pieces (``tail_chunks``, one full-attention or MLA group): once a prompt's prefill is complete, the
  full blocks after its last whole chunk are stored as one *tail* record (a chunk slot whose first ``m``
  blocks hold them; the job's other GPU ids are -1). An older turn's tail piece the request's lookup found
  is dropped once the request stored past it (a whole chunk over it, or a longer piece). Sliding-window
  hybrids (no Mamba) store a tail piece per group, like parts (``PartPlanner.store_tail``), none when a
  block a hit on it reads is gone already; a superseded one is dropped with all its parts.
- Hybrid models (``parts.PartPlanner``): each chunk's parts that later hits can use, none when a block a
  hit needs was already freed.
- KV events (``ChunkEvents``): what each stored chunk names in vLLM's terms, kept while a tier holds it.

Threading contract: vLLM's scheduler thread only; no I/O, no torch.
"""
from __future__ import annotations

from collections.abc import Sequence

from tiered_kv.errors import ConfigError
from tiered_kv.planner.chain import TierChain
from tiered_kv.connector.vllm.blocks import BlockTracker
from tiered_kv.connector.vllm.config import ConnectorConfig
from tiered_kv.connector.vllm.geometry import Geometry
from tiered_kv.connector.vllm.parts import PartPlanner
from tiered_kv.connector.vllm.routing import JobRouter, PlannedPut
from tiered_kv.connector.vllm.state import PlannerCounters, RequestState, RequestTable


class ChunkEvents:
    """What each chunk (or tail piece) this engine stores names in vLLM's terms: its block hashes, the hash
    before it, its tokens and LoRA id, from ``enable`` on (vLLM's KV events); off by default (no cost)."""

    def __init__(self, geo: Geometry, chain: TierChain) -> None:
        self.chain = chain
        self.bs = geo.block_size
        self.chunk = geo.chunk_tokens
        self._hashes_per_chunk = geo.chunk_tokens // geo.hash_block_size
        self.meta: dict[bytes, tuple] | None = None  # chunk key -> what a KV event names

    def enable(self) -> None:
        """Record from now on (the chain records which copies land in or leave a tier)."""
        if self.meta is None:
            self.meta = {}
            self.chain.record_events()

    def remember(self, st: RequestState, c0: int, c1: int, key: bytes | None = None) -> None:
        """Event metadata of chunks ``[c0, c1)`` of ``st``: their block hashes, the parent hash, their tokens."""
        req, m, chunk = st.request, self._hashes_per_chunk, self.chunk
        hashes, tokens = req.block_hashes, req.all_token_ids
        keys = st.keys
        lora = req.lora_request.lora_int_id if req.lora_request is not None else None
        for c in range(c0, c1):
            self.meta[key if key is not None else keys[c]] = (
                list(hashes[c * m:(c + 1) * m]), hashes[c * m - 1] if c else None,
                list(tokens[c * chunk:(c + 1) * chunk]), lora)

    def remember_tail(self, key: bytes, req, base: int, blocks: int) -> None:
        """Event metadata of a tail piece (blocks ``[base, blocks)``): named like a chunk's blocks."""
        hashes, bs = req.block_hashes, self.bs
        self.meta[key] = (list(hashes[base:blocks]), hashes[base - 1] if base else None,
                          list(req.all_token_ids[base * bs:blocks * bs]),
                          req.lora_request.lora_int_id if req.lora_request is not None else None)

    def take(self) -> list[tuple[bool, str, tuple]]:
        """``(stored, tier name, event metadata)`` for every chunk this engine stored that landed in or left a tier
        since the last call; metadata is dropped once no tier holds the chunk."""
        meta = self.meta
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


class StorePlanner:
    """Plans the stores of newly computed chunks, per step or at a request's finish (see the module)."""

    def __init__(self, cfg: ConnectorConfig, geo: Geometry, chain: TierChain, requests: RequestTable,
                 blocks: BlockTracker, router: JobRouter, parts: PartPlanner | None, tails: bool,
                 events: ChunkEvents, counters: PlannerCounters) -> None:
        self.cfg = cfg
        self.bs = geo.block_size
        self.k = geo.chunk_blocks
        self.chunk = geo.chunk_tokens
        self._hashes_per_chunk = geo.chunk_tokens // geo.hash_block_size
        self._groups = geo.groups
        self._single = not geo.parts
        self.chain = chain
        self._requests = requests
        self._chunk_keys = requests.chunk_keys
        self._tail_prefix = requests.tail_prefix
        self._blocks = blocks
        self._disown = blocks.disown
        self._router = router
        self._parts = parts
        self._tails = tails
        self._events = events
        self.counters = counters
        self.storing: dict[str, RequestState] = {}  # requests with prompt chunks still to store (eager)
        self.finish_puts: list[tuple[list[bytes], list[int], int]] = []  # planned at a finish, put next step

    def plan_step(self, scheduler_output, step: int) -> None:
        """Plan this step's stores: the chunks each scheduled request completes (eager), and the stores planned
        when requests finished since the last step."""
        keys_out: list[bytes] = []
        gpu_out: list[int] = []
        tails = self.counters.tail_stores  # a tail piece adds -1 ids to gpu_out (one group: the only way)
        eager = self.cfg.store_policy == "eager"
        scheduled = scheduler_output.num_scheduled_tokens
        storing = self.storing if eager else {}
        cached = scheduler_output.scheduled_cached_reqs
        blocks, reqs, tables = self._blocks, self._requests.reqs, self._requests.tables
        writers: list[str] = []  # requests whose blocks this step's store reads
        for new in scheduler_output.scheduled_new_reqs:
            st = reqs.get(new.req_id)
            if st is None or not eager:
                continue
            blocks.set_tables(st, tables(new.block_ids))
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
                    blocks.set_tables(st, tables(new_ids))
                else:
                    blocks.extend_tables(st, new_ids)
            before = len(keys_out)
            self._plan_store(st, cached.num_computed_tokens[i] + scheduled.get(rid, 0), keys_out, gpu_out)
            if len(keys_out) > before:
                writers.append(rid)
        self.put(keys_out, gpu_out, step, writers, not self._single or self.counters.tail_stores != tails)
        if self.finish_puts:  # planned when their requests finished, i.e. in an earlier step
            first = min(s for _, _, s in self.finish_puts)
            self.put([k for ks, _, _ in self.finish_puts for k in ks],
                     [g for _, gs, _ in self.finish_puts for g in gs], first)
            self.finish_puts = []

    def put(self, keys: list[bytes], gpu: list[int], step: int, reqs: Sequence[str] = (), holes: bool = True) -> None:
        """Plan storing ``keys`` from ``gpu`` (``holes``: it may hold -1); both lists are kept, not copied."""
        if not keys:
            return
        router = self._router
        hid = next(router.handle_ids)
        router.puts[hid] = PlannedPut(gpu, step, reqs, holes)
        self.counters.store_chunks += len(keys)
        router.route(self.chain.put(keys, hid))

    def _plan_store(self, st: RequestState, computed: int, keys_out: list[bytes], gpu_out: list[int]) -> None:
        """Plan stores of the chunks ``st`` completed up to token ``computed`` (this step's end)."""
        req = st.request
        end = computed
        if not self.cfg.store_decode_tokens:
            computed = min(computed, req.num_prompt_tokens)
        if self._single:
            block_ids = st.tables[0]
            n = min(computed // self.bs, len(req.block_hashes), len(block_ids)) // self.k
            if n > st.stored:
                keys = self._chunk_keys(st, n)
                keys_out.extend(keys[st.stored:n])
                gpu_out.extend(block_ids[st.stored * self.k:n * self.k])
                if self._events.meta is not None:
                    self._events.remember(st, st.stored, n)
                st.stored = n
        else:
            chunk = self.chunk
            n = min(computed // chunk, len(req.block_hashes) // self._hashes_per_chunk,
                    *(len(t) // g.chunk_blocks for t, g in zip(st.tables, self._groups)))
            if n > st.stored:
                keys = self._chunk_keys(st, n)
                for c in range(st.stored, n):
                    self._offer(st, c, keys[c], end == (c + 1) * chunk, keys_out, gpu_out)
                st.stored = n
        if self._tails and not st.tail_done and end >= req.num_prompt_tokens and st.stored == n:
            st.tail_done = True  # the prefill is complete: its full blocks after the last whole chunk
            blocks = self._offer_tail(st, st.tables, computed, n, keys_out, gpu_out)
            if st.seen_tail is not None:
                self._drop_superseded_tail(st, blocks)
        if st.seen_tail is not None:
            self._drop_superseded_tail(st, st.stored * self.k)
        if not self.cfg.store_decode_tokens and st.stored >= req.num_prompt_tokens // self.chunk and \
                (st.tail_done or not self._tails):
            if self.storing.pop(req.request_id, None) is not None:  # every prompt chunk offered
                self._disown(st)

    def _drop_superseded_tail(self, st: RequestState, stored_blocks: int) -> None:
        """Drop the older tail piece ``st``'s lookup found once ``st`` stored blocks past its end (a whole
        chunk over it, or a longer tail piece); a tail piece of the same length is the same key, kept."""
        key, end = st.seen_tail
        if stored_blocks > end:
            st.seen_tail = None
            if self._events.meta is not None:
                # no KV event retracts it: the chunk or piece that covers it holds the same block hashes
                self._events.meta.pop(key, None)
            keys = [key] if self._single else self._parts.tail_part_keys(key)
            if key in self.chain.index:
                self.counters.tails_superseded += 1
                self._router.route(self.chain.delete(keys))
            if not self._single:  # no longer part of its prefix's eviction order
                gone = set(keys)
                st.owned = [k for k in st.owned if k not in gone]

    def _offer_tail(self, st: RequestState, tables: Sequence[Sequence[int]], computed: int, n: int,
                    keys_out: list[bytes], gpu_out: list[int]) -> int:
        """Add the tail piece after the ``n`` whole chunks (the full blocks of ``computed`` tokens) to a store, if
        any: one record (one group: its blocks, then -1 for the rest of the slot), or each group's part (several;
        none when a block a hit on it reads is gone already). Returns the blocks stored up to its end (``n``
        chunks' without one)."""
        req = st.request
        k, base = self.k, n * self.k
        blocks = min(computed // self.bs, len(req.block_hashes), *(len(t) for t in tables))
        if blocks // k != n or not blocks % k:
            return base
        key = self._tail_prefix + req.block_hashes[blocks - 1]
        if self._single:
            keys_out.append(key)
            gpu_out.extend(tables[0][base:blocks])
            gpu_out.extend([-1] * (base + k - blocks))
        else:
            parts = self._parts.store_tail(key, tables, blocks)
            if parts is None:
                if key not in self.chain.index:
                    self.counters.chunks_not_storable += 1
                return base
            for part_key, ids in parts:
                keys_out.append(part_key)
                gpu_out.extend(ids)
                st.owned.append(part_key)
        self.counters.tail_stores += 1
        if self._events.meta is not None:  # a KV event names the piece's blocks like a chunk's (on its main part)
            self._events.remember_tail(key, req, base, blocks)
        return blocks

    def _offer(self, st: RequestState, c: int, key: bytes, state_at_end: bool, keys_out: list[bytes],
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
        if self._events.meta is not None and any(k is key for k, _ in parts):
            self._events.remember(st, c, c + 1, key)  # the chunk's event rides on its main part

    def on_finish(self, st: RequestState, request, block_ids, step: int) -> None:
        """``store_policy`` on_finish: plan the chunks of a request that finished (``block_ids``: one list per KV
        cache group, as vLLM frees them; 0 where a sliding window or a Mamba group already let a block go)."""
        computed = request.num_computed_tokens
        if not self.cfg.store_decode_tokens:
            computed = min(computed, request.num_prompt_tokens)
        tables = self._requests.tables(block_ids)
        if self._single:
            ids = tables[0]
            n = min(computed // self.bs, len(request.block_hashes), len(ids)) // self.k
            keys = self._chunk_keys(st, n)[st.stored:n]
            gpu = ids[st.stored * self.k:n * self.k]
        else:
            n = min(computed // self.chunk, len(request.block_hashes) // self._hashes_per_chunk,
                    *(len(t) // g.chunk_blocks for t, g in zip(tables, self._groups)))
            keys, gpu = [], []
            all_keys = self._chunk_keys(st, n)
            for c in range(st.stored, n):  # only chunks whose needed blocks are still held
                self._offer(st, c, all_keys[c], False, keys, gpu, tables)
        if self._tails and not st.tail_done and st.stored <= n:
            blocks = self._offer_tail(st, tables, computed, n, keys, gpu)
            if st.seen_tail is not None:
                self._drop_superseded_tail(st, blocks)
        if keys and self._events.meta is not None and self._single:
            self._events.remember(st, st.stored, n)
        if keys:
            # vLLM frees the blocks now: the store stays valid only while they are not re-allocated
            # after this step, which JobRouter.take_valid_stores checks
            self.finish_puts.append((keys, gpu, step))


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
