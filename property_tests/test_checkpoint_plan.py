"""Checkpoint planning, checked without an engine (actors/engine/checkpoints.py, docs/reuse.md).

``CheckpointPolicy.rule`` and ``plan_checkpoints`` are pure. Layouts, budgets, prompts (token 0
starts a word), cached starts, message ends and rules are drawn; the rules:

- the plan is sorted, without repeats, strictly inside (start, target), or at target where that
  is the whole prompt (point 1, the end of the prompt: a generate's last pass ends there);
- it never holds more than ``rule.most`` points, so the snapshots fit the room admission reserved
  (``rule.most`` snapshots of at most ``snapshot_bytes`` each);
- every point that is not an anchor (the end of the prompt, the last word boundary, the starts
  of the last lines near the end, the end of the instructions, ``BRANCH_REACH`` before the end) or
  a message end is a multiple of the rule's spacing;
- the spacing widens only when it must: a multiple of the spacing is left out only when the plan
  could not have held it with all the others;
- the end of the prompt, when it is the target (a generate) and ``most`` allows one point, is
  always planned;
- a rule's snapshots take at most 1/``BUDGET_SHARE`` of the budget and the bytes left free, its
  spacing is at most the option and weighs a snapshot against the full-attention KV it spans.

Settings come from the active Hypothesis profile.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given
from hypothesis import strategies as st

from actors.engine.checkpoints import (
    BRANCH_REACH,
    BUDGET_SHARE,
    LINE_STARTS,
    MAX_POINTS,
    MIN_SPACING,
    WORD_SCAN_TOKENS,
    CheckpointPolicy,
    CheckpointRule,
    plan_checkpoints,
)
from runtime.backends.contract import ModelInfo, ReuseStrategy


def decode(ids: Sequence[int]) -> str:
    # Token 0 starts a word, token 1 ends a line.
    return "".join(" w" if t == 0 else ".\n" if t == 1 else "x" for t in ids)


@st.composite
def prompts(draw: st.DrawFn) -> tuple[list[int], int, int, tuple[int, ...], int]:
    """Tokens, a cached start, a target (all, or all but one), message ends, instructions end."""
    tokens = draw(st.lists(st.integers(0, 3), min_size=1, max_size=1200))
    target = len(tokens) - draw(st.integers(0, min(1, len(tokens) - 1)))
    start = draw(st.integers(0, target))
    ends = tuple(sorted(draw(st.sets(st.integers(1, len(tokens)), max_size=20))))
    instructions = draw(st.sampled_from((0, *ends[:1])) | st.integers(0, len(tokens)))
    return tokens, start, target, ends, instructions


rules = st.builds(CheckpointRule, spacing=st.integers(0, 200), most=st.integers(0, 40))


@given(prompt=prompts(), rule=rules)
def test_a_plan_stays_inside_its_bounds_and_widens_only_when_it_must(
    prompt: tuple[list[int], int, int, tuple[int, ...], int], rule: CheckpointRule
) -> None:
    tokens, start, target, ends, instructions = prompt
    plan = plan_checkpoints(
        tokens, start, target, decode, rule, message_ends=ends, instructions_end=instructions
    )

    assert plan == sorted(set(plan))
    end = len(tokens)
    assert all(start < p < target or p == target == end for p in plan)
    assert len(plan) <= rule.most
    last = end - 1
    words = [i for i in range(last, max(start, last - WORD_SCAN_TOKENS), -1) if tokens[i] == 0]
    lines = [i + 1 for i in range(end - 2, max(start, len(tokens) - BRANCH_REACH) - 1, -1)]
    lines = [p for p in lines if tokens[p - 1] == 1][:LINE_STARTS]
    anchors = {end, instructions, *ends, *words[:1], *lines, len(tokens) - BRANCH_REACH}
    periodic = [p for p in plan if p not in anchors]
    assert all(rule.spacing > 0 and p % rule.spacing == 0 for p in periodic)
    if rule.spacing > 0:
        multiples = range((start // rule.spacing + 1) * rule.spacing, target, rule.spacing)
        missing = [m for m in multiples if m not in plan]
        assert not missing or len(plan) + len(missing) > rule.most
    if start < end == target and rule.most > 0:
        assert end in plan


layouts = st.builds(
    ModelInfo,
    context_length=st.just(1 << 20),
    vocab_size=st.just(512),
    eos_token_ids=st.just(frozenset()),
    reuse=st.just(ReuseStrategy.CHECKPOINT),
    reuse_reason=st.just("drawn"),
    bytes_per_token=st.integers(0, 1 << 16),
    window_tokens=st.none() | st.integers(1, 4096),
    window_bytes_per_token=st.integers(0, 1 << 16),
    fixed_state_bytes=st.integers(0, 1 << 26),
)


@given(
    layout=layouts,
    widest=st.integers(0, 4096),
    budget=st.integers(0, 1 << 36),
    target=st.integers(0, 1 << 17),
    message_ends=st.integers(0, 20),
    free=st.integers(-(1 << 30), 1 << 36),
)
def test_a_rule_fits_its_budget_and_weighs_snapshots_against_the_kv(
    layout: ModelInfo, widest: int, budget: int, target: int, message_ends: int, free: int
) -> None:
    policy = CheckpointPolicy(widest=widest, budget_bytes=budget)
    rule = policy.rule(layout, target, message_ends, free)

    assert rule is not None
    assert 0 <= rule.most <= MAX_POINTS
    if layout.snapshot_bytes > 0:
        assert rule.most * layout.snapshot_bytes <= min(budget // BUDGET_SHARE, max(free, 0))
    assert 0 <= rule.spacing <= max(widest, 0)
    if widest > 0 and layout.bytes_per_token > 0 and rule.spacing < widest:
        assert rule.spacing >= MIN_SPACING
        assert rule.spacing * layout.bytes_per_token >= layout.snapshot_bytes
        assert rule.spacing & (rule.spacing - 1) == 0  # a power of two


@given(prompt=prompts(), layout=layouts, widest=st.integers(0, 4096))
def test_a_rule_with_room_to_spare_holds_every_point_its_plan_wants(
    prompt: tuple[list[int], int, int, tuple[int, ...], int], layout: ModelInfo, widest: int
) -> None:
    """Admission reserves room for ``rule.most`` snapshots before the plan is made: unless the
    count cap binds, that is never fewer than the points the plan would take uncapped."""
    tokens, start, target, ends, instructions = prompt
    ample = 1 << 60
    rule = CheckpointPolicy(widest=widest, budget_bytes=ample).rule(
        layout, target, len(ends), ample
    )
    assert rule is not None
    uncapped = CheckpointRule(rule.spacing, 1 << 30)
    plan = plan_checkpoints(
        tokens, start, target, decode, uncapped, message_ends=ends, instructions_end=instructions
    )
    assert len(plan) <= rule.most or rule.most == MAX_POINTS
