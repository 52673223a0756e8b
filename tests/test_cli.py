"""``mlxrt serve``'s arguments (the server itself is tested in test_http_*.py)."""

from __future__ import annotations

import pytest

from runtime.cli import main, model_specs


def test_serve_arguments_become_model_specs() -> None:
    specs = model_specs(["a=/models/a", "b=/models/b"], "mlx", ["kv_bits=4", "note=plain text"])
    assert [(s.name, s.path, s.backend) for s in specs] == [
        ("a", "/models/a", "mlx"),
        ("b", "/models/b", "mlx"),
    ]
    assert specs[0].options == {"kv_bits": 4, "note": "plain text"}
    [simulated] = model_specs(["sim"], "simulated", [])
    assert simulated.path is None
    with pytest.raises(ValueError, match="NAME=PATH"):
        model_specs(["a"], "mlx", [])
    with pytest.raises(ValueError, match="twice"):
        model_specs(["a=/x", "a=/y"], "mlx", [])
    with pytest.raises(ValueError, match="KEY=VALUE"):
        model_specs(["a=/x"], "mlx", ["kv_bits"])


def test_serve_refuses_a_malformed_model_before_starting(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--model", "no-path"])
    assert exited.value.code == 2
    assert "NAME=PATH" in capsys.readouterr().err
