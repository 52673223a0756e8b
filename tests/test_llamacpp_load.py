"""Loading on llama.cpp: bad input is a typed error at load, ``auto`` picks a backend and says
why, and the llama.cpp options are typed like every other backend's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from runtime.backends.choice import choose_backend, resolve_backend
from runtime.backends.loader import make_backend_loader
from runtime.backends.options import LlamaCppOptions, decode_options
from runtime.errors import InvalidModelSpec, UnsupportedModelFormat
from runtime.messages import ModelSpec
from tests.llamacpp_support import require_llama_cpp


def _load(path: Path | str, **options: object) -> object:
    spec = ModelSpec(name="m", backend="llamacpp", path=str(path), options=dict(options))
    return make_backend_loader()(spec, decode_options(spec))


def test_a_file_that_is_not_gguf_is_refused_with_what_to_do(tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(UnsupportedModelFormat, match=r"not a GGUF file.*backend='mlx'"):
        _load(weights)


def test_a_directory_or_a_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelFormat, match="is a directory"):
        _load(tmp_path)
    with pytest.raises(UnsupportedModelFormat, match="no file at"):
        _load(tmp_path / "absent.gguf")


def test_an_architecture_llama_cpp_cannot_load_is_refused(tmp_path: Path) -> None:
    """A well-formed GGUF file whose architecture llama.cpp does not know."""
    require_llama_cpp()
    from gguf import GGUFWriter

    path = tmp_path / "strange.gguf"
    writer = GGUFWriter(str(path), "no-such-architecture")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelFormat, match=r"llama.cpp could not load.*backend='mlx'"):
        _load(path)


def test_llama_cpp_options_are_typed_and_checked() -> None:
    spec = ModelSpec(name="m", backend="llamacpp", path="x.gguf", options={"n_threads": 2})
    assert decode_options(spec) == LlamaCppOptions(n_threads=2)
    with pytest.raises(InvalidModelSpec, match="unknown option 'kv_bits'"):
        decode_options(ModelSpec(name="m", backend="llamacpp", options={"kv_bits": 4}))
    with pytest.raises(InvalidModelSpec, match="max_sequences"):
        decode_options(ModelSpec(name="m", backend="llamacpp", options={"max_sequences": 1}))


def test_auto_picks_a_backend_and_says_why() -> None:
    assert choose_backend("/models/some-dir")[0] == "mlx"
    backend, why = choose_backend("model.gguf")
    # This machine is a Linux CPU: llama.cpp where it is installed, MLX otherwise.
    from runtime.backends.llamacpp.binding import llama_cpp_available

    assert backend == ("llamacpp" if llama_cpp_available() else "mlx")
    assert "GGUF" in why
    assert resolve_backend(ModelSpec(name="m", backend="auto", path="m.gguf")).backend == backend
    assert resolve_backend(ModelSpec(name="m", backend="mlx", path="m.gguf")).backend == "mlx"


def test_the_default_threads_follow_omp_num_threads_as_ray_sets_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os

    from runtime.backends.llamacpp.build import cpus_given

    may_run_on = len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpus_given() == may_run_on  # a plain process: every CPU it may run on
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # a Ray engine asking for one CPU
    assert cpus_given() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", str(may_run_on + 8))  # never past what it may run on
    assert cpus_given() == may_run_on
    monkeypatch.setenv("OMP_NUM_THREADS", "four")
    assert cpus_given() == may_run_on
