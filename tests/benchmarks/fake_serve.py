"""Stands in for ``python3 -m vllm.entrypoints.cli.main serve ...`` in the tests of serve_bench's start/stop path.

Run as ``fake_serve.py -m vllm.entrypoints.cli.main serve MODEL --port P ...``: serves ``serve_stub``
on port P until killed. ``FAKE_SERVE_FAIL=skip`` makes it exit with an error when
``--skip-tokenizer-init`` is given (to exercise the tokenizer fallback), ``FAKE_SERVE_FAIL=graphs``
when ``--enforce-eager`` is not; ``FAKE_SERVE_EXIT_AFTER=n`` exits after n requests; ``FAKE_SERVE_SAY`` is a
line it logs at start (as an engine's warning would be). It records its argv and some environment in
``FAKE_SERVE_RECORD``. With a ``cpu_pool`` in the connector's extra config and ``FAKE_SERVE_SHM`` set, it makes the
pool's directory under ``FAKE_SERVE_SHM`` (as the first replica would in ``/dev/shm``) and leaves it when killed. With a ``trace_path`` in the connector's extra config it writes a load-trace line
(tiered_kv's format) every 50 ms, as a worker rank would.
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from serve_stub import StubServer  # noqa: E402

argv = sys.argv[1:]
if os.environ.get("FAKE_SERVE_RECORD"):
    with open(os.environ["FAKE_SERVE_RECORD"], "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "argv": argv, "LMCACHE_CHUNK_SIZE": os.environ.get("LMCACHE_CHUNK_SIZE"),
                            "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED"),
                            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}) + "\n")
fail = os.environ.get("FAKE_SERVE_FAIL", "")
print("fake vllm serve starting", flush=True)
if os.environ.get("FAKE_SERVE_SAY"):
    print(os.environ["FAKE_SERVE_SAY"], file=sys.stderr, flush=True)
if (fail == "skip" and "--skip-tokenizer-init" in argv) or (fail == "graphs" and "--enforce-eager" not in argv):
    print("ValueError: tokenizer needed" if fail == "skip" else "RuntimeError: CUDA graph capture failed",
          file=sys.stderr, flush=True)
    sys.exit(3)
if "--kv-transfer-config" in argv:  # a connector's per-step load trace (tiered_kv's format): one line per 50 ms
    extra = json.loads(argv[argv.index("--kv-transfer-config") + 1]).get("kv_connector_extra_config", {})
    if extra.get("cpu_pool") and os.environ.get("FAKE_SERVE_SHM"):
        pool = os.path.join(os.environ["FAKE_SERVE_SHM"], f"tiered_kv-{os.getuid()}", extra["cpu_pool"][len("host:"):])
        os.makedirs(pool, exist_ok=True)
        with open(os.path.join(pool, "payload"), "wb") as f:
            f.write(b"\0" * 8192)
    if extra.get("trace_path"):
        import threading

        def write_trace(path=extra["trace_path"] + ".rank0.jsonl"):
            step = 0
            while True:
                step += 1
                line = {"step": step, "t": time.time(), "in_step": {"loads": 1, "bytes": 1 << 20},
                        "async": {"loads": 2, "bytes": 2 << 20}, "start_load_ms": 1.5, "fence_ms": 0.0,
                        "async_in_flight": 2, "landed": [{"job": step, "kind": "in_step", "step": step,
                                                          "bytes": 1 << 20, "gpu_ms": 0.5, "host_ms": 2.0}]}
                with open(path, "a") as f:
                    f.write(json.dumps(line) + "\n")
                time.sleep(0.05)

        threading.Thread(target=write_trace, daemon=True).start()
time.sleep(0.3)  # "loading the model": /health does not answer yet
StubServer(port=int(argv[argv.index("--port") + 1]), exit_after=int(os.environ.get("FAKE_SERVE_EXIT_AFTER", "0"))).start()
while True:
    time.sleep(1)
