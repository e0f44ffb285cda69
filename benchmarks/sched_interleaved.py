"""Scheduler step cost with and without a connector, every mode's steps interleaved in one process.

``benchmarks/sched_overhead_runs.sh`` runs one process per mode and alternates the processes: on this shared
2-core box the speed of the box moved by 1.3-1.9x between runs minutes apart (2026-11-29), more than a
connector costs, and a run's ~95 measured steps (~0.13 s) can hold a whole generation-1 collection or none.
Here every mode gets its own vLLM ``Scheduler`` (the real one, CPU only) in *one* process, and the modes take
turns step by step: step i of every mode, in a fresh random order (seeded) each step, then step i + 1. A change of the box's speed lands on all modes within a few milliseconds, so the
per-round ratio ``mode / none`` (the same steps' CPU time summed) is what the connector costs, and the median
over rounds is the figure. Each round builds fresh schedulers, then freezes the collector's heap as vLLM's
``EngineCore`` does after building its scheduler (``freeze_gc_heap``), so no mode starts its steps with another's
start-up garbage.

The workload is ``../shared/tools/sched_overhead.py``'s: 64 requests of 8,192 distinct tokens, 32 output tokens
each, a 2-layer model of 16-token blocks, a fake worker that samples one token per request per step and
completes no connector job (for our connector the worst case: every store stays in flight). The clock is the
scheduler thread's CPU time (``time.thread_time``) around ``schedule()`` and ``update_from_output()``; wall time
is recorded beside it.

Modes: ``none``, ``null`` (``benchmarks.probes.null_connector:NullConnector``: vLLM's connector plumbing alone),
``tiered`` (``TieredKVConnector`` with its defaults), ``remote`` (ours with the Redis fleet tier: needs
``--remote-url``; ``benchmarks.remote_sched_mode`` with its fleet process announcing ``--fleet-keys-per-s``),
``offloading`` (vLLM's ``OffloadingConnector``).

Usage (from the repo root)::

    PYTHONPATH=. .venv/bin/python benchmarks/sched_interleaved.py --rounds 12 \\
        --out docs/results/sched_interleaved_DATE_cpu-box.json --device "cpu-box (...)"

Threading contract: a script; the schedulers run on its one thread (the connectors' own threads aside).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NREQ, PROMPT, OUT_TOK = 64, 8192, 32  # the shared tool's workload
LAYERS, BS, HEADS, HEAD = 2, 16, 2, 16
NB = NREQ * (PROMPT + OUT_TOK) // BS + 64
MODES = {
    "none": None,
    "null": ("NullConnector", "benchmarks.probes.null_connector"),
    "tiered": ("TieredKVConnector", "tiered_kv.connector.vllm"),
    "remote": ("ExtraFromEnvConnector", "benchmarks.remote_sched_mode"),
    "offloading": ("OffloadingConnector", None),
}
#: a round stops (with an error) after this many steps: the workload takes ~95
MAX_STEPS = 5000
#: our connector's scheduler-side counters kept per round (the remote mode's feed and lookups at work)
CONNECTOR_STATS = ("sched_lookups", "sched_store_chunks", "remote_known", "sched_remote_announced",
                   "sched_remote_adopted")
#: the rule of issue 31 item 4: ours within this much of no connector (percent), and with the remote tier
BOUND_PCT = {"tiered": 15.0, "remote": 20.0}


def _model_dir(root: str) -> str:
    """A directory holding a tiny Llama config.json (no weights, no tokenizer)."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": HEADS,
           "num_hidden_layers": LAYERS, "vocab_size": 1000, "max_position_embeddings": 16384,
           "rms_norm_eps": 1e-5, "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2}
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump(cfg, f)
    return root


def build(mode: str, model_dir: str, prompts: list[list[int]]):
    """A real vLLM ``Scheduler`` for ``mode`` holding the workload's requests."""
    import torch
    from vllm import SamplingParams
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    max_len = PROMPT + OUT_TOK + 16
    mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float16", seed=0, max_model_len=max_len)
    sc = SchedulerConfig(max_num_seqs=NREQ, max_num_batched_tokens=PROMPT + NREQ, max_model_len=max_len,
                         enable_chunked_prefill=True, is_encoder_decoder=False, disable_hybrid_kv_cache_manager=True)
    cc = CacheConfig(block_size=BS, gpu_memory_utilization=0.9, enable_prefix_caching=True)
    ktc = None
    if MODES[mode] is not None:
        cls, module = MODES[mode]
        extra = {"cpu_bytes_to_use": 8 << 30} if mode == "offloading" else {}
        ktc = KVTransferConfig(kv_connector=cls, kv_connector_module_path=module, kv_role="kv_both",
                               kv_connector_extra_config=extra)
    cfg = VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc, kv_transfer_config=ktc,
                     device_config=DeviceConfig("cpu"))
    if mode == "offloading":
        cfg.cache_config.kv_cache_layout = "LBNHC"
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float16)
    page = spec.page_size_bytes
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    kvc = KVCacheConfig(num_blocks=NB, kv_cache_tensors=[_kv_tensor(KVCacheTensor, page, layers)],
                        kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    cfg.cache_config.num_gpu_blocks = NB
    init_none_hash(sha256)
    s = Scheduler(vllm_config=cfg, kv_cache_config=kvc, structured_output_manager=StructuredOutputManager(cfg),
                  block_size=BS, log_stats=True)
    for i, prompt in enumerate(prompts):
        sp = SamplingParams(max_tokens=OUT_TOK, ignore_eos=True)
        sp.update_from_generation_config({}, 2)
        s.add_request(Request(request_id=f"r{i}", prompt_token_ids=prompt, sampling_params=sp, pooling_params=None,
                              block_hasher=get_request_block_hasher(BS, sha256)))
    return s


def _kv_tensor(cls, page: int, layers: list[str]):
    """The one KV tensor every layer shares, in this vLLM's terms (0.32: ``layers`` with strides; 0.26:
    ``shared_by``)."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(cls)}
    if "layer_stride" in fields:
        return cls(size=NB * page * LAYERS, layers=layers, layer_stride=NB * page, block_stride=page)
    return cls(size=NB * page * LAYERS, shared_by=layers)


class Driver:
    """One mode's scheduler and the fake worker that answers its steps."""

    def __init__(self, mode: str, sched) -> None:
        self.mode, self.s = mode, sched
        self.cpu: list[float] = []
        self.wall: list[float] = []
        self.connector: dict = {}
        self.owm = None
        if mode == "offloading":
            from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
            self.owm = OffloadingWorkerMetadata

    def step(self) -> bool:
        """One step: ``schedule()``, a fake forward, ``update_from_output()``; False once no request is left."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        s = self.s
        if not s.has_requests():
            return False
        c0, w0 = time.thread_time(), time.perf_counter()
        out = s.schedule()
        c1, w1 = time.thread_time(), time.perf_counter()
        meta, wm, loads = out.kv_connector_metadata, None, set()
        if self.owm is not None and meta is not None:  # vLLM's connector: every job done at once, as the tool does
            wm = self.owm()
            for jid, job in list(meta.load_jobs.items()) + list(meta.store_jobs.items()):
                wm.mark_completed(jid)
                if jid in meta.load_jobs and not job.sync:
                    loads.add(job.req_id)
        ids = list(out.num_scheduled_tokens)
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=[[7] for _ in ids], logprobs=None, prompt_logprobs_dict={},
                                pooler_output=None,
                                kv_connector_output=KVConnectorOutput(
                                    finished_recving=loads or None,
                                    kv_connector_worker_meta=wm if wm and wm.completed_jobs else None))
        c2, w2 = time.thread_time(), time.perf_counter()
        s.update_from_output(out, mro)
        c3, w3 = time.thread_time(), time.perf_counter()
        self.cpu.append((c1 - c0) + (c3 - c2))
        self.wall.append((w1 - w0) + (w3 - w2))
        return True

    def snapshot(self) -> None:
        """Keep what our connector's scheduler side did (``CONNECTOR_STATS``): that the remote mode's feed and
        lookups ran, not only that it was configured."""
        conn = getattr(self.s, "connector", None)
        if conn is not None and hasattr(conn, "stats") and self.mode in ("tiered", "remote"):
            st = conn.stats()
            self.connector = {k: st[k] for k in CONNECTOR_STATS if k in st}

    def close(self) -> None:
        """Shut the scheduler's connector down (ours joins its threads)."""
        conn = getattr(self.s, "connector", None)
        if conn is not None and hasattr(conn, "shutdown"):
            conn.shutdown()


def run_round(modes: list[str], model_dir: str, seed: int, order_seed: int) -> dict[str, Driver]:
    """Build a scheduler per mode, freeze the heap as the engine does, step every mode in turn until all end.

    Each step runs the live modes in a fresh random order (``order_seed``: reproducible), so no mode keeps running
    right after another (whose step may have evicted its caches). A round longer than ``MAX_STEPS`` steps stops with
    the modes still running named."""
    from vllm.utils.gc_utils import freeze_gc_heap

    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 990) for _ in range(PROMPT)] for _ in range(NREQ)]
    drivers: list[Driver] = []
    try:
        for m in modes:
            drivers.append(Driver(m, build(m, model_dir, prompts)))
        freeze_gc_heap()
        order, live = random.Random(order_seed), list(drivers)
        for _ in range(MAX_STEPS):
            if not live:
                break
            order.shuffle(live)
            live = [d for d in live if d.step()]
        else:
            raise SystemExit(f"a round ran {MAX_STEPS} steps and {[d.mode for d in live]} still had requests: "
                             "a connector's job the fake worker never completes?")
        for d in drivers:
            d.snapshot()
    finally:
        for d in drivers:
            d.close()
        gc.unfreeze()
        gc.collect()
    return {d.mode: d for d in drivers}


def summarize(rounds: list[dict[str, dict]], modes: list[str]) -> dict:
    """Per mode: us/step per round (CPU and wall), the per-round paired ratio to ``none`` over the steps both
    ran, and their medians; the rule's verdict where one applies."""
    out = {}
    for m in modes:
        cpu = [r[m]["cpu_us_per_step"] for r in rounds]
        wall = [r[m]["wall_us_per_step"] for r in rounds]
        row = {"cpu_us_per_step": cpu, "wall_us_per_step": wall, "median_cpu_us_per_step": round(statistics.median(cpu), 1),
               "median_wall_us_per_step": round(statistics.median(wall), 1), "steps": [r[m]["steps"] for r in rounds]}
        if m != "none":
            paired = [r[m]["paired_cpu_vs_none_pct"] for r in rounds]
            pwall = [r[m]["paired_wall_vs_none_pct"] for r in rounds]
            row.update(paired_cpu_vs_none_pct=paired, paired_wall_vs_none_pct=pwall,
                       median_paired_cpu_vs_none_pct=round(statistics.median(paired), 1),
                       median_paired_wall_vs_none_pct=round(statistics.median(pwall), 1))
            if m in BOUND_PCT:
                row["bound_pct"] = BOUND_PCT[m]
                row["pass"] = row["median_paired_cpu_vs_none_pct"] <= BOUND_PCT[m]
        out[m] = row
    return out


def round_figures(drivers: dict[str, Driver]) -> dict[str, dict]:
    """One round's figures per mode (``summarize``'s inputs)."""
    base = drivers["none"]
    figs = {}
    for m, d in drivers.items():
        n = min(len(d.cpu), len(base.cpu))  # every mode runs the same schedule here; "paired_steps" says if not
        f = {"steps": len(d.cpu), "cpu_us_per_step": round(1e6 * sum(d.cpu) / len(d.cpu), 1),
             "wall_us_per_step": round(1e6 * sum(d.wall) / len(d.wall), 1)}
        if d.connector:
            f["connector"] = d.connector
        if m != "none":
            f["paired_steps"] = n
            f["paired_cpu_vs_none_pct"] = round(100 * (sum(d.cpu[:n]) / sum(base.cpu[:n]) - 1), 1)
            f["paired_wall_vs_none_pct"] = round(100 * (sum(d.wall[:n]) / sum(base.wall[:n]) - 1), 1)
        figs[m] = f
    return figs


def table(summary: dict) -> str:
    """A markdown table of ``summarize``'s result."""
    lines = ["| mode | us/step (CPU), median | per round | **paired vs none, median** | per round | wall, paired |",
             "|---|---|---|---|---|---|"]
    for m, v in summary.items():
        rounds = ", ".join(f"{x:.0f}" for x in v["cpu_us_per_step"])
        if m == "none":
            lines.append(f"| `{m}` | {v['median_cpu_us_per_step']:,.0f} | {rounds} | - | - | - |")
            continue
        verdict = "" if "pass" not in v else (" (pass)" if v["pass"] else f" (**over {v['bound_pct']:.0f}%**)")
        per = ", ".join(f"{x:+.1f}" for x in v["paired_cpu_vs_none_pct"])
        lines.append(f"| `{m}` | {v['median_cpu_us_per_step']:,.0f} | {rounds} | "
                     f"**{v['median_paired_cpu_vs_none_pct']:+.1f}%**{verdict} | {per} | "
                     f"{v['median_paired_wall_vs_none_pct']:+.1f}% |")
    return "\n".join(lines)


def _code() -> str:
    """The checkout's commit (and whether it has local changes)."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return rev + (" + local changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    """Run ``--rounds`` interleaved rounds of ``--modes``, print the table, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="none,null,tiered",
                    help=f"comma-separated, from {sorted(MODES)}; 'none' is always run (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=10, help="rounds of fresh schedulers (default: %(default)s)")
    ap.add_argument("--remote-url", default="",
                    help="redis:// URL of a Redis Cluster for the 'remote' mode (default: $TKV_REMOTE_URL)")
    ap.add_argument("--start-cluster", action="store_true",
                    help="for the 'remote' mode: start a local 3-master Redis Cluster on 127.0.0.1 (tests/_redis.py) "
                         "and stop it at the end")
    ap.add_argument("--fleet-keys-per-s", type=float, default=1000.0,
                    help="chunks a second the simulated fleet announces in the 'remote' mode (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=None, help="results JSON (default: bench_out/sched_interleaved_<UTC>.json)")
    ap.add_argument("--device", default="", help="the machine, in words")
    a = ap.parse_args(argv)
    modes = list(dict.fromkeys(["none"] + [m for m in a.modes.split(",") if m]))
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"--modes: unknown mode(s) {bad}; choose from {sorted(MODES)}")
    if a.rounds < 1:
        raise SystemExit(f"--rounds {a.rounds}: need at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        cluster = None
        if "remote" in modes and not a.start_cluster:
            a.remote_url = a.remote_url or os.environ.get("TKV_REMOTE_URL", "")
        if "remote" not in modes and (a.start_cluster or a.remote_url):
            raise SystemExit("--start-cluster / --remote-url configure the 'remote' mode: add it to --modes")
        if "remote" in modes:
            if a.start_cluster and a.remote_url:
                raise SystemExit("--start-cluster and --remote-url: give one (a local cluster, or yours)")
            extra = {"remote_url": a.remote_url}
            if a.start_cluster:
                from tests._redis import PASSWORD, PASSWORD_ENV, RedisCluster

                cluster = RedisCluster(Path(tmp) / "cluster")
                cluster.create()
                os.environ[PASSWORD_ENV] = PASSWORD
                extra = {"remote_url": cluster.url, "remote_password_env": PASSWORD_ENV}
            elif not a.remote_url:
                raise SystemExit("--modes remote needs a Redis Cluster: --start-cluster (a local one on 127.0.0.1) "
                                 "or --remote-url redis://HOST:PORT")
            os.environ["TKV_EXTRA"] = json.dumps(extra)
            os.environ["TKV_FLEET_KEYS_PER_S"] = str(a.fleet_keys_per_s)
        try:
            return _measure(a, modes, tmp)
        finally:
            if cluster is not None:
                cluster.close()


def _measure(a: argparse.Namespace, modes: list[str], tmp: str) -> int:
    """The rounds, the table and the JSON of ``main``."""
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    rounds = []
    model_dir = _model_dir(tmp)
    for r in range(a.rounds):
        t0 = time.perf_counter()
        if "remote" in modes:  # a namespace of its own per round: a round's feed starts empty, as round 1's did
            os.environ["TKV_EXTRA"] = json.dumps({**json.loads(os.environ["TKV_EXTRA"]), "tenant_salt": f"round-{r}"})
        figs = round_figures(run_round(modes, model_dir, seed=0, order_seed=r))
        rounds.append(figs)
        print(f"round {r + 1}/{a.rounds} ({time.perf_counter() - t0:.1f} s): " + ", ".join(
            f"{m} {f['cpu_us_per_step']:,.0f} us" + (f" ({f['paired_cpu_vs_none_pct']:+.1f}%)" if m != "none" else "")
            for m, f in figs.items()), flush=True)
    summary = summarize(rounds, modes)
    print(table(summary))
    import vllm

    doc = {"benchmark": "sched_interleaved", "started": started, "device": a.device, "code": _code(),
           "vllm": vllm.__version__, "python": sys.version.split()[0], "cpus": os.cpu_count(),
           "load_average": os.getloadavg(), "command": shlex.join([Path(sys.executable).name, *sys.argv]),
           "workload": f"{NREQ} requests x {PROMPT:,}-token distinct prompts, {OUT_TOK} output tokens, {LAYERS} layers "
                       f"of {BS}-token blocks; no connector job completes",
           "rounds": rounds, "summary": summary}
    out = a.out or ROOT / "bench_out" / f"sched_interleaved_{started.replace(':', '').replace('-', '')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
