"""``image_url`` content parts: where the server may read an image from.

A data URL (``data:image/png;base64,...``) is always read. A local file (``file:///...`` or an
absolute path) only under a directory the host allowed (``ServerConfig.media_dirs``, ``mlxrt
serve --media-dir``), after resolving links, so a client cannot name ``/etc/passwd`` or climb out
with ``..``. A remote URL is refused: this server does not fetch (send the image as a data URL).
The bytes go to the engine as they are: decoding and the size limits are the engine's
(runtime/backends/vision/media.py), so HTTP and the embedded API refuse the same images.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from urllib.parse import unquote, urlparse

from runtime.errors import InvalidMedia, MediaSourceRefused
from runtime.messages import ImagePart
from runtime.server.errors import HttpError

_MAX_FILE_BYTES = 64 << 20  # a file larger than any engine limit is not read whole


def image_part(url: str, where: str, media_dirs: tuple[str, ...]) -> ImagePart:
    """The image ``url`` names (``where``: the part, e.g. ``messages[0].content[1]``); raises a
    400 ``HttpError``: ``invalid_media`` (a malformed data URL), ``media_source_refused``."""
    if url.startswith("data:"):
        return ImagePart(data=_data_url(url, where), part=where)
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https"):
        raise _refused(
            where,
            f"{where}.image_url is a remote URL; this server does not fetch images: send the "
            "image as a data URL (data:image/png;base64,...)",
        )
    if parsed.scheme == "file" or (not parsed.scheme and url.startswith("/")):
        path = unquote(parsed.path) if parsed.scheme == "file" else url
        return ImagePart(data=_local_file(Path(path), where, media_dirs), part=where)
    raise HttpError(
        400,
        f"{where}.image_url must be a data URL or a file: URL, not {url[:40]!r}",
        code=InvalidMedia.code,
        param=f"{where}.image_url",
    )


def _data_url(url: str, where: str) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64") or not header[5:].startswith("image/"):
        raise HttpError(
            400,
            f"{where}.image_url is not a base64 image data URL; send "
            "data:image/<format>;base64,<bytes>",
            code=InvalidMedia.code,
            param=f"{where}.image_url",
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise HttpError(
            400,
            f"{where}.image_url holds invalid base64 ({exc}); encode the image's bytes again",
            code=InvalidMedia.code,
            param=f"{where}.image_url",
        ) from exc


def _local_file(path: Path, where: str, media_dirs: tuple[str, ...]) -> bytes:
    try:
        real = path.resolve(strict=True)
    except (OSError, RuntimeError):
        real = None
    allowed = [Path(d).resolve() for d in media_dirs]
    if real is None or not any(real.is_relative_to(d) for d in allowed):
        # The same answer for a missing file and a forbidden one: no probing the disk.
        raise _refused(
            where,
            f"{where}.image_url names a local file this server may not read; allowed: files "
            "under its --media-dir directories"
            + (f" ({', '.join(str(d) for d in allowed)})" if allowed else " (none are set)"),
        )
    if not real.is_file() or real.stat().st_size > _MAX_FILE_BYTES:
        raise HttpError(
            400,
            f"{where}.image_url is not a readable image file of at most {_MAX_FILE_BYTES} bytes",
            code=InvalidMedia.code,
            param=f"{where}.image_url",
        )
    return real.read_bytes()


def _refused(where: str, message: str) -> HttpError:
    return HttpError(400, message, code=MediaSourceRefused.code, param=f"{where}.image_url")
