"""Router settings (flags and YAML) and ``kvgate router``'s command line: what is accepted, and one line
naming the key for what is not; Ctrl-C/SIGTERM stop a running router cleanly."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from kvgate.cli.main import main
from kvgate.errors import ConfigError
from kvgate.routing.settings import EndpointSpec, build, load


def test_yaml_with_flags_on_top(tmp_path):
    f = tmp_path / "router.yaml"
    f.write_text("policy: least-loaded\nblock_size: 32\nhash_seed: 7\nendpoints:\n"
                 "  - http://10.0.0.1:8000\n"
                 "  - url: http://10.0.0.2:8000/\n    events: tcp://10.0.0.2:5557\n"
                 "    gateway_events: tcp://10.0.0.2:5570\n    gateway_replay: tcp://10.0.0.2:5571\n"
                 "    block_size: 32\n    hash_algo: sha256_cbor\n")
    s = load(str(f), {"port": 9000, "policy": None, "endpoints": None})
    assert (s.policy, s.block_size, s.hash_seed, s.port) == ("least-loaded", 32, "7", 9000)
    assert s.endpoints == (EndpointSpec("http://10.0.0.1:8000"),
                           EndpointSpec("http://10.0.0.2:8000", events="tcp://10.0.0.2:5557",
                                        gateway_events="tcp://10.0.0.2:5570", gateway_replay="tcp://10.0.0.2:5571",
                                        block_size=32, hash_algo="sha256_cbor"))
    s = load(str(f), {"endpoints": ["http://e:1"], "policy": "round-robin"})
    assert s.endpoints == (EndpointSpec("http://e:1"),) and s.policy == "round-robin"


@pytest.mark.parametrize("values, named", [
    ({}, "endpoints: none given"),
    ({"endpoints": ["10.0.0.1:8000"]}, "not an http(s) URL"),
    ({"endpoints": ["http://e:1/v1"]}, "has a path (/v1)"),
    ({"endpoints": ["http://e:1", "http://e:1"]}, "http://e:1 given more than once"),
    ({"endpoints": ["http://e:1"], "policy": "random"}, "policy: 'random' is not a policy"),
    ({"endpoints": ["http://e:1"], "block_size": 0}, "block_size: the block size"),
    ({"endpoints": ["http://e:1"], "hash_algo": "md5"}, "hash_algo: 'md5'"),
    ({"endpoints": ["http://e:1"], "port": 70000}, "port: a TCP port"),
    ({"endpoints": ["http://e:1"], "poll_interval": 0}, "poll_interval: a number of seconds > 0"),
    ({"endpoints": ["http://e:1"], "colour": "red"}, "unknown router key(s) colour"),
    ({"endpoints": [{"url": "http://e:1", "evnts": "tcp://x:1"}]}, "endpoints[0]: unknown key(s) evnts"),
    ({"endpoints": [{"url": "http://e:1", "events": "x:1"}]}, "endpoints[0].events: a ZMQ endpoint"),
    ({"endpoints": [{"url": "http://e:1", "events_replay": "tcp://x:1"}]}, "events_replay goes with"),
    ({"endpoints": [{"url": "http://e:1", "hash_algo": "md5"}]}, "endpoints[0].hash_algo"),
])
def test_bad_settings_name_the_key(values, named):
    with pytest.raises(ConfigError) as e:
        build(values)
    assert named in str(e.value)


def test_bad_yaml_file(tmp_path):
    with pytest.raises(ConfigError, match="missing.yaml: No such file"):
        load(str(tmp_path / "missing.yaml"), {})
    (tmp_path / "list.yaml").write_text("- a\n")
    with pytest.raises(ConfigError, match="list.yaml: expected a mapping of keys to values"):
        load(str(tmp_path / "list.yaml"), {})
    (tmp_path / "bad.yaml").write_text("a: [\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load(str(tmp_path / "bad.yaml"), {})


def test_cli_errors_are_one_line_and_exit_2(capsys):
    assert main(["router", "--endpoint", "http://e:1", "--block-size", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvgate router: block_size:") and err.count("\n") == 1
    # xxhash without a seed: vLLM seeds it randomly per process; refused before serving
    assert main(["router", "--endpoint", "http://127.0.0.1:9", "--hash-algo", "xxhash", "--port", "0",
                 "--host", "127.0.0.1"]) == 2
    assert "PYTHONHASHSEED" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["router", "--policy", "random"])


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_router_cleanly(sig):
    # an endpoint nobody serves: the router starts anyway (its /health says 503) and stops on the signal
    p = subprocess.Popen([sys.executable, "-m", "kvgate", "router", "--endpoint", "http://127.0.0.1:9",
                          "--host", "127.0.0.1", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        line = p.stdout.readline()
        assert "serving on 127.0.0.1:" in line and "0 of 1 endpoints routable" in line, line + p.stderr.read()
        p.send_signal(sig)
        assert p.wait(20) == 0
        assert "Traceback" not in p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def test_cost_weights_come_from_the_config_and_bad_ones_are_named() -> None:
    from kvgate.routing.front import Router
    from kvgate.routing.score import DEFAULT_LOAD_COSTS

    s = build({"endpoints": ["http://e:1"], "tier_costs": {"storage": 1}, "load_costs": {"prefill_ahead": 0.5}})
    assert dict(s.tier_costs) == {"gpu": 0.0, "cpu": 0.1, "storage": 1.0}
    assert dict(s.load_costs) == {**DEFAULT_LOAD_COSTS, "prefill_ahead": 0.5}
    r = Router(s)
    assert r.policy.scorer.tier_costs["storage"] == 1.0 and r.scoring is r.policy
    assert Router(build({"endpoints": ["http://e:1"], "policy": "round-robin", "tier_costs": {"cpu": 2}})
                  ).scoring.scorer.tier_costs["cpu"] == 2.0  # /v1/score weighs as configured too
    for bad, match in [({"tier_costs": {"ssd": 1}}, "tier_costs: unknown key 'ssd'"),
                       ({"load_costs": {"waiting": -1}}, "load_costs\\['waiting'\\] must be a number >= 0"),
                       ({"load_costs": {"waiting": "lots"}}, "must be a number"),
                       ({"tier_costs": [1, 2]}, "tier_costs: a map of gpu, cpu, storage")]:
        with pytest.raises(ConfigError, match=match):
            build({"endpoints": ["http://e:1"], **bad})
