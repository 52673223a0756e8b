"""The bench report: page, README headline and plots from a small fixture run (no timing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import headline, report
from bench.headline import END, START, MarkersMissing
from bench.results import Measurement, ResultSet, format_table, read

META = {
    "machine": {"cpu": "Fixture CPU", "cores": 2, "memory_gib": 24.0},
    "os": "Linux",
    "python": "3.11.7",
    "versions": {"mlx": "0.32.4", "mlx-lm": "0.32.2", "msgspec": "0.22.0", "uvloop": "0.23.0"},
    "commit": "0123abc",
    "blas": "OpenBLAS via LD_PRELOAD (/usr/lib/libblas.so.3)",
    "mode": "full",
    "argv": ["--models", "smollm2,llama"],
    "date": "2026-01-01T00:00:00+00:00",
}
# (system, model, scenario, value, unit): smollm2 fully compared, llama and gemma3 barely or not.
ROWS = [
    ("runtime", "simulated", "hop.message_us_p50", 2.7, "us"),
    ("runtime", "simulated", "hop.token_us", 130.0, "us"),
    ("runtime", "simulated", "hop.token_compute_us", 40.0, "us"),
    ("runtime", "smollm2", "turn2.cold_ttft", 1000.0, "ms"),
    ("mlx-lm", "smollm2", "turn2.cold_ttft", 1000.0, "ms"),
    ("mlx_lm.server", "smollm2", "turn2.cold_ttft", 800.0, "ms"),
    ("runtime", "smollm2", "turn2.warm_ttft", 50.0, "ms"),
    ("mlx_lm.server", "smollm2", "turn2.warm_ttft", 100.0, "ms"),
    ("runtime", "smollm2", "decode.tokens_per_s", 12.0, "tok/s"),
    ("mlx-lm", "smollm2", "decode.tokens_per_s", 12.5, "tok/s"),
    ("runtime", "smollm2", "abandon.short_idle_ttft", 40.0, "ms"),
    ("runtime", "smollm2", "abandon.short_after_ttft", 50.0, "ms"),
    ("mlx_lm.server", "smollm2", "abandon.short_after_ttft", 1000.0, "ms"),
    ("runtime", "smollm2", "abandon.after/idle", 1.25, "x"),
    ("runtime", "smollm2", "concurrency.8.tok_s", 40.0, "tok/s"),
    ("mlx_lm.server", "smollm2", "concurrency.8.tok_s", 20.0, "tok/s"),
    ("runtime", "smollm2", "keystroke.latency_p50", 30.0, "ms"),
    ("mlx_lm.server", "smollm2", "keystroke.latency_p50", 60.0, "ms"),
    ("runtime", "smollm2", "turn2.prefilled_warm", 14.0, "tokens"),
    ("runtime", "llama", "turn2.cold_ttft", 30.0, "ms"),
]
README = f"# Project\n\nBefore.\n\n{START}\nstale figures\n{END}\n\nAfter.\n"


@pytest.fixture
def run(tmp_path: Path) -> Path:
    lines = [json.dumps({"meta": META})]
    lines += [
        json.dumps({"system": s, "model": m, "scenario": c, "value": v, "unit": u, "samples": []})
        for s, m, c, v, u in ROWS
    ]
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _loaded(run: Path) -> tuple[dict[str, object], ResultSet]:
    with run.open(encoding="utf-8") as lines:
        meta, items = read(lines)
    return meta, ResultSet(items)


def _page(run: Path) -> str:
    return report.render(*_loaded(run), source="run.jsonl")


def _readme(run: Path, tmp_path: Path) -> str:
    readme = tmp_path / "README.md"
    if not readme.exists():
        readme.write_text(README, encoding="utf-8")
    headline.rewrite(readme, headline.block(*_loaded(run), source="run.jsonl"))
    return readme.read_text(encoding="utf-8")


def test_the_page_lists_values_and_runtime_ratios_per_model(run: Path) -> None:
    page = _page(run)
    assert "| `turn2.cold_ttft` | ms | 1000.0 | 1000.0 | 800.0 | 1.00x | 1.25x |" in page
    assert "| `decode.tokens_per_s` | tok/s | 12.00 | 12.50 | — | 0.96x | — |" in page
    assert "| `turn2.cold_ttft` | ms | 30.00 | — | — | — | — |" in page  # llama: runtime only
    assert "| CPU | Fixture CPU, 2 cores |" in page
    assert "| BLAS | OpenBLAS via LD_PRELOAD (/usr/lib/libblas.so.3) |" in page
    assert "| mlx-lm | 0.32.2 |" in page
    assert "`hop.token_us` minus `hop.token_compute_us`: 90.0 us" in page
    assert "$" not in page  # every template field was filled


def test_the_page_judges_each_goal_per_model(run: Path) -> None:
    page = _page(run)
    # Columns: scenario, goal, then the measured models in order (llama, smollm2).
    goal_rows = {
        "`turn2.cold_ttft` | runtime/mlx-lm ≤ 1.05x": "not measured | met (1.00x)",
        "`turn2.cold_ttft` | runtime/mlx_lm.server ≤ 1.00x": "not measured | not met (1.25x)",
        "`turn2.warm_ttft` | runtime/mlx_lm.server ≤ 1.00x": "not measured | met (0.50x)",
        "`decode.tokens_per_s` | runtime/mlx-lm ≥ 0.97x": "not measured | not met (0.96x)",
        "`abandon.after/idle` | `abandon.after/idle` ≤ 1.50x": "not measured | met (1.25x)",
        "`concurrency.8.tok_s` | runtime/mlx_lm.server ≥ 1.00x": "not measured | met (2.00x)",
        "`concurrency.1.tok_s` | runtime/mlx_lm.server ≥ 1.00x": "not measured | not measured",
    }
    for head, cells in goal_rows.items():
        assert f"| {head} | {cells} |" in page
    assert "`hop.message_us_p50` ≤ 10 us: met (2.7 us)" in page


def test_the_readme_block_holds_the_headline_and_nothing_else_changes(
    run: Path, tmp_path: Path
) -> None:
    readme = _readme(run, tmp_path)
    before, _, rest = readme.partition(START)
    block, _, after = rest.partition(END)
    assert before == "# Project\n\nBefore.\n\n"
    assert after == "\n\nAfter.\n"
    assert "stale figures" not in block
    assert (
        "| cold TTFT | smollm2 | 1.00x | 1.25x | runtime/mlx-lm ≤ 1.05x; "
        "runtime/mlx_lm.server ≤ 1.00x | met (1.00x); not met (1.25x) |"
    ) in block
    assert "| decode tok/s | smollm2 | 0.96x | not measured |" in block
    assert "| 8-stream tok/s | smollm2 | not measured | 2.00x |" in block
    assert "| keystroke latency p50 | smollm2 | not measured | 0.50x | none set | - |" in block
    assert "| cold TTFT | gemma3 | not measured | not measured |" in block  # absent model
    assert "Fixture CPU (2 cores)" in block


def test_a_second_report_replaces_the_block_instead_of_adding_one(
    run: Path, tmp_path: Path
) -> None:
    first = _readme(run, tmp_path)
    assert _readme(run, tmp_path) == first


def test_a_readme_without_markers_is_refused(run: Path, tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# Project\n", encoding="utf-8")
    with pytest.raises(MarkersMissing):
        headline.rewrite(readme, "figures")
    assert readme.read_text(encoding="utf-8") == "# Project\n"


def test_a_report_writes_the_page_plots_readme_and_the_run_they_came_from(
    run: Path, tmp_path: Path
) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(README, encoding="utf-8")
    docs = tmp_path / "docs"
    report.write(run, docs, readme)
    perf = docs / "perf"
    for name in ("ttft.png", "throughput.png", "abandon.png"):
        assert (perf / name).read_bytes().startswith(b"\x89PNG\r\n\x1a\n"), name
    assert (perf / "results.jsonl").read_text() == run.read_text()
    page = (docs / "performance.md").read_text(encoding="utf-8")
    assert "![Time to first token (ms, lower is better)](perf/ttft.png)" in page
    assert "| cold TTFT | smollm2 | 1.00x | 1.25x |" in readme.read_text(encoding="utf-8")
    # Rebuilt from the copy it kept, the page is the same.
    report.write(perf / "results.jsonl", docs, None)
    assert (docs / "performance.md").read_text(encoding="utf-8") == page


def test_the_printed_table_divides_times_and_rates_only() -> None:
    table = format_table(
        [
            Measurement("runtime", "llama", "turn2.cold_ttft", 10.0, "ms"),
            Measurement("mlx-lm", "llama", "turn2.cold_ttft", 8.0, "ms"),
            Measurement("mlx_lm.server", "llama", "turn2.cold_ttft", 20.0, "ms"),
            Measurement("runtime", "llama", "turn2.prefilled_cold", 600.0, "tokens"),
            Measurement("mlx_lm.server", "llama", "turn2.prefilled_cold", 300.0, "tokens"),
        ]
    )
    header, _, cold, prefilled, legend = table.splitlines()
    assert header.split()[-2:] == ["runtime/mlx-lm", "runtime/mlx_lm.server"]
    assert cold.split()[-2:] == ["1.25x", "0.50x"]
    assert prefilled.split()[-2:] == ["-", "-"]
    assert "below 1 is better" in legend
