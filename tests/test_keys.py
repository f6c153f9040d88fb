import pytest

from kvgate.keys import (BadKey, as_key, check_key, dialog_digest, encode_namespace, full_key, key_digest, key_digests,
                         split_full_key)


def test_namespaces_never_collide():
    assert full_key(b"a", b"bc") != full_key(b"ab", b"c")
    assert split_full_key(full_key(b"ns", b"key")) == (b"ns", b"key")
    assert key_digest(full_key(b"m1", b"k")) != key_digest(full_key(b"m2", b"k"))


def test_limits():
    with pytest.raises(BadKey):
        encode_namespace("")
    with pytest.raises(BadKey):
        encode_namespace("x" * 256)
    with pytest.raises(BadKey):
        check_key(b"")
    with pytest.raises(BadKey):
        check_key(b"x" * 1025)
    assert as_key("é") == "é".encode()


def test_key_digests_are_key_digest_of_each_key():
    keys = [full_key(b"ns", b"k%d" % i) for i in range(100)]
    assert key_digests(keys) == [key_digest(k) for k in keys] and key_digests([]) == []


def test_dialog_digest():
    assert dialog_digest(None) == bytes(16)
    assert dialog_digest(b"d") != dialog_digest(b"e") and len(dialog_digest(b"d")) == 16
