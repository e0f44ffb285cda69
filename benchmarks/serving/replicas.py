"""Several ``vllm serve`` replicas per engine start, one per GPU, behind a round-robin router (issue 33).

``serve_bench.py --replicas N``: an engine start of a mode is N servers, replica i on GPU i
(``CUDA_VISIBLE_DEVICES``: the i-th of the benchmark's own visible GPUs, else ``i``; PCI order as
nvidia-smi numbers them), its own port (and, in ``tiered*`` modes, its own metrics port), all serving
one model directory by the same path (the connector's namespace names the model by vLLM's model
string: two paths would share nothing), each with its own disk directory (``<disk_root>/g<i>/<mode>``)
and log (``..._g<i>.log``). A host pool (``tiered-pool``) gets one name per start that every replica of
the start joins (``modes.with_pool``); once the start's servers are gone its directory in ``/dev/shm`` is
removed (a killed pool keeps its memory until the next open of its name, which never comes).

The router sends turn ``t`` of user ``u`` to replica ``(u + t) % N`` (``route``): the warm phase's turn 0
spreads the users over the replicas, and every later turn lands on another replica than the same user's
previous turn, so a replica finds the user's latest prefix only in a tier it shares with the others.

Per phase the replicas' Prometheus counters are summed (``combine``: what the report's sources and tier
hits read); gauges, and each replica's own requests, TTFT p50, sources and tier hits, are kept per
replica (``per_replica``), where a sum would mean nothing.

Threading contract: main thread only (``router``'s function runs on the client's event loop, in the main
thread); no shared state beyond what the caller passes in.
"""
from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, replace

from serving import stats
from serving.modes import ModeRegistry, ModeSpec, ServerOptions, Sizes, pool_of, serve_argv, serve_env, with_pool, with_trace

SHM_DIR = "/dev/shm"


def route(user: int, turn: int, n: int) -> int:
    """The replica that serves turn ``turn`` of ``user`` among ``n``: round robin per turn, ``(user + turn) % n``."""
    return (user + turn) % n


def router(bases: list[str]) -> Callable[[int, int], str]:
    """``(user, turn) -> base URL`` of the replica ``route`` picks."""
    n = len(bases)
    return lambda user, turn: bases[route(user, turn, n)]


def gpu_ids(n: int, env: dict[str, str] | None = None) -> list[str]:
    """The GPU of each replica: the i-th of the benchmark's ``CUDA_VISIBLE_DEVICES`` if set, else ``i``."""
    vis = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES", "").strip()
    ids = [x.strip() for x in vis.split(",") if x.strip()] if vis and vis != "all" else [str(i) for i in range(n)]
    if len(ids) < n:
        raise SystemExit(f"--replicas {n} needs {n} GPUs; CUDA_VISIBLE_DEVICES={vis!r} names {len(ids)}")
    return ids[:n]


def free_ports(k: int) -> list[int]:
    """``k`` distinct TCP ports nothing listens on right now (held together while they are picked)."""
    socks = []
    try:
        for _ in range(k):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def pool_name(tag: str | int) -> str:
    """A host pool's name for one engine start (unique per benchmark process and ``tag``)."""
    return f"sb{os.getpid()}-{tag}"


def suffixed(path: str, i: int, n: int, ext: str = "") -> str:
    """``path`` of replica ``i`` (``_g<i>`` before ``ext``); unchanged with one replica."""
    stem = path[: -len(ext)] if ext and path.endswith(ext) else path
    return path if n == 1 else f"{stem}_g{i}{ext}"


@dataclass
class Replica:
    """One server of an engine start: where it runs and how it is started."""

    index: int
    gpu: str | None  # None: one replica, the benchmark's own environment
    port: int
    spec: ModeSpec
    argv: list[str]
    env: dict
    delta: dict  # the environment that differs from the benchmark's (for the printed command)
    log: str

    @property
    def base(self) -> str:
        """The server's URL."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def pool(self) -> str | None:
        """The host pool it joins, if any."""
        return pool_of(self.spec)


def plan(reg: ModeRegistry, mode: str, sizes: Sizes, n: int, *, gpus: list[str], ports: list[int],
         metrics_ports: list[int] | None, pool: str, trace: str | None, opts_for: Callable[[ModeSpec], ServerOptions],
         model_dir: str, repo: str, base_env: dict[str, str], extra_env: dict[str, str], log: str) -> list[Replica]:
    """The ``n`` servers of one start of ``mode`` (``n`` = 1: exactly the single-server command of before)."""
    out = []
    for i in range(n):
        sz = sizes if n == 1 else replace(sizes, disk_root=os.path.join(sizes.disk_root, f"g{i}"))
        spec = with_pool(reg.spec(mode, sz, metrics_port=metrics_ports[i] if metrics_ports else None), pool)
        if trace:
            spec = with_trace(spec, suffixed(trace, i, n))
        argv = serve_argv(spec, opts_for(spec), model_dir, ports[i])
        env, delta = serve_env(spec, repo, base_env)
        more = dict(extra_env)
        if n > 1:  # PCI order: CUDA numbers the GPUs as nvidia-smi does
            more.update(CUDA_VISIBLE_DEVICES=gpus[i], CUDA_DEVICE_ORDER="PCI_BUS_ID")
        env.update(more)
        delta.update(more)
        out.append(Replica(i, gpus[i] if n > 1 else None, ports[i], spec, argv, env, delta,
                           suffixed(log, i, n, ".log")))
    return out


# ---------------------------------------------------------------------------- metrics
def combine(scrapes: list[dict]) -> dict:
    """One scrape (``{"vllm": {...}, "tkv": {...}}``) of all replicas: counters and histogram totals summed,
    gauges left out (``per_replica`` keeps them). One replica: its scrape as it is."""
    if len(scrapes) == 1:
        return scrapes[0]
    out: dict = {}
    for part in ("vllm", "tkv"):
        acc: dict[str, float] = {}
        for s in scrapes:
            for k, v in s[part].items():
                if stats.is_total(k):
                    acc[k] = acc.get(k, 0.0) + v
        out[part] = acc
    return out


def per_replica(results, before: list[dict], after: list[dict], specs: list[ModeSpec]) -> list[dict]:
    """Each replica's share of a phase: requests routed to it, their TTFT p50, its token sources, its tier
    hits, what our workers cost its thread (``stats.worker_time``), its gauges after the phase."""
    n = len(specs)
    out = []
    for i, spec in enumerate(specs):
        mine = [r for r in results if route(r.user, r.turn, n) == i]
        ttft = [r.ttft_s for r in mine if r.error is None and r.ttft_s is not None]
        p50 = stats.percentile(ttft, 50)
        vdelta = stats.prom_delta(before[i]["vllm"], after[i]["vllm"])
        tdelta = stats.prom_delta(before[i]["tkv"], after[i]["tkv"])
        out.append({"replica": i, "requests": len(mine), "errors": sum(r.error is not None for r in mine),
                    "ttft_ms_p50": None if p50 is None else round(p50 * 1e3, 3),
                    "sources": stats.token_sources(vdelta),
                    "tiers": stats.tier_hits(tdelta, spec.chunk_tokens) if spec.metrics_port else {},
                    "worker_time": stats.worker_time(tdelta, vdelta),
                    "gauges": {k: v for k, v in after[i]["vllm"].items() if not stats.is_total(k)}})
    return out


# ---------------------------------------------------------------------------- processes and files
def stop_servers(servers) -> float:
    """SIGTERM every server's process group at once, then ``stop`` each (SIGKILL after its grace)."""
    for s in servers:
        if s.proc is not None and s.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # already gone
                os.killpg(s.proc.pid, signal.SIGTERM)
    return sum(s.stop() for s in servers)


#: /proc/<pid>/status lines ``group_memory`` sums, and the keys it reports them under
_MEMORY_KEYS = {"VmRSS:": "rss_bytes", "RssAnon:": "rss_anon_bytes", "RssShmem:": "rss_shmem_bytes"}


def group_memory(pgid: int) -> dict[str, int]:
    """Resident memory of every live process in process group ``pgid`` (a server started in a session of its
    own: the API server and its engine core), summed: ``rss_bytes`` (VmRSS: a host pool's shared pages count in
    every process that touched them), ``rss_anon_bytes`` (private pages: a private CPU tier) and
    ``rss_shmem_bytes`` (shared memory: the host pool's pages, or vLLM's own shared buffers); ``processes`` counted.
    Several replicas on one pool show the pool in each one's ``rss_shmem_bytes`` and once in ``pool_bytes``."""
    out = dict.fromkeys(_MEMORY_KEYS.values(), 0)
    out["processes"] = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
            # the command name (field 2) may hold spaces and parentheses: the fields after its last ")"
            if int(stat[stat.rindex(")") + 2:].split()[2]) != pgid:
                continue
            with open(f"/proc/{name}/status", encoding="ascii", errors="replace") as f:
                lines = f.read().splitlines()
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to read
            continue
        out["processes"] += 1
        for key, value in status_memory(lines).items():
            out[key] += value
    return out


def status_memory(lines: list[str]) -> dict[str, int]:
    """``rss_bytes``, ``rss_anon_bytes`` and ``rss_shmem_bytes`` from the lines of one ``/proc/<pid>/status``."""
    out = {}
    for line in lines:
        key = _MEMORY_KEYS.get(line.split(None, 1)[0] if line else "")
        if key:
            out[key] = int(line.split()[1]) * 1024  # kB
    return out


def pool_dir(pool: str) -> str:
    """Where the host pool ``pool`` of this user lives (``tiered_kv/tiers/pool/place.py``)."""
    return os.path.join(SHM_DIR, f"tiered_kv-{os.getuid()}", pool)


def pool_bytes(pool: str) -> int:
    """Allocated bytes of the pool's files (0 when it is gone)."""
    total = 0
    for base, _dirs, files in os.walk(pool_dir(pool)):
        for name in files:
            with contextlib.suppress(OSError):  # removed meanwhile
                total += os.stat(os.path.join(base, name)).st_blocks * 512
    return total


def remove_pool(pool: str | None) -> None:
    """Remove what is left of ``pool`` in ``/dev/shm`` (call only once every process of it is gone)."""
    if pool:
        shutil.rmtree(pool_dir(pool), ignore_errors=True)


def shm_problem(gib: int) -> str | None:
    """Why a host pool of ``gib`` GiB cannot be made in ``/dev/shm`` here, or None."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError as e:
        return f"no {SHM_DIR}: {e}"
    free = st.f_bavail * st.f_frsize
    if free < gib << 30:
        return (f"the host pool needs {gib} GiB in {SHM_DIR}, {free / (1 << 30):.1f} GiB free "
                "(docker: --shm-size; or a smaller --cpu-gib)")
    return None


def shm_free_gib() -> float | None:
    """Free GiB in ``/dev/shm`` (None without it)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize / (1 << 30)


def pack_logs(out_dir: str, shape: str, name: str, since: float = 0.0, every_start: bool = False) -> str | None:
    """Pack the per-replica server logs and traces of ``shape`` in ``out_dir`` (``every_start``: every start's, one
    server or several) written since ``since`` (a ``time.time()``; 0: any) into ``name`` (a .tgz) and remove them:
    a device call brings back only a few files. Returns the archive's path (None: nothing to pack)."""
    g = "" if every_start else "_g*"
    d, s = glob.escape(out_dir), glob.escape(shape)
    files = sorted(f for f in glob.glob(os.path.join(d, f"serve_{s}_*{g}.log"))
                   + glob.glob(os.path.join(d, f"trace_{s}_*{g}.rank*.jsonl"))
                   + glob.glob(os.path.join(d, f"trace_{s}_*{g}.sched.jsonl")) if os.path.getmtime(f) >= since)
    if not files:
        return None
    path = os.path.join(out_dir, name)
    with tarfile.open(path, "w:gz") as tar:
        for f in files:
            tar.add(f, arcname=os.path.basename(f))
    for f in files:
        os.remove(f)
    return path
