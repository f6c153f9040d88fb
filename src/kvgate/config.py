"""Gateway configuration: one table of keys, read from YAML and from flags.

The table is ``Config`` itself: each field is declared once with its parser,
default and help, and ``FIELDS`` is read back from the fields, so a default
cannot differ between ``Config()``, the YAML file and the flags.  Every key
is accepted in the YAML file and as a command-line flag (``max_bytes`` <->
``--max-bytes``).  Values are checked here, once, so the rest of the code
can trust a ``Config``.  Any problem raises ``ConfigError`` with a one-line
message that names the key.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
import re
import ssl
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import yaml

from kvgate.errors import ConfigError
from kvgate.types import split_host_port




def read_token(path: str, key: str) -> str:
    """The token in the file at ``path``, stripped; a ``ConfigError`` naming ``key`` when it cannot be read or
    is empty.  Blocking: a gateway reads its own at start, a card client on its I/O threads."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as e:
        raise ConfigError(f"{key}: cannot read {path}: {e.strerror}") from None
    if not token:
        raise ConfigError(f"{key}: {path} is empty")
    return token


def is_loopback(host: str) -> bool:
    """Whether a bind address reaches this host only (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
}
# Bare single letters are binary, as in `16G` meaning GiB: that is what people
# mean when they size a cache next to `free -g`.
_SIZE_UNITS.update({"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40})
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

_PORT_MAX = 65535
SOCKET_PATH_MAX = 107  # sockaddr_un.sun_path is 108 bytes, one of them the terminating NUL

_DURATION_UNITS = {"": 1.0, "s": 1.0, "ms": 0.001, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any) -> int:
    """`16G`, `512MiB`, `1.5GB`, `4096` -> bytes.  Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 16G or 512MiB")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("a size cannot be negative")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if str(value).strip().startswith("-"):
        raise ValueError(f"a size cannot be negative, got {value!r}")
    m = _SIZE_RE.match(str(value))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"expected a size such as 16G or 512MiB, got {value!r}")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def size_text(n: float) -> str:
    """A byte count as a person reads it in a message: ``1 MiB``, ``256 KiB``, ``1.5 GiB``, ``1000 bytes``."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.4g} {unit}"
    return f"{n:g} bytes"


def parse_duration(value: Any) -> float:
    """`30`, `30s`, `15m`, `2h`, `1d`, `250ms` -> seconds."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 30s, 15m or 2h")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError("a duration cannot be negative")
        return float(value)
    m = _DURATION_RE.match(str(value))
    if not m or m.group(2).lower() not in _DURATION_UNITS:
        raise ValueError(f"expected a duration such as 30s, 15m or 2h, got {value!r}")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()]


def _parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true/false (or 1/0), got {value!r}")


def _parse_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    try:
        return int(str(value).strip())
    except ValueError:
        raise ValueError(f"expected an integer, got {value!r}") from None


def _parse_str(value: Any) -> str:
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise ValueError(f"expected a string, got {value!r}")
    return str(value)


def _parse_str_list(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ValueError(f"expected a list of strings, got {value!r}")


@dataclass(frozen=True)
class Field:
    """One config key: how to parse it, its default, and its help text (read from its ``Config`` field)."""

    name: str
    parse: Callable[[Any], Any]
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    optional: bool = False  # `null` / absent is a valid value
    metavar: str | None = None
    many: bool = False  # flag takes one or more values


# The card of a gateway started without storage_devices (``make run``); the
# only card directory created when it is missing unless create_card_dirs says so.
DEFAULT_CARD = "./var/kvgate/card0"


def _key(parse: Callable[[Any], Any], default: Any, help: str, **options: Any) -> Any:
    """A ``Config`` field that is also a config key: its default is written here once, and
    ``FIELDS`` (YAML, flags, ``--help``) is read back from these fields."""
    metadata = {"key": dict(parse=parse, default=default, help=help, **options)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Config:
    """The gateway's settings, each checked: the one place every config key and its default is written.

    Built by ``from_mapping`` / ``load`` (``kvgate serve`` and ``fingerprint``, on the main thread,
    before anything starts) or directly (tests, ``kvgate bench``); frozen, so any thread or task may
    read it.  Each field is declared with ``_key``: how its raw value is parsed, its default, its help.
    """

    storage_devices: list[str] = _key(_parse_str_list, [DEFAULT_CARD],
                                      "cards of the long tier: directories (absolute or relative paths)",
                                      metavar="DIR", many=True)
    create_card_dirs: bool = _key(_parse_bool, False,
                                  "create card directories that do not exist (off: a missing one waits, logged, "
                                  f"until it is created or mounted; {DEFAULT_CARD} is always created)")
    storage_slots: int = _key(_parse_int, 1024,
                              "slots of the key distribution over the cards: many more than cards, so the shares "
                              "come out even; set the same on every gateway of the cards", minimum=1)
    num_dbs: int = _key(_parse_int, 1, "shards (subdirectories) inside each card", minimum=1)
    key_placement: str = _key(_parse_str, "dialog", "how blocks are placed on cards", choices=("dialog", "stripe"))
    key_layout_fingerprint: str | None = _key(
        _parse_str, None, "expected key layout fingerprint (16 hex digits); a differing layout refuses to start",
        optional=True)
    shared_storage: bool = _key(_parse_bool, False, "cards are shared with other gateways: never delete all data")
    start_clean: bool = _key(_parse_bool, False,
                             "delete every object on the cards at start (refused with shared_storage)")
    # A quarter of a SATA SSD's write rate, a small share of an NVMe's: the engine's own writes and restores
    # keep the card.
    card_move_rate: int = _key(parse_size, 128 << 20,
                               "bytes a second the mover copies between cards after a card joins or drains",
                               minimum=1 << 20)
    io_timeout_ms: int = _key(_parse_int, 2000, "deadline of one card I/O in milliseconds", minimum=1)
    io_timeout_strikes: int = _key(_parse_int, 3,
                                   "I/Os in a row past the deadline or failing that take a card out of service",
                                   minimum=1)
    status_file: str | None = _key(_parse_str, None, "Prometheus text file rewritten every second", optional=True)
    port: int = _key(_parse_int, 5557, "TCP port of the gateway (0 disables the TCP listener)", minimum=0,
                     maximum=_PORT_MAX)
    bind_address: str = _key(_parse_str, "127.0.0.1",
                             "TCP bind address; anything but loopback needs auth_token_file")
    socket: str | None = _key(
        _parse_str, None, "Unix socket path (default: kvgate-<port>.sock in $XDG_RUNTIME_DIR, else in /tmp; "
        "port 0 is named as 5557)", optional=True)
    metrics_port: int = _key(_parse_int, 9557, "HTTP port of /metrics and /v1/cache/prewarm (0 disables)",
                             minimum=0, maximum=_PORT_MAX)
    metrics_bind_address: str = _key(_parse_str, "127.0.0.1", "HTTP bind address of /metrics")
    shared_memory_size: int = _key(parse_size, 256 << 20, "shared-memory region given to each local session",
                                   minimum=1 << 20)
    thread_pool_size: int = _key(_parse_int, 4, "threads doing card I/O and bulk copies", minimum=1)
    max_bytes: int = _key(parse_size, 1 << 30, "size of the RAM tier (preallocated at start)", minimum=0)
    ram_page_size: int = _key(parse_size, 256 << 10, "allocation unit of the RAM tier", minimum=4096)
    # A card smaller than one filesystem block holds no object at all (a directory card's smallest file is one).
    card_capacity: int | None = _key(
        parse_size, None,
        "bytes each card may hold (default: what it holds plus its free space, less card_reserve on a "
        "filesystem; a Redis card: what fits under its maxmemory)", optional=True, minimum=4096)
    card_reserve: int | None = _key(
        parse_size, None,
        "free space left on a directory card's filesystem when card_capacity is not set (default: a tenth of what "
        "the card could hold, its objects plus the free space, at most 1 GiB; not used for Redis cards: they keep "
        "a share of maxmemory for the server)", optional=True)
    eviction_policy: str = _key(
        _parse_str, "adaptive", "eviction order of both tiers: adaptive (the prefix rules, each dialog cut from its "
        "tail, in whichever order, prefix or LRU by dialog, small simulated caches find restoring more), prefix, or lru",
        choices=("adaptive", "prefix", "lru"))
    ttl: float | None = _key(parse_duration, None, "objects older than this are misses and are deleted",
                             optional=True)
    auth_token_file: str | None = _key(_parse_str, None, "file holding the token that lets its holder in on every "
                                       "listener (without it: only the gateway's user and root)", optional=True)
    card_token_file: str | None = _key(
        _parse_str, None, "file holding the token kvgate:// card servers require (kvgate export --token-file)",
        optional=True)
    card_tls_ca_file: str | None = _key(
        _parse_str, None, "PEM file of the CAs that sign the certificates of kvgates:// card servers (kvgate export "
        "--tls-cert); default: the system's trusted CAs", optional=True)
    max_frame_bytes: int = _key(parse_size, 256 << 20,
                                "largest message a client may send (inline bytes included)", minimum=1 << 16)
    max_connections: int = _key(
        _parse_int, 256,
        "concurrent client connections of each listener: the Unix socket, and all TCP listeners together",
        minimum=1)
    # A client says hello in its first frame, right after connecting: 10 s is far beyond a loaded host's
    # delay, and is all an idle connection can hold a slot for.
    hello_timeout: float = _key(
        parse_duration, 10.0,
        "time a new connection has to have its hello accepted; until then it holds no inline bytes", minimum=0.1)
    # An announced frame holds its share of the inline byte budget until it is in: a 256 MiB frame may
    # take 10 s + 64 s, a client below 4 MiB/s (32 Mbit/s) is too slow to feed an engine anyway.
    frame_timeout: float = _key(
        parse_duration, 10.0,
        "time an announced header and body may take to arrive, plus 1 s per 4 MiB of them", minimum=0.1)
    refuse_unsalted: bool = _key(_parse_bool, False, "refuse requests of sessions that announce no tenant salt")
    sync_writes: bool = _key(_parse_bool, False,
                             "fsync every object before acknowledging it (survives power loss)")
    direct_reads: bool = _key(_parse_bool, True,
                              "directory cards read what the page cache lacks with O_DIRECT, around the page cache")
    cross_memory_gets: bool = _key(
        _parse_bool, True,
        "local clients of the gateway's own user read gets of plain buffers straight out of its memory "
        "(process_vm_readv), and warm directory-card objects out of files it lends them open (pidfd_getfd): "
        "one copy, instead of through their session region (two)")
    shared_ram_arena: bool = _key(
        _parse_bool, True,
        "with cross_memory_gets, the RAM tier lives in a sealed memfd that local clients of the gateway's own "
        "user map read-only and copy their gets out of (a memcpy; process_vm_readv reaches about 0.66 of one), so "
        "the RAM-tier pages a client has read count in its resident size, which the OOM killer weighs (not in its "
        "cgroup's charge: they are the gateway's); false: private memory, read with process_vm_readv")
    in_place_regions: bool = _key(
        _parse_bool, True,
        "read into, hash and write from the shared memory of a local client that could stop the gateway anyway "
        "(its own user or root, in its PID namespace) in place, one copy (a region it shrinks meanwhile fails "
        "that request, under the C helper's guard); false: through the kernel and a scratch buffer (two), as "
        "for every other client")
    prepare_reads: bool = _key(
        _parse_bool, True,
        "a lookup that finds objects on a card starts their reads' first steps (directory: the file lookups)")
    read_priority: str = _key(
        _parse_str, "realtime",
        "realtime: the threads serving reads an engine waits on run at SCHED_RR 1 where permitted "
        "(engines poll the CPUs while they wait); normal: the fair scheduler's share",
        choices=("realtime", "normal"))
    # KV events (vLLM's format: a router learns where each block is).  Off by default: the events say
    # which blocks this gateway holds, so whoever reads them learns which prompts were seen.
    kv_events_endpoint: str | None = _key(
        _parse_str, None, "ZMQ PUB endpoint this gateway publishes its tiers' KV events on, in vLLM's format "
        "(e.g. tcp://127.0.0.1:5570; off when unset)", optional=True)
    kv_events_replay_endpoint: str | None = _key(
        _parse_str, None, "ZMQ ROUTER endpoint a subscriber that missed batches asks again (e.g. "
        "tcp://127.0.0.1:5571; off when unset)", optional=True)
    kv_events_topic: str = _key(_parse_str, "kvgate", "topic of the events of this gateway's RAM tier; a card's "
                                "events go out under <topic>@card:<serial>")
    kv_events_buffer: int = _key(_parse_int, 10_000, "event batches kept for replay", minimum=1)
    # Peers: gateways that read from each other what their tiers hold (a prefix one engine computed, another
    # restores).  Off by default: a peer reads the whole cache, so both ends need the token.
    peer_listen: str | None = _key(
        _parse_str, None, "HOST:PORT where this gateway serves what its tiers hold to peer gateways, read only "
        "(needs peer_token_file; off when unset)", optional=True, metavar="HOST:PORT")
    peers: list[str] = _key(
        _parse_str_list, [], "peer gateways (the HOST:PORT of their peer_listen) this one reads a missing object "
        "from, after its own tiers", metavar="HOST:PORT", many=True)
    peer_token_file: str | None = _key(
        _parse_str, None, "file holding the token peer gateways present to each other (peer_listen, peers)",
        optional=True)
    # TLS between peers: the listener's certificate and key, and the CAs a puller checks its peers' against.
    # Kept apart from card_tls_ca_file: the CA that may vouch for a card server need not vouch for a peer,
    # which reads the whole cache.
    peer_tls_cert_file: str | None = _key(
        _parse_str, None, "PEM certificate (chain) of the peer listener: with it (and peer_tls_key_file) every peer "
        "connection is TLS, and a plain one is refused", optional=True)
    peer_tls_key_file: str | None = _key(
        _parse_str, None, "PEM private key of peer_tls_cert_file", optional=True)
    peer_tls_ca_file: str | None = _key(
        _parse_str, None, "PEM file of the CAs that sign the peers' certificates: with it every peer is reached over "
        "TLS (kvgates://HOST:PORT/peer) and its certificate checked against these CAs and the peer's host "
        "(card_tls_ca_file is not used for peers)", optional=True)
    # A peer's answer must come sooner than the engine could recompute the prefix: a 2K-token prefix takes
    # tens of ms on a GPU, so a peer slower than this is as good as absent.
    peer_timeout_ms: int = _key(_parse_int, 500, "deadline of one call to a peer (a batch of lookups or reads); "
                                "past it the objects are misses and the engine recomputes them", minimum=1)
    # In cluster mode a gateway finds its peers in the registry, at the address each advertises there.
    peer_advertise: str | None = _key(
        _parse_str, None, "cluster mode: HOST:PORT other gateways pull from, reported in the registry; peer_listen "
        "when unset, and required when peer_listen listens on a wildcard host (0.0.0.0, ::)", optional=True,
        metavar="HOST:PORT")
    log_level: str = _key(_parse_str, "info", "log level", choices=("debug", "info", "warning", "error"))
    cluster_etcd_endpoints: list[str] = _key(
        _parse_str_list, [],
        "cluster mode: etcd endpoints (host:port) of the card registry; the cards come from its view, not "
        "from storage_devices", metavar="HOST:PORT", many=True)
    cluster_name: str = _key(_parse_str, "default", "cluster mode: the cluster whose registry this gateway follows")
    cluster_view_file: str = _key(
        _parse_str, "./var/kvgate/cluster-view.json",
        "cluster mode: where the last view is kept, so that a start while etcd is unreachable serves it")
    # A gateway polls about once a second: a call that takes longer is better made again than waited for.
    cluster_call_timeout: float = _key(parse_duration, 0.5, "cluster mode: bound of each etcd call",
                                       minimum=0.01)
    # An agent's lease outlives a pause of a few seconds (its TTL, 5 s by
    # default); a card is held out only after that many polls more, so one
    # slow keep-alive never costs a card's conversations.
    cluster_sick_polls: int = _key(
        _parse_int, 3, "cluster mode: polls in a row that must find a card not reported alive before this "
        "gateway holds it out of service", minimum=1)

    @property
    def cluster_mode(self) -> bool:
        return bool(self.cluster_etcd_endpoints)

    @property
    def socket_path(self) -> str:
        return self.socket or default_socket_path(self.port)

    def replace(self, **changes: Any) -> "Config":
        return from_mapping({**self.to_mapping(), **changes})

    def to_mapping(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


FIELDS: tuple[Field, ...] = tuple(Field(f.name, **f.metadata["key"]) for f in dataclasses.fields(Config))

FIELDS_BY_NAME = {f.name: f for f in FIELDS}


def default_socket_path(port: int | None = None) -> str:
    """The gateway's Unix socket when the ``socket`` key is not set: ``$XDG_RUNTIME_DIR/kvgate-<port>.sock``
    (``/tmp`` when XDG_RUNTIME_DIR is unset or empty), where port is the TCP ``port``, or its default
    (5557) when the TCP listener is off (0) or no port is given.

    The one rule for the default: the gateway listens here, every CLI command looks here, and every
    engine integration connects here when its config names no socket and no address, so a bare
    ``kvgate serve`` and an engine without a socket setting meet when both see the same
    XDG_RUNTIME_DIR.  Turning the TCP listener off (``--port 0``) must not move the socket
    (it was ``kvgate-0.sock``, where ``kvgate stat`` did not look).
    """
    default = FIELDS_BY_NAME["port"].default
    return os.path.join(os.environ.get("XDG_RUNTIME_DIR") or "/tmp", f"kvgate-{port or default}.sock")


def _check(f: Field, raw: Any) -> Any:
    if raw is None:
        if f.optional:
            return None
        raise ConfigError(f"config key '{f.name}': a value is required")
    try:
        value = f.parse(raw)
    except ValueError as e:
        raise ConfigError(f"config key '{f.name}': {e}") from None
    if f.choices and value not in f.choices:
        raise ConfigError(f"config key '{f.name}': expected one of {', '.join(f.choices)}, got {value!r}")
    shown = size_text if f.parse is parse_size else "{:g}".format
    if f.minimum is not None and value < f.minimum:
        raise ConfigError(f"config key '{f.name}': must be at least {shown(f.minimum)}, got {raw!r}")
    if f.maximum is not None and value > f.maximum:
        raise ConfigError(f"config key '{f.name}': must be at most {shown(f.maximum)}, got {raw!r}")
    return value


def from_mapping(values: Mapping[str, Any]) -> Config:
    """Build a Config from a mapping of raw values (YAML or flags)."""
    unknown = sorted(set(values) - set(FIELDS_BY_NAME))
    if unknown:
        hint = _did_you_mean(unknown[0])
        raise ConfigError(f"unknown config key '{unknown[0]}'{hint}")
    checked = {name: _check(FIELDS_BY_NAME[name], raw) for name, raw in values.items()}
    if checked.get("cluster_etcd_endpoints") and "storage_devices" not in checked:
        checked["storage_devices"] = []  # not the default card: the registry's cards
    cfg = Config(**checked)
    _check_combination(cfg)
    return cfg


def _did_you_mean(name: str) -> str:
    import difflib

    close = difflib.get_close_matches(name, list(FIELDS_BY_NAME), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _check_combination(cfg: Config) -> None:
    if cfg.cluster_mode:
        if cfg.storage_devices:
            raise ConfigError("config key 'storage_devices': in cluster mode (cluster_etcd_endpoints) the cards "
                              "come from the cluster's registry; remove storage_devices")
        if "/" in cfg.cluster_name or not cfg.cluster_name:
            raise ConfigError(f"config key 'cluster_name': a non-empty name without '/', got {cfg.cluster_name!r}")
    elif not cfg.storage_devices:
        raise ConfigError("config key 'storage_devices': at least one card is required")
    if cfg.shared_storage and cfg.start_clean:
        raise ConfigError(
            "config key 'start_clean': refused because shared_storage is true "
            "(other gateways use these cards; nothing was deleted)"
        )
    if cfg.key_layout_fingerprint is not None and not re.fullmatch(r"[0-9a-f]{16}", cfg.key_layout_fingerprint):
        raise ConfigError("config key 'key_layout_fingerprint': expected 16 lowercase hex digits")
    if cfg.max_bytes and cfg.max_bytes < cfg.ram_page_size:
        raise ConfigError(f"config key 'max_bytes': must be 0 or at least ram_page_size "
                          f"({size_text(cfg.ram_page_size)}), got {size_text(cfg.max_bytes)}")
    if (cfg.peer_listen or cfg.peers) and not cfg.peer_token_file:
        key = "peer_listen" if cfg.peer_listen else "peers"
        raise ConfigError(f"config key '{key}': peers read each other's whole cache, so both ends present a "
                          "token: set peer_token_file (the same file, or the same token, on every peer)")
    for key, addresses in (("peer_listen", [cfg.peer_listen] if cfg.peer_listen else []), ("peers", cfg.peers),
                           ("peer_advertise", [cfg.peer_advertise] if cfg.peer_advertise else [])):
        for a in addresses:
            try:
                bare, _port = split_host_port(a)
                why = "" if not any(c in bare for c in ",/ \t[]") else f"host {bare!r} is not a host name or address"
            except ValueError as e:
                why = str(e)
            if why:
                hint = "; give each peer as its own value (--peers A:P B:P, or a YAML list)" if "," in a or " " in a else ""
                raise ConfigError(f"config key '{key}': expected HOST:PORT, got {a!r} ({why}){hint}")
    try:
        peer_tls_server_context(cfg)
        if cfg.peer_tls_ca_file:
            _tls_client_context(cfg.peer_tls_ca_file, "peer_tls_ca_file")
    except ConfigError as e:
        raise ConfigError(f"config key {e}") from None
    if cfg.peer_advertise:
        if not cfg.peer_listen:
            raise ConfigError("config key 'peer_advertise': it says where peers reach this gateway's peer_listen, "
                              "which is unset: set peer_listen too, or remove peer_advertise")
        if is_wildcard(cfg.peer_advertise):
            raise ConfigError(f"config key 'peer_advertise': {cfg.peer_advertise} is a wildcard address, which "
                              "other gateways cannot reach: give this host's address")
    elif cfg.cluster_mode and cfg.peer_listen and is_wildcard(cfg.peer_listen):
        raise ConfigError(f"config key 'peer_advertise': peer_listen {cfg.peer_listen} listens on every address, "
                          "so the registry cannot tell other gateways which one reaches this one: set "
                          "peer_advertise to the HOST:PORT they should pull from")
    socket_bytes = len(os.fsencode(cfg.socket_path))
    if socket_bytes > SOCKET_PATH_MAX:
        raise ConfigError(f"config key 'socket': {cfg.socket_path} is {socket_bytes} bytes long; a Unix socket path "
                          f"has at most {SOCKET_PATH_MAX}: choose a shorter one")


def _readable(path: str, key: str) -> None:
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise ConfigError(f"'{key}': cannot read {path}: {e.strerror}") from None


def peer_tls_server_context(cfg: Config) -> ssl.SSLContext | None:
    """The peer listener's TLS context (TLS 1.2 at least) from ``peer_tls_cert_file`` and
    ``peer_tls_key_file``; None when neither is set.  A ``ConfigError`` naming the key (as ``read_token``:
    ``'key': why``) when one is set without the other, or the files cannot be read or do not make a
    certificate and its key.  Blocking (reads the files): at start, on the main thread."""
    cert, key = cfg.peer_tls_cert_file, cfg.peer_tls_key_file
    if not cert and not key:
        return None
    if not key:
        raise ConfigError("'peer_tls_cert_file': set peer_tls_key_file too (the PEM file of the certificate's "
                          "private key)")
    if not cert:
        raise ConfigError("'peer_tls_key_file': it is the key of peer_tls_cert_file, which is unset: set "
                          "peer_tls_cert_file too, or remove peer_tls_key_file")
    _readable(cert, "peer_tls_cert_file")
    _readable(key, "peer_tls_key_file")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.num_tickets = 0  # no session tickets: nothing unasked arrives on a peer's idle connection (Conn.stale)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=cert)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"'peer_tls_cert_file': {cert} holds no PEM certificate ({_ssl_why(e)})") from None
    try:
        ctx.load_cert_chain(cert, key, password=_no_passphrase)
    except (OSError, ssl.SSLError) as e:
        if getattr(e, "reason", None) == "KEY_VALUES_MISMATCH":
            raise ConfigError(f"'peer_tls_key_file': {key} is not the private key of the certificate in {cert} "
                              "(peer_tls_cert_file)") from None
        raise ConfigError(f"'peer_tls_key_file': {key} holds no PEM private key the gateway can use (one without "
                          f"a passphrase) for the certificate in {cert} ({_ssl_why(e)})") from None
    return ctx


def _no_passphrase() -> bytes:
    return b""  # (asked only for a key with a passphrase: never a prompt on the terminal of a gateway)


def _ssl_why(e: BaseException) -> str:
    """An ``ssl`` error's message without the source line of CPython's ``_ssl.c`` it came from."""
    text = str(e.args[1]) if isinstance(e, OSError) and len(e.args) > 1 else str(e)
    return re.sub(r"\s*\(_ssl\.c:\d+\)$", "", text)


def _tls_client_context(ca_file: str, key: str) -> ssl.SSLContext:
    """A context that trusts the CAs in ``ca_file``; ``ConfigError`` naming ``key`` (``'key': why``)."""
    _readable(ca_file, key)
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"'{key}': cannot load {ca_file} as PEM certificates ({_ssl_why(e)})") from None


WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]")


def is_wildcard(address: str) -> bool:
    """Whether ``address`` (HOST:PORT) listens on every address of its host (not one a peer can dial)."""
    return address.rpartition(":")[0] in WILDCARD_HOSTS


def peer_address(cfg: Config) -> str:
    """Where other gateways pull from this one (``peer_advertise``, else ``peer_listen``); "" without a
    peer listener."""
    if not cfg.peer_listen:
        return ""
    return cfg.peer_advertise or cfg.peer_listen


def load_yaml(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"config file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path}: not valid YAML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path}: not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of keys to values")
    return data


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def default_text(f: Field) -> str | None:
    """A key's default as docs/configuration.md's tables and ``--help`` write it (``1G``, ``10s``,
    ``false``); None when it has none (unset, or derived at start as its help says)."""
    value = f.default
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(value) + "]"
    if f.parse is parse_size:
        for unit, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
            if value and value % (1 << shift) == 0:
                return f"{value >> shift}{unit}"
        return str(value)
    if f.parse is parse_duration:
        return f"{value:g}s"
    return str(value)


# A flag's value that starts with a minus and a digit (`--max-bytes -1G`): argparse takes it for an unknown
# option unless it is a plain number, and prints its usage instead of the key's own message.
_NEGATIVE_VALUE = re.compile(r"^-\.?\d")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config key; flags left out are None and do not override YAML.  A value such as ``-1G``
    given as its own word is the flag's value, for the key's check to refuse by name (no flag of ``parser``
    may look like a negative number)."""
    parser._negative_number_matcher = _NEGATIVE_VALUE  # argparse's own test for "a negative number, not a flag"
    for f in FIELDS:
        shown = default_text(f)
        kwargs: dict[str, Any] = {"dest": f.name, "default": None,
                                  "help": f.help if shown is None else f"{f.help} (default: {shown})"}
        if f.many:
            kwargs["nargs"] = "+"
        if f.metavar:
            kwargs["metavar"] = f.metavar
        elif f.choices:
            kwargs["metavar"] = "{" + ",".join(f.choices) + "}"
        else:
            kwargs["metavar"] = "VALUE"
        parser.add_argument(flag_name(f.name), **kwargs)


def load(config_file: str | None = None, overrides: Mapping[str, Any] | Iterable[tuple[str, Any]] = ()) -> Config:
    """YAML file (if any) with non-None overrides (flags) on top."""
    values: dict[str, Any] = load_yaml(config_file) if config_file else {}
    items = overrides.items() if isinstance(overrides, Mapping) else overrides
    for name, value in items:
        if value is not None:
            values[name] = value
    return from_mapping(values)
