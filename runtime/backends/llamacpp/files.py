"""Which GGUF file a ``ModelSpec`` names for llama.cpp, refused early with a typed error."""

from __future__ import annotations

from pathlib import Path

from runtime.backends.model_store import KNOWN_MODELS, fetch_model
from runtime.errors import InvalidModelSpec, UnsupportedModelFormat
from runtime.messages import ModelSpec

GGUF_MAGIC = b"GGUF"


def gguf_file_of(spec: ModelSpec) -> tuple[Path, str | None]:
    """The .gguf file ``spec.path`` names (a known model is fetched on first use), and its
    sha256 where it is pinned. Raises ``InvalidModelSpec`` (no path),
    ``UnsupportedModelFormat`` (a directory, or a file that is not GGUF) or ``ModelFetchFailed``.
    """
    if not spec.path:
        raise InvalidModelSpec(
            f"model {spec.name!r} needs a path: a .gguf file or a known model "
            f"({', '.join(KNOWN_MODELS)})"
        )
    known = KNOWN_MODELS.get(spec.path)
    if known is not None:
        return fetch_model(known), known.sha256
    path = Path(spec.path).expanduser()
    if path.is_dir():
        raise UnsupportedModelFormat(
            f"{path} is a directory; the llama.cpp backend loads .gguf files: give a .gguf file, "
            "or load the directory with backend='mlx'"
        )
    if not path.is_file():
        raise UnsupportedModelFormat(
            f"no file at {path}; the llama.cpp backend loads a .gguf file or a known model "
            f"({', '.join(KNOWN_MODELS)})"
        )
    with path.open("rb") as stream:
        magic = stream.read(4)
    if magic != GGUF_MAGIC:
        raise UnsupportedModelFormat(
            f"{path} is not a GGUF file (it does not start with 'GGUF'); the llama.cpp backend "
            "loads .gguf files: convert the model to GGUF, or load it with backend='mlx'"
        )
    return path, None
