"""Examples of stop-string matching on streamed text split at arbitrary points."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from runtime.errors import InvalidRequest
from runtime.text.stop_strings import StopResult, StopStringMatcher


def feed_all(matcher: StopStringMatcher, pieces: Sequence[str]) -> list[StopResult]:
    return [matcher.feed(piece) for piece in pieces]


def test_stop_string_spanning_three_pieces_is_cut_with_everything_after_it() -> None:
    matcher = StopStringMatcher(["lo w"])

    results = feed_all(matcher, ["Hel", "lo wor", "ld"])

    assert results[0] == StopResult("He")  # "l" may start "lo w"
    assert results[1] == StopResult("l", stopped=True, stop="lo w")
    assert results[2] == StopResult("", stopped=True, stop="lo w")
    assert matcher.flush() == ""


def test_held_back_prefix_is_released_once_it_cannot_match() -> None:
    matcher = StopStringMatcher(["</end>"])

    first = matcher.feed("a </e")
    second = matcher.feed("x and more")

    assert first == StopResult("a ")
    assert second == StopResult("</ex and more")
    assert matcher.flush() == ""


def test_partial_prefix_at_end_of_stream_is_returned_by_flush() -> None:
    matcher = StopStringMatcher(["STOP"])

    assert matcher.feed("all done ST") == StopResult("all done ")
    assert matcher.flush() == "ST"
    assert not matcher.stopped


def test_earliest_completed_stop_wins_among_several() -> None:
    matcher = StopStringMatcher(["world", "o w", "xyz"])

    results = feed_all(matcher, ["hello", " wo", "rld"])

    assert "".join(r.text for r in results) == "hell"
    assert results[1].stopped and results[1].stop == "o w"


def test_stops_completing_on_the_same_character_pick_the_longest() -> None:
    matcher = StopStringMatcher(["c", "abc"])

    result = matcher.feed("xxabcd")

    assert result == StopResult("xx", stopped=True, stop="abc")


def test_a_stop_ending_first_wins_over_an_enclosing_stop_that_starts_earlier() -> None:
    # Split-independent: "bc" completes before "abcd" could, whatever the piece boundaries.
    whole = StopStringMatcher(["abcd", "bc"]).feed("abcd")
    streamed = feed_all(StopStringMatcher(["abcd", "bc"]), ["ab", "c", "d"])

    assert whole == StopResult("a", stopped=True, stop="bc")
    assert "".join(r.text for r in streamed) == "a"


def test_stop_at_the_very_start_emits_nothing() -> None:
    matcher = StopStringMatcher(["<|im_end|>"])

    results = feed_all(matcher, ["<|im", "_end|>", "trailing"])

    assert [r.text for r in results] == ["", "", ""]
    assert results[1].stopped and results[1].stop == "<|im_end|>"


def test_overlapping_self_prefix_is_found_after_a_false_start() -> None:
    # "aab" inside "aaab": a naive matcher that restarts after the mismatch misses it.
    matcher = StopStringMatcher(["aab"])

    results = feed_all(matcher, ["a", "a", "a", "b", "c"])

    assert "".join(r.text for r in results) == "a"
    assert results[3].stop == "aab"


def test_unicode_stop_split_between_code_points() -> None:
    matcher = StopStringMatcher(["👋🏽 终"])

    results = feed_all(matcher, ["héllo 👋", "🏽", " 终了"])

    assert "".join(r.text for r in results) == "héllo "
    assert results[2].stopped and results[2].stop == "👋🏽 终"


def test_no_stops_passes_text_through_unchanged() -> None:
    matcher = StopStringMatcher([])

    assert matcher.feed("anything") == StopResult("anything")
    assert matcher.flush() == ""


def test_held_back_text_never_exceeds_longest_stop_minus_one() -> None:
    matcher = StopStringMatcher(["abcd", "cx"])

    assert matcher.feed("xxabc") == StopResult("xx")  # "abc" may still become "abcd"
    assert matcher.feed("a") == StopResult("abc")  # only "a" may still start a stop
    assert matcher.feed("bcx") == StopResult("ab", stopped=True, stop="cx")


@pytest.mark.parametrize("stops", [[""], ["ok", ""]])
def test_empty_stop_string_is_rejected(stops: list[str]) -> None:
    with pytest.raises(InvalidRequest, match="must be non-empty"):
        StopStringMatcher(stops)
