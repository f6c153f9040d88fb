"""The router's HTTP front: an OpenAI-compatible server that sends each request to one of N engines.

Paths (aiohttp server; engines are reached with one aiohttp client session):

- ``POST /v1/completions``, ``POST /v1/chat/completions``: the JSON body goes to the chosen engine
  unchanged (except ``kv_transfer_params``, below); the answer comes back as the engine sent it: status,
  content type and body, and with ``"stream": true`` each chunk of its server-sent events as it arrives.
  A request that cannot connect to its endpoint is retried once on the policy's next choice, and the
  endpoint is taken out until its next good health poll.  No endpoint routable: 503 with a JSON error.
- ``GET /v1/models``: a routable endpoint's answer.
- ``GET /health``: 200 when at least one endpoint is routable, else 503; the JSON names each endpoint's
  state (``up``, ``down``, ``refused``) and why.
- ``GET /metrics``: Prometheus text (``kvgate_router_*``: requests per endpoint and policy, decision and
  tokenize latency, matched blocks per tier, endpoints up and refused).
- ``POST /v1/score``: ``{prompt | messages | token_ids, model}`` in; each endpoint's matched blocks per tier
  (gpu, cpu, storage), prefill left, load and cost out, for an external picker (llm-d, Dynamo).

Tokenizing: to hash a prompt as the engine does, the router must have the engine's token ids.  It asks a
routable endpoint's ``POST /tokenize`` (vLLM 0.32 and SGLang: ``{"model", "prompt"}`` for a completion, or
``{"model", "messages"}`` for a chat, where the engine applies its chat template with
``add_generation_prompt`` true as a chat completion does; the answer's ``tokens``).  That is one more HTTP
round trip before the request is sent, paid only by the cache-aware policy and ``/v1/score``; a completion
whose ``prompt`` is already token ids skips it.  When tokenizing fails the request is still routed (by
load).

llm-d's peer-source contract: a request with header ``x-kv-cache-source-host-port: host:port`` is sent on
with ``kv_transfer_params.remote_kv_source = {kv_request_id, remote_host, remote_port}`` added to its body
(``kv_request_id``: the request's ``x-request-id`` header, else a fresh id, which is also sent on as
``x-request-id``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from kvgate.errors import InvalidArgument
from kvgate.routing.endpoints import EndpointPool, EndpointState
from kvgate.routing.feeds import Feeds
from kvgate.routing.handoff import Handoff, handoff_blocks, prefill_body, prompt_cached
from kvgate.routing.hashing import BlockHasher
from kvgate.routing.index import KvIndex
from kvgate.routing.policies import CacheAware, Decision, make_policy
from kvgate.routing.score import Endpoint, Scorer
from kvgate.routing.settings import EndpointSpec, RouterSettings
from kvgate.types import split_host_port

log = logging.getLogger("kvgate.router")

SOURCE_HEADER = "x-kv-cache-source-host-port"
# request headers sent on to the engine (the rest, Host and Content-Length above all, are the client's
# connection to the router, not to the engine)
_FORWARD = ("authorization", "x-request-id", "traceparent", "tracestate")
_CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)


class _PrefillAhead:
    """A request's share of its endpoint's ``prefilling`` (the blocks it was scored to compute), counted
    from its dispatch until its first byte comes back (or it fails), once."""

    __slots__ = ("ep", "blocks")

    def __init__(self, ep: EndpointState, blocks: int) -> None:
        self.ep, self.blocks = ep, blocks
        ep.prefilling += blocks

    def done(self) -> None:
        self.ep.prefilling -= self.blocks
        self.blocks = 0


def _route_headers(url: str, decision: Decision) -> dict[str, str]:
    """What the answer tells of the choice: ``x-kvgate-endpoint`` (the engine that answered) and, when the
    policy scored, ``x-kvgate-matched`` (its matched blocks per tier, the blocks left to prefill, its cost)."""
    out = {"x-kvgate-endpoint": url}
    for s in decision.scores or ():
        if s.endpoint == url:
            out["x-kvgate-matched"] = (f"gpu={s.gpu} cpu={s.cpu} storage={s.storage} prefill={s.prefill} "
                                       f"cost={s.cost:.3g}")
    return out


def _error(status: int, message: str, kind: str = "router_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


def add_remote_source(body: dict[str, Any], header: str, request_id: str) -> None:
    """Put llm-d's ``remote_kv_source`` for ``header`` (``host:port``; IPv6 as ``[addr]:port``) into
    ``body["kv_transfer_params"]`` (kept, when the client sent some).  InvalidArgument for a bad header."""
    try:
        host, port = split_host_port(header)
    except ValueError as e:
        raise InvalidArgument(f"{SOURCE_HEADER}: {header!r} is not host:port (e.g. 10.0.0.7:8000): {e}") from None
    params = body.get("kv_transfer_params")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise InvalidArgument(f"kv_transfer_params must be a JSON object to add remote_kv_source to, "
                              f"got {type(params).__name__}")
    params["remote_kv_source"] = {"kv_request_id": request_id, "remote_host": host, "remote_port": port}
    body["kv_transfer_params"] = params


class Metrics:
    """The router's Prometheus metrics, on their own registry (a process may run a gateway beside it)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvgate_router_requests", "requests sent to an endpoint, by policy",
                                ["endpoint", "policy"], registry=r)
        self.retries = Counter("kvgate_router_retries", "requests retried on the next choice after a "
                               "connect failure", ["endpoint"], registry=r)
        self.failures = Counter("kvgate_router_failures", "requests answered 502/503 by the router", ["why"],
                                registry=r)
        self.decision = Histogram("kvgate_router_decision_seconds", "time to choose an endpoint "
                                  "(hashing and scoring; not tokenizing)", registry=r,
                                  buckets=(1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2))
        self.tokenize = Histogram("kvgate_router_tokenize_seconds", "time of the engine's /tokenize round "
                                  "trip", registry=r, buckets=(5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1))
        self.matched = Counter("kvgate_router_matched_blocks", "prompt blocks the chosen endpoint can "
                               "restore, by tier (gpu, cpu, storage) and prefill (to compute)", ["tier"],
                               registry=r)
        self.fallbacks = Counter("kvgate_router_fallbacks", "cache-aware decisions made by load because "
                                 "nothing matched or no hashes were known", registry=r)
        self.up = Gauge("kvgate_router_endpoint_up", "1 when the endpoint passes its health poll",
                        ["endpoint"], registry=r)
        self.refused = Gauge("kvgate_router_endpoint_refused", "1 when the endpoint's hash settings differ "
                             "from the router's", ["endpoint"], registry=r)
        self.handoffs = Counter("kvgate_router_handoffs", "split requests (prefill and decode endpoints), by "
                                "outcome: stored, timeout, present, short, untokenized, prefill-failed",
                                ["outcome"], registry=r)
        self.handoff_wait = Histogram("kvgate_router_handoff_wait_seconds", "from a prefill's answer until its KV "
                                      "is restorable by the decode endpoint (or handoff_timeout)", registry=r,
                                      buckets=(1e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
        self.load = Gauge("kvgate_router_endpoint_load", "running + waiting (last poll) + router in-flight",
                          ["endpoint"], registry=r)


def sources(spec: EndpointSpec, settings: RouterSettings | None = None) -> Endpoint:
    """The index source ids of an endpoint's KV event feeds: its engine's under its URL, its gateway's
    under ``<url>#gateway`` (None where it publishes none); with ``peer_pulls``, the other endpoints'
    gateways as its ``peers``."""
    gateway = f"{spec.url}#gateway" if spec.gateway_events else None
    peers: tuple[str, ...] = ()
    if settings is not None and settings.peer_pulls and gateway is not None:
        peers = tuple(f"{e.url}#gateway" for e in settings.endpoints if e.gateway_events and e.url != spec.url)
    return Endpoint(name=spec.url, engine=spec.url if spec.events else None, gateway=gateway, peers=peers)


class Router:
    """The front: ``start`` polls the endpoints once, subscribes to their KV events (``kvgate.routing.feeds``,
    into ``index``), then serves on ``settings.host:port`` (``port`` 0: a free one, see ``port`` after start);
    ``close`` stops serving, polling and the feeds.  ``index``: the KV index the cache-aware policy and
    ``/v1/score`` read (empty: decisions fall back to load).  Raises InvalidArgument at construction for
    hash settings no router can reproduce.

    Refusals both ways: an endpoint refused for its settings has its feeds refused (its blocks leave the
    index); an endpoint whose engine's feed is refused (its events' block size, or the hash of a prompt's first
    block, differs from the router's) is refused for routing, with the feed's message."""

    def __init__(self, settings: RouterSettings, index: KvIndex | None = None) -> None:
        self.settings = settings
        self.index = index if index is not None else KvIndex()
        self.hasher = BlockHasher(settings.hash_algo, settings.block_size, settings.hash_seed)
        scorer = Scorer(self.index, dict(settings.tier_costs), dict(settings.load_costs))
        self.policy = make_policy(settings.policy, self.index, scorer)
        # /v1/score scores whatever the policy: share the policy's scorer when it has one
        self.scoring = self.policy if isinstance(self.policy, CacheAware) else CacheAware(self.index, scorer)
        self.metrics = Metrics()
        self.handoff = Handoff(self.index, scorer, settings.handoff_timeout, settings.peer_pulls)
        for spec in settings.endpoints:
            self.scoring.sources[spec.url] = sources(spec, settings)
        self.feeds: Feeds | None = None
        self.session: aiohttp.ClientSession | None = None
        self.pool: EndpointPool | None = None
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    # ---- lifecycle
    async def open(self) -> None:
        """The client session and the endpoint poller (``start`` does this, then serves)."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.settings.connect_timeout)
        # no per-host connection cap: the engine decides how many requests it takes
        self.session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0),
                                             auto_decompress=False)
        self.pool = EndpointPool(self.settings, self.session)
        if any(spec.events or spec.gateway_events for spec in self.settings.endpoints):
            self.feeds = Feeds(self.index, self.settings.block_size, asyncio.get_running_loop(), self.hasher)
            for spec in self.settings.endpoints:
                src = sources(spec)
                if spec.events:
                    self.feeds.add(src.engine, spec.events, spec.events_replay)
                if spec.gateway_events:
                    self.feeds.add(src.gateway, spec.gateway_events, spec.gateway_replay)
        await self.pool.start()
        self.sync_refusals()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)  # long prompts: 64 MiB of JSON
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/score", self._score)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def start(self) -> None:
        await self.open()
        # handler_cancellation: a client that leaves cancels its handler at once, which closes the connection
        # to the engine (vLLM aborts the request there); without it the handler waits for the engine's
        # next chunk to find the client gone, which for a queued request can be a long prefill away
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.host, self.settings.port)
        await site.start()
        server = site._server
        self.port = server.sockets[0].getsockname()[1] if server and server.sockets else self.settings.port
        log.info("router: serving on %s:%s, policy %s, %d endpoint(s) routable of %d", self.settings.host,
                 self.port, self.policy.name, len(self.pool.routable()), len(self.pool.endpoints))

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.pool is not None:
            await self.pool.close()
        if self.feeds is not None:
            self.feeds.close()
            self.feeds = None
        if self.session is not None:
            await self.session.close()
            self.session = None

    def sync_refusals(self) -> None:
        """Carry refusals between the endpoints and their feeds (class docstring).  Cheap: run before each
        decision and each /health or /metrics answer."""
        if self.feeds is None:
            return
        refused = self.feeds.refused
        for ep in self.pool.endpoints:
            src = self.scoring.sources[ep.url]
            if ep.refused:
                for s in (src.engine, src.gateway):
                    if s is not None and s not in refused:
                        self.feeds.refuse(s, ep.refused)
            elif src.engine is not None and src.engine in refused:
                ep.refused = f"{ep.url} refused: {refused[src.engine]}"

    # ---- tokenizing and deciding
    async def tokens(self, kind: str, body: dict[str, Any], candidates: list[EndpointState]) -> list[int] | None:
        """The prompt's token ids as the engine makes them (``kind``: "completion" or "chat"), or None when
        they cannot be had (no prompt of a known shape, /tokenize refused, or no candidate reachable)."""
        if kind == "completion":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return prompt
            if not isinstance(prompt, str):
                return None  # a batch of prompts: the engine's prefixes differ per prompt; routed by load
            ask: dict[str, Any] = {"prompt": prompt}
        else:
            messages = body.get("messages")
            if not isinstance(messages, list):
                return None
            ask = {"messages": messages, "add_generation_prompt": body.get("add_generation_prompt", True)}
            for k in ("continue_final_message", "chat_template", "chat_template_kwargs", "tools"):
                if k in body:
                    ask[k] = body[k]
        if body.get("model") is not None:
            ask["model"] = body["model"]
        for ep in candidates[:2]:  # one that cannot connect is taken out and the next one asked
            t0 = time.perf_counter()
            try:
                async with self.session.post(f"{ep.url}/tokenize", json=ask) as r:
                    if r.status != 200:
                        log.debug("router: /tokenize on %s answered %s", ep.url, r.status)
                        return None
                    data = await r.json(content_type=None)
            except _CONNECT_ERRORS as e:
                self.pool.mark_down(ep, f"POST /tokenize could not connect: {type(e).__name__}: {e}")
                continue
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
                log.debug("router: /tokenize on %s failed: %s", ep.url, e)
                return None
            finally:
                self.metrics.tokenize.observe(time.perf_counter() - t0)
            toks = data.get("tokens") if isinstance(data, dict) else None
            return toks if isinstance(toks, list) else None
        return None

    async def decide(self, kind: str, body: dict[str, Any]) -> Decision:
        """The policy's order of the routable endpoints for a whole request (tokenizing when it wants)."""
        self.sync_refusals()
        hashes = None
        if self.policy.needs_tokens and self.pool.routable():
            toks = await self.tokens(kind, body, self.pool.routable())
            hashes = self.hasher.hashes(toks) if toks else None
        return self.choose(hashes)

    def choose(self, hashes: list[bytes] | None, role: str | None = None) -> Decision:
        """The policy's order of the routable endpoints (of those that ``prefills`` / ``decodes`` when
        ``role`` names one) for a prompt with these block hashes (None: unknown)."""
        candidates = self.pool.routable()
        if role is not None:
            candidates = [e for e in candidates if getattr(e.spec, role)]
        t0 = time.perf_counter()
        decision = self.policy.order(candidates, hashes)
        self.metrics.decision.observe(time.perf_counter() - t0)
        if decision.fallback:
            self.metrics.fallbacks.inc()
        if decision.scores:
            s = decision.scores[0]
            for tier in ("gpu", "cpu", "storage", "prefill"):
                self.metrics.matched.labels(tier).inc(getattr(s, tier))
        return decision

    # ---- handlers
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, "/v1/completions", "completion")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, "/v1/chat/completions", "chat")

    async def _body(self, request: web.Request) -> dict[str, Any] | web.Response:
        try:
            body = json.loads(await request.read())
        except ValueError as e:
            return _error(400, f"the request body is not JSON: {e}", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_request_error")
        return body

    async def _proxy(self, request: web.Request, path: str, kind: str) -> web.StreamResponse:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        headers = {k: request.headers[k] for k in _FORWARD if k in request.headers}
        source = request.headers.get(SOURCE_HEADER)
        if source is not None:
            rid = headers.setdefault("x-request-id", request.headers.get("x-request-id") or uuid.uuid4().hex)
            try:
                add_remote_source(body, source, rid)
            except InvalidArgument as e:
                return _error(400, str(e), "invalid_request_error")
        if self.settings.split:
            return await self._split(request, path, kind, body, headers)
        return await self._forward(request, path, body, headers, await self.decide(kind, body), {})

    async def _forward(self, request: web.Request, path: str, body: dict[str, Any], headers: dict[str, str],
                       decision: Decision, extra: dict[str, str]) -> web.StreamResponse:
        """Send the request to the decision's first endpoint (its second when the first cannot connect) and
        answer the client as that engine answers, with the route headers and ``extra``."""
        if not decision.order:
            self.metrics.failures.labels("no_endpoint").inc()
            return _error(503, "no endpoint is routable: " + "; ".join(
                f"{e.url} {e.refused or e.reason}" for e in self.pool.endpoints))
        payload = json.dumps(body).encode()
        headers = {**headers, "content-type": "application/json"}
        stream = bool(body.get("stream"))
        tries = decision.order[:2]
        prefill = {s.endpoint: s.prefill for s in decision.scores or ()}
        last_error = ""
        for i, ep in enumerate(tries):
            ep.inflight += 1
            ahead = _PrefillAhead(ep, prefill.get(ep.url, 0))
            try:
                try:
                    resp = await self.session.post(ep.url + path, data=payload, headers=headers)
                except _CONNECT_ERRORS as e:
                    last_error = f"{ep.url}: {type(e).__name__}: {e}"
                    self.pool.mark_down(ep, f"a request could not connect: {type(e).__name__}: {e}")
                    if i + 1 < len(tries):
                        self.metrics.retries.labels(ep.url).inc()
                        log.warning("router: %s; retrying on %s", last_error, tries[i + 1].url)
                    continue
                self.metrics.requests.labels(ep.url, self.policy.name).inc()
                try:
                    return await self._answer(request, resp, stream, {**_route_headers(ep.url, decision), **extra},
                                              ahead)
                finally:
                    resp.release()
            finally:
                ep.inflight -= 1
                ahead.done()
        self.metrics.failures.labels("connect").inc()
        return _error(502, f"no endpoint could be reached ({len(tries)} tried): {last_error}")

    async def _split(self, request: web.Request, path: str, kind: str, body: dict[str, Any],
                     headers: dict[str, str]) -> web.StreamResponse:
        """A request split into a prefill and a decode (``kvgate.routing.handoff``)."""
        self.sync_refusals()
        toks = await self.tokens(kind, body, self.pool.routable()) if self.pool.routable() else None
        hashes = self.hasher.hashes(toks) if toks else None
        decode = self.choose(hashes, "decodes")
        if not decode.order:  # no endpoint decodes now: 503, as any request no endpoint can take
            return await self._forward(request, path, body, headers, decode, {})
        if toks is None or hashes is None:
            self.metrics.handoffs.labels("untokenized").inc()
            return await self._forward(request, path, body, headers, decode, {"x-kvgate-handoff": "untokenized"})
        dec = decode.order[0]
        need = handoff_blocks(len(toks), self.settings.block_size, len(hashes))
        dec_gw = self.scoring.sources[dec.url].gateway
        others = [self.scoring.sources[e.url].gateway for e in self.pool.endpoints]
        if need == 0:
            outcome, extra = "short", {}
        elif self.handoff.restorable(hashes, dec_gw, others) >= need:
            outcome, extra = "present", {}
        else:
            outcome, extra = await self._prefill(path, body, headers, hashes, need, dec_gw)
        self.metrics.handoffs.labels(outcome).inc()
        return await self._forward(request, path, body, headers, decode, {**extra, "x-kvgate-handoff": outcome})

    async def _prefill(self, path: str, body: dict[str, Any], headers: dict[str, str], hashes: list[bytes],
                       need: int, dec_gw: str | None) -> tuple[str, dict[str, str]]:
        """Run the prefill of a split request on the best prefill endpoint, then wait for its KV to be
        restorable by the decode's gateway: (outcome, headers for the answer)."""
        choice = self.choose(hashes, "prefills")
        if not choice.order:
            return "prefill-failed", {}
        ep = choice.order[0]
        score = next((s for s in choice.scores or () if s.endpoint == ep.url), None)
        ahead = _PrefillAhead(ep, score.prefill if score else 0)
        ep.inflight += 1
        try:
            async with self.session.post(ep.url + path, json=prefill_body(body), headers=headers) as r:
                answer = await r.read()
                status = r.status
        except _CONNECT_ERRORS as e:
            self.pool.mark_down(ep, f"a prefill could not connect: {type(e).__name__}: {e}")
            status = None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            log.warning("router: the prefill on %s failed (%s: %s); the decode computes the prompt", ep.url,
                        type(e).__name__, e)
            status = None
        finally:
            ep.inflight -= 1
            ahead.done()
        extra = {"x-kvgate-prefill": ep.url}
        if status != 200:
            if status is not None:
                log.warning("router: the prefill on %s answered %s; the decode computes the prompt", ep.url, status)
            return "prefill-failed", extra
        self.metrics.requests.labels(ep.url, self.policy.name).inc()
        cached = prompt_cached(answer)
        if cached is not None:
            extra["x-kvgate-prefill-cached"] = str(cached)
        prefill_gw = self.scoring.sources[ep.url].gateway
        stored, waited = await self.handoff.wait(hashes, need, dec_gw, [prefill_gw])
        self.metrics.handoff_wait.observe(waited)
        if not stored:
            log.warning("router: the prompt's KV (%d blocks) was not restorable by %s within %.1f s of its prefill "
                        "on %s (handoff_timeout): the decode recomputes what it lacks", need, dec_gw,
                        self.handoff.timeout, ep.url)
        return ("stored" if stored else "timeout"), extra

    async def _answer(self, request: web.Request, resp: aiohttp.ClientResponse, stream: bool,
                      route: dict[str, str], ahead: "_PrefillAhead") -> web.StreamResponse:
        ctype = resp.headers.get("content-type", "application/json")
        if not stream or resp.status != 200:
            data = await resp.read()
            ahead.done()
            out = web.Response(status=resp.status, body=data, headers=route)
            out.headers["content-type"] = ctype
            return out
        out = web.StreamResponse(status=resp.status, headers=route)
        out.headers["content-type"] = ctype
        out.headers["cache-control"] = "no-cache"
        await out.prepare(request)
        # each chunk as the engine sends it: a client sees every SSE event when the engine emits it
        async for chunk in resp.content.iter_any():
            ahead.done()  # the first token is out: its prefill no longer delays what comes next
            await out.write(chunk)
        await out.write_eof()
        return out

    async def _models(self, request: web.Request) -> web.Response:
        for ep in self.pool.routable():
            try:
                async with self.session.get(f"{ep.url}/v1/models") as r:
                    data = await r.read()
                    out = web.Response(status=r.status, body=data)
                    out.headers["content-type"] = r.headers.get("content-type", "application/json")
                    return out
            except _CONNECT_ERRORS as e:
                self.pool.mark_down(ep, f"GET /v1/models could not connect: {e}")
        return _error(503, "no endpoint is routable to list models")

    async def _score(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        candidates = self.pool.routable()
        toks = body.get("token_ids")
        if toks is not None:
            if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
                return _error(400, "token_ids must be a list of integers", "invalid_request_error")
        elif "messages" in body:
            toks = await self.tokens("chat", body, candidates)
        elif "prompt" in body:
            toks = await self.tokens("completion", body, candidates)
        else:
            return _error(400, "give one of prompt, messages or token_ids", "invalid_request_error")
        if toks is None:
            return _error(503, "the prompt could not be tokenized: no endpoint answered POST /tokenize "
                          "(send token_ids instead)")
        t0 = time.perf_counter()
        hashes = self.hasher.hashes(toks)
        scores = self.scoring.score(self.pool.endpoints, hashes) if self.pool.endpoints else []
        elapsed = time.perf_counter() - t0
        by_url = {e.url: e for e in self.pool.endpoints}
        return web.json_response({
            "tokens": len(toks), "blocks": len(hashes), "block_size": self.settings.block_size,
            "seconds": elapsed,
            "endpoints": [{"url": s.endpoint, "routable": by_url[s.endpoint].routable, "gpu": s.gpu,
                           "cpu": s.cpu, "storage": s.storage, "matched": s.matched, "prefill": s.prefill,
                           "running": s.running, "waiting": s.waiting, "cost": s.cost} for s in scores]})

    async def _health(self, request: web.Request) -> web.Response:
        self.sync_refusals()
        eps = [e.as_json() for e in self.pool.endpoints]
        ok = bool(self.pool.routable())
        out: dict[str, Any] = {"status": "ok" if ok else "unavailable", "policy": self.policy.name,
                               "endpoints": eps}
        if self.feeds is not None:
            out["feeds"] = [f.stats() for f in self.feeds.feeds.values()]
        return web.json_response(out, status=200 if ok else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        m = self.metrics
        self.sync_refusals()
        for e in self.pool.endpoints:
            m.up.labels(e.url).set(1 if e.up else 0)
            m.refused.labels(e.url).set(1 if e.refused else 0)
            m.load.labels(e.url).set(e.load)
        out = web.Response(body=generate_latest(m.registry))
        out.headers["content-type"] = CONTENT_TYPE_LATEST
        return out


async def serve(settings: RouterSettings, stop: asyncio.Event, ready=None) -> None:
    """Run a router until ``stop`` is set; ``ready(router)`` is called once it serves."""
    router = Router(settings)
    try:
        await router.start()
        if ready is not None:
            ready(router)
        await stop.wait()
    finally:
        await router.close()
