"""Pipelined page moves between SGLang's host pool and the store, in chunks of reused staging buffers.

A batch from SGLang (up to 128 pages, 1 GiB for an 8B model) is cut into chunks of
``chunk_pages``. Two staging buffers per thread alternate, so the copy of one chunk out of
(or into) the host pool overlaps the store's disk I/O of the previous chunk, and memory
stays bounded at ``2 * chunk_pages`` pages per SGLang thread. Chunks of consecutive pages
that are contiguous in the pool (MLA ``page_first`` layouts) skip the staging buffer: the
store reads and writes the pool's memory directly.

Threading contract: the functions are re-entrant; each calling thread uses its own
staging buffers (``HostPages.staging``). A buffer is reused only after the store's job
that used it has completed.
"""
from __future__ import annotations

from tiered_kv.store.tiered_store import Handle, TieredStore
from tiered_kv.connector.sglang.pages import HostPages


def _chunks(n: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, n)) for a in range(0, n, size)]


def write_pages(store: TieredStore, pages: HostPages, keys: list[bytes], page_ids: list[int],
                chunk_pages: int) -> tuple[list[bool], bool]:
    """Put ``pages[page_ids[i]]`` under ``keys[i]``. Returns (accepted per key, any chunk zero-copy)."""
    ok: list[bool] = []
    zero_copy = False
    pending: Handle | None = None
    for c, (a, b) in enumerate(_chunks(len(keys), chunk_pages)):
        blocks, direct = pages.gather(page_ids[a:b], into=pages.staging(c % 2, b - a))
        zero_copy |= direct
        handle = store.put(keys[a:b], blocks)
        if pending is not None:
            ok += pending.wait()  # frees the other buffer before the next gather reuses it
        pending = handle
    if pending is not None:
        ok += pending.wait()
    return ok, zero_copy


def read_pages(store: TieredStore, pages: HostPages, keys: list[bytes], page_ids: list[int],
               chunk_pages: int) -> tuple[int, bool]:
    """Get the leading run of ``keys`` into ``pages[page_ids]``. Returns (pages landed, any chunk zero-copy)."""
    chunks = _chunks(len(keys), chunk_pages)
    landed = 0
    zero_copy = False
    inflight: list[tuple[int, int, object, Handle]] = []

    def issue(c: int) -> None:
        a, b = chunks[c]
        target, direct = pages.read_target(page_ids[a:b], c % 2)
        inflight.append((a, b, target, store.get(keys[a:b], target)))
        nonlocal zero_copy
        zero_copy |= direct

    if chunks:
        issue(0)
    for c in range(len(chunks)):
        if c + 1 < len(chunks):
            issue(c + 1)  # the next chunk's disk read overlaps this chunk's scatter
        a, b, target, handle = inflight.pop(0)
        got = handle.wait()
        pages.scatter(page_ids[a:b], target, got)
        landed += got
        if got < b - a:
            for *_, h in inflight:  # let reads into our buffers finish before anyone reuses them
                h.wait()
            break
    return landed, zero_copy
