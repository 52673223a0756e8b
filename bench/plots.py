"""The report's PNG plots: one figure per question, one panel per model, one bar per system."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bench.goals import STREAMS
from bench.results import ResultSet

if TYPE_CHECKING:
    from matplotlib.axes import Axes

COLORS = {
    "runtime": "#1f77b4",
    "runtime-nospec": "#aec7e8",
    "mlx-lm": "#7f7f7f",
    "mlx_lm.server": "#ff7f0e",
    "llama-server": "#2ca02c",
    "ours-llamacpp": "#9467bd",
}
OTHER_COLOR = "#000000"  # a system the run has but this table does not know
COLUMNS = 3  # panels per row


@dataclass(frozen=True)
class Figure:
    """A PNG: ``groups`` of bars (label, scenario) per model panel, values in ``unit``."""

    name: str
    title: str
    unit: str
    groups: tuple[tuple[str, str], ...]
    log: bool  # log scale where a panel's values span orders of magnitude (ms TTFTs)


FIGURES = (
    Figure(
        "ttft.png",
        "Time to first token (ms, lower is better)",
        "ms",
        (
            ("cold", "turn2.cold_ttft"),
            ("turn 2", "turn2.warm_ttft"),
            ("prewarm: cold", "prewarm.cold_ttft"),
            ("after prewarm", "prewarm.after_ttft"),
            ("keystroke p50", "keystroke.latency_p50"),
            ("branch ~900", "branch.900.ttft"),
        ),
        log=True,
    ),
    Figure(
        "throughput.png",
        "Decode tokens/s: one stream, then N concurrent streams (higher is better)",
        "tok/s",
        (
            ("decode", "decode.tokens_per_s"),
            *((f"{n} stream{'s' if n > 1 else ''}", f"concurrency.{n}.tok_s") for n in STREAMS),
        ),
        log=False,
    ),
    Figure(
        "speculative.png",
        "Decode tok/s by workload, runtime speculating (higher is better)",
        "tok/s",
        (
            ("rename", "speculative.rewrite_rename.tok_s"),
            ("quotes", "speculative.summarise_quotes.tok_s"),
            ("citations", "speculative.document_citations.tok_s"),
            ("code", "speculative.code_continue.tok_s"),
            ("free chat", "speculative.free_chat.tok_s"),
        ),
        log=False,
    ),
    Figure(
        "abandon.png",
        "Short request's TTFT: idle vs right after abandoning a long prefill (ms, lower is better)",
        "ms",
        (("idle", "abandon.short_idle_ttft"), ("after abandon", "abandon.short_after_ttft")),
        log=True,
    ),
)


def write_plots(results: ResultSet, models: Sequence[str], out: Path) -> list[Path]:
    """Every figure of ``FIGURES`` as a PNG in ``out``.

    A group of bars no model measured is left out of its figure, and a panel with no data says
    "not measured", so an empty slot is never read as a zero.
    """
    out.mkdir(parents=True, exist_ok=True)
    return [_draw(figure, results, models, out / figure.name) for figure in FIGURES]


def _draw(figure: Figure, results: ResultSet, models: Sequence[str], path: Path) -> Path:
    # matplotlib comes with the bench extra only: imported here, the page renders without it.
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, and the same output on every machine
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    systems = results.systems()
    measured = tuple(
        (label, scenario)
        for label, scenario in figure.groups
        if any(results.value(s, m, scenario) is not None for s in systems for m in models)
    )
    groups = measured or figure.groups
    panels = list(models) or ["(no model)"]
    rows = math.ceil(len(panels) / COLUMNS)
    cols = min(len(panels), COLUMNS)
    fig, axes = plt.subplots(
        rows, cols, figsize=(5.2 * cols, 3.6 * rows), squeeze=False, layout="constrained"
    )
    for ax, model in zip(axes.flat, panels, strict=False):
        _panel(ax, figure, groups, systems, results, model)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    handles = [Rectangle((0, 0), 1, 1, color=COLORS.get(s, OTHER_COLOR)) for s in systems]
    fig.suptitle(figure.title)
    ncols = max(1, len(systems))
    fig.legend(handles, systems, loc="outside lower center", ncols=ncols, frameon=False)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _panel(
    ax: Axes,
    figure: Figure,
    groups: Sequence[tuple[str, str]],
    systems: Sequence[str],
    results: ResultSet,
    model: str,
) -> None:
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.set_title(model)
    width = 0.8 / max(1, len(systems))
    drawn = False
    for i, system in enumerate(systems):
        for g, (_, scenario) in enumerate(groups):
            value = results.value(system, model, scenario)
            if value is None or (figure.log and value <= 0):
                continue
            x = g + (i - (len(systems) - 1) / 2) * width
            ax.bar(x, value, width, color=COLORS.get(system, OTHER_COLOR))
            ax.annotate(_short(value), (x, value), ha="center", va="bottom", fontsize=7)
            drawn = True
    ax.set_xticks(range(len(groups)), [label for label, _ in groups], fontsize=8)
    ax.set_xlim(-0.5, len(groups) - 0.5)
    ax.set_ylabel(figure.unit)
    if not drawn:
        ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
        ax.set_yticks([])
    elif figure.log:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 100, not 10^2
        ax.yaxis.set_minor_formatter(NullFormatter())


def _short(value: float) -> str:
    """A bar's label, at most four characters wide so that neighbouring labels do not collide."""
    if value >= 1000:
        return f"{value / 1000:.1f}k" if value < 9950 else f"{value / 1000:.0f}k"
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"
