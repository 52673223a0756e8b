"""Streaming text properties: stop strings and coalescing lose, duplicate or leak nothing.

Texts are drawn from a small alphabet (with non-ASCII characters) so stop strings occur often and
overlap themselves; they are split at random points as a tokenizer would. The stop-string matcher is
checked against matching the whole text at once; the coalescer against the plain concatenation of
what was added. Settings come from the active Hypothesis profile.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from runtime.text.coalesce import Chunk, CoalescePolicy, Coalescer
from runtime.text.stop_strings import StopStringMatcher

ALPHABET = "ab \u00e9\U0001f44b"


@st.composite
def stops_and_text(draw: st.DrawFn) -> tuple[list[str], str]:
    """Stops that often end with one another, and a text built partly from pieces of them."""
    stops = draw(st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=3))
    suffix_stop = draw(st.booleans())
    if stops and suffix_stop:
        stops.append(stops[0][draw(st.integers(0, len(stops[0]) - 1)) :])
    pieces = st.sampled_from([*stops, *ALPHABET]).flatmap(
        lambda s: st.just(s) | st.just(s[: len(s) // 2 + 1])
    )
    return stops, "".join(draw(st.lists(pieces, max_size=20)))


def split_at(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted({c % (len(text) + 1) for c in cuts}), len(text)]
    return [text[start:end] for start, end in itertools.pairwise(bounds)]


def expected_output(text: str, stops: list[str]) -> tuple[str, str | None]:
    """The whole text matched at once: the stop that completes first (longest on a tie) wins."""
    for end in range(1, len(text) + 1):
        for stop in sorted(stops, key=len, reverse=True):
            if text.endswith(stop, 0, end):
                return text[: end - len(stop)], stop
    return text, None


@given(case=stops_and_text(), cuts=st.lists(st.integers(min_value=0, max_value=100)))
def test_streamed_output_is_the_text_before_the_first_stop(
    case: tuple[list[str], str], cuts: list[int]
) -> None:
    stops, text = case
    matcher = StopStringMatcher(stops)
    longest = max((len(s) for s in stops), default=0)
    emitted: list[str] = []
    consumed = 0
    matched: str | None = None

    for piece in split_at(text, cuts):
        result = matcher.feed(piece)
        emitted.append(result.text)
        consumed += len(piece)
        assert not any(stop in result.text for stop in stops)
        if result.stopped:
            matched = result.stop
            break
        # Held back only what may still start a stop string.
        assert consumed - len("".join(emitted)) <= max(longest - 1, 0)
    if matched is None:
        emitted.append(matcher.flush())

    output = "".join(emitted)
    assert (output, matched) == expected_output(text, stops)
    assert not any(stop in output for stop in stops)


@dataclass(frozen=True)
class Add:
    text: str
    dt: float


@dataclass(frozen=True)
class TimerFired:
    pass


@dataclass(frozen=True)
class NonTokenEvent:
    pass


steps = st.lists(
    st.one_of(
        st.builds(Add, st.text(alphabet=ALPHABET, max_size=12), st.floats(0.0, 0.1)),
        st.just(TimerFired()),
        st.just(NonTokenEvent()),
    ),
    max_size=40,
)
policies = st.builds(
    CoalescePolicy,
    max_chars=st.integers(min_value=1, max_value=16),
    max_age_s=st.floats(min_value=0.0, max_value=0.2),
    enabled=st.booleans(),
)


@given(policy=policies, steps=steps)
def test_coalescer_keeps_every_token_once_in_order_within_size(
    policy: CoalescePolicy, steps: list[Add | TimerFired | NonTokenEvent]
) -> None:
    coalescer = Coalescer(policy)
    now = 0.0
    added: list[str] = []
    chunks: list[Chunk] = []

    def collect(chunk: Chunk | None) -> None:
        if chunk is None:
            return
        assert chunk.token_ids, "a chunk is never empty: every add carries a token id"
        covered = [added[i] for i in chunk.token_ids]
        assert chunk.text == "".join(covered)
        assert len(chunk.text) <= policy.max_chars or len(covered[-1]) >= policy.max_chars
        chunks.append(chunk)

    for step in steps:
        match step:
            case Add(text=text, dt=dt):
                now += dt
                added.append(text)
                collect(coalescer.add(text, [len(added) - 1], now))
                deadline = coalescer.next_deadline()
                assert deadline is None or now <= deadline, "an overdue buffer is sent on add"
            case TimerFired():
                deadline = coalescer.next_deadline()
                if deadline is not None:
                    now = max(now, deadline)
                    collect(coalescer.due(now))
                    assert coalescer.next_deadline() is None
            case NonTokenEvent():
                collect(coalescer.flush())
                assert coalescer.next_deadline() is None
        if not policy.enabled:
            assert len(chunks) == len(added)
    collect(coalescer.flush())

    assert "".join(c.text for c in chunks) == "".join(added)
    assert [i for c in chunks for i in c.token_ids] == list(range(len(added)))
