"""GPU <-> pinned CPU data path: batched block/slot copies for every engine KV layout.

Role: converts between an engine's KV tensors (vLLM per-layer or cross-layer,
SGLang device or host pools; MHA or MLA; any dtype) and block-major slab slots
(one engine block, all layers, contiguous). Pieces:

- ``layouts``: ``KVLayout`` (the tensors + block dim) and the slot byte format;
- ``segments``: per-call byte runs (adjacent ones merged) and 2-D rectangles (pure CPU torch);
- ``testing``: engine-shaped tensors and an independent reference (tests, benchmarks);
- ``engine``: the copy engine (``cuMemcpyBatchAsync`` and ``cuMemcpy2DAsync`` via cuda-python);
- ``triton_kernel``: the SM kernel (Triton, UVA) for many tiny runs;
- ``staged``: loads as one DMA per run of adjacent slots into a device buffer, then an on-device scatter;
- ``cpu``: the CPU fallback with identical semantics;
- ``select``: the measured rule that picks a mechanism per call;
- ``dispatch``: per-copier CUDA state: descriptor form, slice-by-slice planning and submission;
- ``submit``: the per-direction submitter thread and ``CopyResult``;
- ``copier``: ``BlockCopier``, the interface callers use.

Importing this package needs torch only: CUDA, Triton and cuda-python are
imported on first use. Threading contracts are in each module's docstring.
"""

from tiered_kv.copy.copier import BlockCopier, allocate_slab, prepare_copier, warm_copy_paths, warm_sm_kernel
from tiered_kv.copy.errors import BackendUnavailableError, BlockIndexError, CopyLaunchError, LayoutError
from tiered_kv.copy.layouts import (
    KVLayout,
    TensorBlockMap,
    block_geometry,
    sglang_device_layout,
    sglang_host_layout,
    vllm_cross_layer_layout,
    vllm_layer_layout,
)
from tiered_kv.copy.segments import ChunkTable, Rects, RectTable, Runs, merge_runs, plan_rects, plan_runs, split_runs
from tiered_kv.copy.select import Mechanism, SelectionPolicy, choose_mechanism
from tiered_kv.copy.submit import CopyResult

__all__ = [
    "BackendUnavailableError",
    "BlockCopier",
    "BlockIndexError",
    "ChunkTable",
    "CopyLaunchError",
    "CopyResult",
    "KVLayout",
    "LayoutError",
    "Mechanism",
    "RectTable",
    "Rects",
    "Runs",
    "SelectionPolicy",
    "TensorBlockMap",
    "allocate_slab",
    "block_geometry",
    "choose_mechanism",
    "merge_runs",
    "plan_rects",
    "plan_runs",
    "sglang_device_layout",
    "sglang_host_layout",
    "split_runs",
    "vllm_cross_layer_layout",
    "vllm_layer_layout",
    "prepare_copier",
    "warm_copy_paths",
    "warm_sm_kernel",
]
