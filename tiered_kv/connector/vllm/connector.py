"""``TieredKVConnector``: tiered_kv as a vLLM KV connector (vLLM 0.26 - 0.33), no patch to vLLM.

Load it with::

    --kv-transfer-config '{"kv_connector":"TieredKVConnector",
      "kv_connector_module_path":"tiered_kv.connector.vllm","kv_role":"kv_both",
      "kv_connector_extra_config":{"cpu_bytes":"64GiB","disk_path":"/nvme/kv","disk_bytes":"1TiB"}}'

The class is a thin adapter. In the scheduler role (vLLM's EngineCore process) it wraps a
``SchedulerPlanner`` (``scheduler.py`` and its parts): lookups, load and store planning,
completions; with ``cpu_pool`` it also joins the host pool and runs the ``PoolWatch`` thread that tells
the planner what other processes stored there. In the worker role (one per GPU worker / TP rank) it
wraps a ``WorkerRuntime`` (``worker.py``): the rank's CPU slab (or the host pool) and disk tiers and the
movers that copy between them and vLLM's KV tensors. The two talk only through ``TieredKVMetadata`` (a ``StepPlan``, scheduler ->
workers, pickled by vLLM every step) and ``TieredKVWorkerMeta`` (per-job ``JobReport``s, workers
-> scheduler, merged over ranks by vLLM's ``KVOutputAggregator``); both messages are ``common.py``'s.

Version notes: only hooks present in both 0.26 and 0.33 are relied on (``get_finished``, not
``get_transfer_results``; ``start_load_kv(**kwargs)``; ``bind_gpu_block_pool`` is not used).
``handle_preemptions`` (fences) is optional: the fences also run in ``start_load_kv``.

Threading contract: vLLM calls scheduler-role methods on the EngineCore scheduler thread and
worker-role methods on the worker's model-runner thread; each role's state is touched by that
thread only (the worker's movers synchronize through ``WorkerRuntime``'s lock).
"""
from __future__ import annotations

import functools
import json
import logging
import operator
import os
import time
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from tiered_kv.errors import ConfigError
from tiered_kv.store.metrics import make_registry, serve
from tiered_kv.connector.vllm.config import (
    POOL_UNSTABLE_HASH_WARNING,
    UNSTABLE_HASH_WARNING,
    ConnectorConfig,
    capacities,
    check_pool,
    hash_identity,
    namespace,
    namespace_layout,
    pool_store_config,
    rank_disk_dir,
)
from tiered_kv.connector.vllm.common import JobReport, StepPlan
from tiered_kv.connector.vllm.forward_clock import ForwardClock
from tiered_kv.connector.vllm import hook_profile
from tiered_kv.connector.vllm.geometry import geometry
from tiered_kv.connector.vllm.sched_trace import SchedTrace, timed_sched_hook
from tiered_kv.connector.vllm.scheduler import SchedulerPlanner
from tiered_kv.connector.vllm.worker import WorkerRuntime

log = logging.getLogger(__name__)

__all__ = ["TieredKVConnector", "TieredKVMetadata", "TieredKVWorkerMeta", "TieredKVStats"]


@dataclass
class TieredKVMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step: the step's plan."""

    plan: StepPlan


@dataclass
class TieredKVWorkerMeta(KVConnectorWorkerMetadata):
    """Workers -> scheduler, once per step: outcomes of the jobs this rank finished, and the number of the step
    (``StepPlan.step``) whose output carries it (-1: none; the planner times steps with it, ``prefill_learn``)."""

    reports: dict[int, JobReport] = field(default_factory=dict)
    step: int = -1
    #: forwards this rank timed (``forward_clock.py``): ``{step: (seconds, loaded)}``; None: no clock (no
    #: ``prefill_learn``)
    forward: dict[int, tuple[float, bool]] | None = None

    def __bool__(self) -> bool:
        return bool(self.reports) or self.step >= 0 or bool(self.forward)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "TieredKVWorkerMeta":
        """Merge another rank's reports (vLLM calls this across TP workers)."""
        if not isinstance(other, TieredKVWorkerMeta):
            raise ConfigError(f"cannot aggregate TieredKVWorkerMeta with {type(other).__name__}")
        self.step = max(self.step, other.step)  # every rank ran the same step
        if other.forward is not None:  # a step's time is its slowest rank's
            mine_f = self.forward = self.forward if self.forward is not None else {}
            for s, (sec, loaded) in other.forward.items():
                old = mine_f.get(s)
                mine_f[s] = (sec, loaded) if old is None else (max(old[0], sec), old[1] or loaded)
        for job_id, rep in other.reports.items():
            mine = self.reports.get(job_id)
            if mine is None:
                self.reports[job_id] = JobReport(rep.count, list(rep.ok), list(rep.corrupt), rep.nbytes, rep.seconds,
                                                 list(rep.missing), list(rep.evicted))
            else:
                mine.merge(rep)
        return self


@dataclass
class TieredKVStats(KVConnectorStats):
    """Connector stats: plain numbers (bytes, seconds, counts) summed over workers and intervals."""

    def reset(self) -> None:
        """Start a new interval."""
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "TieredKVStats":
        """Sum another worker's numbers into these."""
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        """vLLM's log line of the interval: bytes moved, load/store GB/s where time was spent, failures and fence waits
        (the other counters, the hook seconds among them, stay in ``data``: the scheduler's ``stats()["workers_<key>"]``
        and the Prometheus ``tiered_kv_worker_*`` families; vLLM's logger keeps adding intervals it found empty into
        the next one, which would make a sum of hook time over an unknown span)."""
        data = self.data
        out = {k: data[k] for k in _FLOW_KEYS if data.get(k)}
        for what in ("load", "store"):
            secs = out.get(f"{what}_seconds", 0.0)
            if secs:
                out[f"{what}_gbps"] = round(out.get(f"bytes_{what}ed", 0) / secs / 1e9, 3)
        if data.get("fence_wait_seconds"):
            out["fence_wait_seconds"] = round(data["fence_wait_seconds"], 4)
        return out

    def is_empty(self) -> bool:
        """True when nothing moved in the interval (hook time alone is not logged)."""
        return not any(self.data.get(k) for k in _FLOW_KEYS)


def _log_from_env() -> None:
    """``TIERED_KV_LOG=debug|info|warning`` sends tiered_kv's own log to stderr at that level (once)."""
    level = os.environ.get("TIERED_KV_LOG", "").upper()
    root = logging.getLogger("tiered_kv")
    if level in ("DEBUG", "INFO", "WARNING", "ERROR") and not any(getattr(h, "_tkv", False) for h in root.handlers):
        handler = logging.StreamHandler()
        handler._tkv = True
        handler.setFormatter(logging.Formatter("%(created).3f tiered_kv %(levelname)s %(message)s"))
        root.addHandler(handler)
        root.setLevel(level)


def worker_rank() -> int:
    """This worker's tensor-parallel rank (0 when vLLM's TP group is not set up, e.g. in tests)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    try:
        return int(get_tensor_model_parallel_rank())
    except AssertionError:  # "tensor model parallel group is not initialized"
        return 0


def _timed_hook(fn):
    """Count the seconds one of vLLM's worker-side hooks holds vLLM's thread (``hook_<name>_seconds`` in the flow
    stats the scheduler sums); debug log: say when one call held it over 1 ms. With ``TIERED_KV_PROFILE`` set, run it
    under the worker's hook profile too."""
    name = fn.__name__
    key = f"hook_{name}_seconds"

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            if self._profile is not None:  # TIERED_KV_PROFILE (hook_profile.py)
                return self._profile.call(name, fn, self, *args, **kwargs)
            return fn(self, *args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            self._hook_s[key] = self._hook_s.get(key, 0.0) + dt
            if dt > 1e-3 and log.isEnabledFor(logging.DEBUG):
                log.debug("%s held vLLM's thread %.1f ms", name, dt * 1e3)

    return wrapper


class TieredKVConnector(KVConnectorBase_V1, SupportsHMA):
    """tiered_kv's vLLM connector: GPU blocks <-> pinned CPU <-> disk, keyed by vLLM's block hashes.

    ``SupportsHMA``: vLLM keeps its hybrid KV cache manager on, so sliding-window, Mamba and
    full-attention layers each get their own KV cache group (docs/vllm.md, "Hybrid models").
    """

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_from_env()
        if kv_cache_config is None:
            raise ConfigError("TieredKVConnector needs vLLM's kv_cache_config (vLLM >= 0.26)")
        self.cfg = ConnectorConfig.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        self.geo = geometry(vllm_config, kv_cache_config, self.cfg.chunk_blocks, self.cfg.mla_store_once)
        check_pool(self.cfg, self.geo)
        self.ident = hash_identity(str(vllm_config.cache_config.prefix_caching_hash_algo))
        if not self.ident.stable:
            if self.cfg.disk_path is not None:
                log.warning(UNSTABLE_HASH_WARNING, self.ident.algo)
            if self.cfg.cpu_pool is not None:
                log.warning(POOL_UNSTABLE_HASH_WARNING, self.ident.algo, self.cfg.cpu_pool)
            self.ident = type(self.ident)(self.ident.algo, "unstable", False)
        self.ns = namespace(self.cfg, self.geo, str(vllm_config.model_config.model), self.ident)
        if role == KVConnectorRole.SCHEDULER:  # engines (replicas, a restart) share chunks only under one namespace
            log.info("TieredKVConnector: key namespace %s (model %r%s); another engine shares this one's chunks "
                     "only with the same model string (or model_id), chunk geometry, hash and tenant_salt",
                     self.ns.prefix.hex(), self.ns.model, ", tenant_salt set" if self.cfg.tenant_salt else "")
        cpu_chunks, disk_chunks = capacities(self.cfg, self.geo)
        self._stats_sent: dict[str, float] = {}
        self._stats_at = 0.0  # monotonic time the last counters were shipped
        self._flow_sent: tuple = ()  # the flow counters (``_FLOW_KEYS``) as last shipped
        self._hook_s: dict[str, float] = {}  # worker: seconds vLLM's thread spent in each timed hook (_timed_hook)
        self._workers_flow: dict[str, float] = {}  # scheduler: the workers' flow stats (vLLM sums the ranks), summed
        self._out_reports: dict[int, JobReport] = {}
        self._out_invalid: set[int] = set()
        self._bound_step = -1  # worker: the step of the plan bound now (echoed to time steps, prefill_learn)
        self._forward: ForwardClock | None = None  # worker: times this rank's forwards (prefill_learn)
        self._profile = hook_profile.from_env() if role == KVConnectorRole.WORKER else None
        self.planner: SchedulerPlanner | None = None
        self.worker: WorkerRuntime | None = None
        self._prom_snapshot: dict = {}
        self._prom_at = 0.0
        self._presence = self._pool = None
        self._sched_trace: SchedTrace | None = None  # scheduler, ``trace_path``: steps scheduled and applied
        if role == KVConnectorRole.SCHEDULER:
            self._presence = self._open_presence()  # a wrong password or no cluster fails here, at start-up
            self._pool = self._open_pool()  # a pool of another geometry fails here, at start-up
            self.planner = SchedulerPlanner(self.cfg, self.geo, self.ns, cpu_chunks, disk_chunks,
                                            self._adoptable_keys(disk_chunks), presence=self._presence,
                                            pool=self._pool)
            if self._presence is not None:
                self.planner.sync_remote()  # what the fleet stored before this start, read by _open_presence
            self._sched_trace = SchedTrace(self.cfg.trace_path) if self.cfg.trace_path else None  # after what may fail
            kv_events = vllm_config.kv_events_config
            self._events_on = bool(kv_events is not None and kv_events.enable_kv_cache_events)
            if self._events_on:
                self.planner.enable_events()
            if self.cfg.metrics_port is not None:
                self._prom_snapshot = self._prom_stats()
                # the HTTP thread reads a snapshot the scheduler thread replaces: the planner is not thread-safe
                serve(make_registry(lambda: self._prom_snapshot, "vllm"), self.cfg.metrics_port)
        else:
            self._events_on = False
            self.worker = WorkerRuntime(self.cfg, self.geo, self.ns, worker_rank(), cpu_chunks, disk_chunks,
                                        shared_name=_shared_slab_name(vllm_config, self.ns))
            if not self.ident.stable and self.worker.disk is not None:
                self.worker.disk.delete(self.worker.disk.stored_keys())  # unnameable after a restart

    def _open_presence(self):
        """Scheduler role with ``remote_url``: the namespace's presence feed (its thread reads what the fleet stores;
        the planner takes it once per step without network I/O). It holds one plain connection to the stream's
        node, not a cluster client: no slot map in this process (see ``PresenceFeed``). Waits at most
        ``remote_timeout_s`` for the feed to read what the fleet stored before this start, so the first requests
        can hit it and the first steps do not take that backlog."""
        settings = self.cfg.remote_settings()
        if settings is None:
            return None
        from tiered_kv.tiers.remote import PresenceFeed, stream_key  # lazily: needs redis-py

        # finding the stream's node checks the login: a wrong password or no cluster fails the engine's start.
        # At most one read per remote_feed_interval_s (0.1 s: ten a second) while the fleet writes: a block stored
        # elsewhere is a hit here within about that long, and the feed thread takes the GIL from the scheduler
        # thread rarely.
        feed = PresenceFeed.standalone(settings, stream_key(settings.key_prefix, self.ns.prefix),
                                       min_interval_s=self.cfg.remote_feed_interval_s)
        if not feed.caught_up.wait(settings.op_timeout_s):
            log.info("TieredKVConnector: the presence feed has not read the fleet's stream through within %.1f s; "
                     "it goes on in the background", settings.op_timeout_s)
        log.info("TieredKVConnector: remote tier on %s (remote_write=%s)", settings.describe()["url"],
                 self.cfg.remote_write)
        return feed

    def _open_pool(self):
        """Scheduler role with ``cpu_pool``: join (or make) the host pool, unpinned (this process never reads its
        pages), and watch this namespace's records in it from a thread; the planner takes what the watch found once
        per step and before each lookup, without I/O. Its first listing (what the pool holds now) runs here."""
        if self.cfg.cpu_pool is None:
            return None
        from tiered_kv.tiers.pool import PoolTier, PoolWatch  # lazily: needs lmdb

        tier = PoolTier(namespace_layout(self.geo), self.cfg.cpu_pool, self.cfg.cpu_bytes, owner=self.ns.prefix,
                        weight=self.cfg.cpu_pool_weight, pin=False)
        try:
            watch = PoolWatch(tier, self.cfg.cpu_pool_poll_s)
        except BaseException:
            tier.close()
            raise
        log.info("TieredKVConnector: CPU tier is the host pool %s (%d chunks of %d bytes); a Python API process shares "
                 "this engine's chunks with TieredStore(%s)", self.cfg.cpu_pool, tier.capacity, tier.block_nbytes,
                 json.dumps(pool_store_config(self.cfg, self.geo, self.ns)))
        return watch

    def _adoptable_keys(self, disk_chunks: int) -> list[bytes]:
        """Keys every rank's disk directory holds from a previous engine (read-only open, after the integrity
        check in a child process: a damaged index adopts nothing; the rank's worker moves it aside)."""
        if not disk_chunks or not self.ident.stable:
            return []
        from tiered_kv.tiers.disk import DiskTier, check_index  # lazily: needs lmdb and zstandard

        common: dict[bytes, None] | None = None
        for rank in range(1 if self.geo.replicated else self.geo.tp_size):
            path = rank_disk_dir(self.cfg, self.ns, rank, self.geo.tp_size, self.geo.replicated)
            if not (path / "index").exists():
                return []
            report = check_index(path / "index")
            if not report["ok"]:
                log.error("TieredKVConnector: the disk index of %s is damaged (%s); adopting nothing from it",
                          path, report["error"])
                return []
            tier = DiskTier(self.geo.rank_layout(rank), path, 0, readonly=True, owner=self.ns.prefix)
            try:
                keys = tier.stored_keys()
            finally:
                tier.close()
            common = dict.fromkeys(keys) if common is None else {k: None for k in keys if k in common}
        return list(common or ())

    # ================================================================== scheduler role
    @timed_sched_hook
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens the tiers can load beyond the local hit, and whether the load is asynchronous.

        CPU-tier hits load inside the step by default (``load_mode`` "layerwise": vLLM schedules
        the request at once and the forward waits for each layer's bytes); disk hits always load
        asynchronously, between steps.
        """
        n = self.planner.match(request, num_computed_tokens)
        if n is None:  # hybrid model: its disk hit is moving to the CPU tier first; vLLM asks again next step
            return None, False
        return n, n > 0 and self.planner.load_async(request)

    @timed_sched_hook
    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Plan loads into the blocks vLLM allocated for an external hit (every KV cache group's); with no
        hit, start tracking the request (its chunks are stored as they are computed)."""
        ids = blocks.get_block_ids() if num_external_tokens > 0 else ()
        self.planner.allocated(request, ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        """This step's plan for the workers; the step's clock starts (``StepMeter``)."""
        t0 = time.perf_counter()
        plan = self.planner.build(scheduler_output)
        self.planner.steps.scheduled(plan.step, scheduler_output, self.planner.step_in_step)
        if self.cfg.metrics_port is not None and time.monotonic() - self._prom_at > 1.0:
            self._prom_at = time.monotonic()
            self._prom_snapshot = self._prom_stats()
        if self._sched_trace is not None:
            self._sched_trace.built(plan.step, scheduler_output, plan, time.perf_counter() - t0)
        return TieredKVMetadata(plan)

    def _prom_stats(self) -> dict:
        """What the Prometheus endpoint serves until the next refresh: the planner's numbers and the workers' counters
        summed (``tiered_kv.store.metrics``, ``workers``)."""
        return {**self.planner.store_stats(), "workers": dict(self._workers_flow)}

    def update_connector_output(self, connector_output) -> None:
        """A step's output arrived: stop its clock, apply the workers' job reports (merged over ranks by vLLM) and
        add their flow stats (``kv_connector_stats``, summed over ranks by vLLM) to ``stats()``'s ``workers_*``."""
        t0 = time.perf_counter()
        flow = getattr(connector_output, "kv_connector_stats", None)
        if flow is not None and not isinstance(flow, TieredKVStats):  # under vLLM's MultiConnector: ours among them
            flow = next((v for v in (getattr(flow, "data", None) or {}).values() if isinstance(v, TieredKVStats)), None)
        if flow is not None and flow.data:
            for k, v in flow.data.items():
                self._workers_flow[k] = self._workers_flow.get(k, 0) + v
        wm = connector_output.kv_connector_worker_meta
        if isinstance(wm, TieredKVWorkerMeta):
            if wm.step >= 0 or wm.forward:
                self.planner.steps.finished(wm.step, wm.forward)
            if wm.reports:
                self.planner.apply_reports(wm.reports)
            if self._sched_trace is not None and wm.step >= 0:
                self._sched_trace.applied(wm.step, time.perf_counter() - t0)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """Forget the request (vLLM's hybrid KV cache manager off: one group); never delays vLLM's frees."""
        self.planner.finished(request, (block_ids,))
        return False, None

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        """Forget the request (one block list per KV cache group); never delays vLLM's block frees (fences
        protect in-flight copies)."""
        self.planner.finished(request, block_ids)
        return False, None

    def has_pending_push_work(self) -> bool:
        """True while planned jobs wait to be handed to the workers (vLLM >= 0.33 keeps stepping)."""
        return self.planner.has_pending_work_to_ship()

    def take_events(self):
        """``BlockStored``/``BlockRemoved`` for the chunks this engine stored, per medium (CPU, DISK, REMOTE), since
        the last call; empty unless vLLM's ``--kv-events-config`` enables KV cache events."""
        if self.planner is None or not self._events_on:
            return ()
        records = self.planner.take_events()
        if not records:
            return ()
        from tiered_kv.connector.vllm.events import make_events  # noqa: PLC0415 (only with events on)

        return make_events(records, self.geo.hash_block_size)

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache: a dropped store is a future miss, never an error."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        """No layout wish: every per-layer layout is copied correctly (its order is in the key namespace)."""
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None) -> KVConnectorStats | None:
        """Rebuild stats shipped as a dict."""
        return TieredKVStats(data=dict(data)) if data is not None else TieredKVStats()

    def stats(self) -> dict:
        """Our own state for tests and logs: planner state (scheduler; with ``workers_<key>``, the flow counters of
        every rank summed: ``bytes_to_disk`` of a TP=2 MLA engine is rank 0's alone) or rank counters (worker)."""
        if self.planner is None:
            return self.worker.stats()
        return {**self.planner.stats(), **{f"workers_{k}": v for k, v in self._workers_flow.items()}}

    # ================================================================== worker role
    @property
    def prefer_cross_layer_blocks(self) -> bool:
        """vLLM 0.26: ask for one KV tensor with each block contiguous across layers (NHD layout only).

        A block is then one 2 MiB copy run (Llama-3-8B) instead of one 64 KiB run per layer: 32x
        fewer driver descriptors per load or store. The slot bytes are the same as with per-layer
        NHD tensors (layer-major, each layer in N,H,C order), so CPU and disk records are
        interchangeable. With HND the cross-layer tensor puts heads outside layers, which would
        cut a block into 8 KiB pieces: keep per-layer tensors then. vLLM 0.33 never asks.
        """
        cfg = getattr(self, "cfg", None)
        if cfg is None or not cfg.cross_layer_blocks:
            return False
        try:
            from vllm.v1.attention.backends.utils import get_kv_cache_layout

            return get_kv_cache_layout() == "NHD"
        except Exception:  # noqa: BLE001 - no layout helper in this vLLM: keep per-layer tensors
            return False

    def register_cross_layers_kv_cache(self, kv_cache, attn_backend) -> None:
        """vLLM 0.26: bind the cross-layer KV tensor through per-layer views of it (vLLM's own mapping)."""
        order = tuple(attn_backend.get_kv_cache_stride_order(include_num_layers_dimension=True))
        if len(order) != kv_cache.dim():
            raise ConfigError(f"TieredKVConnector: cross-layer KV tensor of shape {tuple(kv_cache.shape)} does not "
                              f"match the stride order {order} of {getattr(attn_backend, '__name__', attn_backend)}; "
                              f"set kv_connector_extra_config cross_layer_blocks=false")
        logical = kv_cache.permute(*[order.index(i) for i in range(len(order))])  # (layers, per-layer shape)
        views = {}
        for i, t in enumerate(self._kv_cache_config.kv_cache_tensors):
            for name in (getattr(t, "shared_by", None) or getattr(t, "layers", None) or ()):
                views[name] = logical[i]
        log.info("TieredKVConnector: cross-layer KV tensor %s bound as %d per-layer views",
                 tuple(kv_cache.shape), len(views))
        self.register_kv_caches(views)

    def register_kv_caches(self, kv_caches) -> None:
        """Bind vLLM's per-layer KV tensors; with ``prefill_learn``, start timing forwards on their device."""
        self.worker.register(kv_caches)
        if self.cfg.prefill_learn:
            self._forward = ForwardClock(self.worker.kv.device)

    @_timed_hook
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Take this step's plan."""
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, TieredKVMetadata):
            plan = connector_metadata.plan
            self._bound_step = plan.step if self.cfg.prefill_learn else -1
            self.worker.on_plan(plan)
            self.worker.store_gate.open()  # the last step's stores: its sampler and our inputs are enqueued
            if self.worker.trace is not None:
                self.worker.trace.bound()
            if self._forward is not None:  # the forward's clock starts here: 0.33 starts loads after its launch
                self._forward.begin(plan.step, bool(plan.sync))

    @_timed_hook
    def handle_preemptions(self, kv_connector_metadata=None, *args, **kwargs) -> None:
        """Before the batch is updated: wait for copies touching re-allocated blocks."""
        if isinstance(kv_connector_metadata, TieredKVMetadata):
            self.worker.on_plan(kv_connector_metadata.plan)
            self.worker.fence()

    @_timed_hook
    def start_load_kv(self, forward_context, **kwargs) -> None:
        """Start this step's loads and tier moves; in-step loads start before the forward reads them."""
        self.worker.before_forward(layerwise_ok=_runs_attention_eagerly(forward_context))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Make the forward's stream wait until this layer's in-step loads have landed (no host wait)."""
        if self._profile is not None:
            self._profile.call("wait_for_layer_load", self.worker.wait_layer, layer_name)
            return
        self.worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        """Stores are whole-block, after the forward (``wait_for_save``)."""

    @_timed_hook
    def wait_for_save(self) -> None:
        """Start this step's stores; returns at once."""
        if self._forward is not None:
            self._forward.end()
        self.worker.after_forward()

    @_timed_hook
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose loads all landed on this rank (stores never delay frees)."""
        res = self.worker.poll()
        self._out_reports.update(res.reports)
        self._out_invalid |= res.invalid_block_ids
        return None, (res.finished_recving or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """GPU blocks this rank's loads could not fill (vLLM recomputes them)."""
        out, self._out_invalid = self._out_invalid, set()
        return out

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """This step's job reports for the planner, and the step's number (with ``prefill_learn``: every step's
        output then calls the scheduler's ``update_connector_output``) with the forwards this rank timed since the
        last call (``forward_clock.py``)."""
        step, self._bound_step = self._bound_step, -1
        forward = self._forward.take() if self._forward is not None else None
        if forward and self.worker.trace is not None:
            self.worker.trace.forwards(forward)
        if not self._out_reports and step < 0 and not forward:
            return None
        out, self._out_reports = self._out_reports, {}
        return TieredKVWorkerMeta(out, step, forward)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This rank's counters and hook seconds since they were last shipped (worker), or None (scheduler). A step
        that moved nothing ships nothing until ``STATS_EVERY_S`` passed (its hook time waits in the next delta)."""
        if self.worker is None:
            return None
        counters = self.worker.counters  # plain numbers the movers add to: a copy without the lock is one snapshot
        flow = _flow_of(counters)
        now_s = time.monotonic()
        if flow == self._flow_sent and now_s - self._stats_at < STATS_EVERY_S:
            return None
        now = dict(vars(counters))
        now.update(self._hook_s)
        sent = self._stats_sent
        delta = {k: d for k, v in now.items() if (d := v - sent.get(k, 0))}
        self._stats_sent, self._stats_at, self._flow_sent = now, now_s, flow
        return TieredKVStats(data=delta) if delta else None

    def shutdown(self) -> None:
        """Finish queued jobs and close the tiers (worker); stop the presence feed and the pool watch (scheduler)."""
        if self.worker is not None:
            self.worker.close()
        if self._presence is not None:
            self._presence.close()
            self._presence = None
        if self.planner is not None:
            self.planner.steps.close()
        if self._sched_trace is not None:
            self._sched_trace.close()
        if self._pool is not None:
            self._pool.close()
            self._pool = None


def _shared_slab_name(vllm_config, ns) -> str:
    """Name of the shared-memory CPU slab of a replicated (MLA) cache: one per engine and namespace."""
    engine = str(vllm_config.kv_transfer_config.engine_id or "engine")
    return f"tkv-{engine[:36]}-{ns.prefix.hex()[:16]}"


def _runs_attention_eagerly(forward_context) -> bool:
    """True when this step's attention layers run outside a captured CUDA graph, so vLLM calls
    ``wait_for_layer_load`` for each (no forward context, or a full-graph replay: False)."""
    mode = getattr(forward_context, "cudagraph_runtime_mode", None)
    return getattr(mode, "name", None) in ("NONE", "PIECEWISE")


_FLOW_KEYS = ("bytes_loaded", "bytes_stored", "bytes_to_disk", "bytes_from_disk", "bytes_to_remote",
              "bytes_from_remote", "load_seconds", "store_seconds", "failed_items", "corrupt_items")
#: a worker step that moved nothing ships its counters (hook seconds, ...) at most this often
STATS_EVERY_S = 1.0
#: the flow counters of a rank's ``WorkerCounters``, read in one call (a step that moved nothing ships nothing)
_flow_of = operator.attrgetter(*_FLOW_KEYS)
