"""The load generator: streaming ``/v1/completions`` requests with token-id prompts, closed loop.

Each request asks for greedy decoding of a fixed number of tokens (``temperature`` 0,
``ignore_eos``: dummy weights emit EOS at random) and streams them back with their token ids
(``return_token_ids``: with ``--skip-tokenizer-init`` the text is empty), plus a final usage chunk
(prompt, completion and cached prompt tokens; with ``--enable-per-request-metrics`` the server's
queue time). The client timestamps every SSE chunk when its bytes arrive.

A phase runs ``concurrency`` workers over an ordered list of (user, turn) items: a worker takes
the next item, waits until the same user's previous turn has finished (a user never has two
requests in flight), sends it, and takes the next item when the answer is complete. So exactly
``concurrency`` users are in flight while items remain. With several replicas the phase's ``base_url`` is a
router, ``(user, turn) -> url`` (``serving/replicas.py``: round robin per turn).

Threading contract: one asyncio event loop; nothing here is shared across threads.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict, deque
from dataclasses import asdict, dataclass, field

import aiohttp

STUCK_S = 30.0


@dataclass
class RequestResult:
    """What the client saw of one request (times in seconds; chunk times relative to the send)."""

    user: int = -1
    turn: int = -1
    prompt_len: int = 0
    sent_at: float = 0.0  # relative to the phase start
    ttft_s: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    queue_ms: float | None = None
    server_ttft_ms: float | None = None
    error: str | None = None

    def as_dict(self) -> dict:
        """Plain dict (for ``stats.summarize``)."""
        return asdict(self)


def completion_body(prompt: list[int], max_tokens: int) -> dict:
    """The request every mode gets: greedy, fixed length, streamed with token ids and usage."""
    return {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}


async def stream_completion(session: aiohttp.ClientSession, base_url: str, prompt: list[int],
                            max_tokens: int, phase_t0: float | None = None) -> RequestResult:
    """Send one streaming completion and record its chunks (never raises for server-side errors)."""
    res = RequestResult(prompt_len=len(prompt))
    t_send = time.perf_counter()
    if phase_t0 is not None:
        res.sent_at = t_send - phase_t0
    try:
        async with session.post(base_url + "/v1/completions", json=completion_body(prompt, max_tokens)) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return res
            buf = b""
            done = False
            async for data in resp.content.iter_any():  # lines can be long (the prompt's ids): split here
                now = time.perf_counter() - t_send
                buf += data
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if _event(res, line.strip(), now):
                        done = True
                if done:
                    break
            if buf.strip() and not done:
                _event(res, buf.strip(), time.perf_counter() - t_send)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"[:300]
    if res.error is None and res.ttft_s is None:
        res.error = "no output tokens in the stream"
    return res


def _event(res: RequestResult, line: bytes, now: float) -> bool:
    """Apply one SSE line; True at ``[DONE]``."""
    if not line.startswith(b"data:"):
        return False
    payload = line[5:].strip()
    if payload == b"[DONE]":
        return True
    try:
        obj = json.loads(payload)
    except ValueError:
        res.error = f"bad SSE payload: {payload[:200]!r}"
        return True
    if obj.get("error") or obj.get("object") == "error":
        res.error = f"server error: {json.dumps(obj)[:300]}"
        return True
    choices = obj.get("choices") or []
    ids = (choices[0].get("token_ids") or []) if choices else []
    if ids:
        if res.ttft_s is None:
            res.ttft_s = now
        res.chunk_times.append(now)
        res.chunk_tokens.append(len(ids))
        res.token_ids.extend(ids)
    usage = obj.get("usage")
    if usage and not choices:  # the final usage chunk (continuous usage is not requested)
        res.prompt_tokens = usage.get("prompt_tokens")
        res.completion_tokens = usage.get("completion_tokens")
        res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        metrics = obj.get("metrics") or {}
        res.queue_ms = metrics.get("queue_time_ms")
        res.server_ttft_ms = metrics.get("time_to_first_token_ms")
    return False


@dataclass
class PhaseRun:
    """A finished (or cut short) phase."""

    results: list[RequestResult]
    wall_s: float
    truncated: bool


async def run_phase(session: aiohttp.ClientSession, base_url, items, prompt_of, concurrency: int,
                    max_tokens: int, stop_at: float | None = None) -> PhaseRun:
    """Closed loop over ``items`` [(user, turn)] with ``concurrency`` workers; ``prompt_of(user, turn)``
    gives the token ids. ``base_url``: one server's URL, or a router ``(user, turn) -> URL`` choosing the
    server of each request. No new request starts after ``stop_at`` (``time.monotonic()``)."""
    url_of = base_url if callable(base_url) else (lambda user, turn: base_url)
    queue = deque(items)
    locks: dict[int, asyncio.Lock] = defaultdict(asyncio.Lock)
    results: list[RequestResult] = []
    truncated = False
    t0 = time.perf_counter()

    async def worker() -> None:
        nonlocal truncated
        while queue:
            if stop_at is not None and time.monotonic() >= stop_at:
                truncated = True
                return
            user, turn = queue.popleft()
            async with locks[user]:  # FIFO: the user's earlier turn (taken earlier) goes first
                r = await stream_completion(session, url_of(user, turn), prompt_of(user, turn), max_tokens, t0)
            r.user, r.turn = user, turn
            results.append(r)

    workers = asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(queue))))))
    if stop_at is None:
        await workers
    else:  # requests still in flight STUCK_S after the deadline are cancelled (a hung server)
        try:
            await asyncio.wait_for(workers, timeout=max(1.0, stop_at - time.monotonic() + STUCK_S))
        except asyncio.TimeoutError:
            truncated = True
    return PhaseRun(results, time.perf_counter() - t0, truncated)


def make_session(concurrency: int, request_timeout_s: float) -> aiohttp.ClientSession:
    """One session per engine start: enough connections for every worker, a read timeout per request."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=concurrency + 8, force_close=False),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=request_timeout_s))
