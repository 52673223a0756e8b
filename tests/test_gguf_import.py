"""GGUF import (runtime.backends.mlx.gguf): each llama.cpp convention the importer undoes is proven
by what the real model does with it undone and without; the Q4/Q8 repack is proven exact against
gguf's own dequantizer; then errors, the conversion cache and the whole path through
``Runtime.load_model``.

The "not undone" models are built without touching production code: the same tensor conversion
with a patched ``Architecture`` (``dataclasses.replace``), loaded into the converted model's
mlx-lm class. The tokenizers are tested in test_gguf_tokenizer.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import filecmp
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter
from gguf.quants import quantize
from hypothesis import given
from hypothesis import strategies as st
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.utils import load_model, load_tokenizer

from runtime.backends.mlx.gguf.architectures import ARCHITECTURES, GEMMA3, LLAMA, Architecture
from runtime.backends.mlx.gguf.convert import (
    STAMP,
    ConvertedModel,
    _convert_tensors,
    convert_gguf,
    read_metadata,
)
from runtime.backends.mlx.gguf.tensors import GROUP, affine_triple, dense
from runtime.errors import InvalidModelSpec, ModelLoadFailed, UnsupportedModelFormat
from runtime.progress import no_progress
from tests.loop_checks import on_asyncio

SMOL = "smollm2-135m-instruct"
GEMMA = "gemma3-270m"
Converted = Callable[[str, str], ConvertedModel]

# Plain factual English, ~90 tokens (a creative paragraph gives SmolLM2 NLL ~3.5 even when right).
PARAGRAPH = (
    "Water boils at 100 degrees Celsius at sea level. At higher altitudes the air pressure is "
    "lower, so water boils at a lower temperature. This is why cooking pasta takes longer in the "
    "mountains. When water freezes, it turns into ice and expands, which is why pipes can burst in "
    "winter. Most of the water on Earth is found in the oceans, and only a small part of it is "
    "fresh water that people can drink."
)


@pytest.fixture(scope="module")
def gguf_files(real_gguf: Callable[[str], Path]) -> Callable[[str], tuple[Any, dict[str, Any]]]:
    """``gguf_files(name)``: the gguf reader of a known model's file and its metadata, read once
    (reading Gemma's 262k-token vocabulary takes ~8 s)."""
    opened: dict[str, tuple[Any, dict[str, Any]]] = {}

    def get(name: str) -> tuple[Any, dict[str, Any]]:
        if name not in opened:
            opened[name] = read_metadata(real_gguf(name))
        return opened[name]

    return get


def tensor_named(reader: Any, name: str) -> Any:
    return next(t for t in reader.tensors if t.name == name)


def mean_nll(model: nn.Module, ids: list[int]) -> float:
    """Mean negative log-likelihood of each token of ``ids`` given those before it."""
    tokens = mx.array(ids)[None]
    logits = model(tokens[:, :-1]).astype(mx.float32)
    return float(nn.losses.cross_entropy(logits[0], tokens[0, 1:]).mean().item())


def paragraph_nlls(
    converted: ConvertedModel,
    gguf: tuple[Any, dict[str, Any]],
    broken: Architecture,
    touched: Callable[[str], bool],
) -> tuple[float, float]:
    """The paragraph's mean NLL on the converted model, then on the same model with the weights
    converted by ``broken`` (the same architecture with one convention left in place).

    Only the GGUF tensors ``touched`` by that convention are converted again (every other one
    converts the same either way, and dequantizing all of Gemma's takes ~20 s)."""
    tokenizer = load_tokenizer(converted.path)
    ids = list(tokenizer.encode(PARAGRAPH))
    model, _ = load_model(converted.path)
    undone = mean_nll(model, ids)
    reader, meta = gguf
    some = SimpleNamespace(tensors=[t for t in reader.tensors if touched(t.name)])
    tensors, quantization, _ = _convert_tensors(some, meta, broken, "float32", no_progress)
    assert tensors and not quantization
    weights = dict(tree_flatten(model.parameters()))
    assert tensors.keys() <= weights.keys()
    model.load_weights(list({**weights, **tensors}.items()))  # strict: the same names and shapes
    return undone, mean_nll(model, ids)


# ---------------------------------------------------------------------- conventions


@pytest.mark.real_model
def test_llama_qk_rows_unpermuted_is_what_makes_smollm2_fluent(
    converted_gguf: Converted, gguf_files: Callable[[str], tuple[Any, dict[str, Any]]]
) -> None:
    kept_permuted = dataclasses.replace(LLAMA, fix_rows=lambda name, meta: None)

    undone, not_undone = paragraph_nlls(
        converted_gguf(SMOL, "float32"),
        gguf_files(SMOL),
        kept_permuted,
        touched=lambda name: name.endswith((".attn_q.weight", ".attn_k.weight")),
    )

    assert undone < 2.8, f"mean NLL {undone:.2f} with the rows un-permuted (measured 2.34)"
    assert not_undone > undone + 1.0, f"permuted rows: NLL {not_undone:.2f} (measured 3.79)"


@pytest.mark.real_model
def test_gemma_norms_minus_one_is_what_makes_gemma_fluent(
    converted_gguf: Converted, gguf_files: Callable[[str], tuple[Any, dict[str, Any]]]
) -> None:
    kept_plus_one = dataclasses.replace(GEMMA3, fix=lambda name, values, meta: values)

    undone, not_undone = paragraph_nlls(
        converted_gguf(GEMMA, "float32"),
        gguf_files(GEMMA),
        kept_plus_one,
        touched=lambda name: name.endswith("norm.weight"),  # every norm kind
    )

    assert undone < 2.8, f"mean NLL {undone:.2f} with norms minus 1 (measured 2.36)"
    assert not_undone > undone + 10.0, f"norms kept as 1 + w: NLL {not_undone:.2f} (measured 17.8)"


@pytest.mark.real_model
@pytest.mark.parametrize("name", [SMOL, GEMMA])
def test_tied_embeddings_have_no_output_layer(
    converted_gguf: Converted,
    gguf_files: Callable[[str], tuple[Any, dict[str, Any]]],
    name: str,
) -> None:
    reader, _ = gguf_files(name)
    converted = converted_gguf(name, "float32")

    model, config = load_model(converted.path, lazy=True)

    assert "output.weight" not in {t.name for t in reader.tensors}
    assert not any(
        key.startswith("lm_head") for key in mx.load(str(converted.path / "model.safetensors"))
    )
    assert not any(key.startswith("lm_head") for key, _ in tree_flatten(model.parameters()))
    if config["model_type"] == "llama":  # gemma3_text ties when the weights have no lm_head
        assert config["tie_word_embeddings"] is True


# ---------------------------------------------------------------------- exact repack


def assert_repack_is_exact(tensor: Any) -> None:
    """``mx.dequantize`` of the affine triple equals gguf's own dequantization, bit for bit."""
    weight, scales, biases = affine_triple(tensor)
    bits = 8 if tensor.tensor_type == QT.Q8_0 else 4
    mine = mx.dequantize(
        mx.array(weight),
        mx.array(scales).astype(mx.float32),
        mx.array(biases).astype(mx.float32),
        group_size=GROUP,
        bits=bits,
    )
    reference = dense(tensor)
    assert np.array(mine).shape == reference.shape
    assert np.array_equal(np.array(mine), reference)


@pytest.mark.real_model
@pytest.mark.parametrize(
    ("name", "tensor", "kind"),
    [
        (SMOL, "blk.0.attn_q.weight", QT.Q4_1),
        (SMOL, "blk.29.ffn_down.weight", QT.Q4_1),
        (SMOL, "token_embd.weight", QT.Q8_0),
        (GEMMA, "blk.0.attn_v.weight", QT.Q8_0),
    ],
)
def test_q4_1_and_q8_0_repack_is_bit_exact_on_real_tensors(
    gguf_files: Callable[[str], tuple[Any, dict[str, Any]]], name: str, tensor: str, kind: QT
) -> None:
    reader, _ = gguf_files(name)
    real = tensor_named(reader, tensor)
    assert real.tensor_type == kind

    assert_repack_is_exact(real)


def write_gguf(
    path: Path,
    arch: str,
    tensors: Mapping[str, tuple[np.ndarray, QT]],
    metadata: Mapping[str, int] | None = None,
) -> Path:
    """A small GGUF file; each tensor is ``(data, type)``, data quantized bytes or float32."""
    writer = GGUFWriter(path, arch)
    for key, value in (metadata or {}).items():
        writer.add_uint32(key, value)
    for name, (data, kind) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=kind if kind != QT.F32 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("kind", [QT.Q4_0, QT.Q4_1, QT.Q8_0])
def test_repack_is_bit_exact_on_a_written_file(tmp_path: Path, kind: QT) -> None:
    # No real file here holds Q4_0: write one (rows of different scales, an all-zero block).
    values = np.random.default_rng(0).standard_normal((6, 4 * GROUP)).astype(np.float32)
    values *= np.float32(10.0) ** np.arange(-3, 3, dtype=np.float32)[:, None]
    values[0, :GROUP] = 0.0
    path = write_gguf(tmp_path / "q.gguf", "llama", {"w": (quantize(values, kind), kind)})
    reader, _ = read_metadata(path)
    (tensor,) = reader.tensors
    assert tensor.tensor_type == kind and dense(tensor).shape == values.shape

    assert_repack_is_exact(tensor)


@pytest.mark.real_model
def test_quantized_smollm2_predicts_as_float32_does(converted_gguf: Converted) -> None:
    quantized = converted_gguf(SMOL, "quantized")
    full, _ = load_model(converted_gguf(SMOL, "float32").path)
    model, config = load_model(quantized.path)
    tokenizer = load_tokenizer(quantized.path)
    ids = mx.array(tokenizer.encode(PARAGRAPH)[:16])[None]

    assert quantized.kept_quantized == 211 and quantized.requantized == 0  # every Q4_1 and Q8_0
    assert config["quantization"]["model.embed_tokens"] == {"group_size": GROUP, "bits": 8}
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    # MLX's CPU quantized matmul takes ~3.6 s a token with float16 scales and ~0.1 s with float32
    # ones; float32 computes the same dequantized weights, so the check stays exact and fast.
    as_float32 = tree_map_with_path(
        lambda path, v: v.astype(mx.float32) if v.dtype == mx.float16 else v, model.parameters()
    )
    model.update(as_float32)
    reference, logits = full(ids)[0], model(ids)[0]

    assert mx.array_equal(mx.argmax(logits, axis=-1), mx.argmax(reference, axis=-1)).item()
    assert mx.abs(logits - reference).max().item() < 1e-3  # measured 1.2e-4 (logits up to 33)


# ---------------------------------------------------------------------- errors


def test_an_unsupported_architecture_is_named_with_the_supported_ones(tmp_path: Path) -> None:
    ones = np.ones((4, 4), dtype=np.float32)
    path = write_gguf(tmp_path / "qwen.gguf", "qwen2", {"token_embd.weight": (ones, QT.F32)})
    cache = tmp_path / "cache"

    with pytest.raises(UnsupportedModelFormat) as raised:
        convert_gguf(path, cache, "float32")

    assert "'qwen2'" in raised.value.message
    assert all(name in raised.value.message for name in ARCHITECTURES)
    assert list(cache.iterdir()) == []  # the half-built directory is gone


@pytest.mark.parametrize("content", [b"", b"GGUF", b"not a model file\n" * 64])
def test_a_file_that_is_not_gguf_fails_to_load(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)

    with pytest.raises(ModelLoadFailed, match="not a readable GGUF file"):
        convert_gguf(path, tmp_path / "cache", "float32")


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete GGUF file of a few hundred bytes: some metadata and one Q8_0 tensor."""
    values = np.linspace(-1.0, 1.0, 2 * GROUP, dtype=np.float32).reshape(2, GROUP)
    return write_gguf(
        tmp_path_factory.mktemp("small") / "small.gguf",
        "llama",
        {"token_embd.weight": (quantize(values, QT.Q8_0), QT.Q8_0)},
        {"llama.block_count": 1, "llama.context_length": 64},
    )


def test_a_gguf_file_cut_short_fails_to_load(small_gguf: Path, tmp_path: Path) -> None:
    whole = small_gguf.read_bytes()
    reader, _ = read_metadata(small_gguf)
    (tensor,) = reader.tensors
    data_end = tensor.data_offset + tensor.n_bytes  # only alignment padding follows
    cut = tmp_path / "cut.gguf"

    for size in range(data_end):  # e.g. an interrupted copy
        cut.write_bytes(whole[:size])
        with pytest.raises(ModelLoadFailed, match="not a readable GGUF file"):
            convert_gguf(cut, tmp_path / "cache", "float32")

    assert list((tmp_path / "cache").iterdir()) == []


@given(edits=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), min_size=1))
def test_a_corrupt_gguf_header_is_read_or_fails_to_load(
    small_gguf: Path, edits: list[tuple[int, int]]
) -> None:
    reader, _ = read_metadata(small_gguf)
    header = bytearray(small_gguf.read_bytes())
    header_size = reader.tensors[0].data_offset
    for at, byte in edits:
        header[at % header_size] = byte
    corrupt = small_gguf.with_name("corrupt.gguf")
    corrupt.write_bytes(header)

    with contextlib.suppress(ModelLoadFailed):  # any other exception fails the test
        read_metadata(corrupt)


def test_a_missing_file_fails_to_load(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadFailed, match="no GGUF file"):
        convert_gguf(tmp_path / "absent.gguf", tmp_path / "cache", "float32")


def test_an_unknown_weight_format_is_an_invalid_spec(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")

    with pytest.raises(InvalidModelSpec, match="int3"):
        convert_gguf(path, tmp_path / "cache", "int3")


# ---------------------------------------------------------------------- cache


def tree_state(directory: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``directory`` (itself included) -> (inode, mtime in ns)."""
    paths = [directory, *directory.rglob("*")]
    return {str(p): (p.stat().st_ino, p.stat().st_mtime_ns) for p in paths}


@pytest.mark.real_model
def test_a_second_conversion_reuses_the_first_and_does_no_work(
    converted_gguf: Converted, real_gguf: Callable[[str], Path]
) -> None:
    first = converted_gguf(SMOL, "float32")
    before = tree_state(first.path)
    stages: list[str] = []

    again = convert_gguf(
        real_gguf(SMOL),
        first.path.parent,
        "float32",
        progress=lambda stage, done, total: stages.append(stage),
    )

    assert again.reused and not first.reused
    assert again.path == first.path
    assert tree_state(first.path) == before
    assert "convert" not in stages  # only the file was hashed
    assert dataclasses.replace(again, reused=False) == first


def same_files(one: Path, other: Path) -> bool:
    names = sorted(p.name for p in one.iterdir())
    if names != sorted(p.name for p in other.iterdir()):
        return False
    return all(filecmp.cmp(one / name, other / name, shallow=False) for name in names)


@pytest.mark.real_model
def test_two_threads_converting_one_file_both_get_a_complete_directory(
    converted_gguf: Converted, real_gguf: Callable[[str], Path], tmp_path: Path
) -> None:
    source = real_gguf(SMOL)
    both_building = threading.Barrier(2, timeout=60)

    def convert(_: int) -> ConvertedModel:
        def progress(stage: str, done: int, total: int) -> None:
            if stage == "convert" and done == 1:  # each is past the cache check: both build
                both_building.wait()

        return convert_gguf(source, tmp_path, "float32", progress=progress)

    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(convert, range(2))

    assert not first.reused and not second.reused
    assert first.path == second.path
    assert [p.name for p in tmp_path.iterdir()] == [first.path.name]  # no .building dirs left
    assert (first.path / STAMP).is_file()
    assert same_files(first.path, converted_gguf(SMOL, "float32").path)  # converted alone
    load_model(first.path, lazy=True)


# ---------------------------------------------------------------------- through the runtime


@pytest.fixture
def fresh_cache(
    real_gguf: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """SmolLM2's GGUF file, with the runtime's cache moved to an empty folder."""
    source = real_gguf(SMOL)  # first: it is found in the user's cache
    monkeypatch.setenv("MLXRT_CACHE_DIR", str(tmp_path / "cache"))
    return source


@pytest.mark.real_model
@pytest.mark.anyio
# One event loop: the conversion runs on a worker thread, the same under either loop.
@pytest.mark.parametrize("anyio_backend", [on_asyncio()], ids=["asyncio"])
async def test_a_gguf_path_loads_through_the_runtime_and_answers(
    fresh_cache: Path, tmp_path: Path
) -> None:
    from runtime.host.api import Runtime
    from runtime.host.config import RuntimeConfig
    from runtime.messages import ChatMessage, Finished, ModelSpec

    spec = ModelSpec(name="smol", path=str(fresh_cache))
    question = [ChatMessage(role="user", content="What is the capital of France?")]

    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
        loaded = await rt.load_model(spec)
        answer = await rt.complete("smol", messages=question, max_tokens=12)

    assert loaded.context_length == 8192
    (converted,) = (tmp_path / "cache" / "converted").iterdir()
    assert converted.name.endswith("-float32-v1") and (converted / STAMP).is_file()
    assert isinstance(answer.terminal, Finished)
    assert "Paris" in answer.text
