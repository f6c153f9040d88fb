"""A configured card directory that does not exist is waited for, never created.

An unmounted mount point's parent is the root filesystem: a gateway that
created the missing directory would fill it.  Only the embedded default
(``./var/kvgate/card0``, no ``storage_devices`` configured) is created, and
``create_card_dirs: true`` allows it for every card.
"""

from __future__ import annotations

import time

from kvgate.cards.directory.layout import LABEL_NAME
from tests.helpers import GatewayProcess, wait_until


def wait_active(gw: GatewayProcess, timeout: float = 20.0) -> dict:
    def all_active() -> dict | None:
        st = gw.stats()
        return st if st["cards"] and all(c["active"] for c in st["cards"]) else None

    return wait_until(all_active, timeout, lambda: f"no active card: {gw.stats()['cards']}\n{gw.log()}")


def test_a_missing_configured_card_directory_is_not_created_and_taken_once_it_exists(gateway_factory,
                                                                                      tmp_path) -> None:
    card = tmp_path / "mnt" / "nvme0" / "kv"
    gw = gateway_factory(["--storage-devices", str(card)], name="waits", create_cards=False)
    time.sleep(1.5)  # the point: a few pending retries pass, and none creates the directory
    assert not card.exists() and not card.parent.exists(), "the gateway created a configured card directory"
    warning = next((ln for ln in gw.log().splitlines() if str(card) in ln and "WARNING" in ln), None)
    assert warning is not None, gw.log()
    assert "does not exist" in warning and "create the directory or mount its filesystem" in warning, warning
    assert not any(c["active"] for c in gw.stats()["cards"])
    # Created now (as an operator would, or as a mount would bring it): taken, labelled, used.
    card.mkdir(parents=True)
    st = wait_active(gw)
    assert len(st["cards"]) == 1 and (card / LABEL_NAME).exists()
    with gw.client("ns") as c:
        assert c.put_many([b"k"], [b"v"], retention="long") == [True]
    assert gw.stats()["cards"][0]["objects"] == 1
    assert any(card.glob("db*/*/*")), "no object file on the card"


def test_create_card_dirs_creates_a_missing_configured_card(gateway_factory, tmp_path) -> None:
    card = tmp_path / "made" / "kv"
    gw = gateway_factory(["--storage-devices", str(card), "--create-card-dirs", "true"], name="makes",
                         create_cards=False)
    st = wait_active(gw, timeout=5)
    assert len(st["cards"]) == 1 and (card / LABEL_NAME).exists()


def test_the_embedded_default_card_is_created(gateway_factory, tmp_path) -> None:
    """``make run``: no storage_devices, the cwd a fresh directory."""
    gw = gateway_factory(name="default", start=False)
    i = gw.argv.index("--storage-devices")
    del gw.argv[i:i + 2]
    gw.card_dirs = []
    gw.start()
    st = wait_active(gw, timeout=5)
    assert len(st["cards"]) == 1
    assert (tmp_path / "var" / "kvgate" / "card0" / LABEL_NAME).exists()
    assert "does not exist" not in gw.log()
