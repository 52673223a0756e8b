"""Model options (``ModelSpec.options``): one typed vocabulary per backend kind, decoded at load.

A typo, a wrong type or an option that cannot apply is an ``InvalidModelSpec`` naming the option,
raised by ``Runtime.load_model`` before anything is loaded.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.api import Runtime
from runtime.backends import simulated
from runtime.backends.model_source import prepare_model
from runtime.backends.options import (
    MlxOptions,
    OptionValue,
    SimulatedModelOptions,
    decode_options,
)
from runtime.backends.simulated import RealClock, SimulatedBackend
from runtime.config import RuntimeConfig
from runtime.errors import InvalidModelSpec
from runtime.messages import CommandFailed, Generate, ModelLoaded, ModelSpec
from runtime.testing.simulator import Simulator

PER_TOKEN = 0.001


def simulate(spec: ModelSpec) -> Simulator:
    sim = Simulator(seed=0, config=RuntimeConfig(kv_budget_bytes=64 << 20))
    assert isinstance(sim.load(spec), ModelLoaded)
    return sim


def generate(request_id: str, incarnation: int, tokens: tuple[int, ...], n: int) -> Generate:
    return Generate(
        request_id=request_id,
        incarnation=incarnation,
        model="m",
        prompt_tokens=tokens,
        max_tokens=n,
    )


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
        ("mlx", {"context_length": "8192"}, "'context_length'", "an integer, or null"),
        ("mlx", {"weights": "int3"}, "'weights'", "one of 'auto', 'float32'"),
        ("mlx", {"trimmable": False}, "'trimmable'", "known: batching"),
        ("simulated", {"max_batch": True}, "'max_batch'", "an integer"),  # a bool is no count
        ("simulated", {"batching": "False"}, "'batching'", "true or false"),
        ("simulated", {"kv_bits": 4}, "'kv_bits'", "known: batching"),
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
