"""The ``vllm serve`` process of one engine start: launch, health, scrape, stop, and the GPU between starts.

The server runs in its own session (process group), so stopping it reaches the API server, the
EngineCore child and anything they started (LMCache's threads and ZMQ servers are not stopped
by vLLM's wrapper): SIGTERM to the group, SIGKILL after ``grace`` seconds. Its stdout and stderr
go to one log file per start; a failed start prints the log's last lines.

Threading contract: used from the benchmark's main thread; ``stop_all`` may run from a signal handler.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

_LIVE: set["ServerProcess"] = set()


def free_port() -> int:
    """A TCP port nothing listens on right now (the kernel's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """(status, body); status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, TimeoutError):
        return 0, ""


class ServerProcess:
    """One ``vllm serve`` subprocess and its log file."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: str) -> None:
        self.argv, self.env, self.log_path = argv, env, log_path
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0

    def start(self) -> None:
        """Launch in a new session; output to the log file."""
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(("$ " + " ".join(self.argv) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        self.started_at = time.monotonic()
        _LIVE.add(self)

    @property
    def alive(self) -> bool:
        """True while the server process runs."""
        return self.proc is not None and self.proc.poll() is None

    def wait_healthy(self, base_url: str, timeout_s: float) -> tuple[bool, str]:
        """Poll ``/health`` until 200 (the server listens only once the engine is up)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if not self.alive:
                return False, f"server exited with code {self.proc.returncode} before it was healthy"
            if http_get(base_url + "/health", timeout=2.0)[0] == 200:
                return True, ""
            time.sleep(0.5)
        return False, f"not healthy after {timeout_s:.0f} s"

    def stop(self, grace_s: float = 15.0) -> float:
        """SIGTERM the process group, SIGKILL after ``grace_s``; returns the seconds it took."""
        t0 = time.monotonic()
        if self.proc is None:
            return 0.0
        pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            end = time.monotonic() + wait
            while time.monotonic() < end:
                self.proc.poll()  # reap the leader: a zombie still counts as a group member
                if not _group_alive(pgid):
                    break
                time.sleep(0.2)
            if not _group_alive(pgid):
                break
        self.proc.poll()
        _LIVE.discard(self)
        return time.monotonic() - t0

    def log_tail(self, lines: int = 60) -> str:
        """The last lines of the server's log."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 200_000))
                return "\n".join(f.read().decode("utf-8", "replace").splitlines()[-lines:])
        except OSError as e:
            return f"(no log: {e})"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def stop_all() -> None:
    """Kill every server this process started and did not stop yet (on SIGTERM/SIGINT and at exit)."""
    for s in list(_LIVE):
        if s.proc is not None:
            try:
                os.killpg(s.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _LIVE.discard(s)


def visible_gpu_args() -> list[str]:
    """nvidia-smi's ``--id`` for the GPUs this process may use (``CUDA_VISIBLE_DEVICES``), else none.

    With several engines on one machine (``scripts/gpu/on_each_gpu.sh``: one GPU each, numbered in
    PCI order as nvidia-smi numbers them) a start must not wait for its neighbours' memory."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    return ["--id=" + vis] if vis and vis != "all" else []


def gpu_memory_used_mib() -> list[int] | None:
    """Used memory of each visible GPU (nvidia-smi), or None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                              *visible_gpu_args()], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode:
        return None
    return [int(x) for x in out.stdout.split() if x.strip().isdigit()]


def wait_gpu_free(limit_mib: int = 2048, timeout_s: float = 30.0) -> float:
    """Wait until every GPU uses less than ``limit_mib`` (the last engine's memory is back); returns seconds."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        used = gpu_memory_used_mib()
        if used is None or max(used, default=0) < limit_mib:
            break
        time.sleep(0.5)
    return time.monotonic() - t0


def gpu_share() -> dict:
    """Which GPU of how many on this machine the run used (``visible`` None: all of them). A run beside
    others on one host (``scripts/gpu/on_each_gpu.sh``) says so in its JSON."""
    try:
        out = subprocess.run(["nvidia-smi", "--list-gpus"], capture_output=True, text=True, timeout=10)
        host = len(out.stdout.splitlines()) if out.returncode == 0 else 0
    except (OSError, subprocess.TimeoutExpired):
        host = 0
    return {"visible": os.environ.get("CUDA_VISIBLE_DEVICES") or None, "host_gpus": host}


def device_name() -> str:
    """The GPU's name and driver (nvidia-smi), or a plain description without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader",
                              *visible_gpu_args()], capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return f"no GPU ({os.uname().nodename})"
