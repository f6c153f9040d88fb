"""Small aiohttp servers standing in for engines in the router's fast tests: /health (switchable),
/metrics in vLLM's names, /tokenize (one token per character), /v1/completions and /v1/chat/completions
(a JSON answer naming the engine, or server-sent events released chunk by chunk), /v1/models and, when
given, /server_info like vLLM's dev-mode one.  Each records the bodies and headers it was sent."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web


class FakeEngine:
    def __init__(self, name: str, *, running: int = 0, waiting: int = 0,
                 server_info: dict[str, Any] | None = None) -> None:
        self.name = name
        self.healthy = True
        self.running = running
        self.waiting = waiting
        self.server_info = server_info
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.tokenize_calls: list[dict[str, Any]] = []
        self.release = asyncio.Event()  # a stream's chunks after the first wait for this
        self.release.set()
        self.first = asyncio.Event()  # a stream's first chunk (its "first token") waits for this
        self.first.set()
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> "FakeEngine":
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/server_info", self._server_info)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port or self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        text = ("# HELP vllm:num_requests_running running\n# TYPE vllm:num_requests_running gauge\n"
                f'vllm:num_requests_running{{engine="0",model_name="m"}} {self.running}.0\n'
                "# HELP vllm:num_requests_waiting waiting\n# TYPE vllm:num_requests_waiting gauge\n"
                f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {self.waiting}.0\n')
        return web.Response(text=text, content_type="text/plain")

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.tokenize_calls.append(body)
        if "prompt" in body:
            text = body["prompt"]
        else:
            text = "".join(f"<{m['role']}>{m['content']}" for m in body["messages"]) + "<assistant>"
        toks = [ord(c) for c in text]
        return web.json_response({"count": len(toks), "max_model_len": 4096, "tokens": toks})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model", "owned_by": self.name}]})

    async def _server_info(self, request: web.Request) -> web.Response:
        if self.server_info is None:
            return web.Response(status=404)
        return web.json_response({"vllm_config": {"cache_config": self.server_info}})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        if body.get("bad"):
            return web.json_response({"error": {"message": "bad request", "code": 400}}, status=400)
        if not body.get("stream"):
            return web.json_response({"id": "x", "engine": self.name, "echo": body})
        out = web.StreamResponse()
        out.content_type = "text/event-stream"
        await out.prepare(request)
        await self.first.wait()
        for i in range(3):
            await out.write(f"data: {json.dumps({'engine': self.name, 'i': i})}\n\n".encode())
            if i == 0:
                await self.release.wait()
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out
