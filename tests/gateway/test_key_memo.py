"""``KeyMemo`` (gateway/key_memo.py) gives exactly ``KeySpace.short_keys``, whatever the
prompts share, across key spaces, through eviction; and it reuses what it can."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.key_memo import KeyMemo
from gateway.routing import KeyBuilder, prompt_keys
from prefixgate.wire import CompletionRequest
from router.protocol import KeySpace

SPACES = [KeySpace("m", 16, ""), KeySpace("m", 16, "tenant"), KeySpace("m", 4, "")]
tokens = st.lists(st.integers(0, 2**32 - 1), max_size=200)


@settings(max_examples=200, deadline=None)
@given(
    base=tokens,
    steps=st.lists(
        st.tuples(st.integers(0, 200), tokens, st.sampled_from(range(len(SPACES)))),
        min_size=1,
        max_size=12,
    ),
    budget=st.sampled_from([0, 2_000, 20_000, 1 << 20]),
)
def test_the_memo_gives_the_key_spaces_keys(
    base: list[int], steps: list[tuple[int, list[int], int]], budget: int
) -> None:
    memo = KeyMemo(budget, max_entries=3)
    for cut, tail, space in steps:
        prompt = base[:cut] + tail  # shares a prefix of some length with the others
        assert memo.short_keys(SPACES[space], prompt) == SPACES[space].short_keys(prompt)
        memo.check_invariants()


def test_a_shared_prefix_is_hashed_once() -> None:
    memo = KeyMemo()
    space = SPACES[0]
    prefix = list(range(16 * 100))
    first = memo.short_keys(space, [*prefix, 1, 2, 3])
    assert memo.reused == 0
    second = memo.short_keys(space, [*prefix, *range(7, 7 + 40)])
    assert memo.reused == 100  # every block of the prefix, none of the new ones
    assert second[:100] == first[:100] and second == space.short_keys([*prefix, *range(7, 47)])
    assert memo.short_keys(SPACES[1], prefix) == SPACES[1].short_keys(prefix)
    assert memo.reused == 100  # another salt: another chain, nothing to reuse
    memo.check_invariants()


def test_prompt_keys_with_and_without_the_memo_agree() -> None:
    builder = KeyBuilder(loader=lambda name, template, mode: None)  # type: ignore[arg-type,return-value]
    ids = list(range(16 * 8 + 5))
    for prompt in (ids, ids[:40], [*ids, 9, 9, 9]):
        request = CompletionRequest(model="m", prompt=prompt)
        with_memo = prompt_keys(request, None, "m", 16, "s", builder.memo)
        assert with_memo == prompt_keys(request, None, "m", 16, "s")
        text = CompletionRequest(model="m", prompt="x" * 300 + str(len(prompt)))
        assert prompt_keys(text, None, "m", 16, "", builder.memo) == prompt_keys(
            text, None, "m", 16, ""
        )
    assert builder.memo.reused > 0
    builder.memo.check_invariants()
