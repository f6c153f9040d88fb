"""The operations table: one handler per request type, and who may ask for what.

In process, with no store: only the table and the session checks in front of
it run (what each handler does is tested against real gateways).
"""

from __future__ import annotations

import asyncio
import typing

import pytest

from kvgate.gateway.operations import Operations
from kvgate.gateway.sessions import Session
from kvgate.protocol import Cards, Clean, ErrorCode, Hello, Put, Request, RequestError, Stats


def _operations() -> Operations:
    return Operations(cfg=None, store=None, pool=None, heads=None, snapshot=lambda: {"ok": 1})


def _session(role: str) -> Session:
    return Session(id=1, local=True, pid=None, uid=None, inline=None, role=role)


def test_the_table_answers_every_request_type() -> None:
    assert set(_operations().table) == set(typing.get_args(Request))


def test_a_request_type_with_no_handler_is_an_unknown_op() -> None:
    class Unlisted:
        id = 7

    with pytest.raises(RequestError) as e:
        asyncio.run(_operations().handle(_session("engine"), Unlisted(), b""))
    assert (e.value.code, str(e.value)) == (ErrorCode.UNKNOWN_OP, "unknown op Unlisted")


def test_only_stats_clean_cards_and_hello_are_for_any_session() -> None:
    assert {t for t, op in _operations().table.items() if not op.engine_only} == {Stats, Clean, Cards, Hello}


def test_an_admin_session_asking_for_an_engine_op_is_told_so() -> None:
    with pytest.raises(RequestError) as e:
        asyncio.run(_operations().handle(_session("admin"), Put(id=3, keys=[b"k"], sizes=[1]), b"x"))
    assert (e.value.code, str(e.value)) == (ErrorCode.BAD_REQUEST, "put needs an engine session")


def test_a_second_hello_is_refused() -> None:
    with pytest.raises(RequestError) as e:
        asyncio.run(_operations().handle(_session("engine"), Hello(id=4), b""))
    assert (e.value.code, str(e.value)) == (ErrorCode.BAD_REQUEST, "this connection already has a session")


def test_stats_answers_any_session_with_the_snapshot() -> None:
    reply, body = asyncio.run(_operations().handle(_session("admin"), Stats(id=5), b""))
    assert (reply.stats, body) == ({"ok": 1}, None)


@pytest.mark.parametrize("role,local", [("engine", True), ("admin", False)])
def test_card_changes_need_an_admin_session_on_the_unix_socket(role: str, local: bool) -> None:
    """A change points the gateway at a path or server of the asker's choosing: only a local admin may."""
    sess = Session(id=1, local=local, pid=None, uid=None, inline=None, role=role)
    with pytest.raises(RequestError) as e:
        asyncio.run(_operations().handle(sess, Cards(id=6, action="add", target="/tmp/x"), b""))
    assert e.value.code == ErrorCode.NOT_AUTHORIZED
