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

Tiers (bridge/media.py maps the engine's ``medium``): an engine block keeps the same hash
in every medium, so a block's copies are counted per tier, and the block is routed as on
the device while it has a copy there, else as on the host:

    store in a tier          a new block's keys appear in that tier; a host block's
                             keys are promoted by a device copy
    remove in a tier         a block's last copy gone: its keys are removed (unless
                             another block produces them); the device copy gone and a
                             host copy left: its keys are demoted to the host
    AllBlocksCleared         every tier is forgotten (vLLM sends one per cache reset)

KV-cache groups: a hybrid model (gpt-oss, Gemma 2 and 3, Qwen3-Next and other models
with sliding-window or linear-attention layers) has several groups in vLLM, each caching
every block under the same hash and publishing its own events (``group_idx``). A hit
needs a full-attention group's blocks from the prompt's start; a sliding-window group
needs only the window before the hit, a Mamba group only the state there, and both let
the blocks before it go first (a sliding-window group frees them while the request still
runs). So the translator follows one group: the lowest-numbered whose kind (vLLM 0.32
names it on stores, ``kv_cache_spec_kind``) is full attention, else group 0. A model's
first group is often a sliding-window or Mamba one (its first layer's): following it
would lose the prefixes whose early blocks it evicts, and a Mamba group's blocks, which
skip positions, would come as orphans. When a store names a full-attention group below the one
followed, the translator forgets what it published and follows that group (once per
engine, at its first stores).

A bare store (no token ids, as vLLM's offloading connectors send by default) adds a
copy to a block already described, and is counted and skipped for one never seen. A key
whose tokens span several engine pages (SGLang's 1-token pages) takes the tier of the
page that completed it: radix caches evict leaf first and load back root first, so that
page is the first to leave the device and the last to return, and in that order the key
is not priced as on the device while part of it has left.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from bridge.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, salt_of
from bridge.media import MediumMap
from bridge.published import NO_COPIES, Copies, PublishedKeys
from router.protocol import (
    DEFAULT_BLOCK_SIZE,
    Medium,
    SnapshotBlock,
    chain_key,
    encode_tokens,
    root_key,
    short_key,
)

log = logging.getLogger("prefixgate.bridge")

# The kinds of KV-cache group whose blocks hold the whole prefix they end (vLLM's names).
PREFIX_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
MAX_GROUPS = 256  # group numbers learned; vLLM's models have a handful


class BlockState(NamedTuple):
    """What prefixgate knows after one engine block."""

    model_id: str
    salt: str
    last_key: bytes | None  # full key of the last complete group; None: still at the root
    tail: tuple[int, ...]  # tokens after last_key, fewer than a block
    keys: tuple[bytes, ...]  # short keys this engine block completed
    parent: bytes | None  # short key before keys[0] (None: keys start at the root)


class Chain(NamedTuple):
    """Keys to publish as stored in ``medium``, in order, the first a child of ``parent``."""

    parent: bytes | None
    keys: tuple[bytes, ...]
    medium: Medium


class Update(NamedTuple):
    """What one engine event changes in the published view."""

    stored: tuple[Chain, ...] = ()  # new, refreshed, promoted or demoted keys
    removed: tuple[bytes, ...] = ()  # keys held in no tier any more
    orphan: bool = False  # a stored block's parent was unknown: nothing was produced

    @property
    def stored_keys(self) -> tuple[bytes, ...]:
        return tuple(k for chain in self.stored for k in chain.keys)


@dataclass(slots=True)
class TranslatorStats:
    stored_blocks: int = 0  # engine blocks seen for the first time
    removed_blocks: int = 0  # removals of a block's copy in a tier
    orphans: int = 0  # stored events dropped because their parent was unknown
    unknown_removals: int = 0  # removed copies we never saw stored
    undescribed: int = 0  # bare store announcements for blocks never described
    ignored: int = 0  # events for an untracked medium or another KV-cache group


@dataclass(slots=True)
class _Changes:
    stored: list[tuple[bytes, Medium]] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)


@dataclass(slots=True)
class KeyTranslator:
    model_id: str
    block_size: int = DEFAULT_BLOCK_SIZE
    media: MediumMap = field(default_factory=MediumMap)
    blocks: dict[BlockHash, BlockState] = field(default_factory=dict)  # held in some tier
    copies: dict[BlockHash, Copies] = field(default_factory=dict)  # same keys as blocks
    published: PublishedKeys = field(default_factory=PublishedKeys)
    stats: TranslatorStats = field(default_factory=TranslatorStats)
    group: int = 0  # the engine's KV-cache group followed (events without one: group 0)
    kinds: dict[int, str] = field(default_factory=dict)  # each group's kind, as named

    def stored(self, event: BlockStored) -> Update:
        dropped = self._learn(event.group_idx, event.kind) if event.kind is not None else ()
        tier = self._tier(event.medium, event.group_idx)
        if tier is None:
            return Update(removed=dropped)
        changes = _Changes(removed=list(dropped))
        if not event.token_ids:  # a bare announcement: only blocks described before
            for block_hash in event.block_hashes:
                known = self.blocks.get(block_hash)
                if known is None:
                    self.stats.undescribed += 1
                else:
                    self._count(block_hash, known, tier, +1, changes, announced=tier)
            return self._update(changes)
        if event.parent is None:
            model = event.lora_name or self.model_id
            state = BlockState(model, salt_of(event), None, (), (), None)
        elif event.parent in self.blocks:
            state = self.blocks[event.parent]
        else:
            self.stats.orphans += 1
            return Update(orphan=True)
        size = event.block_size
        for i, block_hash in enumerate(event.block_hashes):
            known = self.blocks.get(block_hash)
            if known is None:
                state = self._advance(state, event.token_ids[i * size : (i + 1) * size])
                self.blocks[block_hash] = state
                self.stats.stored_blocks += 1
            else:  # another copy (another tier, a duplicate block): same state
                state = known
            self._count(block_hash, state, tier, +1, changes, announced=tier)
        return self._update(changes)

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
        parent = short_key(state.last_key) if state.last_key is not None else None
        tail = buffer[n_full * B :]
        return BlockState(state.model_id, state.salt, last, tail, tuple(shorts), parent)

    def removed(self, event: BlockRemoved) -> Update:
        """The keys that left the cache with these engine blocks' copies in the event's
        tier, and those that now live only in the other tier (demoted)."""
        tier = self._tier(event.medium, event.group_idx)
        if tier is None:
            return Update()
        changes = _Changes()
        for block_hash in event.block_hashes:
            state = self.blocks.get(block_hash)
            held = self.copies.get(block_hash, NO_COPIES)
            if state is None or not (held.device if tier == "device" else held.host):
                self.stats.unknown_removals += 1
                continue
            self.stats.removed_blocks += 1
            self._count(block_hash, state, tier, -1, changes, announced=None)
        return self._update(changes)

    def _tier(self, medium: str | None, group_idx: int | None) -> Medium | None:
        tier = self.media.tier(medium) if (group_idx or 0) == self.group else None
        if tier is None:
            self.stats.ignored += 1
        return tier

    def _learn(self, group_idx: int | None, kind: str) -> tuple[bytes, ...]:
        """Note a group's kind; when that changes the group to follow, switch to it and
        return the keys published from the other (they are forgotten)."""
        group = group_idx or 0
        if self.kinds.get(group) == kind or not 0 <= group < MAX_GROUPS:
            return ()
        self.kinds[group] = kind
        full = [g for g, k in self.kinds.items() if k in PREFIX_KINDS]
        follow = min(full) if full else 0
        if follow == self.group:
            return ()
        log.info(
            "following the engine's KV-cache group %d (%s) for prefixes; groups named so far: %s",
            follow,
            self.kinds.get(follow, "unnamed"),
            ", ".join(f"{g} {k}" for g, k in sorted(self.kinds.items())),
        )
        self.group = follow
        dropped = tuple(self.published.producers)
        self.cleared()
        return dropped

    def _count(
        self,
        block_hash: BlockHash,
        state: BlockState,
        tier: Medium,
        n: int,
        changes: _Changes,
        announced: Medium | None,
    ) -> None:
        """Add ``n`` copies of the block in ``tier`` and note what that changed for its
        keys. ``announced``: a store's tier, whose keys are published even when their
        tier did not change (a refresh for readers' LRU); None for a removal."""
        before = self.copies.get(block_hash, NO_COPIES)
        after = before.plus(tier, n)
        old_tier, new_tier = before.tier, after.tier
        if new_tier is None:
            del self.copies[block_hash]
            del self.blocks[block_hash]
        else:
            self.copies[block_hash] = after
        keys = state.keys
        published = self.published
        tier_of = published.tier
        if old_tier == new_tier:  # the keys stay where they are: a store refreshes them
            if announced is not None:
                for key in keys:
                    if tier_of(key) == announced:
                        changes.stored.append((key, announced))
            return
        producers = published.producers
        if new_tier is None and old_tier is not None and all(producers.get(k) == 1 for k in keys):
            published.drop(keys, old_tier)  # the usual case: the block's keys leave
            changes.removed.extend(keys)
            return
        was = [tier_of(k) for k in keys]
        if old_tier is None:
            assert new_tier is not None
            published.add(keys, state.parent, new_tier)
            if not any(was):  # the usual case: new keys, all in the block's tier
                changes.stored.extend((key, new_tier) for key in keys)
                return
        elif new_tier is None:
            published.drop(keys, old_tier)
        else:
            published.move(keys, new_tier)
        for key, old in zip(keys, was, strict=True):
            new = tier_of(key)
            if new is None:
                if old is not None:
                    changes.removed.append(key)
            elif new == announced or new != old:
                changes.stored.append((key, new))

    def _update(self, changes: _Changes) -> Update:
        """Stored keys as chains: a chain continues while the next key is the child of
        the one before and in the same tier."""
        if not changes.stored:
            return Update((), tuple(changes.removed))
        chains: list[Chain] = []
        parents = self.published.parents
        run: list[bytes] = []
        run_tier: Medium = "device"
        for key, tier in changes.stored:
            if run and (tier != run_tier or parents[key] != run[-1]):
                chains.append(Chain(parents[run[0]], tuple(run), run_tier))
                run = []
            run.append(key)
            run_tier = tier
        if run:
            chains.append(Chain(parents[run[0]], tuple(run), run_tier))
        return Update(tuple(chains), tuple(changes.removed))

    def cleared(self, event: AllBlocksCleared | None = None) -> None:
        """Forget everything, in every tier (the engine dropped its cache, restarted, or
        events were lost beyond repair)."""
        self.blocks.clear()
        self.copies.clear()
        self.published.clear()

    def snapshot(self) -> list[SnapshotBlock]:
        """The published keys with their tiers, parents before children."""
        return self.published.snapshot()

    def check_invariants(self) -> None:
        assert self.blocks.keys() == self.copies.keys(), "blocks and their copies disagree"
        producers: dict[bytes, int] = {}
        on_host: dict[bytes, int] = {}
        for block_hash, state in self.blocks.items():
            assert len(state.tail) < self.block_size, "a tail holds a whole block"
            held = self.copies[block_hash]
            assert held.device >= 0 and held.host >= 0 and held.tier is not None, "no copy"
            for key in state.keys:
                producers[key] = producers.get(key, 0) + 1
                if held.tier == "host":
                    on_host[key] = on_host.get(key, 0) + 1
        assert producers == self.published.producers, "producer counts differ from blocks"
        assert on_host == self.published.on_host, "host counts differ from blocks"
        self.published.check_invariants()
