"""Engine blocks → prefixgate block keys.

An engine names a cached block by its own hash and reports the block's token ids and its
parent's hash. prefixgate's keys (router/protocol.py) are chained SHA-256 over 16-token
blocks under a root of (model id, block size, salt). The translator walks each stored
engine block from its parent's state:

    parent state: last full key K (None: the chain's root), tail T (< B tokens held back)
    buffer      = T ‖ block tokens
    keys        = chain_key(K, B tokens) for every full B-token group of buffer
    new state   = (last of those keys, or K), leftover tokens of buffer

So an engine block of k×B tokens yields k keys, and pages that are no multiple of B
(SGLang's 1-token pages, say) are regrouped, a partial group held until a child fills
it. The model id is the served model name, or the block's ``lora_name`` (a LoRA adapter
is served, and routed, as a model of its own); the salt comes from the first block's
``extra_keys``; children inherit both from their parent.

``engine hash → state`` remembers which keys each engine block produced, so a removal
takes back exactly those keys. A key produced by two engine blocks (possible where the
engine hashes inputs prefixgate's keys do not cover, e.g. multimodal ids) is counted and
leaves only with its last producer. A stored block whose parent is unknown (events were
missed) is never guessed: ``stored`` reports it as an orphan and produces nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from bridge.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, salt_of
from router.protocol import (
    DEFAULT_BLOCK_SIZE,
    SnapshotBlock,
    chain_key,
    encode_tokens,
    root_key,
    short_key,
)

# Where the engine keeps blocks it can hit on: vLLM's GPU medium (None in older versions).
TRACKED_MEDIA = (None, "GPU")


class BlockState(NamedTuple):
    """What prefixgate knows after one engine block."""

    model_id: str
    salt: str
    last_key: bytes | None  # full key of the last complete group; None: still at the root
    tail: tuple[int, ...]  # tokens after last_key, fewer than a block
    keys: tuple[bytes, ...]  # short keys this engine block completed


class Stored(NamedTuple):
    """A chain to publish: ``keys`` in order, the first a child of ``parent``."""

    parent: bytes | None
    keys: tuple[bytes, ...]
    orphan: bool  # the parent was unknown: nothing was produced


@dataclass(slots=True)
class TranslatorStats:
    stored_blocks: int = 0
    removed_blocks: int = 0
    orphans: int = 0  # stored events dropped because their parent was unknown
    unknown_removals: int = 0  # removed engine blocks we never saw stored
    ignored: int = 0  # events for another medium or KV-cache group


@dataclass(slots=True)
class KeyTranslator:
    model_id: str
    block_size: int = DEFAULT_BLOCK_SIZE
    blocks: dict[BlockHash, BlockState] = field(default_factory=dict)
    # The published mirror: short key → (short parent, how many engine blocks produced it).
    parents: dict[bytes, bytes | None] = field(default_factory=dict)
    producers: dict[bytes, int] = field(default_factory=dict)
    stats: TranslatorStats = field(default_factory=TranslatorStats)

    def stored(self, event: BlockStored) -> Stored:
        if event.medium not in TRACKED_MEDIA or event.group_idx not in (None, 0):
            self.stats.ignored += 1
            return Stored(None, (), orphan=False)
        if event.parent is None:
            model = event.lora_name or self.model_id
            state = BlockState(model, salt_of(event), None, (), ())
        elif event.parent in self.blocks:
            state = self.blocks[event.parent]
        else:
            self.stats.orphans += 1
            return Stored(None, (), orphan=True)
        first_parent = short_key(state.last_key) if state.last_key is not None else None
        produced: list[bytes] = []
        size = event.block_size
        for i, block_hash in enumerate(event.block_hashes):
            known = self.blocks.get(block_hash)
            if known is not None:  # re-stored (e.g. replayed): same state, nothing new
                state = known
                produced.extend(known.keys)
                continue
            parent = short_key(state.last_key) if state.last_key is not None else None
            state = self._advance(state, event.token_ids[i * size : (i + 1) * size])
            self.blocks[block_hash] = state
            self._add_keys(state.keys, parent)
            produced.extend(state.keys)
            self.stats.stored_blocks += 1
        return Stored(first_parent, tuple(produced), orphan=False)

    def _advance(self, state: BlockState, tokens: Iterable[int]) -> BlockState:
        B = self.block_size
        buffer = (*state.tail, *tokens)
        n_full = len(buffer) // B
        prev = state.last_key
        if n_full and prev is None:
            prev = root_key(state.model_id, B, state.salt)
        shorts: list[bytes] = []
        for g in range(n_full):
            assert prev is not None
            prev = chain_key(prev, encode_tokens(buffer[g * B : (g + 1) * B]))
            shorts.append(short_key(prev))
        last = prev if n_full else state.last_key
        return BlockState(state.model_id, state.salt, last, buffer[n_full * B :], tuple(shorts))

    def _add_keys(self, keys: tuple[bytes, ...], parent: bytes | None) -> None:
        for key in keys:
            count = self.producers.get(key, 0)
            if count == 0:
                self.parents[key] = parent
            self.producers[key] = count + 1
            parent = key

    def removed(self, event: BlockRemoved) -> tuple[bytes, ...]:
        """The short keys that left the cache with these engine blocks."""
        if event.medium not in TRACKED_MEDIA or event.group_idx not in (None, 0):
            self.stats.ignored += 1
            return ()
        gone: list[bytes] = []
        for block_hash in event.block_hashes:
            state = self.blocks.pop(block_hash, None)
            if state is None:
                self.stats.unknown_removals += 1
                continue
            self.stats.removed_blocks += 1
            for key in state.keys:
                count = self.producers[key] - 1
                if count:
                    self.producers[key] = count
                else:
                    del self.producers[key]
                    del self.parents[key]
                    gone.append(key)
        return tuple(gone)

    def cleared(self, event: AllBlocksCleared | None = None) -> None:
        """Forget everything (the engine dropped its cache, restarted, or events were lost
        beyond repair)."""
        self.blocks.clear()
        self.parents.clear()
        self.producers.clear()

    def snapshot(self) -> list[SnapshotBlock]:
        """The published keys, parents before children."""
        out: list[SnapshotBlock] = []
        emitted: set[bytes] = set()
        for key in self.parents:
            path: list[bytes] = []
            k: bytes | None = key
            while k is not None and k in self.parents and k not in emitted and k not in path:
                path.append(k)
                k = self.parents[k]
            for node in reversed(path):
                out.append(SnapshotBlock(self.parents[node], node))
                emitted.add(node)
        return out

    def check_invariants(self) -> None:
        counts: dict[bytes, int] = {}
        for state in self.blocks.values():
            assert len(state.tail) < self.block_size, "a tail holds a whole block"
            for key in state.keys:
                counts[key] = counts.get(key, 0) + 1
        assert counts == self.producers, "producer counts differ from the blocks' keys"
        assert self.parents.keys() == self.producers.keys(), "mirror and counts disagree"
