"""README's headline block: the runtime against raw mlx-lm and mlx_lm.server on the real models,
then our runtime (on llama.cpp, and on MLX) against llama.cpp's own llama-server.

The block sits between two markers in README.md; ``rewrite`` replaces what is between them and
nothing else, so the rest of the README stays hand-written.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import goals
from bench.goals import LLAMA_SERVER, OURS_LLAMACPP, RAW, RUNTIME, SERVER, Goal, judged, show
from bench.markdown import table
from bench.results import ResultSet

START = "<!-- bench:headline:start -->"
END = "<!-- bench:headline:end -->"
REAL_MODELS = ("smollm2", "gemma3")


class MarkersMissing(ValueError):
    """Raised by ``rewrite`` when the README lacks the start or end marker, or has them reversed."""


@dataclass(frozen=True)
class Headline:
    """One row per real model: the runtime over each other system on ``scenario``, and its goals."""

    label: str
    scenario: str
    goals: tuple[Goal, ...]


HEADLINES = (
    Headline("cold TTFT", "turn2.cold_ttft", (goals.COLD_VS_RAW, goals.COLD_VS_SERVER)),
    Headline("turn-2 TTFT", "turn2.warm_ttft", (goals.WARM_VS_SERVER,)),
    Headline("decode tok/s", "decode.tokens_per_s", (goals.DECODE_VS_RAW,)),
    Headline("TTFT after an abandoned prefill", "abandon.short_after_ttft", (goals.ABANDON,)),
    Headline("8-stream tok/s", "concurrency.8.tok_s", (goals.CONCURRENCY[8],)),
    Headline("keystroke latency p50", "keystroke.latency_p50", ()),
)
# Issue 22: the rows where llama.cpp's own server is the bar, judged on ours-llamacpp.
LLAMACPP_HEADLINES = (
    Headline("cold TTFT", "turn2.cold_ttft", (goals.LLAMACPP_COLD,)),
    Headline("turn-2 TTFT", "turn2.warm_ttft", (goals.LLAMACPP_WARM,)),
    Headline("decode tok/s", "decode.tokens_per_s", (goals.LLAMACPP_DECODE,)),
    Headline(
        "TTFT after an abandoned prefill", "abandon.short_after_ttft", (goals.LLAMACPP_ABANDON,)
    ),
    Headline("4-stream tok/s", "concurrency.4.tok_s", (goals.LLAMACPP_CONCURRENCY[4],)),
    Headline("8-stream tok/s", "concurrency.8.tok_s", (goals.LLAMACPP_CONCURRENCY[8],)),
    Headline("branch TTFT, ~900 tokens", "branch.900.ttft", (goals.LLAMACPP_BRANCH[900],)),
)
LLAMACPP_SYSTEMS = (LLAMA_SERVER, OURS_LLAMACPP)


def block(meta: dict[str, Any], results: ResultSet, source: str) -> str:
    """The markdown between the markers (markers excluded)."""
    machine = meta.get("machine", {})
    rows = _rows(results, HEADLINES, ((RAW, RUNTIME), (SERVER, RUNTIME)))
    intro = (
        "Runtime over raw mlx-lm and over `mlx_lm.server` on the real models (times: below 1 is "
        f"better for the runtime; tok/s: above 1), from a {meta.get('mode', '?')} bench run on "
        f"{machine.get('cpu', '?')} ({machine.get('cores', '?')} cores), {meta.get('date', '?')}, "
        f"with {meta.get('blas', '?')}. Written by `python -m bench.report {source}`; details "
        "and plots in [docs/performance.md](docs/performance.md)."
    )
    return "\n".join(
        [
            _fill(intro),
            "",
            table(
                ["", "model", "runtime/mlx-lm", "runtime/mlx_lm.server", "goal (issue 10)", "met"],
                rows,
            ),
            "",
            goals.hop_verdict(results),
            "",
            llamacpp_block(results),
        ]
    )


def llamacpp_block(results: ResultSet) -> str:
    """Our runtime on llama.cpp and on MLX over llama-server, the goals of issue 22, each
    system's own after/idle on an abandon, and why a llama.cpp system did not run, if so."""
    rows = _rows(
        results, LLAMACPP_HEADLINES, ((LLAMA_SERVER, OURS_LLAMACPP), (LLAMA_SERVER, RUNTIME))
    )
    intro = (
        "Our runtime on llama.cpp's kernels (`ours-llamacpp`: `mlxrt serve --backend llamacpp`) "
        "and on MLX (`runtime`) over llama.cpp's own `llama-server` on the same GGUF files, from "
        "the same run (issue 22)."
    )
    waits = [
        f"{system} {', '.join(_after_idle(results, system, m) for m in REAL_MODELS)}"
        for system in (LLAMA_SERVER, OURS_LLAMACPP, RUNTIME)
    ]
    header = ["", "model", "ours-llamacpp/llama-server", "runtime/llama-server"]
    parts = [
        _fill(intro),
        "",
        table([*header, "goal (issue 22)", "met"], rows),
        "",
        _fill(
            "A short request right after an abandoned long prefill, as a multiple of its idle "
            f"TTFT (`abandon.after/idle`): {'; '.join(waits)}."
        ),
    ]
    for why in results.skip_reasons(LLAMACPP_SYSTEMS, REAL_MODELS):
        parts += ["", _fill(f"{why}.")]
    bullets = goals.why_not_bullets(goals.LLAMACPP_GOALS, results, REAL_MODELS)
    if bullets:
        wrapped = [_fill(bullet, indent="  ") for bullet in bullets]
        parts += ["", goals.WHY_NOT_LEAD, "", *wrapped]
    return "\n".join(parts)


def _rows(
    results: ResultSet, lines: Sequence[Headline], ratios: Sequence[tuple[str, str]]
) -> list[list[str]]:
    """A table row per headline and real model: each (versus, system) ratio, the goals, verdicts."""
    rows = []
    for line in lines:
        for model in REAL_MODELS:
            shown = [show(results.versus(model, line.scenario, *ratio), "x") for ratio in ratios]
            rows.append(
                [
                    line.label,
                    model,
                    *shown,
                    "; ".join(g.text for g in line.goals) or "none set",
                    "; ".join(judged(g, results, model) for g in line.goals) or "-",
                ]
            )
    return rows


def _after_idle(results: ResultSet, system: str, model: str) -> str:
    return f"{model} {show(results.value(system, model, 'abandon.after/idle'), 'x')}"


def _fill(text: str, indent: str = "") -> str:
    return textwrap.fill(
        text, width=100, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False
    )


def rewrite(readme: Path, text: str) -> None:
    """Replace what lies between the markers in ``readme``; raises ``MarkersMissing``."""
    current = readme.read_text(encoding="utf-8")
    start, end = current.find(START), current.find(END)
    if start < 0 or end < start:
        raise MarkersMissing(f"{readme} needs {START} and then {END} around the headline")
    head = current[: start + len(START)]
    readme.write_text(f"{head}\n{text}\n{current[end:]}", encoding="utf-8")
