"""``tiered-kv top URL``: a live terminal view of a running engine's tiered_kv metrics endpoint.

It reads the Prometheus text a ``metrics_port`` serves (``TieredStore``, the vLLM connector's scheduler
process, the SGLang backend; ``tiered_kv.store.metrics``) every ``--interval`` seconds and shows, per
front end (the ``store`` label): per tier occupancy, hits/s, bytes/s in and out, evictions, failures,
queue depth and load latency; bytes/s per tier edge; the load gate's decisions; remote-tier errors.
Rates are the difference of two scrapes over the time between them; latency quantiles come from the
load histogram's buckets over the same interval (over everything so far on the first frame).

Threading contract: a command-line entry point; runs on the main thread (rich's ``Live`` refreshes
from it too: ``auto_refresh`` is off).
"""
from __future__ import annotations

import argparse
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from tiered_kv.values.units import format_size

_PREFIX = "tiered_kv_"


@dataclass
class Scrape:
    """One read of an endpoint: every ``tiered_kv_*`` sample, keyed by name and sorted label pairs."""

    at: float
    samples: dict[tuple[str, tuple], float] = field(default_factory=dict)

    def value(self, name: str, **labels: str) -> float:
        """The sample ``name`` with exactly ``labels`` (0 when absent)."""
        return self.samples.get((name, tuple(sorted(labels.items()))), 0.0)

    def labels_of(self, name: str, key: str, **match: str) -> list[str]:
        """Distinct values of label ``key`` among samples ``name`` whose labels include ``match``, in the order the
        endpoint listed them (tiers fastest first)."""
        out = dict.fromkeys(dict(lab).get(key) for (n, lab) in self.samples
                            if n == name and match.items() <= dict(lab).items())
        return [v for v in out if v is not None]


def metrics_url(url: str) -> str:
    """``host:port``, ``http://host:port`` or a full URL -> the URL of the metrics page (``/metrics`` by default)."""
    if "://" not in url:
        url = "http://" + url
    scheme, rest = url.split("://", 1)
    return url if "/" in rest.rstrip("/") else f"{scheme}://{rest.rstrip('/')}/metrics"


def scrape(url: str, timeout: float = 5.0) -> Scrape:
    """Read and parse ``url`` once; OSError (with the URL and what to check) when it cannot be read."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            text = resp.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as exc:
        raise OSError(f"cannot read {url}: {exc}; is the engine running with metrics_port set to that port?") from None
    out = Scrape(time.monotonic())
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith(_PREFIX):
                out.samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


# ---------------------------------------------------------------------- numbers
def _rate(cur: Scrape, prev: Scrape | None, name: str, **labels: str) -> float | None:
    """Per-second change of a counter between two scrapes (None on the first frame)."""
    if prev is None or cur.at <= prev.at:
        return None
    return max(0.0, cur.value(name, **labels) - prev.value(name, **labels)) / (cur.at - prev.at)


def _quantiles(cur: Scrape, prev: Scrape | None, store: str, tier: str, qs=(0.5, 0.99)) -> list[float | None]:
    """Load-latency quantiles of ``tier`` from the histogram's bucket counts added since ``prev`` (or all of them
    when ``prev`` is None or nothing was added); the upper bound of the bucket the quantile falls in."""
    name = "tiered_kv_load_seconds_bucket"
    les = cur.labels_of(name, "le", store=store, tier=tier)
    bounds = sorted(les, key=lambda le: float(le))
    counts = [cur.value(name, store=store, tier=tier, le=le) for le in bounds]
    if prev is not None:
        delta = [c - prev.value(name, store=store, tier=tier, le=le) for c, le in zip(counts, bounds)]
        if delta and delta[-1] > 0:
            counts = delta
    if not counts or counts[-1] <= 0:
        return [None for _ in qs]
    return [float(next(le for le, c in zip(bounds, counts) if c >= q * counts[-1])) for q in qs]


def _fmt_rate(v: float | None, unit: str = "") -> str:
    if v is None:
        return "-"
    if unit == "B":
        return f"{format_size(int(v))}/s"
    return f"{v:,.1f}/s" if v < 100 else f"{v:,.0f}/s"



def _fmt_seconds(v: float | None) -> str:
    """A bucket's upper bound: the quantile is at most this."""
    if v is None:
        return "-"
    if v == float("inf"):
        return ">5s"
    return f"≤{v * 1e3:g}ms" if v < 1 else f"≤{v:g}s"


# ---------------------------------------------------------------------- view
def _tier_table(cur: Scrape, prev: Scrape | None, store: str) -> Table:
    t = Table(title=f"tiers ({store}), fastest first", title_justify="left")
    for col in ("tier", "held / cap", "hits", "in", "out", "evicted", "failed / bad", "queue", "load p50 / p99"):
        t.add_column(col, justify="left" if col == "tier" else "right")
    for tier in cur.labels_of("tiered_kv_tier_resident_blocks", "tier", store=store):
        lab = {"store": store, "tier": tier}
        res, cap = cur.value("tiered_kv_tier_resident_blocks", **lab), cur.value("tiered_kv_tier_capacity_blocks", **lab)
        p50, p99 = _quantiles(cur, prev, store, tier)
        t.add_row(tier, f"{res:,.0f} / {cap:,.0f}" if cap else f"{res:,.0f} / -",
                  _fmt_rate(_rate(cur, prev, "tiered_kv_tier_hits_total", **lab)),
                  _fmt_rate(_rate(cur, prev, "tiered_kv_tier_bytes_in_total", **lab), "B"),
                  _fmt_rate(_rate(cur, prev, "tiered_kv_tier_bytes_out_total", **lab), "B"),
                  f"{cur.value('tiered_kv_tier_evictions_total', **lab):,.0f}",
                  f"{cur.value('tiered_kv_tier_failed_transfers_total', **lab):,.0f} / "
                  f"{cur.value('tiered_kv_tier_corrupt_dropped_total', **lab):,.0f}",
                  f"{cur.value('tiered_kv_tier_queue_depth', **lab):,.0f}",
                  "-" if p50 is None else f"{_fmt_seconds(p50)} / {_fmt_seconds(p99)}")
    return t


def _edge_table(cur: Scrape, prev: Scrape | None, store: str) -> Table:
    t = Table(title=f"tier edges ({store}): engine = the engine's blocks", title_justify="left")
    for col in ("edge", "bytes/s", "blocks/s", "bytes so far"):
        t.add_column(col, justify="left" if col == "edge" else "right")
    name = "tiered_kv_edge_bytes_total"
    edges = {(dict(lab)["src"], dict(lab)["dst"]) for (n, lab) in cur.samples
             if n == name and dict(lab).get("store") == store}
    for src, dst in sorted(edges):
        lab = {"store": store, "src": src, "dst": dst}
        t.add_row(f"{src} → {dst}", _fmt_rate(_rate(cur, prev, name, **lab), "B"),
                  _fmt_rate(_rate(cur, prev, "tiered_kv_edge_blocks_total", **lab)),
                  format_size(int(cur.value(name, **lab))))
    return t


def _summary(cur: Scrape, prev: Scrape | None, store: str) -> Text:
    lookups = _rate(cur, prev, "tiered_kv_lookups_total", store=store)
    hits = _rate(cur, prev, "tiered_kv_hits_total", store=store)
    total_l, total_h = cur.value("tiered_kv_lookups_total", store=store), cur.value("tiered_kv_hits_total", store=store)
    rate = f"{hits / lookups:.1%}" if lookups else "-"
    overall = f"{total_h / total_l:.1%}" if total_l else "-"
    return Text(f"{store}: lookups {_fmt_rate(lookups)}, hit rate {rate} now, {overall} since start; "
                f"resident {format_size(int(cur.value('tiered_kv_resident_bytes', store=store)))}; "
                f"jobs in flight {cur.value('tiered_kv_inflight_jobs', store=store):,.0f}")


def _gate_line(cur: Scrape, prev: Scrape | None, store: str) -> Text | None:
    name = "tiered_kv_gate_decisions_total"
    decisions = cur.labels_of(name, "decision", store=store)
    if not decisions:
        return None
    parts = [f"{d} {cur.value(name, store=store, decision=d):,.0f}" for d in decisions]
    return Text(f"load gate ({store}): " + ", ".join(parts)
                + f"; slow-tier blocks declined {cur.value('tiered_kv_gate_declined_blocks_total', store=store):,.0f}"
                + f"; read estimate {cur.value('tiered_kv_gate_read_gbps', store=store):.3g} GB/s"
                + f" vs break-even {cur.value('tiered_kv_gate_break_even_gbps', store=store):.3g} GB/s")


def _remote_line(cur: Scrape, store: str) -> Text | None:
    name = "tiered_kv_remote_errors_total"
    kinds = cur.labels_of(name, "kind", store=store)
    failed = cur.value("tiered_kv_tier_failed_transfers_total", store=store, tier="remote")
    if not kinds and "remote" not in cur.labels_of("tiered_kv_tier_resident_blocks", "tier", store=store):
        return None
    parts = [f"failed transfers {failed:,.0f}"] + [f"{k} {cur.value(name, store=store, kind=k):,.0f}" for k in kinds]
    style = "red" if failed or any(cur.value(name, store=store, kind=k) for k in kinds) else ""
    return Text(f"remote tier ({store}): " + ", ".join(parts), style=style)


def render(url: str, cur: Scrape, prev: Scrape | None) -> Group:
    """One frame: a header, then per front end its summary, tiers, edges, gate and remote lines."""
    stamp = time.strftime("%H:%M:%S")
    since = f"rates over the last {cur.at - prev.at:.1f} s" if prev is not None else "first read: totals only"
    parts: list = [Text(f"tiered-kv top  {url}  {stamp}  ({since})", style="bold")]
    stores = cur.labels_of("tiered_kv_lookups_total", "store")
    if not stores:
        parts.append(Text("no tiered_kv metrics at this URL yet (the store opens when the engine attaches it)"))
    for store in stores:
        parts += [_summary(cur, prev, store), _tier_table(cur, prev, store), _edge_table(cur, prev, store)]
        parts += [x for x in (_gate_line(cur, prev, store), _remote_line(cur, store)) if x is not None]
    return Group(*parts)


def run_top(args: argparse.Namespace, console: Console | None = None) -> int:
    """Show the endpoint: ``--once`` prints one frame (two reads ``--interval`` apart) and exits; otherwise a
    live view until Ctrl-C (or ``--iterations`` frames). Returns 2 when the endpoint cannot be read at start."""
    con = console or Console()
    url = metrics_url(args.url)
    try:
        prev = scrape(url)
    except OSError as exc:
        con.print(f"[red]{exc}")
        return 2
    if args.once:
        time.sleep(args.interval)
        cur = _read_or_keep(url, prev, con)
        con.print(render(url, cur, prev if cur is not prev else None))
        return 0
    frames = 0
    with Live(render(url, prev, None), console=con, auto_refresh=False, screen=False) as live:
        try:
            while args.iterations is None or frames < args.iterations:
                time.sleep(args.interval)
                cur = _read_or_keep(url, prev, con)
                live.update(render(url, cur, prev if cur is not prev else None), refresh=True)
                prev, frames = cur, frames + 1
        except KeyboardInterrupt:
            pass
    return 0


def _read_or_keep(url: str, prev: Scrape, con: Console) -> Scrape:
    """A new read, or the last one when the endpoint went away for a moment (the view keeps going)."""
    try:
        return scrape(url)
    except OSError as exc:
        con.log(f"[yellow]{exc}")
        return prev


def add_parser(sub) -> None:
    """The ``top`` sub-command's arguments."""
    p = sub.add_parser("top", help="live view of a running engine's tiered_kv metrics endpoint (metrics_port)")
    p.add_argument("url", help="the metrics endpoint: host:port, http://host:port or http://host:port/metrics")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between reads (default 2)")
    p.add_argument("--once", action="store_true", help="print one frame (two reads --interval apart) and exit")
    p.add_argument("--iterations", type=int, default=None, help="stop after this many frames (default: Ctrl-C)")
