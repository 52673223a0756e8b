"""``mlxrt serve``'s arguments (the server itself is tested in test_http_*.py)."""

from __future__ import annotations

import io
import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest

from runtime.backends.model_store import DEFAULT_MODEL
from runtime.cli import main
from runtime.cli.model_args import model_specs

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_serve_arguments_become_model_specs() -> None:
    specs = model_specs(["a=/models/a", "b=/models/b"], "mlx", ["kv_bits=4", "weights=float32"])
    assert [(s.name, s.path, s.backend) for s in specs] == [
        ("a", "/models/a", "mlx"),
        ("b", "/models/b", "mlx"),
    ]
    assert specs[0].options == {"kv_bits": 4, "weights": "float32"}
    [simulated] = model_specs(["sim"], "simulated", [])
    assert simulated.path is None
    with pytest.raises(ValueError, match="NAME=PATH"):
        model_specs(["=/models/a"], "mlx", [])
    with pytest.raises(ValueError, match="twice"):
        model_specs(["a=/x", "a=/y"], "mlx", [])
    with pytest.raises(ValueError, match="KEY=VALUE"):
        model_specs(["a=/x"], "mlx", ["kv_bits"])


def test_a_bare_path_is_served_under_a_name_derived_from_it() -> None:
    specs = model_specs(
        ["/models/SmolLM2.Q4_1.gguf", "/models/llama-dir/", "gemma3-270m", "/x/a=b"], "mlx", []
    )
    assert [(s.name, s.path) for s in specs] == [
        ("SmolLM2.Q4_1", "/models/SmolLM2.Q4_1.gguf"),
        ("llama-dir", "/models/llama-dir/"),
        ("gemma3-270m", "gemma3-270m"),
        ("a=b", "/x/a=b"),
    ]


def test_no_model_means_the_default_model() -> None:
    [spec] = model_specs([], "mlx", ["weights=float32"])
    assert (spec.name, spec.path) == (DEFAULT_MODEL, DEFAULT_MODEL)
    assert spec.options == {"weights": "float32"}


def test_generate_without_a_prompt_says_what_to_write(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--backend", "simulated", "--model", "sim"]) == 2
    assert "give a prompt" in capsys.readouterr().err


def test_serve_refuses_a_malformed_model_before_starting(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--model", "=no-name"])
    assert exited.value.code == 2
    assert "NAME=PATH" in capsys.readouterr().err


def test_generate_streams_a_reply_on_the_simulated_backend(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert (
        main(["generate", "--backend", "simulated", "--model", "sim", "--max-tokens", "5", "hi"])
        == 0
    )
    assert capsys.readouterr().out.strip()


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def test_every_command_s_help_ends_with_examples_of_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    usage = _help(capsys)
    match = re.search(r"\{([a-z,-]+)\}", usage)
    assert match is not None, usage
    commands = match[1].split(",")
    assert {"demo", "generate", "chat", "serve"} <= set(commands)
    for command in commands:
        shown = _help(capsys, command)
        examples = shown.partition("\nexamples:\n")[2]
        assert f"mlxrt {command}" in examples, f"`mlxrt {command} --help` shows no examples"


def test_serve_passes_its_default_temperature_to_the_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import uvicorn

    import runtime.server

    seen: list[float] = []

    class Recorded(runtime.server.OpenAIServer):
        def __init__(self, config: runtime.server.ServerConfig, **kwargs: object) -> None:
            seen.append(config.default_temperature)
            super().__init__(config, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(runtime.server, "OpenAIServer", Recorded)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: None)
    assert main(["serve", "--backend", "simulated", "--model", "m", "--quiet"]) == 0
    assert (
        main(["serve", "--backend", "simulated", "--model", "m", "--temp", "0.7", "--quiet"]) == 0
    )
    assert seen == [0.0, 0.7]


SIM_GENERATE = ["generate", "--backend", "simulated", "--model", "sim"]


def test_version_names_the_package_mlx_and_the_blas(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    shown = capsys.readouterr().out
    assert re.match(r"mlxrt \d+\.\d+\.\d+ \(mlx \S+, mlx-lm \S+; BLAS: .+\)$", shown.strip())


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_temp_and_temperature_are_one_flag_everywhere(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for flag in ("--temp", "--temperature"):
        with pytest.raises(SystemExit) as exited:
            main([command, flag, "-0.5", "--backend", "simulated", "--model", "sim", "x"][:-1])
        assert exited.value.code == 2
        assert "--temp must be 0 (greedy) or more" in capsys.readouterr().err
    help_text = _help(capsys, command)
    assert "--temp T, --temperature T" in help_text and "--ctx-size N" in help_text


def test_generate_reports_its_speed_on_stderr_unless_quiet(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*SIM_GENERATE, "--raw", "--max-tokens", "4", "--temp", "0.5", "hello"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"prompt 5 tokens \(0 cached\) [\d.]+ s, 4 tokens [\d.]+ s, [\d.]+ tok/s", err)
    assert main([*SIM_GENERATE, "--raw", "--max-tokens", "4", "--quiet", "hello"]) == 0
    assert capsys.readouterr().err == ""


def test_a_model_without_a_chat_template_gets_the_prompt_raw_and_is_told_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """issue 21: the simulated model has no chat template; `generate` used to frame the prompt
    in a made-up "user:/assistant:" format without a word."""
    assert main([*SIM_GENERATE, "--max-tokens", "2", "hello"]) == 0
    err = capsys.readouterr().err
    assert err.count("sim has no chat template: the text goes to it as is") == 1
    assert "prompt 5 tokens" in err  # b"hello", no frame
    assert main([*SIM_GENERATE, "--max-tokens", "2", "--chat", "hello"]) == 0
    err = capsys.readouterr().err
    assert "no chat template" not in err
    framed = int(re.search(r"prompt (\d+) tokens", err)[1])  # type: ignore[index]
    assert framed > 5  # "user: hello\nassistant: "
    assert main([*SIM_GENERATE, "--max-tokens", "2", "--raw", "hello"]) == 0
    assert "no chat template" not in capsys.readouterr().err


def test_ctx_size_sets_the_context_length(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SIM_GENERATE, "--raw", "--max-tokens", "4", "-c", "8", "a long prompt"]) == 2
    assert "the model's context of 8 tokens" in capsys.readouterr().err
    assert main([*SIM_GENERATE, "--raw", "--max-tokens", "4", "--ctx-size", "64", "hello"]) == 0


@pytest.mark.parametrize("argv", [["-"], ["--prompt", "-"]], ids=["positional", "flag"])
def test_a_dash_reads_the_prompt_from_stdin(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main([*SIM_GENERATE, "--raw", "--max-tokens", "3", *argv]) == 0
    assert "prompt 5 tokens" in capsys.readouterr().err  # the newline echo adds is dropped
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main([*SIM_GENERATE, *argv]) == 2
    assert "stdin was empty" in capsys.readouterr().err


def test_generate_into_a_closed_pipe_ends_quietly() -> None:
    """`mlxrt generate ... | head`: the reader is gone before the first token; no traceback."""
    argv = [sys.executable, "-m", "runtime.cli", *SIM_GENERATE, "--max-tokens", "50", "x"]
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has already gone
    try:
        done = subprocess.run(
            argv, cwd=ROOT, stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120,
            check=False,
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr
    assert "tok/s" not in done.stderr  # nobody reads the reply: no speed line either


def test_serve_checks_its_port_before_loading_any_model(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import runtime.cli.serve

    def no_load(*_: object, **__: object) -> None:
        raise AssertionError("a model was prepared although the port is taken")

    monkeypatch.setattr(runtime.cli.serve, "prepare_specs", no_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", "/no/such/model", "--port", str(port)]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"mlxrt serve: cannot listen on 127.0.0.1:{port} (")
    assert "pick another --port" in line


def test_serve_checks_its_ray_address_before_loading_any_model(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import runtime.cli.serve

    def no_load(*_: object, **__: object) -> None:
        raise AssertionError("a model was prepared although no Ray head answers")

    monkeypatch.setattr(runtime.cli.serve, "prepare_specs", no_load)
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    assert main(["serve", "--model", "/no/such/model", "--ray", f"127.0.0.1:{port}"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"mlxrt serve: no Ray head answers at '127.0.0.1:{port}'")
    assert "ray start --head" in line
    with pytest.raises(SystemExit) as usage:  # a usage error, before anything starts
        main(["serve", "--model", "m", "--backend", "simulated", "--replicas", "0"])
    assert usage.value.code == 2
    assert "--replicas must be at least 1" in capsys.readouterr().err


def test_serve_keeps_named_models_loaded_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """issue 21: `serve --model X` used to unload X after 5 idle minutes. Now only --keep-alive
    does that; models loaded on demand still get the 5-minute default. --ctx-size reaches the
    specs too."""
    import uvicorn

    import runtime.server

    seen: list[runtime.server.ServerConfig] = []

    class Recorded(runtime.server.OpenAIServer):
        def __init__(self, config: runtime.server.ServerConfig, **kwargs: object) -> None:
            seen.append(config)
            super().__init__(config, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(runtime.server, "OpenAIServer", Recorded)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: None)
    base = ["serve", "--backend", "simulated", "--model", "m", "--quiet", "--port", "0"]
    assert main([*base, "--ctx-size", "512", "--temperature", "0.3"]) == 0
    assert main([*base, "--keep-alive", "30s"]) == 0
    default, told = seen
    assert default.models[0].keep_alive_s is None and default.keep_alive_s == 300.0
    assert default.models[0].options["context_length"] == 512
    assert default.default_temperature == 0.3
    assert told.models[0].keep_alive_s == 30.0 and told.keep_alive_s == 30.0


def test_node_kv_budgets_come_from_the_serve_command_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from runtime.cli.mlxrt import build_parser
    from runtime.cli.serve_flags import cluster_config

    parser = build_parser()
    flags = ["serve", "--ray", "--node-kv-budget-mib", "256"]
    args = parser.parse_args([*flags, "--node-kv-budget-mib", "10.0.0.2=512"])
    config = cluster_config(args, parser)
    assert config is not None and config.address is None  # --ray alone: a local Ray
    assert config.kv_budget_bytes_per_node == 256 << 20
    assert config.node_kv_budget_bytes == {"10.0.0.2": 512 << 20}
    assert cluster_config(parser.parse_args(["serve"]), parser) is None
    for bad in (["--node-kv-budget-mib", "256"], [*flags[1:], "--node-kv-budget-mib", "=5"],
                [*flags[1:], "--node-kv-budget-mib", "node=lots"]):  # fmt: skip
        with pytest.raises(SystemExit) as usage:
            cluster_config(parser.parse_args(["serve", *bad]), parser)
        assert usage.value.code == 2
        assert "--node-kv-budget-mib" in capsys.readouterr().err
