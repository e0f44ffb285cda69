"""Test harness: vLLM's real Scheduler/AsyncScheduler + our connector, worker side on CPU tensors.

``Engine`` plays EngineCore plus the model runner of one or more TP workers:

- the scheduler is vLLM's own (``Scheduler`` or ``AsyncScheduler``), which builds the
  scheduler-role ``TieredKVConnector`` itself from the ``KVTransferConfig``;
- each worker is a worker-role ``TieredKVConnector`` in this process, registered on per-layer
  CPU tensors shaped like vLLM's KV views ``(num_blocks, H, block_size, 2*D)``, and driven each
  step in the model runner's order (handle_preemptions, bind, forward, start_load_kv,
  wait_for_save, get_finished, load errors, stats, worker meta, clear);
- the "forward" writes, for every scheduled token, KV values that are a pure function of the
  token prefix (a rolling hash), so any block can be checked bit for bit against the tokens
  that produced it. Before each forward, every block a request is about to read (all blocks
  below its ``num_computed_tokens``) is checked: a wrong byte from a load fails the test;
- outputs go back through ``ModelRunnerOutput.kv_connector_output`` (merged over ranks with
  vLLM's ``KVOutputAggregator``), one step late under async scheduling, like EngineCore;
- the clocks that time steps for the learned prefill model read the harness's: each rank's forward clock
  (``ForwardClock.clock``, the one in use) is that rank's ``forward_clock``, which its forward advances by
  ``step_truth``'s time for the step's tokens; the planner's own step clock (``StepMeter.clock``, used only
  until a worker reports forwards) is ``step_clock``, advanced by the same plus 0.1 ms a step. ``step_truth``
  is by default the configured start model, so the model learned equals the configured one and the split
  decides as with ``prefill_learn: false``; a test sets another truth to see it learned.

Hybrid and MLA models (``Engine.create(..., shape=...)``, shapes in ``models.py``): vLLM's
hybrid KV cache manager is on, the ``KVCacheConfig`` comes from vLLM's own grouping code
(``get_kv_cache_configs``), every worker's KV tensors from vLLM's own ``allocate_kv_cache``
(so cache groups alias the same bytes, as on a GPU), and block tables from the scheduler's KV
cache manager (tables rebuilt from SchedulerOutput go stale for sliding windows). A forward
checks what it reads: every block of a full-attention or MLA layer, the window's blocks of a
sliding-window layer, the recurrent state of a Mamba layer; it writes each scheduled token's
KV bytes (a function of the token prefix, the layer and the head) and each Mamba layer's state
at the step's end.

Threading contract: single-threaded, except the connector's own mover threads.
"""
from __future__ import annotations

import json
import os
import pickle
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

import tests.connector.vllm.models as shapes
import tiered_kv.connector.vllm.connector as tkv_vllm
from tiered_kv.connector.vllm.connector import TieredKVConnector
from tiered_kv.planner.rates import PrefillModel
from tiered_kv.connector.vllm.stores import _resumed_ids

BS = 16
LAYERS = 2
HEADS = 2
HEAD = 16
EOS = 2
MOD = 2039  # values < 2048 are exact in float16

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HEADS * HEAD * 2,
    "intermediate_size": 128, "num_attention_heads": HEADS * 2, "num_key_value_heads": HEADS,
    "num_hidden_layers": LAYERS, "vocab_size": 1000, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": EOS,
}
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
MODULE_PATH = "tiered_kv.connector.vllm"  # kv_connector_module_path, as the README's long form gives it
_NONE_HASH_READY = False


def write_model_dir(path: str) -> str:
    """A model directory holding only a tiny Llama config.json (no weights, no tokenizer)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(TINY_LLAMA, f)
    return path


def make_vllm_config(model_dir: str, extra: dict, async_sched: bool = False, max_model_len: int = 2048,
                     max_batched: int = 256, tp: int = 1, hash_algo: str = "sha256", hma: bool = False,
                     dtype: str = "float16", module_path: str | None = MODULE_PATH) -> VllmConfig:
    """VllmConfig with our connector loaded by module path, like ``--kv-transfer-config`` does.

    ``module_path=None``: the connector named only, as vLLM finds it once the installed package's
    plugin registered it (``tiered_kv.connector.vllm.plugin``).

    ``hma``: vLLM's hybrid KV cache manager on (what a GPU platform gives a SupportsHMA connector;
    vLLM's CPU platform turns it off).
    """
    mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype=dtype, seed=0, max_model_len=max_model_len)
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_batched, max_model_len=max_model_len,
                         enable_chunked_prefill=True, is_encoder_decoder=False, disable_hybrid_kv_cache_manager=True)
    cc = CacheConfig(block_size=BS, gpu_memory_utilization=0.9, enable_prefix_caching=True,
                     prefix_caching_hash_algo=hash_algo)
    ktc = KVTransferConfig(kv_connector="TieredKVConnector", kv_connector_module_path=module_path,
                           kv_role="kv_both", kv_connector_extra_config=dict(extra),
                           kv_load_failure_policy="recompute")
    cfg = VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc, kv_transfer_config=ktc,
                     device_config=DeviceConfig("cpu"))
    cfg.scheduler_config.async_scheduling = async_sched
    cfg.parallel_config.tensor_parallel_size = tp
    if hma:
        cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
        if "kv_cache_layout" in vars(cfg.cache_config):  # vLLM 0.32: the engine core resolves it on a GPU
            cfg.cache_config.kv_cache_layout = "LBNHC"
    return cfg


def hybrid_kv_cache_configs(cfg: VllmConfig, shape: str, num_blocks: int):
    """(the workers' KVCacheConfig, the scheduler's) for ``shape``, grouped by vLLM's own code, about
    ``num_blocks`` blocks."""
    from vllm.v1.core import kv_cache_utils as ku

    specs = shapes.layer_specs(shape, cfg.model_config, BS)
    page = max(s.page_size_bytes for s in specs.values())
    probe = ku.get_kv_cache_configs(cfg, [specs], [page * len(specs) * num_blocks])[0]
    sizes = [t.size for t in probe.kv_cache_tensors]
    # vLLM 0.32: every KVCacheTensor describes one shared backing allocation; 0.26: one each
    total = sizes[0] if "layers" in vars(probe.kv_cache_tensors[0]) else sum(sizes)
    kvc = ku.get_kv_cache_configs(cfg, [specs], [total // probe.num_blocks * num_blocks])[0]
    return kvc, ku.generate_scheduler_kv_cache_config([kvc])


def allocate_worker_kv(kvc) -> dict[str, torch.Tensor]:
    """One worker's KV tensors: vLLM's own allocation where it has one (groups alias the same bytes)."""
    try:
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.utils import allocate_kv_cache
    except ImportError:  # vLLM 0.26: one buffer per KVCacheTensor, shared by one layer of each group
        return _allocate_kv_026(kvc)
    return allocate_kv_cache(kvc, torch.device("cpu"), KVCacheLayout.LBNHC)


def _allocate_kv_026(kvc) -> dict[str, torch.Tensor]:
    from vllm.v1.kv_cache_interface import MambaSpec

    spec_of = {n: g.kv_cache_spec for g in kvc.kv_cache_groups for n in g.layer_names}
    out = {}
    for t in kvc.kv_cache_tensors:
        buf = torch.zeros(t.size, dtype=torch.uint8)
        for name in t.shared_by:
            spec = spec_of[name]
            page = spec.page_size_bytes
            if isinstance(spec, MambaSpec):
                out[name] = buf.as_strided((kvc.num_blocks, 1, 1, spec.real_page_size_bytes), (page, 0, 0, 1))
                continue
            heads = int(spec.num_kv_heads)
            width = page // (spec.block_size * heads * spec.dtype.itemsize)  # K and V, or MLA's latent
            raw = buf.as_strided((kvc.num_blocks, heads, spec.block_size, width * spec.dtype.itemsize),
                                 (page, width * spec.dtype.itemsize, heads * width * spec.dtype.itemsize, 1))
            out[name] = raw.view(spec.dtype)
    return out


@dataclass(frozen=True)
class _Layer:
    """One layer as the harness writes and checks it."""

    name: str
    index: int  # model layer number (goes into its KV bytes)
    group: int
    kind: str  # full | swa | mamba
    window: int
    block_size: int


def _layers_of(kvc) -> list[_Layer]:
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

    out = []
    for gi, g in enumerate(kvc.kv_cache_groups):
        spec = g.kv_cache_spec
        kind = "mamba" if isinstance(spec, MambaSpec) else "swa" if isinstance(spec, SlidingWindowSpec) else "full"
        for name in g.layer_names:
            out.append(_Layer(name, int(name.split(".")[2]), gi, kind,
                              int(spec.sliding_window) if kind == "swa" else 0, int(spec.block_size)))
    return sorted(out, key=lambda x: x.index)


def step_output(new: list[tuple[str, int, int]], cached: list[tuple[str, int, int]]) -> SimpleNamespace:
    """The fields of a ``SchedulerOutput`` that the connector's step meter reads (``prefill.step_parts``), for
    requests ``(id, tokens scheduled, tokens computed before)``: ``new`` scheduled for the first time, ``cached``
    running on."""
    nst = {rid: n for rid, n, _ in new + cached}
    return SimpleNamespace(
        num_scheduled_tokens=nst, total_num_scheduled_tokens=sum(nst.values()),
        scheduled_new_reqs=[SimpleNamespace(req_id=rid, num_computed_tokens=c) for rid, _, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[rid for rid, _, _ in cached],
                                              num_computed_tokens=[c for _, _, c in cached]))


def prefix_hashes(token_ids: list[int], upto: int) -> torch.Tensor:
    """The rolling hash of every prefix ``token_ids[:p + 1]``, p < upto (int64)."""
    h = 0
    hs = []
    for t in token_ids[:upto]:
        h = (h * 1000003 + int(t) + 1) % (1 << 61)
        hs.append(h)
    return torch.tensor(hs, dtype=torch.int64)


def token_bytes(hashes: torch.Tensor, layer: int, heads: int, width: int, rank_heads: int = 0) -> torch.Tensor:
    """KV bytes ``(T, heads, width)`` of tokens with prefix hashes ``hashes`` in one layer.

    ``rank_heads``: this rank's first head (TP shards heads); MLA latents are the same on every rank (0).
    """
    hv = hashes.view(-1, 1, 1)
    head = (torch.arange(heads, dtype=torch.int64).view(1, -1, 1) + rank_heads) * 7907
    j = torch.arange(width, dtype=torch.int64).view(1, 1, -1) * 7919
    return ((hv * 31 + layer * 104729 + head + j) % 251).to(torch.uint8)


def state_bytes(prefix_hash: int, layer: int, width: int) -> torch.Tensor:
    """A Mamba layer's recurrent state after a prefix (its hash), as ``width`` bytes."""
    j = torch.arange(width, dtype=torch.int64) * 6007
    return ((prefix_hash % 1000003 * 17 + layer * 104729 + j) % 253).to(torch.uint8)


def kv_cache_config(num_blocks: int) -> KVCacheConfig:
    """One full-attention group over the tiny model's layers (what EngineCore derives on a GPU)."""
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float16)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(list(LAYER_NAMES), spec)])


class Nhd026Backend:
    """The two static methods of vLLM 0.26's FlashAttention backend that cross-layer registration
    reads, with the NHD answers (0.26 source: ``v1/attention/backends/flash_attn.py``). A stand-in
    because CI runs vLLM 0.32, whose backends no longer take ``include_num_layers_dimension``."""

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        return (num_blocks, num_kv_heads, block_size, 2 * head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False):
        return (1, 0, 3, 2, 4) if include_num_layers_dimension else (0, 2, 1, 3)


def register_cross_layer(conn, num_blocks: int) -> dict[str, torch.Tensor]:
    """Allocate a cross-layer tensor as vLLM 0.26 does (physical ``(B, L, N, H, 2D)``), register it, and
    return the per-layer logical views the harness writes and checks."""
    from vllm.v1.kv_cache_interface import KVCacheTensor

    order = Nhd026Backend.get_kv_cache_stride_order(include_num_layers_dimension=True)
    logical_shape = (LAYERS,) + Nhd026Backend.get_kv_cache_shape(num_blocks, BS, HEADS, HEAD)
    cross = torch.zeros(tuple(logical_shape[i] for i in order), dtype=torch.float16)
    page = BS * HEADS * 2 * HEAD * 2
    conn._kv_cache_config.kv_cache_tensors = [KVCacheTensor(size=page * num_blocks, layers=[n], layer_stride=page,
                                                           block_stride=page) for n in LAYER_NAMES]
    conn.register_cross_layers_kv_cache(cross, Nhd026Backend)
    logical = cross.permute(*[order.index(i) for i in range(len(order))])
    return {name: logical[i] for i, name in enumerate(LAYER_NAMES)}


def kv_values(token_ids: list[int], upto: int, rank: int = 0) -> torch.Tensor:
    """Reference KV for positions ``[0, upto)``: ``(upto, LAYERS, HEADS, 2*HEAD)`` float16, a function of the prefix."""
    h = 0
    hs = []
    for t in token_ids[:upto]:
        h = (h * 1000003 + int(t) + 1) % (1 << 61)
        hs.append(h)
    hv = torch.tensor(hs, dtype=torch.int64).view(-1, 1, 1, 1)
    lay = torch.arange(LAYERS, dtype=torch.int64).view(1, -1, 1, 1) * 104729
    head = (torch.arange(HEADS, dtype=torch.int64).view(1, 1, -1, 1) + rank * HEADS) * 7907
    j = torch.arange(2 * HEAD, dtype=torch.int64).view(1, 1, 1, -1) * 7919
    return ((hv * 31 + lay + head + j) % MOD).to(torch.float16)


@dataclass
class Worker:
    """One TP rank: a worker-role connector over per-layer CPU KV tensors."""

    connector: TieredKVConnector
    kv: dict[str, torch.Tensor]
    rank: int
    forward_clock: float = 0.0  # this rank's forward clock (``ForwardClock.clock``): advanced by each forward's truth


@dataclass
class Engine:
    """Scheduler + workers + the step loop. Build with ``Engine.create``."""

    cfg: VllmConfig
    sched: Scheduler
    workers: list[Worker]
    num_blocks: int
    async_sched: bool
    requests: dict[str, Request] = field(default_factory=dict)
    verified_blocks: int = 0
    sync_steps: int = 0  # steps vLLM flagged has_sync_kv_loads (in-step loads)
    discarded_reads: int = 0  # wrong blocks a forward read in a step that reported them as failed loads
    steps: int = 0
    #: tokens each request held when first scheduled (vLLM's local prefix hit plus the connector's)
    cached_at_start: dict[str, int] = field(default_factory=dict)
    shape: str | None = None  # a hybrid/MLA model of models.py (None: the tiny Llama)
    layers: list[_Layer] = field(default_factory=list)
    hash_block_size: int = BS
    kv_cache_config: KVCacheConfig | None = None  # the workers' (hybrid shapes)
    step_truth: PrefillModel | None = None  # each step's synthetic time (None: the configured start model)
    step_clock: float = 0.0  # the planner's step clock (seconds): advanced by step_truth's time of each step
    _forward_s: float = 0.0  # this step's forward time by step_truth (each rank's forward clock advances by it)
    _prev: tuple | None = None
    _tables: dict[str, list[int]] = field(default_factory=dict)
    _aggregator: KVOutputAggregator | None = None

    @classmethod
    def create(cls, model_dir: str, extra: dict, *, num_blocks: int = 64, async_sched: bool = False,
               tp: int = 1, max_batched: int = 256, hash_algo: str = "sha256", cross_layer: bool = False,
               shape: str | None = None, max_model_len: int = 2048, tweak=None,
               module_path: str | None = MODULE_PATH) -> "Engine":
        """Build a scheduler (which builds the scheduler-role connector) and ``tp`` worker-role connectors.

        ``cross_layer``: register each worker the way vLLM 0.26 does when the connector prefers
        cross-layer blocks (one block-outermost tensor, ``register_cross_layers_kv_cache``).
        ``shape``: a hybrid or MLA model of ``models.py`` (``model_dir`` from ``models.write_model_dir``);
        ``tweak(cfg)`` may adjust the VllmConfig before anything is built from it. ``module_path``: see
        ``make_vllm_config`` (the tiny Llama only).
        """
        global _NONE_HASH_READY
        if not _NONE_HASH_READY:
            init_none_hash(sha256)  # EngineCore does this once per process
            _NONE_HASH_READY = True
        if shape is not None:
            return cls._create_shaped(model_dir, extra, shape, num_blocks, async_sched, tp, max_batched, hash_algo,
                                      max_model_len, tweak)
        cfg = make_vllm_config(model_dir, extra, async_sched=async_sched, max_batched=max_batched, tp=tp,
                               hash_algo=hash_algo, max_model_len=max_model_len, module_path=module_path)
        if tweak is not None:
            tweak(cfg)
        kvc = kv_cache_config(num_blocks)
        cfg.cache_config.num_gpu_blocks = num_blocks
        cls_ = AsyncScheduler if async_sched else Scheduler
        sched = cls_(vllm_config=cfg, kv_cache_config=kvc, structured_output_manager=StructuredOutputManager(cfg),
                     block_size=BS, log_stats=True)
        workers = []
        for rank in range(tp):
            original = tkv_vllm.worker_rank
            tkv_vllm.worker_rank = lambda r=rank: r  # each simulated rank gets its own slab and disk dir
            try:
                conn = TieredKVConnector(cfg, KVConnectorRole.WORKER, kvc)
            finally:
                tkv_vllm.worker_rank = original
            if cross_layer:
                kv = register_cross_layer(conn, num_blocks)
            else:
                kv = {name: torch.zeros((num_blocks, HEADS, BS, 2 * HEAD), dtype=torch.float16) for name in LAYER_NAMES}
                conn.register_kv_caches(kv)
            workers.append(Worker(conn, kv, rank))
        return cls(cfg, sched, workers, num_blocks, async_sched)._with_step_clock()

    @classmethod
    def _create_shaped(cls, model_dir, extra, shape, num_blocks, async_sched, tp, max_batched, hash_algo,
                       max_model_len, tweak) -> "Engine":
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        cfg = make_vllm_config(model_dir, extra, async_sched=async_sched, max_batched=max_batched, tp=tp,
                               hash_algo=hash_algo, hma=True, dtype="bfloat16", max_model_len=max_model_len)
        if shape == "mamba":
            cfg.cache_config.mamba_cache_mode = "align"
            cfg.cache_config.mamba_block_size = BS
        if tweak is not None:
            tweak(cfg)
        kvc, sched_kvc = hybrid_kv_cache_configs(cfg, shape, num_blocks)
        sbs, hbs = resolve_kv_cache_block_sizes(sched_kvc, cfg)
        cfg.cache_config.num_gpu_blocks = sched_kvc.num_blocks
        cls_ = AsyncScheduler if async_sched else Scheduler
        sched = cls_(vllm_config=cfg, kv_cache_config=sched_kvc,
                     structured_output_manager=StructuredOutputManager(cfg), block_size=sbs, log_stats=True)
        workers = []
        for rank in range(tp):
            original = tkv_vllm.worker_rank
            tkv_vllm.worker_rank = lambda r=rank: r
            try:
                conn = TieredKVConnector(cfg, KVConnectorRole.WORKER, kvc)
            finally:
                tkv_vllm.worker_rank = original
            kv = allocate_worker_kv(kvc)
            conn.register_kv_caches(kv)
            workers.append(Worker(conn, kv, rank))
        return cls(cfg, sched, workers, sched_kvc.num_blocks, async_sched, shape=shape, layers=_layers_of(kvc),
                   hash_block_size=hbs, kv_cache_config=kvc)._with_step_clock()

    def _with_step_clock(self) -> "Engine":
        """The planner's step clock reads ``step_clock`` (see the module)."""
        planner = self.connector.planner
        if self.step_truth is None:
            self.step_truth = planner.steps.estimator.start
        planner.steps.clock = lambda: self.step_clock
        for w in self.workers:
            fc = w.connector._forward
            if fc is not None:
                fc.clock = lambda w=w: w.forward_clock
        return self

    @property
    def connector(self) -> TieredKVConnector:
        """The scheduler-role connector vLLM built."""
        return self.sched.connector

    # ------------------------------------------------------------------ requests
    def add(self, req_id: str, prompt: list[int], max_tokens: int = 2) -> Request:
        """Add a request (block hashes computed by vLLM's own hasher)."""
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sp.update_from_generation_config({}, EOS)
        req = Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=sp, pooling_params=None,
                      block_hasher=get_request_block_hasher(self.hash_block_size, sha256))
        self.requests[req_id] = req
        self.sched.add_request(req)
        return req

    def abort(self, req_id: str) -> None:
        """Abort a request the way the engine does on client disconnect."""
        self.sched.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    # ------------------------------------------------------------------ stepping
    def step(self) -> bool:
        """One engine step: schedule, run every worker, apply outputs (one step late when async).

        Returns whether any token was scheduled."""
        out = self.sched.schedule()
        if self.async_sched and self._prev is not None:
            self.sched.update_from_output(*self._prev)
            self._prev = None
        parts = [(out.num_scheduled_tokens[n.req_id], n.num_computed_tokens) for n in out.scheduled_new_reqs]
        c = out.scheduled_cached_reqs
        parts += [(out.num_scheduled_tokens[rid], c.num_computed_tokens[i]) for i, rid in enumerate(c.req_ids)]
        self._forward_s = self.step_truth.step_seconds(parts)  # each rank's forward takes this (``_run_worker``)
        self.step_clock += self._forward_s + 1e-4  # the forward, and a step's fixed cost
        mro = self._run_workers(out)
        if self.async_sched:
            self._prev = (out, mro)
        else:
            self.sched.update_from_output(out, mro)
        self.steps += 1
        return bool(out.total_num_scheduled_tokens)

    def flush(self) -> None:
        """Apply the output still held back by async scheduling."""
        if self._prev is not None:
            self.sched.update_from_output(*self._prev)
            self._prev = None

    def run(self, max_steps: int = 2000, until=None, timeout: float = 60.0) -> None:
        """Step until no request is left (or ``until()`` is true); idle steps yield to the movers."""
        import time

        deadline = time.monotonic() + timeout
        for _ in range(max_steps):
            if until is not None and until():
                return
            if until is None and not self.sched.has_requests():
                self.flush()
                if not self.sched.has_requests():
                    return
            if time.monotonic() > deadline:
                break
            if not self.step():
                time.sleep(0.002)  # nothing ran: a real step takes milliseconds too
        raise AssertionError(f"engine did not converge in {max_steps} steps / {timeout} s: "
                             f"{ {r: q.status.name for r, q in self.requests.items()} }")

    def settle(self, timeout: float = 20.0) -> None:
        """Step (empty steps if need be) until every connector job finished and was applied."""
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.step()
            self.flush()
            st = self.connector.stats()
            if (st["inflight_jobs"] == 0 and not self.connector.planner.has_pending_work_to_ship()
                    and all(w.connector.worker.idle() for w in self.workers)):
                return
            time.sleep(0.002)
        raise AssertionError(f"connector did not settle: {self.connector.stats()}")

    def _run_workers(self, out) -> ModelRunnerOutput:
        for new in out.scheduled_new_reqs:
            self.cached_at_start.setdefault(new.req_id, new.num_computed_tokens)
        rows = self._scheduled(out)
        outputs = [self._run_worker(w, out, rows) for w in self.workers]
        if len(outputs) == 1:
            return outputs[0]
        if self._aggregator is None:  # one per engine: it counts ranks across steps
            self._aggregator = KVOutputAggregator(len(outputs))
        return self._aggregator.aggregate(outputs)

    def _run_worker(self, w: Worker, out, rows) -> ModelRunnerOutput:
        conn = w.connector
        # vLLM pickles the scheduler output to every worker process: do the same, so each rank
        # gets its own copy and anything unpicklable fails here.
        meta = pickle.loads(pickle.dumps(out.kv_connector_metadata))
        conn.handle_preemptions(meta)
        conn.bind_connector_metadata(meta)
        # vLLM 0.33 starts loads before the forward only in steps with in-step ("sync") loads,
        # otherwise after the forward launch; 0.26 always before (no has_sync_kv_loads there)
        before = getattr(out, "has_sync_kv_loads", True)
        if before:
            conn.start_load_kv(None)
        for name in LAYER_NAMES:  # what every attention layer does on entry
            conn.wait_for_layer_load(name)
        wrong = self._verify_inputs(rows, [w])
        self.sync_steps += bool(getattr(out, "has_sync_kv_loads", False))
        self._forward(w, rows)
        w.forward_clock += self._forward_s
        if not before:
            conn.start_load_kv(None)
        conn.wait_for_save()
        sending, recving = conn.get_finished(out.finished_req_ids)
        invalid = conn.get_block_ids_with_load_errors()
        # wrong KV read by this step's forward is only allowed in blocks the connector reports as
        # failed loads in this same step: vLLM then discards the step's output and recomputes them
        unreported = [(msg, g) for msg, g in wrong if g not in invalid]
        if unreported:
            raise AssertionError(unreported[0][0])
        self.discarded_reads += len(wrong)
        kv_out = KVConnectorOutput(
            finished_sending=sending, finished_recving=recving,
            invalid_block_ids=invalid,
            kv_connector_stats=conn.get_kv_connector_stats(),
            kv_connector_worker_meta=pickle.loads(pickle.dumps(conn.build_connector_worker_meta())))
        conn.clear_connector_metadata()
        ids = [rid for rid, _, _, _ in rows]
        sampled = [[self._sample(rid)] if done + n >= self.requests[rid].num_prompt_tokens else []
                   for rid, done, n, _ in rows]
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                                 pooler_output=None, kv_connector_output=kv_out)

    def _scheduled(self, out) -> list[tuple[str, int, int, list[int]]]:
        """(req_id, num_computed_before, num_scheduled, block table) of every scheduled request.

        Hybrid shapes: the block table is the KV cache manager's, one list per group.
        """
        if self.shape is not None:
            rows = [(new.req_id, new.num_computed_tokens) for new in out.scheduled_new_reqs]
            c = out.scheduled_cached_reqs
            rows += [(rid, c.num_computed_tokens[i]) for i, rid in enumerate(c.req_ids)]
            manager = self.sched.kv_cache_manager
            return [(rid, done, out.num_scheduled_tokens[rid], [list(t) for t in manager.get_block_ids(rid)])
                    for rid, done in rows]
        tables = self._tables
        rows = []
        for new in out.scheduled_new_reqs:
            tables[new.req_id] = list(new.block_ids[0])
            rows.append((new.req_id, new.num_computed_tokens, out.num_scheduled_tokens[new.req_id]))
        c = out.scheduled_cached_reqs
        resumed = _resumed_ids(c) if c.req_ids else set()
        for i, rid in enumerate(c.req_ids):
            if c.new_block_ids[i] is not None:
                if rid in resumed:
                    tables[rid] = list(c.new_block_ids[i][0])
                else:
                    tables.setdefault(rid, []).extend(c.new_block_ids[i][0])
            rows.append((rid, c.num_computed_tokens[i], out.num_scheduled_tokens[rid]))
        return [(rid, done, n, list(tables[rid])) for rid, done, n in rows]

    def _verify_inputs(self, rows, workers) -> list[tuple[str, int]]:
        """Every block below a request's computed tokens must hold that prefix's KV, on these ranks.

        Returns ``(message, GPU block id)`` for every wrong block (the caller decides whether vLLM
        would have used it).
        """
        if self.shape is not None:
            return self._verify_shaped(rows, workers)
        wrong: list[tuple[str, int]] = []
        for rid, done, _, table in rows:
            nblk = done // BS
            if nblk == 0:
                continue
            req = self.requests[rid]
            ids = torch.tensor(table[:nblk])
            for w in workers:
                ref = kv_values(req.all_token_ids, nblk * BS, w.rank)  # (T, L, H, 2D)
                for li, name in enumerate(LAYER_NAMES):
                    got = w.kv[name][ids]  # (nblk, H, BS, 2D)
                    want = ref[:, li].reshape(nblk, BS, HEADS, 2 * HEAD).transpose(1, 2)
                    if not torch.equal(got, want):
                        bad = [i for i in range(nblk) if not torch.equal(got[i], want[i])]
                        msg = (f"request {rid}: blocks {bad[:8]} (GPU ids {[table[i] for i in bad[:8]]})"
                               f" of layer {li} on rank {w.rank} hold wrong KV before the forward")
                        wrong.extend((msg, table[i]) for i in bad)
            self.verified_blocks += nblk
        return wrong

    # ------------------------------------------------------------------ hybrid shapes
    def _layer_view(self, w: Worker, layer: _Layer) -> torch.Tensor:
        """The layer's KV as bytes: ``(blocks, heads, block_size, bytes per head)``; Mamba ``(blocks, 1, 1, state)``."""
        t = w.kv[layer.name]
        return t.view(torch.uint8) if t.dtype != torch.uint8 else t

    def _rank_heads(self, w: Worker, heads: int) -> int:
        return 0 if self.shape == "dsv2" else w.rank * heads  # MLA latents are the same on every rank

    def _verify_shaped(self, rows, workers) -> list[tuple[str, int]]:
        wrong: list[tuple[str, int]] = []
        for rid, done, _, tables in rows:
            if done == 0:
                continue
            req = self.requests[rid]
            hashes = prefix_hashes(req.all_token_ids, done)
            for w in workers:
                for layer in self.layers:
                    view = self._layer_view(w, layer)
                    table, bs = tables[layer.group], layer.block_size
                    if layer.kind == "mamba":
                        pos = -(-done // bs) - 1
                        want = state_bytes(int(hashes[done - 1]), layer.index, view.shape[-1])
                        if not table[pos] or not torch.equal(view[table[pos], 0, 0], want):
                            wrong.append((f"request {rid}: Mamba state of layer {layer.index} at token {done} "
                                          f"(block {table[pos]}) is wrong on rank {w.rank}", table[pos]))
                        self.verified_blocks += 1
                        continue
                    first = max(0, (done - layer.window + 1) // bs) if layer.kind == "swa" else 0
                    last = done // bs
                    if last <= first:
                        continue
                    ids = table[first:last]
                    if 0 in ids:
                        wrong.append((f"request {rid}: layer {layer.index} reads null block at position "
                                      f"{first + ids.index(0)} (computed {done})", 0))
                        continue
                    heads, width = view.shape[1], view.shape[3]
                    want = token_bytes(hashes[first * bs:last * bs], layer.index, heads, width,
                                       self._rank_heads(w, heads))
                    want = want.view(last - first, bs, heads, width).transpose(1, 2)
                    got = view[torch.tensor(ids)]
                    if not torch.equal(got, want):
                        bad = [i for i in range(len(ids)) if not torch.equal(got[i], want[i])]
                        msg = (f"request {rid}: blocks at positions {[first + i for i in bad[:8]]} (GPU ids "
                               f"{[ids[i] for i in bad[:8]]}) of layer {layer.index} ({layer.kind}) on rank "
                               f"{w.rank} hold wrong KV before the forward (computed {done})")
                        wrong.extend((msg, ids[i]) for i in bad)
                    self.verified_blocks += len(ids)
        return wrong

    def _forward_shaped(self, w: Worker, rows) -> None:
        for rid, done, n, tables in rows:
            req = self.requests[rid]
            end = min(done + n, len(req.all_token_ids))
            if end <= done:
                continue
            hashes = prefix_hashes(req.all_token_ids, end)
            pos = torch.arange(done, end)
            for layer in self.layers:
                view = self._layer_view(w, layer)
                table, bs = torch.tensor(tables[layer.group]), layer.block_size
                if layer.kind == "mamba":  # the state after this step, in the block of its last token
                    view[int(table[-(-end // bs) - 1]), 0, 0] = state_bytes(int(hashes[end - 1]), layer.index,
                                                                           view.shape[-1])
                    continue
                heads, width = view.shape[1], view.shape[3]
                vals = token_bytes(hashes[done:end], layer.index, heads, width, self._rank_heads(w, heads))
                view[table[pos // bs], :, pos % bs, :] = vals

    def _forward(self, w: Worker, rows) -> None:
        """Write the KV of every scheduled token whose id is known (prompt and applied outputs)."""
        if self.shape is not None:
            return self._forward_shaped(w, rows)
        for rid, done, n, table in rows:
            req = self.requests[rid]
            end = min(done + n, len(req.all_token_ids))
            if end <= done:
                continue
            vals = kv_values(req.all_token_ids, end, w.rank)[done:end]  # (n, L, H, 2D)
            pos = torch.arange(done, end)
            blocks = torch.tensor(table)[pos // BS]
            offs = pos % BS
            for li, name in enumerate(LAYER_NAMES):
                w.kv[name][blocks, :, offs, :] = vals[:, li]

    def _sample(self, rid: str) -> int:
        return 10 + (len(self.requests[rid].output_token_ids) * 37 + len(rid)) % 900

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Shut the worker connectors down (flushes and closes their tiers), then the scheduler's."""
        for w in self.workers:
            w.connector.shutdown()
        self.connector.shutdown()


class Gate:
    """Holds every job a worker's movers start, and every asynchronous load its ``AsyncLoader`` submits
    (not seen landed), until opened.

    With ``open_on_fence`` the gate opens by itself when the worker starts waiting on a fence
    (a re-allocated block whose copy is held), so a test can hold copies in flight across
    steps without dead-locking the step that needs them; ``fenced`` says whether that happened.
    """

    def __init__(self, runtime, open_on_fence: bool = False) -> None:
        self.event = threading.Event()
        self.started = 0
        self.fenced = False
        self._movers = [m for m in (runtime.front, runtime.back) if m is not None]
        for m in self._movers:
            m._execute = self._wrap(m._execute)  # the mover thread looks it up at each job
        loader = runtime.async_loads  # asynchronous CPU loads: submitted in a batch, seen landed in poll
        if loader is not None:
            start, landed, wait = loader.start, loader.landed, loader.wait

            def gated_start(jobs, *args, **kwargs):
                self.started += len(jobs)
                return start(jobs, *args, **kwargs)

            def gated_landed():
                return landed() if self.event.is_set() else []

            def gated_wait(job_ids=None):
                self.event.wait()
                return wait(job_ids)

            loader.start, loader.landed, loader.wait = gated_start, gated_landed, gated_wait
        if open_on_fence:
            original = runtime.fence

            def fence():
                plan = runtime._plan
                if plan is not None and plan.fences:
                    self.fenced = True
                    self.event.set()
                original()

            runtime.fence = fence

    def _wrap(self, fn):
        def gated(job):
            self.started += 1
            self.event.wait()
            return fn(job)
        return gated

    def open(self) -> None:
        """Let the held jobs run."""
        self.event.set()
