"""The engines' KV-cache events, decoded from msgpack.

vLLM (and SGLang, which publishes the same format) sends each ``EventBatch`` as one ZMQ
message ``[topic, seq, payload]``: ``seq`` an 8-byte big-endian counter that grows by one
per batch and starts at 0 with each engine process, ``payload`` a msgpack-encoded
msgspec struct. Two encodings of the same structs are in use across versions, and both
are read here:

* ``array_like``: a batch is ``[ts, events, data_parallel_rank?]`` and (older releases)
  an event ``[tag, field, field, ...]`` in declaration order, trailing defaults omitted;
* map form: an event ``{"type": tag, field: ...}`` (vLLM 0.32 sends array-like batches of
  map-form events), a batch ``{"ts", "events", ...}``.

Tags and fields (declaration order):

    BlockStored      block_hashes, parent_block_hash, token_ids, block_size, lora_id,
                     medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, ...
    BlockRemoved     block_hashes, medium, group_idx
    AllBlocksCleared (none)

SGLang 0.5.23 sends map-form events with a ``cache_salt`` field of its own (vLLM puts
the salt in ``extra_keys``); both are read.

A block hash is an int or bytes (engine versions differ); only its identity matters
here, and a block keeps it in every ``medium`` (a string naming where the copy is: see
bridge/media.py). A ``BlockStored`` without token ids is a bare announcement of blocks
stored before (vLLM's offloading connectors send those, with block_size 0). Anything else
in a batch (unknown tags, malformed events: token ids outside uint32, a medium that is no
string) is skipped and counted, never fatal: a newer or broken engine must not stop the
bridge.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import msgpack

BlockHash = int | bytes
MAX_TOKEN_ID = 2**32 - 1  # block keys hash token ids as uint32

STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
)
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class BlockStored(NamedTuple):
    """``token_ids`` empty: a bare announcement that blocks stored before are now also in
    ``medium`` (vLLM's offloading connectors send these unless their
    ``self_describing_kv_events`` is on); ``block_size`` is then meaningless."""

    block_hashes: tuple[BlockHash, ...]
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    medium: str | None = None
    # One entry per block; the first block's entry carries the request's cache_salt.
    extra_keys: tuple[tuple[Any, ...] | None, ...] = ()
    group_idx: int | None = None
    # The group's kind of attention as vLLM (0.32 on) names it: "full_attention",
    # "sliding_window", "mamba", ... (bridge/translate.py follows a full-attention group).
    kind: str | None = None
    # The request's cache_salt as a field of its own (SGLang 0.5.23; vLLM puts it in
    # extra_keys).
    cache_salt: str | None = None


class BlockRemoved(NamedTuple):
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(NamedTuple):
    pass


EngineEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(NamedTuple):
    ts: float
    events: list[EngineEvent]
    skipped: int  # events that were not understood (unknown tag or malformed)


class BadPayload(ValueError):
    """A message that is not an EventBatch at all."""


def decode_batch(payload: bytes) -> EventBatch:
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise BadPayload(f"not msgpack: {exc}") from exc
    if isinstance(raw, dict):
        ts, events = raw.get("ts"), raw.get("events")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
    else:
        raise BadPayload("not an EventBatch (neither array nor map)")
    if not isinstance(events, list) or not isinstance(ts, int | float):
        raise BadPayload("EventBatch without ts and an events list")
    out: list[EngineEvent] = []
    skipped = 0
    for item in events:
        event = decode_event(item)
        if event is None:
            skipped += 1
        else:
            out.append(event)
    return EventBatch(float(ts), out, skipped)


def decode_event(item: Any) -> EngineEvent | None:
    """One event in either encoding; None when it is not one we understand."""
    if isinstance(item, list) and item and isinstance(item[0], str):
        tag, fields = item[0], _positional(item[0], item[1:])
    elif isinstance(item, dict) and isinstance(item.get("type"), str):
        tag, fields = item["type"], item
    else:
        return None
    try:
        if tag == "BlockStored":
            return _stored(fields)
        if tag == "BlockRemoved":
            return BlockRemoved(
                _hashes(fields["block_hashes"]),
                _medium(fields.get("medium")),
                _group(fields.get("group_idx")),
            )
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
    except (KeyError, TypeError, ValueError, OverflowError):  # int(inf) overflows
        return None
    return None


def _positional(tag: str, values: Sequence[Any]) -> dict[str, Any]:
    names = STORED_FIELDS if tag == "BlockStored" else REMOVED_FIELDS
    return dict(zip(names, values, strict=False))


def _stored(f: dict[str, Any]) -> BlockStored:
    hashes = _hashes(f["block_hashes"])
    tokens = tuple(int(t) for t in f["token_ids"])
    block_size = int(f["block_size"])
    if tokens:
        if block_size <= 0 or len(tokens) != len(hashes) * block_size:
            raise ValueError("token_ids do not fill the stored blocks")
        if min(tokens) < 0 or max(tokens) > MAX_TOKEN_ID:
            raise ValueError("a token id is not a uint32")
    elif block_size < 0:
        raise ValueError("negative block_size")
    parent = f.get("parent_block_hash")
    if parent is not None and not isinstance(parent, int | bytes):
        raise TypeError("parent_block_hash is neither int nor bytes")
    extra = f.get("extra_keys") or ()
    extra_keys = tuple(tuple(e) if isinstance(e, list | tuple) else None for e in extra)
    lora = f.get("lora_name")
    kind = f.get("kv_cache_spec_kind")
    salt = f.get("cache_salt")
    return BlockStored(
        hashes,
        parent,
        tokens,
        block_size,
        lora if isinstance(lora, str) else None,
        _medium(f.get("medium")),
        extra_keys,
        _group(f.get("group_idx")),
        kind if isinstance(kind, str) else None,
        salt if isinstance(salt, str) else None,
    )


def _medium(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError("medium is not a string")
    return value


def _group(value: Any) -> int | None:
    if value is not None and not isinstance(value, int):
        raise TypeError("group_idx is not an int")
    return value


def _hashes(values: Any) -> tuple[BlockHash, ...]:
    if not isinstance(values, list):
        raise TypeError("block_hashes is not a list")
    for h in values:
        if not isinstance(h, int | bytes):
            raise TypeError("a block hash is neither int nor bytes")
    return tuple(values)


def salt_of(event: BlockStored) -> str:
    """The request's ``cache_salt``: the event's own field (SGLang), else from the first
    block's extra keys (vLLM); "" when none.

    Current vLLM tags each extra key: ``("cache_salt", salt)``, ``("lora", name, path)``,
    multimodal and prompt-embedding entries of their own. Older releases put bare values
    in order LoRA name, multimodal identifiers, salt (first block only), prompt-embedding
    hashes (bytes), so there the salt is the last string that is not the LoRA name; a
    multimodal prompt without a salt would be misread, but its keys could not match the
    gateway's text-only keys anyway.
    """
    if event.cache_salt is not None:
        return event.cache_salt
    if not event.extra_keys or event.extra_keys[0] is None:
        return ""
    first = event.extra_keys[0]
    for item in first:
        if isinstance(item, list | tuple) and len(item) == 2 and item[0] == "cache_salt":
            return str(item[1])
    if any(isinstance(item, list | tuple) for item in first):
        return ""  # the tagged form, without a salt
    strings = [k for k in first if isinstance(k, str) and k != event.lora_name]
    return strings[-1] if strings else ""


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(raw: bytes) -> int:
    if len(raw) != 8:
        raise BadPayload(f"sequence frame of {len(raw)} bytes, expected 8")
    return int.from_bytes(raw, "big", signed=True)
