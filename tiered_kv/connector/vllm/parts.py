"""Hybrid models on the scheduler side: which parts of which chunks a hit reads and a store writes.

With several KV cache groups (sliding window + full attention, Mamba + attention; ``Geometry.parts``)
each group's share of a chunk is a record of its own, a *part*, so a tier spends its bytes on what a
later hit can use:

- a hit that ends at chunk boundary ``e`` (chunks ``[c0, e)`` loaded, vLLM holding those below ``c0``)
  reads every full-attention (or MLA) group's parts of ``[c0, e)``, each sliding-window group's parts
  of the chunks its window before ``e`` reaches, and each Mamba group's part of chunk ``e - 1`` (the
  recurrent state at the boundary);
- a store of chunk ``c`` writes every full-attention group's part; a sliding-window group's part only
  when ``c`` lies in the window before the request's last stored boundary (the end of its prompt's
  whole chunks, or one chunk earlier, where the n-1 rule puts a re-sent prompt's hit), or always with
  ``swa_store: all``; a Mamba group's part only where the state at ``c``'s end was kept.

So a conversation of P tokens costs full-attention layers x P plus sliding-window layers x the window,
and the next turn, whose prompt extends this one, hits at exactly that boundary. A prefix another
request shares only up to some earlier chunk is no hit for it (its window there was not kept) unless
``swa_store`` is ``all``.

Tail pieces (``tail_chunks``, sliding windows and full attention, no Mamba): a prompt's full blocks after
its last whole chunk ``e`` (``m`` of them, ending at block ``T = e*k + m``) are stored per group too, once
its prefill is complete: every full-attention group's ``m`` blocks, and each sliding-window group's of
those a hit ending at ``T`` reads (the window before ``T``; the window's blocks before chunk ``e`` are
the window parts kept for boundary ``e``). A hit ending at ``T`` reads every full-attention part below
``T`` and each window's blocks ``[T - window, T)``; ``find`` probes tails where the full-attention walk
stopped, longest first.

Keys: the *main* group's part (the first full-attention or MLA group; else the first group) is named
by the chunk's key, so chunk lookups, KV events and remote presence work as for one group; any other
group's part by the namespace key of the chunk's last block hash, ``b"|part"`` and the group's
position. A tail piece's main part is named by its tail key (``state.TAIL_MARK``), any other group's by
that key, ``b"|part"`` and the group's position (never 32 bytes long, so never a chunk's or a part's key).

Threading contract: vLLM's scheduler thread only (``SchedulerPlanner`` calls it); no I/O, no torch.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tiered_kv.connector.vllm.geometry import Geometry

#: the fastest tier holding a key, or None (the planner's lookup, which may adopt what the fleet stored)
Best = Callable[[bytes], "int | None"]


@dataclass(slots=True)
class PartHit:
    """A hit over parts: it ends at chunk boundary ``end``, or ``tail`` blocks after it with a tail piece;
    ``keys[i]`` is part ``items[i]`` = (chunk, group position), held fastest in tier ``tiers[i]``; items are in
    chunk order, groups in group order (a tail piece's parts are chunk ``end``'s)."""

    end: int
    keys: list[bytes]
    items: list[tuple[int, int]]
    tiers: list[int]
    tail: int = 0
    tail_key: bytes = b""  # the tail piece's key (its main part's), with ``tail``

    def chunk_tiers(self, c0: int) -> list[int]:
        """The slowest tier among each chunk's parts, for chunks ``[c0, end)``, then the tail piece's if any."""
        out = [0] * (self.end - c0 + (1 if self.tail else 0))
        for (c, _), t in zip(self.items, self.tiers):
            if t > out[c - c0]:
                out[c - c0] = t
        return out


class PartPlanner:
    """The per-group rules of a hybrid model's hits and stores (pure planning over one ``Geometry``)."""

    def __init__(self, geo: Geometry, key: Callable[[bytes], bytes], swa_store: str = "window") -> None:
        self.groups = geo.groups
        self.p = geo.part_blocks
        self.width = geo.slot_blocks  # GPU ids per item: p per group
        self.chunk = geo.chunk_tokens
        self.hashes_per_chunk = geo.chunk_tokens // geo.hash_block_size
        kinds = [g.kind for g in self.groups]
        self.full = [i for i, k in enumerate(kinds) if k in ("full", "mla")]
        self.main = self.full[0] if self.full else 0
        self.swa = [i for i, k in enumerate(kinds) if k == "swa"]
        self.mamba = [i for i, k in enumerate(kinds) if k == "mamba"]
        self.every_window = swa_store == "all"
        self._key = key
        self._suffix = [b"|part" + str(i).encode() for i in range(len(self.groups))]

    # ------------------------------------------------------------------ keys
    def part_key(self, hashes: Sequence[bytes], c: int, i: int, chunk_key: bytes) -> bytes:
        """Key of group position ``i``'s part of chunk ``c`` (``chunk_key``: the chunk's key, the main part's)."""
        if i == self.main:
            return chunk_key
        return self._key(bytes(hashes[(c + 1) * self.hashes_per_chunk - 1]) + self._suffix[i])

    # ------------------------------------------------------------------ hits
    def find(self, hashes: Sequence[bytes], chunk_key: Callable[[int], bytes], c0: int, usable: int,
             best: Best, tails: tuple[bytes, int, int] | None = None) -> PartHit | None:
        """The longest hit from chunk ``c0`` within ``usable`` chunks, or None.

        Full-attention parts must be held for every chunk; the end is then moved back until each
        sliding-window group holds its window before it and each Mamba group its state at it. A window
        part missing at chunk c rules out every end whose window reaches c, so the search jumps there.
        ``tails``: (tail key prefix, blocks vLLM holds, the last block the hit may end at): first the tail
        pieces of the chunk where the full-attention walk stopped are probed, longest first.
        """
        tiers: dict[tuple[int, int], int] = {}
        n = 0
        for c in range(c0, c0 + usable):
            ck = chunk_key(c)
            held = True
            for i in self.full:
                t = best(self.part_key(hashes, c, i, ck))
                if t is None:
                    held = False
                    break
                tiers[(c, i)] = t
            if not held:
                break
            n += 1
        if not self.full:
            n = usable  # no group reads every chunk: the windows and states alone decide
        e = c0 + n
        if tails is not None:
            hit = self._find_tail(hashes, chunk_key, c0, e, best, tiers, *tails)
            if hit is not None:
                return hit
        while e > c0:
            stop = self._boundary_misses(hashes, chunk_key, c0, e, best, tiers)
            if stop is None:
                return self._hit(hashes, chunk_key, c0, e, tiers)
            e = stop
        return None

    def _boundary_misses(self, hashes, chunk_key, c0: int, e: int, best: Best,
                         tiers: dict[tuple[int, int], int], tail: int = 0) -> int | None:
        """None when every window and state part of the chunks before ``e`` that a hit ending at ``e`` (and
        ``tail`` blocks of a tail piece after it) reads is held (their tiers go into ``tiers``); else the latest
        end that is still possible."""
        for i in self.mamba:
            t = best(self.part_key(hashes, e - 1, i, chunk_key(e - 1)))
            if t is None:
                return e - 1
            tiers[(e - 1, i)] = t
        for i in self.swa:
            lo = max(c0, self._window_start(i, e, tail))
            for c in range(e - 1, lo - 1, -1):  # the newest first: a miss there rules out the most ends
                t = best(self.part_key(hashes, c, i, chunk_key(c)))
                if t is None:
                    return c
                tiers[(c, i)] = t
        return None

    def _find_tail(self, hashes, chunk_key, c0: int, e: int, best: Best, tiers: dict[tuple[int, int], int],
                   prefix: bytes, local_blocks: int, last_block: int) -> PartHit | None:
        """The longest tail-piece hit in chunk ``e`` (where the full-attention walk from ``c0`` stopped), or None:
        every group's part of the piece and each window's parts before chunk ``e`` that a hit ending there reads
        must be held. A piece of ``m`` blocks ends at block ``e*k + m``: at most ``last_block`` (the n-1 rule) and
        past the ``local_blocks`` vLLM holds, or it would add nothing."""
        k = self.groups[self.main].chunk_blocks
        base = e * k
        hi = min(k - 1, last_block - base)
        lo = max(1, local_blocks - base + 1)
        for m in range(hi, lo - 1, -1):
            key = prefix + bytes(hashes[base + m - 1])
            found: dict[tuple[int, int], int] = {}
            for i in range(len(self.groups)):
                t = best(self.tail_part_key(key, i))
                if t is None:
                    break
                found[(e, i)] = t
            else:  # no Mamba group here (``SchedulerPlanner``: no tails with Mamba): the windows alone
                if self._boundary_misses(hashes, chunk_key, c0, e, best, found, m) is None:
                    tail_tiers = dict(tiers)
                    tail_tiers.update(found)
                    return self._hit(hashes, chunk_key, c0, e, tail_tiers, m, key)
        return None

    def _hit(self, hashes, chunk_key, c0: int, e: int, tiers: dict[tuple[int, int], int], tail: int = 0,
             tail_key: bytes = b"") -> PartHit:
        keys: list[bytes] = []
        items: list[tuple[int, int]] = []
        out_tiers: list[int] = []
        for c in range(c0, e):
            ck = chunk_key(c)
            for i, g in enumerate(self.groups):
                if self._read(g.kind, i, c, e, tail):
                    keys.append(self.part_key(hashes, c, i, ck))
                    items.append((c, i))
                    out_tiers.append(tiers[(c, i)])
        if tail:
            for i in range(len(self.groups)):
                keys.append(self.tail_part_key(tail_key, i))
                items.append((e, i))
                out_tiers.append(tiers[(e, i)])
        return PartHit(e, keys, items, out_tiers, tail, tail_key)

    def _read(self, kind: str, i: int, c: int, e: int, tail: int = 0) -> bool:
        """Whether a hit ending at ``e`` (and ``tail`` blocks of a tail piece after it) reads group position
        ``i``'s part of chunk ``c`` (``c < e``)."""
        if kind == "swa":
            return c >= self._window_start(i, e, tail)
        if kind == "mamba":
            return c == e - 1
        return True

    def _window_start(self, i: int, e: int, tail: int = 0) -> int:
        """The first chunk holding a block of sliding-window group position ``i``'s window before a hit's end
        (chunk boundary ``e``, then ``tail`` blocks); below 0 when the window reaches back past the first chunk."""
        g = self.groups[i]
        return (e * g.chunk_blocks + tail - g.window_blocks) // g.chunk_blocks

    def load_ids(self, tables: Sequence[Sequence[int]], hit: PartHit, c0: int, local: int) -> list[int]:
        """GPU ids a load of ``hit`` fills: ``width`` per item, the item's group's ``p`` ids in its section, -1
        elsewhere and for blocks vLLM did not allocate (null) or already holds (below ``local`` tokens).

        vLLM allocates for an external hit only what the hit reads (null blocks for a sliding window's
        older blocks, one state block for Mamba); a block allocated where the stored parts hold nothing
        would be computed on garbage, so it raises instead.
        """
        self._check_allocation(tables, c0, hit.end, local, hit.tail)
        p, width = self.p, self.width
        out: list[int] = []
        for c, i in hit.items:
            ids = [-1] * width
            g = self.groups[i]
            table = tables[i]
            base = i * p
            end = hit.end * g.chunk_blocks + hit.tail  # a tail piece's slot holds its first blocks only
            for j, pos in enumerate(self._positions(g.kind, g.chunk_blocks, c)):
                b = table[pos] if pos < len(table) else 0
                if b and (pos + 1) * g.block_size > local and pos < end:
                    ids[base + j] = b
            out += ids
        return out

    def _check_allocation(self, tables, c0: int, e: int, local: int, tail: int = 0) -> None:
        for i, g in enumerate(self.groups):
            if g.kind not in ("swa", "mamba"):
                continue
            k, bs, table = g.chunk_blocks, g.block_size, tables[i]
            end = e * k + tail  # the hit's end, in this group's blocks
            # the first block a hit ending there reads: the window's oldest block, or the state block
            first = end - g.window_blocks if g.kind == "swa" else end - 1
            for pos in range(c0 * k, min(first, len(table))):
                if table[pos] and (pos + 1) * bs > local:
                    raise RuntimeError(
                        f"TieredKVConnector: vLLM allocated block {table[pos]} of KV cache group {g.index} "
                        f"({g.kind}) at position {pos} for an external hit ending at token {end * bs}, "
                        f"where the stored parts hold nothing for it; this vLLM version allocates hits "
                        f"differently")

    @staticmethod
    def _positions(kind: str, k: int, c: int) -> range:
        """Block positions (in the group's table) that group's part of chunk ``c`` holds, in part order."""
        if kind == "mamba":
            return range((c + 1) * k - 1, (c + 1) * k)  # the state block at the chunk's end
        return range(c * k, (c + 1) * k)

    # ------------------------------------------------------------------ stores
    def store(self, hashes: Sequence[bytes], c: int, chunk_key: bytes, tables: Sequence[Sequence[int]],
              state_at_end: bool, final: tuple[int, int] | None) -> list[tuple[bytes, list[int]]] | None:
        """The parts of chunk ``c`` to store, ``(key, GPU ids)`` each (-1: a block to leave alone), or None
        when a full-attention block of it is gone (no hit could use the chunk).

        ``final``: the request's last stored boundary and the one the n-1 rule may move a re-sent prompt's
        hit to (sliding windows are kept before those); None stores every chunk's window parts.
        ``state_at_end``: a step ended at the chunk's end, so a Mamba state block holds the state there.
        """
        out: list[tuple[bytes, list[int]]] = []
        for i in self.full:
            g = self.groups[i]
            blocks = [tables[i][pos] for pos in self._positions(g.kind, g.chunk_blocks, c)]
            if not all(blocks):
                return None
            out.append((self.part_key(hashes, c, i, chunk_key), self._ids(i, blocks)))
        for i in self.swa:
            ids = self._window_part(tables[i], self.groups[i], c, final)
            if ids is not None:
                out.append((self.part_key(hashes, c, i, chunk_key), self._ids(i, ids)))
        if state_at_end:
            for i in self.mamba:
                g = self.groups[i]
                b = tables[i][(c + 1) * g.chunk_blocks - 1]
                if b:
                    out.append((self.part_key(hashes, c, i, chunk_key), self._ids(i, [b])))
        return out

    def _ids(self, i: int, blocks: list[int]) -> list[int]:
        p = self.p
        ids = [-1] * self.width
        ids[i * p:i * p + len(blocks)] = [b if b else -1 for b in blocks]
        return ids

    def _window_part(self, table: Sequence[int], g, c: int, final: tuple[int, int] | None) -> list[int] | None:
        """A sliding-window group's blocks of chunk c that a hit at a kept boundary reads (0 for the others), or
        None when the chunk is outside every kept window or such a block is gone already."""
        k = g.chunk_blocks
        if self.every_window or final is None:
            ends = [c + 1]  # any later boundary may be a hit's; the nearest reads the most of chunk c
        else:
            ends = [e for e in set(final) if e - g.window_chunks <= c < e]
            if not ends:
                return None
        first = min(e * k - g.window_blocks for e in ends)  # the oldest block any of those hits reads
        blocks = [table[pos] if pos >= first else 0 for pos in range(c * k, (c + 1) * k)]
        if any(not b for pos, b in zip(range(c * k, (c + 1) * k), blocks) if pos >= first):
            return None
        return blocks

    def tail_part_key(self, tail_key: bytes, i: int) -> bytes:
        """Key of group position ``i``'s part of the tail piece named ``tail_key`` (the main part's key)."""
        return tail_key if i == self.main else tail_key + self._suffix[i]

    def tail_part_keys(self, tail_key: bytes) -> list[bytes]:
        """Every group's part key of the tail piece named ``tail_key``, in group order."""
        return [self.tail_part_key(tail_key, i) for i in range(len(self.groups))]

    def store_tail(self, tail_key: bytes, tables: Sequence[Sequence[int]],
                   blocks: int) -> list[tuple[bytes, list[int]]] | None:
        """The parts of the tail piece that ends at block ``blocks`` (its full blocks after the last whole chunk),
        ``(key, GPU ids)`` each, or None when a block a hit ending there reads is gone already (0): every
        full-attention group's blocks of the piece, each sliding-window group's in the window before its end
        (-1 for the older ones, which no hit reads)."""
        out: list[tuple[bytes, list[int]]] = []
        for i, g in enumerate(self.groups):  # no Mamba group here (``SchedulerPlanner``: no tails with Mamba)
            table = tables[i]
            base = blocks - blocks % g.chunk_blocks
            first = max(base, blocks - g.window_blocks) if g.kind == "swa" else base
            if len(table) < blocks or not all(table[first:blocks]):
                return None
            piece = [0] * (first - base) + list(table[first:blocks])
            out.append((self.tail_part_key(tail_key, i), self._ids(i, piece)))
        return out

    def final_boundaries(self, prompt_tokens: int, store_decode_tokens: bool) -> tuple[int, int] | None:
        """The boundaries a later hit on a request's stored prefix ends at: its prompt's whole chunks, and one
        chunk earlier when the prompt ends on a chunk boundary (the n-1 rule); None when decode tokens are
        stored too (the stored end keeps moving: every chunk keeps its window)."""
        if store_decode_tokens:
            return None
        return prompt_tokens // self.chunk, (prompt_tokens - 1) // self.chunk
