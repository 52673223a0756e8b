"""The performance goals of issues 10, 22 and 25, and whether a run meets them.

A goal bounds either one of our systems' own value of a scenario (the actor hop, abandon's
after/idle) or its ratio to another system on the same model and scenario: issue 10 sets the
runtime on MLX against raw mlx-lm and mlx_lm.server, issue 22 the runtime on llama.cpp
(``ours-llamacpp``) against llama.cpp's own ``llama-server``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from bench.results import OVERHEAD_MODEL, SPLIT_PARTS, ResultSet

RAW = "mlx-lm"
SERVER = "mlx_lm.server"
RUNTIME = "runtime"
LLAMA_SERVER = "llama-server"
OURS_LLAMACPP = "ours-llamacpp"
STREAMS = (1, 2, 4, 8)  # the concurrency scenarios' stream counts

Verdict = Literal["met", "not met", "not measured"]


@dataclass(frozen=True)
class Goal:
    """``system``'s value of ``scenario``, or its ratio to ``versus``'s, at most or at least
    ``limit``."""

    scenario: str
    limit: float
    at_most: bool
    versus: str | None = None
    unit: str = "x"
    system: str = RUNTIME
    # Both systems ran each repetition in turn, on the same prompt (bench/server.py): their
    # samples pair up, and the spread of the pairs' ratios says how far the run's noise reaches.
    paired: bool = False

    @property
    def subject(self) -> str:
        if self.versus:
            return f"{self.system}/{self.versus}"
        own = "" if self.system == RUNTIME else f"{self.system} "
        return f"{own}`{self.scenario}`"

    @property
    def text(self) -> str:
        """The goal as the issue states it, e.g. ``runtime/mlx_lm.server ≤ 1.00x``."""
        return f"{self.subject} {'≤' if self.at_most else '≥'} {show(self.limit, self.unit)}"

    def measure(self, results: ResultSet, model: str) -> float | None:
        if self.versus is None:
            return results.value(self.system, model, self.scenario)
        return results.versus(model, self.scenario, self.versus, self.system)

    def judge(self, value: float | None) -> Verdict:
        if value is None:
            return "not measured"
        met = value <= self.limit if self.at_most else value >= self.limit
        return "met" if met else "not met"


def judged(goal: Goal, results: ResultSet, model: str) -> str:
    """``met (0.98x)``, ``not met (1.20x)`` or ``not measured``."""
    value = goal.measure(results, model)
    verdict = goal.judge(value)
    return verdict if value is None else f"{verdict} ({show(value, goal.unit)})"


def spread(goal: Goal, results: ResultSet, model: str) -> tuple[float, float] | None:
    """The lowest and highest per-repetition ratio of a paired goal (``Goal.paired``): its
    system's sample over the other's from the same repetition. None where the goal is not
    paired or the two rows have no samples of the same length."""
    if not goal.paired or goal.versus is None:
        return None
    ours = results.get(goal.system, model, goal.scenario)
    theirs = results.get(goal.versus, model, goal.scenario)
    if ours is None or theirs is None or len(ours.samples) != len(theirs.samples):
        return None
    ratios = [a / b for a, b in zip(ours.samples, theirs.samples, strict=True) if b]
    return (min(ratios), max(ratios)) if len(ratios) > 1 else None


def judged_in_full(goal: Goal, results: ResultSet, model: str) -> str:
    """``judged``, and for a paired goal the spread of its per-repetition ratios:
    ``not met (1.02x; 0.97-1.06x)``. A spread across the limit: the run cannot tell."""
    value, pairs = goal.measure(results, model), spread(goal, results, model)
    if value is None or pairs is None:
        return judged(goal, results, model)
    low, high = pairs
    return f"{goal.judge(value)} ({show(value, goal.unit)}; {low:.2f}-{high:.2f}x)"


def show(value: float | None, unit: str) -> str:
    """A goal's value for a reader: ratios as ``1.05x``, others with their unit."""
    if value is None:
        return "not measured"
    return f"{value:.2f}x" if unit == "x" else f"{value:g} {unit}"


COLD_VS_RAW = Goal("turn2.cold_ttft", 1.05, at_most=True, versus=RAW)
COLD_VS_SERVER = Goal("turn2.cold_ttft", 1.0, at_most=True, versus=SERVER)
DECODE_VS_RAW = Goal("decode.tokens_per_s", 0.97, at_most=False, versus=RAW)
WARM_VS_SERVER = Goal("turn2.warm_ttft", 1.0, at_most=True, versus=SERVER)
ABANDON = Goal("abandon.after/idle", 1.5, at_most=True)
CONCURRENCY = {
    n: Goal(f"concurrency.{n}.tok_s", 1.0, at_most=False, versus=SERVER) for n in STREAMS
}
# Issue 25: speculation (``runtime`` speculates in the speculative group) against raw mlx-lm.
SPECULATIVE = (
    Goal("speculative.rewrite_rename.tok_s", 1.8, at_most=False, versus=RAW),
    Goal("speculative.summarise_quotes.tok_s", 1.8, at_most=False, versus=RAW),
    Goal("speculative.free_chat.tok_s", 0.97, at_most=False, versus=RAW),
)
MODEL_GOALS = (  # judged on each model
    COLD_VS_RAW,
    COLD_VS_SERVER,
    WARM_VS_SERVER,
    DECODE_VS_RAW,
    ABANDON,
    *CONCURRENCY.values(),
    *SPECULATIVE,
)


def _vs_llama_server(scenario: str, limit: float, at_most: bool) -> Goal:
    return Goal(scenario, limit, at_most, LLAMA_SERVER, system=OURS_LLAMACPP, paired=True)


# Issue 22: our runtime on llama.cpp's kernels against llama-server on the same GGUF file.
LLAMACPP_DECODE = _vs_llama_server("decode.tokens_per_s", 0.95, at_most=False)
LLAMACPP_COLD = _vs_llama_server("turn2.cold_ttft", 1.0, at_most=True)
LLAMACPP_WARM = _vs_llama_server("turn2.warm_ttft", 1.0, at_most=True)
LLAMACPP_CONCURRENCY = {n: _vs_llama_server(f"concurrency.{n}.tok_s", 1.0, False) for n in (4, 8)}
LLAMACPP_ABANDON = Goal("abandon.after/idle", 1.5, at_most=True, system=OURS_LLAMACPP)
LLAMACPP_BRANCH = {n: _vs_llama_server(f"branch.{n}.ttft", 1.0, True) for n in (900, 1800)}
LLAMACPP_GOALS = (  # judged on each real model
    LLAMACPP_DECODE,
    LLAMACPP_COLD,
    LLAMACPP_WARM,
    *LLAMACPP_CONCURRENCY.values(),
    LLAMACPP_ABANDON,
    *LLAMACPP_BRANCH.values(),
)
HOP = Goal("hop.message_us_p50", 10.0, at_most=True, unit="us")


def _split(
    goal: Goal, results: ResultSet, model: str
) -> tuple[tuple[float, float], tuple[float, float]] | None:
    """((ours, theirs) prompt time, (ours, theirs) rest) in ms of a goal against another system;
    None where either side gave no split (``bench.results.split_ttft``)."""
    if goal.versus is None:
        return None
    ours_eval, their_eval, ours_rest, their_rest = (
        results.value(system, model, f"{goal.scenario}.{part}")
        for part in SPLIT_PARTS
        for system in (goal.system, goal.versus)
    )
    if ours_eval is None or their_eval is None or ours_rest is None or their_rest is None:
        return None
    return (ours_eval, their_eval), (ours_rest, their_rest)


def ttft_split(goal: Goal, results: ResultSet, model: str) -> str:
    """Where a TTFT goal's two sides spent their time, from each server's own prompt time
    (``bench.results.split_ttft``): ``prompt time 412 vs 389 ms, the rest 25 vs 22 ms``
    (``goal.system``'s first). Empty for other goals, or where either side gave no split."""
    split = _split(goal, results, model)
    if split is None:
        return ""
    (ours_eval, their_eval), (ours_rest, their_rest) = split
    return (
        f"prompt time {ours_eval:.0f} vs {their_eval:.0f} ms, "
        f"the rest {ours_rest:.0f} vs {their_rest:.0f} ms"
    )


def why_not(goal: Goal, results: ResultSet, model: str) -> str:
    """What a paired goal's own rows say of why this run did not meet it ('' where it did, or
    was not measured): a spread across the limit is the run's noise; a TTFT gap is placed by the
    servers' own prompt times (``ttft_split``), in the prompt's evaluation or around it."""
    value = goal.measure(results, model)
    if not goal.paired or goal.versus is None or value is None or goal.judge(value) != "not met":
        return ""
    reasons = []
    pairs = spread(goal, results, model)
    if pairs is not None:
        low, high = pairs
        if low <= goal.limit <= high:
            reasons.append(
                f"within this run's noise: its repetitions gave {low:.2f}-{high:.2f}x, on both "
                f"sides of {show(goal.limit, goal.unit)}"
            )
        else:
            reasons.append(f"every repetition missed it ({low:.2f}-{high:.2f}x)")
    split = _split(goal, results, model)
    if split is not None and split[0][0] and split[0][1]:
        (ours_eval, their_eval), (ours_rest, their_rest) = split
        inside, outside = ours_eval - their_eval, ours_rest - their_rest
        if outside > 0 and outside >= inside:
            reasons.append(
                f"{outside:.1f} ms more outside the prompt's evaluation (the servers' own prompt "
                f"times: {inside:+.1f} ms, {ours_eval / their_eval:.2f}x): the runtime's own "
                "hand-offs around llama.cpp's work (HTTP, tokenizing, the cache's and budget's "
                "messages, the jobs' trips to the compute thread)"
            )
        elif inside > 0:
            reasons.append(
                f"{inside:.1f} ms more in the prompt's evaluation ({ours_eval / their_eval:.2f}x, "
                f"by the servers' own prompt times; {outside:+.1f} ms outside it)"
            )
    return "; ".join(reasons)


WHY_NOT_LEAD = "Why a goal was not met, from this run's own rows:"


def why_not_bullets(judged: Sequence[Goal], results: ResultSet, models: Sequence[str]) -> list[str]:
    """A markdown bullet per goal a model did not meet, saying ``why_not``."""
    return [
        f"- `{goal.scenario}` on {model}: {why}."
        for goal in judged
        for model in models
        if (why := why_not(goal, results, model))
    ]


def hop_verdict(results: ResultSet) -> str:
    """The one goal without a model: the actor hop, on the rows ``--scenarios hop`` writes."""
    verdict = judged(HOP, results, OVERHEAD_MODEL)
    return f"Actor message hop p50 under uvloop, {HOP.text}: {verdict}."
