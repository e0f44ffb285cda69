"""Helpers for the metrics tests: the Grafana dashboard's queries, a free port, and the names a live endpoint serves.

Threading contract: test code; called from the test thread.
"""
from __future__ import annotations

import json
import re
import socket
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "tiered_kv.json"
#: metrics every front end exports (the store families); the others come only from some (gate, remote errors)
COMMON_PREFIXES = ("tiered_kv_tier_", "tiered_kv_edge_", "tiered_kv_load_seconds", "tiered_kv_lookups", "tiered_kv_hits",
                   "tiered_kv_resident", "tiered_kv_inflight")


def dashboard_exprs() -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and template-variable queries."""
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", ())]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if isinstance(v.get("query"), dict)]
    return exprs


def dashboard_metrics() -> set[str]:
    """Metric names (as samples are named: ``_total``, ``_bucket``) the dashboard's expressions read."""
    return {m for e in dashboard_exprs() for m in re.findall(r"\btiered_kv_[a-z0-9_]+", e)}


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape_text(port: int) -> str:
    """The metrics page a ``metrics_port`` serves."""
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def sample_names(text: str) -> set[str]:
    """Names of the ``tiered_kv_*`` samples in a Prometheus text page (with their values' label sets ignored)."""
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith("tiered_kv_")}
