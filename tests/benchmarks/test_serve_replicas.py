"""``benchmarks/serve_bench.py --replicas N`` on the CPU (issue 33): the round-robin router, the per-replica
command lines of the dry run (GPUs, ports, one model path, one host pool per start), and whole calls against
stand-ins: two ``serve_stub`` servers driven with ``--attach URL,URL`` and two ``fake_serve.py`` processes
started, routed to and stopped by the benchmark itself.
"""
from __future__ import annotations

import json
import os
import shlex
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import serve_bench  # noqa: E402
from serving import replicas, report  # noqa: E402
from serving.workload import Workload, WorkloadParams, plan_phases  # noqa: E402


@pytest.fixture(autouse=True)
def _no_visible_devices_from_the_caller(monkeypatch):
    """The replicas' GPUs follow the benchmark's own CUDA_VISIBLE_DEVICES: a caller's (a GPU box's) must not leak
    into the tests that assume none."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

SMALL_ARGS = ["--shape", "llama3-8b", "--users", "6", "--system-tokens", "32", "--context-tokens", "48",
              "--turn-tokens", "16", "--answer-tokens", "4", "--concurrency", "4,2,1", "--c1-users", "2",
              "--phase-gap-s", "0", "--no-plot"]
SMALL = WorkloadParams(users=6, system_tokens=32, context_tokens=48, turn_tokens=16, answer_tokens=4,
                       concurrency=(4, 2, 1), c1_users=2)


# ============================================================================ the router
@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_router_sends_every_turn_after_the_first_to_another_replica(n):
    for user in range(20):
        for turn in range(6):
            assert 0 <= replicas.route(user, turn, n) < n
            assert replicas.route(user, turn + 1, n) != replicas.route(user, turn, n)
    # the warm phase (turn 0 of every user) spreads the users evenly over the replicas
    counts = [sum(replicas.route(u, 0, n) == i for u in range(4 * n)) for i in range(n)]
    assert counts == [4] * n
    bases = [f"http://h:{8000 + i}" for i in range(n)]
    url_of = replicas.router(bases)
    assert [url_of(5, t) for t in range(n)] == [bases[(5 + t) % n] for t in range(n)]


def test_one_replica_is_always_replica_zero():
    assert {replicas.route(u, t, 1) for u in range(5) for t in range(5)} == {0}


def test_replica_gpus_follow_the_benchmarks_own_visible_devices():
    assert replicas.gpu_ids(2, {}) == ["0", "1"]
    assert replicas.gpu_ids(2, {"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    with pytest.raises(SystemExit, match="needs 2 GPUs"):
        replicas.gpu_ids(2, {"CUDA_VISIBLE_DEVICES": "0"})
    ports = replicas.free_ports(4)
    assert len(set(ports)) == 4


# ============================================================================ the dry run
def _servers(out: str) -> dict[str, list[dict]]:
    """``{mode: [{env, argv, kv}]}`` from a dry run's printed command lines."""
    modes: dict[str, list[dict]] = {}
    mode = None
    for line in out.splitlines():
        if line.startswith("## mode "):
            mode = line.split()[2]
            modes[mode] = []
        elif "vllm.entrypoints.cli.main serve" in line:
            words = shlex.split(line)
            k = next(i for i, w in enumerate(words) if "=" not in w)
            env, argv = dict(w.split("=", 1) for w in words[:k]), words[k:]
            kv = json.loads(argv[argv.index("--kv-transfer-config") + 1]) if "--kv-transfer-config" in argv else None
            modes[mode].append({"env": env, "argv": argv, "kv": kv})
    return modes


def _extra(server: dict) -> dict:
    return server["kv"]["kv_connector_extra_config"]


def test_dry_run_of_two_replicas_gives_one_server_per_gpu_and_one_pool_per_start(capsys):
    serve_bench.main(["--shape", "llama3-8b", "--dry-run", "--replicas", "2", "--modes", "tiered-pool,tiered"])
    out = capsys.readouterr().out
    assert "round robin per turn" in out
    modes = _servers(out)
    assert list(modes) == ["tiered-pool", "tiered"]
    for mode, servers in modes.items():
        assert len(servers) == 2, mode
        assert [s["env"]["CUDA_VISIBLE_DEVICES"] for s in servers] == ["0", "1"]
        assert all(s["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" and s["env"]["PYTHONHASHSEED"] == "0" for s in servers)
        ports = [s["argv"][s["argv"].index("--port") + 1] for s in servers]
        assert len(set(ports)) == 2, ports
        metrics = [_extra(s)["metrics_port"] for s in servers]
        assert len(set(metrics + [int(p) for p in ports])) == 4  # every server and endpoint its own port
        model = {s["argv"][s["argv"].index("serve") + 1] for s in servers}
        assert len(model) == 1  # one path: the connector's namespace names the model by it
    pools = [_extra(s).get("cpu_pool") for s in modes["tiered-pool"]]
    assert pools[0] and pools[0].startswith("host:") and pools[0] == pools[1]
    assert {_extra(s)["cpu_bytes"] for s in modes["tiered-pool"]} == {_extra(s)["cpu_bytes"] for s in modes["tiered"]}
    private = [_extra(s).get("cpu_pool") for s in modes["tiered"]]
    assert private == [None, None] or len(set(private)) == 2


def test_dry_run_of_one_replica_is_the_single_server_command(capsys):
    serve_bench.main(["--shape", "llama3-8b", "--dry-run", "--modes", "tiered-pool,tiered"])
    modes = _servers(capsys.readouterr().out)
    for servers in modes.values():
        (s,) = servers
        assert "CUDA_VISIBLE_DEVICES" not in s["env"] and s["argv"][s["argv"].index("--port") + 1] == "8000"
    assert _extra(modes["tiered-pool"][0])["cpu_pool"].startswith("host:sb")
    assert "cpu_pool" not in _extra(modes["tiered"][0])


@pytest.mark.parametrize("mode", ["none-resident", "tiered-resident"])
def test_the_resident_floor_is_refused_with_replicas(mode, capsys):
    with pytest.raises(SystemExit):
        serve_bench.parse_args(["--shape", "llama3-8b", "--replicas", "2", "--modes", f"{mode},tiered"])
    assert "is no floor with --replicas" in capsys.readouterr().err
    assert serve_bench.parse_args(["--shape", "llama3-8b", "--modes", f"{mode},tiered"]).replicas == 1


def test_a_mode_given_the_floors_cache_by_its_settings_is_refused_with_replicas_too(capsys):
    """By the mode's setting, not its name: a defined mode or the family's extras."""
    for extra in (["--define", 'tiered-x={"gpu_resident": true}', "--modes", "tiered-x,none"],
                  ["--tiered-extra", '{"gpu_resident": true}', "--modes", "tiered,none"]):
        with pytest.raises(SystemExit):
            serve_bench.parse_args(["--shape", "llama3-8b", "--replicas", "2", *extra])
        assert "is no floor with --replicas" in capsys.readouterr().err
    ok = serve_bench.parse_args(["--shape", "llama3-8b", "--replicas", "2", "--define",
                                 'tiered-resident-off={"gpu_resident": false}', "--modes", "tiered-resident-off,none"])
    assert ok.replicas == 2  # named after the resident mode, but not resident


def test_metrics_of_several_replicas_sum_counters_and_keep_gauges_per_replica():
    a = {"vllm": {'x_total{source="a"}': 3.0, "g": 1.0}, "tkv": {"t_total": 2.0}}
    b = {"vllm": {'x_total{source="a"}': 4.0, "g": 5.0}, "tkv": {}}
    assert replicas.combine([a]) is a
    assert replicas.combine([a, b]) == {"vllm": {'x_total{source="a"}': 7.0}, "tkv": {"t_total": 2.0}}


# ============================================================================ against stand-ins
@pytest.fixture
def stubs():
    from serve_stub import StubServer

    s = [StubServer().start(), StubServer().start()]
    yield s
    for x in s:
        x.stop()


def test_attach_to_two_servers_routes_round_robin_per_turn(stubs, tmp_path):
    serve_bench.main(SMALL_ARGS + ["--attach", f"{stubs[0].url},{stubs[1].url}", "--modes", "tiered-pool",
                                   "--out-dir", str(tmp_path)])
    doc = json.loads((tmp_path / "serve_bench_llama3-8b_rr2.json").read_text())
    assert doc["replicas"] == 2
    wl = Workload(SMALL, 0)
    seen = [{json.dumps(p) for p in s.requests} for s in stubs]
    for ph in plan_phases(SMALL):
        for u, t in ph.items:  # each turn on the replica the router picks, and only there
            r = replicas.route(u, t, 2)
            assert json.dumps(wl.prompt(u, t)) in seen[r] and json.dumps(wl.prompt(u, t)) not in seen[1 - r]
    phases = doc["starts"][0]["repeats"][0]["phases"]
    c4 = next(p for p in phases if p["name"] == "c4")
    assert [r["requests"] for r in c4["replicas"]] == [3, 3]
    summed = {k: sum(r["sources"][k] for r in c4["replicas"]) for k in c4["sources"]}
    assert summed == c4["sources"]  # the phase's sources are the replicas' summed
    # each stub's prefix cache is private: turn 1 finds only the system prompt (its user's turn 0 ran on the other)
    assert {row[4] for row in c4["rows"]} == {32}
    assert "gauges" in c4["replicas"][0]


def test_two_replica_starts_launch_route_stop_and_pack_their_logs(tmp_path, monkeypatch):
    rec_path = tmp_path / "rec.jsonl"
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("FAKE_SERVE_RECORD", str(rec_path))
    monkeypatch.setenv("FAKE_SERVE_SHM", str(shm))
    monkeypatch.setattr(replicas, "SHM_DIR", str(shm))
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve().parent / 'fake_serve.py'} \"$@\"\n")
    wrapper.chmod(0o755)
    out = tmp_path / "out"
    serve_bench.main(SMALL_ARGS + ["--python", str(wrapper), "--replicas", "2", "--modes", "tiered-pool,none",
                                   "--cpu-gib", "1", "--tokenizer", "word", "--graphs", "eager",
                                   "--out-dir", str(out)])
    doc = json.loads((out / "serve_bench_llama3-8b_rr2.json").read_text())
    assert [(s["mode"], s["status"]) for s in doc["starts"]] == [("tiered-pool", "ok"), ("none", "ok")]
    runs = [json.loads(line) for line in rec_path.read_text().splitlines()]
    assert len(runs) == 4 and all(r["PYTHONHASHSEED"] == "0" for r in runs)
    pool_runs = [r for r in runs if "--kv-transfer-config" in r["argv"]]
    assert sorted(r["CUDA_VISIBLE_DEVICES"] for r in pool_runs) == ["0", "1"]
    pools = {json.loads(r["argv"][r["argv"].index("--kv-transfer-config") + 1])["kv_connector_extra_config"]["cpu_pool"]
             for r in pool_runs}
    assert len(pools) == 1 and doc["starts"][0]["pool"] == next(iter(pools))[len("host:"):]
    assert len({r["argv"][r["argv"].index("--port") + 1] for r in runs}) >= 2
    assert len({r["argv"][r["argv"].index("serve") + 1] for r in runs}) == 1  # one model path for every server
    for r in runs:
        try:
            os.kill(r["pid"], 0)
            alive = True
        except ProcessLookupError:
            alive = False
        assert not alive  # every server of every start was stopped
    assert doc["starts"][0]["pool_shm_bytes"] > 0
    for start in doc["starts"]:  # each server's memory, read from /proc while it ran
        assert [m["processes"] for m in start["replica_memory"]] == [1, 1]
        assert all(m["rss_bytes"] > 0 for m in start["replica_memory"])
    assert not os.listdir(shm / f"tiered_kv-{os.getuid()}")  # the killed start's pool is removed
    assert [r["gpu"] for r in doc["starts"][0]["replicas"]] == ["0", "1"]
    c4 = next(p for p in doc["starts"][0]["repeats"][0]["phases"] if p["name"] == "c4")
    assert [r["requests"] for r in c4["replicas"]] == [3, 3]
    g = doc["summary"]["tiered-pool"]["phases"]["c4"]["greedy_vs_none"]
    assert g == {"compared": 6, "equal": 6}
    assert not list(out.glob("*.log"))  # packed: a device call brings back only a few files
    with tarfile.open(out / "serve_logs_llama3-8b_rr2.tgz") as tar:
        assert sorted(tar.getnames()) == ["serve_llama3-8b_none_r0_g0.log", "serve_llama3-8b_none_r0_g1.log",
                                          "serve_llama3-8b_tiered-pool_r0_g0.log", "serve_llama3-8b_tiered-pool_r0_g1.log"]


def test_group_memory_sums_a_server_groups_private_and_shared_pages(tmp_path):
    """``group_memory`` on real processes: a session leader and its child, one holding 64 MiB of private pages and
    the other 32 MiB of a shared mapping (a file in /dev/shm, as a host pool's), read from /proc."""
    import subprocess
    import time

    shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    shared = os.path.join(shm_dir, f"tkv-test-group-memory-{os.getpid()}")
    child = ("import mmap, os, time\n"
             f"fd = os.open({shared!r}, os.O_RDWR | os.O_CREAT, 0o600); os.ftruncate(fd, 32 << 20)\n"
             "m = mmap.mmap(fd, 32 << 20); m.write(b'x' * (32 << 20)); print('ready', flush=True); time.sleep(60)\n")
    leader = ("import subprocess, sys, time\n"
              f"c = subprocess.Popen([sys.executable, '-c', {child!r}], stdout=subprocess.PIPE, text=True)\n"
              "c.stdout.readline(); buf = bytearray(b'y' * (64 << 20)); print('ready', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", leader], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        mem = replicas.group_memory(proc.pid)
        assert mem["processes"] == 2
        assert mem["rss_anon_bytes"] >= 64 << 20
        assert mem["rss_shmem_bytes"] >= 32 << 20
        assert mem["rss_bytes"] >= mem["rss_anon_bytes"] + (32 << 20)
        assert replicas.group_memory(proc.pid + 10_000_000)["processes"] == 0  # no such group
    finally:
        os.killpg(proc.pid, 9)
        proc.wait(timeout=10)
        time.sleep(0.1)
        if os.path.exists(shared):
            os.remove(shared)


def test_files_of_several_replicas_merge_apart_from_single_server_files():
    one = {"shape": "llama3-8b", "device": "H200", "date": "d1", "starts": []}
    two = {"shape": "llama3-8b", "device": "H200 x2", "date": "d2", "replicas": 2, "starts": []}
    merged = report.merge([one, two])
    assert sorted(merged) == ["llama3-8b", "llama3-8b_rr2"]
    assert list(report.merge([merged["llama3-8b_rr2"]])) == ["llama3-8b_rr2"]  # a merged file merges again


def test_pool_replicas_reads_its_own_memory_the_same_way():
    """``pool_replicas._memory`` (one replica's record) and ``group_memory`` parse /proc's status alike."""
    import pool_replicas

    mine = pool_replicas._memory()
    assert set(mine) == {"rss_bytes", "rss_anon_bytes", "rss_shmem_bytes"}
    assert 0 < mine["rss_anon_bytes"] <= mine["rss_bytes"]
    assert replicas.status_memory(["VmRSS:\t  2048 kB", "RssShmem:\t 1 kB", "Threads: 3"]) == {
        "rss_bytes": 2048 * 1024, "rss_shmem_bytes": 1024}
