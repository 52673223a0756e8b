"""Where non-trimmable caches are snapshotted."""

from __future__ import annotations

from collections.abc import Sequence

from actors.engine.checkpoints import plan_checkpoints


def decode(ids: Sequence[int]) -> str:
    return "".join(" w" if t == 0 else "x" for t in ids)  # token 0 starts a word


def test_end_of_prompt_minus_one_and_the_last_word_boundary() -> None:
    tokens = [5, 0, 5, 5, 0, 5, 5]  # words start at 1 and 4
    assert plan_checkpoints(tokens, start=0, target=7, every=0, decode=decode) == [4, 6]


def test_every_k_tokens_and_nothing_at_or_before_the_cached_start() -> None:
    tokens = [5] * 20
    assert plan_checkpoints(tokens, start=8, target=20, every=4, decode=decode) == [12, 16, 19]


def test_a_prewarm_target_excludes_its_own_end() -> None:
    tokens = [5, 5, 0, 5, 5]
    # A prewarm prefills len - 1 tokens and commits that state itself.
    assert plan_checkpoints(tokens, start=0, target=4, every=0, decode=decode) == [2]


def test_the_end_of_the_instructions_is_a_checkpoint_when_known() -> None:
    tokens = [5] * 30
    plan = plan_checkpoints(tokens, start=0, target=30, every=0, decode=decode, instructions_end=12)
    assert plan == [12, 29]
