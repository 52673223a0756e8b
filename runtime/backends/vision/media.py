"""Images as the engine takes them: decoded, checked, keyed by their pixels.

An image enters a prompt as a run of *media token ids*, one per soft token its processor makes
of it: ``MEDIA_BASE | key << 14 | offset``, where ``key`` is 48 bits of the SHA-256 of the
decoded pixels (RGB, with the size). They lie far above any vocabulary, so the prefix cache keys a
media span on the image's content with no change to its token trie: the same image in a later
turn matches, a different image at the same position differs from its first soft token on, and
the same picture sent as PNG or JPEG of equal pixels is one image. The model wrapper
(``model.py``) turns the ids back into the image's features. See docs/models.md (vision).
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Sequence
from typing import Final

import msgspec
import numpy as np
import numpy.typing as npt

from runtime.errors import InvalidMedia, MediaUnsupported, TooManyImages
from runtime.messages import ChatMessage

MEDIA_BASE: Final = 1 << 62
_OFFSET_BITS: Final = 14
MAX_SPAN: Final = 1 << _OFFSET_BITS  # soft tokens one image may become
_KEY_MASK: Final = (1 << 48) - 1
FORMATS: Final = frozenset(("PNG", "JPEG", "WEBP", "GIF", "BMP"))


class MediaLimits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What one request may send: ``max_images`` images, each at most ``max_bytes`` encoded and
    ``max_pixels`` decoded (width x height; a decompression bomb is refused before decoding)."""

    max_images: int = 8
    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 4096 * 4096
    # A video: the most frames sampled from it (None: the processor's own cap), the most bytes
    # of its file and seconds it may last (runtime/backends/vision/video.py).
    max_video_frames: int | None = None
    max_video_bytes: int = 64 * 1024 * 1024
    max_video_seconds: int = 3600


class DecodedImage:
    """An image's RGB pixels (height, width, 3) and its content key (48 bits). A video frame is
    keyed apart (``frame``): its processor makes another span of the same pixels."""

    __slots__ = ("frame", "key", "pixels")

    def __init__(self, pixels: npt.NDArray[np.uint8], frame: bool = False) -> None:
        self.pixels = pixels
        self.frame = frame
        salt = b"frame:" if frame else b""
        digest = hashlib.sha256(salt + repr(pixels.shape).encode() + pixels.tobytes()).digest()
        self.key = int.from_bytes(digest[:6], "big") & _KEY_MASK


def decode_image(data: bytes, where: str, limits: MediaLimits) -> DecodedImage:
    """The pixels of the image file ``data``; raises ``InvalidMedia`` naming ``where`` (e.g.
    ``messages[1].images[0]``) when it is too large, not an image, or of another format."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise InvalidMedia(
            f"{where} is {len(data)} bytes, more than the {limits.max_bytes} an image may be; "
            "send a smaller image"
        )
    try:
        with Image.open(io.BytesIO(data)) as image:
            fmt = image.format or "unknown"
            if fmt not in FORMATS:
                raise InvalidMedia(
                    f"{where} is a {fmt} image; send one of {', '.join(sorted(FORMATS))}"
                )
            width, height = image.size
            if width * height > limits.max_pixels:
                raise InvalidMedia(
                    f"{where} is {width}x{height} pixels, more than the {limits.max_pixels} an "
                    "image may have; downscale it"
                )
            image.seek(0)  # an animated GIF or WebP: its first frame
            pixels = np.asarray(image.convert("RGB"), dtype=np.uint8)
    except UnidentifiedImageError as exc:
        raise InvalidMedia(
            f"{where} could not be decoded as an image ({len(data)} bytes); send a PNG, JPEG, "
            "WebP, GIF or BMP file's bytes"
        ) from exc
    except (OSError, ValueError, SyntaxError) as exc:  # truncated or damaged file
        raise InvalidMedia(f"{where} is a damaged image file: {exc}; send it again") from exc
    return DecodedImage(pixels)


def check_count(count: int, limits: MediaLimits) -> None:
    """Raises ``TooManyImages`` when a request's ``count`` images exceed the limit."""
    if count > limits.max_images:
        raise TooManyImages(
            f"the request has {count} images; at most {limits.max_images} are accepted per "
            "request: send fewer"
        )


def media_ids(key: int, count: int) -> list[int]:
    """The media token ids of an image keyed ``key`` that becomes ``count`` soft tokens."""
    if not 0 < count <= MAX_SPAN:
        raise ValueError(f"an image becomes 1 to {MAX_SPAN} soft tokens, not {count}")
    base = MEDIA_BASE | (key & _KEY_MASK) << _OFFSET_BITS
    return [base | i for i in range(count)]


def is_media(token: int) -> bool:
    return token >= MEDIA_BASE


def split_media(token: int) -> tuple[int, int]:
    """The image key and soft-token offset of a media token id."""
    return (token >> _OFFSET_BITS) & _KEY_MASK, token & (MAX_SPAN - 1)


def inside_span(tokens: Sequence[int], point: int) -> bool:
    """Whether a pass boundary at ``point`` (tokens before it in one pass, from it in the next)
    would split a run of media tokens: a family whose image spans attend bidirectionally must see
    each run in one pass (``bidirectional.py``), so chunks and checkpoints never end there."""
    return 0 < point < len(tokens) and is_media(tokens[point - 1]) and is_media(tokens[point])


def past_span(tokens: Sequence[int], point: int) -> int:
    """``point``, or the end of the run of media tokens it would split."""
    while inside_span(tokens, point):
        point += 1
    return point


def longest_run(tokens: Sequence[int]) -> int:
    """The most media tokens in a row in ``tokens``: what a prefill chunk may hold past its size,
    being ended after a run rather than inside it (``past_span``)."""
    if not tokens or max(tokens) < MEDIA_BASE:  # text only: one pass in C, not a Python loop
        return 0
    longest = run = 0
    for token in tokens:
        run = run + 1 if is_media(token) else 0
        longest = max(longest, run)
    return longest


def refuse_media(messages: Sequence[ChatMessage] | None, why: str) -> None:
    """Raises ``MediaUnsupported`` naming the first image or video of ``messages`` (a text-only
    model's backend calls it; ``why`` says what the model is)."""
    for i, message in enumerate(messages or ()):
        if message.images or message.videos:
            raise MediaUnsupported(
                f"messages[{i}] has {len(message.images)} image(s) and {len(message.videos)} "
                f"video(s), but {why}; send text only, or load a vision-language model "
                "directory (docs/models.md, vision)"
            )
