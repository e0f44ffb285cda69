"""``tiered-kv top URL`` against a live metrics endpoint: a real TieredStore with ``metrics_port``."""
from __future__ import annotations

import threading

import torch

from tests._metrics import free_port
from tiered_kv import TieredStore
from tiered_kv.cli.main import main
from tiered_kv.cli.top import metrics_url

SHAPE = (2, 4, 64)


def _busy(store: TieredStore, stop: threading.Event) -> None:
    """Puts that cascade down the chain and gets that load back, until ``stop``."""
    i = 0
    while not stop.is_set():
        keys = [bytes([i % 251, j]) * 16 for j in range(24)]
        store.put(keys, torch.randn((24, *SHAPE))).wait(30)
        store.get(keys, torch.empty((24, *SHAPE))).wait(30)
        i += 1


def test_top_once_shows_tiers_edges_rates_and_latency(small_cfg, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich's width when not on a terminal: no wrapped cells
    port = free_port()
    with TieredStore(small_cfg(metrics_port=port)) as store:
        stop = threading.Event()
        worker = threading.Thread(target=_busy, args=(store, stop), daemon=True)
        worker.start()
        try:
            assert main(["top", f"127.0.0.1:{port}", "--once", "--interval", "0.5"]) == 0
        finally:
            stop.set()
            worker.join(30)
    out = capsys.readouterr().out
    assert f"http://127.0.0.1:{port}/metrics" in out and "rates over the last" in out
    for text in ("tiers (default)", "gpu", "cpu", "disk", "engine → gpu", "gpu → cpu", "load p50 / p99"):
        assert text in out, text
    assert "MiB/s" in out or "KiB/s" in out  # rates between the two reads, not only totals
    assert "ms /" in out  # latency quantiles from the load histogram


def test_top_live_view_runs_frames_then_stops(small_cfg, capsys):
    port = free_port()
    with TieredStore(small_cfg(metrics_port=port)):
        assert main(["top", f"http://127.0.0.1:{port}", "--interval", "0.1", "--iterations", "2"]) == 0
    assert "tiers (default)" in capsys.readouterr().out


def test_top_unreachable_endpoint_says_what_to_check(capsys):
    assert main(["top", f"127.0.0.1:{free_port()}", "--once"]) == 2
    out = capsys.readouterr().out
    assert "cannot read" in out and "metrics_port" in out


def test_metrics_url_forms():
    assert metrics_url("localhost:9400") == "http://localhost:9400/metrics"
    assert metrics_url("http://h:1/") == "http://h:1/metrics"
    assert metrics_url("https://h:1/custom") == "https://h:1/custom"
