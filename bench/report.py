"""``python -m bench.report RESULTS.jsonl``: docs/performance.md, its plots and README's headline.

Everything written comes from the JSON lines of one bench run (``python -m bench --json``) and the
prose of ``bench/performance_template.md``; no figure is typed by hand. A scenario, model or
system the run left out reads "not measured".
"""

from __future__ import annotations

import argparse
import shutil
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import goals, headline, plots
from bench.goals import LLAMA_SERVER, OURS_LLAMACPP, STREAMS, show
from bench.markdown import table
from bench.results import OVERHEAD_MODEL, ResultSet, format_value, read

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = Path(__file__).with_name("performance_template.md")
MODELS = ("llama", "sliding", "hybrid", "smollm2", "gemma3")  # the tiny kinds, then the real ones
REAL_MODELS = ("smollm2", "gemma3")  # the only ones llama.cpp runs (the tiny ones have no GGUF)
LLAMACPP_SYSTEMS = (LLAMA_SERVER, OURS_LLAMACPP)
NOT_MEASURED = "not measured"
ABSENT = "—"  # a cell of the all-results tables that the run did not measure

# (scenario, title) of the summary's system x model tables, in reading order.
SUMMARY = (
    ("turn2.cold_ttft", "Cold TTFT, a ~600-token turn 1 (ms, lower is better)"),
    ("turn2.warm_ttft", "Turn-2 TTFT (ms, lower is better)"),
    ("turn2.cold/warm", "Turn 2's speed-up, cold/warm (higher is better)"),
    ("turn2.prefilled_warm", "Tokens prefilled on turn 2 (fewer is better)"),
    ("prewarm.after_ttft", "TTFT after a prewarm (ms, lower is better)"),
    (
        "branch.900.reprocessed",
        "Tokens re-processed when ~900 tokens of notes are re-sent with the last line changed "
        "(fewer is better)",
    ),
    ("branch.900.ttft", "TTFT of that re-sent prompt (ms, lower is better)"),
    ("keystroke.latency_p50", "Keystroke latency p50 (ms, lower is better)"),
    (
        "abandon.short_after_ttft",
        "A short request's TTFT right after an abandoned long prefill (ms, lower is better)",
    ),
    ("abandon.after/idle", "The same as a multiple of its idle TTFT (lower is better)"),
    ("decode.tokens_per_s", "Decode tokens/s, one stream (higher is better)"),
    (
        "structured.constrained/free",
        "Decode ms/token under a JSON Schema, as a multiple of none (lower is better)",
    ),
)


def render(meta: dict[str, Any], results: ResultSet, source: str) -> str:
    """The whole of performance.md."""
    models = _models(results)
    fields = {
        "source": f"From `{source}`: a {meta.get('mode', '?')} run of {meta.get('date', '?')}.",
        "machine": _machine(meta),
        "goals": _goals(results, models),
        "llamacpp_goals": _llamacpp_goals(results, models),
        "plots": "\n\n".join(f"![{figure.title}](perf/{figure.name})" for figure in plots.FIGURES),
        "summary": _summary(results, models),
        "overhead": _overhead(results),
        "results": "\n\n".join(_model_results(results, m) for m in models) or NOT_MEASURED,
    }
    return string.Template(TEMPLATE.read_text(encoding="utf-8")).substitute(fields)


def _models(results: ResultSet) -> list[str]:
    """The models measured, known ones in ``MODELS`` order (the hop rows have their own table)."""
    return [m for m in results.models(MODELS) if m != OVERHEAD_MODEL]


def _machine(meta: dict[str, Any]) -> str:
    if not meta:
        return "The run recorded no environment (no meta line): " + NOT_MEASURED + "."
    machine = meta.get("machine", {})
    versions = meta.get("versions", {})
    rows = [
        ["CPU", f"{machine.get('cpu')}, {machine.get('cores')} cores"],
        ["memory", f"{machine.get('memory_gib')} GiB"],
        ["OS", str(meta.get("os"))],
        ["Python", str(meta.get("python"))],
        *([name, str(version)] for name, version in versions.items()),
        ["BLAS", str(meta.get("blas"))],
        *([system, line] for system, line in meta.get("llama.cpp", {}).items()),
        ["commit", f"`{meta.get('commit')}`"],
        ["mode", str(meta.get("mode"))],
        ["command", f"`python -m bench {' '.join(meta.get('argv', []))}`"],
        ["date", str(meta.get("date"))],
    ]
    return table(["", ""], rows)


def _goals(results: ResultSet, models: Sequence[str]) -> str:
    """One row per goal, one column per model: the value and whether it meets the goal."""
    per_model = _goal_table(results, goals.MODEL_GOALS, models)
    return f"{per_model}\n\n{goals.hop_verdict(results)}"


def _llamacpp_goals(results: ResultSet, models: Sequence[str]) -> str:
    """Issue 22's goals on the real models, then why a llama.cpp system has no rows, if so."""
    real = [m for m in models if m in REAL_MODELS] or list(REAL_MODELS)
    parts = [
        _goal_table(results, goals.LLAMACPP_GOALS, real),
        _why_not(results, real),
        _ttft_splits(results, real),
    ]
    parts += [f"{why}." for why in results.skip_reasons(LLAMACPP_SYSTEMS, real)]
    return "\n\n".join(p for p in parts if p)


def _why_not(results: ResultSet, models: Sequence[str]) -> str:
    bullets = goals.why_not_bullets(goals.LLAMACPP_GOALS, results, models)
    return "\n\n".join([goals.WHY_NOT_LEAD, "\n".join(bullets)]) if bullets else ""


def _ttft_splits(results: ResultSet, models: Sequence[str]) -> str:
    """Each TTFT goal's two sides split by the servers' own prompt time: whether a gap is in
    llama.cpp's prompt evaluation or around it."""
    ttft_goals = [g for g in goals.LLAMACPP_GOALS if g.scenario.endswith("ttft")]
    rows = [
        [f"`{goal.scenario}`", *(goals.ttft_split(goal, results, m) or ABSENT for m in models)]
        for goal in ttft_goals
    ]
    if all(cell == ABSENT for row in rows for cell in row[1:]):
        return ""
    lead = (
        f"Where each TTFT went, {OURS_LLAMACPP} vs {LLAMA_SERVER} (medians): the prompt time is "
        "each server's own `timings.prompt_ms` (llama-server's from taking the prompt up, a "
        "checkpoint's restore included, to its first token; ours from the engine's `Started`, "
        "after any restore, to the first token reaching the HTTP layer), the rest is the TTFT "
        "the client saw less it."
    )
    return f"{lead}\n\n{table(['scenario', *models], rows)}"


def _goal_table(results: ResultSet, judged: Sequence[goals.Goal], models: Sequence[str]) -> str:
    rows = [
        [f"`{goal.scenario}`", goal.text, *(goals.judged_in_full(goal, results, m) for m in models)]
        for goal in judged
    ]
    return table(["scenario", "goal", *models], rows) if models else NOT_MEASURED


def _summary(results: ResultSet, models: Sequence[str]) -> str:
    parts = []
    for scenario, title in SUMMARY:
        parts += [f"{title}, `{scenario}`:", "", _pivot(results, scenario, models), ""]
    parts += ["Concurrent streams, aggregate decode tokens/s (higher is better):", ""]
    parts.append(_concurrency(results, models))
    return "\n".join(parts)


def _pivot(results: ResultSet, scenario: str, models: Sequence[str]) -> str:
    """Systems down, models across; a system that measured it on no model is left out."""
    rows = []
    for system in results.systems():
        cells = [_value(results, system, m, scenario) for m in models]
        if any(c != NOT_MEASURED for c in cells):
            rows.append([system, *cells])
    return table(["", *models], rows) if rows else NOT_MEASURED


def _concurrency(results: ResultSet, models: Sequence[str]) -> str:
    rows = []
    for model in models:
        for system in results.systems():
            cells = [_value(results, system, model, f"concurrency.{n}.tok_s") for n in STREAMS]
            if any(c != NOT_MEASURED for c in cells):
                rows.append([model, system, *cells])
        for a, b in results.comparisons():
            pair = [results.versus(model, f"concurrency.{n}.tok_s", b, a) for n in STREAMS]
            if any(v is not None for v in pair):
                rows.append([model, f"{a}/{b}", *(show(v, "x") for v in pair)])
    header = ["model", "system", *(f"{n} stream{'s' if n > 1 else ''}" for n in STREAMS)]
    return table(header, rows) if rows else NOT_MEASURED


def _overhead(results: ResultSet) -> str:
    scenarios = [s for s in results.scenarios(OVERHEAD_MODEL) if s.startswith("hop.")]
    if not scenarios:
        return NOT_MEASURED
    rows = []
    for scenario in scenarios:
        item = results.get("runtime", OVERHEAD_MODEL, scenario)
        assert item is not None  # listed because it was measured
        rows.append([f"`{scenario}`", format_value(item), item.unit, item.note])
    token = results.value("runtime", OVERHEAD_MODEL, "hop.token_us")
    compute = results.value("runtime", OVERHEAD_MODEL, "hop.token_compute_us")
    parts = [table(["scenario", "runtime", "unit", "note"], rows)]
    if token is not None and compute is not None:
        parts.append(
            "What the runtime adds per streamed token, `hop.token_us` minus "
            f"`hop.token_compute_us`: {token - compute:.1f} us."
        )
    return "\n\n".join(parts)


def _model_results(results: ResultSet, model: str) -> str:
    systems, pairs = results.systems(), results.comparisons()
    ratios = [f"{a}/{b}" for a, b in pairs]
    rows, notes = [], []
    for scenario in results.scenarios(model):
        items = [results.get(s, model, scenario) for s in systems]
        unit = next(i.unit for i in items if i is not None)
        cells = [ABSENT if i is None else format_value(i) for i in items]
        cells += [_ratio(results.versus(model, scenario, b, a)) for a, b in pairs]
        rows.append([f"`{scenario}`", unit, *cells])
        notes += [f"- {i.system}, `{scenario}`: {i.note}" for i in items if i and i.note]
    parts = [f"### {model}", "", table(["scenario", "unit", *systems, *ratios], rows)]
    if notes:
        parts += ["", "Notes:", "", *notes]
    return "\n".join(parts)


def _value(results: ResultSet, system: str, model: str, scenario: str) -> str:
    """A summary cell: the value with its unit (ratios as ``2.5x``), or why there is none."""
    item = results.get(system, model, scenario)
    if item is None:
        return NOT_MEASURED
    if item.value is None or item.unit in ("tokens", "count", "-"):
        return format_value(item)
    return format_value(item) + ("x" if item.unit == "x" else f" {item.unit}")


def _ratio(value: float | None) -> str:
    return ABSENT if value is None else f"{value:.2f}x"


def write(results_path: Path, out: Path, readme: Path | None) -> list[Path]:
    """Write the page, its plots, a copy of the JSON and (unless None) README's headline block.

    Returns the paths written; raises ``headline.MarkersMissing`` if the README lacks its markers.
    """
    with results_path.open(encoding="utf-8") as lines:
        meta, items = read(lines)
    results = ResultSet(items)
    perf = out / "perf"
    perf.mkdir(parents=True, exist_ok=True)
    kept = perf / "results.jsonl"
    if not (kept.exists() and kept.samefile(results_path)):
        shutil.copyfile(results_path, kept)
    source = _relative(kept)
    page = out / "performance.md"
    page.write_text(render(meta, results, source), encoding="utf-8")
    written = [page, kept, *plots.write_plots(results, _models(results), perf)]
    if readme is not None:
        headline.rewrite(readme, headline.block(meta, results, source))
        written.append(readme)
    return written


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__)
    parser.add_argument("results", type=Path, help="JSON lines written by python -m bench --json")
    parser.add_argument("--out", type=Path, default=REPO / "docs", help="performance.md and perf/")
    parser.add_argument(
        "--readme",
        default=str(REPO / "README.md"),
        help="README whose headline block to rewrite ('' for none)",
    )
    args = parser.parse_args(argv)
    readme = Path(args.readme) if args.readme else None
    for path in write(args.results, args.out, readme):
        print(f"wrote {_relative(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
