"""Where non-trimmable caches are snapshotted, and how densely."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import pytest

from actors.engine.checkpoints import (
    BRANCH_REACH,
    BUDGET_SHARE,
    MAX_POINTS,
    MIN_SPACING,
    PERIODIC_GAP_SHARE,
    CheckpointPolicy,
    CheckpointRule,
    plan_checkpoints,
)
from runtime.backends.contract import ModelInfo, ReuseStrategy

ANY = CheckpointRule(spacing=0, most=MAX_POINTS)
GIB = 1 << 30


def decode(ids: Sequence[int]) -> str:
    # Token 0 starts a word, token 1 ends a line.
    return "".join(" w" if t == 0 else ".\n" if t == 1 else "x" for t in ids)


def info(
    bytes_per_token: int,
    window: int | None = None,
    window_bytes_per_token: int = 0,
    fixed: int = 0,
    reuse: ReuseStrategy = ReuseStrategy.CHECKPOINT,
) -> ModelInfo:
    return ModelInfo(
        context_length=32768,
        vocab_size=512,
        eos_token_ids=frozenset(),
        reuse=reuse,
        reuse_reason="test",
        bytes_per_token=bytes_per_token,
        window_tokens=window,
        window_bytes_per_token=window_bytes_per_token,
        fixed_state_bytes=fixed,
    )


# The layouts measured at load (reuse.md): tiny sliding and hybrid, and Gemma 3 270M in float32.
TINY_SLIDING = info(1024, window=32, window_bytes_per_token=1024)
TINY_HYBRID = info(1024, fixed=38912)
GEMMA3_270M = info(6144, window=512, window_bytes_per_token=30720)


def test_the_end_of_the_prompt_and_the_last_word_boundary() -> None:
    tokens = [5, 0, 5, 5, 0, 5, 5]  # words start at 1 and 4
    # The end: the last pass ends there anyway, so its snapshot cuts no pass of its own.
    assert plan_checkpoints(tokens, 0, 7, decode, ANY) == [4, 7]


def test_the_starts_of_the_last_lines_near_the_end() -> None:
    tokens = [5] * 40
    for end_of_line in (3, 9, 20, 30, 38):
        tokens[end_of_line] = 1
    # The latest three line starts below the end (point 1), not those at 4 and 10.
    assert plan_checkpoints(tokens, 0, 40, decode, ANY) == [21, 31, 39, 40]
    # Only those above the cached start.
    assert plan_checkpoints(tokens, 21, 40, decode, ANY) == [31, 39, 40]


def test_line_starts_are_looked_for_only_within_the_branch_reach() -> None:
    tokens = [5] * (BRANCH_REACH + 100)
    tokens[50] = tokens[99] = 1  # line starts at 51 and 100: 100 lies within the reach
    end = len(tokens)
    plan = plan_checkpoints(tokens, 0, end, decode, ANY)
    assert plan == [end - BRANCH_REACH, end]  # end - BRANCH_REACH is 100
    tokens[150] = 1
    assert plan_checkpoints(tokens, 0, end, decode, ANY) == [100, 151, end]


def test_a_point_branch_reach_tokens_before_the_end() -> None:
    tokens = [5] * 1000
    assert plan_checkpoints(tokens, 0, 1000, decode, ANY) == [1000 - BRANCH_REACH, 1000]
    assert plan_checkpoints(tokens, 500, 1000, decode, ANY) == [1000]  # below the cached start


def test_a_capped_plan_prefers_the_last_line_to_messages_and_the_reach() -> None:
    tokens = [5] * 1000
    tokens[899] = tokens[949] = 1  # the last two lines start at 900 and 950
    rule = CheckpointRule(spacing=0, most=4)
    plan = plan_checkpoints(tokens, 0, 1000, decode, rule, message_ends=(300, 600))
    assert plan == [600, 900, 950, 1000]  # not 300, nor the reach's 488


def test_every_spacing_tokens_and_nothing_at_or_before_the_cached_start() -> None:
    tokens = [5] * 20
    rule = CheckpointRule(spacing=4, most=MAX_POINTS)
    assert plan_checkpoints(tokens, 8, 20, decode, rule) == [12, 16, 20]


def test_a_periodic_point_close_to_another_point_or_the_start_is_left_out() -> None:
    rule = CheckpointRule(spacing=512, most=MAX_POINTS)
    gap = 512 // PERIODIC_GAP_SHARE
    # 512 lies 23 tokens after the branch reach's 489: its cut would end a 23-token pass.
    assert plan_checkpoints([5] * 1001, 0, 1001, decode, rule) == [489, 1001]
    # 512 lies 12 tokens after a cached start of 500; 1024 is far enough from the end.
    assert plan_checkpoints([5] * 1100, 500, 1100, decode, rule) == [588, 1024, 1100]
    # Exactly the gap away (from the reach and from the end): kept.
    end = 1024 + gap
    assert plan_checkpoints([5] * end, 0, end, decode, rule) == [512, end - BRANCH_REACH, 1024, end]


def test_a_prewarm_target_excludes_its_own_end() -> None:
    tokens = [5, 5, 0, 5, 5]
    # A prewarm prefills len - 1 tokens and commits that state itself.
    assert plan_checkpoints(tokens, 0, 4, decode, ANY) == [2]


def test_the_end_of_the_instructions_and_of_each_message_are_checkpoints() -> None:
    tokens = [5] * 30
    plan = plan_checkpoints(
        tokens, 0, 30, decode, ANY, message_ends=(12, 20, 26), instructions_end=12
    )
    assert plan == [12, 20, 26, 30]


def test_a_capped_plan_keeps_the_preferred_points_and_widens_the_spacing() -> None:
    tokens = [5] * 100

    def plan(most: int) -> list[int]:
        rule = CheckpointRule(spacing=8, most=most)
        ends = (10, 50, 70, 90)
        return plan_checkpoints(
            tokens, 0, 100, decode, rule, message_ends=ends, instructions_end=10
        )

    # The end, the instructions, message ends; one left for multiples of 8: 64 (spacing 64).
    assert plan(6) == [10, 50, 64, 70, 90, 100]
    # Fewer still: the earliest message end goes, and every periodic point.
    assert plan(4) == [10, 70, 90, 100]


def test_a_widened_spacing_leaves_its_room_to_the_denser_points_nearest_the_end() -> None:
    rule = CheckpointRule(spacing=8, most=9)
    # The end and 12 multiples of 8 want 13: every 16 fits (6), then 88 and 72 of the rest.
    plan = plan_checkpoints([5] * 100, 0, 100, decode, rule)
    assert plan == [16, 32, 48, 64, 72, 80, 88, 96, 100]


@pytest.mark.parametrize(
    ("layout", "spacing"),
    [
        # A snapshot is one 32-token window (32 KiB): the KV of 32 tokens; the floor is 64.
        pytest.param(TINY_SLIDING, 64, id="tiny-sliding"),
        # The recurrent state is 38 KiB, 38 tokens of full-attention KV: the floor again.
        pytest.param(TINY_HYBRID, 64, id="tiny-hybrid"),
        # 15 window layers of 512 tokens are 15 MiB, the KV of 2,560 tokens: the option wins.
        pytest.param(GEMMA3_270M, 512, id="gemma3-270m"),
    ],
)
def test_the_spacing_weighs_a_snapshot_against_the_full_attention_kv(
    layout: ModelInfo, spacing: int
) -> None:
    assert CheckpointPolicy(widest=512, budget_bytes=GIB).spacing(layout) == spacing


def test_the_spacing_is_a_power_of_two_never_wider_than_the_option() -> None:
    layout = info(1024, fixed=100 * 1024)  # a snapshot is the KV of 100 tokens
    assert CheckpointPolicy(widest=512, budget_bytes=GIB).spacing(layout) == 128
    assert CheckpointPolicy(widest=96, budget_bytes=GIB).spacing(layout) == 96
    assert CheckpointPolicy(widest=0, budget_bytes=GIB).spacing(layout) == 0


def test_a_model_without_full_attention_checkpoints_at_the_floor_within_the_caps() -> None:
    """A constant-size state has no KV to weigh against: the floor, then the caps widen it."""
    recurrent_only = info(0, fixed=1 << 20)
    assert CheckpointPolicy(widest=512, budget_bytes=GIB).spacing(recurrent_only) == MIN_SPACING
    assert CheckpointPolicy(widest=32, budget_bytes=GIB).spacing(recurrent_only) == 32
    assert CheckpointPolicy(widest=0, budget_bytes=GIB).spacing(recurrent_only) == 0
    # 1/32 of 64 MiB holds two 1 MiB states: a 300-token plan keeps the end and one multiple.
    rule = CheckpointPolicy(widest=512, budget_bytes=64 << 20).rule(recurrent_only, 300, 0, GIB)
    assert rule == CheckpointRule(MIN_SPACING, 2)
    assert plan_checkpoints([5] * 300, 0, 300, decode, rule) == [256, 300]


def test_the_rule_caps_the_snapshots_by_count_and_by_budget_share() -> None:
    policy = CheckpointPolicy(widest=512, budget_bytes=GIB)
    # 4,000 tokens at spacing 64 want 62 periodic points: the count cap.
    assert policy.rule(TINY_SLIDING, 4000, 0, GIB) == CheckpointRule(64, MAX_POINTS)
    # A short prompt wants only its own: 6 anchors (3 of them line starts; none 512 before the
    # end of a prompt shorter than that), 2 message ends, 4 multiples of 64.
    assert policy.rule(TINY_SLIDING, 300, 2, GIB) == CheckpointRule(64, 12)
    assert policy.rule(TINY_SLIDING, 600, 2, GIB) == CheckpointRule(64, 7 + 2 + 9)
    assert policy.rule(TINY_SLIDING, 5, 2, GIB) == CheckpointRule(64, 5)  # a point per token
    # Gemma's 15 MiB snapshots: 1/32 of 1 GiB affords two.
    assert GIB // BUDGET_SHARE // GEMMA3_270M.snapshot_bytes == 2
    assert policy.rule(GEMMA3_270M, 4000, 0, GIB) == CheckpointRule(512, 2)
    # What is left of the budget after the sequence's own KV caps it too.
    assert policy.rule(TINY_SLIDING, 4000, 0, 3 * 32768 + 1) == CheckpointRule(64, 3)


def test_the_rule_holds_every_anchor_a_plan_can_take() -> None:
    """Admission reserves room for ``most`` snapshots before the plan exists: a prompt with every
    kind of anchor (and no periodic points) gets exactly that many."""
    tokens = [5] * 1000
    tokens[990] = 0  # a word starts at 990
    for end_of_line in (899, 919, 939):
        tokens[end_of_line] = 1
    ends = (100, 300)
    rule = CheckpointPolicy(widest=0, budget_bytes=GIB).rule(TINY_SLIDING, 1000, len(ends), GIB)
    assert rule is not None
    plan = plan_checkpoints(tokens, 0, 1000, decode, rule, message_ends=ends, instructions_end=50)
    assert plan == [50, 100, 300, 1000 - BRANCH_REACH, 900, 920, 940, 990, 1000]
    assert rule.most == len(plan)


def test_a_sequence_that_never_fills_its_window_has_no_rule() -> None:
    """Under ``trims_below`` (llama.cpp's sliding window before it fills) its state still trims
    when it ends: snapshots would buy nothing."""
    policy = CheckpointPolicy(widest=512, budget_bytes=GIB)
    gemma = msgspec.structs.replace(GEMMA3_270M, trims_below=512)
    assert policy.rule(gemma, 400, 0, GIB, longest=511) is None
    assert policy.rule(gemma, 400, 0, GIB, longest=512) is not None
    assert policy.rule(gemma, 400, 0, GIB) is not None  # a prewarm: its length unknown
    # No bound (MLX's caches, a recurrent state): the rule whatever the length.
    assert policy.rule(GEMMA3_270M, 10, 0, GIB, longest=20) is not None


def test_a_trimmable_cache_has_no_rule() -> None:
    llama = info(2048, reuse=ReuseStrategy.TRIM)
    assert CheckpointPolicy(widest=512, budget_bytes=GIB).rule(llama, 4000, 3, GIB) is None
