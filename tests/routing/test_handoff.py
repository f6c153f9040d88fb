"""Prefill and decode endpoints (``kvgate.routing.handoff``) against small engines standing in for vLLM
(front_engines.py) and real ZMQ publishers standing in for their gateways' events: the prefill runs first,
cut to one token; the decode waits until the prompt's KV is where its gateway can restore it (a card
both gateways mount, or with ``peer_pulls`` the prefill gateway's RAM); no prefill when the KV is already
there or the prompt is too short; a timeout or a failed prefill still answers; the settings checks."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest

from kvgate.errors import ConfigError
from kvgate.kvevents.publisher import EventPublisher
from kvgate.kvevents.wire import MEDIUM_CPU
from kvgate.routing.handoff import handoff_blocks, prefill_body, prompt_cached
from kvgate.routing.settings import build
from tests.helpers import free_port
from tests.routing.front_engines import FakeEngine
from tests.routing.test_front import _base, _published, _router, _stored, _until, run

PROMPT = "abcdefghijklmnopq"  # 17 tokens in the fake tokenizer: 4 full blocks of 4


def test_prefill_body_and_blocks_handed_off():
    body = {"model": "m", "prompt": "x", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True},
            "min_tokens": 10, "max_completion_tokens": 50, "temperature": 0, "n": 2}
    assert prefill_body(body) == {"model": "m", "prompt": "x", "max_tokens": 1, "stream": False,
                                  "max_completion_tokens": 1, "temperature": 0, "n": 1}
    assert body["max_tokens"] == 50  # the client's body is left as it was
    assert prompt_cached(b'{"usage": {"prompt_tokens_details": {"cached_tokens": 256}}}') == 256
    for answer in (b'{"usage": {"prompt_tokens_details": null}}', b"[1]", b"not json", b'{"usage": 3}'):
        assert prompt_cached(answer) is None, answer
    assert handoff_blocks(17, 4, 4) == 4
    assert handoff_blocks(16, 4, 4) == 4  # the last full block too (vLLM 0.32 loads it)
    assert handoff_blocks(16, 4, 3) == 3  # never more than the router hashed
    assert handoff_blocks(3, 4, 0) == 0
    assert handoff_blocks(0, 4, 0) == 0


def test_settings_name_what_a_split_fleet_lacks():
    gw = {"gateway_events": "tcp://127.0.0.1:1"}
    with pytest.raises(ConfigError, match=r"endpoints\[0\].role: 'prefil' is not a role"):
        build({"endpoints": [{"url": "http://a:1", "role": "prefil"}]})
    with pytest.raises(ConfigError, match="none can decode"):
        build({"endpoints": [{"url": "http://a:1", "role": "prefill", **gw}]})
    with pytest.raises(ConfigError, match="none can prefill"):
        build({"endpoints": [{"url": "http://a:1", "role": "decode", **gw}]})
    with pytest.raises(ConfigError, match=r"http://b:1: gateway_events not given"):
        build({"endpoints": [{"url": "http://a:1", "role": "prefill", **gw}, "http://b:1"]})
    with pytest.raises(ConfigError, match="peer_pulls: true or false"):
        build({"endpoints": ["http://a:1"], "peer_pulls": "yes"})
    s = build({"endpoints": [{"url": "http://a:1", "role": "prefill", **gw}, {"url": "http://b:1", **gw}]})
    assert s.split and not s.endpoints[0].decodes and s.endpoints[1].prefills and s.endpoints[1].decodes
    assert not build({"endpoints": ["http://a:1"]}).split


@contextlib.asynccontextmanager
async def split_fleet(**settings):
    """Engine a (prefill) and b (decode), each with a ZMQ publisher standing in for its gateway's events,
    behind a cache-aware router with blocks of 4 tokens: (router, a, b, a's publisher, b's publisher)."""
    a, b = await FakeEngine("a").start(), await FakeEngine("b").start()
    gwa, gwb = (EventPublisher(f"tcp://127.0.0.1:{free_port()}") for _ in range(2))
    gwa.start()
    gwb.start()
    eps = [{"url": a.url, "role": "prefill", "gateway_events": gwa.endpoint},
           {"url": b.url, "role": "decode", "gateway_events": gwb.endpoint}]
    r = await _router([a, b], policy="cache-aware", block_size=4, endpoints=eps, handoff_timeout=5.0, **settings)
    try:
        yield r, a, b, gwa, gwb
    finally:
        await r.close()
        gwa.close()
        gwb.close()
        for e in (a, b):
            await e.stop()


def test_prefill_then_decode_once_the_kv_is_where_the_decode_can_restore_it():
    async def go():
        async with split_fleet() as (r, a, b, gwa, gwb):
            keys = r.hasher.keys([ord(ch) for ch in PROMPT])
            # both gateways mount card S (each publishes on its card topic): what A's gateway writes there
            # B's gateway reads
            await _published(gwb, _stored([12345]), lambda: "S" in r.index.mounts(b.url + "#gateway"),
                             topic="gwb@card:S")

            async def store_when_prefilled() -> None:
                await _until(lambda: len(a.bodies) == 1, 10)
                await asyncio.sleep(0.2)  # the decode must wait for this, not go at once
                await _published(gwa, _stored(keys), lambda: r.handoff.restorable(
                    r.hasher.hashes([ord(ch) for ch in PROMPT]), b.url + "#gateway") == 4, topic="gwa@card:S")

            async with aiohttp.ClientSession() as s:
                body = {"model": "m", "prompt": PROMPT, "max_tokens": 7, "stream": True, "temperature": 0}
                storing = asyncio.create_task(store_when_prefilled())
                async with s.post(_base(r) + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    text = await resp.text()
                    assert resp.headers["x-kvgate-prefill"] == a.url
                    assert resp.headers["x-kvgate-endpoint"] == b.url
                    assert resp.headers["x-kvgate-handoff"] == "stored"
                await storing
                assert '"engine": "b"' in text and "[DONE]" in text
                assert a.bodies == [{**body, "max_tokens": 1, "stream": False, "n": 1}]
                assert b.bodies == [body]  # the decode gets the client's request as it was

                # the KV is there now: the decode goes at once, no prefill
                async with s.post(_base(r) + "/v1/completions", json={**body, "stream": False}) as resp:
                    assert resp.headers["x-kvgate-handoff"] == "present" and "x-kvgate-prefill" not in resp.headers
                    assert (await resp.json())["engine"] == "b"
                assert len(a.bodies) == 1 and len(b.bodies) == 2

                # too short to hand anything off (3 tokens: no full block)
                async with s.post(_base(r) + "/v1/completions", json={"model": "m", "prompt": "xyz"}) as resp:
                    assert resp.headers["x-kvgate-handoff"] == "short" and (await resp.json())["engine"] == "b"

                # a batch of prompts has no one prefix to hand off: the decode endpoint does it all
                async with s.post(_base(r) + "/v1/completions", json={"model": "m", "prompt": ["ab", "cd"]}) as resp:
                    assert resp.headers["x-kvgate-handoff"] == "untokenized"
                    assert (await resp.json())["engine"] == "b"

                # nothing ever stored: the decode goes after handoff_timeout and computes it all
                r.handoff.timeout = 0.3
                async with s.post(_base(r) + "/v1/completions", json={"model": "m", "prompt": "q" + PROMPT}) as resp:
                    assert resp.headers["x-kvgate-handoff"] == "timeout"
                    assert (await resp.json())["engine"] == "b"
                assert len(a.bodies) == 2

                # the prefill engine gone: the decode does it all, the client sees no error
                await a.stop()
                async with s.post(_base(r) + "/v1/completions", json={"model": "m", "prompt": "z" + PROMPT}) as resp:
                    assert resp.status == 200 and resp.headers["x-kvgate-handoff"] == "prefill-failed"
                    assert (await resp.json())["engine"] == "b"
                # the decode engine gone too: 503 naming the endpoints, not a hand-off outcome
                await b.stop()
                await _until(lambda: not r.pool.routable(), 10)
                async with s.post(_base(r) + "/v1/completions", json={"model": "m", "prompt": PROMPT}) as resp:
                    assert resp.status == 503 and "no endpoint is routable" in (await resp.json())["error"]["message"]
                async with s.get(_base(r) + "/metrics") as resp:
                    metrics = await resp.text()
            for outcome in ("stored", "present", "short", "untokenized", "timeout", "prefill-failed"):
                assert f'kvgate_router_handoffs_total{{outcome="{outcome}"}} 1.0' in metrics, outcome
            assert "kvgate_router_handoff_wait_seconds_count 2.0" in metrics
    run(go())


def test_peer_pulls_count_the_prefill_gateways_ram():
    async def go():
        async with split_fleet(peer_pulls=True) as (r, a, b, gwa, _gwb):
            keys = r.hasher.keys([ord(ch) for ch in PROMPT])
            hashes = r.hasher.hashes([ord(ch) for ch in PROMPT])

            async def store_when_prefilled() -> None:
                await _until(lambda: len(a.bodies) == 1, 10)
                await _published(gwa, _stored(keys, MEDIUM_CPU),
                                 lambda: r.handoff.restorable(hashes, b.url + "#gateway", [a.url + "#gateway"]) == 4)

            storing = asyncio.create_task(store_when_prefilled())
            async with aiohttp.ClientSession() as s:
                async with s.post(_base(r) + "/v1/completions", json={"model": "m", "prompt": PROMPT}) as resp:
                    assert resp.headers["x-kvgate-handoff"] == "stored"
                    assert (await resp.json())["engine"] == "b"
            await storing
            # without peer_pulls the same RAM-held blocks are not restorable by b
            r.handoff.peer_pulls = False
            assert r.handoff.restorable(hashes, b.url + "#gateway", [a.url + "#gateway"]) == 0
    run(go())
