import argparse
import dataclasses
import re

import pytest

from kvgate import config
from kvgate.cli import build_parser
from kvgate.config import ConfigError, default_socket_path, from_mapping, load, parse_duration, parse_size


@pytest.mark.parametrize("text,expected", [
    ("16G", 16 << 30), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000), ("4096", 4096), (4096, 4096),
    ("2m", 2 << 20), ("1k", 1024), ("1kb", 1000), ("1 GiB", 1 << 30),
])
def test_sizes_with_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["lots", "-1", "1X", "", True, "1.2.3G"])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


@pytest.mark.parametrize("text,expected", [("30", 30.0), ("30s", 30.0), ("15m", 900.0), ("2h", 7200.0), ("250ms", 0.25)])
def test_durations(text, expected):
    assert parse_duration(text) == expected


def test_defaults_are_valid_and_derived_values():
    cfg = from_mapping({})
    assert cfg.key_placement == "dialog"
    assert cfg.storage_slots == 1024  # fixed: adding a card moves only its share
    assert cfg.socket_path.endswith("kvgate-5557.sock")
    cfg = from_mapping({"storage_devices": ["/a", "/b", "/c"], "port": 6000})
    assert cfg.socket_path.endswith("kvgate-6000.sock")


def test_the_default_socket_follows_xdg_runtime_dir_and_not_a_tcp_listener_turned_off(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert from_mapping({}).socket_path == f"{tmp_path}/kvgate-5557.sock"
    assert from_mapping({"port": 0}).socket_path == f"{tmp_path}/kvgate-5557.sock"  # was kvgate-0.sock
    assert default_socket_path() == default_socket_path(0) == f"{tmp_path}/kvgate-5557.sock"
    monkeypatch.setenv("XDG_RUNTIME_DIR", "")
    assert default_socket_path(6000) == "/tmp/kvgate-6000.sock"


def test_unknown_key_names_it_and_suggests():
    with pytest.raises(ConfigError, match=r"unknown config key 'max_byte'.*did you mean 'max_bytes'"):
        from_mapping({"max_byte": "1G"})


@pytest.mark.parametrize("key,value,fragment", [
    ("max_bytes", "lots", "'max_bytes'"),
    ("key_placement", "random", "'key_placement': expected one of dialog, stripe"),
    ("num_dbs", 0, "'num_dbs': must be at least 1"),
    ("port", "http", "'port': expected an integer"),
    ("shared_storage", "maybe", "'shared_storage'"),
    ("key_layout_fingerprint", "XYZ", "'key_layout_fingerprint'"),
    ("storage_devices", 5, "'storage_devices'"),
    ("port", 70000, "'port': must be at most 65535"),
    ("metrics_port", "70000", "'metrics_port': must be at most 65535"),
    ("socket", "/tmp/" + "s" * 200 + ".sock", "'socket': /tmp/"),
    ("hello_timeout", "soon", "'hello_timeout'"),
    ("frame_timeout", 0, "'frame_timeout': must be at least"),
])
def test_bad_values_name_the_key(key, value, fragment):
    with pytest.raises(ConfigError) as e:
        from_mapping({key: value})
    assert fragment in str(e.value)
    assert "\n" not in str(e.value)


def test_shared_storage_refuses_start_clean():
    with pytest.raises(ConfigError, match="start_clean.*shared_storage.*nothing was deleted"):
        from_mapping({"shared_storage": True, "start_clean": 1})


def test_yaml_then_flags_override(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("max_bytes: 2G\nnum_dbs: 4\nstorage_devices: [/x, /y]\n")
    cfg = load(str(f), {"num_dbs": "8", "port": None})
    assert cfg.max_bytes == 2 << 30 and cfg.num_dbs == 8 and cfg.storage_devices == ["/x", "/y"]
    assert cfg.port == 5557


def test_yaml_errors(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load(str(f))
    with pytest.raises(ConfigError, match="No such file"):
        load(str(tmp_path / "missing.yaml"))
    f.write_bytes(b"max_bytes: 1G\nsocket: /tmp/caf\xe9.sock\n")  # Latin-1, not UTF-8
    with pytest.raises(ConfigError, match=r"c\.yaml: not UTF-8 text \(byte 30\)"):
        load(str(f))


def test_socket_path_limit_is_the_kernels():
    longest = "/tmp/" + "s" * (config.SOCKET_PATH_MAX - len("/tmp/"))
    assert from_mapping({"socket": longest}).socket_path == longest
    with pytest.raises(ConfigError, match=f"is {config.SOCKET_PATH_MAX + 1} bytes long"):
        from_mapping({"socket": longest + "x"})


def test_every_key_is_a_flag():
    p = argparse.ArgumentParser()
    config.add_flags(p)
    args = p.parse_args(["--max-bytes", "16G", "--storage-devices", "/a", "/b", "--key-placement", "stripe"])
    cfg = load(None, {f.name: getattr(args, f.name) for f in config.FIELDS})
    assert cfg.max_bytes == 16 << 30 and cfg.storage_devices == ["/a", "/b"] and cfg.key_placement == "stripe"
    dests = {a.dest for a in p._actions}
    assert {f.name for f in config.FIELDS} <= dests


def test_yaml_flags_and_the_constructor_share_one_default_per_key():
    # Config's fields are the keys: a field without a key (or a key without a field) fails here.
    assert [f.name for f in config.FIELDS] == [f.name for f in dataclasses.fields(config.Config)]
    assert from_mapping({}) == config.Config() == load(None, {f.name: None for f in config.FIELDS})
    assert config.Config().to_mapping() == {f.name: f.default for f in config.FIELDS}


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split("options:")[1].split())
    for f in config.FIELDS:
        shown = config.default_text(f)
        if shown is None:
            continue
        flag = re.search(rf"{config.flag_name(f.name)} \S+(?: \[\S+ \.\.\.\])? (.*?)(?= --|$)", text)
        assert flag and flag.group(1).endswith(f"(default: {shown})"), (f.name, flag and flag.group(1))
    port = config.FIELDS_BY_NAME["port"].default
    assert build_parser().parse_args(["stat"]).port == port


def test_cluster_mode_takes_no_storage_devices_and_drops_the_default_card() -> None:
    cfg = from_mapping({"cluster_etcd_endpoints": ["127.0.0.1:2379"]})
    assert cfg.cluster_mode and cfg.storage_devices == []
    with pytest.raises(ConfigError, match="storage_devices': in cluster mode .* remove storage_devices"):
        from_mapping({"cluster_etcd_endpoints": ["127.0.0.1:2379"], "storage_devices": ["/cards/a"]})
    with pytest.raises(ConfigError, match="cluster_name': a non-empty name without '/'"):
        from_mapping({"cluster_etcd_endpoints": ["127.0.0.1:2379"], "cluster_name": "a/b"})
    assert not from_mapping({}).cluster_mode


@pytest.mark.parametrize("key,value,message", [
    ("shared_memory_size", "1000", "'shared_memory_size': must be at least 1 MiB, got '1000'"),
    ("ram_page_size", "1K", "'ram_page_size': must be at least 4 KiB, got '1K'"),
    ("max_frame_bytes", 100, "'max_frame_bytes': must be at least 64 KiB, got 100"),
    ("max_bytes", "100K", "'max_bytes': must be 0 or at least ram_page_size (256 KiB), got 100 KiB"),
    ("card_capacity", "1", "'card_capacity': must be at least 4 KiB, got '1'"),
    ("max_bytes", "-1G", "'max_bytes': a size cannot be negative, got '-1G'"),
])
def test_sizes_in_messages_are_in_units(key, value, message):
    with pytest.raises(ConfigError) as e:
        from_mapping({key: value})
    assert str(e.value) == f"config key {message}"


def test_the_smallest_card_capacity_holds_an_object_and_none_is_still_the_default():
    assert from_mapping({"card_capacity": "4K"}).card_capacity == 4096
    assert from_mapping({}).card_capacity is None


@pytest.mark.parametrize("flags", [["--max-bytes", "-1G"], ["--max-bytes=-1G"], ["--card-capacity", "-.5G"]])
def test_a_negative_size_given_as_its_own_word_reaches_the_keys_check(flags, capsys):
    from kvgate.cli import main

    assert main(["fingerprint", "--storage-devices", "/nowhere", *flags]) == 2
    err = capsys.readouterr().err
    assert "a size cannot be negative" in err and "usage:" not in err, err


def test_peer_advertise_is_where_a_cluster_pulls_from_and_required_behind_a_wildcard_listen():
    peer = {"peer_token_file": "/t", "cluster_etcd_endpoints": ["127.0.0.1:2379"]}
    assert config.peer_address(from_mapping({**peer, "peer_listen": "10.0.0.1:5600"})) == "10.0.0.1:5600"
    assert config.peer_address(from_mapping({"storage_devices": ["/d"]})) == ""
    for wildcard in ("0.0.0.0:5600", ":::5600", "[::]:5600"):
        with pytest.raises(ConfigError, match="config key 'peer_advertise'.*every address"):
            from_mapping({**peer, "peer_listen": wildcard})
        cfg = from_mapping({**peer, "peer_listen": wildcard, "peer_advertise": "10.0.0.1:5600"})
        assert config.peer_address(cfg) == "10.0.0.1:5600"
    from_mapping({"storage_devices": ["/d"], "peer_token_file": "/t", "peer_listen": "0.0.0.0:5600"})  # no cluster
    for bad, named in (({"peer_advertise": "10.0.0.1"}, "HOST:PORT"),
                       ({"peer_advertise": "0.0.0.0:5600"}, "wildcard"),
                       ({"peer_listen": None, "peer_advertise": "10.0.0.1:5600"}, "peer_listen")):
        with pytest.raises(ConfigError, match=f"config key 'peer_advertise'.*{named}"):
            from_mapping({**peer, "peer_listen": "0.0.0.0:5600", **bad})


def test_peer_addresses_are_one_host_port_each():
    """A comma list given as one value (the flag takes each peer as its own value) is refused at start,
    naming the fix, never handed on to a peer's connection as an address."""
    base = {"storage_devices": ["/d"], "peer_token_file": "/t"}
    for bad, hint in ((["10.0.0.1:5600,10.0.0.2:5600"], "its own value"), (["a b:5600"], "its own value"),
                      (["10.0.0.1:0"], "'10.0.0.1:0'"), (["[]:5600"], "'\\[\\]:5600'"), (["h/x:1"], "'h/x:1'")):
        with pytest.raises(ConfigError, match=f"config key 'peers': expected HOST:PORT, got .*{hint}"):
            from_mapping({**base, "peers": bad})
    assert from_mapping({**base, "peers": ["[::1]:5600", "host-b:5600"]}).peers == ["[::1]:5600", "host-b:5600"]
