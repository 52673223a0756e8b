"""``mlxrt serve``'s arguments (the server itself is tested in test_http_*.py)."""

from __future__ import annotations

import re

import pytest

from runtime.backends.model_store import DEFAULT_MODEL
from runtime.cli import main, model_specs


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
