"""The SGLang backend's pure parts (no SGLang needed): extra-config keys, namespaces, page keys."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvgate.integrations.sglang.settings import (
    EXTRA_CONFIG_KEYS,
    ConfigError,
    NamespaceInputs,
    derive_namespace,
    page_key,
    pool_page_key,
    pool_tag,
    settings_from_extra,
)
from kvgate.integrations.vllm.settings import EXTRA_CONFIG_KEYS as VLLM_KEYS


def config(**over):
    base = dict(tp_rank=1, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                model_name="meta-llama/Llama-3.1-8B", dcp_rank=0, dcp_size=1, should_split_heads=False)
    base.update(over)
    return SimpleNamespace(**base)


def ns(cfg=None, **geometry) -> str:
    g = dict(page_size=16, layout="layer_first", dtype="torch.bfloat16", page_bytes=1 << 20, fragments=64)
    g.update(geometry)
    return derive_namespace(NamespaceInputs.build(cfg or config(), **g))[0]


def test_the_keys_are_the_vllm_tiers_where_they_mean_the_same():
    assert set(EXTRA_CONFIG_KEYS) <= set(VLLM_KEYS)
    assert EXTRA_CONFIG_KEYS == {k: VLLM_KEYS[k] for k in EXTRA_CONFIG_KEYS}


def test_extra_config_is_parsed_like_the_vllm_tier():
    s = settings_from_extra({"backend_name": "kvgate", "interface_v1": 1, "kvgate.socket": "/run/k.sock",
                             "kvgate.affinity_chunks": "3", "kvgate.io_timeout": "0.5", "kvgate.retention": "SHORT"})
    assert (s.target, s.affinity_chunks, s.io_timeout, s.retention) == ("/run/k.sock", 3, 0.5, "short")
    assert settings_from_extra({"kvgate.address": "10.0.0.1:5557"}).target == "10.0.0.1:5557"
    assert settings_from_extra({"kvgate.socket": "/s", "kvgate.affinity_chunks": "auto"}).affinity_chunks is None


def test_without_a_socket_or_address_the_backend_uses_the_gateways_default_socket(monkeypatch, tmp_path):
    from kvgate.config import default_socket_path

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    for extra in ({}, {"backend_name": "kvgate"}):
        assert settings_from_extra(extra).target == default_socket_path() == f"{tmp_path}/kvgate-5557.sock"


@pytest.mark.parametrize("extra, names", [
    ({"kvgate.socket": "/s", "kvgate.address": "h:1"}, "kvgate.socket"),
    ({"kvgate.sokcet": "/s"}, "kvgate.sokcet"),
    ({"kvgate.socket": "/s", "kvgate.io_timeout_ms": 500}, "kvgate.io_timeout (seconds"),
    ({"kvgate.socket": "/s", "kvgate.affinity_chunks": 0}, "kvgate.affinity_chunks"),
    ({"kvgate.socket": "/s", "kvgate.io_timeout": -1}, "kvgate.io_timeout"),
    ({"kvgate.socket": "/s", "kvgate.retention": "forever"}, "kvgate.retention"),
    ({"kvgate.address": "nohost"}, "kvgate.address"),
])
def test_a_wrong_key_is_an_error_naming_it(extra, names):
    with pytest.raises(ConfigError, match=names.replace("(", r"\(")):
        settings_from_extra(extra)


@pytest.mark.parametrize("key", ["kvgate.skip_unsalted", "kvgate.refuse_unsalted"])
def test_salt_switches_are_refused_because_sglang_hides_the_salt(key):
    with pytest.raises(ConfigError, match=f"{key}: not supported with SGLang.*cache_salt.*remove the key"):
        settings_from_extra({"kvgate.socket": "/s", key: True})


def test_namespace_separates_what_changes_the_bytes_and_nothing_else():
    base = ns()
    assert base.startswith("sglang|meta-llama/Llama-3.1-8B|tp1of2|p16|bfloat16|")
    assert len(base.encode()) < 255
    assert ns() == base  # replicas of one model share it
    for other in (ns(config(tp_rank=0)), ns(config(tp_size=4)), ns(config(pp_rank=1, pp_size=2)),
                  ns(config(model_name="other")), ns(page_size=32), ns(layout="page_first"),
                  ns(dtype="torch.float16"), ns(page_bytes=2 << 20), ns(config(attn_cp_size=2))):
        assert other != base


def test_mla_models_share_one_namespace_across_tp_ranks():
    a = ns(config(is_mla_model=True, tp_rank=0))
    b = ns(config(is_mla_model=True, tp_rank=1, tp_size=2))
    assert a == b and "|mla|" in a


def test_a_long_model_path_keeps_the_namespace_short():
    name = ns(config(model_name="/models/" + "x" * 400))
    assert len(name.encode()) < 255 and "..." in name


def test_page_keys_are_compact_and_never_collide_across_forms():
    h = "ab" * 32
    assert page_key(h) == bytes.fromhex(h)
    assert page_key("g" * 64) == b"s" + b"g" * 64
    assert page_key("x" * 31) == b"s" + b"x" * 31 + b"\x00"  # 32 bytes would look like a hash: padded
    assert {len(page_key(k)) for k in ("", "a", "x" * 31, "y" * 100)}.isdisjoint({32})


def test_extra_pool_keys_never_shadow_kv_pages_and_follow_the_pool_geometry():
    geometry = {"class": "MambaPoolHost", "page_size": 1, "sizes": [2048, 384], "layout": "page_first",
                "dtype": "bfloat16", "tp": "0/1"}
    mamba = pool_tag("mamba", geometry)
    assert mamba.startswith(b"\x00mamba\x00") and mamba == pool_tag("mamba", dict(geometry))
    assert pool_tag("mamba", {**geometry, "dtype": "float32"}) != mamba  # another state dtype: other objects
    assert pool_tag("mamba", {**geometry, "tp": "1/2"}) != mamba
    assert pool_tag("swa", geometry) != mamba
    kv_keys = [page_key(k) for k in ("ab" * 32, "00" * 32, "", "x" * 31, "y" * 100)]
    for k in kv_keys:
        pk = pool_page_key(mamba, k)
        assert pk.startswith(mamba) and pk not in kv_keys and len(pk) != 32
    # Padded when the result would be 32 bytes long (the raw form of a KV page key).
    short = pool_tag("s", {})
    assert len(pool_page_key(short, b"s" + b"z" * (31 - len(short)))) == 33

