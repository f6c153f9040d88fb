"""What the repository ships for running kvgate: the Grafana board queries only metrics a gateway exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from kvgate.cluster.registry import View
from tests.cluster.common import ETCD, EtcdServer, labelled_card
from tests.cluster.test_gateway_cluster import _publish
from tests.helpers import GatewayProcess, free_port, wait_until

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
BOARD = DEPLOY / "grafana" / "kvgate.json"
METRIC = re.compile(r"\bkvgate_[a-z0-9_]+")


def _board() -> dict:
    return json.loads(BOARD.read_text())


def _panels(board: dict) -> list[dict]:
    return [p for p in board["panels"] if p["type"] != "row"]


def test_the_board_is_a_dashboard_grafana_can_provision() -> None:
    board = _board()
    assert board["uid"] == "kvgate" and board["title"] == "kvgate"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for p in _panels(board):
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"]), p["title"]
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert all('instance=~"$instance"' in t["expr"] for t in p["targets"]), f"{p['title']}: per gateway"
    names = {v["name"] for v in board["templating"]["list"]}
    assert names == {"datasource", "instance"}
    provider = yaml.safe_load((DEPLOY / "grafana" / "dashboards.yaml").read_text())
    assert provider["apiVersion"] == 1 and provider["providers"][0]["type"] == "file"


@pytest.mark.slow
@pytest.mark.skipif(ETCD is None, reason="needs etcd (make test installs it)")
def test_every_metric_the_board_queries_is_one_a_gateway_exports(tmp_path: Path) -> None:
    """A gateway in cluster mode (so the cluster panels have their series) that served a few requests."""
    wanted = {m for p in _panels(_board()) for t in p["targets"] for m in METRIC.findall(t["expr"])}
    assert {"kvgate_hits_total", "kvgate_request_seconds_bucket", "kvgate_cluster_view_epoch"} <= wanted
    etcd = EtcdServer(tmp_path / "etcd").start()
    card = labelled_card(tmp_path / "card")
    mport = free_port()
    gw = GatewayProcess(tmp_path / "gw", ["--cluster-etcd-endpoints", etcd.endpoint, "--cluster-name", "t",
                                          "--cluster-view-file", str(tmp_path / "view.json"), "--storage-slots", "64",
                                          "--max-bytes", "16M", "--metrics-port", str(mport)])
    try:
        _publish(etcd, View.of(1, [card], 64))
        gw.start()
        wait_until(lambda: gw.stats()["cards"], 10, gw.log)
        with gw.client("board|ns") as c:
            assert all(c.put_many([b"a", b"b"], [b"x" * 5000] * 2))
            c.get_many([b"a", b"missing"])
            c.lookup([b"a", b"b"])
        text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5).read().decode()
    finally:
        gw.stop()
        etcd.stop()
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    missing = sorted(wanted - exported)
    assert not missing, f"the board queries metrics no gateway exports: {missing}"


def test_the_example_config_is_one_a_gateway_takes() -> None:
    from kvgate.config import load

    cfg = load(str(DEPLOY / "systemd" / "kvgate.yaml"))
    assert cfg.socket_path == "/run/kvgate/kvgate.sock" and cfg.storage_devices == ["/var/lib/kvgate/card0"]
    assert cfg.read_priority == "realtime" and cfg.max_bytes == 16 << 30


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_the_systemd_unit_verifies_and_runs_as_its_own_user_with_realtime_reads(tmp_path: Path) -> None:
    unit = (DEPLOY / "systemd" / "kvgate.service").read_text()
    settings = dict(line.split("=", 1) for line in unit.splitlines() if "=" in line and not line.startswith("#"))
    assert settings["Type"] == "notify" and settings["User"] == "kvgate" and settings["LimitRTPRIO"] == "1"
    assert settings["NoNewPrivileges"] == "true" and settings["ProtectSystem"] == "strict"
    assert "/dev/shm" in settings["ReadWritePaths"], "the engine's shared memory"
    assert settings["ExecReload"] == "/bin/kill -HUP $MAINPID" and settings["Restart"] == "on-failure"
    # verify checks that ExecStart's program exists: point it at this checkout's kvgate.
    kvgate = Path(sys.executable).with_name("kvgate")
    here = tmp_path / "kvgate.service"
    here.write_text(unit.replace("/usr/local/bin/kvgate", str(kvgate)))
    r = subprocess.run(["systemd-analyze", "verify", str(here)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr


MANIFESTS = sorted((DEPLOY / "kubernetes").rglob("*.yaml"))


def _resources() -> list[tuple[str, dict]]:
    return [(p.relative_to(DEPLOY).as_posix(), doc) for p in MANIFESTS for doc in yaml.safe_load_all(p.read_text())
            if doc and doc.get("kind") != "Kustomization"]


def test_every_kubernetes_manifest_validates_against_the_schemas_strictly() -> None:
    import kubernetes_validate

    resources = _resources()
    assert {doc["kind"] for _, doc in resources} >= {"DaemonSet", "Deployment", "ConfigMap", "Secret", "Service"}
    for where, doc in resources:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)  # raises, naming it
    kustomization = yaml.safe_load((DEPLOY / "kubernetes" / "kustomization.yaml").read_text())
    listed = {DEPLOY / "kubernetes" / r for r in kustomization["resources"]}
    assert listed == {p for p in MANIFESTS if p.parent.name == "kubernetes" and p.name != "kustomization.yaml"}


def test_the_manifests_configs_are_ones_a_gateway_takes_and_the_pods_share_what_it_needs() -> None:
    from kvgate.config import from_mapping

    for where, doc in _resources():
        if doc["kind"] == "ConfigMap":
            cfg = from_mapping(yaml.safe_load(doc["data"]["kvgate.yaml"]))
            assert cfg.socket_path == "/run/kvgate/kvgate.sock" and cfg.read_priority == "realtime", where
        if doc["kind"] in ("DaemonSet", "Deployment"):
            spec = doc["spec"]["template"]["spec"]
            (gw,) = [c for c in spec["containers"] if c["name"] == "kvgate"]
            assert gw["securityContext"]["capabilities"]["add"] == ["SYS_NICE"], where
            assert gw["readinessProbe"]["httpGet"]["path"] == "/healthz", where
            mounts = {m["mountPath"] for m in gw["volumeMounts"]}
            assert {"/dev/shm", "/run/kvgate", "/var/lib/kvgate/cards"} <= mounts, where
            for other in spec["containers"]:  # an engine beside it shares the socket and the shared memory
                if other is not gw:
                    assert {"/dev/shm", "/run/kvgate"} <= {m["mountPath"] for m in other["volumeMounts"]}, where
                    # and the PID namespace, so its memory is used in place (kvgate.gateway.shm)
                    assert spec.get("shareProcessNamespace") is True, where


def _engine_up(engine: str) -> bool:
    try:
        return subprocess.run([engine, "info"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.slow
def test_the_container_image_builds_where_a_container_engine_runs(tmp_path: Path) -> None:
    text = (DEPLOY / "container" / "Containerfile").read_text()
    assert 'ENTRYPOINT ["kvgate", "serve"]' in text and "USER 10001" in text, "runs the gateway, not as root"
    engine = next((e for e in ("podman", "docker") if shutil.which(e) and _engine_up(e)), None)
    if engine is None:
        pytest.skip("no container engine runs here (podman or a docker daemon): the image is not built")
    root = DEPLOY.parent
    r = subprocess.run([engine, "build", "-f", str(DEPLOY / "container" / "Containerfile"), "-t", "kvgate:test",
                        str(root)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([engine, "run", "--rm", "kvgate:test", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "storage-devices" in r.stdout
