"""Measurements: one JSON object per line, plus the human table printed at the end."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import IO, Any

SYSTEMS = ("runtime", "mlx-lm", "mlx_lm.server")
SCENARIOS = (
    "turn2.cold_ttft",
    "turn2.warm_ttft",
    "turn2.cold/warm",
    "turn2.prefilled_cold",
    "turn2.prefilled_warm",
    "abandon.long_cold_ttft",
    "abandon.short_idle_ttft",
    "abandon.short_after_ttft",
    "abandon.after/idle",
    "abandon.cancelled_requests",
    "decode.tokens_per_s",
    *(
        f"concurrency.{n}.{what}"
        for n in (1, 2, 4, 8)
        for what in ("tok_s", "ttft_p50", "ttft_max")
    ),
    "prewarm.cold_ttft",
    "prewarm.after_ttft",
    "prewarm.cold/after",
    "keystroke.latency_p50",
    "keystroke.latency_p90",
    "keystroke.cached_fraction",
    "skipped",
)


@dataclass(frozen=True)
class Measurement:
    """One number: ``value`` in ``unit`` for ``system`` on ``model`` in ``scenario``."""

    system: str
    model: str
    scenario: str
    value: float | None
    unit: str
    samples: list[float] = field(default_factory=list)
    note: str = ""


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def timed(
    system: str, model: str, scenario: str, samples: Sequence[float], unit: str = "ms"
) -> Measurement:
    """The median of ``samples`` (seconds) reported in ``unit`` (ms or s)."""
    scale = 1000.0 if unit == "ms" else 1.0
    scaled = [round(s * scale, 3) for s in samples]
    return Measurement(system, model, scenario, median(scaled), unit, scaled)


def decode_rate(
    system: str, model: str, samples: Sequence[float], note: str | None = None
) -> Measurement:
    """Median decode speed (tokens/s) over ``samples``, every sample kept."""
    rounded = [round(r, 1) for r in samples]
    return Measurement(
        system, model, "decode.tokens_per_s", median(rounded), "tok/s", rounded, note
    )


def ratio(
    system: str, model: str, scenario: str, num: float | None, den: float | None
) -> Measurement:
    value = round(num / den, 2) if num is not None and den else None
    return Measurement(system, model, scenario, value, "x")


class Sink:
    """Writes each measurement as a JSON line the moment it is recorded, and keeps them all."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self.items: list[Measurement] = []

    def add(self, item: Measurement) -> Measurement:
        self.items.append(item)
        self._stream.write(json.dumps(_jsonable(item)) + "\n")
        self._stream.flush()
        return item

    def extend(self, items: Iterable[Measurement]) -> None:
        for item in items:
            self.add(item)


def _jsonable(item: Measurement) -> dict[str, Any]:
    data = asdict(item)
    if not data["note"]:
        del data["note"]
    return data


def format_table(items: Sequence[Measurement]) -> str:
    """Rows: model x scenario; columns: the three systems. Notes are listed below the grid."""
    rows: dict[tuple[str, str], dict[str, Measurement]] = {}
    units: dict[tuple[str, str], str] = {}
    notes: list[str] = []
    for item in items:
        key = (item.model, item.scenario)
        rows.setdefault(key, {})[item.system] = item
        units[key] = item.unit
        if item.note:
            notes.append(f"[{item.system} {item.model} {item.scenario}] {item.note}")
    fmt: Callable[[Measurement | None], str] = _cell
    header = f"{'model':8} {'scenario':34} {'unit':6}" + "".join(f"{s:>15}" for s in SYSTEMS)
    lines = [header, "-" * len(header)]
    models = list(dict.fromkeys(model for model, _ in rows))
    order = sorted(rows, key=lambda k: (models.index(k[0]), _rank(k[1])))
    for model, scenario in order:
        by_system = rows[(model, scenario)]
        cells = "".join(f"{fmt(by_system.get(s)):>15}" for s in SYSTEMS)
        lines.append(f"{model:8} {scenario:34} {units[(model, scenario)]:6}{cells}")
    if notes:
        lines += ["", "notes:", *(f"  {n}" for n in dict.fromkeys(notes))]
    return "\n".join(lines)


def _rank(scenario: str) -> int:
    return SCENARIOS.index(scenario) if scenario in SCENARIOS else len(SCENARIOS)


def _cell(item: Measurement | None) -> str:
    if item is None:
        return "-"
    if item.value is None:
        return "n/a"
    if item.unit in ("tokens", "count"):
        return f"{item.value:.0f}"
    return f"{item.value:.2f}" if abs(item.value) < 100 else f"{item.value:.1f}"
