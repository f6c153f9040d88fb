"""A fleet behind ``kvgate router``: three vLLM CPU engines, each with its own kvgate gateway, one card
all three gateways mount, multi-turn conversations replayed through the router under each policy in
turn, ``--rounds`` times (the machine is shared and noisy: medians, and every round printed).

What it measures, per policy and round, on the same engines:

- **served**: prompt tokens the engines reported as cached (``usage.prompt_tokens_details.cached_tokens``,
  vLLM's own count: its GPU prefix cache plus what the kvgate tier restored), against what an **oracle**
  would serve: for each request, the longest prefix of it (whole 128-token blocks, at most all but the
  prompt's last token, as vLLM computes at least one) that a request answered before it was sent had in
  its prompt.  Nothing is evicted at this scale (the gateways' RAM tiers and the card hold every block),
  so every such prefix is somewhere an endpoint can restore it from: the oracle knows every endpoint's
  contents, and asks nothing of the router.
- **TTFT**: the first streamed chunk's arrival, client side, through the router.

The workload: conversations of the trace in ``benchmarks/data`` (requests grouped by their first block: a
long shared document, a new tail each turn), turns in order, a turn sent once the one before it was
answered, ``--concurrency`` requests in flight; each trace block (512 tokens there) becomes
``--block-tokens`` token ids, and one shared system prompt (``--system-blocks`` vLLM blocks) goes in front
of every request.  Each policy's round gets its own token ids (a salt), and every engine's prefix cache
is reset before it (POST /reset_prefix_cache), so no run finds another's blocks.  Where the served
tokens came from: the engines' own counters (``vllm:prefix_cache_hits``: their GPU;
``vllm:external_prefix_cache_hits``: restored through the connector).

Run it with ``make bench-fleet`` (``ARGS=...``); ``make demo-fleet`` is ``--demo``: fewer conversations,
and each routed request printed with the endpoint the router chose and what it credited it with (the
answer's ``x-kvgate-endpoint`` / ``x-kvgate-matched`` headers).

``--own-cards``: each gateway has a card of its own instead of the shared one, and pulls what it lacks
from the other two (``peers``, ``peer_listen``): reuse across engines then goes by pulls, and each
gateway's pull counters are printed at the end.  ``--pd``: after the policies, the same conversations
through a router with endpoint roles (engine0 and engine2 prefill, engine1 decodes), each request printed
with its prefill and decode engines, the hand-off's outcome and what each restored.  ``--demo`` implies
both.

Processes: the engines run in ``.venv-vllm``; the gateways and the router in this interpreter's.  All of
them run in their own sessions and are stopped in a ``finally``.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from kvgate.bench.processes import GatewayProcess, free_port  # noqa: E402

VENV_PY = REPO / ".venv-vllm" / "bin" / "python"
TRACE = REPO / "benchmarks" / "data" / "mooncake-synthetic-trace.jsonl"
BLOCK = 128  # the KV block size of vLLM's CPU platform (tokens)
MODEL = {"vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 8192}
POLICIES = ("round-robin", "least-loaded", "cache-aware")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- the workload ---------------------------------------------------------------------------------

class Turn:
    __slots__ = ("conv", "turn", "hash_ids", "output", "tokens")

    def __init__(self, conv: int, turn: int, hash_ids: list[int], output: int) -> None:
        self.conv, self.turn, self.hash_ids, self.output = conv, turn, hash_ids, output
        self.tokens: list[int] = []


def conversations(path: Path, n: int, min_turns: int, max_turns: int) -> list[Turn]:
    """The first ``n`` conversations of the trace with at least ``min_turns`` requests (grouped by first
    block), their first ``max_turns`` turns, in the trace's order."""
    groups: dict[int, list[dict]] = collections.defaultdict(list)
    order: list[int] = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            first = r["hash_ids"][0]
            if first not in groups:
                order.append(first)
            groups[first].append(r)
    turns: list[tuple[float, Turn]] = []
    chosen = [g for g in order if len(groups[g]) >= min_turns][:n]
    for c, g in enumerate(chosen):
        for t, r in enumerate(groups[g][:max_turns]):
            turns.append((r["timestamp"], Turn(c, t, r["hash_ids"], r["output_length"])))
    turns.sort(key=lambda x: x[0])
    return [t for _, t in turns]


def assign_tokens(turns: list[Turn], salt: int, block_tokens: int, system_blocks: int, max_tokens: int,
                  vocab: int) -> None:
    """Token ids per turn: a system prompt shared by all, then ``block_tokens`` ids per trace block (the
    same ids for the same block), cut at ``max_tokens``; ``salt`` gives each policy run its own ids."""
    system = random.Random(f"{salt}:system").choices(range(10, vocab), k=system_blocks * BLOCK)
    blocks: dict[int, list[int]] = {}
    for t in turns:
        toks = list(system)
        for h in t.hash_ids:
            if len(toks) >= max_tokens:
                break
            if h not in blocks:
                blocks[h] = random.Random(f"{salt}:{h}").choices(range(10, vocab), k=block_tokens)
            toks.extend(blocks[h])
        t.tokens = toks[:max_tokens]


class Oracle:
    """The longest prefix of a prompt, in whole blocks, that an answered request's prompt had."""

    def __init__(self) -> None:
        self._held: set[bytes] = set()
        self._lock = threading.Lock()

    @staticmethod
    def _prefixes(tokens: list[int]) -> list[bytes]:
        import hashlib

        out, h = [], hashlib.sha256()
        for i in range(len(tokens) // BLOCK):
            h.update(json.dumps(tokens[i * BLOCK:(i + 1) * BLOCK]).encode())
            out.append(h.copy().digest())
        return out

    def servable(self, tokens: list[int]) -> int:
        usable = (len(tokens) - 1) // BLOCK  # vLLM computes at least the last token
        n = 0
        with self._lock:
            for d in self._prefixes(tokens)[:usable]:
                if d not in self._held:
                    break
                n += 1
        return n * BLOCK

    def answered(self, tokens: list[int]) -> None:
        with self._lock:
            self._held.update(self._prefixes(tokens))


# ---- processes ----------------------------------------------------------------------------------------

def _get(url: str, timeout: float = 10) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _post(url: str, body: dict | None = None, timeout: float = 60) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_for(what: str, predicate, timeout: float, tail=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise RuntimeError(f"{what}: not within {timeout:.0f} s\n{tail()}")


class Engine:
    """A vLLM CPU server storing through its gateway, publishing its KV events (tcp://*:PORT: vLLM binds
    its PUB socket only to a wildcard address), answering with cached-token counts, in dev mode (its
    /server_info for the router's settings check, /reset_prefix_cache for this benchmark)."""

    def __init__(self, workdir: Path, name: str, model: Path, gateway: GatewayProcess) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        pub, replay = free_port(), free_port()
        self.events, self.replay = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
                  "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
        transfer = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
            "spec_name": "KvgateOffloadingSpec", "spec_module_path": "kvgate.integrations.vllm",
            "cpu_bytes_to_use": 128 << 20, "kvgate.socket": gateway.socket}}
        self.argv = [str(VENV_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                     "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(self.port),
                     "--max-model-len", "4096", "--enable-prefix-caching", "--enable-prompt-tokens-details",
                     "--kv-events-config", json.dumps(events), "--kv-transfer-config", json.dumps(transfer)]
        self.env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"}
        self.env.pop("PYTHONHASHSEED", None)  # the router's --hash-seed default: none
        self.log_path = workdir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log_path, "wb") as f:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def up(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError(f"engine {self.name} exited:\n{self.tail()}")
        try:
            return _get(self.url + "/health", 2)[0] == 200
        except OSError:
            return False

    def stop(self) -> None:
        """Stop the engine and everything it started (its engine core and workers share its process group):
        SIGTERM, then SIGKILL to the group whatever the first process did, so that a worker whose parent
        already died (an engine killed on purpose) is not left holding its memory."""
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue

    def kill(self) -> None:
        """SIGKILL the engine's whole process group at once (a crash, as a test makes one)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(30)


class Router:
    def __init__(self, workdir: Path, policy: str, endpoints: list[dict], extra: dict | None = None) -> None:
        self.policy = policy
        self.config = workdir / f"router-{policy}.yaml"
        self.config.write_text(json.dumps({"endpoints": endpoints, "policy": policy, "block_size": BLOCK,
                                           "poll_interval": 0.5, **(extra or {})}))  # JSON is YAML
        self.log_path = workdir / f"router-{policy}.log"
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        self.proc = subprocess.Popen([sys.executable, "-m", "kvgate", "router", "--config", str(self.config),
                                      "--host", "127.0.0.1", "--port", "0"], env=env, stdout=subprocess.PIPE,
                                     stderr=open(self.log_path, "wb"), text=True, start_new_session=True)
        line = self.proc.stdout.readline()  # its one line once it serves; '' when it exits
        if "serving on 127.0.0.1:" not in line:
            raise RuntimeError(f"router ({policy}) did not start: {line}\n"
                               + self.log_path.read_text(errors="replace")[-3000:])
        self.port = int(line.split("serving on 127.0.0.1:")[1].split()[0])
        self.line = line.strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# ---- one policy's run ------------------------------------------------------------------------------

def send(port: int, tokens: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed completion through the router: TTFT, cached tokens, the route headers."""
    body = json.dumps({"model": "tiny", "prompt": tokens, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"router answered {resp.status}: {resp.read()[:500]!r}")
    ttft, usage = None, None
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if ttft is None and event.get("choices"):
            ttft = time.perf_counter() - t0
        if event.get("usage"):
            usage = event["usage"]
    conn.close()
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {"ttft": ttft, "cached": details.get("cached_tokens") or 0, "prompt": len(tokens),
            "endpoint": resp.getheader("x-kvgate-endpoint", ""), "matched": resp.getheader("x-kvgate-matched", ""),
            "prefill": resp.getheader("x-kvgate-prefill", ""), "handoff": resp.getheader("x-kvgate-handoff", ""),
            "prefill_cached": resp.getheader("x-kvgate-prefill-cached", "")}


def replay(port: int, turns: list[Turn], concurrency: int, max_out: int, names: dict[str, str],
           demo: bool) -> list[dict]:
    """Every turn through the router, turns of one conversation in order (a turn waits for the answer
    to the one before it), at most ``concurrency`` in flight."""
    oracle = Oracle()
    done = {(t.conv, t.turn): threading.Event() for t in turns}
    results: list[dict] = [None] * len(turns)  # type: ignore[list-item]
    next_i = iter(range(len(turns)))
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        while not errors:
            with lock:
                i = next(next_i, None)
            if i is None:
                return
            t = turns[i]
            if t.turn > 0:
                done[(t.conv, t.turn - 1)].wait()
            try:
                servable = oracle.servable(t.tokens)
                r = send(port, t.tokens, min(max_out, max(1, t.output)))
            except BaseException as e:  # noqa: BLE001 - reported by the caller
                errors.append(e)
                done[(t.conv, t.turn)].set()
                return
            oracle.answered(t.tokens)
            r.update(oracle=servable, conv=t.conv, turn=t.turn)
            results[i] = r
            done[(t.conv, t.turn)].set()
            if demo and r["handoff"]:
                log(f"  conv {t.conv:2d} turn {t.turn}  {len(t.tokens):5d} tokens  prefill "
                    f"{names.get(r['prefill'], '-'):8s} (restored {r['prefill_cached'] or '-':>5s}) -> decode "
                    f"{names.get(r['endpoint'], r['endpoint'])} (restored {r['cached']:5d})  {r['handoff']:8s}  "
                    f"TTFT {r['ttft'] * 1000:6.0f} ms")
            elif demo:
                log(f"  conv {t.conv:2d} turn {t.turn}  {len(t.tokens):5d} tokens -> "
                    f"{names.get(r['endpoint'], r['endpoint'])}  cached {r['cached']:5d} (oracle {servable:5d})  "
                    f"TTFT {r['ttft'] * 1000:6.0f} ms  {r['matched']}")

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return results


def summary(policy: str, results: list[dict]) -> dict[str, Any]:
    ttfts = sorted(r["ttft"] for r in results)
    served = sum(r["cached"] for r in results)
    oracle = sum(r["oracle"] for r in results)
    per = collections.Counter(r["endpoint"] for r in results)
    return {"policy": policy, "requests": len(results), "prompt_tokens": sum(r["prompt"] for r in results),
            "served": served, "oracle": oracle, "served_vs_oracle": served / oracle if oracle else None,
            "ttft_p50": statistics.median(ttfts), "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))],
            "ttft_mean": statistics.fmean(ttfts), "per_endpoint": dict(per)}


def engine_hits(engines: list[Engine]) -> tuple[float, float]:
    """Prompt tokens the engines found so far: on their GPU (``vllm:prefix_cache_hits``) and restored from
    below it by their connector (``vllm:external_prefix_cache_hits``: vLLM's CPU tier, then kvgate)."""
    local = external = 0.0
    for e in engines:
        status, text = _get(e.url + "/metrics")
        if status != 200:
            raise RuntimeError(f"{e.name} GET /metrics: {status}")
        for line in text.decode().splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                local += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:external_prefix_cache_hits_total"):
                external += float(line.rsplit(" ", 1)[1])
    return local, external


def build_model(model_dir: Path) -> None:
    code = ("import sys; from pathlib import Path; sys.path.insert(0, %r)\n"
            "import vllm_harness\n"
            "vllm_harness.build_model(Path(%r), %r)\n"
            "vllm_harness.build_tokenizer(Path(%r), %d)\n") % (
        str(REPO / "benchmarks"), str(model_dir), MODEL, str(model_dir), MODEL["vocab_size"])
    subprocess.run([str(VENV_PY), "-c", code], check=True, timeout=600)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--min-turns", type=int, default=3, help="conversations with fewer requests are skipped")
    p.add_argument("--max-turns", type=int, default=5)
    p.add_argument("--block-tokens", type=int, default=16, help="token ids per trace block (512 tokens there)")
    p.add_argument("--system-blocks", type=int, default=2, help="vLLM blocks of the shared system prompt")
    p.add_argument("--max-prompt", type=int, default=2048, help="prompt tokens at most")
    p.add_argument("--max-output", type=int, default=8, help="tokens generated per request at most")
    p.add_argument("--concurrency", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3, help="every policy this many times, in turn, on the same engines")
    p.add_argument("--policies", default="round-robin,least-loaded,cache-aware")
    p.add_argument("--router", type=json.loads, default={}, metavar="JSON",
                   help='router config keys to add, e.g. \'{"tier_costs": {"storage": 1}}\'')
    p.add_argument("--own-cards", action="store_true",
                   help="a card per gateway, each pulling from the others (peers) instead of one shared card")
    p.add_argument("--pd", action="store_true",
                   help="then a round with prefill and decode endpoints (engine0, engine2 prefill; engine1 decode)")
    p.add_argument("--demo", action="store_true",
                   help="fewer conversations, round-robin and cache-aware only, every routed request printed; "
                        "implies --own-cards and --pd")
    p.add_argument("--workdir", default=str(REPO / "var" / "bench-fleet"))
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if args.demo:
        args.conversations = min(args.conversations, 6)
        args.policies = "round-robin,cache-aware"
        args.rounds = 1
        args.own_cards = args.pd = True
    policies = [x for x in args.policies.split(",") if x]
    for x in policies:
        if x not in POLICIES:
            p.error(f"--policies: unknown policy {x!r} (one of {', '.join(POLICIES)})")
    if not VENV_PY.exists():
        p.error(f"{VENV_PY} is missing: make vllm-venv")

    def stop_on(signum, _frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop_on)

    work = Path(args.workdir)
    model = work / "model"
    card = work / "card"
    for d in (work, card):
        d.mkdir(parents=True, exist_ok=True)
    for old in card.iterdir():  # a run starts from an empty card
        subprocess.run(["rm", "-rf", str(old)], check=True)
    token = work / "peer.token"
    token.write_text("fleet-peer-token")
    peer_ports = [free_port() for _ in range(3)]
    turns = conversations(TRACE, args.conversations, args.min_turns, args.max_turns)
    log(f"workload: {len(turns)} requests of {args.conversations} conversations of {TRACE.name} "
        f"({args.block_tokens} tokens per trace block, {args.system_blocks * BLOCK}-token shared system prompt, "
        f"at most {args.max_prompt} prompt tokens), {args.concurrency} in flight")
    log("building the random-weight model (once)")
    build_model(model)

    gateways: list[GatewayProcess] = []
    engines: list[Engine] = []
    results: dict[str, list[dict]] = {policy: [] for policy in policies}
    try:
        specs = []
        for i in range(3):
            pub, rep = free_port(), free_port()
            if args.own_cards:
                own = work / f"card{i}"
                subprocess.run(["rm", "-rf", str(own)], check=True)
                own.mkdir()
                where = ["--storage-devices", str(own), "--peer-listen", f"127.0.0.1:{peer_ports[i]}",
                         "--peers", *(f"127.0.0.1:{p}" for j, p in enumerate(peer_ports) if j != i),
                         "--peer-token-file", str(token)]
            else:
                where = ["--storage-devices", str(card), "--shared-storage", "true"]
            gw = GatewayProcess(work / f"gw{i}", ["--max-bytes", "512M", "--shared-memory-size", "256M", "--port", "0", "--metrics-port", "0",
                                                  *where,
                                                  "--kv-events-endpoint", f"tcp://127.0.0.1:{pub}",
                                                  "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{rep}",
                                                  "--kv-events-topic", f"gw{i}"], name=f"gw{i}")
            gw.start()
            gateways.append(gw)
            specs.append((pub, rep))
        log("3 gateways up, " + ("each with its own card, pulling from the other two" if args.own_cards
                                 else f"one shared card {card}"))
        for i, gw in enumerate(gateways):
            engines.append(Engine(work, f"engine{i}", model, gw))
        for e in engines:
            e.start()
        for e in engines:
            wait_for(f"engine {e.name} up", e.up, 900, e.tail)
        log("3 vLLM engines up: " + ", ".join(e.url for e in engines))
        names = {e.url: e.name for e in engines}
        endpoints = [{"url": e.url, "events": e.events, "events_replay": e.replay,
                      "gateway_events": f"tcp://127.0.0.1:{pub}", "gateway_replay": f"tcp://127.0.0.1:{rep}"}
                     for e, (pub, rep) in zip(engines, specs)]
        # warm every engine (first-request costs) on tokens no run uses
        warm = conversations(TRACE, 3, 1, 1)
        assign_tokens(warm, -1, args.block_tokens, args.system_blocks, args.max_prompt, MODEL["vocab_size"])
        for e, t in zip(engines, warm):
            status, body = _post(e.url + "/v1/completions", {"model": "tiny", "prompt": t.tokens,
                                                             "max_tokens": 2, "temperature": 0}, 600)
            if status != 200:
                raise RuntimeError(f"warm-up on {e.name}: {status} {body[:300]!r}")
        for rnd in range(args.rounds):
            for n, policy in enumerate(policies):
                for e in engines:
                    status, body = _post(e.url + "/reset_prefix_cache")
                    if status != 200:
                        raise RuntimeError(f"{e.name} POST /reset_prefix_cache: {status} {body[:300]!r}")
                assign_tokens(turns, rnd * len(policies) + n, args.block_tokens, args.system_blocks,
                              args.max_prompt, MODEL["vocab_size"])
                router = Router(work, policy, endpoints, args.router)
                try:
                    log(f"round {rnd + 1}, {policy}: {router.line}")
                    hits0 = engine_hits(engines)
                    t0 = time.monotonic()
                    res = replay(router.port, turns, args.concurrency, args.max_output, names, args.demo)
                    s = summary(policy, res)
                    s["seconds"] = time.monotonic() - t0
                    hits1 = engine_hits(engines)
                    s["from_gpu"], s["restored"] = hits1[0] - hits0[0], hits1[1] - hits0[1]
                    s["each_request"] = res
                    s["per_endpoint"] = {names.get(k, k): v for k, v in s["per_endpoint"].items()}
                    results[policy].append(s)
                    log(f"{policy}: served {s['served']} of the oracle's {s['oracle']} tokens "
                        f"({(s['served_vs_oracle'] or 0):.2f}; {s['from_gpu']:.0f} on the GPU that had them, "
                        f"{s['restored']:.0f} restored from below it), TTFT p50 {s['ttft_p50'] * 1000:.0f} ms, "
                        f"p90 {s['ttft_p90'] * 1000:.0f} ms, {s['seconds']:.0f} s, per engine {s['per_endpoint']}")
                finally:
                    router.stop()
        if args.pd:
            for e in engines:
                _post(e.url + "/reset_prefix_cache")
            assign_tokens(turns, 10_000, args.block_tokens, args.system_blocks, args.max_prompt, MODEL["vocab_size"])
            roles = ("prefill", "decode", "prefill")
            extra = {**args.router, "peer_pulls": bool(args.own_cards), "handoff_timeout": 10}
            router = Router(work, "cache-aware", [{**ep, "role": role} for ep, role in zip(endpoints, roles)], extra)
            try:
                log(f"prefill/decode: engine0 and engine2 prefill, engine1 decodes; {router.line}")
                hits0 = engine_hits(engines)
                res = replay(router.port, turns, args.concurrency, args.max_output, names, True)
                hits1 = engine_hits(engines)
                outcomes = collections.Counter(r["handoff"] for r in res)
                log(f"prefill/decode: {len(res)} requests, hand-offs {dict(outcomes)}, decode restored "
                    f"{sum(r['cached'] for r in res)} of {sum(r['prompt'] for r in res)} prompt tokens")
                results["prefill/decode"] = [summary("prefill/decode", res) | {
                    "each_request": res, "from_gpu": hits1[0] - hits0[0], "restored": hits1[1] - hits0[1]}]
            finally:
                router.stop()
        if args.own_cards:
            for i, gw in enumerate(gateways):
                st = gw.stats()
                pulled = st.get("peers") or []
                log(f"gw{i}: pulled {sum(p.get('hits', 0) for p in pulled)} objects "
                    f"({sum(p.get('bytes_read', 0) for p in pulled) / (1 << 20):.1f} MiB) from its peers; served "
                    f"{(st.get('peer_listen') or {}).get('served_objects', 0)} to them")
    finally:
        for e in engines:
            e.stop()
        for gw in gateways:
            gw.stop()
            gw.cleanup()
    print()
    print(f"{'policy':14s} {'served/oracle':>13s} {'on GPU':>7s} {'TTFT p50':>9s} {'p90':>7s} {'mean':>7s}  "
          f"(each round's TTFT p50, ms)")
    med = {}
    for policy, rounds in results.items():
        if not rounds:
            continue
        served, oracle = sum(s["served"] for s in rounds), sum(s["oracle"] for s in rounds)
        gpu = sum(s["from_gpu"] for s in rounds) / served if served else 0.0
        med[policy] = statistics.median(s["ttft_p50"] for s in rounds)
        p90 = statistics.median(s["ttft_p90"] for s in rounds)
        mean = statistics.median(s["ttft_mean"] for s in rounds)
        each = ", ".join(f"{s['ttft_p50'] * 1000:.0f}" for s in rounds)
        print(f"{policy:14s} {served / oracle if oracle else 0:13.2f} {gpu:7.2f} {med[policy] * 1000:7.0f}ms "
              f"{p90 * 1000:5.0f}ms {mean * 1000:5.0f}ms  ({each})")
    if "cache-aware" in med and "round-robin" in med:
        each = [c["ttft_p50"] / r["ttft_p50"] for c, r in zip(results["cache-aware"], results["round-robin"])]
        print(f"\ncache-aware TTFT p50 / round-robin: {med['cache-aware'] / med['round-robin']:.2f} "
              f"(medians of {len(each)} rounds; each round: {', '.join(f'{x:.2f}' for x in each)})")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
