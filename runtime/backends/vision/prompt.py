"""Images into a chat prompt, through the one chat preparation path (``runtime.text.chat``).

``prepare`` runs first on the tokenize job: it decodes each image of the messages (typed errors
name the part), registers it in the store, and writes a *keyed marker*
(``<|mlxrt-image:<key>|>``) into the content where the image stands. The template then renders
the markers as text, and ``VisionChatTokenizer.encode`` replaces each with its image's span (the
model's processor's expansion of the model's own image marker: begin- and end-of-image tokens
included). Any render of any subset of the messages (history windows, instruction prefixes,
message ends) therefore tokenizes each image the same way. A client's text that holds a keyed
marker is refused: it could name another request's image.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Final

import msgspec

from runtime.backends.vision.media import MediaLimits, check_count, decode_image
from runtime.backends.vision.store import MediaStore
from runtime.backends.vision.video import video_frames, video_text
from runtime.errors import InvalidRequest, MediaUnsupported
from runtime.messages import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, ChatMessage

_KEYED: Final = re.compile(r"<\|mlxrt-image:([0-9a-f]{12})\|>")


def keyed_marker(key: int) -> str:
    return f"<|mlxrt-image:{key:012x}|>"


def prepare(
    messages: Sequence[ChatMessage], store: MediaStore, limits: MediaLimits
) -> tuple[ChatMessage, ...]:
    """``messages`` with every image registered and keyed into its content, images dropped;
    raises ``InvalidRequest`` (a placeholder count that does not match), ``TooManyImages`` or
    ``InvalidMedia``."""
    check_count(sum(len(m.images) for m in messages), limits)
    out: list[ChatMessage] = []
    for i, message in enumerate(messages):
        if _KEYED.search(message.content):
            raise InvalidRequest(
                f"messages[{i}].content holds the runtime's reserved image marker "
                "'<|mlxrt-image:...|>'; remove it (images go in the message's images)"
            )
        if not message.images and not message.videos:
            out.append(message)
            continue
        content = _place(i, message.content, IMAGE_PLACEHOLDER, "image", len(message.images))
        content = _place(i, content, VIDEO_PLACEHOLDER, "video", len(message.videos))
        pieces = content.split(IMAGE_PLACEHOLDER)
        keyed = [pieces[0]]
        for j, (part, rest) in enumerate(zip(message.images, pieces[1:], strict=True)):
            where = part.part or f"messages[{i}].images[{j}]"
            item = store.register(decode_image(part.data, where, limits), where)
            keyed += [keyed_marker(item.key), rest]
        content = _videos(i, "".join(keyed), message, store, limits)
        out.append(msgspec.structs.replace(message, content=content, images=(), videos=()))
    return tuple(out)


def _place(i: int, content: str, placeholder: str, what: str, count: int) -> str:
    """``content`` with ``count`` placeholders: as sent, or all first when it has none."""
    if count == 0:
        return content
    placed = content.count(placeholder)
    if placed == 0:
        return placeholder * count + content
    if placed != count:
        raise InvalidRequest(
            f"messages[{i}].content has {placed} {placeholder} placeholders for {count} "
            f"{what}s; put one per {what}, or none ({what}s first)"
        )
    return content


def _videos(
    i: int, content: str, message: ChatMessage, store: MediaStore, limits: MediaLimits
) -> str:
    """``content`` with each video's placeholder replaced by its frames' text (video.py)."""
    if not message.videos:
        return content
    sampling = store.video
    pieces = content.split(VIDEO_PLACEHOLDER)
    keyed = [pieces[0]]
    for j, (part, rest) in enumerate(zip(message.videos, pieces[1:], strict=True)):
        where = part.part or f"messages[{i}].videos[{j}]"
        if sampling is None:
            raise MediaUnsupported(
                f"{where} is a video, but this model's family takes images only; send its "
                "frames as images, or load a video-capable model (SmolVLM2; docs/models.md)"
            )
        frames = video_frames(part, where, sampling, limits)
        if store.whole_videos:  # Qwen-VL: one span of the whole video (video_grid_thw)
            keyed += [keyed_marker(store.register_video(frames.images, where).key), rest]
            continue
        markers = [
            keyed_marker(store.register(frame, f"{where} frame {k}").key)
            for k, frame in enumerate(frames.images)
        ]
        keyed += [video_text(frames, markers), rest]
    return "".join(keyed)


class VisionChatTokenizer:
    """mlx-lm's tokenizer wrapper of a VLM directory, expanding keyed markers into image spans;
    content reaches the template as a list of text parts, the form VLM templates iterate."""

    def __init__(self, inner: Any, store: MediaStore) -> None:
        self._inner = inner
        self._store = store

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        pieces = _KEYED.split(text)
        ids = [int(t) for t in self._inner.encode(pieces[0], add_special_tokens=add_special_tokens)]
        for n, piece in enumerate(pieces[1:]):
            if n % 2 == 0:
                ids += self._store.span(int(piece, 16))
            elif piece:
                ids += [int(t) for t in self._inner.encode(piece, add_special_tokens=False)]
        return ids

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> Any:
        parts = [
            {**m, "content": [{"type": "text", "text": m["content"]}]}
            if isinstance(m.get("content"), str)
            else m
            for m in conversation
        ]
        return self._inner.apply_chat_template(parts, **kwargs)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._inner, "has_chat_template", False))

    @property
    def chat_template(self) -> Any:
        return getattr(self._inner, "chat_template", None)
