"""vLLM's KV event payload, field for field: the structs, and ``encode_batch`` / ``decode_batch``.

Mirrors ``vllm/distributed/kv_events.py`` of vLLM 0.32 (read from the package, not the docs):

- ``EventBatch``: a msgpack ARRAY ``[ts, events, data_parallel_rank]`` (``array_like``; msgspec writes
  a ``data_parallel_rank`` of None as nil, and reads a 2-element array too).
- Each event is a msgpack MAP tagged ``"type": "<class name>"`` (``BlockStored``, ``BlockRemoved``,
  ``AllBlocksCleared``) with ``omit_defaults``: a field left at its default is not sent, so
  ``BlockStored``'s required fields (``block_hashes`` .. ``lora_name``) always are.
- Older vLLM releases sent each event as a positional ARRAY ``[tag, field1, field2, ...]``
  in field order, with trailing defaults left off; ``decode_batch`` accepts both forms, and a batch
  may even mix them.  ``encode_batch(..., positional=True)`` writes the older form (for tests and for
  consumers that only read it).
- vLLM 0.33 adds ``BlockStored.lookahead_token_ids``; it is here as an optional last field, so 0.32's
  decoder (which ignores unknown map keys) reads our events, and ours reads 0.33's.

A block hash is ``bytes`` (vLLM's default, the sha256 family's 32 bytes) or an ``int`` (an engine run
with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``: the low 64 bits of the hash); consumers must accept both.

The frames around a payload (topic, 8-byte big-endian sequence number, payload; the replay socket's
``END_SEQ``) are the publisher's and subscriber's; their constants are here so both agree.
"""

from __future__ import annotations

import re
from typing import Any, Union

import msgspec

from kvgate.errors import InvalidArgument

__all__ = [
    "MEDIUM_GPU", "MEDIUM_CPU", "MEDIUM_STORAGE", "LOCALITY_LOCAL", "LOCALITY_REMOTE", "END_SEQ",
    "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared", "Event", "EventBatch",
    "encode_batch", "decode_batch", "seq_bytes", "seq_from_bytes",
]

# Media, as vLLM names them: where the published blocks are.  kvgate's RAM tier is CPU, a card STORAGE.
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
# Locality relative to the publisher (vLLM: None means unspecified).
LOCALITY_LOCAL = "LOCAL"
LOCALITY_REMOTE = "REMOTE"

# The replay socket's last answer carries this sequence number (-1, 8 bytes big-endian, signed) and an
# empty topic and payload.
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def seq_bytes(seq: int) -> bytes:
    """A batch's sequence number as its frame: 8 bytes, big-endian (vLLM's ``seq.to_bytes(8, "big")``)."""
    return seq.to_bytes(8, "big")


def seq_from_bytes(frame: bytes) -> int:
    """A sequence-number frame as an int: -1 for ``END_SEQ``, else the unsigned value.

    Raises InvalidArgument if the frame is not 8 bytes."""
    if len(frame) != 8:
        raise InvalidArgument(f"a KV event sequence number is 8 bytes, got {len(frame)}")
    if frame == END_SEQ:
        return -1
    return int.from_bytes(frame, "big")


ExternalBlockHash = Union[bytes, int]


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of every KV cache event (map-tagged ``"type"``: the class name)."""


class BlockStored(KVCacheEvent):
    """Blocks now held.  Fields, order and defaults as vLLM 0.32's, plus 0.33's ``lookahead_token_ids``."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # deprecated in vLLM (lora_name replaces it), still sent
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None  # the secondary tier that holds the blocks ("kvgate" for ours)
    session_id: str | None = None
    lookahead_token_ids: list[int] | None = None  # vLLM 0.33


class BlockRemoved(KVCacheEvent):
    """Blocks no longer held (on ``medium``)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Everything the publisher held is gone (a snapshot starts with one)."""


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published message's payload: ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


# --- the older positional form: [tag, field1, field2, ...] -------------------------------------------
# Every field after the first releases' ones has a default, so a short array from an old engine decodes,
# and msgspec ignores trailing elements it does not know (a newer engine's extra fields).


class _PosEvent(msgspec.Struct, omit_defaults=True, gc=False, array_like=True, tag=True):
    pass


class _PosBlockStored(_PosEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[int] | None = None


class _PosBlockRemoved(_PosEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _PosAllBlocksCleared(_PosEvent, tag="AllBlocksCleared"):
    pass


_POS_OF = {BlockStored: _PosBlockStored, BlockRemoved: _PosBlockRemoved, AllBlocksCleared: _PosAllBlocksCleared}
_MAP_OF = {v: k for k, v in _POS_OF.items()}


class _PosBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Union[_PosBlockStored, _PosBlockRemoved, _PosAllBlocksCleared]]
    data_parallel_rank: int | None = None


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(EventBatch)
_EVENT_DECODER = msgspec.msgpack.Decoder(Event)
_POS_EVENT_DECODER = msgspec.msgpack.Decoder(Union[_PosBlockStored, _PosBlockRemoved, _PosAllBlocksCleared])
_RAW_DECODER = msgspec.msgpack.Decoder(_RawBatch)


def _fields(ev: msgspec.Struct) -> dict[str, Any]:
    return {f: getattr(ev, f) for f in ev.__struct_fields__}


def encode_batch(batch: EventBatch, *, positional: bool = False) -> bytes:
    """The msgpack payload of ``batch``, as vLLM 0.32 writes it (each event a map tagged ``"type"``), or
    with ``positional=True`` as older releases did (each event ``[tag, field1, ...]``)."""
    if not positional:
        return _ENCODER.encode(batch)
    events = [_POS_OF[type(ev)](**_fields(ev)) for ev in batch.events]
    return _ENCODER.encode(_PosBatch(batch.ts, events, batch.data_parallel_rank))


def _is_msgpack_array(raw: bytes) -> bool:
    b = raw[0] if raw else 0
    return 0x90 <= b <= 0x9F or b in (0xDC, 0xDD)


def _positional_path(message: str, raw: msgspec.Raw, index: int) -> str:
    """msgspec's ``at `$[k]...``` of a positional event, as ``at `$.events[index].<field>...```."""
    def field(m: re.Match) -> str:
        k = int(m.group(1))
        name = f"[{k}]"
        try:
            tag = msgspec.msgpack.decode(raw)[0]
            cls = {c.__struct_config__.tag: c for c in _MAP_OF}.get(tag)
            if cls is not None and 1 <= k <= len(cls.__struct_fields__):
                name = "." + cls.__struct_fields__[k - 1]
        except Exception:  # noqa: BLE001 - only the message's wording is at stake
            pass
        return f"`$.events[{index}]{name}"
    if " - at `$" not in message:  # msgspec names no path for the event itself
        return f"{message} - at `$.events[{index}]`"
    if not _is_msgpack_array(bytes(raw)):  # a map event: its paths are `$.field...`
        return message.replace("`$", f"`$.events[{index}]")
    out = re.sub(r"`\$\[(\d+)\]", field, message)
    return out.replace("`$`", f"`$.events[{index}]`") if out == message else out


def _batch_path(message: str) -> str:
    """msgspec's ``at `$[0]``` of a batch, as ``at `$.ts``` (``$[1][i]`` -> ``$.events[i]``)."""
    names = {"0": ".ts", "1": ".events", "2": ".data_parallel_rank"}
    return re.sub(r"`\$\[([012])\]", lambda m: f"`${names[m.group(1)]}", message)


def decode_batch(payload: bytes) -> EventBatch:
    """The ``EventBatch`` in ``payload``; each event may be map-tagged (vLLM 0.32) or positional
    (older releases), mixed freely.  Unknown map keys and trailing positional fields (a newer engine's)
    are ignored.

    Raises InvalidArgument naming what was wrong (msgspec's path, e.g. ``$.events[0].block_hashes``)
    when the payload is not such a batch.
    """
    try:
        return _DECODER.decode(payload)  # the common case, one pass in C
    except (msgspec.ValidationError, msgspec.DecodeError) as first:
        try:
            raw = _RAW_DECODER.decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise InvalidArgument(f"malformed KV event batch: {_batch_path(str(e))}") from None
        events: list[Any] = []
        for i, ev in enumerate(raw.events):
            try:
                if _is_msgpack_array(bytes(ev)):
                    pos = _POS_EVENT_DECODER.decode(ev)
                    events.append(_MAP_OF[type(pos)](**_fields(pos)))
                else:
                    events.append(_EVENT_DECODER.decode(ev))
            except (msgspec.ValidationError, msgspec.DecodeError) as e:
                raise InvalidArgument(f"malformed KV event batch: {_positional_path(str(e), ev, i)}") from None
        if not any(_is_msgpack_array(bytes(ev)) for ev in raw.events):
            # every event was a map, so the first decode's complaint is the real one
            raise InvalidArgument(f"malformed KV event batch: {_batch_path(str(first))}") from None
        return EventBatch(raw.ts, events, raw.data_parallel_rank)
