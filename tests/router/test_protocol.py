"""The block-key contract: published test vectors and event codec round-trips.

Any other implementation of the keys (another language, another gateway) can be checked
against VECTORS. Byte layout, restated so the vectors can be recomputed by hand:

    root  = SHA-256(b"prefixgate/1\\x00" ‖ utf8(model) ‖ b"\\x00" ‖ u32le(block_size) ‖ utf8(salt))
    key_0 = SHA-256(root ‖ u32le(t_0) ‖ … ‖ u32le(t_{B-1}))
    key_i = SHA-256(key_{i-1} ‖ u32le(t_{iB}) ‖ … ‖ u32le(t_{iB+B-1}))
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import struct
from itertools import groupby
from operator import attrgetter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.protocol import (
    MAX_BLOCK_SIZE,
    MAX_DATA_PARALLEL_RANK,
    MAX_LOAD_COUNT,
    BlockEvent,
    KeySpace,
    Medium,
    ReplicaInfo,
    ReplicaLoad,
    RoutedHint,
    SnapshotBlock,
    block_keys,
    chain_key,
    decode_snapshot,
    encode_snapshot,
    encode_tokens,
    event_seq,
    redacted_url,
    root_key,
    short_key,
    snapshot_runs,
)

# (model, block size, salt, tokens) -> (root hex, [block key hex, ...])
VECTORS: list[tuple[str, int, str, list[int], str, list[str]]] = [
    (
        "smollm2-135m",
        16,
        "",
        list(range(40)),
        "b91ee44e8e3d599411aa0bda3bf879473047ac3029e2886f56ddc1356de42c84",
        [
            "32bae4cae8878dae7207f9848b6bd53b8c40361b73e4cb285adf04413426ed5d",
            "9405fa2eb07b980b2255bd8f30440e33c231728f99bba1954811e64d5831ed46",
        ],
    ),
    (
        "smollm2-135m",
        16,
        "tenant-a",
        list(range(40)),
        "92ac3c7865230eeeddcbaee66a829467a494397cc9ee69c039fff4e3c15a7582",
        [
            "3885860ee9d0b93e6674d8d3be5edad0d25525fbeeef91bef519af8b9604b080",
            "20f80d8e0da2828238fd5c55032c8ff2788817252a698c786147154f1750c1a0",
        ],
    ),
    (
        "smollm2-135m",
        4,
        "",
        list(range(10)),
        "88d4adbd949e70a3bd28c96b2803afbe846564bba4e357f5337193a4c6b1e593",
        [
            "5484f59879f462281606ad958fd4da663e4df6cbdd660fa301545a3c535709e4",
            "6e72f1a19cde50647dfe5f37fabe47b1b0f901e1556c290bcdb934f794e94432",
        ],
    ),
]


def reference_keys(model: str, block_size: int, salt: str, tokens: list[int]) -> list[bytes]:
    """An independent implementation (struct + hashlib) of the layout in the docstring."""
    prev = hashlib.sha256(
        b"prefixgate/1\x00"
        + model.encode()
        + b"\x00"
        + struct.pack("<I", block_size)
        + salt.encode()
    ).digest()
    keys = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        prev = hashlib.sha256(prev + struct.pack(f"<{block_size}I", *block)).digest()
        keys.append(prev)
    return keys


@pytest.mark.parametrize(("model", "block_size", "salt", "tokens", "root_hex", "keys_hex"), VECTORS)
def test_published_vectors(
    model: str, block_size: int, salt: str, tokens: list[int], root_hex: str, keys_hex: list[str]
) -> None:
    space = KeySpace(model, block_size, salt)
    assert space.root.hex() == root_hex
    assert [k.hex() for k in space.keys(tokens)] == keys_hex
    assert [k.hex() for k in reference_keys(model, block_size, salt, tokens)] == keys_hex


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=70),
    block_size=st.sampled_from([1, 3, 16]),
    salt=st.text(max_size=8),
)
def test_keys_match_the_reference_layout(tokens: list[int], block_size: int, salt: str) -> None:
    assert KeySpace("m", block_size, salt).keys(tokens) == reference_keys(
        "m", block_size, salt, tokens
    )


def test_only_full_blocks_get_keys_and_tail_does_not_change_them() -> None:
    space = KeySpace("smollm2-135m")
    assert space.keys(range(15)) == []
    assert space.keys(range(32)) == space.keys(range(47))
    assert len(space.keys(range(48))) == 3


def test_keys_differ_across_model_block_size_salt_and_history() -> None:
    tokens = list(range(32))
    spaces = [
        KeySpace("smollm2-135m", 16, ""),
        KeySpace("tiny-random", 16, ""),
        KeySpace("smollm2-135m", 8, ""),
        KeySpace("smollm2-135m", 16, "tenant-a"),
    ]
    firsts = {s.keys(tokens)[0] for s in spaces}
    assert len(firsts) == len(spaces)
    # The same second block after a different first block gets a different key.
    a = KeySpace("m").keys([1] * 16 + [7] * 16)
    b = KeySpace("m").keys([2] * 16 + [7] * 16)
    assert a[1] != b[1]


def test_resuming_a_chain_gives_the_same_keys() -> None:
    tokens = list(range(100, 180))
    root = root_key("m", 16)
    full = block_keys(tokens, 16, root)
    assert block_keys(tokens, 16, root, parent=full[1], start_block=2) == full[2:]
    with pytest.raises(ValueError, match="parent"):
        block_keys(tokens, 16, root, start_block=2)


def test_chain_key_and_encode_tokens_are_the_links_block_keys_uses() -> None:
    tokens = list(range(16))
    root = root_key("m", 16)
    assert encode_tokens([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    assert chain_key(root, encode_tokens(tokens)) == block_keys(tokens, 16, root)[0]


def test_invalid_inputs_are_rejected() -> None:
    with pytest.raises(ValueError):
        root_key("m", 0)
    with pytest.raises(OverflowError):
        KeySpace("m", 1).keys([-1])
    with pytest.raises(OverflowError):
        KeySpace("m", 1).keys([2**32])


def test_short_key_is_the_first_16_bytes() -> None:
    key = KeySpace("m", 1).keys([5])[0]
    assert short_key(key) == key[:16] and len(short_key(key)) == 16


# --------------------------------------------------------------------------- codecs

short_keys = st.binary(min_size=16, max_size=16)


@given(
    seq=st.integers(0, 2**63),
    keys=st.lists(short_keys, max_size=5),
    parent=st.none() | short_keys,
    event_type=st.sampled_from(["stored", "removed", "cleared"]),
)
def test_block_event_round_trip(
    seq: int, keys: list[bytes], parent: bytes | None, event_type: str
) -> None:
    event = BlockEvent(seq, event_type, tuple(keys), parent)  # type: ignore[arg-type]
    fields = event.encode()
    assert BlockEvent.decode(fields) == event
    # Redis hands fields back as bytes.
    assert BlockEvent.decode({k.encode(): v.encode() for k, v in fields.items()}) == event


def test_block_event_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="unknown"):
        BlockEvent.decode({"seq": "1", "type": "moved", "keys": ""})
    with pytest.raises(ValueError, match="16-byte"):
        BlockEvent.decode({"seq": "1", "type": "removed", "keys": "ab" * 17})
    # As Redis returns them (bytes), each departure is a ValueError the follower skips.
    good = {b"seq": b"1", b"type": b"stored", b"keys": b"ab" * 16, b"parent": b"cd" * 16}
    assert BlockEvent.decode(good).parent == bytes.fromhex("cd" * 16)
    for field, value in [
        (b"type", b"moved"),
        (b"keys", b"zz" * 16),
        (b"keys", b"ab" * 15 + b"a"),
        (b"parent", b"cd" * 15),
        (b"parent", b"not hex!" * 4),
        (b"medium", b"disk"),
        (b"seq", b"one"),
        (b"keys", "é".encode() * 16),
    ]:
        with pytest.raises(ValueError):
            BlockEvent.decode({**good, field: value})
    with pytest.raises(ValueError, match="without a seq"):
        BlockEvent.decode({k: v for k, v in good.items() if k != b"seq"})
    assert BlockEvent.decode({**good, b"medium": b"host"}).medium == "host"


@given(
    seq=st.integers(0, 2**64 - 1),
    blocks=st.lists(st.tuples(st.none() | short_keys, short_keys), max_size=8),
)
def test_snapshot_round_trip(seq: int, blocks: list[tuple[bytes | None, bytes]]) -> None:
    snapshot_blocks = [SnapshotBlock(p, k) for p, k in blocks]
    decoded = decode_snapshot(encode_snapshot(seq, snapshot_blocks))
    assert decoded.seq == seq
    assert decoded.blocks == snapshot_blocks


def test_snapshot_rejects_garbage() -> None:
    one = encode_snapshot(1, [SnapshotBlock(None, bytes(16))])
    for decode in (decode_snapshot, snapshot_runs):
        with pytest.raises(ValueError, match="not a prefixgate snapshot"):
            decode(b"XXXX" + bytes(8))
        with pytest.raises(ValueError, match="truncated"):
            decode(one[:-1])
        with pytest.raises(ValueError, match="flag 4"):  # checked before any run is read
            decode(one[:12] + b"\x04" + one[13:])


@given(
    blocks=st.lists(
        st.tuples(st.none() | short_keys, short_keys, st.sampled_from(["device", "host"])),
        max_size=40,
    ),
    step=st.integers(1, 9),
)
def test_snapshot_runs_are_the_snapshots_tier_runs_last_first_in_steps(
    blocks: list[tuple[bytes | None, bytes, Medium]], step: int
) -> None:
    """What the router inserts: each run of one tier, last run first, cut from its end
    into pieces of at most ``step`` keys, each in snapshot order."""
    raw = encode_snapshot(7, blocks)
    runs = [
        (medium, [b.key for b in run])
        for medium, run in groupby(decode_snapshot(raw).blocks, key=attrgetter("medium"))
    ]
    expected = [
        (medium, keys[max(0, end - step) : end])
        for medium, keys in reversed(runs)
        for end in range(len(keys), 0, -step)
    ]
    read = snapshot_runs(raw, step)
    assert read.seq == 7 and list(read.runs) == expected


@given(
    gateway=st.text(max_size=10),
    replica=st.text(max_size=10),
    keys=st.lists(short_keys, max_size=5),
)
def test_routed_hint_round_trip(gateway: str, replica: str, keys: list[bytes]) -> None:
    hint = RoutedHint(gateway, replica, tuple(keys))
    assert RoutedHint.decode(hint.encode()) == hint
    assert RoutedHint.decode(hint.encode().encode()) == hint


def test_replica_info_round_trip() -> None:
    info = ReplicaInfo(
        replica_id="r0",
        url="http://127.0.0.1:8001",
        model="smollm2-135m",
        block_size=16,
        load=ReplicaLoad(running=2, waiting=1, free_blocks=10, used_blocks=5, total_blocks=15),
        timestamp=12.5,
    )
    assert ReplicaInfo.decode(info.encode()) == info
    assert ReplicaInfo.decode(info.encode().encode()) == info
    rank = dataclasses.replace(info, data_parallel_rank=3)
    assert ReplicaInfo.decode(rank.encode()) == rank


# Any JSON value: what a record, event field or hint of another version might hold.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)
RECORD = json.loads(ReplicaInfo("r0", "http://r0", "m", 16, ReplicaLoad(1), 2.0).encode())
HINT = json.loads(RoutedHint("g", "r", (bytes(16),), 3).encode())


@given(
    field=st.sampled_from(
        ["replica_id", "url", "model", "block_size", "load", "timestamp", "data_parallel_rank"]
    ),
    value=json_values,
)
def test_a_replica_record_decodes_or_raises_value_error(field: str, value: object) -> None:
    """The gateway's sync skips what raises ValueError; anything else would end its
    loop (router/sync.py)."""
    record = {**RECORD, field: value}
    try:
        info = ReplicaInfo.decode(json.dumps(record))
    except ValueError:
        return
    assert isinstance(info.url, str) and isinstance(info.model, str)
    assert 0 < info.block_size <= MAX_BLOCK_SIZE and math.isfinite(info.timestamp)
    rank = info.data_parallel_rank
    assert rank is None or (type(rank) is int and 0 <= rank <= MAX_DATA_PARALLEL_RANK)
    counts = [getattr(info.load, f.name) for f in dataclasses.fields(ReplicaLoad)]
    assert all(type(v) is int and 0 <= v <= MAX_LOAD_COUNT for v in counts)


@given(field=st.sampled_from(["g", "r", "k", "s"]), value=json_values)
def test_a_routed_hint_decodes_or_raises_value_error(field: str, value: object) -> None:
    try:
        hint = RoutedHint.decode(json.dumps({**HINT, field: value}))
    except ValueError:
        return
    assert all(len(k) == 16 for k in hint.keys)
    assert hint.seq is None or type(hint.seq) is int


@given(raw=st.binary(max_size=40) | json_values.map(lambda v: json.dumps(v).encode()))
def test_any_bytes_decode_or_raise_value_error(raw: bytes) -> None:
    for decode in (ReplicaInfo.decode, RoutedHint.decode, decode_snapshot):
        with contextlib.suppress(ValueError):  # any other exception fails the test
            decode(raw)
    with contextlib.suppress(ValueError):
        list(snapshot_runs(raw, 3).runs)


@given(
    entry=st.dictionaries(
        st.sampled_from([b"seq", b"type", b"keys", b"parent", b"medium", b"zone"]),
        st.binary(max_size=40) | st.sampled_from([b"1", b"stored", b"removed", b"00" * 16]),
    )
)
def test_a_block_event_entry_decodes_or_raises_value_error(entry: dict[bytes, bytes]) -> None:
    try:
        event = BlockEvent.decode(entry)
    except ValueError:
        seq = event_seq(entry)  # what the sync keeps of it
        assert seq is None or isinstance(seq, int)
        return
    assert all(len(k) == 16 for k in event.keys)
    assert event.parent is None or len(event.parent) == 16


def test_a_newer_replicas_record_and_an_older_ones_decode() -> None:
    newer = {**RECORD, "zone": "eu-1", "load": {**RECORD["load"], "offloaded_blocks": 3}}
    assert ReplicaInfo.decode(json.dumps(newer)) == ReplicaInfo.decode(json.dumps(RECORD))
    older = {**RECORD, "load": {"running": 1}}  # before queued_prefill_tokens and the rest
    assert ReplicaInfo.decode(json.dumps(older)).load == ReplicaLoad(1)
    assert "data_parallel_rank" in RECORD  # written, as null, for the whole engine
    before_ranks = {k: v for k, v in RECORD.items() if k != "data_parallel_rank"}
    assert ReplicaInfo.decode(json.dumps(before_ranks)).data_parallel_rank is None
    # The load is advice: a count out of range reads 0, and the replica stays routable.
    # (10**400 queued tokens made every routing decision raise OverflowError.)
    odd = {"running": -5, "waiting": "2", "queued_prefill_tokens": 10**400, "free_blocks": 3}
    assert ReplicaInfo.decode(json.dumps({**RECORD, "load": odd})).load == ReplicaLoad(
        free_blocks=3
    )
    assert ReplicaInfo.decode(json.dumps({**RECORD, "load": [1]})).load == ReplicaLoad()
    for url in ("http://[::1", "not a url", "ftp://x", "http://x:99999", "http:///v1"):
        with pytest.raises(ValueError, match="'url'"):
            ReplicaInfo.decode(json.dumps({**RECORD, "url": url}))
    with pytest.raises(ValueError, match="'block_size' must be 1 to 65536"):
        ReplicaInfo.decode(json.dumps({**RECORD, "block_size": 10**400}))
    with pytest.raises(ValueError, match="'block_size' must be a non-negative integer"):
        ReplicaInfo.decode(json.dumps({**RECORD, "block_size": "16"}))
    with pytest.raises(ValueError, match="'timestamp' must be finite"):
        ReplicaInfo.decode(json.dumps({**RECORD, "timestamp": float("inf")}))


def test_encoders_refuse_full_keys() -> None:
    # A 32-byte key would otherwise decode as two unrelated 16-byte keys.
    full = bytes(32)
    with pytest.raises(ValueError, match="16-byte"):
        BlockEvent(1, "removed", (full,)).encode()
    with pytest.raises(ValueError, match="16-byte"):
        BlockEvent(1, "stored", (bytes(16),), parent=full).encode()
    with pytest.raises(ValueError, match="16-byte"):
        encode_snapshot(1, [SnapshotBlock(None, full)])
    with pytest.raises(ValueError, match="16-byte"):
        RoutedHint("g", "r", (full,)).encode()


@pytest.mark.parametrize(
    ("url", "logged"),
    [
        ("redis://:s3cret@redis:6379/0", "redis://:***@redis:6379/0"),
        (
            "rediss://default:s3cret@cache.example.com:6380",
            "rediss://default:***@cache.example.com:6380",
        ),
        ("redis://user:p@ss:w@rd@host/0", "redis://user:***@host/0"),
        ("redis://user@host:6379", "redis://user@host:6379"),  # no password
        ("redis://redis:6379/0", "redis://redis:6379/0"),
        ("unix:///tmp/redis.sock", "unix:///tmp/redis.sock"),
        ("redis://:s3cret@[::1", "<a URL that does not parse>"),
        # redis-py reads these query parameters as the password and the key's passphrase
        (
            "rediss://h:6380/0?password=s3cret&ssl_ca_certs=/ca.pem&ssl_password=kp",
            "rediss://h:6380/0?password=***&ssl_ca_certs=/ca.pem&ssl_password=***",
        ),
        ("rediss://h:6380/0?ssl_cert_reqs=none", "rediss://h:6380/0?ssl_cert_reqs=none"),
    ],
)
def test_a_url_is_logged_without_its_password(url: str, logged: str) -> None:
    assert redacted_url(url) == logged
