"""Model options (``ModelSpec.options``): one typed vocabulary per backend kind, decoded at load.

A typo, a wrong type or an option that cannot apply is an ``InvalidModelSpec`` naming the option,
raised by ``Runtime.load_model`` before anything is loaded; ``mlxrt`` converts ``KEY=VALUE``
text by the option's declared type.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from runtime.backends import simulated
from runtime.backends.loader import make_backend_loader
from runtime.backends.model_source import PreparedModel, prepare_model
from runtime.backends.options import (
    MlxOptions,
    OptionValue,
    SimulatedModelOptions,
    decode_options,
)
from runtime.backends.simulated import RealClock, SimulatedBackend, greedy_continuation
from runtime.cli import main
from runtime.cli.model_args import model_specs, prepare_specs
from runtime.errors import InvalidConfig, InvalidModelSpec
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import CommandFailed, ModelSpec
from runtime.testing.harness import make_sim
from runtime.testing.requests import generate
from runtime.testing.simulator import Simulator

PER_TOKEN = 0.001


# ---------------------------------------------------------------------- the command line


@pytest.mark.parametrize("text", ["False", "false", "0"])
def test_batching_false_on_the_command_line_turns_batching_off(text: str) -> None:
    # "False" used to arrive as the string "False" (and "0" as the integer 0): batching stayed on.
    [spec] = model_specs(
        ["m"], "simulated", [f"batching={text}", f"decode_s_per_token={PER_TOKEN}"]
    )
    assert spec.options["batching"] is False
    sim = make_sim(spec)
    first, second = tuple(range(10, 20)), tuple(range(30, 60))
    sim.send(generate("a", first, 30))
    sim.send(generate("b", second, 30, incarnation=2))
    sim.run_until_quiescent()
    assert sim.emitted_tokens("a", 1) == greedy_continuation(first, 30)
    assert sim.emitted_tokens("b", 2) == greedy_continuation(second, 30)
    counters = sim.core("engine:m#1").counters.snapshot()  # type: ignore[union-attr]
    assert counters.get("batch_steps", 0) == 0 and counters["decoded_tokens"] > 0


def test_command_line_values_take_each_options_declared_type() -> None:
    [spec] = model_specs(
        ["a=/models/a"],
        "mlx",
        ["kv_bits=4", "max_batch=3", "batching=true", "weights=float32", "context_length=null"],
    )
    assert spec.options == {
        "kv_bits": 4,
        "max_batch": 3,
        "batching": True,
        "weights": "float32",
        "context_length": None,
    }
    [sim] = model_specs(["s"], "simulated", ["prefill_s_per_token=1e-3", "load_s=2"])
    assert sim.options == {"prefill_s_per_token": 0.001, "load_s": 2.0}


@pytest.mark.parametrize(
    ("option", "named", "accepted"),
    [
        ("max_batch=lots", "'max_batch'", "an integer"),
        ("batching=maybe", "'batching'", "true or false"),
        ("kv_bits=5", "'kv_bits'", "4 or 8"),
        ("kv_bit=4", "'kv_bit'", "kv_bits"),
        # Out of range: a zero batch or gate would admit nothing, a negative time misfire.
        ("max_batch=0", "'max_batch'", "an integer >= 1"),
        ("max_concurrent=0", "'max_concurrent'", "an integer >= 1"),
        ("prefill_chunk_ms=-1", "'prefill_chunk_ms'", "a number >= 0"),
        ("decode_stall_ms=-5", "'decode_stall_ms'", "a number >= 0"),
        ("checkpoint_every_tokens=-1", "'checkpoint_every_tokens'", "an integer >= 0"),
        ("context_length=-2", "'context_length'", "an integer >= 0, or null"),
    ],
)
def test_a_command_line_option_that_does_not_convert_names_the_option(
    option: str, named: str, accepted: str
) -> None:
    with pytest.raises(InvalidModelSpec, match=named) as caught:
        model_specs(["a=/models/a"], "mlx", [option])
    assert accepted in caught.value.message


def test_serve_refuses_an_unknown_option_before_starting(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--backend", "simulated", "--model", "m", "--model-option", "batchin=0"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "'batchin'" in err and "batching" in err


def test_prepared_specs_drop_the_weights_their_directory_already_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The CLI converts a .gguf once and hands the engines its directory: the weights option was
    # used up by the conversion, and on a directory it would now be refused.
    monkeypatch.setattr(
        "runtime.cli.model_args.prepare_model", lambda spec, progress: PreparedModel(tmp_path)
    )
    (tmp_path / "tokenizer.json").write_text("{}")  # a model directory has its tokenizer
    spec = ModelSpec(name="g", path="/x/model.gguf", options={"weights": "float32", "kv_bits": 8})
    [prepared] = prepare_specs((spec,), quiet=True)
    assert prepared.path == str(tmp_path)
    assert prepared.options == {"kv_bits": 8}
    assert prepare_model(prepared).path == tmp_path


# ---------------------------------------------------------------------- the host API


@pytest.mark.anyio
async def test_a_misspelt_mlx_option_is_refused_by_load_model(tmp_path: Path) -> None:
    # kv_bit=4 used to be dropped silently: the model loaded with full-precision KV.
    spec = ModelSpec(name="q", path=str(tmp_path / "absent"), options={"kv_bit": 4})
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 20)) as rt:
        with pytest.raises(InvalidModelSpec, match="'kv_bit'") as caught:
            await rt.load_model(spec)
    assert "kv_bits" in caught.value.message and "mlx" in caught.value.message


@pytest.mark.anyio
async def test_weights_on_an_mlx_directory_is_refused_by_load_model(tmp_path: Path) -> None:
    # weights used to be ignored for a directory: the model loaded as its files were.
    spec = ModelSpec(name="d", path=str(tmp_path), options={"weights": "quantized"})
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 20)) as rt:
        with pytest.raises(InvalidModelSpec, match="'weights'") as caught:
            await rt.load_model(spec)
    assert ".gguf" in caught.value.message


def test_weights_on_an_mlx_directory_is_refused_when_preparing(tmp_path: Path) -> None:
    with pytest.raises(InvalidModelSpec, match="directory"):
        prepare_model(ModelSpec(name="d", path=str(tmp_path), options={"weights": "float32"}))


@pytest.mark.anyio
async def test_a_refused_spec_loads_nothing(tmp_path: Path) -> None:
    bad = ModelSpec(name="m", backend="simulated", options={"max_batch": "4"})
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 20)) as rt:
        with pytest.raises(InvalidModelSpec, match="'max_batch'"):
            await rt.load_model(bad)
        # The name is free: nothing was admitted under it.
        loaded = await rt.load_model(ModelSpec(name="m", backend="simulated"))
    assert loaded.model == "m"


def test_an_engine_refuses_bad_options_sent_past_the_host_api() -> None:
    # A LoadModel that skipped Runtime.load_model (the simulator sends it as is) still fails typed.
    sim = Simulator(seed=0, config=RuntimeConfig(kv_budget_bytes=1 << 20))
    reply = sim.load(ModelSpec(name="m", backend="simulated", options={"trimable": False}))
    assert isinstance(reply, CommandFailed) and reply.code == InvalidModelSpec.code
    assert "'trimable'" in reply.message and "trimmable" in reply.message


# ---------------------------------------------------------------------- the vocabulary


def test_each_backend_decodes_its_own_options_and_the_engines() -> None:
    mlx = decode_options(ModelSpec(name="m", options={"kv_bits": 8, "max_batch": 2}))
    assert isinstance(mlx, MlxOptions)
    assert (mlx.kv_bits, mlx.max_batch, mlx.batching, mlx.weights) == (8, 2, True, None)
    sim = decode_options(
        ModelSpec(name="s", backend="simulated", options={"trimmable": False, "load_s": 1})
    )
    assert isinstance(sim, SimulatedModelOptions)
    assert (sim.trimmable, sim.load_s, sim.max_concurrent) == (False, 1.0, 32)
    # The simulated options stay importable where hosts' tests found them.
    assert simulated.SimulatedModelOptions is SimulatedModelOptions


@pytest.mark.parametrize(
    ("backend", "options", "named", "accepted"),
    [
        ("mlx", {"kv_bits": 5}, "'kv_bits'", "4 or 8, or null"),
        ("mlx", {"context_length": "8192"}, "'context_length'", "an integer >= 0, or null"),
        ("mlx", {"weights": "int3"}, "'weights'", "one of 'auto', 'float32'"),
        ("mlx", {"trimmable": False}, "'trimmable'", "known: batching"),
        ("simulated", {"max_batch": True}, "'max_batch'", "an integer"),  # a bool is no count
        ("simulated", {"batching": "False"}, "'batching'", "true or false"),
        ("simulated", {"kv_bits": 4}, "'kv_bits'", "known: batching"),
        ("simulated", {"max_concurrent": 0}, "'max_concurrent'", "an integer >= 1"),
        ("mlx", {"max_batch": -1}, "'max_batch'", "an integer >= 1"),
    ],
)
def test_a_bad_option_names_itself_and_what_is_accepted(
    backend: str, options: dict[str, OptionValue], named: str, accepted: str
) -> None:
    spec = ModelSpec(name="m", backend=backend, options=options)
    with pytest.raises(InvalidModelSpec, match=named) as caught:
        decode_options(spec)
    assert accepted in caught.value.message and f"'{backend}'" in caught.value.message


def test_an_unknown_backend_is_an_invalid_spec() -> None:
    with pytest.raises(InvalidModelSpec, match=r"'onnx'.*mlx"):
        decode_options(ModelSpec(name="m", backend="onnx"))


def test_the_simulated_backend_decodes_its_options_at_load() -> None:
    spec = ModelSpec(name="m", backend="simulated", options={"bytes_per_token": 8})
    assert SimulatedBackend.load(spec, RealClock()).info.bytes_per_token == 8
    with pytest.raises(InvalidModelSpec, match="'bytes_per_tokn'"):
        SimulatedBackend.load(
            ModelSpec(name="m", backend="simulated", options={"bytes_per_tokn": 8}), RealClock()
        )


def test_a_load_decodes_the_options_once_in_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    # The simulator sends LoadModel as is (no host-edge decode): the engine's is the only one.
    from runtime.backends import options

    converted: list[str] = []
    convert = options._convert

    def counting(
        spec: ModelSpec, fields: dict[str, Any], key: str, value: object, *, strict: bool
    ) -> Any:
        converted.append(key)
        return convert(spec, fields, key, value, strict=strict)

    monkeypatch.setattr(options, "_convert", counting)
    make_sim(ModelSpec(name="m", backend="simulated", options={"bytes_per_token": 8}))
    assert converted == ["bytes_per_token"]


def test_the_loader_hands_each_kind_its_struct_and_refuses_another_kinds() -> None:
    load = make_backend_loader(RealClock())
    spec = ModelSpec(name="m", backend="simulated")  # the struct, not spec.options, is read
    assert load(spec, SimulatedModelOptions(bytes_per_token=8)).info.bytes_per_token == 8
    with pytest.raises(InvalidModelSpec, match="SimulatedModelOptions, not MlxOptions"):
        load(spec, MlxOptions())
    with pytest.raises(InvalidModelSpec, match="MlxOptions, not SimulatedModelOptions"):
        load(ModelSpec(name="m", path="/nowhere"), SimulatedModelOptions())


@pytest.mark.parametrize(
    ("knob", "value", "wanted"),
    [
        ("stall_timeout_s", 0.0, "> 0, or None"),
        ("step_timeout_s", -1.0, ">= 0, or None"),
        ("reservation_timeout_s", -0.5, ">= 0"),
        ("router_mailbox_capacity", 0, ">= 1"),
        ("default_max_tokens", 0, ">= 1"),
        ("kv_budget_fraction", 1.5, "in (0, 1]"),
        ("kv_budget_bytes", -1, ">= 0"),
    ],
)
def test_a_runtime_config_knob_out_of_range_is_refused_naming_it(
    knob: str, value: float, wanted: str
) -> None:
    with pytest.raises(InvalidConfig) as caught:
        RuntimeConfig(**{knob: value})
    assert caught.value.code == "invalid_config"
    assert f"RuntimeConfig.{knob}" in caught.value.message and wanted in caught.value.message


def test_runtime_config_ranges_keep_their_off_values() -> None:
    RuntimeConfig(stall_timeout_s=None, step_timeout_s=None, kv_budget_bytes=0)
    RuntimeConfig(step_timeout_s=0.0, reservation_timeout_s=0.0)
