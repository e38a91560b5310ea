"""The contract shared by replicas and gateways: block keys, Redis layout, event codec.

Block keys (DESIGN.md):

    root  = SHA-256(b"prefixgate/1" ‖ 0x00 ‖ model_id ‖ 0x00 ‖ u32le(block_size) ‖ salt)
    key_0 = SHA-256(root    ‖ u32le(tokens[0:B]))
    key_i = SHA-256(key_i-1 ‖ u32le(tokens[iB:(i+1)B]))

Only full blocks get keys; the partial tail never does. Keys are 32 bytes; events and the
router's index use the first 16 bytes (`short_key`), where a collision only misroutes (a
replica verifies every hit against the stored token ids).

Redis layout (one Redis per cluster, every name under the ``prefixgate:`` prefix):

    prefixgate:replicas               SET of registered replica ids
    prefixgate:replica:{id}           STRING json ReplicaInfo, with an expiry (heartbeat)
    prefixgate:events:{id}            STREAM of block events, capped (XADD MAXLEN ~)
    prefixgate:snapshot:{id}          STRING, encode_snapshot(): the replica's cached blocks
    prefixgate:routed                 PUB/SUB channel of gateways' optimistic inserts

A replica's stream and snapshot expire ``RETAIN_S`` after its last heartbeat, and a
gateway takes an id out of the set once neither its record nor its snapshot is left: a
replica gone for good (a pod replaced under a new name, a port that changed) leaves
nothing behind, while one that restarts within the hour resumes where it was. A live
replica adds itself to the set again at every heartbeat.

Every event carries a per-replica sequence number that grows by one per event; a reader
that sees a gap (or starts late) rebuilds that replica's view from the snapshot, whose
``seq`` is the last event folded into it. A replica's life starts its numbers at the
time in microseconds, so a restarted replica's first event is a gap.
"""

from __future__ import annotations

import binascii
import hashlib
import json
import math
import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Literal, NamedTuple
from urllib.parse import urlsplit, urlunsplit

DEFAULT_BLOCK_SIZE = 16
KEY_BYTES = 32
SHORT_KEY_BYTES = 16
KEY_PREFIX = "prefixgate"

REPLICAS_SET = f"{KEY_PREFIX}:replicas"
ROUTED_CHANNEL = f"{KEY_PREFIX}:routed"
# How long a replica's event stream and snapshot outlive its last heartbeat (a few MB
# each: ~10,000 events, and a snapshot of ~35 bytes a block).
RETAIN_S = 3600.0
# Bounds on what a registry record may say (the router multiplies both into floats).
MAX_BLOCK_SIZE = 65_536
MAX_LOAD_COUNT = 2**40
# The largest data-parallel rank a record may name (vLLM's ranks count from 0; a cluster
# of this many GPUs behind one server is far beyond any deployment).
MAX_DATA_PARALLEL_RANK = 65_535
# The header that sends a request to one data-parallel rank (vLLM reads it on its chat
# and completions endpoints; other endpoints leave the choice of rank to the engine).
DATA_PARALLEL_RANK_HEADER = "x-data-parallel-rank"


def replica_info_key(replica_id: str) -> str:
    return f"{KEY_PREFIX}:replica:{replica_id}"


def events_stream_key(replica_id: str) -> str:
    return f"{KEY_PREFIX}:events:{replica_id}"


def snapshot_key(replica_id: str) -> str:
    return f"{KEY_PREFIX}:snapshot:{replica_id}"


# --------------------------------------------------------------------------- block keys


def root_key(model_id: str, block_size: int, salt: str = "") -> bytes:
    """The chain's start: differs across models, block sizes and tenants (salts)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    h = hashlib.sha256(b"prefixgate/1\x00")
    h.update(model_id.encode("utf-8"))
    h.update(b"\x00")
    h.update(block_size.to_bytes(4, "little"))
    h.update(salt.encode("utf-8"))
    return h.digest()


def _u32le(token_ids: Sequence[int]) -> bytes:
    packed = array("I", token_ids)
    if packed.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte "I"
        packed = array("L", token_ids)
    if sys.byteorder != "little":  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


def encode_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as the bytes a block key hashes: little-endian uint32 each."""
    return _u32le(token_ids)


def chain_key(parent: bytes, block_bytes: bytes) -> bytes:
    """One link of the chain: a block's key from its parent's key (or the root) and its
    ``encode_tokens`` bytes. ``block_keys`` applies exactly this to every full block."""
    return hashlib.sha256(parent + block_bytes).digest()


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    root: bytes,
    *,
    parent: bytes | None = None,
    start_block: int = 0,
    short: bool = False,
) -> list[bytes]:
    """Chained keys of every full block of ``token_ids``.

    With ``parent`` and ``start_block`` the chain resumes mid-way: the keys of blocks
    ``start_block..`` given the key of block ``start_block - 1`` (``root`` when None).
    ``short``: each key's 16-byte short form (``short_key``), what the router indexes;
    the chain itself always runs on the full keys.
    """
    if start_block > 0 and parent is None:
        # Resuming from the root would silently produce keys of a different chain.
        raise ValueError("block_keys: start_block > 0 needs the parent key of the block before")
    data = memoryview(_u32le(token_ids))
    width = 4 * block_size
    n_full = len(token_ids) // block_size
    keys: list[bytes] = []
    prev = root if parent is None else parent
    sha = hashlib.sha256
    for i in range(start_block, n_full):
        prev = sha(prev + data[i * width : (i + 1) * width]).digest()
        keys.append(prev[:SHORT_KEY_BYTES] if short else prev)
    return keys


@dataclass(slots=True, frozen=True)
class KeySpace:
    """Everything that determines a block key except the tokens: model, block size, salt."""

    model_id: str
    block_size: int = DEFAULT_BLOCK_SIZE
    salt: str = ""

    @property
    def root(self) -> bytes:
        return root_key(self.model_id, self.block_size, self.salt)

    def keys(self, token_ids: Sequence[int]) -> list[bytes]:
        return block_keys(token_ids, self.block_size, self.root)

    def short_keys(self, token_ids: Sequence[int]) -> list[bytes]:
        """``keys`` in their short form, as ``Router.route`` takes them."""
        return block_keys(token_ids, self.block_size, self.root, short=True)


def short_key(key: bytes) -> bytes:
    """The 16-byte form used on the wire and in the router's index."""
    return key[:SHORT_KEY_BYTES]


# --------------------------------------------------------------------------- registry


@dataclass(slots=True)
class ReplicaLoad:
    """What a replica reports about its load in every heartbeat."""

    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    used_blocks: int = 0
    total_blocks: int = 0
    queued_prefill_tokens: int = 0


@dataclass(slots=True)
class ReplicaInfo:
    """A replica's registry record (``prefixgate:replica:{id}``), refreshed each heartbeat."""

    replica_id: str
    url: str
    model: str
    block_size: int
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    timestamp: float = 0.0
    # One data-parallel rank of an engine that runs several behind ``url`` (vLLM's
    # ``--data-parallel-size``): requests sent here name it (``X-data-parallel-rank``), so
    # they reach the rank whose cache this record publishes. None: the whole engine.
    data_parallel_rank: int | None = None

    def encode(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def decode(cls, raw: str | bytes) -> ReplicaInfo:
        """A record as ``encode`` writes it. Fields this version does not know (a newer
        replica's) are left out. The load is advice: a count that is missing (an older
        replica's record), or not an integer from 0 to ``MAX_LOAD_COUNT``, reads 0,
        where a huge one would overflow the router's float arithmetic on every decision.
        Any other departure raises ValueError, naming the field."""
        data = _json_object(raw, "replica record")
        load = data.get("load", {})
        if not isinstance(load, dict):
            load = {}
        timestamp = data.get("timestamp", 0.0)
        if isinstance(timestamp, bool) or not isinstance(timestamp, int | float):
            raise ValueError(f"replica record: 'timestamp' must be a number, got {timestamp!r}")
        if not math.isfinite(timestamp):
            raise ValueError(f"replica record: 'timestamp' must be finite, got {timestamp!r}")
        block_size = _count(data, "block_size", "replica record")
        if not 0 < block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"replica record: 'block_size' must be 1 to {MAX_BLOCK_SIZE}")
        rank = data.get("data_parallel_rank")
        if rank is not None:
            rank = _count(data, "data_parallel_rank", "replica record")
            if rank > MAX_DATA_PARALLEL_RANK:
                raise ValueError(
                    f"replica record: 'data_parallel_rank' must be 0 to {MAX_DATA_PARALLEL_RANK}"
                )
        return cls(
            replica_id=_text(data, "replica_id", "replica record"),
            url=http_url(_text(data, "url", "replica record"), "replica record: 'url'"),
            model=_text(data, "model", "replica record"),
            block_size=block_size,
            load=ReplicaLoad(
                **{f.name: _load_count(load.get(f.name)) for f in fields(ReplicaLoad)}
            ),
            timestamp=float(timestamp),
            data_parallel_rank=rank,
        )


def _json_object(raw: str | bytes, what: str) -> dict[str, object]:
    try:
        data = json.loads(raw)
    except ValueError as exc:  # a JSONDecodeError, or a UnicodeDecodeError for bytes
        raise ValueError(f"{what} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} is not a JSON object")
    return data


def _text(data: dict[str, object], name: str, what: str) -> str:
    value = data.get(name)
    if not isinstance(value, str):
        raise ValueError(f"{what}: {name!r} must be a string, got {value!r}")
    return value


def _count(data: dict[str, object], name: str, what: str) -> int:
    """A non-negative integer field."""
    value = data.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what}: {name!r} must be a non-negative integer, got {value!r}")
    return value


def http_url(url: str, what: str) -> str:
    """``url`` if it is an http(s) address with a host and a valid port (``what``: how
    the error names it): a gateway's HTTP client raises on anything else, not as a
    connection error (``http://[::1``, say), in every probe and request sent there."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - parsed for its ValueError
    except ValueError as exc:
        raise ValueError(f"{what} {url!r} is not a URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{what} {url!r} is not an http(s) address with a host")
    return url


def redacted_url(url: str) -> str:
    """``url`` fit for a log line: a password in it (``redis://:secret@host``, a managed
    Redis's URL) replaced by ``***``, and so is the value of a query parameter redis-py
    reads as one (``?password=``, ``?ssl_password=``, the client key's passphrase)."""
    try:
        parts = urlsplit(url)
    except ValueError:  # "redis://[::1", say: no telling where a password would be
        return "<a URL that does not parse>"
    redacted = parts
    userinfo, at, host = parts.netloc.rpartition("@")
    if at and ":" in userinfo:
        user = userinfo.split(":", 1)[0]
        redacted = redacted._replace(netloc=f"{user}:***@{host}")
    if parts.query:
        fields = [field.partition("=") for field in parts.query.split("&")]
        query = "&".join(
            name + eq + ("***" if eq and "password" in name.lower() else value)
            for name, eq, value in fields
        )
        redacted = redacted._replace(query=query)
    return url if redacted == parts else urlunsplit(redacted)


def _load_count(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_LOAD_COUNT:
        return value
    return 0


# --------------------------------------------------------------------------- block events

EventType = Literal["stored", "removed", "cleared"]
# Where a block's KV lives on the replica (vLLM's ``medium``: GPU -> device, CPU -> host).
Medium = Literal["device", "host"]
MEDIA: tuple[Medium, ...] = ("device", "host")


@dataclass(slots=True, frozen=True)
class BlockEvent:
    """One change to a replica's cache.

    ``stored``: ``keys`` form a chain (each the child of the one before), the first one a
    child of ``parent`` (None: a chain that starts at the root). ``removed``: ``keys``
    left the cache (any order). ``cleared``: the whole cache was dropped (no keys).
    Keys are short (16-byte) keys.

    ``medium``: the tier the keys are stored in or removed from. A ``stored`` event in
    ``host`` for keys held on the device says they moved there (demoted); one in
    ``device`` for keys on the host, that they came back (promoted). On the wire the
    field is left out for ``device``, so events from before tiers decode as device.
    """

    seq: int
    type: EventType
    keys: tuple[bytes, ...] = ()
    parent: bytes | None = None
    medium: Medium = "device"

    def encode(self) -> dict[str, str]:
        """Fields for XADD. Keys as one hex string (32 hex chars per key)."""
        _check_short((*self.keys, *((self.parent,) if self.parent is not None else ())))
        fields = {"seq": str(self.seq), "type": self.type, "keys": b"".join(self.keys).hex()}
        if self.parent is not None:
            fields["parent"] = self.parent.hex()
        if self.medium != "device":
            fields["medium"] = self.medium
        return fields

    @classmethod
    def decode(cls, entry: dict[bytes, bytes] | dict[str, str]) -> BlockEvent:
        """An event as ``encode`` writes it (Redis hands the fields back as bytes); any
        departure raises ValueError. ``event_seq`` reads the seq alone.

        Every gateway decodes every replica's events, so this is read straight from the
        bytes Redis returns, a field at a time, not the whole entry turned to text first:
        decoding is a third of what following a cluster's cache costs
        (``benchmarks/follow_bench.py``)."""
        f: dict[bytes, bytes | str]
        if entry and not isinstance(next(iter(entry)), bytes):  # text, as encode writes it
            f = {k.encode() if isinstance(k, str) else k: v for k, v in entry.items()}
        else:
            f = entry  # type: ignore[assignment]
        event_type = _EVENT_TYPES.get(f.get(b"type"))  # type: ignore[arg-type]
        if event_type is None:
            raise ValueError(f"unknown block event type {_shown(f.get(b'type'))!r}")
        seq = f.get(b"seq")
        if seq is None:
            raise ValueError("block event without a seq")
        try:
            raw = binascii.unhexlify(f.get(b"keys", b""))
        except binascii.Error as exc:
            raise ValueError(f"block event keys are not hex: {exc}") from None
        if len(raw) % SHORT_KEY_BYTES:
            raise ValueError("block event keys are not a whole number of 16-byte keys")
        keys = tuple(raw[i : i + SHORT_KEY_BYTES] for i in range(0, len(raw), SHORT_KEY_BYTES))
        parent_hex = f.get(b"parent")
        parent = None
        if parent_hex:
            try:
                parent = binascii.unhexlify(parent_hex)
            except binascii.Error as exc:
                raise ValueError(f"block event parent is not hex: {exc}") from None
            if len(parent) != SHORT_KEY_BYTES:
                raise ValueError("block event parent is not a 16-byte key")
        raw_medium = f.get(b"medium")
        medium = "device" if raw_medium is None else _MEDIA.get(raw_medium)  # type: ignore[arg-type]
        if medium is None:
            raise ValueError(f"unknown block event medium {_shown(raw_medium)!r}")
        return cls(seq=int(seq), type=event_type, keys=keys, parent=parent, medium=medium)  # type: ignore[arg-type]


# What decode accepts, as Redis returns it (bytes) and as encode writes it (text).
_EVENT_TYPES: dict[bytes | str, EventType] = {
    **{t.encode(): t for t in ("stored", "removed", "cleared")},
    **{t: t for t in ("stored", "removed", "cleared")},
}
_MEDIA: dict[bytes | str, Medium] = {**{m.encode(): m for m in MEDIA}, **{m: m for m in MEDIA}}


def _shown(value: bytes | str | None) -> str | None:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def event_seq(entry: dict[bytes, bytes] | dict[str, str]) -> int | None:
    """The seq of a stream entry ``BlockEvent.decode`` could not read; None if it has
    none readable either."""
    for name, value in entry.items():
        if name in ("seq", b"seq"):
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _check_short(keys: Iterable[bytes]) -> None:
    # A full 32-byte key would decode as two bogus short keys: refuse it at the source.
    for key in keys:
        if len(key) != SHORT_KEY_BYTES:
            raise ValueError(f"expected a {SHORT_KEY_BYTES}-byte short key, got {len(key)} bytes")


def as_text(value: str | bytes) -> str:
    """A Redis reply field as text (redis-py returns bytes unless told to decode)."""
    return value.decode() if isinstance(value, bytes) else value


# --------------------------------------------------------------------------- snapshots


class SnapshotBlock(NamedTuple):
    parent: bytes | None
    key: bytes
    medium: Medium = "device"  # the KV tier the block is in


class Snapshot(NamedTuple):
    seq: int
    blocks: list[SnapshotBlock]


_SNAPSHOT_MAGIC = b"PGS1"


def encode_snapshot(
    seq: int, blocks: Iterable[SnapshotBlock | tuple[bytes | None, bytes, Medium]]
) -> bytes:
    """``PGS1 ‖ u64le(seq) ‖ records``; a record is ``flag ‖ parent16 ‖ key16`` where
    flag bit 0 set means the block has a parent and clear that it starts at the root
    (parent bytes then are zero and ignored), and bit 1 set that the block is on the
    host tier. Parents come before their children."""
    zero = bytes(SHORT_KEY_BYTES)
    flags = [bytes((flag,)) for flag in range(4)]
    parts = [_SNAPSHOT_MAGIC, seq.to_bytes(8, "little")]
    for parent, key, medium in blocks:
        if len(key) != SHORT_KEY_BYTES or (parent is not None and len(parent) != SHORT_KEY_BYTES):
            _check_short((key,) if parent is None else (parent, key))  # raises, naming it
        flag = (parent is not None) | (medium == "host") << 1
        parts += (flags[flag], zero if parent is None else parent, key)
    return b"".join(parts)


class SnapshotRuns(NamedTuple):
    """A snapshot read for applying (``snapshot_runs``): its seq, and its keys in runs of
    one tier, last run first, each at most ``step`` keys in snapshot order: the order
    ``Router.snapshot_steps`` inserts them in."""

    seq: int
    runs: Iterator[tuple[Medium, list[bytes]]]


SNAPSHOT_STEP = 8192  # keys per run read lazily: ~10 ms of the router's inserts


def snapshot_runs(raw: bytes, step: int = SNAPSHOT_STEP) -> SnapshotRuns:
    """The snapshot's seq and its keys, checked whole at once (an unreadable snapshot
    raises ValueError here, before any of it is applied) and read a run at a time from
    the end: no block objects, no parents (the index needs neither), and no pass over a
    million records in one go."""
    width = 1 + 2 * SHORT_KEY_BYTES
    if raw[:4] != _SNAPSHOT_MAGIC:
        raise ValueError("not a prefixgate snapshot")
    if (len(raw) - 12) % width:
        raise ValueError("truncated snapshot")
    flags = raw[12::width]  # one byte per record
    if flags and max(flags) > 3:
        raise ValueError(f"bad snapshot record flag {max(flags)}")
    return SnapshotRuns(int.from_bytes(raw[4:12], "little"), _runs_from_end(raw, flags, step))


def _runs_from_end(raw: bytes, flags: bytes, step: int) -> Iterator[tuple[Medium, list[bytes]]]:
    width = 1 + 2 * SHORT_KEY_BYTES
    first_key = 12 + 1 + SHORT_KEY_BYTES  # the first record's key: after its flag and parent
    end = len(flags)
    while end:
        host = flags[end - 1] & 2
        start = max(0, end - step)
        window = flags[start:end]
        other = (b"\x00", b"\x01") if host else (b"\x02", b"\x03")  # the other tier's flags
        begin = start + 1 + max(window.rfind(other[0]), window.rfind(other[1]))
        offsets = range(first_key + begin * width, first_key + end * width, width)
        yield ("host" if host else "device"), [raw[o : o + SHORT_KEY_BYTES] for o in offsets]
        end = begin


def decode_snapshot(raw: bytes) -> Snapshot:
    if raw[:4] != _SNAPSHOT_MAGIC:
        raise ValueError("not a prefixgate snapshot")
    seq = int.from_bytes(raw[4:12], "little")
    width = 1 + 2 * SHORT_KEY_BYTES
    body = raw[12:]
    if len(body) % width:
        raise ValueError("truncated snapshot")
    blocks = []
    for i in range(0, len(body), width):
        flag = body[i]
        if flag > 3:
            raise ValueError(f"bad snapshot record flag {flag}")
        parent = body[i + 1 : i + 1 + SHORT_KEY_BYTES] if flag & 1 else None
        medium: Medium = "host" if flag & 2 else "device"
        blocks.append(SnapshotBlock(parent, body[i + 1 + SHORT_KEY_BYTES : i + width], medium))
    return Snapshot(seq, blocks)


# --------------------------------------------------------------------------- routed hints


@dataclass(slots=True, frozen=True)
class RoutedHint:
    """A gateway's optimistic insert, shared with other gateways on ``ROUTED_CHANNEL``:
    the routed prompt's keys past what the replica was known to hold (a chain's tail;
    the head, the receivers know from the replica's events)."""

    gateway_id: str
    replica_id: str
    keys: tuple[bytes, ...]
    # The replica's last block event the sender had folded in when it routed (None: it
    # had none): a hint routed before the replica's last ``cleared`` event is stale.
    seq: int | None = None

    def encode(self) -> str:
        _check_short(self.keys)
        data: dict[str, object] = {
            "g": self.gateway_id,
            "r": self.replica_id,
            "k": b"".join(self.keys).hex(),
        }
        if self.seq is not None:
            data["s"] = self.seq
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def decode(cls, raw: str | bytes) -> RoutedHint:
        """A hint as ``encode`` writes it; any departure raises ValueError."""
        data = _json_object(raw, "routed hint")
        blob = bytes.fromhex(_text(data, "k", "routed hint"))
        if len(blob) % SHORT_KEY_BYTES:
            raise ValueError("routed hint keys are not a whole number of 16-byte keys")
        keys = tuple(blob[i : i + SHORT_KEY_BYTES] for i in range(0, len(blob), SHORT_KEY_BYTES))
        seq = data.get("s")
        return cls(
            _text(data, "g", "routed hint"),
            _text(data, "r", "routed hint"),
            keys,
            seq if isinstance(seq, int) and not isinstance(seq, bool) else None,
        )
