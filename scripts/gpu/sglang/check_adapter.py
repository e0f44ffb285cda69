"""Probe the installed SGLang (0.5.17 on the GPU machine) for what the benchmark and our backend need.

Run by ``install_on_gpu.sh`` (``PYTHONPATH=$SITE:. python3 scripts/gpu/sglang/check_adapter.py``):
1. versions of sglang, sgl_kernel, torch, transformers, tokenizers (and whether flashinfer is the shim);
2. every module on the offline Engine's path imports (each failure printed with its missing module);
3. our backend through SGLang's own ``dynamic`` factory with SGLang's own ``HiCacheStorageConfig``
   (which ``versions.py`` answers: writer rank, DP rank, DCP), then a round trip through a real
   host pool built from a real device KV pool on the GPU (bit-exact, both API paths), when CUDA is up.
Exit 0: everything the Llama modes need passed (an MLA-only import may have failed: said so); 1: something
failed (the lines marked FAIL say what).

Threading contract: a script; single-threaded.
"""
from __future__ import annotations

import importlib
import os
import sys
import tempfile
import traceback

ENGINE_PATH = (
    "sglang", "sglang.srt.entrypoints.engine", "sglang.srt.managers.scheduler", "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.detokenizer_manager", "sglang.srt.model_executor.model_runner", "sglang.srt.models.llama",
    "sglang.srt.models.deepseek_v2", "sglang.srt.layers.attention.triton_backend", "sglang.srt.layers.sampler",
    "sglang.srt.mem_cache.hiradix_cache", "sglang.srt.managers.cache_controller",
    "sglang.srt.mem_cache.storage.backend_factory", "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.pool_host.mla", "sgl_kernel", "tiered_kv.connector.sglang.backend",
)
#: Reported, but not failing the install: MLA-only imports (only the MLA modes need them), and the round trip
#: through a hand-built 0.5.17 host pool (it builds SGLang's pools outside an engine; the benchmark's engines
#: build their own, so a constructor detail here must not stop the benchmark).
OPTIONAL = ("import sglang.srt.models.deepseek_v2", "import sglang.srt.mem_cache.pool_host.mla",
            "GPU host pool round trip")
failures: list[str] = []
optional_failures: list[str] = []


def check(name: str, fn) -> object:
    """Run one probe; print OK or FAIL with the reason."""
    try:
        out = fn()
        print(f"OK   {name}" + (f": {out}" if out not in (None, True) else ""), flush=True)
        return out
    except Exception as exc:  # noqa: BLE001 (a probe reports, it does not stop)
        (optional_failures if name in OPTIONAL else failures).append(name)
        print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
        traceback.print_exc(limit=-3)
        return None


def versions() -> str:
    out = []
    for mod in ("sglang", "sgl_kernel", "torch", "transformers", "tokenizers", "triton", "flashinfer"):
        try:
            m = importlib.import_module(mod)
            out.append(f"{mod} {getattr(m, '__version__', '?')}")
        except Exception as exc:  # noqa: BLE001
            out.append(f"{mod} not importable ({type(exc).__name__})")
    return " | ".join(out)


def storage_config(extra: dict, **kw):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    base = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                enable_storage_metrics=False, is_page_first_layout=True, model_name="probe/llama",
                extra_config=dict(extra))
    base.update(kw)
    return HiCacheStorageConfig(**base)


def factory_and_versions(disk: str) -> str:
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    from tiered_kv.connector.sglang import versions as v

    extra = {"backend_name": "tiered_kv", "module_path": "tiered_kv.connector.sglang",
             "class_name": "TieredHiCacheStorage", "interface_v1": 1, "disk_path": disk, "disk_bytes": "1GiB"}
    be = v.unwrap(StorageBackendFactory.create_backend("dynamic", storage_config(extra), None))
    assert type(be).__name__ == "TieredHiCacheStorage", type(be)
    mla1 = storage_config(extra, is_mla_model=True, tp_rank=1, tp_size=2)
    has_prop = isinstance(getattr(type(mla1), "is_storage_writer", None), property)
    assert v.storage_writer(mla1) is False and v.storage_writer(storage_config(extra, tp_rank=1, tp_size=2))
    return (f"is_storage_writer property: {has_prop}; dp_rank field: {hasattr(mla1, 'dp_rank')}; "
            f"dcp fields: {hasattr(mla1, 'dcp_size')}; MLA rank 1 writes: False (0.5.17 rule when no property)")


def gpu_round_trip(disk: str) -> str:
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    if not torch.cuda.is_available():
        return "skipped (no CUDA)"
    ps, layers, heads, dim = 64, 4, 8, 128
    dev = MHATokenToKVPool(size=ps * 32, page_size=ps, dtype=torch.bfloat16, head_num=heads, head_dim=dim,
                           layer_num=layers, device="cuda", enable_memory_saver=False)
    host = MHATokenToKVPoolHost(dev, 2.0, 0, ps, "page_first", pin_memory=True, device="cpu")
    extra = {"backend_name": "tiered_kv", "module_path": "tiered_kv.connector.sglang",
             "class_name": "TieredHiCacheStorage", "interface_v1": 1, "disk_path": disk, "disk_bytes": "1GiB"}
    be = StorageBackendFactory.create_backend("dynamic", storage_config(extra), host)
    be.register_mem_pool_host(host)
    raw = host.kv_buffer.view(torch.int16)
    raw.copy_(torch.randint(-2**15, 2**15 - 1, raw.shape, dtype=torch.int16))
    keys = [f"{i:064x}" for i in range(1, 9)]
    src = host.alloc(8 * ps)
    want = [host.get_data_page(int(src[i * ps]), flat=True).view(torch.uint8).clone() for i in range(8)]
    assert all(be.batch_set_v1(keys, src)), be.stats()["backend"]
    assert be.batch_exists(keys) == 8
    dst = host.alloc(8 * ps)
    assert all(be.batch_get_v1(keys, dst))
    got = [host.get_data_page(int(dst[i * ps]), flat=True).view(torch.uint8) for i in range(8)]
    assert all(torch.equal(a, b) for a, b in zip(got, want)), "v1 pages differ"
    legacy = be.batch_get(keys[:2], [host.get_dummy_flat_data_page() for _ in range(2)])
    assert all(torch.equal(legacy[i].view(torch.uint8), want[i]) for i in range(2)), "legacy pages differ"
    be.close()
    return f"8 pages of {want[0].numel() >> 10} KiB bit-exact (v1 + legacy), layout page_first, pinned host pool"


def main() -> int:
    """Run every probe; 0 when all passed."""
    check("versions", versions)
    for mod in ENGINE_PATH:
        check(f"import {mod}", lambda m=mod: importlib.import_module(m) and None)
    with tempfile.TemporaryDirectory(prefix="tkv-check-") as disk:
        check("dynamic factory + versions.py on this SGLang", lambda: factory_and_versions(os.path.join(disk, "a")))
        check("GPU host pool round trip", lambda: gpu_round_trip(os.path.join(disk, "b")))
    if optional_failures:
        print(f"check_adapter: optional probes failed ({optional_failures}); the Llama modes can run", flush=True)
    print("check_adapter:", "ALL OK" if not failures else f"{len(failures)} FAILED: {failures}", flush=True)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
