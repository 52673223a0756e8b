"""The bad-input catalogue for what the runtime reads from files and bytes (docs/reliability.md):
model files (a .gguf that is cut short or is not GGUF, a model directory without its tokenizer,
damaged JSON beside the weights, a damaged conversion stamp), model options, and every decode
boundary (the messages' msgpack wire form; the HTTP bodies are in test_bad_input_http.py).

Each gets a typed error with its stable code and a message saying what to do; a runtime whose
load failed still loads and serves a good model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import anyio.to_thread
import msgspec
import numpy as np
import pytest

from runtime.errors import InvalidModelSpec, MalformedMessage, MlxRuntimeError, ModelLoadFailed
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import ModelSpec, Sampling, decode, encode
from runtime.server import OpenAIServer, ServerConfig
from runtime.testing.harness import sim_spec
from runtime.testing.requests import generate
from runtime.testing.tiny_models import tiny_model_path

pytestmark = pytest.mark.anyio

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


async def load_error(spec: ModelSpec) -> MlxRuntimeError:
    """The error ``load_model(spec)`` raises; the same runtime then loads and serves a good one."""
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
        with pytest.raises(MlxRuntimeError) as raised:
            await rt.load_model(spec)
        await rt.load_model(sim_spec("good"))
        served = await rt.complete("good", "fine", max_tokens=2)
        assert served.usage.completion_tokens == 2
        engines = [a for a in rt.stats().actors if a.startswith("engine:")]
        assert len(engines) == 1 and engines[0].startswith("engine:good#")
    return raised.value


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Conversions go to a temporary cache, never the user's."""
    monkeypatch.setenv("MLXRT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def small_gguf(path: Path) -> Path:
    """A complete GGUF file: a little metadata and one float32 tensor."""
    from gguf import GGUFWriter

    writer = GGUFWriter(path, "llama")
    writer.add_uint32("llama.block_count", 1)
    writer.add_tensor("token_embd.weight", np.ones((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# --------------------------------------------------------------------------- model files


@pytest.mark.parametrize("kind", ["not gguf", "empty", "cut in the header", "cut in the data"])
async def test_a_gguf_that_is_not_one_or_cut_short_fails_to_load(
    kind: str, tmp_path: Path, cache: Path
) -> None:
    whole = small_gguf(tmp_path / "whole.gguf").read_bytes()
    content = {
        "not gguf": b"<html>404 Not Found</html>\n" * 8,
        "empty": b"",
        "cut in the header": whole[:12],
        "cut in the data": whole[: len(whole) - 200],
    }[kind]
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    error = await load_error(ModelSpec(name="broken", path=str(path)))
    assert isinstance(error, ModelLoadFailed) and error.code == "model_load_failed"
    assert f"{path} is not a readable GGUF file" in error.message
    assert leftovers(cache) == ["converted"]
    assert leftovers(cache / "converted") == []  # nothing half-built is left


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


async def test_a_damaged_conversion_stamp_says_to_delete_the_copy(tmp_path: Path) -> None:
    from runtime.backends.mlx.gguf.convert import IMPORTER_VERSION, STAMP, convert_gguf

    source = small_gguf(tmp_path / "model.gguf")
    sha256 = "ab" * 32
    converted = tmp_path / "cache" / f"{sha256[:16]}-float32-v{IMPORTER_VERSION}"
    converted.mkdir(parents=True)
    for damage in ("{not json", '["a list"]', '{"architecture": "llama"}'):
        (converted / STAMP).write_text(damage)
        with pytest.raises(ModelLoadFailed, match="is damaged") as raised:
            # Off the loop, as the runtime converts (a conversion reads and writes files).
            await anyio.to_thread.run_sync(
                lambda: convert_gguf(source, tmp_path / "cache", "float32", sha256=sha256)
            )
        assert "delete that directory" in raised.value.message


def copy_without(tmp_path: Path, *names: str) -> Path:
    directory = tmp_path / "model"
    shutil.copytree(tiny_model_path("llama"), directory)
    for name in names:
        (directory / name).unlink()
    return directory


@pytest.mark.parametrize(
    "missing", [TOKENIZER_FILES, ("tokenizer.json",)], ids=["every tokenizer file", "its vocab"]
)
async def test_a_model_directory_without_its_tokenizer_fails_to_load(
    missing: tuple[str, ...], tmp_path: Path
) -> None:
    directory = copy_without(tmp_path, *missing)
    error = await load_error(ModelSpec(name="llama", path=str(directory)))
    assert isinstance(error, ModelLoadFailed) and error.code == "model_load_failed"
    assert f"the model directory {directory} has no tokenizer" in error.message
    assert "copy the model's tokenizer files" in error.message


@pytest.mark.parametrize("name", ["generation_config.json", "config.json"])
@pytest.mark.parametrize("damage", [b"{ not json", b"\xff\xfe", b"[1, 2]"])
async def test_damaged_json_beside_the_weights_fails_to_load(
    name: str, damage: bytes, tmp_path: Path
) -> None:
    directory = copy_without(tmp_path)
    (directory / name).write_bytes(damage)
    error = await load_error(ModelSpec(name="llama", path=str(directory)))
    assert isinstance(error, ModelLoadFailed) and error.code == "model_load_failed"
    assert str(directory) in error.message


async def test_a_server_whose_model_fails_to_load_does_not_start(tmp_path: Path) -> None:
    spec = ModelSpec(name="llama", path=str(copy_without(tmp_path, *TOKENIZER_FILES)))
    server = OpenAIServer(ServerConfig(models=(spec,), runtime=RuntimeConfig(kv_budget_bytes=0)))
    with pytest.raises(ModelLoadFailed, match="has no tokenizer"):
        async with server.app.router.lifespan_context(server.app):
            pass


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (ModelSpec(name="q", backend="teleport"), "teleport"),
        (sim_spec("q", bytes_per_token="lots"), "bytes_per_token"),  # type: ignore[arg-type]
        (sim_spec("q", bytes_per_tokens=1), "bytes_per_tokens"),
        (ModelSpec(name="q", path="m", options={"kv_bits": 3}), "kv_bits"),
    ],
    ids=["unknown backend", "wrong type", "unknown option", "value out of its set"],
)
async def test_model_options_that_do_not_decode_are_refused_before_loading(
    spec: ModelSpec, says: str
) -> None:
    error = await load_error(spec)
    assert isinstance(error, InvalidModelSpec) and error.code == "invalid_model_spec"
    assert says in error.message


# --------------------------------------------------------------------------- msgpack wire form

GENERATE = generate("r", max_tokens=None, prompt="hi", sampling=Sampling())
GARBAGE = {
    "empty": b"",
    "not msgpack": b"\xc1",  # a byte msgpack never uses
    "text": b"hello, runtime",
    "cut short": encode(GENERATE)[:-3],
    "trailing bytes": encode(GENERATE) + b"\x00",
    "unknown tag": msgspec.msgpack.encode({"type": "Teleport", "to": "mars"}),
    "no tag": msgspec.msgpack.encode({"request_id": "r", "incarnation": 1, "model": "m"}),
    "not a map": msgspec.msgpack.encode([1, 2, 3]),
    "wrong field type": msgspec.msgpack.encode(
        {**msgspec.to_builtins(GENERATE), "incarnation": "one"}
    ),
    "unknown field": msgspec.msgpack.encode({**msgspec.to_builtins(GENERATE), "priority": 9}),
    "bad nested value": msgspec.msgpack.encode(
        {**msgspec.to_builtins(GENERATE), "sampling": {"temprature": 2}}
    ),
    "bad extension": b"\xd4\x05\x00",  # a msgpack ext type the runtime never writes
    "deep nesting": b"\x91" * 100_000 + b"\xc0",
}


@pytest.mark.parametrize("data", GARBAGE.values(), ids=GARBAGE.keys())
def test_garbage_on_the_wire_is_a_malformed_message(data: bytes) -> None:
    with pytest.raises(MalformedMessage) as raised:
        decode(data)
    assert raised.value.code == "malformed_message"
    assert "messages.encode" in raised.value.message


def test_a_good_wire_form_still_decodes() -> None:
    assert decode(encode(GENERATE)) == GENERATE
