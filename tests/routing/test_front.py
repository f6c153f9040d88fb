"""The router's HTTP front against small aiohttp servers standing in for engines (front_engines.py):
passthrough (plain and streamed), health take-out and bring-back, retry on a connect failure, the
policies' choices, the peer-source header, the settings check, /v1/score and /metrics."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from kvgate.kvevents.publisher import EventPublisher
from kvgate.kvevents.wire import MEDIUM_CPU, MEDIUM_GPU, BlockStored
from kvgate.routing.endpoints import compare_settings, parse_load
from kvgate.routing.front import Router
from kvgate.routing.settings import EndpointSpec, build
from tests.helpers import free_port
from tests.routing.front_engines import FakeEngine


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def _router(engines, policy="round-robin", poll=0.05, **kw) -> Router:
    settings = build({"endpoints": kw.pop("endpoints", [e.url for e in engines]), "host": "127.0.0.1",
                      "port": 0, "policy": policy, "poll_interval": poll, **kw})
    r = Router(settings)
    await r.start()
    return r


async def _until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def _base(r: Router) -> str:
    return f"http://127.0.0.1:{r.port}"


def test_completion_and_chat_pass_through_unchanged():
    async def go():
        a = await FakeEngine("a").start()
        r = await _router([a])
        try:
            async with aiohttp.ClientSession() as s:
                body = {"model": "m", "prompt": "hello", "max_tokens": 3, "extra": {"x": [1, 2]}}
                async with s.post(_base(r) + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    got = await resp.json()
                    assert resp.headers["x-kvgate-endpoint"] == a.url
                    assert "x-kvgate-matched" not in resp.headers  # round-robin scores nothing
                assert got == {"id": "x", "engine": "a", "echo": body}
                chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
                async with s.post(_base(r) + "/v1/chat/completions", json=chat) as resp:
                    assert (await resp.json())["echo"] == chat
                # an engine's error comes back as it sent it
                async with s.post(_base(r) + "/v1/completions", json={"prompt": "x", "bad": True}) as resp:
                    assert resp.status == 400
                    assert (await resp.json())["error"]["message"] == "bad request"
                async with s.post(_base(r) + "/v1/completions", data=b"{nope") as resp:
                    assert resp.status == 400
                    assert "not JSON" in (await resp.json())["error"]["message"]
                async with s.get(_base(r) + "/v1/models") as resp:
                    assert (await resp.json())["data"][0]["owned_by"] == "a"
        finally:
            await r.close()
            await a.stop()
    run(go())


def test_stream_passes_each_chunk_as_the_engine_sends_it():
    async def go():
        a = await FakeEngine("a").start()
        a.release.clear()  # the engine sends its first chunk, then waits
        r = await _router([a])
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(_base(r) + "/v1/completions", json={"prompt": "hi", "stream": True}) as resp:
                    assert resp.status == 200
                    assert resp.headers["content-type"].startswith("text/event-stream")
                    assert resp.headers["x-kvgate-endpoint"] == a.url
                    first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
                    assert json.loads(first[len(b"data: "):]) == {"engine": "a", "i": 0}
                    a.release.set()  # only now does the engine send the rest
                    rest = await resp.read()
            assert rest.count(b"data: ") == 3 and rest.endswith(b"data: [DONE]\n\n")
        finally:
            await r.close()
            await a.stop()
    run(go())


def test_a_client_leaving_mid_stream_is_seen_at_once_and_frees_its_in_flight_count():
    async def go():
        a = await FakeEngine("a").start()
        a.release.clear()
        r = await _router([a])
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(_base(r) + "/v1/completions", json={"prompt": "hi", "stream": True}) as resp:
                    await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
                    assert r.pool.endpoints[0].inflight == 1
                    resp.close()  # the client goes away with the engine still streaming
            await _until(lambda: r.pool.endpoints[0].inflight == 0)
            a.release.set()
            async with aiohttp.ClientSession() as s:  # the router still serves
                async with s.post(_base(r) + "/v1/completions", json={"prompt": "x"}) as resp:
                    assert resp.status == 200
        finally:
            await r.close()
            await a.stop()
    run(go())


def test_unhealthy_endpoint_is_taken_out_and_comes_back():
    async def go():
        a, b = await FakeEngine("a").start(), await FakeEngine("b").start()
        r = await _router([a, b])
        try:
            async with aiohttp.ClientSession() as s:
                a.healthy = False
                await _until(lambda: not r.pool.endpoints[0].up)
                async with s.get(_base(r) + "/health") as resp:
                    h = await resp.json()
                    assert resp.status == 200
                assert h["endpoints"][0]["state"] == "down" and "503" in h["endpoints"][0]["reason"]
                assert h["endpoints"][1]["state"] == "up"
                for _ in range(4):
                    async with s.post(_base(r) + "/v1/completions", json={"prompt": "x"}) as resp:
                        assert (await resp.json())["engine"] == "b"
                b.healthy = False
                await _until(lambda: not r.pool.endpoints[1].up)
                async with s.get(_base(r) + "/health") as resp:
                    assert resp.status == 503
                    assert (await resp.json())["status"] == "unavailable"
                async with s.post(_base(r) + "/v1/completions", json={"prompt": "x"}) as resp:
                    assert resp.status == 503
                    assert "no endpoint is routable" in (await resp.json())["error"]["message"]
                a.healthy = True
                await _until(lambda: r.pool.endpoints[0].up)
                async with s.post(_base(r) + "/v1/completions", json={"prompt": "x"}) as resp:
                    assert (await resp.json())["engine"] == "a"
        finally:
            await r.close()
            await a.stop()
            await b.stop()
    run(go())


def test_connect_failure_is_retried_on_the_next_choice():
    async def go():
        a, b = await FakeEngine("a").start(), await FakeEngine("b").start()
        r = await _router([a, b], poll=60)  # no poll between: the request itself finds a gone
        try:
            await a.stop()
            async with aiohttp.ClientSession() as s:
                async with s.post(_base(r) + "/v1/completions", json={"prompt": "x"}) as resp:
                    assert resp.status == 200
                    assert (await resp.json())["engine"] == "b"
                ep = r.pool.endpoints[0]
                assert not ep.up and "could not connect" in ep.reason
                async with s.get(_base(r) + "/metrics") as resp:
                    text = await resp.text()
            assert f'kvgate_router_retries_total{{endpoint="{a.url}"}} 1.0' in text
            assert f'kvgate_router_endpoint_up{{endpoint="{a.url}"}} 0.0' in text
            assert (f'kvgate_router_requests_total{{endpoint="{b.url}",policy="round-robin"}} 1.0') in text
            assert a.url + '"} 0.0' in text
            # both gone: one retry, then 502 naming the failure
            await b.stop()
            r.pool.endpoints[0].up = True
            r.pool.endpoints[1].up = True
            async with aiohttp.ClientSession() as s:
                async with s.post(_base(r) + "/v1/completions", json={"prompt": "x"}) as resp:
                    assert resp.status == 502
                    assert "2 tried" in (await resp.json())["error"]["message"]
        finally:
            await r.close()
            await a.stop()
            await b.stop()
    run(go())


def test_cache_aware_tokenizes_on_the_next_endpoint_when_one_is_gone():
    async def go():
        a, b = await FakeEngine("a").start(), await FakeEngine("b").start()
        r = await _router([a, b], policy="cache-aware", poll=60)
        try:
            await a.stop()
            async with aiohttp.ClientSession() as s:
                async with s.post(_base(r) + "/v1/completions", json={"prompt": "abcd"}) as resp:
                    assert (await resp.json())["engine"] == "b"
            assert b.tokenize_calls == [{"prompt": "abcd"}]
            assert not r.pool.endpoints[0].up and "/tokenize could not connect" in r.pool.endpoints[0].reason
        finally:
            await r.close()
            await a.stop()
            await b.stop()
    run(go())


def test_round_robin_and_least_loaded_choices():
    async def go():
        a, b = await FakeEngine("a").start(), await FakeEngine("b", running=3, waiting=1).start()
        rr = await _router([a, b], policy="round-robin")
        ll = await _router([a, b], policy="least-loaded")
        try:
            async with aiohttp.ClientSession() as s:
                got = []
                for _ in range(4):
                    async with s.post(_base(rr) + "/v1/completions", json={"prompt": "x"}) as resp:
                        got.append((await resp.json())["engine"])
                assert got == ["a", "b", "a", "b"]
                for _ in range(2):
                    async with s.post(_base(ll) + "/v1/completions", json={"prompt": "x"}) as resp:
                        assert (await resp.json())["engine"] == "a"
                a.running, a.waiting, b.running, b.waiting = 9, 0, 0, 0
                await _until(lambda: ll.pool.endpoints[0].running == 9)
                async with s.post(_base(ll) + "/v1/completions", json={"prompt": "x"}) as resp:
                    assert (await resp.json())["engine"] == "b"
                # the router's own in-flight requests count between polls
                a.running = 0
                await _until(lambda: ll.pool.endpoints[0].running == 0)
                ll.pool.endpoints[0].inflight = 5
                async with s.post(_base(ll) + "/v1/completions", json={"prompt": "x"}) as resp:
                    assert (await resp.json())["engine"] == "b"
                ll.pool.endpoints[0].inflight = 0
        finally:
            await rr.close()
            await ll.close()
            await a.stop()
            await b.stop()
    run(go())


def test_source_header_becomes_remote_kv_source():
    async def go():
        a = await FakeEngine("a").start()
        r = await _router([a])
        try:
            async with aiohttp.ClientSession() as s:
                h = {"x-kv-cache-source-host-port": "10.0.0.7:8200", "x-request-id": "req-1"}
                body = {"prompt": "x", "kv_transfer_params": {"do_remote_prefill": True}}
                async with s.post(_base(r) + "/v1/completions", json=body, headers=h) as resp:
                    assert resp.status == 200
                sent = a.bodies[-1]
                assert sent["kv_transfer_params"] == {
                    "do_remote_prefill": True,
                    "remote_kv_source": {"kv_request_id": "req-1", "remote_host": "10.0.0.7", "remote_port": 8200}}
                assert a.headers[-1]["x-request-id"] == "req-1"
                # no request id: a fresh one, sent on as the header too
                h = {"x-kv-cache-source-host-port": "[::1]:9"}
                async with s.post(_base(r) + "/v1/chat/completions", json={"messages": []}, headers=h) as resp:
                    assert resp.status == 200
                src = a.bodies[-1]["kv_transfer_params"]["remote_kv_source"]
                assert src["remote_host"] == "::1" and src["remote_port"] == 9
                assert src["kv_request_id"] == a.headers[-1]["x-request-id"]
                # no header: the body is untouched
                async with s.post(_base(r) + "/v1/completions", json={"prompt": "y"}) as resp:
                    assert resp.status == 200
                assert a.bodies[-1] == {"prompt": "y"}
                async with s.post(_base(r) + "/v1/completions", json={"prompt": "y"},
                                  headers={"x-kv-cache-source-host-port": "nohost"}) as resp:
                    assert resp.status == 400
                    assert "x-kv-cache-source-host-port" in (await resp.json())["error"]["message"]
        finally:
            await r.close()
            await a.stop()
    run(go())


def test_endpoint_with_other_hash_settings_is_refused_naming_them():
    async def go():
        a = await FakeEngine("a", server_info={"block_size": 32, "prefix_caching_hash_algo": "sha256"}).start()
        b = await FakeEngine("b").start()
        c = await FakeEngine("c").start()
        eps = [a.url, {"url": b.url, "hash_algo": "sha256_cbor"}, {"url": c.url, "block_size": 16}]
        r = await _router([a, b, c], endpoints=eps)
        try:
            ea, eb, ec = r.pool.endpoints
            assert ea.refused and "block_size: the router has 16, the engine reports 32" in ea.refused
            assert eb.refused and "hash_algo: the router has 'sha256', its config states 'sha256_cbor'" in eb.refused
            assert ec.refused is None and ec.routable and set(ec.unchecked) == {"hash_algo", "hash_seed"}
            async with aiohttp.ClientSession() as s:
                for _ in range(3):
                    async with s.post(_base(r) + "/v1/completions", json={"prompt": "x"}) as resp:
                        assert (await resp.json())["engine"] == "c"
                async with s.get(_base(r) + "/health") as resp:
                    h = await resp.json()
                async with s.get(_base(r) + "/metrics") as resp:
                    text = await resp.text()
            assert [e["state"] for e in h["endpoints"]] == ["refused", "refused", "up"]
            assert "--block-size 32" in h["endpoints"][0]["reason"]
            assert f'kvgate_router_endpoint_refused{{endpoint="{a.url}"}} 1.0' in text
            # an engine restarted with the router's settings is accepted when it comes back
            a.server_info = {"block_size": 16, "prefix_caching_hash_algo": "sha256"}
            a.healthy = False
            await _until(lambda: not ea.up)
            a.healthy = True
            await _until(lambda: ea.up)
            assert ea.refused is None and ea.routable
        finally:
            await r.close()
            for e in (a, b, c):
                await e.stop()
    run(go())


def _stored(keys, medium=None, block_size=4):
    return [BlockStored(block_hashes=list(keys), parent_block_hash=None, token_ids=[], block_size=block_size,
                        lora_id=None, medium=medium, lora_name=None)]


async def _published(pub: EventPublisher, events, cond, timeout=10.0, topic="kv"):
    """Publish ``events`` until the router's feed has applied them (a SUB socket joins some ms after
    connecting: what is published before is not received; re-storing a block is idempotent)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "the router did not apply the published events"
        pub.publish(topic, events)
        await asyncio.sleep(0.05)


def test_cache_aware_routes_by_the_kv_events_it_reads_and_scores():
    async def go():
        a, b, c = await FakeEngine("a").start(), await FakeEngine("b").start(), await FakeEngine("c").start()
        ports = [free_port() for _ in range(4)]
        pubs = [EventPublisher(f"tcp://127.0.0.1:{p}") for p in ports[:3]]
        for p in pubs:
            p.start()
        eb, gwa, ec = pubs
        eps = [{"url": a.url, "gateway_events": gwa.endpoint}, {"url": b.url, "events": eb.endpoint},
               {"url": c.url, "events": ec.endpoint}]
        r = await _router([a, b, c], policy="cache-aware", block_size=4, endpoints=eps)
        try:
            prompt = "abcdefghijklmnop"  # 16 tokens in the fake tokenizer: 4 blocks of 4
            keys = r.hasher.keys([ord(ch) for ch in prompt])
            async with aiohttp.ClientSession() as s:
                # nothing indexed: least-loaded fallback (a, the first of the idle ones)
                async with s.post(_base(r) + "/v1/completions", json={"model": "m", "prompt": prompt}) as resp:
                    assert (await resp.json())["engine"] == "a"
                assert a.tokenize_calls[-1] == {"model": "m", "prompt": prompt}
                # b's engine holds 3 blocks on its GPU, a's gateway 1 in its RAM
                await _published(eb, _stored(keys[:3]), lambda: r.index.count(b.url, MEDIUM_GPU) == 3)
                await _published(gwa, _stored(keys[:1], MEDIUM_CPU),
                                 lambda: r.index.count(a.url + "#gateway", MEDIUM_CPU) == 1)
                async with s.post(_base(r) + "/v1/completions", json={"model": "m", "prompt": prompt}) as resp:
                    assert (await resp.json())["engine"] == "b"
                    # the answer says which engine and why: 3 blocks on its GPU, 1 left to compute
                    assert resp.headers["x-kvgate-endpoint"] == b.url
                    assert resp.headers["x-kvgate-matched"].startswith("gpu=3 cpu=0 storage=0 prefill=1 cost=")
                # a streamed request's prefill counts against its endpoint until its first token comes back
                state_b = r.pool.endpoints[1]
                b.first.clear()
                streamed = asyncio.create_task(s.post(_base(r) + "/v1/completions",
                                                      json={"model": "m", "prompt": prompt, "stream": True}))
                await _until(lambda: state_b.prefilling == 1)
                b.first.set()
                async with await streamed as resp:
                    assert resp.headers["x-kvgate-endpoint"] == b.url
                    await resp.read()
                assert state_b.prefilling == 0 and state_b.inflight == 0
                async with s.post(_base(r) + "/v1/score", json={"model": "m", "prompt": prompt}) as resp:
                    sc = await resp.json()
                assert sc["blocks"] == 4 and sc["tokens"] == 16
                by = {e["url"]: e for e in sc["endpoints"]}
                assert (by[b.url]["gpu"], by[b.url]["matched"], by[b.url]["prefill"]) == (3, 3, 1)
                assert (by[a.url]["cpu"], by[a.url]["gpu"], by[a.url]["matched"]) == (1, 0, 1)
                async with s.post(_base(r) + "/v1/score", json={"token_ids": [ord(ch) for ch in prompt[:8]]}) as resp:
                    sc = await resp.json()
                assert sc["blocks"] == 2 and {e["url"]: e["matched"] for e in sc["endpoints"]}[b.url] == 2
                async with s.post(_base(r) + "/v1/score", json={"model": "m"}) as resp:
                    assert resp.status == 400
                # c's engine hashes blocks of 8 tokens: its feed, then the endpoint, are refused
                await _published(ec, _stored(keys[:1], block_size=8), lambda: r.feeds.refused)
                async with s.get(_base(r) + "/health") as resp:
                    h = await resp.json()
                state = {e["url"]: e for e in h["endpoints"]}[c.url]
                assert state["state"] == "refused" and "blocks of 8 tokens" in state["reason"], state
                async with s.get(_base(r) + "/metrics") as resp:
                    text = await resp.text()
            assert 'kvgate_router_matched_blocks_total{tier="gpu"} 6.0' in text
            assert "kvgate_router_fallbacks_total 1.0" in text
            assert "kvgate_router_decision_seconds_count 3.0" in text
            assert "kvgate_router_tokenize_seconds_count" in text
            assert f'kvgate_router_endpoint_refused{{endpoint="{c.url}"}} 1.0' in text
        finally:
            await r.close()
            for p in pubs:
                p.close()
            for e in (a, b, c):
                await e.stop()
    run(go())


def test_parse_load_reads_vllm_and_sglang_names():
    vllm = ('vllm:num_requests_running{engine="0"} 2.0\nvllm:num_requests_running{engine="1"} 1.0\n'
            'vllm:num_requests_waiting{engine="0"} 4.0\n')
    assert parse_load(vllm) == (3, 4)
    sgl = "sglang:num_running_reqs 5\nsglang:num_queue_reqs 6\n"
    assert parse_load(sgl) == (5, 6)
    assert parse_load("other_metric 1\n") is None


def test_compare_settings_names_setting_and_both_values():
    s = build({"endpoints": ["http://e:1"], "hash_seed": "7"})
    refused, unchecked = compare_settings(s, EndpointSpec("http://e:1", hash_seed="8"), {"block_size": 16})
    assert "hash_seed: the router has '7', its config states '8'" in refused
    assert unchecked == ("hash_algo",)
    s = build({"endpoints": ["http://e:1"]})
    refused, _ = compare_settings(s, EndpointSpec("http://e:1", hash_seed="0"), {})
    assert "hash_seed: the router has none" in refused
    assert compare_settings(s, EndpointSpec("http://e:1"), {"block_size": 16, "hash_algo": "sha256"}) == \
        (None, ("hash_seed",))
