"""Loading a vision-language model directory with mlx-vlm, for the MLX backend.

A directory is a VLM when its config.json names an mlx-vlm ``model_type`` this runtime serves and
has a ``vision_config``; the MLX backend asks ``vision_family`` before it loads anything, so the
directory's config decides, never a flag. Families served: those whose language model numbers
positions like a text model (Gemma 3, Idefics3 / SmolVLM), and Qwen2-VL / Qwen2.5-VL, whose M-RoPE
grid positions a layer of their cache keeps (``mrope.py``). Qwen3-VL is refused with its reason.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Final

from runtime.backends.options import MlxOptions
from runtime.backends.vision.bidirectional import DECLARED
from runtime.backends.vision.media import MediaLimits
from runtime.backends.vision.model import VisionTextModel
from runtime.backends.vision.mrope import GRID_FAMILIES
from runtime.backends.vision.prompt import VisionChatTokenizer, prepare
from runtime.backends.vision.store import MediaStore
from runtime.backends.vision.video import sampling_of
from runtime.errors import ModelLoadFailed
from runtime.messages import ChatMessage

SERVED: Final = frozenset(("gemma3", "idefics3", "smolvlm", *GRID_FAMILIES))
# Served by mlx-vlm but not here yet, and why (the load says so rather than failing later).
_REFUSED: Final = {
    "qwen3_vl": "its deepstack visual features and interleaved M-RoPE have no adapter yet",
}
log = logging.getLogger("mlx_actor_runtime.vision")


def vision_family(path: Path) -> str | None:
    """The mlx-vlm model type of the VLM directory ``path``, or None for a text model; raises
    ``ModelLoadFailed`` for a VLM this runtime does not serve, or when mlx-vlm is missing."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # not a directory with a config: the text loader says what is wrong
    if not isinstance(config, dict) or "vision_config" not in config:
        return None
    family = str(config.get("model_type"))
    if family in _REFUSED:
        raise ModelLoadFailed(
            f"{path} is a {family} vision-language model, which is not served yet "
            f"({_REFUSED[family]}); serve one of {', '.join(sorted(SERVED))}"
        )
    if family not in SERVED:
        return None  # a text model whose config carries a vision section mlx-lm ignores
    try:
        import mlx_vlm  # noqa: F401
    except ImportError as exc:
        raise ModelLoadFailed(
            f"{path} is a {family} vision-language model, which needs mlx-vlm: "
            "pip install 'mlx-actor-runtime[vision]'"
        ) from exc
    return family


class VisionMedia:
    """A loaded VLM's media side: its store, chat tokenizer and limits."""

    def __init__(self, store: MediaStore, chat_tokenizer: VisionChatTokenizer, limits: MediaLimits):
        self.store = store
        self.chat_tokenizer = chat_tokenizer
        self.limits = limits

    def prepare(self, messages: tuple[ChatMessage, ...]) -> tuple[ChatMessage, ...]:
        return prepare(messages, self.store, self.limits)


def load_vision(path: Path, options: MlxOptions) -> tuple[Any, Any, dict[str, Any], VisionMedia]:
    """The wrapped model, mlx-lm's tokenizer wrapper, the config and the media side of the VLM
    at ``path``; raises ``ModelLoadFailed`` (kv_bits, or what mlx-vlm refused)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from mlx_vlm.utils import load as vlm_load

    if options.kv_bits is not None:
        raise ModelLoadFailed(
            f"{path} is a vision-language model: kv_bits is not supported for these yet; "
            "load it without kv_bits"
        )
    try:
        vlm, processor = vlm_load(str(path))
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except Exception as exc:
        raise ModelLoadFailed(
            f"could not load the vision-language model at {path}: {type(exc).__name__}: {exc}"
        ) from exc
    template = getattr(processor, "chat_template", None) or getattr(
        processor.tokenizer, "chat_template", None
    )
    if not tokenizer.has_chat_template and isinstance(template, str):
        # VLM directories often keep it in chat_template.json, which mlx-vlm reads (mlx-lm not).
        tokenizer._tokenizer.chat_template = template
        tokenizer.has_chat_template = True
    # Room for a whole video's frames on top of the images: one evicted before its prefill
    # would fail its own request (media_evicted).
    sampling = sampling_of(processor)
    frames = 0 if sampling is None else options.max_video_frames or sampling.max_frames
    store = MediaStore(vlm, processor, capacity=64 + frames)
    limits = MediaLimits(
        max_images=options.max_images,
        max_bytes=options.max_image_bytes,
        max_pixels=options.max_image_pixels,
        max_video_frames=options.max_video_frames,
        max_video_bytes=options.max_video_bytes,
        max_video_seconds=options.max_video_seconds,
    )
    media = VisionMedia(store, VisionChatTokenizer(tokenizer, store), limits)
    log.info("%s: a %s vision-language model (mlx-vlm)", path, config.get("model_type"))
    try:
        family = config.get("model_type")
        model = VisionTextModel(vlm, store, family in DECLARED, family in GRID_FAMILIES)
    except TypeError as exc:  # an mlx-vlm whose Gemma 3 is shaped otherwise
        raise ModelLoadFailed(
            f"{path}: cannot keep its image spans bidirectional with this mlx-vlm ({exc}); "
            "install the mlx-vlm version the [vision] extra pins"
        ) from exc
    return model, tokenizer, config, media
