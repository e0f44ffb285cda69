"""Numbers of one phase: percentiles, inter-token latency, output rate, and Prometheus deltas.

Pure functions over plain values (no I/O), so the tests can check every formula on the CPU.

- TTFT of a request: first streamed chunk that carries output token ids, minus the send time.
- ITL: the gaps between a request's later token-carrying chunks. Under load one chunk can carry
  several tokens; a gap of g seconds before a chunk of k tokens counts as k gaps of g/k (vLLM's
  own ``inter_token_latency_seconds`` histogram spreads the same way).
- Output tokens/s of a phase: all output tokens of its requests / the phase's wall time.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence

_PROM_LINE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+(\S+)')
_PROM_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
#: labels that only say which engine or model a sample belongs to (one of each here): dropped
_NOISE_LABELS = ("engine", "model_name")


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default); None when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def spread_gaps(chunk_times: Sequence[float], chunk_tokens: Sequence[int]) -> list[float]:
    """Inter-token gaps of one request from its token-carrying chunks (times in s, tokens per chunk).

    The first chunk's tokens come at TTFT; its extra tokens (k > 1) count as gaps of 0. Every later
    chunk of k tokens after a gap g adds k gaps of g / k.
    """
    gaps: list[float] = []
    if not chunk_times:
        return gaps
    gaps += [0.0] * max(0, chunk_tokens[0] - 1)
    for i in range(1, len(chunk_times)):
        k = max(1, chunk_tokens[i])
        gaps += [(chunk_times[i] - chunk_times[i - 1]) / k] * k
    return gaps


def summarize(results: Iterable[dict], wall_s: float) -> dict:
    """One phase's numbers from its request results (``client.RequestResult.as_dict()`` shape)."""
    results = list(results)
    ok = [r for r in results if not r.get("error")]
    ttft = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
    gaps: list[float] = []
    for r in ok:
        gaps += spread_gaps(r.get("chunk_times", ()), r.get("chunk_tokens", ()))
    out_tokens = sum(r.get("completion_tokens") or sum(r.get("chunk_tokens", ())) for r in ok)
    queue = [r["queue_ms"] for r in ok if r.get("queue_ms") is not None]
    ms = lambda v: None if v is None else round(v * 1e3, 3)  # noqa: E731
    return {
        "requests": len(results), "errors": len(results) - len(ok), "wall_s": round(wall_s, 3),
        "ttft_ms": {"p50": ms(percentile(ttft, 50)), "p90": ms(percentile(ttft, 90)),
                    "p99": ms(percentile(ttft, 99)), "mean": ms(sum(ttft) / len(ttft)) if ttft else None},
        "itl_ms": {"p50": ms(percentile(gaps, 50)), "p90": ms(percentile(gaps, 90))},
        "output_tokens": out_tokens,
        "output_tok_s": round(out_tokens / wall_s, 2) if wall_s > 0 else None,
        "req_s": round(len(ok) / wall_s, 3) if wall_s > 0 else None,
        "prompt_tokens": sum(r.get("prompt_tokens") or 0 for r in ok),
        "cached_tokens": sum(r.get("cached_tokens") or 0 for r in ok),
        "server_queue_ms_p50": round(percentile(queue, 50), 3) if queue else None,
    }


#: first tokens that reach the client at most this far apart came out of one engine step (a decode step of these
#: shapes takes 4-7 ms on the H200; one step's streamed chunks arrive within ~1 ms of each other)
WAVE_GAP_S = 0.002


def first_token_waves(results: Iterable[dict], concurrency: int, gap_s: float = WAVE_GAP_S) -> dict | None:
    """How a closed-loop phase's first tokens bunched: the *shape* of its waves, which moves TTFT between engine starts.

    A closed loop of ``concurrency`` users can settle into waves: users whose requests shared a prefill step get
    their answers together and send their next turns together, so the next step prefills (and loads) them all at
    once and every one of them waits for the whole step. First tokens (send time + TTFT) closer than ``gap_s`` count
    as one wave. Returns the number of waves, the mean and largest wave, and ``together``: the share of requests
    whose first token came in a wave of at least half the concurrency (at least 2); None without a first token.
    """
    times = sorted(r["sent_at"] + r["ttft_s"] for r in results
                   if not r.get("error") and r.get("ttft_s") is not None and r.get("sent_at") is not None)
    if not times:
        return None
    sizes, n = [], 1
    for a, b in zip(times, times[1:]):
        if b - a <= gap_s:
            n += 1
        else:
            sizes.append(n)
            n = 1
    sizes.append(n)
    big = max(2, concurrency // 2)
    return {"waves": len(sizes), "mean": round(len(times) / len(sizes), 2), "max": max(sizes),
            "together": round(sum(k for k in sizes if k >= big) / len(times), 3), "gap_ms": gap_s * 1e3}


# ---------------------------------------------------------------------------- Prometheus text
def parse_prometheus(text: str) -> dict[str, float]:
    """Samples of a Prometheus text page as ``{'name{k="v",...}': value}``, engine/model labels dropped.

    Samples equal after dropping those labels are summed. Histogram buckets are skipped (``_sum``
    and ``_count`` are kept): the deltas we report are totals, not distributions.
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _PROM_LINE.match(line)
        if not m or m.group(1).endswith("_bucket"):
            continue
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        labels = [(k, v) for k, v in _PROM_LABEL.findall(m.group(3) or "") if k not in _NOISE_LABELS]
        key = m.group(1) + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels)) + "}" if labels else "")
        out[key] = out.get(key, 0.0) + value
    return out


def is_total(key: str) -> bool:
    """Counters and histogram totals: the samples whose difference over a phase means something."""
    name = key.split("{", 1)[0]
    return name.endswith(("_total", "_sum", "_count"))


def prom_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """After minus before for counters and histogram totals that moved (gauges: their value after)."""
    out = {}
    for key, value in after.items():
        d = value - before.get(key, 0.0) if is_total(key) else value
        if d:
            out[key] = round(d, 6)
    return out


def by_label(delta: dict[str, float], name: str, label: str) -> dict[str, float]:
    """``{label value: sample}`` of one metric in a parsed page or delta."""
    out = {}
    pat = re.compile(re.escape(name) + r"\{(.*)\}$")
    for key, value in delta.items():
        m = pat.match(key)
        if m:
            labels = dict(_PROM_LABEL.findall(m.group(1)))
            if label in labels:
                out[labels[label]] = out.get(labels[label], 0.0) + value
    return out


def token_sources(vllm_delta: dict[str, float]) -> dict[str, float]:
    """Prompt tokens of a phase by where their KV came from: recomputed, GPU prefix cache, connector."""
    src = by_label(vllm_delta, "vllm:prompt_tokens_by_source_total", "source")
    return {"computed": src.get("local_compute", 0.0), "gpu_hit": src.get("local_cache_hit", 0.0),
            "connector_hit": src.get("external_kv_transfer", 0.0)}


#: vLLM's per-request histograms whose mean over a phase ``engine_times`` reports (ms), by the name it gives them
ENGINE_TIMES = {"queue": "vllm:request_queue_time_seconds", "prefill": "vllm:request_prefill_time_seconds",
                "ttft": "vllm:time_to_first_token_seconds", "decode": "vllm:request_decode_time_seconds"}


def engine_times(vllm_delta: dict[str, float]) -> dict[str, float]:
    """The engine's own mean times of a phase's requests (ms): queued, prefill (scheduled to first token), TTFT as
    the server saw it, decode; from the histograms' sums and counts (a time whose histogram did not move is left
    out), with ``n``, the requests they count: one more than the phase's, as ``serve_bench`` sends its 16-token
    flush request before it scrapes (every mode the same). The prefill time is what a connector's work inside the
    engine adds to, apart from the client's and the HTTP server's share of the TTFT (round 20 compared modes by it)."""
    out = {}
    for name, metric in ENGINE_TIMES.items():
        count = vllm_delta.get(metric + "_count", 0.0)
        if count > 0:
            out[name] = round(vllm_delta.get(metric + "_sum", 0.0) / count * 1e3, 3)
            out.setdefault("n", count)
    return out


def tier_hits(tkv_delta: dict[str, float], chunk_tokens: int) -> dict[str, float]:
    """Our connector's loads per tier (``tiered_kv_tier_hits_total``, in chunks) as tokens."""
    return {tier: n * chunk_tokens for tier, n in by_label(tkv_delta, "tiered_kv_tier_hits_total", "tier").items()}


def load_costs(tkv_delta: dict[str, float]) -> dict:
    """What the split measured its in-step loads to cost (gauges: their value at the phase's end) and the hits the
    CPU tier's load floor sent to recompute in the phase: ``load_floor_ms``, ``overlap_s_per_gb`` per slow tier,
    ``recomputed_hits``. Empty where the connector reports none."""
    floor = by_label(tkv_delta, "tiered_kv_split_load_floor_seconds", "store")
    overlap = by_label(tkv_delta, "tiered_kv_split_overlap_seconds_per_gb", "tier")
    recomputed = by_label(tkv_delta, "tiered_kv_gate_decisions_total", "decision").get("recompute", 0.0)
    if not (floor or overlap or recomputed):
        return {}
    return {"load_floor_ms": round(sum(floor.values()) * 1e3, 3), "overlap_s_per_gb": overlap,
            "recomputed_hits": recomputed}


def worker_time(tkv_delta: dict[str, float], vllm_delta: dict[str, float]) -> dict:
    """What our vLLM workers cost vLLM's thread in a phase (``tiered_kv_worker_seconds_total``, every rank summed):
    ms per engine step (steps: ``vllm:iteration_tokens_total_count``) inside our hooks (``hook_*``, plus the in-step
    submissions between layers, ``layer_submit``), of which fence waits; ms per hook; stores cancelled by fences. Empty
    without the workers' counters (no ``metrics_port``, or a connector that ships none). Also the movers' threads'
    CPU ms (``mover_cpu_ms``, of it ``store_cpu_ms``): time they may have held the GIL vLLM's thread needs. And
    ``submit_ms_per_load``: vLLM's thread in ``start_load_kv`` and between layers per load started (in-step and
    asynchronous; None without loads), the host cost of a load that issue 31's c8 cell follows."""
    secs = by_label(tkv_delta, "tiered_kv_worker_seconds_total", "what")
    if not secs:
        return {}
    events = by_label(tkv_delta, "tiered_kv_worker_events_total", "what")
    steps = vllm_delta.get("vllm:iteration_tokens_total_count", 0.0)
    hooks = {k.removeprefix("hook_"): v * 1e3 for k, v in secs.items() if k.startswith("hook_")}
    hooks["layer_submit"] = secs.get("layer_submit", 0.0) * 1e3
    total = sum(hooks.values())
    loads = events.get("sync_loads", 0.0) + events.get("async_loads", 0.0)
    submit = hooks.get("start_load_kv", 0.0) + hooks["layer_submit"]
    return {"steps": steps, "hook_ms": round(total, 3),
            "submit_ms_per_load": round(submit / loads, 4) if loads else None,
            "hook_ms_per_step": round(total / steps, 4) if steps else None,
            "by_hook_ms": {k: round(v, 3) for k, v in sorted(hooks.items())},
            "fence_wait_ms": round(secs.get("fence_wait", 0.0) * 1e3, 3),
            # the movers' threads' CPU (time the GIL may have been taken from vLLM's thread), of it the stores'
            "mover_cpu_ms": round(secs.get("mover_cpu", 0.0) * 1e3, 3),
            "store_cpu_ms": round(secs.get("store_cpu", 0.0) * 1e3, 3),
            "stores_cancelled": events.get("stores_cancelled", 0.0),
            "copies": {k: events.get(k, 0.0) for k in ("sync_loads", "sync_staged_copies", "sync_sm_copies",
                                                       "async_loads")}}
