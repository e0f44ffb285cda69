"""Does LMCache bind its compiled CUDA ops, the way LMCache itself imports them? One verdict line.

Run in a FRESH interpreter on the GPU machine, after LMCache is installed (install_on_gpu.sh runs it):

    PYTHONPATH=/tmp/site python3 scripts/gpu/lmcache/check_native.py

Why a fresh interpreter, and why nothing may load ``c_ops`` first: LMCache >= 0.5.3 imports its extension
lazily, inside ``import lmcache`` (``CudaDeviceOps.ensure_native`` runs ``import lmcache.c_ops``), and drops
to pure-torch ops with one warning ("compiled extension not found") on ANY ImportError. The extension is a
pybind11 module: loading the same ``.so`` a second time under another module name (e.g. an earlier check
that loaded ``c_ops`` straight from its file) re-runs its module init, pybind11 refuses to register its
types twice ("generic_type: type ... is already registered!", an ImportError), and LMCache silently stays
on the fallback. So this script loads nothing by hand before ``import lmcache``; it watches that import
through a ``builtins.__import__`` wrapper to catch the ImportError LMCache swallows, and only if the
extension did not bind does it load the file (in a child process) to show the loader's own error.

When the ops are native it also runs one real transfer: vLLM-style per-layer paged KV caches on the GPU
gathered into a pinned host buffer by the native ``multi_layer_kv_transfer`` and by LMCache's own torch
fallback (bit-identical results expected), scattered back with the native op, and times both.

Exit status: 0 native ops bound (and the transfer matched, or could not be run: said so); 7 torch fallback
(the swallowed ImportError is printed); 8 LMCache did not pick the CUDA device; 9 native ops bound but the
transfer disagreed with the fallback. Single-threaded script; no threading contract.
"""
from __future__ import annotations

import builtins
import glob
import importlib
import os
import subprocess
import sys
import time
import traceback

EXT = "lmcache.c_ops"


def import_lmcache_watching_ext() -> tuple[object, list[str], str | None]:
    """``import lmcache`` as vLLM's EngineCore would, recording every ImportError of ``EXT`` (with its
    traceback) and the file of the extension module if it did load. Returns (lmcache, errors, ext_file)."""
    errors: list[str] = []
    loaded: list[str] = []

    def watch(real):
        def spy(name, *args, **kwargs):
            try:
                mod = real(name, *args, **kwargs)
            except ImportError:
                if name == EXT:
                    errors.append(traceback.format_exc())
                raise
            if name == EXT and not loaded:
                ext = sys.modules.get(EXT)
                if getattr(ext, "__file__", None):
                    loaded.append(ext.__file__)
            return mod
        return spy

    import torch  # noqa: F401  (LMCache imports it first too; loads libc10/libtorch/libcudart by soname)

    # 0.5.3: `import lmcache.c_ops as native` (builtins.__import__); 0.4.6/0.5.1: importlib.import_module
    real_import, real_import_module = builtins.__import__, importlib.import_module
    builtins.__import__, importlib.import_module = watch(real_import), watch(real_import_module)
    try:
        import lmcache
    finally:
        builtins.__import__, importlib.import_module = real_import, real_import_module
    return lmcache, errors, (loaded[0] if loaded else None)


def is_native(fn) -> bool:
    """True when ``fn`` is a function of the compiled extension, not a DeviceOps method (the fallback)."""
    return type(fn).__name__ == "builtin_function_or_method" and getattr(fn, "__module__", None) == EXT


def explain_failure(lmcache_dir: str) -> None:
    """Load the extension file in a child interpreter, under its real name, to print the loader's error."""
    for path in sorted(glob.glob(os.path.join(lmcache_dir, "c_ops*.so"))):
        code = ("import torch, importlib.machinery as m, importlib.util as u, sys\n"
                f"p = {path!r}\n"
                f"ld = m.ExtensionFileLoader({EXT!r}, p)\n"
                f"mod = u.module_from_spec(u.spec_from_file_location({EXT!r}, p, loader=ld))\n"
                "ld.exec_module(mod); print('  loaded by file in a fresh process:', len(dir(mod)), 'names')\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        print(f"  {os.path.basename(path)}:", (out.stdout + out.stderr).strip()[-1500:] or f"exit {out.returncode}")
        ldd = subprocess.run(["ldd", path], capture_output=True, text=True)
        missing = [ln.strip() for ln in ldd.stdout.splitlines() if "not found" in ln]
        print("  ldd, libraries not found by path (torch's and CUDA's load by soname after `import torch`):",
              ", ".join(missing) or "none")


def transfer_test(ops) -> tuple[bool | None, str]:
    """Gather + scatter through the native op vs LMCache's torch fallback. (matched or None, summary)."""
    import torch
    from lmcache.v1.platform import ops_types, torch_ops

    layers, blocks, block_size, heads, head_size, tokens = 32, 512, 16, 8, 128, 256
    dev = torch.device("cuda", 0)
    gen = torch.Generator(device=dev).manual_seed(0)
    # vLLM flash-attention per-layer layout [2, NB, BS, NH, HS] (LMCache's NL_X_TWO_NB_BS_NH_HS): the one
    # both the native kernel and the fallback implement, so their results can be compared bit for bit.
    caches = [torch.randn(2, blocks, block_size, heads, head_size, generator=gen, device=dev,
                          dtype=torch.bfloat16) for _ in range(layers)]
    ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=dev)
    slots = torch.randperm(blocks * block_size, generator=gen, device=dev)[:tokens].to(torch.int64)
    hidden = heads * head_size
    native_kv = torch.empty(2, layers, tokens, hidden, dtype=torch.bfloat16).pin_memory()
    torch_kv = torch.empty_like(native_kv).pin_memory()
    fmt_n, fmt_t = ops.EngineKVFormat.NL_X_TWO_NB_BS_NH_HS, ops_types.EngineKVFormat.NL_X_TWO_NB_BS_NH_HS

    def native(direction, kv, ptr_tensor):
        ops.multi_layer_kv_transfer(kv, ptr_tensor, slots, dev, blocks * block_size, direction, fmt_n,
                                    block_size=block_size, head_size=head_size)

    def fallback():
        views = [c.view(2, blocks * block_size, hidden) for c in caches]
        torch_ops.multi_layer_kv_transfer(torch_kv, views, slots, dev, blocks * block_size,
                                          ops_types.TransferDirection.D2H, fmt_t)

    def timed(fn, reps=20) -> float:
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / reps * 1e3

    try:
        t_native = timed(lambda: native(ops.TransferDirection.D2H, native_kv, ptrs))
        t_torch = timed(fallback, reps=5)
        same_gather = torch.equal(native_kv, torch_kv)
        back = [torch.zeros_like(c) for c in caches]
        back_ptrs = torch.tensor([c.data_ptr() for c in back], dtype=torch.int64, device=dev)
        native(ops.TransferDirection.H2D, native_kv, back_ptrs)
        torch.cuda.synchronize()
        same_scatter = all(torch.equal(b.view(2, -1, hidden)[:, slots], c.view(2, -1, hidden)[:, slots])
                           for b, c in zip(back, caches))
    except Exception as exc:  # the op's signature is LMCache's, not ours: report, don't guess
        return None, f"transfer test could not run: {type(exc).__name__}: {str(exc)[:300]}"
    mb = native_kv.numel() * native_kv.element_size() / 1e6
    return (same_gather and same_scatter,
            f"{tokens} tokens x {layers} layers ({mb:.1f} MB) GPU->pinned gather: native {t_native:.3f} ms "
            f"({mb / t_native:.1f} GB/s), torch fallback {t_torch:.3f} ms; native == fallback: {same_gather}; "
            f"native scatter back restores the slots: {same_scatter}")


def main() -> int:
    """Print the verdict; see the module docstring for the exit status."""
    lmcache, errors, ext_file = import_lmcache_watching_ext()
    ops = sys.modules.get(EXT)  # 0.5.3: a shim over its DeviceOps instance; 0.5.1: fallback merged with native
    fn = getattr(ops, "multi_layer_kv_transfer", None)
    print(f"lmcache {lmcache.__version__} from {os.path.dirname(lmcache.__file__)}, device {lmcache.torch_device_type}")
    if lmcache.torch_device_type != "cuda":
        print("VERDICT: LMCache did not pick CUDA (no GPU visible to torch?): its native ops cannot be checked")
        return 8
    if not is_native(fn):
        print(f"VERDICT: LMCACHE NATIVE OPS NOT USED: {EXT}.multi_layer_kv_transfer is {fn!r} (torch fallback)")
        for err in errors:
            print("ImportError that LMCache swallowed (CudaDeviceOps.ensure_native):\n" + err.rstrip())
        if not errors:
            print("(no ImportError of lmcache.c_ops was seen: LMCache never tried to import it)")
        explain_failure(os.path.dirname(lmcache.__file__))
        return 7
    print(f"VERDICT: LMCACHE NATIVE OPS USED: {EXT} bound from {ext_file} "
          f"(multi_layer_kv_transfer is {type(fn).__name__}, EngineKVFormat is {type(ops.EngineKVFormat).__name__})")
    try:
        ok, summary = transfer_test(ops)
    except Exception as exc:  # e.g. an LMCache version without lmcache.v1.platform.torch_ops
        ok, summary = None, f"transfer test could not run: {type(exc).__name__}: {str(exc)[:300]}"
    print(("transfer test: " if ok is not None else "") + summary)
    if ok is False:
        print("VERDICT: native transfer DISAGREES with LMCache's torch fallback: do not report lmcache numbers")
        return 9
    return 0


if __name__ == "__main__":
    sys.exit(main())
