"""README's headline block: the runtime against raw mlx-lm and mlx_lm.server on the real models.

The block sits between two markers in README.md; ``rewrite`` replaces what is between them and
nothing else, so the rest of the README stays hand-written.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import goals
from bench.goals import RAW, SERVER, Goal, judged, show
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


def block(meta: dict[str, Any], results: ResultSet, source: str) -> str:
    """The markdown between the markers (markers excluded)."""
    machine = meta.get("machine", {})
    rows = []
    for line in HEADLINES:
        for model in REAL_MODELS:
            rows.append(
                [
                    line.label,
                    model,
                    show(results.versus(model, line.scenario, RAW), "x"),
                    show(results.versus(model, line.scenario, SERVER), "x"),
                    "; ".join(g.text for g in line.goals) or "none set",
                    "; ".join(judged(g, results, model) for g in line.goals) or "-",
                ]
            )
    intro = (
        "Runtime over raw mlx-lm and over `mlx_lm.server` on the real models (times: below 1 is "
        f"better for the runtime; tok/s: above 1), from a {meta.get('mode', '?')} bench run on "
        f"{machine.get('cpu', '?')} ({machine.get('cores', '?')} cores), {meta.get('date', '?')}, "
        f"with {meta.get('blas', '?')}. Written by `python -m bench.report {source}`; details "
        "and plots in [docs/performance.md](docs/performance.md)."
    )
    return "\n".join(
        [
            textwrap.fill(intro, width=100, break_long_words=False, break_on_hyphens=False),
            "",
            table(
                ["", "model", "runtime/mlx-lm", "runtime/mlx_lm.server", "goal (issue 10)", "met"],
                rows,
            ),
            "",
            goals.hop_verdict(results),
        ]
    )


def rewrite(readme: Path, text: str) -> None:
    """Replace what lies between the markers in ``readme``; raises ``MarkersMissing``."""
    current = readme.read_text(encoding="utf-8")
    start, end = current.find(START), current.find(END)
    if start < 0 or end < start:
        raise MarkersMissing(f"{readme} needs {START} and then {END} around the headline")
    head = current[: start + len(START)]
    readme.write_text(f"{head}\n{text}\n{current[end:]}", encoding="utf-8")
