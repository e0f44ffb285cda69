"""Copy-engine mechanism: the driver's batched memcpy (``cuMemcpyBatchAsync``) and 2-D memcpy.

Role: move a list of byte runs between GPU memory and pinned host memory with
the GPU's DMA copy engines, which leaves the SMs to the model. The entry point
is resolved once through cuda-python (``cuda.bindings.driver.cuGetProcAddress``,
asking for the CUDA 12.8 ABI, the one that still takes ``failIdx``) and called
through ctypes with the run arrays straight from int64 CPU tensors: building
Python objects per descriptor would cost more CPU than the copy takes. A long
list is submitted in slices that grow from ``FIRST_SLICE`` to
``max_runs_per_call`` runs, so the first copies start within microseconds while
later descriptors are still being handed to the driver.

``RectMemcpy`` is the other descriptor form: one ``cuMemcpy2DAsync`` per
rectangle (``segments.RectTable``), used when a block's chunks sit at a fixed
pitch (vLLM's per-layer views of one buffer: a row per layer), which cuts the
driver work per block from one descriptor per layer to one call.

``RectBatchMemcpy`` hands many such pitched copies (2-D, depth 1) to the driver in one call
(``cuMemcpy3DBatchAsync``): the staged load's column-range DMAs, one copy per run of adjacent
slots, whose single 2-D calls held vLLM's thread ~4-5 us each.

Every batched copy carries ``srcAccessOrder = STREAM`` (the source is read in stream
order, so KV written by earlier kernels on the stream is what gets copied);
``prefer_overlap`` sets ``CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE``.

Threading: a ``BatchMemcpy``, ``RectMemcpy`` or ``RectBatchMemcpy`` holds only immutable
ctypes state after construction; ``submit`` and ``gather_rows`` (which build their
descriptors per call) may be called from several threads (each call passes its own
arrays and stream). The driver reads the descriptor arrays during the
call, so they may be freed when ``submit`` returns.
"""

from __future__ import annotations

import ctypes

import torch

from tiered_kv.copy.errors import BackendUnavailableError, CopyLaunchError
from tiered_kv.copy.segments import Rects, Runs

_SRC_ACCESS_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1  # CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
_ABI_VERSION = 12080  # the 9-argument form with failIdx
FIRST_SLICE = 128  # runs in the first driver call; each later call doubles, up to max_runs_per_call


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_uint),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


_FN_TYPE = ctypes.CFUNCTYPE(
    ctypes.c_int,  # CUresult
    ctypes.c_void_p,  # dsts
    ctypes.c_void_p,  # srcs
    ctypes.c_void_p,  # sizes
    ctypes.c_size_t,  # count
    ctypes.c_void_p,  # attrs
    ctypes.c_void_p,  # attrsIdxs
    ctypes.c_size_t,  # numAttrs
    ctypes.c_void_p,  # failIdx
    ctypes.c_void_p,  # hStream
)


def _entry(name: str, fn_type) -> ctypes._CFuncPtr:
    """The driver's ``name`` at the CUDA 12.8 ABI (through cuda-python), as a ctypes function of ``fn_type``; raise
    ``BackendUnavailableError`` when cuda-python or the entry point is missing."""
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise BackendUnavailableError(
            "the copy engine needs cuda-python (pip install 'tiered_kv[cuda]'): " f"{exc}"
        ) from exc
    torch.cuda.init()  # the driver call needs an initialised context; torch's is fine
    result = driver.cuGetProcAddress(name.encode(), _ABI_VERSION, 0)
    err, ptr = result[0], int(result[1])
    if err != driver.CUresult.CUDA_SUCCESS or ptr == 0:
        raise BackendUnavailableError(
            f"cuGetProcAddress('{name}', {_ABI_VERSION}) failed: {err}; needs a CUDA 12.8+ driver"
        )
    return fn_type(ptr)


def _slices(n: int, max_runs: int):
    """``(start, count)`` of the driver calls a list of ``n`` runs is submitted in: ``FIRST_SLICE`` runs first
    (so the first copies start while later ones are still described), each later slice twice the last, up to
    ``max_runs``."""
    start, step = 0, min(FIRST_SLICE, max_runs)
    while start < n:
        count = min(step, n - start)
        yield start, count
        start += count
        step = min(2 * step, max_runs)


class BatchMemcpy:
    """``cuMemcpyBatchAsync`` bound once; ``submit`` enqueues a ``Runs`` list on a stream."""

    def __init__(self, prefer_overlap: bool = True, max_runs_per_call: int = 2048) -> None:
        """Resolve the driver entry point; raise ``BackendUnavailableError`` when it cannot."""
        if max_runs_per_call < 1:
            raise ValueError(f"max_runs_per_call={max_runs_per_call} must be >= 1")
        self._fn = _entry("cuMemcpyBatchAsync", _FN_TYPE)
        flags = _FLAG_PREFER_OVERLAP_WITH_COMPUTE if prefer_overlap else 0
        self._attrs = _MemcpyAttributes(srcAccessOrder=_SRC_ACCESS_ORDER_STREAM, flags=flags)
        self._max_runs = max_runs_per_call

    def submit(self, runs: Runs, stream_handle: int) -> int:
        """Enqueue every run on ``stream_handle`` (not the legacy default stream); return driver calls made."""
        if stream_handle == 0:
            raise CopyLaunchError("cuMemcpyBatchAsync refuses the legacy default stream; pass a created stream")
        src = runs.src.contiguous()
        dst = runs.dst.contiguous()
        size = runs.size.contiguous()
        n = runs.count
        attrs_idx = ctypes.c_size_t(0)
        fail_idx = ctypes.c_size_t(0)
        calls = 0
        for start, count in _slices(n, self._max_runs):
            offset = start * 8  # int64 entries
            err = self._fn(
                dst.data_ptr() + offset,
                src.data_ptr() + offset,
                size.data_ptr() + offset,
                count,
                ctypes.addressof(self._attrs),
                ctypes.addressof(attrs_idx),
                1,
                ctypes.addressof(fail_idx),
                stream_handle,
            )
            calls += 1
            if err != 0:
                bad = start + int(fail_idx.value)
                detail = ""
                if 0 <= bad < n:
                    detail = f" (run {bad}: src=0x{int(src[bad]):x} dst=0x{int(dst[bad]):x} size={int(size[bad])})"
                raise CopyLaunchError(f"cuMemcpyBatchAsync returned CUresult {err}{detail}")
        return calls


_MEMORYTYPE_HOST = 1  # CU_MEMORYTYPE_HOST
_MEMORYTYPE_DEVICE = 2  # CU_MEMORYTYPE_DEVICE
_DEFAULT_MAX_PITCH = (1 << 31) - 1  # what CUDA GPUs report; used if the query fails


class _Memcpy2D(ctypes.Structure):
    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_uint),
        ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64),
        ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_uint),
        ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64),
        ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
    ]


_FN2D_TYPE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)


class RectMemcpy:
    """``cuMemcpy2DAsync`` bound once: one driver call moves one block's pitched rows (e.g. 32 layers)."""

    def __init__(self, device: torch.device) -> None:
        """Resolve the entry point and the device's pitch limit; raise ``BackendUnavailableError`` when absent."""
        self._fn = _entry("cuMemcpy2DAsync", _FN2D_TYPE)
        from cuda.bindings import driver  # present: _entry needed it
        index = device.index if device.index is not None else torch.cuda.current_device()
        attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_PITCH
        err, pitch = driver.cuDeviceGetAttribute(attr, driver.CUdevice(index))
        self.max_pitch = int(pitch) if err == driver.CUresult.CUDA_SUCCESS else _DEFAULT_MAX_PITCH

    def gather_rows(self, dst: int, src: int, src_pitch: int, width: int, runs: list[tuple[int, int, int]],
                    stream_handle: int) -> int:
        """Pinned host -> device, one driver call per run: run ``(d, r, h)`` copies ``h`` rows of ``width`` bytes,
        ``src_pitch`` apart from ``src + r * src_pitch``, packed to ``dst + d``. One descriptor struct serves every
        run (only its addresses and height change), so a call costs the driver call and a few field writes: the
        staged load's DMA (``staged.py``) issues thousands of these per step on vLLM's thread. Returns the calls."""
        p = _Memcpy2D()
        p.srcMemoryType, p.dstMemoryType = _MEMORYTYPE_HOST, _MEMORYTYPE_DEVICE
        p.srcPitch, p.dstPitch, p.WidthInBytes = src_pitch, width, width
        ref, fn = ctypes.addressof(p), self._fn
        for d, r, h in runs:
            p.srcHost, p.dstDevice, p.Height = src + r * src_pitch, dst + d, h
            err = fn(ref, stream_handle)
            if err != 0:
                raise CopyLaunchError(f"cuMemcpy2DAsync returned CUresult {err} (dst=0x{dst + d:x} src=0x"
                                      f"{src + r * src_pitch:x} pitch={src_pitch} width={width} height={h})")
        return len(runs)

    def submit(self, rects: Rects, to_cpu: bool, stream_handle: int) -> int:
        """Enqueue every rectangle on ``stream_handle``; return driver calls made."""
        p = _Memcpy2D()
        if to_cpu:
            p.srcMemoryType, p.dstMemoryType = _MEMORYTYPE_DEVICE, _MEMORYTYPE_HOST
        else:
            p.srcMemoryType, p.dstMemoryType = _MEMORYTYPE_HOST, _MEMORYTYPE_DEVICE
        ref = ctypes.addressof(p)
        cols = zip(rects.gpu.tolist(), rects.cpu.tolist(), rects.pitch.tolist(), rects.width.tolist(), rects.height.tolist())
        calls = 0
        for gpu, cpu, pitch, width, height in cols:
            if to_cpu:
                p.srcDevice, p.srcPitch, p.dstHost, p.dstPitch = gpu, pitch, cpu, width
            else:
                p.srcHost, p.srcPitch, p.dstDevice, p.dstPitch = cpu, width, gpu, pitch
            p.WidthInBytes, p.Height = width, height
            err = self._fn(ref, stream_handle)
            calls += 1
            if err != 0:
                raise CopyLaunchError(
                    f"cuMemcpy2DAsync returned CUresult {err} (gpu=0x{gpu:x} cpu=0x{cpu:x} pitch={pitch}"
                    f" width={width} height={height})"
                )
        return calls


#: ``CUDA_MEMCPY3D_BATCH_OP`` as 14 little-endian 64-bit words (112 bytes; checked against cuda-python's own struct
#: in tests/copy/test_engine_layout.py): per operand (src at word 0, dst at word 5) its type, pointer, row length
#: and layer height (bytes and rows for pointer operands: their element is one byte), location hint; then the
#: extent (width, height, depth) and the source access order with the flags in the high half of the last word.
OP_WORDS = 14
_SRC, _DST, _EXTENT, _ORDER = 0, 5, 10, 13
_OPERAND_POINTER = 1  # CU_MEMCPY_OPERAND_TYPE_POINTER

_FN3D_BATCH_TYPE = ctypes.CFUNCTYPE(
    ctypes.c_int,  # CUresult
    ctypes.c_size_t,  # numOps
    ctypes.c_void_p,  # opList
    ctypes.c_void_p,  # failIdx
    ctypes.c_ulonglong,  # flags
    ctypes.c_void_p,  # hStream
)


def pitched_ops(dst: int, src: int, src_pitch: int, width: int, runs: list[tuple[int, int, int]],
                flags: int = _FLAG_PREFER_OVERLAP_WITH_COMPUTE) -> torch.Tensor:
    """The ``(n, OP_WORDS)`` int64 descriptor array of ``RectBatchMemcpy.gather_rows``'s copies: run ``(d, r, h)``
    copies ``h`` rows of ``width`` bytes, ``src_pitch`` apart from ``src + r * src_pitch``, packed to ``dst + d``.
    Built column by column (no Python per run beyond the list's conversion)."""
    t = torch.tensor(runs, dtype=torch.int64).reshape(-1, 3)
    ops = torch.zeros((t.shape[0], OP_WORDS), dtype=torch.int64)
    d, r, h = t[:, 0], t[:, 1], t[:, 2]
    ops[:, _SRC] = _OPERAND_POINTER
    ops[:, _SRC + 1] = src + r * src_pitch
    ops[:, _SRC + 2] = src_pitch
    ops[:, _SRC + 3] = h
    ops[:, _DST] = _OPERAND_POINTER
    ops[:, _DST + 1] = dst + d
    ops[:, _DST + 2] = width
    ops[:, _DST + 3] = h
    ops[:, _EXTENT] = width
    ops[:, _EXTENT + 1] = h
    ops[:, _EXTENT + 2] = 1
    ops[:, _ORDER] = _SRC_ACCESS_ORDER_STREAM | (flags << 32)
    return ops


class RectBatchMemcpy:
    """``cuMemcpy3DBatchAsync`` bound once: many pitched host -> device copies (2-D, depth 1) in one driver call.

    ``gather_rows`` takes what ``RectMemcpy.gather_rows`` takes and hands every run to the driver in slices of a
    growing size (``FIRST_SLICE`` runs first, so the first copies start while the rest are described), instead
    of one ``cuMemcpy2DAsync`` per run (~4-5 us of the caller's thread each on the H200 host, 2026-11-30). Copies
    of one call may run in any order (the staged load's are disjoint); the batch as a whole is in stream order."""

    def __init__(self, max_runs_per_call: int = 2048) -> None:
        """Resolve the entry point (CUDA 12.8 ABI, the form with ``failIdx``); raise ``BackendUnavailableError``
        when the driver lacks it."""
        self._fn = _entry("cuMemcpy3DBatchAsync", _FN3D_BATCH_TYPE)
        self._max_runs = max(1, int(max_runs_per_call))

    def gather_rows(self, dst: int, src: int, src_pitch: int, width: int, runs: list[tuple[int, int, int]],
                    stream_handle: int) -> int:
        """Pinned host -> device, every run in batched driver calls (see ``pitched_ops``); returns the copies.
        Raises ``CopyLaunchError`` naming the failed run; the runs before it in its slice may have been queued."""
        if not runs:
            return 0
        ops = pitched_ops(dst, src, src_pitch, width, runs)
        n = ops.shape[0]
        fail_idx = ctypes.c_size_t(0)
        for start, count in _slices(n, self._max_runs):
            err = self._fn(count, ops.data_ptr() + start * OP_WORDS * 8, ctypes.addressof(fail_idx), 0, stream_handle)
            if err != 0:
                bad = start + int(fail_idx.value)
                d, r, h = runs[bad] if 0 <= bad < n else (None, None, None)
                raise CopyLaunchError(f"cuMemcpy3DBatchAsync returned CUresult {err} (run {bad}: dst offset {d}, "
                                      f"slab row {r}, {h} rows of {width} bytes, pitch {src_pitch})")
        return n
