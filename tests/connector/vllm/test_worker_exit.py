"""A process that never shuts the connector down still exits cleanly, with its queued stores done.

``LLM`` in-process (vLLM's ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) does not call the connector's
``shutdown`` at exit; a store queued by the last request (e.g. its tail piece at finish) then ran on
our daemon threads while the interpreter finalized, and on the GPU machine the process aborted after
its work ("terminate called without an active exception", rc -6; 2026-11-23). The worker registers an
exit hook that closes it first. Here a child process queues stores and exits without ``close``.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

CHILD = textwrap.dedent("""
    import logging, sys, time
    import torch
    sys.path.insert(0, {tests!r})
    from connector.vllm.test_worker_in_step import make_runtime, K
    from tiered_kv.connector.vllm.common import CPU, StepPlan
    from tiered_kv.values.jobs import EXT, JobKind, TransferJob
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
    chunks = 24
    rt, kv, names = make_runtime("cpu", 4, 2, 64, chunks * K + 2, cpu_chunks=chunks + 2, load_mode="async")
    for t in kv.values():
        t.normal_()
    # many store jobs, none waited for: the process ends with them queued on the mover thread
    for j in range(chunks):
        job = TransferJob(j + 1, JobKind.INGRESS, EXT, CPU, [b"k%d" % j], [j], [0])
        rt.on_plan(StepPlan(j + 1, stores=[job], ext={{j + 1: list(range(j * K, (j + 1) * K))}}))
        rt.after_forward()
    print("LEAVING", flush=True)
""")


def test_exit_without_shutdown_closes_the_worker():
    tests = os.path.join(ROOT, "tests")
    proc = subprocess.run([sys.executable, "-c", CHILD.format(tests=tests)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "LEAVING" in out
    assert "terminate called" not in out
    assert "closed at interpreter exit" in out, out[-3000:]  # the hook closed what nobody shut down
    assert "closing at interpreter exit failed" not in out
