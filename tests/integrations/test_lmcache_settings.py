"""ObjectKey / CacheEngineKey -> (namespace, key) mappings, adapter_params and connector extra_config
parsing (no LMCache needed)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest

from kvgate.config import default_socket_path
from kvgate.integrations.lmcache.settings import (
    CONNECTOR_KEYS,
    ConfigError,
    connector_plugin_name,
    engine_key_bytes,
    engine_key_namespace,
    key_bytes,
    namespace_for,
    parse_connector_config,
    parse_params,
    split_by_namespace,
)
from tests.helpers import kvgate_env


@dataclass(frozen=True)
class Key:  # the fields of lmcache.v1.distributed.api.ObjectKey
    chunk_hash: bytes
    model_name: str
    kv_rank: int
    object_group_id: int = 0
    cache_salt: str = ""


def test_namespace_and_key():
    k = Key(b"\x01\x02" * 16, "meta-llama/Llama-3-8B", 3, 1)
    assert namespace_for(k) == "lmcache|meta-llama/Llama-3-8B|r3|g1"
    assert key_bytes(k) == b"\x01\x02" * 16
    assert namespace_for(k, "prod-a") == "prod-a|r3|g1"


def test_every_field_but_the_hash_separates_namespaces():
    base = Key(b"h" * 32, "m", 0)
    others = [Key(b"h" * 32, "m2", 0), Key(b"h" * 32, "m", 1), Key(b"h" * 32, "m", 0, 1),
              Key(b"h" * 32, "m", 0, 0, "tenant-a"), Key(b"h" * 32, "m", 0, 0, "tenant-b")]
    names = {namespace_for(k) for k in [base, *others]}
    assert len(names) == 6
    salted = namespace_for(others[3])
    assert "tenant-a" not in salted  # the salt is digested, never sent as is


def printed_under_two_hash_seeds(code: str) -> set[str]:
    """What ``code`` prints in two interpreters with different PYTHONHASHSEEDs (one answer: no Python hash())."""
    return {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env=kvgate_env({"PYTHONHASHSEED": seed})).stdout for seed in ("1", "2")}


@pytest.mark.slow  # starts interpreters
def test_mapping_is_stable_across_processes():
    """No Python hash(): another interpreter with another PYTHONHASHSEED gives the same names."""
    outs = printed_under_two_hash_seeds(
        "from kvgate.integrations.lmcache.settings import namespace_for, key_bytes\n"
        "class K: chunk_hash=b'abc'; model_name='m'; kv_rank=2; object_group_id=0; cache_salt='s'\n"
        "print(namespace_for(K()), key_bytes(K()).hex())")
    assert len(outs) == 1
    k = Key(b"abc", "m", 2, 0, "s")
    assert outs.pop().split() == [namespace_for(k), key_bytes(k).hex()]


def test_long_model_and_hash_fit_the_limits():
    k = Key(b"x" * 5000, "org/" + "m" * 400, 0, 0, "s" * 128)
    ns = namespace_for(k)
    assert len(ns.encode()) <= 255 and ns != namespace_for(Key(b"x", "org/" + "m" * 399 + "n", 0, 0, "s" * 128))
    assert len(key_bytes(k)) <= 1024
    assert key_bytes(k) != key_bytes(Key(b"x" * 4999 + b"y", "m", 0))


def test_int_and_str_hashes():
    assert key_bytes(Key(5, "m", 0)) != key_bytes(Key(-5, "m", 0))
    assert key_bytes(Key("ab", "m", 0)) == b"ab"


def test_split_by_namespace_keeps_order():
    ks = [Key(b"a", "m", 0), Key(b"b", "m", 1), Key(b"c", "m", 0)]
    assert split_by_namespace(ks) == {"lmcache|m|r0|g0": [0, 2], "lmcache|m|r1|g0": [1]}


def test_params():
    s = parse_params({"kvgate.socket": "/tmp/g.sock", "kvgate.io_timeout": "4", "kvgate.retention": "short",
                      "kvgate.load_workers": 2, "kvgate.register_l1": "false"})
    assert s.target == "/tmp/g.sock" and s.tier.io_timeout == 4.0 and s.tier.retention == "short"
    assert s.load_workers == 2 and s.register_l1 is False
    assert parse_params({"kvgate.address": "127.0.0.1:5557"}).register_l1 is True


@pytest.mark.parametrize("params, word", [
    ({"kvgate.socket": "/s", "kvgate.address": "h:1"}, "exactly one"),
    ({"kvgate.socket": "/s", "kvgate.sockets": "/t"}, "kvgate.sockets"),
    ({"kvgate.socket": "/s", "kvgate.io_timeout": 0}, "kvgate.io_timeout"),
    ({"kvgate.socket": "/s", "kvgate.retention": "forever"}, "kvgate.retention"),
    ({"kvgate.socket": "/s", "kvgate.load_workers": 0}, "kvgate.load_workers"),
    ({"kvgate.socket": "/s", "kvgate.register_l1": "maybe"}, "kvgate.register_l1"),
])
def test_bad_params_name_the_key(params, word):
    with pytest.raises(ConfigError, match=word.replace(".", r"\.")):
        parse_params(params)


@dataclass(frozen=True)
class EngineKey:  # the fields of lmcache.utils.CacheEngineKey that name an object
    model_name: str
    world_size: int
    worker_id: int
    chunk_hash: int
    dtype: str = "torch.float16"  # str(torch.float16)
    tags: tuple | None = None


def test_cache_engine_key_mapping_is_deterministic_and_separates_what_lmcache_separates():
    k = EngineKey("org/m", 2, 1, 0x75BCD15)
    assert engine_key_namespace(k) == "lmcache|org/m|w2r1|float16"
    assert engine_key_namespace(k, "prod") == "prod|w2r1|float16"
    assert engine_key_bytes(k) == (0x75BCD15).to_bytes(4, "big", signed=True)
    tagged = EngineKey("org/m", 2, 1, 0x75BCD15, tags=(("user", "a"),))
    assert engine_key_namespace(tagged) == engine_key_namespace(k)  # one namespace per worker
    assert engine_key_bytes(tagged) != engine_key_bytes(k)
    assert b"user" not in engine_key_bytes(tagged) and len(engine_key_bytes(tagged)) == 4 + 2 + 16
    assert engine_key_bytes(EngineKey("org/m", 2, 1, 0x75BCD15, tags=(("user", "b"),))) != engine_key_bytes(tagged)
    for other in (EngineKey("org/n", 2, 1, 0x75BCD15), EngineKey("org/m", 2, 0, 0x75BCD15),
                  EngineKey("org/m", 1, 1, 0x75BCD15), EngineKey("org/m", 2, 1, 0x75BCD15, "torch.bfloat16")):
        assert engine_key_namespace(other) != engine_key_namespace(k), other


@pytest.mark.slow  # starts interpreters
def test_cache_engine_key_mapping_is_stable_across_processes():
    seen = printed_under_two_hash_seeds(
        "from kvgate.integrations.lmcache.settings import engine_key_bytes as b;"
        "from tests.integrations.test_lmcache_settings import EngineKey as K;"
        "print(b(K('org/m', 2, 1, 123, tags=(('user', 'a'),))).hex())")
    assert len(seen) == 1


def test_connector_extra_config():
    extra = {"remote_storage_plugin.kv.module_path": "kvgate.integrations.lmcache",
             "remote_storage_plugin.kv.class_name": "KvgateRemoteConnector",
             "remote_storage_plugin.kv.kvgate.socket": "/tmp/s.sock",
             "remote_storage_plugin.kv.kvgate.retention": "short",
             "remote_storage_plugin.fs.base_path": "/tmp/x", "save_chunk_meta": False}
    name = connector_plugin_name(["fs", "kv"], extra, "KvgateRemoteConnector")
    assert name == "kv"
    s = parse_connector_config(extra, name)
    assert (s.target, s.retention, s.io_timeout) == ("/tmp/s.sock", "short", 10.0)
    with pytest.raises(ConfigError, match="found none"):
        connector_plugin_name(["fs"], extra, "KvgateRemoteConnector")
    with pytest.raises(ConfigError, match=r"remote_storage_plugin\.kv\.kvgate\.load_workers"):
        parse_connector_config({**extra, "remote_storage_plugin.kv.kvgate.load_workers": 2}, "kv")
    with pytest.raises(ConfigError, match="kvgate.io_timeout"):
        parse_connector_config({**extra, "remote_storage_plugin.kv.kvgate.io_timeout": -1}, "kv")
    assert parse_connector_config({}, "kv").target == default_socket_path()  # the gateway's default socket
    assert "kvgate.affinity_chunks" not in CONNECTOR_KEYS and "kvgate.register_l1" not in CONNECTOR_KEYS
