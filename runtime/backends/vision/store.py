"""The engine's images: each image's soft-token span as its processor makes it, and its features.

``register`` (the tokenize job) expands the model's image marker with its own processor, so the
prompt holds the exact soft tokens the model reads and the KV reservation prices them before
admission. ``encode`` runs the vision tower in the prefill job whose chunk reaches the span, image
by image; an abort stops it at the next encoder layer (``tower.py``) or image. Items are kept in
LRU order within ``capacity`` and ``capacity_bytes`` (memory the KV budget does not count); one
evicted before its prefill fails that request ``MediaEvicted`` (retryable), never another's.
See docs/models.md, "Vision-language models".
"""

from __future__ import annotations

import copy
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from runtime.backends.contract import PrefillInterrupted
from runtime.backends.vision.media import DecodedImage, is_media, media_ids, split_media
from runtime.backends.vision.tower import layer_checks
from runtime.backends.vision.video import VideoSampling, sampling_of
from runtime.errors import InvalidMedia, MediaEvicted


class MediaItem:
    """One image: its prompt span (``span``: the marker's expansion, soft tokens as media ids),
    the processor's own ids and inputs (for the tower), and its features once computed."""

    __slots__ = ("features", "grid", "inputs", "key", "raw_ids", "soft_tokens", "span", "token")

    def __init__(self, key: int, raw_ids: list[int], image_token: int, inputs: dict[str, Any]):
        self.key = key
        self.raw_ids = raw_ids
        self.inputs = inputs
        self.token = image_token  # the processor's soft token: an image's, or a video's
        self.soft_tokens = sum(1 for t in raw_ids if t == image_token)
        soft = iter(media_ids(key, self.soft_tokens))
        self.span = [next(soft) if t == image_token else t for t in raw_ids]
        self.features: mx.array | None = None
        self.grid = (1, 1, self.soft_tokens)  # merged (time, rows, columns): M-RoPE families'

    @property
    def nbytes(self) -> int:
        """What the item holds: the processor's pixels until the tower ran, then features."""
        held = sum(int(v.nbytes) for v in self.inputs.values())
        return held + (0 if self.features is None else int(self.features.nbytes))


class MediaStore:
    """Images by content key for one loaded VLM (its model and processor), at most
    ``capacity`` items and ``capacity_bytes`` of pixels and features (the newest one always)."""

    def __init__(
        self, model: Any, processor: Any, capacity: int = 64, capacity_bytes: int = 512 << 20
    ) -> None:
        self._model = model
        self._processor = processor
        self._capacity = capacity
        self._capacity_bytes = capacity_bytes
        self._items: OrderedDict[int, MediaItem] = OrderedDict()
        tokenizer = processor.tokenizer
        # The text a prompt names an image with, which the processor expands.
        self.marker: str = getattr(processor, "boi_token", None) or processor.image_token
        # Qwen2-VL's image_grid_thw: its merged grid gives the soft tokens' M-RoPE positions.
        self._merge = int(getattr(processor.image_processor, "merge_size", 0) or 0)
        if self._merge:  # the span its template writes for an image part
            self.marker = f"<|vision_start|>{processor.image_token}<|vision_end|>"
        self.image_token = int(processor.image_token_id)
        self._bos = getattr(tokenizer, "bos_token_id", None)
        # A video-capable family (SmolVLM2): its frames are one tile each, as its own video
        # processor makes them, so a copy of the processor that never splits an image.
        self.video: VideoSampling | None = sampling_of(processor)
        self._frames = processor
        if self.video is not None and not self._merge:
            self._frames = copy.copy(processor)
            self._frames.image_processor = copy.copy(processor.image_processor)
            self._frames.image_processor.do_image_splitting = False

    def register(self, image: DecodedImage, where: str) -> MediaItem:
        """The item of ``image``, made by the processor unless the store holds it; raises
        ``InvalidMedia`` naming ``where`` when the processor refuses the image."""
        item = self._items.get(image.key)
        if item is not None:
            self._items.move_to_end(image.key)
            return item
        from PIL import Image

        try:
            processor = self._frames if image.frame else self._processor
            out = processor(
                text=[self.marker], images=[Image.fromarray(image.pixels)], return_tensors="np"
            )
        except Exception as exc:  # the processor's own checks (size, aspect ratio...)
            raise InvalidMedia(f"the model's processor refused {where}: {exc}") from exc
        return self._keep(image.key, out, self.image_token, "image_grid_thw")

    def register_video(self, frames: Sequence[DecodedImage], where: str) -> MediaItem:
        """A Qwen-VL video (``frames`` sampled by ``video.py``) as one item, keyed on every
        frame's pixels; raises ``InvalidMedia`` naming ``where`` when the processor refuses it."""
        digest = hashlib.sha256(b"video:" + b"".join(f.key.to_bytes(6, "big") for f in frames))
        key = int.from_bytes(digest.digest()[:6], "big")
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
            return item
        from PIL import Image

        video_token = str(self._processor.video_token)
        try:
            out = self._processor(
                text=[f"<|vision_start|>{video_token}<|vision_end|>"],
                videos=[[Image.fromarray(f.pixels) for f in frames]],
                return_tensors="np",
            )
        except Exception as exc:
            raise InvalidMedia(f"the model's processor refused {where}: {exc}") from exc
        return self._keep(key, out, int(self._processor.video_token_id), "video_grid_thw")

    def _keep(self, key: int, out: Any, token: int, grid: str) -> MediaItem:
        """The item of processor output ``out`` (soft tokens ``token``), kept under ``key``."""
        raw = [int(t) for t in np.asarray(out["input_ids"])[0]]
        if self._bos is not None and raw and raw[0] == self._bos:
            raw = raw[1:]  # the prompt has its own BOS; a span never starts one
        inputs = {
            k: mx.array(np.asarray(v))
            for k, v in out.items()
            if k not in ("input_ids", "attention_mask", "token_type_ids")
        }
        item = MediaItem(key, raw, token, inputs)
        if self._merge and grid in inputs:
            t, h, w = (int(x) for x in np.asarray(out[grid])[0])
            item.grid = (t, h // self._merge, w // self._merge)
        self._items[key] = item
        self._evict()
        return item

    @property
    def whole_videos(self) -> bool:
        """Whether a video is one item of its processor (Qwen-VL), not a run of frames."""
        return bool(self._merge) and self.video is not None

    @property
    def nbytes(self) -> int:
        return sum(item.nbytes for item in self._items.values())

    def _evict(self) -> None:
        """Drop the least recently used items past either capacity, never the newest."""
        while len(self._items) > 1 and (
            len(self._items) > self._capacity or self.nbytes > self._capacity_bytes
        ):
            self._items.popitem(last=False)

    def span(self, key: int) -> list[int]:
        """The prompt span of the registered image ``key``."""
        return self._item(key).span

    def grid(self, key: int) -> tuple[int, int, int]:
        """The merged grid of the registered image ``key`` (M-RoPE positions, ``mrope.py``)."""
        return self._item(key).grid

    def features(self, key: int, stop: threading.Event | None = None) -> mx.array:
        """``(soft_tokens, hidden)``: what the model puts in its input embeddings at the image's
        soft tokens, computed by the model's own ``get_input_embeddings`` at first use; with
        ``stop``, checked before each encoder layer of the tower (``PrefillInterrupted``)."""
        item = self._item(key)
        if item.features is None:
            ids = mx.array([item.raw_ids])
            inputs = dict(item.inputs)
            pixels = inputs.pop("pixel_values", None)
            if pixels is None:  # a Qwen-VL video's
                pixels = inputs.pop("pixel_values_videos")
            with layer_checks(self._model, stop):
                embedded = self._model.get_input_embeddings(
                    ids, pixels, mask=mx.ones(ids.shape), **inputs
                ).inputs_embeds[0]
            where = mx.array(np.flatnonzero(np.array(item.raw_ids) == item.token))
            item.features = embedded[where]
            mx.eval(item.features)
            item.inputs = {}  # the pixels are not needed again
        return item.features

    def encode(self, token_ids: Sequence[int], stop: threading.Event | None) -> None:
        """Run the vision tower for each image ``token_ids`` reach whose features are not
        computed yet, one image at a time, ahead of the prefill pass that reads them: an abort
        set meanwhile stops before the next image or the image's next encoder layer
        (``PrefillInterrupted``; the image keeps its pixels, its features are not kept)."""
        keys = dict.fromkeys(split_media(t)[0] for t in token_ids if is_media(t))
        for key in keys:
            if stop is not None and stop.is_set():
                raise PrefillInterrupted("the sequence was aborted before an image's encoding")
            self.features(key, stop)

    def _item(self, key: int) -> MediaItem:
        item = self._items.get(key)
        if item is None:
            raise MediaEvicted(
                "an image of this prompt left the engine's media store before its prefill "
                "(more images in flight than it holds); send the request again"
            )
        self._items.move_to_end(key)
        return item

    def __len__(self) -> int:
        return len(self._items)
