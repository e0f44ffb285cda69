#!/usr/bin/env python3
"""Render the Grafana dashboard's panels from a real run: live front ends, a real Prometheus, the dashboard's queries.

No Grafana runs here (Debian does not package it and its binaries are not reachable), so this draws each
panel of ``deploy/grafana/tiered_kv.json`` itself, at its grid position, with matplotlib, from what a real
Prometheus (Debian's ``prometheus``, scraping every second) answers to that panel's own expressions
(``query_range``; Grafana's ``$__rate_interval`` becomes 15s, ``$store``/``$instance`` match all). The picture
says so in its title: it is a rendering of the dashboard's queries, not a Grafana screenshot.

What runs, on this CPU machine, for ``--seconds`` (default 150):
- a ``TieredStore`` (GPU stand-in, CPU, disk, and the remote tier on a 3-master Redis Cluster started here),
  ``metrics_port`` A: many conversations put growing prefixes and read earlier ones back;
- vLLM's real Scheduler with ``TieredKVConnector`` (CPU + disk tiers, the load gate on a disk assumed slow;
  the test harness plays the worker on CPU tensors), ``metrics_port`` B: multi-turn conversations whose
  earlier turns the GPU forgot;
- one Redis node killed at 55% of the run and started again at 75% (remote-tier errors, then recovery).

Usage (from the repository root, in .venv): ``python scripts/render_dashboard.py --out docs/img/dashboard.png``

Threading contract: a script; the two workloads run on their own threads, Prometheus and Redis are child
processes this script starts and stops.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DASHBOARD = ROOT / "deploy" / "grafana" / "tiered_kv.json"
RATE_INTERVAL = "15s"
STEP_S = 2


# ---------------------------------------------------------------------- workloads
def store_workload(port: int, url: str, root: Path, stop: threading.Event) -> None:
    """Conversations on a TieredStore: each turn puts its grown prefix and reads an earlier conversation back."""
    import torch

    from tests._redis import PASSWORD_ENV
    from tiered_kv import TieredStore

    cfg = dict(block_shape=[2, 16, 4, 64], dtype="bfloat16", gpu_bytes="1MiB", cpu_bytes="4MiB",
               disk_path=str(root / "store-kv"), disk_bytes="24MiB", model="dashboard-demo", metrics_port=port,
               remote_url=url, remote_password_env=PASSWORD_ENV, remote_timeout_s=0.5, remote_connect_timeout_s=0.2)
    rng = random.Random(0)
    convs: list[list[int]] = []
    with TieredStore(cfg) as store:
        while not stop.is_set():
            if not convs or rng.random() < 0.3:
                convs.append([rng.randrange(32000) for _ in range(16 * 8)])
            conv = convs[min(len(convs) - 1, int(rng.expovariate(0.08)))]  # recent ones more often
            conv += [rng.randrange(32000) for _ in range(16 * rng.randint(1, 4))]
            keys = store.keys_for_tokens(conv)
            store.get(keys, torch.empty((len(keys), 2, 16, 4, 64), dtype=torch.bfloat16)).wait(30)
            store.put(keys, torch.randn((len(keys), 2, 16, 4, 64)).to(torch.bfloat16)).wait(30)
            time.sleep(0.02)


def vllm_workload(port: int, root: Path, stop: threading.Event) -> None:
    """Multi-turn conversations through vLLM's Scheduler; the GPU forgets between turns (prefix cache reset)."""
    from tests.connector.vllm.harness import BS, Engine, write_model_dir

    extra = {"chunk_blocks": 4, "cpu_bytes": 24 * 4 * 4096, "disk_path": str(root / "vllm-kv"), "disk_bytes": "8MiB",
             "metrics_port": port, "disk_read_gbps": 0.05, "disk_probe_every": 4, "prefill_tokens_per_s": 30000}
    eng = Engine.create(write_model_dir(str(root / "tiny-llama")), extra, num_blocks=256, max_batched=512)
    rng = random.Random(1)
    convs: dict[int, list[int]] = {}
    n = 0
    try:
        while not stop.is_set():
            c = rng.randrange(24)
            prompt = convs.get(c, []) + [100 + rng.randrange(800) for _ in range(BS * rng.randint(2, 6))]
            prompt = prompt[-(1500):]
            req = eng.add(f"r{n}", prompt, max_tokens=2)
            eng.run(timeout=60)
            convs[c] = list(req.prompt_token_ids) + list(req.output_token_ids)
            n += 1
            if n % 3 == 0:
                eng.sched.reset_prefix_cache()
            time.sleep(0.05)
    finally:
        eng.close()


# ---------------------------------------------------------------------- prometheus
def start_prometheus(root: Path, targets: list[str], port: int) -> subprocess.Popen:
    """A Prometheus scraping ``targets`` every second, its data under ``root``."""
    conf = root / "prometheus.yml"
    conf.write_text(json.dumps({"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                                "scrape_configs": [{"job_name": "tiered_kv", "static_configs": [{"targets": targets}]}]}))
    proc = subprocess.Popen(["prometheus", f"--config.file={conf}", f"--storage.tsdb.path={root / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=open(root / "prometheus.log", "w"))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=1)
            return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"prometheus did not start; see {root / 'prometheus.log'}")


def query_range(port: int, expr: str, start: float, end: float) -> list[dict]:
    """Prometheus's answer to ``expr`` over [start, end] at ``STEP_S``."""
    expr = expr.replace("$__rate_interval", RATE_INTERVAL).replace("$store", ".*").replace("$instance", ".*")
    q = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": STEP_S})
    body = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/query_range?{q}", timeout=30).read())
    if body["status"] != "success":
        raise RuntimeError(f"query failed: {expr}: {body}")
    return body["data"]["result"]


# ---------------------------------------------------------------------- drawing
def legend(fmt: str, labels: dict) -> str:
    """Grafana's ``{{label}}`` legend format."""
    out = fmt
    for k, v in labels.items():
        out = out.replace("{{" + k + "}}", v)
    return out or ",".join(f"{k}={v}" for k, v in labels.items() if k != "__name__") or "value"


def draw(dash: dict, results: dict, start: float, out: Path, note: str) -> None:
    """One axes per panel at its gridPos (24 columns; a row unit is 0.32 in), dark like Grafana's default theme."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dash["panels"])
    fig = plt.figure(figsize=(20, rows * 0.32 + 1.8), facecolor="#111217")
    top = 1 - 1.4 / (rows * 0.32 + 1.8)
    fig.text(0.01, 0.995, "tiered_kv dashboard (deploy/grafana/tiered_kv.json): each panel's own PromQL, answered by a "
             "real Prometheus 2.42 scraping live front ends, drawn with matplotlib. Not a Grafana screenshot.",
             color="#d8d9da", fontsize=13, va="top", weight="bold")
    fig.text(0.01, 0.995 - 0.3 / (rows * 0.32 + 1.8), textwrap.fill(note, 230), color="#9fa7b3", fontsize=10,
             va="top")
    for p in dash["panels"]:
        g = p["gridPos"]
        left = 0.004 if p["type"] == "stat" else 0.042  # room for the y-axis labels
        ax = fig.add_axes([g["x"] / 24 + left, top - (g["y"] + g["h"]) / rows * top + 0.012,
                           g["w"] / 24 - left - 0.008, g["h"] / rows * top - 0.03], facecolor="#181b1f")
        ax.set_title(p["title"], color="#d8d9da", fontsize=10, loc="left")
        for s in ax.spines.values():
            s.set_color("#2c3235")
        ax.tick_params(colors="#9fa7b3", labelsize=8)
        unit = p["fieldConfig"]["defaults"].get("unit", "")
        fmt = FuncFormatter(lambda v, _pos, u=unit: fmt_unit(v, u))
        series = results[p["id"]]
        if p["type"] == "stat":
            draw_stat(ax, series, unit)
            continue
        for lab, xs, ys in series:
            ax.plot([x - start for x in xs], ys, lw=1.2, label=lab)
        ax.yaxis.set_major_formatter(fmt)
        ax.set_xlabel("seconds into the run", color="#9fa7b3", fontsize=8)
        ax.grid(color="#2c3235", lw=0.5)
        if series:
            ax.legend(fontsize=7, loc="upper left", ncol=3, facecolor="#181b1f", edgecolor="#2c3235",
                      labelcolor="#d8d9da")
        else:
            ax.text(0.5, 0.5, "no data", color="#9fa7b3", ha="center", va="center", transform=ax.transAxes)
    fig.savefig(out, dpi=80, facecolor=fig.get_facecolor())


def draw_stat(ax, series, unit: str) -> None:
    """A stat panel: the last value, big, over a faint sparkline."""
    ax.set_xticks([])
    ax.set_yticks([])
    if not series:
        ax.text(0.5, 0.5, "no data", color="#9fa7b3", ha="center", va="center", transform=ax.transAxes)
        return
    _lab, xs, ys = series[0]
    ax.fill_between(xs, ys, color="#73bf69", alpha=0.15, lw=0)
    ax.text(0.5, 0.45, fmt_unit(ys[-1], unit), color="#73bf69", fontsize=22, ha="center", va="center",
            transform=ax.transAxes, weight="bold")


def fmt_unit(v: float, unit: str) -> str:
    """Grafana-like unit formatting for the units the dashboard uses."""
    if unit == "percentunit":
        return f"{v:.0%}"
    if unit in ("bytes", "Bps"):
        for suffix in ("B", "KiB", "MiB", "GiB"):
            if abs(v) < 1024 or suffix == "GiB":
                return f"{v:.3g} {suffix}" + ("/s" if unit == "Bps" else "")
            v /= 1024
    if unit == "s":
        return f"{v * 1e3:.3g} ms" if v < 1 else f"{v:.3g} s"
    if unit == "ops":
        return f"{v:.3g}/s"
    return f"{v:.3g}"


def collect(dash: dict, port: int, start: float, end: float) -> dict:
    """Every panel's series: ``[(legend, times, values)]`` from Prometheus, NaN and Inf dropped."""
    out = {}
    for p in dash["panels"]:
        series = []
        for t in p["targets"]:
            for r in query_range(port, t["expr"], start, end):
                pts = [(float(x), float(y)) for x, y in r["values"] if y not in ("NaN", "+Inf", "-Inf")]
                if pts:
                    series.append((legend(t.get("legendFormat", ""), r["metric"]), *map(list, zip(*pts))))
        out[p["id"]] = series
    return out


# ---------------------------------------------------------------------- main
def main() -> int:
    """Run the workloads under Prometheus, then render the dashboard; prints where the picture went."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "img" / "dashboard.png"))
    ap.add_argument("--seconds", type=float, default=150.0)
    args = ap.parse_args()
    if shutil.which("prometheus") is None:
        print("prometheus is not installed: apt-get install prometheus", file=sys.stderr)
        return 2
    from tests._metrics import free_port
    from tests._redis import PASSWORD_ENV, RedisCluster

    root = Path(tempfile.mkdtemp(prefix="tkv-dashboard-"))
    cluster = RedisCluster(root / "redis")
    cluster.create()
    os.environ[PASSWORD_ENV] = cluster.password
    store_port, vllm_port, prom_port = free_port(), free_port(), free_port()
    prom = start_prometheus(root, [f"127.0.0.1:{store_port}", f"127.0.0.1:{vllm_port}"], prom_port)
    stop = threading.Event()
    threads = [threading.Thread(target=store_workload, args=(store_port, cluster.url, root, stop), daemon=True),
               threading.Thread(target=vllm_workload, args=(vllm_port, root, stop), daemon=True)]
    try:
        start = time.time()
        for t in threads:
            t.start()
        time.sleep(args.seconds * 0.55)
        cluster.stop(1)  # a Redis master dies: its keys are misses, its writes fail
        down_at = time.time() - start
        time.sleep(args.seconds * 0.20)
        cluster.start(1)
        up_at = time.time() - start
        time.sleep(args.seconds * 0.25)
        stop.set()
        for t in threads:
            t.join(120)
        time.sleep(3)  # the last scrapes
        end = time.time()
        dash = json.loads(DASHBOARD.read_text())
        results = collect(dash, prom_port, start, end)
        note = (f"{time.strftime('%Y-%m-%d')}, a 2-core CPU box: a TieredStore (gpu stand-in 1 MiB, cpu 4 MiB, disk "
                f"24 MiB, remote: 3-master Redis Cluster) under a conversation workload, and vLLM 0.32's real Scheduler "
                f"with TieredKVConnector (cpu + disk, gate on a disk assumed at 0.05 GB/s), both scraped every 1 s. "
                f"Redis master 1 killed at {down_at:.0f} s, back at {up_at:.0f} s.")
        draw(dash, results, start, Path(args.out), note)
        (Path(args.out).with_suffix(".json")).write_text(json.dumps(
            {"start": start, "end": end, "redis_down_s": [down_at, up_at], "rate_interval": RATE_INTERVAL,
             "step_s": STEP_S, "panels": {str(k): [(lab, len(xs)) for lab, xs, _ in v] for k, v in results.items()}},
            indent=1))
        print(f"wrote {args.out}")
    finally:
        stop.set()
        prom.terminate()
        prom.wait(30)
        cluster.close()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
