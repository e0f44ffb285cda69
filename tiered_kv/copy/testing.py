"""Engine-shaped KV tensors and an independent reference, for tests and benchmarks.

Role: builds the tensors vLLM and SGLang hand to a connector (same shapes and
strides as the engines create, without importing either engine), and computes
what a slot must contain by sorting element addresses: a reference that shares
no code with ``layouts.py`` / ``segments.py``. Used by tests/copy,
tests/gpu and benchmarks/gpu_copy.py.

Threading: plain functions, no shared state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tiered_kv.copy.layouts import (
    KVLayout,
    sglang_device_layout,
    sglang_host_layout,
    vllm_cross_layer_layout,
    vllm_layer_layout,
)

#: vLLM 0.33 ``KVCacheLayout`` physical orders (L layers, B blocks, H heads, N tokens, C = 2*head_dim).
VLLM_ORDERS = ("LBNHC", "LBHNC", "BLHNC", "LHBNC", "BLNHC", "BHLNC")


@dataclass(frozen=True)
class Shape:
    """Model geometry of a test or benchmark case."""

    layers: int
    heads: int
    block_size: int
    head_dim: int
    num_blocks: int


def vllm033_views(order: str, s: Shape, dtype: torch.dtype, device: torch.device | str, mla: bool = False) -> list[torch.Tensor]:
    """Per-layer logical ``(B, H, N, 2D)`` views (MLA: ``(B, N, D)``) of one buffer in physical ``order``."""
    heads, width = (1, s.head_dim) if mla else (s.heads, 2 * s.head_dim)
    sizes = {"L": s.layers, "B": s.num_blocks, "H": heads, "N": s.block_size, "C": width}
    buf = torch.empty([sizes[ch] for ch in order], dtype=dtype, device=device)
    rest = order.replace("L", "")
    views = []
    for layer in range(s.layers):
        v = buf.select(order.index("L"), layer).permute([rest.index(ch) for ch in "BHNC"])
        views.append(v.select(1, 0) if mla else v)
    return views


def vllm026_tensors(stride_order: str, s: Shape, dtype: torch.dtype, device: torch.device | str, mla: bool = False) -> list[torch.Tensor]:
    """vLLM 0.26 separate per-layer tensors, ``(B, H, N, 2D)`` materialised as ``NHD`` or ``HND``."""
    if mla:
        return [torch.empty((s.num_blocks, s.block_size, s.head_dim), dtype=dtype, device=device) for _ in range(s.layers)]
    phys = "BNHC" if stride_order == "NHD" else "BHNC"
    sizes = {"B": s.num_blocks, "H": s.heads, "N": s.block_size, "C": 2 * s.head_dim}
    out = []
    for _ in range(s.layers):
        t = torch.empty([sizes[ch] for ch in phys], dtype=dtype, device=device)
        out.append(t.permute([phys.index(ch) for ch in "BHNC"]))
    return out


def vllm026_cross_layer(stride_order: str, s: Shape, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """vLLM 0.26 cross-layer tensor as the logical ``(L, B, H, N, 2D)`` view of a block-outermost buffer."""
    phys = "BLNHC" if stride_order == "NHD" else "BHLNC"
    sizes = {"L": s.layers, "B": s.num_blocks, "H": s.heads, "N": s.block_size, "C": 2 * s.head_dim}
    buf = torch.empty([sizes[ch] for ch in phys], dtype=dtype, device=device)
    return buf.permute([phys.index(ch) for ch in "LBHNC"])


def sglang_host_buffer(layout: str, s: Shape, dtype: torch.dtype, device: torch.device | str, mla: bool = False) -> torch.Tensor:
    """SGLang host ``kv_buffer``: MHA ``(2, L, size, H, D)`` / ``(2, size, L, H, D)``; MLA without the 2 and H=1."""
    size = s.num_blocks * s.block_size
    if mla:
        dims = (s.layers, size, 1, s.head_dim) if layout == "layer_first" else (size, s.layers, 1, s.head_dim)
    else:
        dims = (2, s.layers, size, s.heads, s.head_dim) if layout == "layer_first" else (2, size, s.layers, s.heads, s.head_dim)
    return torch.empty(dims, dtype=dtype, device=device)


@dataclass(frozen=True)
class LayoutCase:
    """A named way of building a layout for a shape, dtype and device."""

    name: str
    build: Callable[[Shape, torch.dtype, torch.device | str], KVLayout]


def all_cases() -> list[LayoutCase]:
    """Every layout the copy path supports: vLLM 0.33 orders, 0.26 tensors, SGLang pools; MHA and MLA."""
    cases = [
        LayoutCase(f"vllm033-{o}", lambda s, d, dev, o=o: vllm_layer_layout(vllm033_views(o, s, d, dev), f"vllm:{o}"))
        for o in VLLM_ORDERS
    ]
    cases += [
        LayoutCase("vllm033-mla-LBNHC", lambda s, d, dev: vllm_layer_layout(vllm033_views("LBNHC", s, d, dev, mla=True))),
        LayoutCase("vllm033-mla-BLHNC", lambda s, d, dev: vllm_layer_layout(vllm033_views("BLHNC", s, d, dev, mla=True))),
        LayoutCase("vllm026-NHD", lambda s, d, dev: vllm_layer_layout(vllm026_tensors("NHD", s, d, dev))),
        LayoutCase("vllm026-HND", lambda s, d, dev: vllm_layer_layout(vllm026_tensors("HND", s, d, dev))),
        LayoutCase("vllm026-mla", lambda s, d, dev: vllm_layer_layout(vllm026_tensors("NHD", s, d, dev, mla=True))),
        LayoutCase("vllm026-xl-NHD", lambda s, d, dev: vllm_cross_layer_layout(vllm026_cross_layer("NHD", s, d, dev), 1)),
        LayoutCase("vllm026-xl-HND", lambda s, d, dev: vllm_cross_layer_layout(vllm026_cross_layer("HND", s, d, dev), 1)),
    ]
    for lay in ("layer_first", "page_first"):
        for mla in (False, True):
            cases.append(LayoutCase(
                f"sglang-host-{lay}-{'mla' if mla else 'mha'}",
                lambda s, d, dev, lay=lay, mla=mla: sglang_host_layout(sglang_host_buffer(lay, s, d, dev, mla), lay, s.block_size, mla),
            ))
    cases += [
        LayoutCase("sglang-device-mha", lambda s, d, dev: sglang_device_layout(
            [torch.empty((s.num_blocks * s.block_size, s.heads, s.head_dim), dtype=d, device=dev) for _ in range(s.layers)],
            [torch.empty((s.num_blocks * s.block_size, s.heads, s.head_dim), dtype=d, device=dev) for _ in range(s.layers)],
            s.block_size)),
        LayoutCase("sglang-device-mla", lambda s, d, dev: sglang_device_layout(
            [torch.empty((s.num_blocks * s.block_size, 1, s.head_dim), dtype=d, device=dev) for _ in range(s.layers)],
            None, s.block_size)),
    ]
    return cases


def storages(layout: KVLayout) -> list[torch.Tensor]:
    """One flat uint8 tensor per distinct storage behind the layout's tensors."""
    seen: dict[int, torch.Tensor] = {}
    for t in layout.tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen[st.data_ptr()] = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st)
    return list(seen.values())


def fill_random(layout: KVLayout, gen: torch.Generator) -> None:
    """Overwrite every byte of every storage of ``layout`` with random bytes (from a CPU generator)."""
    for flat in storages(layout):
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))


def reference_addresses(layout: KVLayout, block: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per tensor ``(storage_bytes, byte_offsets)``: where slot bytes of ``block`` live, in slot order.

    Computed from element addresses sorted ascending, without ``block_geometry``.
    """
    out = []
    r = layout.rows_per_block
    for t in layout.tensors:
        v = t.narrow(layout.block_dim, block * r, r)
        esize = t.element_size()
        addr = torch.zeros(v.shape, dtype=torch.int64)
        for dim, (n, st) in enumerate(zip(v.shape, v.stride())):
            shape = [1] * v.dim()
            shape[dim] = n
            addr = addr + (torch.arange(n, dtype=torch.int64) * st * esize).reshape(shape)
        start = v.data_ptr() - t.untyped_storage().data_ptr()
        elem = torch.sort(addr.reshape(-1)).values + start
        byte = (elem[:, None] + torch.arange(esize, dtype=torch.int64)[None, :]).reshape(-1)
        flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        out.append((flat, byte))
    return out


def reference_slot(layout: KVLayout, block: int) -> torch.Tensor:
    """The bytes slot format says block ``block`` must occupy (CPU uint8, ``block_nbytes`` long)."""
    parts = [flat.cpu()[idx] for flat, idx in reference_addresses(layout, block)]
    return torch.cat(parts)


def reference_write(layout: KVLayout, block: int, slot_bytes: torch.Tensor, snapshots: dict[int, torch.Tensor]) -> None:
    """Apply ``slot_bytes`` to CPU ``snapshots`` (storage data_ptr -> bytes) as a load of ``block`` would."""
    pos = 0
    for flat, idx in reference_addresses(layout, block):
        key = flat.untyped_storage().data_ptr()
        snapshots[key][idx] = slot_bytes[pos : pos + idx.numel()].cpu()
        pos += idx.numel()
