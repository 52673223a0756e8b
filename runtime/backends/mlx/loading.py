"""Which library reads a model directory: mlx-lm, or mlx-vlm for a vision-language model.

The directory's own config decides (``runtime.backends.vision.load.vision_family``); either way
the MLX backend gets a model in mlx-lm's shape, mlx-lm's tokenizer wrapper and the config, plus
the media side of a VLM (None for a text model).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from runtime.backends.options import MlxOptions
from runtime.backends.vision.load import VisionMedia, load_vision, vision_family
from runtime.errors import ModelLoadFailed

Loaded = tuple[Any, Any, dict[str, Any], VisionMedia | None]


def load_directory(path: Path, options: MlxOptions) -> Loaded:
    """Model, tokenizer, config and media side of ``path``; raises ``ModelLoadFailed``."""
    if vision_family(path) is not None:
        return load_vision(path, options)
    from mlx_lm.utils import load as mlx_load

    # mlx-lm and transformers meet a damaged directory with many kinds of error (a config that
    # is a list: TypeError; no model_type: KeyError); to the host each means the same.
    try:
        loaded = mlx_load(str(path), return_config=True)
        model, tokenizer, config = cast(tuple[Any, Any, dict[str, Any]], loaded)
    except Exception as exc:
        raise ModelLoadFailed(
            f"could not load the model at {path}: {type(exc).__name__}: {exc}"
        ) from exc
    return model, tokenizer, config, None
