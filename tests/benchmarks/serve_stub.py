"""A stand-in for ``vllm serve`` for the CPU tests of ``benchmarks/serve_bench.py``.

A real vLLM server cannot run on the CPU test machine (no GPU; the vLLM in .venv is a CPU build
of another version, and a dummy 8B model would take minutes per request there). This aiohttp app
speaks the parts of vLLM's OpenAI API the benchmark uses, in the same wire format as vLLM 0.26:
``POST /v1/completions`` streamed as SSE (a first chunk carrying ``prompt_token_ids``, one chunk
per token or ``chunk_tokens`` tokens, a final usage chunk with ``prompt_tokens_details`` and
``metrics``, then ``[DONE]``), ``GET /health``, ``/version`` and ``/metrics`` (Prometheus text
with ``vllm:prompt_tokens_by_source_total`` counters that grow with the prompts served).

Outputs are a pure function of the prompt (greedy and seeded, like dummy weights), and "cached"
tokens are the prompt's longest prefix seen before (rounded down to 16-token blocks).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading

from aiohttp import web


class StubServer:
    """Runs the app on 127.0.0.1 in a background thread; ``url`` once started."""

    def __init__(self, token_delay_s: float = 0.001, chunk_tokens: int = 1, fail_every: int = 0, port: int = 0,
                 exit_after: int = 0) -> None:
        self.port = port
        self.exit_after = exit_after  # requests, then the process exits (a server crash)
        self.token_delay_s = token_delay_s
        self.chunk_tokens = chunk_tokens
        self.fail_every = fail_every
        self.in_flight = 0
        self.max_in_flight = 0
        self.requests: list[list[int]] = []  # prompts in arrival order
        self.counters = {"local_compute": 0, "local_cache_hit": 0, "external_kv_transfer": 0}
        self._seen: set[bytes] = set()
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    # ------------------------------------------------------------------ app
    def _cached(self, prompt: list[int]) -> int:
        hit, h = 0, hashlib.sha1()
        for end in range(16, len(prompt) + 1, 16):
            h.update(json.dumps(prompt[end - 16:end]).encode())
            key = h.copy().digest()
            if key in self._seen and hit == end - 16:
                hit = end
            self._seen.add(key)
        return hit

    @staticmethod
    def outputs(prompt: list[int], n: int) -> list[int]:
        """The stub's greedy output for a prompt."""
        h = int(hashlib.sha1(json.dumps(prompt).encode()).hexdigest(), 16)
        return [(h >> (7 * i)) % 50000 + 1000 for i in range(n)]

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt, n = body["prompt"], body["max_tokens"]
        self.requests.append(prompt)
        if self.exit_after and len(self.requests) > self.exit_after:
            os._exit(1)
        if self.fail_every and len(self.requests) % self.fail_every == 0:
            return web.json_response({"object": "error", "message": "stub failure"}, status=500)
        assert body["stream"] and body["ignore_eos"] and body["return_token_ids"] and body["temperature"] == 0
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            cached = self._cached(prompt)
            self.counters["local_cache_hit"] += min(cached, 64)
            self.counters["external_kv_transfer"] += max(0, cached - 64)
            self.counters["local_compute"] += len(prompt) - cached
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            out = self.outputs(prompt, n)
            await asyncio.sleep(0.002)  # "prefill"
            for i in range(0, n, self.chunk_tokens):
                ids = out[i:i + self.chunk_tokens]
                choice = {"index": 0, "text": "", "token_ids": ids, "finish_reason": None}
                if i == 0:
                    choice["prompt_token_ids"] = prompt
                await resp.write(f"data: {json.dumps({'id': 'x', 'choices': [choice]})}\n\n".encode())
                await asyncio.sleep(self.token_delay_s)
            usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n,
                     "prompt_tokens_details": {"cached_tokens": cached}}
            final = {"id": "x", "choices": [], "usage": usage, "metrics": {"queue_time_ms": 0.5,
                                                                           "time_to_first_token_ms": 2.0}}
            await resp.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
            await resp.write_eof()
            return resp
        finally:
            self.in_flight -= 1

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "stub"})

    async def metrics(self, request: web.Request) -> web.Response:
        lines = ["# TYPE vllm:prompt_tokens_by_source_total counter"]
        for src, v in self.counters.items():
            lines.append(f'vllm:prompt_tokens_by_source_total{{engine="0",model_name="m",source="{src}"}} {float(v)}')
        lines.append(f'vllm:num_requests_running{{engine="0",model_name="m"}} {float(self.in_flight)}')
        return web.Response(text="\n".join(lines) + "\n")

    # ------------------------------------------------------------------ thread
    def start(self) -> "StubServer":
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "stub server did not start"
        return self

    def _serve(self) -> None:
        self._loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.version)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", self.port)
        self._loop.run_until_complete(site.start())
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self._runner = runner
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
