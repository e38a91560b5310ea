from __future__ import annotations

from collections.abc import Sequence

from replica.detokenize import IncrementalDetokenizer, StopStringMatcher


class ByteTokenizer:
    """Token i < 256 is byte i: a multi-byte character spans several tokens."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def _stream(text: str) -> list[str]:
    detok = IncrementalDetokenizer(ByteTokenizer())
    return [detok.push(b) for b in text.encode()] + [detok.flush()]


def test_multibyte_characters_are_never_split() -> None:
    text = "a€b😀c"
    pieces = _stream(text)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "€" in pieces and "😀" in pieces  # each emitted whole, by the token ending it


def test_a_truncated_character_is_flushed_at_the_end() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer())
    assert detok.push(ord("x")) == "x"
    assert detok.push(0xE2) == ""  # first byte of a 3-byte character: held back
    assert detok.flush() == "\ufffd"


def test_stop_string_prefix_is_held_until_decided() -> None:
    m = StopStringMatcher(["END"])
    assert m.feed("hello E").text == "hello "
    check = m.feed("X")  # "EX" is not the start of "END": release it
    assert check == ("EX", False)
    assert m.feed("foo EN").text == "foo "
    assert m.feed("D and more") == ("", True)


def test_stop_string_inside_one_piece_cuts_before_it() -> None:
    m = StopStringMatcher(["\n\n", "###"])
    assert m.matched is None
    assert m.feed("one\ntwo###three\n\n") == ("one\ntwo", True)
    assert m.matched == "###"  # the earliest in the text, not the first listed


def test_the_stop_string_that_matched_is_recorded_across_pieces() -> None:
    m = StopStringMatcher(["END", "STOP"])
    assert m.feed("a ST").text == "a "
    assert m.matched is None
    assert m.feed("OP") == ("", True) and m.matched == "STOP"


def test_held_text_is_released_when_output_ends() -> None:
    m = StopStringMatcher(["abc"])
    assert m.feed("xyab").text == "xy"
    assert m.flush() == "ab"


def test_no_stops_passes_everything() -> None:
    m = StopStringMatcher([])
    assert m.feed("anything") == ("anything", False)
