"""Shared builders for the SGLang backend tests: real SGLang 0.5.23 objects on CPU.

Everything here constructs SGLang's own classes (``HiCacheStorageConfig``, the
``dynamic`` ``StorageBackendFactory`` path, ``MHATokenToKVPoolHost`` /
``MLATokenToKVPoolHost``, ``HiCacheController``). The only stand-ins are the CPU tensors
that play the device KV buffers the host pools are sized from, and, for the controller,
the two shims SGLang needs outside a launched server (see ``running_controller``).

Threading contract: builders are plain functions; each test uses its own objects.
"""
from __future__ import annotations

import contextlib
import os
import threading
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

PAGE_SIZE = 4
LAYERS = 2
HEADS = 2
HEAD_DIM = 8
DEV_TOKENS = 64
MODEL = "Qwen/Qwen3-0.6B"

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
ALL_POOLS = [("mha", lay) for lay in MHA_LAYOUTS] + [("mla", lay) for lay in MLA_LAYOUTS]

BACKEND_KEYS = {"backend_name": "tiered_kv", "module_path": "tiered_kv.connector.sglang",
                "class_name": "TieredHiCacheStorage"}


def extra_config(disk_path, interface_v1: bool = True, **ours) -> dict:
    """The dict SGLang puts in ``storage_config.extra_config`` for our launch command."""
    cfg = dict(BACKEND_KEYS, interface_v1=1 if interface_v1 else 0, disk_path=str(disk_path), disk_bytes="64MiB")
    cfg.update(ours)
    return cfg


def storage_config(extra: dict, *, tp_rank=0, tp_size=1, is_mla=False, layout="page_first", model=MODEL,
                   pp_rank=0, pp_size=1, cp_rank=0, cp_size=1) -> HiCacheStorageConfig:
    """A ``HiCacheStorageConfig`` as ``HiCacheController._generate_storage_config`` fills it."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, attn_cp_rank=cp_rank,
        attn_cp_size=cp_size, is_mla_model=is_mla, enable_storage_metrics=False,
        is_page_first_layout=layout == "page_first", model_name=model, extra_config=dict(extra))


def mha_pool(layout: str, dtype=None, page_size=PAGE_SIZE, layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM,
             dev_tokens=DEV_TOKENS, ratio=2.0):
    """A real CPU ``MHATokenToKVPoolHost`` (0.5.23 constructor: buffer descriptors, not the device pool)."""
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    dtype = dtype or torch.bfloat16
    # CPU tensors standing in for the device K/V buffers: the host pool reads only their geometry.
    k = tuple(torch.zeros(dev_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(dev_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=torch.tensor([t.data_ptr() for t in k], dtype=torch.uint64),
                          v_data_ptrs=torch.tensor([t.data_ptr() for t in v], dtype=torch.uint64),
                          layout=KVBufferLayout.NHD),
        page_size=page_size, head_num=heads, head_dim=head_dim, v_head_dim=head_dim, dtype=dtype,
        device=torch.device("cpu"))
    return MHATokenToKVPoolHost(info, ratio, 0, page_size, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=dev_tokens, start_layer=0, end_layer=layers)


def mla_pool(layout: str, dtype=None, page_size=PAGE_SIZE, layers=LAYERS, dev_tokens=DEV_TOKENS, ratio=2.0):
    """A real CPU ``MLATokenToKVPoolHost`` (kv_lora_rank 16 + rope 8)."""
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    dtype = dtype or torch.bfloat16
    bufs = tuple(torch.zeros(dev_tokens, 1, 24, dtype=dtype) for _ in range(layers))
    info = MLABufferInfo(buffers=bufs, data_ptrs=torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64),
                         layer_indices=tuple(range(layers)), device_layer_num=layers, page_size=page_size,
                         kv_lora_rank=16, qk_rope_head_dim=8, kv_cache_dim=24, dtype=dtype,
                         device=torch.device("cpu"))
    return MLATokenToKVPoolHost(info, ratio, 0, page_size, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=dev_tokens, start_layer=0, end_layer=layers,
                                target_layer_num=layers)


def make_pool(kind: str, layout: str, **kw):
    """``mha_pool`` or ``mla_pool``."""
    return (mla_pool if kind == "mla" else mha_pool)(layout, **kw)


def create_backend(extra: dict, **cfg_kw):
    """Build through SGLang's dynamic factory, as ``HiCacheController.attach_storage_backend`` does."""
    return StorageBackendFactory.create_backend("dynamic", storage_config(extra, **cfg_kw), None)


def attached_backend(extra: dict, pool, **cfg_kw):
    """``create_backend`` + ``register_mem_pool_host`` (the controller's two attach steps)."""
    layout = pool.layout
    be = create_backend(extra, is_mla=_is_mla(pool), layout=layout, **cfg_kw)
    be.register_mem_pool_host(pool)
    return be


def _is_mla(pool) -> bool:
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    return isinstance(pool, MLATokenToKVPoolHost)


def fill_random(pool, seed: int = 0) -> None:
    """Random bits in the whole host pool (through an integer view, so every bit pattern occurs)."""
    g = torch.Generator().manual_seed(seed)
    if pool.kv_buffer.element_size() == 2:
        raw, lo, hi = pool.kv_buffer.view(torch.int16), -(2 ** 15), 2 ** 15 - 1
    else:
        raw, lo, hi = pool.kv_buffer.view(torch.uint8), 0, 255
    raw.copy_(torch.randint(lo, hi, raw.shape, generator=g, dtype=raw.dtype))


def page_bytes(pool, page_start: int) -> torch.Tensor:
    """The page at token index ``page_start`` as raw bytes (a copy)."""
    return pool.get_data_page(int(page_start), flat=True).view(torch.uint8).clone()


def pages_bytes(pool, host_indices, n_pages: int) -> list:
    """``page_bytes`` of each of ``n_pages`` pages at ``host_indices``."""
    return [page_bytes(pool, host_indices[i * pool.page_size]) for i in range(n_pages)]


def mla_writer_process(disk_path: str, keys: list, seed: int) -> None:
    """TP rank 0 of an MLA model in its own process: fill its pool with ``seed``, write ``keys``' pages, exit."""
    pool = mla_pool("page_first")
    writer = attached_backend(extra_config(disk_path), pool, tp_rank=0, tp_size=2)
    fill_random(pool, seed)
    ok = writer.batch_set_v1(keys, pool.alloc(len(keys) * PAGE_SIZE))
    writer.close()
    os._exit(0 if all(ok) else 3)


def controller_stub(backend, pool):
    """What ``HiCacheController._page_*`` helpers read from ``self`` (SGLang's own unit-test pattern)."""
    return SimpleNamespace(storage_backend=backend, storage_host_pool=pool, page_size=pool.page_size)


def page_helpers(set_via: str, get_via: str):
    """SGLang's real controller page functions: "generic" (legacy) or "zero_copy" (v1)."""
    from sglang.srt.managers.cache_controller import HiCacheController as C

    sets = {"generic": C._generic_page_set, "zero_copy": C._page_set_zero_copy}
    gets = {"generic": C._generic_page_get, "zero_copy": C._page_get_zero_copy}
    return sets[set_via], gets[get_via]


def live_op(request_id: str = "r0"):
    """A prefetch operation stand-in for the page-get helpers (they read request_id and is_terminated)."""
    return SimpleNamespace(request_id=request_id, is_terminated=lambda: False)


@contextlib.contextmanager
def running_controller(pool, extra: dict, model: str = MODEL):
    """A real ``HiCacheController`` with its storage threads, attached to our backend via ``dynamic``.

    Shims (SGLang needs them outside a launched server): ``get_parallel().override`` pins
    the TP/PP ranks, ``is_dp_attention_enabled`` is patched to False, and the device-side
    allocator is a stub exposing only the two attributes ``__init__`` touches (no device
    pool exists on CPU; storage threads never use it).
    """
    import sglang.srt.managers.cache_controller as cc_mod
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.runtime_context import get_parallel

    class _DevicePool:
        device = "cpu"
        layer_num = pool.layer_num

        def register_layer_transfer_counter(self, counter):
            self.counter = counter

    class _Allocator:
        def __init__(self):
            self.pool = _DevicePool()

        def get_kvcache(self):
            return self.pool

    saved = cc_mod.is_dp_attention_enabled
    cc_mod.is_dp_attention_enabled = lambda: False
    try:
        with get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0):
            ctrl = HiCacheController(
                token_to_kv_pool_allocator=_Allocator(), mem_pool_host=pool, page_size=pool.page_size,
                tp_group=None, load_cache_event=threading.Event(), write_policy="write_through",
                io_backend="direct", storage_backend="dynamic", prefetch_threshold=pool.page_size,
                model_name=model, storage_backend_extra_config=dict(extra))
            try:
                yield ctrl
            finally:
                ctrl.detach_storage_backend()
    finally:
        cc_mod.is_dp_attention_enabled = saved
