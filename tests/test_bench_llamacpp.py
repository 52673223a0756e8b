"""The bench's llama.cpp systems: what starts them, when they are skipped, and how they are judged.

No llama.cpp runs here: the commands are checked as argv, the build script on its cached path, the
report on a fixture run (as tests/test_bench_report.py does).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from bench import goals, headline, llamacpp, report
from bench.http_client import Reply
from bench.llamacpp import LLAMA_SERVER, OURS_LLAMACPP, Binary, Found, Unavailable
from bench.models import BenchModel
from bench.results import Measurement, ResultSet, format_table, read, split_ttft

REPO = Path(__file__).resolve().parents[1]
GGUF = Path("/models/SmolLM2-135M-Instruct.Q4_1.gguf")
REAL = BenchModel("smollm2", Path("/converted/smollm2"), None, None, True, gguf=GGUF)
TINY = BenchModel("llama", Path("/tiny/llama"), None, None, False)
BINARY = Binary(Path("/opt/llama/bin/llama-server"), "version: 1 (test)")


def test_llama_server_serves_the_gguf_file_with_two_threads() -> None:
    found = Found(BINARY, Unavailable("no llama-cpp-python"))
    command = found.command(LLAMA_SERVER, REAL)
    assert not isinstance(command, Unavailable)
    assert command.system == LLAMA_SERVER
    assert command.argv == (str(BINARY.path), "--model", str(GGUF), "--threads", "2")
    one = Found(BINARY, None, threads=1).command(LLAMA_SERVER, REAL)
    assert not isinstance(one, Unavailable)
    assert one.argv[-2:] == ("--threads", "1")
    assert "`--threads 1`" in Found(BINARY, None, threads=1).describe()[LLAMA_SERVER]


def test_ours_on_llamacpp_is_mlxrt_serve_with_that_backend_on_the_same_file() -> None:
    command = Found(BINARY, None).command(OURS_LLAMACPP, REAL)
    assert not isinstance(command, Unavailable)
    assert command.system == OURS_LLAMACPP
    assert command.model == "smollm2"
    argv = command.argv
    assert argv[:4] == (sys.executable, "-m", "runtime.cli", "serve")
    assert argv[argv.index("--model") + 1] == f"smollm2={GGUF}"
    assert argv[argv.index("--backend") + 1] == "llamacpp"
    assert argv[argv.index("--model-option") + 1] == "n_threads=2"  # llama-server's threads


def test_each_system_is_skipped_with_its_own_reason() -> None:
    no_binary = Unavailable("llama-server is not built and the build failed")
    no_backend = Unavailable("`mlxrt serve` has no `--backend llamacpp` yet")
    found = Found(no_binary, no_backend)
    assert found.command(LLAMA_SERVER, REAL) == no_binary
    assert found.command(OURS_LLAMACPP, REAL) == no_backend
    for system in llamacpp.SYSTEMS:  # a tiny model has no GGUF file, whatever is installed
        tiny = Found(BINARY, None).command(system, TINY)
        assert isinstance(tiny, Unavailable)
        assert "no GGUF file" in tiny.reason
    row = llamacpp.skipped(LLAMA_SERVER, REAL, no_binary)
    assert (row.system, row.model, row.scenario, row.value) == (
        LLAMA_SERVER,
        "smollm2",
        "skipped",
        None,
    )
    assert row.note == no_binary.reason
    described = found.describe()
    assert described[LLAMA_SERVER] == f"skipped: {no_binary.reason}"
    assert "--threads 2" in Found(BINARY, None).describe()[LLAMA_SERVER]


def test_a_system_not_asked_for_is_neither_started_nor_described() -> None:
    found = Found(BINARY, llamacpp.NOT_ASKED)
    assert found.wanted() == [LLAMA_SERVER]
    assert list(found.describe()) == [LLAMA_SERVER]
    assert Found(llamacpp.NOT_ASKED, None).wanted() == [OURS_LLAMACPP]


@pytest.mark.parametrize(
    ("choices", "expected"),
    [(["mlx", "simulated"], ("mlx", "simulated")), (["mlx", "llamacpp"], ("mlx", "llamacpp"))],
)
def test_the_backends_are_read_from_argparse_help(
    choices: list[str], expected: tuple[str, ...]
) -> None:
    parser = argparse.ArgumentParser(prog="mlxrt serve")
    parser.add_argument("--model")
    parser.add_argument("--backend", default="mlx", choices=choices, help="which backend")
    assert llamacpp.backend_choices(parser.format_help()) == expected
    assert llamacpp.backend_choices("usage: mlxrt serve [--model M]") == ()


def test_the_cli_of_this_checkout_lists_its_backends() -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    assert "mlx" in llamacpp.backend_choices(shown.stdout)


def _executable(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_the_build_script_builds_nothing_when_the_binary_is_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The cache folder names the build's flavour: AMX is left out on x86 (the script says why).
    flavour = "native-noamx" if platform.machine() in ("x86_64", "amd64") else "native"
    cached = tmp_path / "llama.cpp" / f"11434.0.0-{flavour}" / "bin" / "llama-server"
    _executable(cached, "#!/bin/sh\necho 'version: 7 (cached)'\n")
    monkeypatch.setenv("MLXRT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(llamacpp.BINARY_ENV, raising=False)
    done = subprocess.run(
        ["bash", str(llamacpp.BUILD_SCRIPT)], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == str(cached)
    assert sorted(p.name for p in cached.parent.parent.iterdir()) == ["bin"]  # no build dir
    assert llamacpp.find_llama_server() == Binary(cached, "version: 7 (cached)")


def test_a_named_binary_that_cannot_run_is_a_reason_not_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = tmp_path / "llama-server"
    plain.write_text("not a program", encoding="utf-8")
    monkeypatch.setenv(llamacpp.BINARY_ENV, str(plain))
    found = llamacpp.find_llama_server()
    assert isinstance(found, Unavailable)
    assert str(plain) in found.reason
    assert os.access(plain, os.X_OK) is False


def test_prefilled_tokens_prefer_llama_servers_own_count() -> None:
    usage = {"prompt_tokens": 900, "prompt_tokens_details": {"cached_tokens": 880}}
    assert Reply(usage=usage, timings={"prompt_n": 20, "cache_n": 880}).prefilled_tokens == 20
    assert Reply(usage=usage).prefilled_tokens == 20  # prompt_tokens - cached_tokens
    assert Reply(usage={"prompt_tokens": 900}).prefilled_tokens is None  # nothing said


def test_a_ttft_splits_by_the_servers_own_prompt_time_only_where_every_reply_said() -> None:
    assert Reply(timings={"prompt_ms": 412.5}).prompt_eval_s == 0.4125
    assert Reply().prompt_eval_s is None  # mlx_lm.server reports no timings
    rows = split_ttft(
        OURS_LLAMACPP, "smollm2", "turn2.cold_ttft", [0.5, 0.44, 0.6], [0.4, 0.4, 0.5]
    )
    assert [(r.scenario, r.value, r.unit) for r in rows] == [
        ("turn2.cold_ttft.eval", 400.0, "ms"),
        ("turn2.cold_ttft.rest", 100.0, "ms"),  # the median of 100, 40 and 100 ms
    ]
    assert split_ttft(LLAMA_SERVER, "smollm2", "turn2.cold_ttft", [0.5, 0.4], [0.4, None]) == []


# (system, model, scenario, value, unit): ours on llama.cpp and llama-server on smollm2, skipped
# on gemma3; the runtime on MLX beside them.
ROWS = [
    ("runtime", "smollm2", "turn2.cold_ttft", 1240.0, "ms"),
    (LLAMA_SERVER, "smollm2", "turn2.cold_ttft", 1000.0, "ms"),
    (OURS_LLAMACPP, "smollm2", "turn2.cold_ttft", 900.0, "ms"),
    (LLAMA_SERVER, "smollm2", "turn2.cold_ttft.eval", 960.0, "ms"),
    (LLAMA_SERVER, "smollm2", "turn2.cold_ttft.rest", 40.0, "ms"),
    (OURS_LLAMACPP, "smollm2", "turn2.cold_ttft.eval", 870.4, "ms"),
    (OURS_LLAMACPP, "smollm2", "turn2.cold_ttft.rest", 29.6, "ms"),
    (LLAMA_SERVER, "smollm2", "decode.tokens_per_s", 125.0, "tok/s"),
    (OURS_LLAMACPP, "smollm2", "decode.tokens_per_s", 100.0, "tok/s"),
    ("runtime", "smollm2", "decode.tokens_per_s", 17.0, "tok/s"),
    (LLAMA_SERVER, "smollm2", "abandon.after/idle", 61.9, "x"),
    (OURS_LLAMACPP, "smollm2", "abandon.after/idle", 1.2, "x"),
    (LLAMA_SERVER, "smollm2", "branch.900.ttft", 100.0, "ms"),
    (OURS_LLAMACPP, "smollm2", "branch.900.ttft", 80.0, "ms"),
    (LLAMA_SERVER, "smollm2", "concurrency.8.tok_s", 200.0, "tok/s"),
    (OURS_LLAMACPP, "smollm2", "concurrency.8.tok_s", 250.0, "tok/s"),
]
SKIPS = [
    (LLAMA_SERVER, "gemma3", "no binary was built"),
    (OURS_LLAMACPP, "gemma3", "llama-cpp-python is not installed"),
]


def _results() -> ResultSet:
    lines = [json.dumps({"meta": {"mode": "full", "llama.cpp": {LLAMA_SERVER: "`/x` (v1)"}}})]
    lines += [
        json.dumps({"system": s, "model": m, "scenario": c, "value": v, "unit": u})
        for s, m, c, v, u in ROWS
    ]
    lines += [
        json.dumps(
            {"system": s, "model": m, "scenario": "skipped", "value": None, "unit": "-", "note": n}
        )
        for s, m, n in SKIPS
    ]
    _, items = read(lines)
    return ResultSet(items)


def test_issue_22_goals_judge_ours_on_llamacpp_against_llama_server() -> None:
    results = _results()
    assert goals.judged(goals.LLAMACPP_DECODE, results, "smollm2") == "not met (0.80x)"
    assert goals.judged(goals.LLAMACPP_COLD, results, "smollm2") == "met (0.90x)"
    assert goals.judged(goals.LLAMACPP_ABANDON, results, "smollm2") == "met (1.20x)"
    assert goals.judged(goals.LLAMACPP_BRANCH[900], results, "smollm2") == "met (0.80x)"
    assert goals.judged(goals.LLAMACPP_CONCURRENCY[8], results, "smollm2") == "met (1.25x)"
    assert goals.judged(goals.LLAMACPP_COLD, results, "gemma3") == "not measured"
    assert goals.LLAMACPP_DECODE.text == "ours-llamacpp/llama-server ≥ 0.95x"
    assert goals.LLAMACPP_ABANDON.text == "ours-llamacpp `abandon.after/idle` ≤ 1.50x"


def test_a_paired_goal_shows_the_spread_of_its_per_repetition_ratios() -> None:
    """The servers took each repetition in turn: ours 1,020, 1,100 and 960 ms against 1,000,
    1,000 and 1,000 ms is 1.02x (medians) and 0.96-1.10x repetition by repetition."""
    rows = [
        Measurement(OURS_LLAMACPP, "smollm2", "turn2.cold_ttft", 1020.0, "ms", [1020, 1100, 960]),
        Measurement(LLAMA_SERVER, "smollm2", "turn2.cold_ttft", 1000.0, "ms", [1000] * 3),
        Measurement(OURS_LLAMACPP, "smollm2", "abandon.after/idle", 1.2, "x", [1.1, 1.3]),
        Measurement("runtime", "smollm2", "turn2.cold_ttft", 1240.0, "ms", [1200, 1240, 1300]),
        Measurement("mlx_lm.server", "smollm2", "turn2.cold_ttft", 1000.0, "ms", [1000] * 3),
    ]
    results = ResultSet(rows)
    cold = goals.LLAMACPP_COLD
    assert goals.spread(cold, results, "smollm2") == pytest.approx((0.96, 1.10))
    assert goals.judged_in_full(cold, results, "smollm2") == "not met (1.02x; 0.96-1.10x)"
    # Not paired: its own ratio, or systems measured apart (the runtime in its own process).
    assert goals.judged_in_full(goals.LLAMACPP_ABANDON, results, "smollm2") == "met (1.20x)"
    assert goals.judged_in_full(goals.COLD_VS_SERVER, results, "smollm2") == "not met (1.24x)"
    assert goals.judged_in_full(cold, results, "gemma3") == "not measured"


def test_a_goal_not_met_says_why_from_the_runs_own_rows() -> None:
    """Repetitions on both sides of the limit are noise; otherwise the servers' own prompt times
    place a TTFT gap in the prompt's evaluation or outside it (the runtime's hand-offs)."""
    warm = "turn2.warm_ttft"
    rows = [
        Measurement(OURS_LLAMACPP, "smollm2", warm, 114.0, "ms", [112, 114, 120]),
        Measurement(LLAMA_SERVER, "smollm2", warm, 110.0, "ms", [110] * 3),
        Measurement(OURS_LLAMACPP, "smollm2", f"{warm}.eval", 108.7, "ms", []),
        Measurement(LLAMA_SERVER, "smollm2", f"{warm}.eval", 108.5, "ms", []),
        Measurement(OURS_LLAMACPP, "smollm2", f"{warm}.rest", 5.5, "ms", []),
        Measurement(LLAMA_SERVER, "smollm2", f"{warm}.rest", 3.6, "ms", []),
        Measurement(OURS_LLAMACPP, "smollm2", "turn2.cold_ttft", 1020.0, "ms", [1020, 1100, 960]),
        Measurement(LLAMA_SERVER, "smollm2", "turn2.cold_ttft", 1000.0, "ms", [1000] * 3),
        Measurement(OURS_LLAMACPP, "smollm2", "turn2.cold_ttft.eval", 1015.0, "ms", []),
        Measurement(LLAMA_SERVER, "smollm2", "turn2.cold_ttft.eval", 990.0, "ms", []),
        Measurement(OURS_LLAMACPP, "smollm2", "turn2.cold_ttft.rest", 5.0, "ms", []),
        Measurement(LLAMA_SERVER, "smollm2", "turn2.cold_ttft.rest", 10.0, "ms", []),
        Measurement(OURS_LLAMACPP, "gemma3", warm, 50.0, "ms", [50, 51, 49]),
        Measurement(LLAMA_SERVER, "gemma3", warm, 80.0, "ms", [80, 80, 80]),
    ]
    results = ResultSet(rows)
    assert goals.why_not(goals.LLAMACPP_WARM, results, "smollm2") == (
        "every repetition missed it (1.02-1.09x); 1.9 ms more outside the prompt's evaluation "
        "(the servers' own prompt times: +0.2 ms, 1.00x): the runtime's own hand-offs around "
        "llama.cpp's work (HTTP, tokenizing, the cache's and budget's messages, the jobs' trips "
        "to the compute thread)"
    )
    assert goals.why_not(goals.LLAMACPP_COLD, results, "smollm2") == (
        "within this run's noise: its repetitions gave 0.96-1.10x, on both sides of 1.00x; "
        "25.0 ms more in the prompt's evaluation (1.03x, by the servers' own prompt times; "
        "-5.0 ms outside it)"
    )
    assert goals.why_not(goals.LLAMACPP_WARM, results, "gemma3") == ""  # met
    assert goals.why_not(goals.LLAMACPP_COLD, results, "gemma3") == ""  # not measured
    page = report.render({"mode": "full"}, results, "r")
    assert "Why a goal was not met, from this run's own rows:" in page
    assert "- `turn2.warm_ttft` on smollm2: every repetition missed it (1.02-1.09x);" in page
    readme = headline.llamacpp_block(results)  # README's block: the same bullets, wrapped
    assert "Why a goal was not met, from this run's own rows:\n\n- `turn2.cold_ttft`" in readme
    assert all(len(line) <= 100 for line in readme.splitlines() if not line.startswith("|"))


def test_the_page_shows_llama_server_beside_the_others_and_why_one_was_skipped() -> None:
    results = _results()
    page = report.render({"mode": "full", "llama.cpp": {LLAMA_SERVER: "`/x` (v1)"}}, results, "r")
    assert (
        "| `decode.tokens_per_s` | ours-llamacpp/llama-server ≥ 0.95x | not met (0.80x) "
        "| not measured |" in page
    )
    assert "llama-server skipped on gemma3: no binary was built." in page
    assert "ours-llamacpp skipped on gemma3: llama-cpp-python is not installed." in page
    assert "| llama-server | `/x` (v1) |" in page  # the run table says which binary ran
    header = (
        "| scenario | unit | runtime | llama-server | ours-llamacpp | runtime/llama-server "
        "| ours-llamacpp/llama-server |"
    )
    assert header in page
    assert "| `turn2.cold_ttft` | ms | 1240.0 | 1000.0 | 900.0 | 1.24x | 0.90x |" in page
    # Where the TTFTs went: only the goals whose two sides both split them have a cell.
    assert "| scenario | smollm2 | gemma3 |" in page
    assert "| `turn2.cold_ttft` | prompt time 870 vs 960 ms, the rest 30 vs 40 ms | — |" in page
    assert "| `turn2.warm_ttft` | — | — |" in page


def test_the_readme_block_has_the_llama_server_rows(tmp_path: Path) -> None:
    text = headline.block({"mode": "full"}, _results(), "r")
    assert (
        "| cold TTFT | smollm2 | 0.90x | 1.24x | ours-llamacpp/llama-server ≤ 1.00x | met (0.90x) |"
        in text
    )
    assert "| decode tok/s | smollm2 | 0.80x | 0.14x |" in text
    assert "| branch TTFT, ~900 tokens | gemma3 | not measured | not measured |" in text
    assert "llama-server smollm2 61.90x, gemma3 not measured" in text
    assert "llama-server skipped on gemma3: no binary was built." in text


def test_the_printed_table_has_a_column_per_system_the_run_has() -> None:
    table = format_table(
        [
            Measurement(LLAMA_SERVER, "smollm2", "turn2.cold_ttft", 10.0, "ms"),
            Measurement(OURS_LLAMACPP, "smollm2", "turn2.cold_ttft", 9.0, "ms"),
        ]
    )
    header, _, row, _legend = table.splitlines()
    assert header.split()[3:] == [LLAMA_SERVER, OURS_LLAMACPP, "ours-llamacpp/llama-server"]
    assert row.split()[-1] == "0.90x"
