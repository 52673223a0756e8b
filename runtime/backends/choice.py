"""``backend="auto"``: which backend runs a model here, and why (said in the load log).

A GGUF file (or a known model, which is one) runs on llama.cpp on a CPU-only machine where
llama-cpp-python is installed: its quantized CPU kernels decode ~7x faster than MLX's CPU backend,
which has no fast quantized kernels (docs/models.md, measured). On Apple silicon and CUDA MLX runs
it on the GPU. Anything else (an mlx-lm directory, a Hugging Face repo) is MLX's: llama.cpp loads
only GGUF. The choice is made once, before the spec is decoded, so every later step sees a
concrete kind.
"""

from __future__ import annotations

import logging
import platform
import sys
from pathlib import Path

import msgspec

from runtime.backends.model_store import KNOWN_MODELS
from runtime.messages import ModelSpec

AUTO = "auto"
log = logging.getLogger("mlx_actor_runtime.backend_choice")


def resolve_backend(spec: ModelSpec) -> ModelSpec:
    """``spec`` with ``backend="auto"`` replaced by the kind chosen here (logged with why);
    any other spec as it is."""
    if spec.backend != AUTO:
        return spec
    backend, why = choose_backend(spec.path)
    log.info("model %r: backend %s (auto: %s)", spec.name, backend, why)
    return msgspec.structs.replace(spec, backend=backend)


def choose_backend(path: str | None) -> tuple[str, str]:
    """The backend kind for a model at ``path``, and one sentence why."""
    gguf = path is not None and (path in KNOWN_MODELS or Path(path).suffix.lower() == ".gguf")
    if not gguf:
        return "mlx", "not a GGUF file, which is all llama.cpp loads"
    accelerator = _mlx_accelerator()
    if accelerator is not None:
        return "mlx", f"a GGUF file on {accelerator}, where MLX runs on the GPU"
    from runtime.backends.llamacpp.binding import llama_cpp_available

    if llama_cpp_available():
        return "llamacpp", "a GGUF file on a CPU, where llama.cpp's quantized kernels are fastest"
    return "mlx", (
        "a GGUF file on a CPU, but llama-cpp-python is not installed "
        "(pip install 'mlx-actor-runtime[llamacpp]' for ~7x faster decoding)"
    )


def _mlx_accelerator() -> str | None:
    if sys.platform == "darwin" and platform.machine() == "arm64":
        return "Apple silicon"
    try:
        import mlx.core as mx

        if mx.cuda.is_available():
            return "a CUDA GPU"
    except (ImportError, AttributeError):
        pass
    return None
