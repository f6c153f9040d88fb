"""When the SGLang backend tells the user to turn on ``hicache_storage_pass_prefix_keys`` (a unit test of
``DialogMarks``; the real server's side is in test_sglang_engine.py).

SGLang 0.5.23's server hands a lookup ``prefix_keys.copy() if prefix_keys else None``: the lookup of a
prompt from its first page gets None with the switch on.  Loads and backups get a list (empty for a
prompt's start) whenever it is on, so only they can say it is off.
"""

from __future__ import annotations

import collections
import logging
from types import SimpleNamespace

import pytest

from kvgate.client import DialogMark
from kvgate.integrations.sglang.failures import FailureLog
from kvgate.integrations.sglang.marks import DialogMarks

HINT = "passed no prefix keys"


def marks() -> tuple[DialogMarks, collections.Counter]:
    counters: collections.Counter = collections.Counter()
    return DialogMarks(4, counters, FailureLog("/nowhere.sock", counters)), counters


def test_a_lookup_without_prefix_keys_is_not_taken_for_the_switch_off(caplog) -> None:
    dm, counters = marks()
    with caplog.at_level(logging.INFO, logger="sglang.kvgate"):
        for what in ("batch_exists", "batch_exists_v2"):
            assert dm.of_call(None, [b"k" * 32], SimpleNamespace(prefix_keys=None), what) == (DialogMark(None, 0), -1)
    assert HINT not in caplog.text
    assert counters["no_prefix_batch_exists"] == 1 and counters["no_prefix_batch_exists_v2"] == 1


@pytest.mark.parametrize("what", ["batch_get_v1", "batch_set_v1", "batch_get_v2", "batch_set_v2"])
def test_a_load_or_backup_without_prefix_keys_says_how_to_turn_them_on_once(caplog, what) -> None:
    dm, counters = marks()
    with caplog.at_level(logging.INFO, logger="sglang.kvgate"):
        for _ in range(3):
            dm.of_call(None, [b"k" * 32], None, what)
    assert caplog.text.count(HINT) == 1 and "hicache_storage_pass_prefix_keys" in caplog.text
    assert counters[f"no_prefix_{what}"] == 3


def test_with_prefix_keys_a_call_has_its_place_in_the_prompt(caplog) -> None:
    dm, _ = marks()  # affinity_chunks=4: a digest of the prompt's first pages, no gateway call
    keys = [f"{i:064x}" for i in range(6)]
    first = dm.of_call(None, [k.encode() for k in keys[:2]], SimpleNamespace(prefix_keys=[]), "batch_set_v1")
    later = dm.of_call(None, [k.encode() for k in keys[4:]], SimpleNamespace(prefix_keys=keys[:4]), "batch_get_v1")
    assert first[1] == 0 and later[1] == 4 and first[0].mark is not None
    assert HINT not in caplog.text
