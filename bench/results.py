"""Measurements: one JSON object per line (after a first ``{"meta": ...}`` line describing the run),
plus the human table printed at the end."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import IO, Any

# Ours on MLX, raw mlx-lm, mlx_lm.server, llama.cpp's own server, ours on llama.cpp (llamacpp.py).
# The speculative group adds ours with speculation off (``runtime`` speculates there).
SYSTEMS = (
    "runtime",
    "runtime-nospec",
    "mlx-lm",
    "mlx_lm.server",
    "llama-server",
    "ours-llamacpp",
)
OVERHEAD_MODEL = "simulated"  # the model of the hop.* rows: they run no model, or a simulated one
# A TTFT split by the server's own timings.prompt_ms (``split_ttft``): ``<ttft scenario>.eval``
# and ``<ttft scenario>.rest``, for the servers that report it (llama-server and ours).
SPLIT_PARTS = ("eval", "rest")
SCENARIOS = (
    "turn2.cold_ttft",
    *(f"turn2.cold_ttft.{part}" for part in SPLIT_PARTS),
    "turn2.warm_ttft",
    *(f"turn2.warm_ttft.{part}" for part in SPLIT_PARTS),
    "turn2.cold/warm",
    "turn2.prefilled_cold",
    "turn2.prefilled_warm",
    "abandon.long_cold_ttft",
    "abandon.short_idle_ttft",
    "abandon.short_after_ttft",
    "abandon.after/idle",
    "abandon.cancelled_requests",
    "decode.tokens_per_s",
    "hop.message_us_p50",
    "hop.message_us_p90",
    "hop.token_us",
    "hop.token_compute_us",
    *(
        f"concurrency.{n}.{what}"
        for n in (1, 2, 4, 8)
        for what in ("tok_s", "ttft_p50", "ttft_max")
    ),
    "prewarm.cold_ttft",
    "prewarm.after_ttft",
    "prewarm.cold/after",
    *(
        f"branch.{n}.{what}"
        for n in (300, 900, 1800)
        for what in ("cold_ttft", "ttft", "ttft.eval", "ttft.rest", "reprocessed", "cold/branch")
    ),
    "keystroke.latency_p50",
    "keystroke.latency_p90",
    "keystroke.cached_fraction",
    "disk.cold_ttft",
    "disk.hit_ttft",
    "disk.hit/cold",
    "disk.cached_tokens",
    "disk.load_mb_per_s",
    "disk.read_mb_per_s",
    "disk.pressure_cached_ram",
    "disk.pressure_cached_disk",
    *(
        f"speculative.{w}.{what}"
        for w in (
            "rewrite_rename",
            "summarise_quotes",
            "document_citations",
            "code_continue",
            "free_chat",
        )
        for what in ("tok_s", "acceptance")
    ),
    "skipped",
)
# Units a runtime/other ratio means something for, and which side of 1 is better for the runtime.
LOWER_IS_BETTER = ("us", "ms", "s")
HIGHER_IS_BETTER = ("tok/s",)
# (system, other): the ratios shown; ours on MLX against each other system, ours on llama.cpp
# against llama.cpp's own server (the pair issue 22's goals are about).
COMPARISONS = (
    ("runtime", "mlx-lm"),
    ("runtime", "mlx_lm.server"),
    ("runtime", "runtime-nospec"),
    ("runtime", "llama-server"),
    ("ours-llamacpp", "llama-server"),
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


def split_ttft(
    system: str, model: str, scenario: str, ttfts: Sequence[float], evals: Sequence[float | None]
) -> list[Measurement]:
    """Where ``scenario``'s TTFTs (seconds) went, by the server's own ``timings.prompt_ms``
    (``evals``, seconds; None where a reply had none): ``<scenario>.eval``, the server's prompt
    time, and ``<scenario>.rest``, the TTFT less it (HTTP, tokenizing, queueing, and whatever the
    server counts outside its prompt time), each the median of the per-request values, in ms.
    Nothing unless every reply said.

    What the prompt time spans: llama-server's from taking the prompt up (restoring a checkpoint
    included) to its first token; ours from the engine's ``Started`` (after restoring what the
    cache held) to the first token reaching the HTTP layer (runtime/server/timings.py).
    """
    if not evals or any(e is None for e in evals):
        return []
    spent = [e for e in evals if e is not None]
    rest = [t - e for t, e in zip(ttfts, spent, strict=True)]
    return [
        timed(system, model, f"{scenario}.eval", spent),
        timed(system, model, f"{scenario}.rest", rest),
    ]


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
    return Measurement(system, model, scenario, divide(num, den), "x")


def divide(num: float | None, den: float | None) -> float | None:
    """``num / den`` to two places, or None when either is missing (or ``den`` is 0)."""
    return round(num / den, 2) if num is not None and den else None


def versus(ours: Measurement | None, other: Measurement | None) -> float | None:
    """One system's value over another's, for times and rates only."""
    if ours is None or other is None or ours.unit not in (*LOWER_IS_BETTER, *HIGHER_IS_BETTER):
        return None
    return divide(ours.value, other.value)


class Sink:
    """Writes each measurement as a JSON line the moment it is recorded, and keeps them all."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self.items: list[Measurement] = []

    def meta(self, meta: dict[str, Any]) -> None:
        """The run's environment, written once before the first measurement."""
        self._stream.write(json.dumps({"meta": meta}) + "\n")
        self._stream.flush()

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


def read(lines: Iterable[str]) -> tuple[dict[str, Any], list[Measurement]]:
    """A bench's JSON lines back: the meta line (empty if the run wrote none), the measurements."""
    meta: dict[str, Any] = {}
    items = []
    for line in lines:
        if not line.strip():
            continue
        data = json.loads(line)
        if "meta" in data:
            meta = data["meta"]
        else:
            items.append(Measurement(**data))
    return meta, items


class ResultSet:
    """Measurements by system, model and scenario (a later row replaces an earlier one)."""

    def __init__(self, items: Iterable[Measurement]) -> None:
        self.items = list(items)
        self._by = {(i.system, i.model, i.scenario): i for i in self.items}

    def get(self, system: str, model: str, scenario: str) -> Measurement | None:
        return self._by.get((system, model, scenario))

    def value(self, system: str, model: str, scenario: str) -> float | None:
        item = self.get(system, model, scenario)
        return None if item is None else item.value

    def versus(
        self, model: str, scenario: str, other: str, system: str = "runtime"
    ) -> float | None:
        """``system``'s value over ``other``'s (times and rates only)."""
        return versus(self.get(system, model, scenario), self.get(other, model, scenario))

    def systems(self) -> list[str]:
        """The systems with any row in the run (skipped ones included), in ``SYSTEMS`` order."""
        return present_systems(self.items)

    def skip_reasons(self, systems: Sequence[str], models: Sequence[str]) -> list[str]:
        """One sentence per system of ``systems`` skipped on models of ``models``, the models
        with the same reason together: ``llama-server skipped on smollm2, gemma3: <why>``."""
        said: dict[tuple[str, str], list[str]] = {}
        for system in systems:
            for model in models:
                item = self.get(system, model, "skipped")
                if item is not None:
                    said.setdefault((system, item.note.rstrip(".")), []).append(model)
        return [f"{s} skipped on {', '.join(ms)}: {why}" for (s, why), ms in said.items()]

    def comparisons(self) -> list[tuple[str, str]]:
        """The pairs of ``COMPARISONS`` whose two systems both have rows in the run."""
        return present_comparisons(self.items)

    def models(self, preferred: Sequence[str] = ()) -> list[str]:
        """Models with a measurement: those in ``preferred`` first, in its order."""
        present = dict.fromkeys(i.model for i in self.items)
        return [m for m in preferred if m in present] + [m for m in present if m not in preferred]

    def scenarios(self, model: str) -> list[str]:
        """Scenarios measured on ``model``, in ``SCENARIOS`` order, then in the run's order."""
        measured = dict.fromkeys(i.scenario for i in self.items if i.model == model)
        return sorted(measured, key=_rank)


def present_systems(items: Iterable[Measurement]) -> list[str]:
    """The systems of ``items``, in ``SYSTEMS`` order (then any unknown ones, in run order)."""
    present = dict.fromkeys(i.system for i in items)
    return [s for s in SYSTEMS if s in present] + [s for s in present if s not in SYSTEMS]


def present_comparisons(items: Iterable[Measurement]) -> list[tuple[str, str]]:
    """The pairs of ``COMPARISONS`` whose two systems both appear in ``items``."""
    present = set(present_systems(items))
    return [(a, b) for a, b in COMPARISONS if a in present and b in present]


def format_table(items: Sequence[Measurement]) -> str:
    """Rows: model x scenario; columns: the systems the run has, then the ratios of
    ``COMPARISONS`` between them (a run of two systems stays two columns wide).

    Notes are listed below the grid.
    """
    rows: dict[tuple[str, str], dict[str, Measurement]] = {}
    units: dict[tuple[str, str], str] = {}
    notes: list[str] = []
    for item in items:
        key = (item.model, item.scenario)
        rows.setdefault(key, {})[item.system] = item
        units[key] = item.unit
        if item.note:
            notes.append(f"[{item.system} {item.model} {item.scenario}] {item.note}")
    fmt: Callable[[Measurement | None], str] = format_value
    systems, pairs = present_systems(items), present_comparisons(items)
    columns = [*systems, *(f"{a}/{b}" for a, b in pairs)]
    widths = [max(15, len(c) + 2) for c in columns]
    models = list(dict.fromkeys(model for model, _ in rows))
    mw = max(8, *(len(m) for m in models)) if models else 8
    header = f"{'model':{mw}} {'scenario':34} {'unit':6}" + "".join(
        f"{c:>{w}}" for c, w in zip(columns, widths, strict=True)
    )
    lines = [header, "-" * len(header)]
    order = sorted(rows, key=lambda k: (models.index(k[0]), _rank(k[1])))
    for model, scenario in order:
        by_system = rows[(model, scenario)]
        cells = [fmt(by_system.get(s)) for s in systems]
        cells += [format_ratio(versus(by_system.get(a), by_system.get(b))) for a, b in pairs]
        lines.append(
            f"{model:{mw}} {scenario:34} {units[(model, scenario)]:6}"
            + "".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True))
        )
    lines.append(
        f"A/B: below 1 is better for A in {', '.join(LOWER_IS_BETTER)}, "
        f"above 1 in {', '.join(HIGHER_IS_BETTER)}; '-': a side not measured, or no ratio"
    )
    if notes:
        lines += ["", "notes:", *(f"  {n}" for n in dict.fromkeys(notes))]
    return "\n".join(lines)


def _rank(scenario: str) -> int:
    return SCENARIOS.index(scenario) if scenario in SCENARIOS else len(SCENARIOS)


def format_value(item: Measurement | None) -> str:
    if item is None:
        return "-"
    if item.value is None:
        return "n/a"
    if item.unit in ("tokens", "count"):
        return f"{item.value:.0f}"
    return f"{item.value:.2f}" if abs(item.value) < 100 else f"{item.value:.1f}"


def format_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"
