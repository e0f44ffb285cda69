"""One ``vllm serve`` command line and environment per mode (which KV connector, with which settings).

Families and the connector each one configures (vLLM 0.26 on the GPU machine):

- ``none``        no connector: every prefix that left the GPU is recomputed; ``none-resident``
                  gives the engine a GPU KV cache that holds the whole run's history (no prefix
                  ever leaves the GPU): the engine's own floor, which no connector can beat
- ``offloading``  vLLM's ``OffloadingConnector`` (CPU); ``offloading-fs`` adds vLLM's own disk
                  path: ``TieringOffloadingSpec`` with an ``fs`` secondary tier (write-through)
- ``simple``      vLLM's ``SimpleCPUOffloadConnector``; ``simple-lazy`` stores only what the GPU
                  prefix cache is about to drop (``lazy_offload``, vLLM PR #37160's behaviour)
- ``tiered``      ours: ``TieredKVConnector`` from ``tiered_kv.connector.vllm`` (the repo must be
                  on the server's PYTHONPATH; it is added); ``metrics_port`` exposes per-tier
                  counters; ``tiered-disk`` = a small CPU tier + the disk tier; ``tiered-async``,
                  ``tiered-adaptive``, ``tiered-staged``, ``tiered-copyengine``,
                  ``tiered-adaptive-staged``: ``load_mode`` / ``in_step_copy`` variants; ``tiered-resident``:
                  ours with the floor's GPU cache (nothing loads: its traced steps are the floor's);
                  ``tiered-pool``: the CPU tier is a host pool in ``/dev/shm`` that every replica of
                  an engine start joins (``cpu_pool: host:<name>``, ``cpu_bytes`` the same in each;
                  ``with_pool`` gives each start its own name; ``serve_bench.py --replicas``)
- ``lmcache``     ``LMCacheConnectorV1`` (LMCache 0.5.3's adapter), configured by ``LMCACHE_*``
                  environment variables; ``lmcache-disk`` adds its local disk backend

Every mode of a shape gets the same CPU bytes (``cpu_gib``), or in the disk variants the same
smaller CPU tier (``disk_cpu_gib``) plus a disk tier in its own directory under ``disk_root``,
wiped before and after each engine start (vLLM's fs tier has no size limit).

New variants: ``define(name, json)`` derives a mode from the longest built-in (or defined) mode
name that prefixes it, e.g. ``tiered-g1={"load_groups": 1}``; the key ``env`` sets the server's
environment instead (``{"env": {"VLLM_USE_V2_MODEL_RUNNER": "0"}}``); family-wide extras apply to every
mode of a family (``--tiered-extra '{"store_policy": "on_finish"}'``). Order: built-in settings,
then family extras, then the definition's own keys. LMCache keys are config keys
(``chunk_size``), written as ``LMCACHE_CHUNK_SIZE``.
"""
from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field, replace

FAMILIES = ("none", "offloading", "simple", "tiered", "lmcache")
TIERED_MODULE = "tiered_kv.connector.vllm"
BLOCK_SIZE = 16  # vLLM's GPU block (tokens); our chunk = chunk_blocks of these

#: the server environment of the ``-v1runner`` modes: vLLM's V1 model runner (0.26 runs dense models on V2)
V1_RUNNER_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0"}

#: name -> (family, settings over the family's defaults, has a disk tier)
BUILTIN: dict[str, tuple[str, dict, bool]] = {
    "none": ("none", {}, False),
    # the floor of any connector: every prefix stays in vLLM's GPU prefix cache (serve_bench sizes it)
    "none-resident": ("none", {"gpu_resident": True}, False),
    "offloading": ("offloading", {}, False),
    "offloading-fs": ("offloading", {}, True),
    "simple": ("simple", {"lazy_offload": False}, False),
    "simple-lazy": ("simple", {"lazy_offload": True}, False),
    "tiered": ("tiered", {}, False),
    "tiered-onfinish": ("tiered", {"store_policy": "on_finish"}, False),
    # issue 14, bursts at c8/c32: where the CPU hits of a step load (docs/vllm.md, "Adaptive load admission")
    "tiered-async": ("tiered", {"load_mode": "async"}, False),
    "tiered-adaptive": ("tiered", {"load_mode": "adaptive"}, False),
    # in-step layer groups all submitted before the forward (the default until 2026-11-28); the default
    # "pipelined" submits the later ones between the forward's layers
    "tiered-upfront": ("tiered", {"load_submit": "upfront"}, False),
    "tiered-staged": ("tiered", {"in_step_copy": "staged"}, False),
    # every in-step copy on the copy engine (the default until in_step_copy "auto", 2026-11-28)
    "tiered-copyengine": ("tiered", {"in_step_copy": "copy_engine"}, False),
    "tiered-adaptive-staged": ("tiered", {"load_mode": "adaptive", "in_step_copy": "staged"}, False),
    # in-step loads on a Triton kernel (far less time on vLLM's thread per GiB), and vLLM's V1 model runner,
    # which hands over the cross-layer KV tensor (one copy run per block instead of one per layer)
    "tiered-smk": ("tiered", {"in_step_copy": "sm_kernel"}, False),
    "tiered-v1runner": ("tiered", {"env": V1_RUNNER_ENV}, False),
    "offloading-v1runner": ("offloading", {"env": V1_RUNNER_ENV}, False),
    # the V1 runner's own floor (it may prefill faster than V2), and our load modes on it
    "none-resident-v1runner": ("none", {"gpu_resident": True, "env": V1_RUNNER_ENV}, False),
    "tiered-async-v1runner": ("tiered", {"load_mode": "async", "env": V1_RUNNER_ENV}, False),
    "tiered-adaptive-v1runner": ("tiered", {"load_mode": "adaptive", "env": V1_RUNNER_ENV}, False),
    # issue 33: one CPU tier for every replica of a start, a host pool (with_pool names it per start)
    "tiered-pool": ("tiered", {"cpu_pool": "host:serve-bench"}, False),
    # ours beside the floor's GPU cache: nothing leaves the GPU, so nothing loads; with --trace its steps (ours'
    # stores included) are the floor's, for a loading step of ``tiered`` to be set against (issue 31)
    "tiered-resident": ("tiered", {"gpu_resident": True}, False),
    "tiered-disk": ("tiered", {}, True),
    "tiered-disk-always": ("tiered", {"disk_load_policy": "always"}, True),
    "lmcache": ("lmcache", {}, False),
    "lmcache-c16": ("lmcache", {"chunk_size": 16}, False),
    "lmcache-disk": ("lmcache", {}, True),
}

#: set for every mode; the GPU image has no FlashInfer (the sampler would import it), no network
COMMON_ENV = {
    "VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1", "VLLM_HOST_IP": "127.0.0.1",
    "PYTHONHASHSEED": "0",  # vLLM's block hashes (and file names on disk) the same in every start
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DO_NOT_TRACK": "1",
}


@dataclass(frozen=True)
class Sizes:
    """Tier sizes shared by all modes of a run (GiB)."""

    cpu_gib: int
    disk_cpu_gib: int
    disk_gib: int
    disk_root: str


@dataclass(frozen=True)
class ModeSpec:
    """Everything mode-specific about one engine start."""

    name: str
    family: str
    kv_transfer: dict | None
    env: dict = field(default_factory=dict)
    disk_dir: str | None = None
    metrics_port: int | None = None  # ours: the connector's Prometheus endpoint
    chunk_tokens: int = 0  # ours: tokens per chunk (what one tier hit loads)
    gpu_resident: bool = False  # give vLLM a GPU KV cache that holds the run's whole history (the floor)


class ModeRegistry:
    """Built-in modes plus the ones defined on the command line."""

    def __init__(self, family_extra: dict[str, dict] | None = None) -> None:
        self._modes = dict(BUILTIN)
        self.family_extra = {f: dict((family_extra or {}).get(f, {})) for f in FAMILIES}
        bad = set(family_extra or {}) - set(FAMILIES)
        if bad:
            raise ValueError(f"no mode family {sorted(bad)}; families: {FAMILIES}")

    def names(self) -> list[str]:
        """Every mode name known."""
        return list(self._modes)

    def define(self, name: str, settings: dict) -> None:
        """Add ``name``: the longest known mode prefixing it, with ``settings`` on top."""
        base = max((m for m in self._modes if name == m or name.startswith(m + "-")), key=len, default=None)
        if base is None:
            raise ValueError(f"mode {name!r}: its name must start with a known mode ({', '.join(self._modes)})")
        family, over, disk = self._modes[base]
        if family == "none" and set(settings) - {"env"}:
            raise ValueError(f"mode {name!r}: 'none' takes no settings (only 'env')")
        self._modes[name] = (family, {**over, **settings}, disk)

    def spec(self, name: str, sizes: Sizes, metrics_port: int | None = None) -> ModeSpec:
        """The mode's connector config and environment."""
        if name not in self._modes:
            raise ValueError(f"unknown mode {name!r}; known: {', '.join(self._modes)} (or --define NAME=JSON)")
        family, over, disk = self._modes[name]
        settings = {**self.family_extra[family], **over}
        engine_env = settings.pop("env", {})  # the server's environment, not a connector setting
        if not isinstance(engine_env, dict) or not all(isinstance(v, str) for v in engine_env.values()):
            raise ValueError(f"mode {name!r}: 'env' must map variable names to strings, got {engine_env!r}")
        disk_dir = os.path.join(sizes.disk_root, name) if disk else None
        cpu_gib = sizes.disk_cpu_gib if disk else sizes.cpu_gib
        spec = _BUILDERS[family](name, settings, cpu_gib, disk_dir, sizes.disk_gib, metrics_port)
        return replace(spec, env={**spec.env, **engine_env}) if engine_env else spec


def _none(name, settings, cpu_gib, disk_dir, disk_gib, port) -> ModeSpec:
    return ModeSpec(name, "none", None, gpu_resident=bool(settings.get("gpu_resident")))


def _offloading(name, settings, cpu_gib, disk_dir, disk_gib, port) -> ModeSpec:
    extra: dict = {"cpu_bytes_to_use": cpu_gib << 30}
    if disk_dir:
        extra.update(spec_name="TieringOffloadingSpec", secondary_tiers=[
            {"type": "fs", "root_dir": disk_dir, "n_read_threads": 16, "n_write_threads": 16}])
    extra.update(settings)
    return ModeSpec(name, "offloading", {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                         "kv_connector_extra_config": extra}, disk_dir=disk_dir)


def _simple(name, settings, cpu_gib, disk_dir, disk_gib, port) -> ModeSpec:
    if disk_dir:
        raise ValueError("SimpleCPUOffloadConnector has no disk tier in vLLM 0.26 (PR #49644 is not in it)")
    extra = {"cpu_bytes_to_use": cpu_gib << 30, **settings}
    return ModeSpec(name, "simple", {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both",
                                     "kv_connector_extra_config": extra})


def with_trace(spec: ModeSpec, trace_path: str) -> ModeSpec:
    """``spec`` with our connector's per-step load trace on (``trace_path``); other families unchanged."""
    if spec.family != "tiered":
        return spec
    kv = dict(spec.kv_transfer)
    kv["kv_connector_extra_config"] = {**kv["kv_connector_extra_config"], "trace_path": trace_path}
    return replace(spec, kv_transfer=kv)


def with_pool(spec: ModeSpec, pool: str) -> ModeSpec:
    """``spec`` with its host pool named ``host:<pool>`` when it has one (``cpu_pool``); else unchanged.

    Every replica of one engine start gets the same name, every start its own: a pool lives while a
    process has it open, so a start never joins what a killed start left behind."""
    if spec.family != "tiered" or "cpu_pool" not in spec.kv_transfer["kv_connector_extra_config"]:
        return spec
    kv = dict(spec.kv_transfer)
    kv["kv_connector_extra_config"] = {**kv["kv_connector_extra_config"], "cpu_pool": f"host:{pool}"}
    return replace(spec, kv_transfer=kv)


def pool_of(spec: ModeSpec) -> str | None:
    """The host pool's name (without ``host:``) a ``spec`` joins, or None."""
    if spec.family != "tiered":
        return None
    pool = spec.kv_transfer["kv_connector_extra_config"].get("cpu_pool")
    return pool[len("host:"):] if isinstance(pool, str) and pool.startswith("host:") else None


def _tiered(name, settings, cpu_gib, disk_dir, disk_gib, port) -> ModeSpec:
    resident = bool(settings.pop("gpu_resident", False))  # serve_bench's setting, not a connector key
    extra: dict = {"cpu_bytes": f"{cpu_gib}GiB"}
    if disk_dir:
        extra.update(disk_path=disk_dir, disk_bytes=f"{disk_gib}GiB")
    if port is not None:
        extra["metrics_port"] = port
    extra.update(settings)
    kv = {"kv_connector": "TieredKVConnector", "kv_connector_module_path": TIERED_MODULE, "kv_role": "kv_both",
          "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    return ModeSpec(name, "tiered", kv, disk_dir=disk_dir, metrics_port=extra.get("metrics_port"),
                    chunk_tokens=int(extra.get("chunk_blocks", 16)) * BLOCK_SIZE, gpu_resident=resident)


def _lmcache(name, settings, cpu_gib, disk_dir, disk_gib, port) -> ModeSpec:
    # LMCache 0.5.3 reads LMCACHE_<KEY> for each config key when no config file is given
    cfg: dict = {"chunk_size": 256, "local_cpu": True, "max_local_cpu_size": float(cpu_gib),
                 "use_layerwise": False, "save_decode_cache": False, "enable_async_loading": False}
    if disk_dir:
        cfg.update(local_disk=f"file://{disk_dir}/", max_local_disk_size=float(disk_gib))
    cfg.update(settings)
    env = {f"LMCACHE_{k.upper()}": _env_value(v) for k, v in cfg.items()}
    env["LMCACHE_TRACK_USAGE"] = "false"  # no usage reports to an outside host
    return ModeSpec(name, "lmcache", {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"},
                    env=env, disk_dir=disk_dir)


def _env_value(v) -> str:
    if isinstance(v, bool):
        return "True" if v else "False"
    return json.dumps(v) if isinstance(v, (dict, list)) else str(v)


_BUILDERS = {"none": _none, "offloading": _offloading, "simple": _simple, "tiered": _tiered, "lmcache": _lmcache}


# ---------------------------------------------------------------------------- command line
@dataclass(frozen=True)
class ServerOptions:
    """The ``vllm serve`` flags every mode shares."""

    python: str = "python3"
    max_model_len: int = 8192
    max_num_seqs: int = 64  # 0: vLLM's own default (no flag; 1,024 on an H100/H200 server)
    max_num_batched_tokens: int = 8192
    gpu_blocks: int = 6912
    gpu_memory_utilization: float = 0.9
    graphs: str = "decode"  # "decode": no compile, full graphs for decode-only batches; "eager"; "compile": vLLM's own
    capture_size: int = 64
    tokenizer: str = "skip"  # "skip": --skip-tokenizer-init; "word": the model dir's offline tokenizer
    extra_args: tuple[str, ...] = ()


def serve_argv(spec: ModeSpec, opts: ServerOptions, model_dir: str, port: int) -> list[str]:
    """The full command that starts the OpenAI server for ``spec``."""
    argv = [opts.python, "-m", "vllm.entrypoints.cli.main", "serve", model_dir,
            "--served-model-name", "m", "--load-format", "dummy", "--generation-config", "vllm", "--seed", "0",
            "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(opts.max_model_len),
            *(("--max-num-seqs", str(opts.max_num_seqs)) if opts.max_num_seqs else ()),
            "--max-num-batched-tokens", str(opts.max_num_batched_tokens),
            "--num-gpu-blocks-override", str(opts.gpu_blocks),
            "--gpu-memory-utilization", str(opts.gpu_memory_utilization),
            "--enable-prefix-caching", "--enable-prompt-tokens-details", "--enable-per-request-metrics",
            "--disable-uvicorn-access-log", "--jit-monitor-verbose"]  # every kernel compilation logged (add_jit)
    if opts.tokenizer == "skip":
        argv.append("--skip-tokenizer-init")
    if opts.graphs == "eager":
        argv.append("--enforce-eager")
    elif opts.graphs == "compile":  # what `vllm serve` does unasked: torch.compile and its default CUDA graph mode
        pass
    else:  # no torch.compile (seconds to start), CUDA graphs only for uniform decode batches
        argv += ["-cc.mode=none", "-cc.cudagraph_mode=FULL_DECODE_ONLY",
                 "--max-cudagraph-capture-size", str(opts.capture_size)]
    if spec.kv_transfer is not None:
        argv += ["--kv-transfer-config", json.dumps(spec.kv_transfer, separators=(",", ":"))]
    return argv + list(opts.extra_args)


def serve_env(spec: ModeSpec, repo_root: str, base: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(the server's full environment, what differs from ``base``): common + mode variables, repo on PYTHONPATH."""
    paths = [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
    if os.path.abspath(repo_root) not in [os.path.abspath(p) for p in paths]:
        paths.append(repo_root)
    delta = {**COMMON_ENV, "PYTHONPATH": os.pathsep.join(paths), **spec.env}
    return {**base, **delta}, delta


def shell_line(argv: list[str], env_delta: dict[str, str]) -> str:
    """A copy-pasteable shell line (environment first)."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env_delta.items()))
    return (env + " " if env else "") + " ".join(shlex.quote(a) for a in argv)


# ---------------------------------------------------------------------------- validation
def validate_argv(argv: list[str]) -> None:
    """Parse a ``serve`` command with the installed vLLM's own server parser (raises on a bad flag).

    vLLM's parser builds config defaults that ask the platform for its device type; on a machine
    without a GPU and with a vLLM that does not read ``VLLM_TARGET_DEVICE`` (0.26), the dry run
    sets the CPU platform first: only the flags are being checked, nothing runs.
    """
    import vllm.platforms as platforms
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:
        from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args  # vLLM 0.26
    except ImportError:  # vLLM >= 0.30 moved the server's arguments
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    if not platforms.current_platform.device_type:
        from vllm.platforms.cpu import CpuPlatform

        platforms._current_platform = CpuPlatform()
    rest = argv[argv.index("serve") + 1:]
    parser = make_arg_parser(FlexibleArgumentParser())
    try:
        args = parser.parse_args(rest)
    except SystemExit as exc:  # argparse reports on stderr and exits
        raise ValueError(f"vLLM's parser rejected the command (exit {exc.code}): {' '.join(rest)[:300]}") from None
    validate_parsed_serve_args(args)
    if args.kv_transfer_config is not None:
        extra = args.kv_transfer_config.kv_connector_extra_config
        if args.kv_transfer_config.kv_connector_module_path == TIERED_MODULE:
            from tiered_kv.connector.vllm.config import ConnectorConfig

            ConnectorConfig.from_extra_config(extra)  # our own keys, validated the way the connector does
