"""The key names of a Redis card, and the cards a Redis Cluster is.

A card's keys are fixed names plus a hash tag: a Redis Cluster primary is a
card like any server once every key of the card hashes to one slot it
serves (``{tag}`` in front of every name).  Which tag that is, and which
primaries a cluster has, is decided here, from nothing but the addresses
and the slot map, so every gateway that asks gets the same cards.  A
location's password never leaves this module in a message (``redact``).
"""

from __future__ import annotations

import errno
import itertools
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
import redis.exceptions as rexc
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from kvgate.cards.base import CardUnavailable

LABEL_KEY = b"kvgate:card-label"
PROBE_KEY = b"kvgate:write-probe"  # outside OBJECT_PREFIX: scans and clean never see it
LEASE_KEY = b"kvgate:card-lease"  # outside OBJECT_PREFIX too
HEADS_KEY = b"kvgate:heads"  # a set of 8-byte shared-head ids; outside OBJECT_PREFIX too
SNAPSHOT_KEY = b"kvgate:index"  # outside OBJECT_PREFIX too
SNAPSHOT_TEMP = b"kvgate:index-tmp:"  # + a writer's uuid; renamed to SNAPSHOT_KEY when whole
OBJECT_PREFIX = b"kvgate:o:"
SCAN_COUNT = 1000  # SCAN COUNT hint, wherever the object keys are walked

TAG_PARAM = "kvgate_tag"  # in a card's URL: the hash tag of its keys (a Redis Cluster primary's card)


class RedisKeys:
    """The key names of one card.

    ``tag``: a Redis Cluster hash tag (``{tag}`` in front of every name) that
    puts every key of the card in one hash slot of one primary, so that a
    primary of a cluster is a card like any server: a cluster registered by
    a seed address is one card per primary (``cluster_cards``).  Empty for a
    server that is not a cluster node: the names are the module's constants.
    """

    __slots__ = ("tag", "label", "probe", "lease", "heads", "snapshot", "snapshot_temp", "objects", "objects_match")

    def __init__(self, tag: str = "") -> None:
        if any(c in tag for c in "{}*?[]\\") or len(tag) > 64:
            raise ValueError(f"{TAG_PARAM} {tag!r}: at most 64 characters, none of {{}}*?[]\\")
        self.tag = tag
        p = b"{%s}" % tag.encode() if tag else b""
        self.label, self.probe, self.lease, self.heads = p + LABEL_KEY, p + PROBE_KEY, p + LEASE_KEY, p + HEADS_KEY
        self.snapshot, self.snapshot_temp = p + SNAPSHOT_KEY, p + SNAPSHOT_TEMP
        self.objects = p + OBJECT_PREFIX
        self.objects_match = self.objects + b"*"


def split_tag(location: str) -> tuple[str, str]:
    """(the URL without ``kvgate_tag``, the tag or ""): redis-py passes unknown URL parameters on to its
    connections, which refuse them."""
    parts = urlsplit(location)
    query = parse_qsl(parts.query, keep_blank_values=True)
    tags = [v for k, v in query if k == TAG_PARAM]
    if not tags:
        return location, ""
    rest = urlencode([(k, v) for k, v in query if k != TAG_PARAM])
    return urlunsplit(parts._replace(query=rest)), tags[-1]


def cluster_cards(seed: str, io_timeout_ms: int = 2000) -> list[str]:
    """The cards a Redis Cluster reached through ``seed`` is: one URL per primary.

    Each has the primary's address in place of the seed's (the seed's
    scheme, credentials and parameters kept) and a ``kvgate_tag`` whose hash
    slot that primary serves, found by trying ``kvgate-0``, ``kvgate-1``,
    ...: the same cluster gives the same cards whoever asks.  A server that
    is not a cluster node is one card: ``[seed]``.  Blocks for a few round
    trips; ``CardUnavailable`` when the seed does not answer.
    """
    url, _ = split_tag(seed)
    timeout = io_timeout_ms / 1000
    r = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                             retry=Retry(NoBackoff(), 0))
    try:
        if not int(r.info("cluster").get("cluster_enabled", 0)):
            return [seed]
        ranges = r.execute_command("CLUSTER SLOTS")
    except (rexc.RedisError, OSError) as exc:
        raise CardUnavailable(errno.ENOTCONN, f"redis cluster seed did not answer: {exc}", redact(seed)) from None
    finally:
        r.close()
    primaries: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for entry in ranges:
        start, end, primary = int(entry[0]), int(entry[1]), entry[2]
        host = as_text(primary[0]) or urlsplit(url).hostname or "127.0.0.1"  # "" means the address asked
        primaries.setdefault((host, int(primary[1])), []).append((start, end))
    cards = []
    parts = urlsplit(url)
    for (host, port), spans in sorted(primaries.items()):
        tag = next(t for t in (f"kvgate-{n}" for n in itertools.count())
                   if any(lo <= key_slot(t.encode()) <= hi for lo, hi in spans))
        netloc = parts.netloc.rpartition("@")[0]
        netloc = (netloc + "@" if netloc else "") + (f"[{host}]" if ":" in host else host) + f":{port}"
        query = urlencode([*parse_qsl(parts.query, keep_blank_values=True), (TAG_PARAM, tag)])
        cards.append(urlunsplit(parts._replace(netloc=netloc, query=query)))
    return cards


def redact(location: str) -> str:
    """The location with any password replaced, for messages and logs."""
    try:
        parts = urlsplit(location)
        if parts.password is None:
            return location
        user = parts.username or ""
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        if parts.port is not None:
            host = f"{host}:{parts.port}"
        return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
    except ValueError:
        return "<unparsable redis location>"


def as_text(v: Any) -> Any:
    """A reply as ``str`` where redis-py gave bytes; anything else as it is."""
    return v.decode() if isinstance(v, bytes) else v
