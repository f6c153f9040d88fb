"""Router configuration: flags or a YAML file, checked once here (``ConfigError`` naming the key).

The router's own dataclass, not the gateway's ``kvgate.config.Config``: the two share no key.  The YAML
file has the same keys as the flags (``block_size`` <-> ``--block-size``); flags given on the command line
win over the file.  ``endpoints`` in YAML is a list of URLs or of maps::

    endpoints:
      - http://10.0.0.1:8000
      - url: http://10.0.0.2:8000
        events: tcp://10.0.0.2:5557        # the engine's KV events (--kv-events-config endpoint; optional)
        events_replay: tcp://10.0.0.2:5558 # its replay socket (optional)
        gateway_events: tcp://10.0.0.2:5570  # its kvgate gateway's (kv_events_endpoint; optional)
        gateway_replay: tcp://10.0.0.2:5571  # (kv_events_replay_endpoint)
        block_size: 16                     # what the operator states of this engine: checked against the
        hash_algo: sha256                  # router's own at start and whenever it comes back (a mismatch
        hash_seed: "0"                     # refuses the endpoint, naming the setting and both values)
        role: prefill                      # both (default), prefill or decode: kvgate.routing.handoff
    tier_costs: {gpu: 0, cpu: 0.1, storage: 0.25}   # a restored block's cost, in blocks of prefill
    load_costs: {running: 4, waiting: 32, prefill_ahead: 1}   # (kvgate.routing.score)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping
from urllib.parse import urlsplit

from kvgate.config import load_yaml
from kvgate.errors import ConfigError, InvalidArgument
from kvgate.routing.score import DEFAULT_LOAD_COSTS, DEFAULT_TIER_COSTS, check_costs

POLICIES = ("cache-aware", "least-loaded", "round-robin")
ROLES = ("both", "prefill", "decode")  # what an endpoint does for a request (kvgate.routing.handoff)
HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


@dataclass(frozen=True)
class EndpointSpec:
    """One engine behind the router: its base URL (``http://host:port``, no ``/v1``), the ZMQ endpoints of
    the KV events that describe it (its engine's, its gateway's: PUB and replay; None: it publishes none,
    and the cache-aware policy sees nothing it holds), and the hash settings the operator states for it
    (None: not stated; the router then checks only what the engine itself reports)."""

    url: str
    events: str | None = None
    events_replay: str | None = None
    gateway_events: str | None = None
    gateway_replay: str | None = None
    block_size: int | None = None
    hash_algo: str | None = None
    hash_seed: str | None = None
    role: str = "both"

    @property
    def prefills(self) -> bool:
        return self.role in ("both", "prefill")

    @property
    def decodes(self) -> bool:
        return self.role in ("both", "decode")


@dataclass(frozen=True)
class RouterSettings:
    """Everything ``kvgate router`` runs with.  ``hash_seed`` None: the engines run without PYTHONHASHSEED
    (vLLM's fixed default seed for the sha256 algorithms)."""

    endpoints: tuple[EndpointSpec, ...] = ()
    host: str = "0.0.0.0"
    port: int = 8000
    policy: str = "cache-aware"
    block_size: int = 16
    hash_algo: str = "sha256"
    hash_seed: str | None = None
    # 1 s: the engines' /health and /metrics are cheap (vLLM answers both in ~1 ms), and a dead engine is
    # out of rotation within one interval even when no request hits it
    poll_interval: float = 1.0
    # a connect that takes longer than this counts as a failure (the request goes to the next choice)
    connect_timeout: float = 2.0
    # the cache-aware cost's weights (kvgate.routing.score), every key given: defaults filled in by build
    tier_costs: tuple[tuple[str, float], ...] = tuple(DEFAULT_TIER_COSTS.items())
    load_costs: tuple[tuple[str, float], ...] = tuple(DEFAULT_LOAD_COSTS.items())
    # prefill/decode split (kvgate.routing.handoff): how long the decode waits for the prefill's KV to be
    # restorable by the decode endpoint before it is sent anyway (and recomputes what is missing).  The
    # prefill engine stores its KV after it answers; on the CPU test engines a 2-block prompt is in the
    # gateway's events within ~10-50 ms, so 2 s is only reached when something is wrong.
    handoff_timeout: float = 2.0
    # the endpoints' gateways pull from one another (each lists the others in `peers`, or cluster mode):
    # a block held by any endpoint's gateway counts as restorable by every endpoint's
    peer_pulls: bool = False

    @property
    def split(self) -> bool:
        """Whether requests are split into a prefill and a decode (some endpoint is prefill or decode only)."""
        return any(e.role != "both" for e in self.endpoints)


def _url(value: Any, key: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key}: an endpoint is a base URL like http://10.0.0.1:8000, got {value!r}")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{key}: {value!r} is not an http(s) URL; give the engine's base URL, "
                          f"e.g. http://10.0.0.1:8000")
    if parts.path.rstrip("/") not in ("",):
        raise ConfigError(f"{key}: {value!r} has a path ({parts.path}); give the base URL without it "
                          f"(the router adds /v1/..., /health, /metrics itself)")
    return value.rstrip("/")


def _block_size(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key}: the block size is a whole number of tokens >= 1, got {value!r}")
    return value


def _algo(value: Any, key: str) -> str:
    if value not in HASH_ALGOS:
        raise ConfigError(f"{key}: {value!r} is not a vLLM prefix-caching hash algorithm; "
                          f"one of {', '.join(HASH_ALGOS)}")
    return value


def _seed(value: Any, key: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ConfigError(f"{key}: the seed is the engines' PYTHONHASHSEED (a string or a number), got {value!r}")
    return str(value)


_ENDPOINT_KEYS = ("url", "events", "events_replay", "gateway_events", "gateway_replay", "block_size", "hash_algo",
                  "hash_seed", "role")


def _endpoint(item: Any, key: str) -> EndpointSpec:
    if isinstance(item, str):
        return EndpointSpec(_url(item, key))
    if not isinstance(item, Mapping):
        raise ConfigError(f"{key}: an endpoint is a URL or a map with url (and events, block_size, hash_algo, "
                          f"hash_seed), got {item!r}")
    unknown = set(item) - set(_ENDPOINT_KEYS)
    if unknown:
        raise ConfigError(f"{key}: unknown key(s) {', '.join(sorted(map(str, unknown)))}; an endpoint has "
                          f"{', '.join(_ENDPOINT_KEYS)}")
    zmq = {}
    for k in ("events", "events_replay", "gateway_events", "gateway_replay"):
        v = item.get(k)
        if v is not None and (not isinstance(v, str) or "://" not in v):
            raise ConfigError(f"{key}.{k}: a ZMQ endpoint like tcp://10.0.0.2:5557, got {v!r}")
        zmq[k] = v
    for replay, pub in (("events_replay", "events"), ("gateway_replay", "gateway_events")):
        if zmq[replay] and not zmq[pub]:
            raise ConfigError(f"{key}.{replay} goes with {key}.{pub} (the PUB socket it replays)")
    return EndpointSpec(
        url=_url(item.get("url"), f"{key}.url"),
        **zmq,
        block_size=None if item.get("block_size") is None else _block_size(item["block_size"], f"{key}.block_size"),
        hash_algo=None if item.get("hash_algo") is None else _algo(item["hash_algo"], f"{key}.hash_algo"),
        hash_seed=_seed(item.get("hash_seed"), f"{key}.hash_seed"),
        role=_role(item.get("role", "both"), f"{key}.role"),
    )


def _role(value: Any, key: str) -> str:
    if value not in ROLES:
        raise ConfigError(f"{key}: {value!r} is not a role; one of {', '.join(ROLES)} (both: prefill and decode)")
    return value


def build(values: Mapping[str, Any]) -> RouterSettings:
    """A checked ``RouterSettings`` from a map of keys (the YAML file's, merged with the flags given)."""
    known = {f.name for f in dataclasses.fields(RouterSettings)}
    unknown = set(values) - known
    if unknown:
        raise ConfigError(f"unknown router key(s) {', '.join(sorted(map(str, unknown)))}; "
                          f"the keys are {', '.join(sorted(known))}")
    v = dict(values)
    eps = v.get("endpoints") or ()
    if not isinstance(eps, (list, tuple)):
        raise ConfigError(f"endpoints: a list of engine URLs, got {eps!r}")
    endpoints = tuple(e if isinstance(e, EndpointSpec) else _endpoint(e, f"endpoints[{i}]")
                      for i, e in enumerate(eps))
    if not endpoints:
        raise ConfigError("endpoints: none given; name each engine with --endpoint http://host:port "
                          "(repeat it) or list them under endpoints: in the config file")
    urls = [e.url for e in endpoints]
    dup = sorted({u for u in urls if urls.count(u) > 1})
    if dup:
        raise ConfigError(f"endpoints: {', '.join(dup)} given more than once")
    policy = v.get("policy", RouterSettings.policy)
    if policy not in POLICIES:
        raise ConfigError(f"policy: {policy!r} is not a policy; one of {', '.join(POLICIES)}")
    port = v.get("port", RouterSettings.port)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"port: a TCP port 0..65535, got {port!r}")
    if any(e.role != "both" for e in endpoints):
        for what, can in (("prefill", lambda e: e.role != "decode"), ("decode", lambda e: e.role != "prefill")):
            if not any(can(e) for e in endpoints):
                raise ConfigError(f"endpoints: some endpoint has a role, but none can {what}; give one role "
                                  f"{what} or both")
        blind = [e.url for e in endpoints if not e.gateway_events]
        if blind:
            raise ConfigError(f"endpoints: {', '.join(blind)}: gateway_events not given; with prefill and decode "
                              f"endpoints every endpoint needs them (the router sends a decode once its "
                              f"gateway's events show the prompt's KV where that endpoint can restore it)")
    if not isinstance(v.get("peer_pulls", False), bool):
        raise ConfigError(f"peer_pulls: true or false, got {v['peer_pulls']!r}")
    for k in ("poll_interval", "connect_timeout", "handoff_timeout"):
        x = v.get(k, getattr(RouterSettings, k))
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0:
            raise ConfigError(f"{k}: a number of seconds > 0, got {x!r}")
    costs = {}
    for k, defaults in (("tier_costs", DEFAULT_TIER_COSTS), ("load_costs", DEFAULT_LOAD_COSTS)):
        given = v.get(k) or {}
        if not isinstance(given, Mapping):
            raise ConfigError(f"{k}: a map of {', '.join(defaults)} to numbers, got {given!r}")
        try:
            costs[k] = tuple(check_costs(dict(given), defaults, k).items())
        except (InvalidArgument, TypeError) as e:
            raise ConfigError(str(e)) from None
    return RouterSettings(
        endpoints=endpoints,
        host=str(v.get("host", RouterSettings.host)),
        port=port,
        policy=policy,
        block_size=_block_size(v.get("block_size", RouterSettings.block_size), "block_size"),
        hash_algo=_algo(v.get("hash_algo", RouterSettings.hash_algo), "hash_algo"),
        hash_seed=_seed(v.get("hash_seed"), "hash_seed"),
        poll_interval=float(v.get("poll_interval", RouterSettings.poll_interval)),
        connect_timeout=float(v.get("connect_timeout", RouterSettings.connect_timeout)),
        handoff_timeout=float(v.get("handoff_timeout", RouterSettings.handoff_timeout)),
        peer_pulls=bool(v.get("peer_pulls", False)),
        **costs,
    )


def load(path: str | None, overrides: Mapping[str, Any]) -> RouterSettings:
    """The YAML file at ``path`` (None: none) with ``overrides`` (the flags given) on top, checked."""
    values: dict[str, Any] = load_yaml(path) if path is not None else {}
    values.update({k: val for k, val in overrides.items() if val is not None})
    return build(values)
