"""The vLLM integration's pure parts (no vLLM needed): config keys, namespaces, marks, key stability."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from kvgate.config import default_socket_path
from kvgate.integrations.vllm.settings import (
    ConfigError,
    NamespaceInputs,
    TierSettings,
    chunk_runs,
    derive_namespace,
    dialog_mark,
    first_chunk_keys,
    key_stability,
    model_identity,
    request_retention,
    request_source,
    tier_config_from_extra,
)


def inputs(**over) -> NamespaceInputs:
    base = dict(model="meta-llama/Llama-3.1-8B", revision=None, dtype="bfloat16", platform="cuda",
                kv_cache_layout="NHD", canonical_layout=False, replicated_layout=False, tokens_per_hash=16,
                blocks_per_chunk=1, worker_kv_bytes_per_block=131072, chunk_bytes=131072, tp_size=1, pp_size=1,
                pcp_size=1, dcp_size=1, world_size=1,
                groups=[{"group_id": 0, "tokens_per_block": 16, "layers": ["l0", "l1"]}])
    base.update(over)
    return NamespaceInputs(**base)


def test_extra_config_becomes_a_tier_entry():
    extra = {"cpu_bytes_to_use": 1, "kvgate.socket": "/run/k.sock", "kvgate.affinity_chunks": 2}
    assert tier_config_from_extra(extra) == {"type": "KvgateTier", "module_path": "kvgate.integrations.vllm",
                                             "socket": "/run/k.sock", "affinity_chunks": 2}
    assert tier_config_from_extra({"cpu_bytes_to_use": 1}) is None


def test_unknown_kvgate_key_is_an_error_naming_it():
    with pytest.raises(ConfigError, match="kvgate.sokcet"):
        tier_config_from_extra({"kvgate.sokcet": "/x"})


def test_settings_validation():
    s = TierSettings.build(socket="/run/k.sock")
    assert s.target == "/run/k.sock" and s.affinity_chunks is None and s.retention == "long" and not s.salted_only
    assert TierSettings.build(address="10.0.0.1:5557", skip_unsalted="true").salted_only
    assert TierSettings.build().target == default_socket_path()  # neither: the gateway's default socket
    with pytest.raises(ConfigError, match="exactly one"):
        TierSettings.build(socket="/a", address="b:1")
    with pytest.raises(ConfigError, match="kvgate.address"):
        TierSettings.build(address="nohost")
    with pytest.raises(ConfigError, match="kvgate.affinity_chunks"):
        TierSettings.build(socket="/a", affinity_chunks=0)
    assert TierSettings.build(socket="/a", affinity_chunks="auto").affinity_chunks is None
    assert TierSettings.build(socket="/a", affinity_chunks="3").affinity_chunks == 3
    with pytest.raises(ConfigError, match="kvgate.retention"):
        TierSettings.build(socket="/a", retention="forever")
    with pytest.raises(ConfigError, match="kvgate.refuse_unsalted"):
        TierSettings.build(socket="/a", refuse_unsalted="maybe")
    with pytest.raises(ConfigError, match="kvgate.lookup_timeout"):
        TierSettings.build(socket="/a", lookup_timeout=0)


def test_token_file(tmp_path):
    f = tmp_path / "token"
    f.write_text("s3cret\n")
    assert TierSettings.build(address="h:1", token_file=str(f)).token == "s3cret"
    with pytest.raises(ConfigError, match="kvgate.token_file"):
        TierSettings.build(address="h:1", token_file=str(tmp_path / "missing"))


def test_request_retention():
    assert request_retention(None, "long") == ("long", None)
    assert request_retention({"kvgate_retention": "none"}, "long") == ("none", None)
    assert request_retention({"kvgate_retention": "SHORT"}, "long") == ("short", None)
    value, warning = request_retention({"kvgate_retention": 3}, "long")
    assert value == "long" and "kvgate_retention" in warning


def test_request_source():
    """llm-d's (and kvgate router's) kv_transfer_params.remote_kv_source as the gateway's source: HOST:PORT."""
    src = {"kv_request_id": "req-1", "remote_host": "10.0.0.7", "remote_port": 8200}
    assert request_source({"remote_kv_source": src}) == ("10.0.0.7:8200", None)
    assert request_source({"remote_kv_source": {**src, "remote_host": "::1"}}) == ("[::1]:8200", None)
    assert request_source({"remote_kv_source": {**src, "remote_port": "8200"}}) == ("10.0.0.7:8200", None)
    assert request_source({"remote_kv_source": {"remote_host": "gw-a"}}) == ("gw-a", None)
    assert request_source(None) == (None, None) and request_source({"kvgate_retention": "long"}) == (None, None)
    for bad in ("10.0.0.7:8200", {"remote_port": 1}, {**src, "remote_port": 0}, {**src, "remote_port": True},
                {**src, "remote_host": ""}, {**src, "remote_host": 7}, {**src, "remote_host": "h" * 256}):
        value, warning = request_source({"remote_kv_source": bad})
        assert value is None and "remote_kv_source" in warning, bad


def test_namespace_changes_with_every_input_and_fits():
    ns, desc = derive_namespace(inputs())
    assert ns.startswith("vllm|meta-llama/Llama-3.1-8B|") and len(ns.encode()) <= 255
    assert "bfloat16" in desc
    for change in (dict(model="other"), dict(revision="abc"), dict(dtype="float16"), dict(tp_size=2),
                   dict(pp_size=2), dict(blocks_per_chunk=4), dict(kv_cache_layout="HND"), dict(platform="cpu"),
                   dict(worker_kv_bytes_per_block=65536),
                   dict(groups=[{"group_id": 0, "tokens_per_block": 32, "layers": ["l0", "l1"]}])):
        assert derive_namespace(inputs(**change))[0] != ns, change
    assert derive_namespace(inputs())[0] == ns
    long_ns, _ = derive_namespace(inputs(model="/very/long/" + "x" * 400))
    assert len(long_ns.encode()) <= 255


def _model_dir(path, config: dict, weights: dict[str, bytes]):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    for name, data in weights.items():
        (path / name).write_bytes(data)
    return path


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256}


def _namespace(model_path) -> str:
    model, content = model_identity(str(model_path))
    return derive_namespace(inputs(model=model, model_content=content))[0]


def test_one_model_at_two_paths_shares_a_namespace_and_two_models_do_not(tmp_path):
    # Replicas mount one model at different paths (a copy, a symlink, a hub cache of symlinks to
    # blobs): the namespace must not contain where it is, only what it is.
    rng = random.Random(0)
    weights = {"model-00001-of-00002.safetensors": rng.randbytes(300_000), "model-00002-of-00002.safetensors":
               rng.randbytes(70_000), "model.safetensors.index.json": b'{"weight_map": {}}'}
    a = _model_dir(tmp_path / "mnt-a" / "llama", LLAMA, weights)
    b = tmp_path / "models" / "Llama-copy"
    shutil.copytree(a, b)
    link = tmp_path / "link-to-a"
    link.symlink_to(a)
    blobs = tmp_path / "hub" / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    for f in a.iterdir():  # the Hugging Face cache: each file a symlink to its blob
        (blobs / f.name).symlink_to(f)
    ns = _namespace(a)
    assert ns.startswith("vllm|LlamaForCausalLM|") and str(tmp_path) not in ns
    assert _namespace(b) == _namespace(str(link) + "/") == _namespace(blobs) == ns

    # Not shared: another config, a fine-tune (same names and sizes, other weights), another file set.
    other_config = _model_dir(tmp_path / "wider", {**LLAMA, "hidden_size": 512}, weights)
    tuned = {**weights, "model-00002-of-00002.safetensors": rng.randbytes(70_000)}
    fine_tune = _model_dir(tmp_path / "tuned", LLAMA, tuned)
    fewer = _model_dir(tmp_path / "fewer", LLAMA, {"model.safetensors": weights["model-00001-of-00002.safetensors"]})
    others = {_namespace(p) for p in (other_config, fine_tune, fewer)}
    assert len(others) == 3 and ns not in others

    # A hub id is its own name (its revision is an input of its own); a missing path likewise.
    assert model_identity("meta-llama/Llama-3.1-8B") == ("meta-llama/Llama-3.1-8B", None)


def test_dialog_mark_and_first_keys():
    keys = [(b"k2", 256), (b"k0", 0 + 128), (b"k1", 384)]
    assert first_chunk_keys(keys, 1) == [b"k0"]
    assert first_chunk_keys(keys, 2) == [b"k0", b"k2"]
    assert dialog_mark([]) is None
    m = dialog_mark([b"k0"])
    assert len(m) == 16 and m == dialog_mark([b"k0"]) and m != dialog_mark([b"k0", b"k2"])


def test_chunk_runs():
    assert chunk_runs([]) == []
    assert chunk_runs([3, 4, 5]) == [(0, 3, 3)]
    assert chunk_runs([0, 1, 5, 6, -1, -1, 9]) == [(0, 2, 0), (2, 4, 5), (4, 6, -1), (6, 7, 9)]


def test_key_stability():
    assert key_stability("sha256", {}).stable
    assert key_stability("sha256_cbor", {}).stable
    unstable = key_stability("xxhash", {})
    assert not unstable.stable and "PYTHONHASHSEED" in unstable.message
    seeded = key_stability("xxhash", {"PYTHONHASHSEED": "0"})
    assert seeded.stable and "'0'" in seeded.message
