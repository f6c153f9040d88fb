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


# ---- what a namespace stands for ----------------------------------------------------------

from kvgate.keys import (NamespaceBook, counterpart, namespace_difference,  # noqa: E402
                         parse_namespace_inputs)

QWEN16 = {"model": "Qwen/Qwen3-0.6B", "dtype": "float16", "tp_size": 1}
QWEN_BF16 = {**QWEN16, "dtype": "bfloat16"}


def test_namespace_inputs_must_be_one_json_object_of_bounded_size() -> None:
    assert parse_namespace_inputs('{"model": "m"}') == {"model": "m"}
    with pytest.raises(ValueError, match="not JSON"):
        parse_namespace_inputs("{model")
    with pytest.raises(ValueError, match="must be a JSON object, not list"):
        parse_namespace_inputs("[1]")
    with pytest.raises(ValueError, match="the limit is 65536"):
        parse_namespace_inputs('{"m": "' + "x" * 70_000 + '"}')


def test_a_difference_names_each_input_that_differs_and_which_side_has_what() -> None:
    assert namespace_difference(("vllm|q|1", QWEN16), ("vllm|q|2", QWEN_BF16)) == \
        'dtype ("float16" here, "bfloat16" there)'
    two = namespace_difference(("vllm|q|1", QWEN16), ("vllm|q|2", {**QWEN_BF16, "tp_size": 2, "pp_size": 1}))
    assert two == 'dtype ("float16" here, "bfloat16" there), pp_size (not said here, 1 there), ' \
                  'tp_size (1 here, 2 there)'
    assert namespace_difference(("vllm|q|1", QWEN16), ("sglang|q|tp0of1|p16|float16|9", QWEN16)) == \
        "engine (vllm here, sglang there)"
    assert "name only" in namespace_difference(("vllm|q|1", QWEN16), ("vllm|q|2", QWEN16))
    long = namespace_difference(("a", {"model": "m", "layers": ["x" * 50] * 4}), ("b", {"model": "m"}))
    assert len(long) < 200 and long.startswith("layers (") and "..." in long


def test_a_counterpart_is_another_namespace_of_the_same_model_only() -> None:
    theirs = {"vllm|q|2": QWEN_BF16, "vllm|l|3": {"model": "llama", "dtype": "float16"}}
    assert counterpart("vllm|q|1", QWEN16, theirs) == "vllm|q|2"
    assert counterpart("vllm|q|2", QWEN_BF16, theirs) is None  # theirs has it: nothing differs
    assert counterpart("vllm|o|4", {"model": "other"}, theirs) is None  # a model theirs does not run
    assert counterpart("mine", {}, theirs) is None  # inputs without a model: nothing to compare


def test_a_book_keeps_the_latest_namespaces_and_says_when_it_changed() -> None:
    book = NamespaceBook(limit=2)
    assert book.version == 0 and book.foreign("vllm|q|1", {"vllm|q|2": QWEN_BF16}) is None  # nothing declared
    book.declare("vllm|q|1", QWEN16)
    book.declare("vllm|q|1", dict(QWEN16))  # the same again: no change
    assert book.version == 1
    assert book.foreign("vllm|q|1", {"vllm|q|2": QWEN_BF16}) == ("vllm|q|2", 'dtype ("float16" here, "bfloat16" there)')
    assert book.foreign("vllm|q|1", {"vllm|q|1": QWEN16, "vllm|q|2": QWEN_BF16}) is None
    taken = book.items()
    book.declare("b", {"model": "b"})
    book.declare("c", {"model": "c"})
    assert list(book.items()) == ["b", "c"] and book.version == 3 and book.get("vllm|q|1") is None
    assert list(taken) == ["vllm|q|1"]  # a reader's mapping is its own


@pytest.mark.parametrize("helper", ["compiled", "python"])
def test_full_keys_and_joined_digests_agree_with_one_key_at_a_time(helper: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled loops (``kvgate/_keys.c``) and the Python ones give the same bytes: the digests are the
    names of objects on cards, written by either."""
    import random

    import xxhash

    from kvgate import keys as keys_module

    if helper == "python":
        monkeypatch.setattr(keys_module, "_keys", None)
    elif keys_module._keys is None:
        pytest.skip("the compiled key helper is not built here (make install builds it)")
    rng = random.Random(5)
    ks = [rng.randbytes(rng.randrange(1, 1025)) for _ in range(300)] + [b"k", b"\x00" * 1024]
    ns = b"n" * 255
    fkeys = keys_module.full_keys(ns, ks)
    assert fkeys == [full_key(ns, k) for k in ks]
    assert keys_module.joined_digests(fkeys) == b"".join(xxhash.xxh3_128_digest(k) for k in fkeys)
    assert keys_module.joined_digests(fkeys) == b"".join(key_digests(fkeys))
    assert keys_module.full_keys(ns, []) == [] and keys_module.joined_digests([]) == b""
    assert keys_module.full_keys(ns, tuple(ks[:2])) == fkeys[:2], "not a list: the Python loop"


def test_the_compiled_key_helper_is_built_where_a_compiler_and_pythons_headers_are() -> None:
    import os
    import shutil
    import sysconfig

    from kvgate import keys as keys_module

    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    headers = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
    if not (shutil.which(cc) and headers):
        pytest.skip("no C compiler or no Python headers here: the Python loops serve")
    assert keys_module._keys is not None, "make install should have built kvgate/_keys*.so"


def test_str_keys_are_their_utf8_bytes_never_base64() -> None:
    """``as_keys`` checks a batch with ``msgspec.convert``, which reads a str as base64 where it wants bytes
    ("abcd" would become 3 other bytes): a str key must reach the gateway as its UTF-8, alone or mixed."""
    from kvgate.keys import as_keys

    assert as_keys(["abcd"]) == [b"abcd"]
    assert as_keys(["abcd", b"k-1", bytearray(b"k-2")]) == [b"abcd", b"k-1", b"k-2"]
    assert as_keys(("ключ",)) == ["ключ".encode()]
