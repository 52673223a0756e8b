"""The models the bench runs: the tiny random-weight kinds and two real models.

A real model is resolved as the runtime resolves it (``prepare_model`` on its known name: fetched
and converted once, then reused), and that one directory goes to every system, so all of them run
the same weights. Each scenario group picks its sizes from a ``Scaled``: real models are ~50x
slower than the tiny ones on a CPU, so they get shorter prompts and fewer repetitions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

TINY_KINDS = ("llama", "sliding", "hybrid")
# Bench name -> the runtime's known-model name.
REAL_MODELS = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma3-270m"}
MODELS = (*TINY_KINDS, *REAL_MODELS)

T = TypeVar("T")


@dataclass(frozen=True)
class BenchModel:
    """One model as every system gets it: its directory and raw mlx-lm's loaded copy."""

    name: str  # the bench's name for it, in every row
    path: Path
    model: Any
    tokenizer: Any
    real: bool
    note: str = ""  # how the directory was made (real models)
    gguf: Path | None = None  # the GGUF file it was converted from (real models): llama.cpp's input


@dataclass(frozen=True)
class Scaled(Generic[T]):
    """One group's sizes for each kind of run: tiny or real model, full or ``--quick``."""

    tiny: T
    tiny_quick: T
    real: T
    real_quick: T

    def pick(self, model: BenchModel, quick: bool) -> T:
        if model.real:
            return self.real_quick if quick else self.real
        return self.tiny_quick if quick else self.tiny


def load_bench_model(name: str) -> BenchModel:
    """Resolve and load ``name`` (a tiny kind or a key of ``REAL_MODELS``)."""
    if name in REAL_MODELS:
        from mlx_lm import load

        from runtime.backends.model_source import prepare_model
        from runtime.backends.model_store import fetch_model
        from runtime.messages import ModelSpec

        known = REAL_MODELS[name]
        prepared = prepare_model(ModelSpec(name=name, path=known))
        model, tokenizer = load(str(prepared.path))
        gguf = fetch_model(known)  # cached by prepare_model: no work here
        return BenchModel(name, prepared.path, model, tokenizer, True, prepared.note or "", gguf)
    from runtime.testing.tiny_models import TINY_MODEL_KINDS, load_tiny_model, tiny_model_path

    kind = next((k for k in TINY_MODEL_KINDS if k == name), None)
    if kind is None:
        raise ValueError(f"unknown model {name!r}; choose from {MODELS}")
    model, tokenizer = load_tiny_model(kind)
    return BenchModel(name, tiny_model_path(kind), model, tokenizer, False)
