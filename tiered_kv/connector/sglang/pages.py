"""Page access into SGLang's host KV pool: strided views, batched gather and scatter.

One SGLang page (``page_size`` tokens across all layers) is one tiered_kv block. Its
bytes are exactly what ``host_pool.get_data_page(index, flat=True)`` returns, so the
legacy API (flat page tensors) and the zero-copy v1 API (host indices) store the same
bytes and can read each other's blocks.

Rather than a table of layouts, ``HostPages`` asks the pool for the strided views of
two pages (``get_data_page(i, flat=False)``) and derives one view over all pages,
``pages[p] == get_data_page(p * page_size, flat=False)``, with ``as_strided``. That view
is checked against the pool for the first, second and last page; a pool whose pages
are not uniformly strided falls back to the pool's own per-page calls. Moving ``n``
pages is then one indexing copy (gather into a staging tensor, or scatter out of it),
and no copy at all when the pages are consecutive and contiguous in the pool (MLA
``page_first`` layouts), where the store reads and writes the pool's memory directly.

Threading contract: a ``HostPages`` is immutable after construction except for its
staging buffers, which are per thread. ``gather`` and ``scatter`` touch only the pages
they are given, so SGLang's backup and prefetch threads may call them at once for
different host slots (SGLang never hands the same slots to both: backup slots are
host-locked until their ack).
"""
from __future__ import annotations

import mmap
import threading

import torch

from tiered_kv.errors import InvalidInputError
from tiered_kv.values.layout import BlockLayout, normalize_dtype


class HostPages:
    """Batched page views of one SGLang host pool (MHA or MLA, any layout)."""

    def __init__(self, pool: object, is_mla: bool) -> None:
        self.pool = pool
        self.is_mla = is_mla
        self.page_size = int(pool.page_size)
        self.layout_name = str(pool.layout)
        self.torch_dtype = pool.dtype
        dtype = normalize_dtype(str(pool.dtype))
        first = pool.get_data_page(0, flat=False)
        self.page_shape = tuple(int(d) for d in first.shape)
        self.num_pages = int(pool.size) // self.page_size
        kind = "mla" if is_mla else "mha"
        # The tag keeps layouts with equal page shapes apart (MHA page_first_direct vs
        # page_head when heads == layers); shape and dtype are in the fingerprint anyway.
        self.layout = BlockLayout(self.page_shape, dtype, tag=f"sglang:{kind}:{self.layout_name}:ps{self.page_size}")
        self.view = self._strided_view(first)
        self._local = threading.local()

    # ------------------------------------------------------------------ setup
    def _strided_view(self, first: torch.Tensor) -> torch.Tensor | None:
        """One view ``(num_pages, *page_shape)`` over the pool, or None if its pages are not uniformly strided."""
        if self.num_pages < 2:
            return None
        try:
            second = self.pool.get_data_page(self.page_size, flat=False)
            itemsize = first.element_size()
            delta = second.data_ptr() - first.data_ptr()
            if delta <= 0 or delta % itemsize or first.stride() != second.stride():
                return None
            view = first.as_strided((self.num_pages, *self.page_shape), (delta // itemsize, *first.stride()),
                                   first.storage_offset())
            last = self.pool.get_data_page((self.num_pages - 1) * self.page_size, flat=False)
        except (RuntimeError, ValueError, IndexError):
            return None
        for p, want in ((0, first), (1, second), (self.num_pages - 1, last)):
            got = view[p]
            if got.data_ptr() != want.data_ptr() or got.stride() != want.stride() or got.shape != want.shape:
                return None
        return view

    @property
    def strided(self) -> bool:
        """True when pages move by one batched indexing copy (False: per-page pool calls)."""
        return self.view is not None

    @property
    def page_nbytes(self) -> int:
        """Bytes per page (= per block)."""
        return self.layout.nbytes

    # ------------------------------------------------------------------ indices
    def page_ids(self, host_indices: torch.Tensor, n_pages: int) -> list[int]:
        """Page numbers of ``n_pages`` pages given SGLang's token-level ``host_indices``.

        SGLang allocates page-aligned runs, so only ``host_indices[i * page_size]`` matters.
        Raises InvalidInputError if the indices are too short or not page-aligned.
        """
        ps = self.page_size
        if host_indices.numel() < n_pages * ps:
            raise InvalidInputError(f"host_indices has {host_indices.numel()} entries for {n_pages} pages of {ps}")
        starts = host_indices[: n_pages * ps : ps].tolist()
        bad = [s for s in starts if s % ps or not 0 <= s // ps < self.num_pages]
        if bad:
            raise InvalidInputError(f"host index {bad[0]} is not the start of a page in a pool of "
                                    f"{self.num_pages} pages of {ps} tokens")
        return [s // ps for s in starts]

    def _run_view(self, pages: list[int]) -> torch.Tensor | None:
        """The pool's own memory for ``pages`` if they are consecutive and contiguous, else None."""
        if self.view is None or not pages:
            return None
        a = pages[0]
        if pages != list(range(a, a + len(pages))):
            return None
        run = self.view[a:a + len(pages)]
        return run if run.is_contiguous() else None

    # ------------------------------------------------------------------ moves
    def staging(self, slot: int, n: int) -> torch.Tensor:
        """This thread's reusable staging buffer ``slot`` (0 or 1), at least ``n`` pages, first ``n`` returned.

        Reused across calls so a batch does not page-fault fresh memory every time (that
        costs as much as the copy itself); one pair per SGLang thread (backup, prefetch IO).
        """
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = [None, None]
        buf = bufs[slot]
        if buf is None or buf.shape[0] < n:
            buf = bufs[slot] = _aligned_empty((n, *self.page_shape), self.torch_dtype)
        return buf[:n]

    def gather(self, pages: list[int], into: torch.Tensor | None = None) -> tuple[torch.Tensor, bool]:
        """Blocks ``(n, *page_shape)`` holding ``pages``; (tensor, True) when it is the pool's own memory.

        ``into`` (contiguous, n pages) receives the copy when one is needed; else a new tensor.
        """
        run = self._run_view(pages)
        if run is not None:
            return run, True
        out = into if into is not None else torch.empty((len(pages), *self.page_shape), dtype=self.torch_dtype)
        if self.view is not None:
            torch.index_select(self.view, 0, torch.tensor(pages, dtype=torch.long), out=out)
        else:
            for i, p in enumerate(pages):
                out[i].copy_(self.pool.get_data_page(p * self.page_size, flat=False).reshape(self.page_shape))
        return out, False

    def scatter(self, pages: list[int], blocks: torch.Tensor, k: int) -> None:
        """Copy the first ``k`` blocks into ``pages[:k]`` (a no-op when ``blocks`` is the pool's own memory)."""
        if k <= 0 or self._is_pool_memory(blocks):
            return
        if self.view is not None:
            self.view.index_copy_(0, torch.tensor(pages[:k], dtype=torch.long), blocks[:k])
            return
        for i in range(k):
            self.pool.set_from_flat_data_page(pages[i] * self.page_size, blocks[i].flatten())

    def read_target(self, pages: list[int], slot: int) -> tuple[torch.Tensor, bool]:
        """Where the store should read ``pages`` to: the pool itself when possible, else staging ``slot``."""
        run = self._run_view(pages)
        if run is not None:
            return run, True
        return self.staging(slot, len(pages)), False

    def _is_pool_memory(self, t: torch.Tensor) -> bool:
        return self.view is not None and t.untyped_storage().data_ptr() == self.view.untyped_storage().data_ptr()

    def as_block(self, flat: torch.Tensor) -> torch.Tensor | None:
        """A legacy flat page (any dtype of the right byte size) viewed as one block, or None if the size is wrong."""
        if flat.numel() * flat.element_size() != self.page_nbytes:
            return None
        t = flat.detach().reshape(-1)
        if t.dtype != self.torch_dtype:
            t = t.contiguous().view(torch.uint8).view(self.torch_dtype)
        return t.reshape(self.page_shape)


def _aligned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor on page-aligned, pre-faulted anonymous memory (what an O_DIRECT write can use as is)."""
    nbytes = max(1, torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size())
    raw = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)  # the tensor keeps the mapping alive
    raw.zero_()  # touch every page now, not inside the first timed copy
    return raw.view(dtype).reshape(shape)
