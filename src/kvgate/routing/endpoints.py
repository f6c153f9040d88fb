"""The engines behind the router: whether each is up, whether its hash settings agree with the router's,
and how loaded it is.

Every ``poll_interval`` (1 s) each endpoint is asked ``GET /health`` (vLLM and SGLang both serve it: 200
when the engine can take requests) and ``GET /metrics`` (its running and waiting requests: vLLM's
``vllm:num_requests_running`` / ``vllm:num_requests_waiting``, SGLang's ``sglang:num_running_reqs`` /
``sglang:num_queue_reqs``, read with prometheus_client's text parser).  Between two polls the router adds
its own count of requests it has in flight to each endpoint, so a burst does not all land on the endpoint
that looked idle at the last poll.

An endpoint is routable when it is ``up`` and not ``refused``.  A failed health poll, or a request that
cannot connect (``mark_down``), takes it out; the first good poll after that brings it back, after the hash
settings check runs again (an engine restarted with other settings is refused, not silently routed).

The hash settings check (``check_settings``): the router's block size, hash algorithm and seed against what
the engine reports and what the operator states for it.  vLLM shows its ``cache_config`` (``block_size``,
``prefix_caching_hash_algo``) on ``GET /server_info?config_format=json``, which it serves only with
``VLLM_SERVER_DEV_MODE=1``; its PYTHONHASHSEED it shows nowhere.  SGLang's ``GET /server_info`` has
``page_size``.  What the engine does not show is taken from the endpoint's settings in the router config;
what neither gives is not checked (``unchecked`` lists it, on ``/health``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvgate.routing.settings import EndpointSpec, RouterSettings

log = logging.getLogger("kvgate.router")

# metric name (as the text parser gives it, without a _total suffix) -> which load figure it is
_LOAD_METRICS = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "waiting",
}


def parse_load(text: str) -> tuple[int, int] | None:
    """(running, waiting) from an engine's Prometheus text, summed over label sets (one per model or data
    parallel rank); None when the text has neither vLLM's nor SGLang's metrics."""
    got = {"running": 0.0, "waiting": 0.0}
    seen = False
    for fam in text_string_to_metric_families(text):
        which = _LOAD_METRICS.get(fam.name)
        if which is None:
            continue
        for sample in fam.samples:
            if sample.name == fam.name:
                got[which] += sample.value
                seen = True
    return (int(got["running"]), int(got["waiting"])) if seen else None


@dataclass
class EndpointState:
    """One endpoint as the router sees it now.  ``reason``: why it is down (the last failure);
    ``refused``: why its settings make it unroutable (a message naming the setting and both values);
    ``inflight``: the router's requests to it not yet answered; ``prefilling``: the prompt blocks those
    still compute, as scored, until each answers its first byte (cache-aware only)."""

    spec: EndpointSpec
    up: bool = False
    reason: str | None = "not polled yet"
    refused: str | None = None
    unchecked: tuple[str, ...] = ()
    running: int = 0
    waiting: int = 0
    inflight: int = 0
    prefilling: int = 0
    model_ids: tuple[str, ...] = ()
    last_poll: float = 0.0

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def routable(self) -> bool:
        return self.up and self.refused is None

    @property
    def load(self) -> int:
        """What least-loaded compares: the engine's running and waiting requests at the last poll plus the
        router's own requests in flight to it."""
        return self.running + self.waiting + self.inflight

    def as_json(self) -> dict[str, Any]:
        state = "refused" if self.refused else ("up" if self.up else "down")
        return {"url": self.url, "state": state, "reason": self.refused or (None if self.up else self.reason),
                "running": self.running, "waiting": self.waiting, "inflight": self.inflight,
                "prefilling": self.prefilling,
                "unchecked": list(self.unchecked)}


def compare_settings(settings: RouterSettings, spec: EndpointSpec,
                     reported: dict[str, Any]) -> tuple[str | None, tuple[str, ...]]:
    """(refusal message or None, settings checked by nobody).  ``reported``: what the engine itself says
    (keys block_size, hash_algo; absent when it says nothing).  An engine's own report wins over the
    operator's statement; both are compared with the router's."""
    mine = {"block_size": settings.block_size, "hash_algo": settings.hash_algo,
            "hash_seed": settings.hash_seed}
    stated = {"block_size": spec.block_size, "hash_algo": spec.hash_algo, "hash_seed": spec.hash_seed}
    problems = []
    unchecked = []
    for key, want in mine.items():
        if key in reported and reported[key] is not None:
            theirs, source = reported[key], "the engine reports"
        elif stated[key] is not None:
            theirs, source = stated[key], "its config states"
        else:
            unchecked.append(key)
            continue
        if key == "hash_seed" and want is None:
            # the router runs with vLLM's default seed: the endpoint must have no seed either
            problems.append(f"hash_seed: the router has none (vLLM's default seed), {source} {theirs!r}; "
                            f"give the router --hash-seed {theirs} or start the engine without PYTHONHASHSEED")
            continue
        if str(theirs) != str(want):
            flag = "--" + key.replace("_", "-")
            problems.append(f"{key}: the router has {want!r}, {source} {theirs!r}; "
                            f"give the router {flag} {theirs} or start the engine with the router's")
    if problems:
        return (f"{spec.url} refused, its block hashes would not match the router's: " + "; ".join(problems),
                tuple(unchecked))
    return None, tuple(unchecked)


async def engine_settings(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    """The hash settings the engine at ``url`` shows: vLLM's ``/server_info?config_format=json`` (dev mode
    only) or SGLang's ``/server_info``; {} when it shows none."""
    try:
        async with session.get(f"{url}/server_info", params={"config_format": "json"}) as r:
            if r.status != 200:
                return {}
            data = await r.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return {}
    out: dict[str, Any] = {}
    cfg = data.get("vllm_config") if isinstance(data, dict) else None
    if isinstance(cfg, dict):
        cache = cfg.get("cache_config") or {}
        if cache.get("block_size") is not None:
            out["block_size"] = int(cache["block_size"])
        if cache.get("prefix_caching_hash_algo") is not None:
            out["hash_algo"] = str(cache["prefix_caching_hash_algo"])
    elif isinstance(data, dict) and data.get("page_size") is not None:  # SGLang
        out["block_size"] = int(data["page_size"])
    return out


class EndpointPool:
    """The endpoints and their poller.  ``start`` polls every endpoint once (so the router starts knowing
    which are up) then keeps polling in a task; ``close`` stops it.  Everything runs on one event loop."""

    def __init__(self, settings: RouterSettings, session: aiohttp.ClientSession) -> None:
        self.settings = settings
        self.session = session
        self.endpoints = [EndpointState(spec) for spec in settings.endpoints]
        self._task: asyncio.Task | None = None
        self.on_change: list = []  # callbacks(state) run when an endpoint goes up, down or is refused

    def routable(self) -> list[EndpointState]:
        return [e for e in self.endpoints if e.routable]

    def by_url(self, url: str) -> EndpointState | None:
        return next((e for e in self.endpoints if e.url == url), None)

    async def start(self) -> None:
        await self.poll_all()
        self._task = asyncio.create_task(self._run(), name="kvgate-router-poll")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.poll_interval)
            try:
                await self.poll_all()
            except Exception:  # a bug in one poll must not stop health checks for good
                log.exception("router: endpoint poll failed")

    async def poll_all(self) -> None:
        await asyncio.gather(*(self.poll(e) for e in self.endpoints))

    async def poll(self, ep: EndpointState) -> None:
        """One health and load poll of ``ep``; on coming up, the settings check."""
        timeout = aiohttp.ClientTimeout(total=max(self.settings.poll_interval, self.settings.connect_timeout))
        try:
            async with self.session.get(f"{ep.url}/health", timeout=timeout) as r:
                await r.read()
                ok = r.status == 200
                why = None if ok else f"GET /health answered {r.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            ok, why = False, f"GET /health failed: {type(e).__name__}: {e}"
        ep.last_poll = time.monotonic()
        if not ok:
            self._set_down(ep, why or "unhealthy")
            return
        if not ep.up:
            # coming (back) up: check its settings again (an engine restarted with others is refused)
            reported = await engine_settings(self.session, ep.url)
            refused, ep.unchecked = compare_settings(self.settings, ep.spec, reported)
            if refused != ep.refused:
                if refused:
                    log.error("router: %s", refused)
                ep.refused = refused
            await self._models(ep)
            ep.up, ep.reason = True, None
            log.info("router: endpoint %s is up%s", ep.url, " but refused" if ep.refused else "")
            self._changed(ep)
        try:
            async with self.session.get(f"{ep.url}/metrics", timeout=timeout) as r:
                if r.status == 200:
                    load = parse_load(await r.text())
                    if load is not None:
                        ep.running, ep.waiting = load
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
            pass  # load stays as last seen: health decides up/down, not metrics

    async def _models(self, ep: EndpointState) -> None:
        try:
            async with self.session.get(f"{ep.url}/v1/models") as r:
                if r.status == 200:
                    data = await r.json(content_type=None)
                    ep.model_ids = tuple(m.get("id") for m in data.get("data", []) if isinstance(m, dict))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, AttributeError):
            pass

    def mark_down(self, ep: EndpointState, reason: str) -> None:
        """Take ``ep`` out now (a request could not connect to it); the next good poll brings it back."""
        self._set_down(ep, reason)

    def _set_down(self, ep: EndpointState, reason: str) -> None:
        ep.reason = reason
        if ep.up:
            ep.up = False
            log.warning("router: endpoint %s is down: %s", ep.url, reason)
            self._changed(ep)

    def _changed(self, ep: EndpointState) -> None:
        for cb in self.on_change:
            cb(ep)
