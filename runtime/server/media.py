"""``image_url`` and ``video_url`` content parts: where the server may read an image or video from.

A data URL is always read. A local file (``file:///...`` or an absolute path) only under a directory
the host allowed (``ServerConfig.media_dirs``), links resolved, so a client cannot name
``/etc/passwd`` or climb out with ``..``. A remote ``http(s)`` URL is refused unless the host
enabled fetching (``ServerConfig.fetch_images``): then ``fetch_remote`` reads it before the request
is translated, at most ``FETCH_MAX_BYTES`` within ``fetch_timeout_s`` (a failure is a 400 naming the
part). The bytes go to the engine as they are: decoding and size limits are the engine's
(runtime/backends/vision/media.py), so HTTP and the embedded API refuse the same media. See
docs/http.md, "Security".
"""

from __future__ import annotations

import base64
import binascii
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import NamedTuple
from urllib.parse import unquote, urlparse

import anyio

from runtime.errors import InvalidMedia, MediaSourceRefused
from runtime.messages import ImagePart, VideoPart
from runtime.server.errors import HttpError
from runtime.server.schema import WireChatMessage

_PARTS = ("image_url", "video_url")
_MAX_FILE_BYTES = 64 << 20  # a file larger than any engine limit is not read whole
FETCH_MAX_BYTES = 20 << 20  # the engine's default max_image_bytes: a larger image is refused


def remote_urls(messages: Sequence[WireChatMessage]) -> dict[str, str]:
    """Each ``http(s)`` image or video URL of ``messages`` and the first part that names it."""
    return _media_urls(messages, lambda url: urlparse(url).scheme in ("http", "https"))


def _local_path(url: str) -> Path | None:
    """The file a ``file:`` URL or an absolute path names; None for any other URL."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    return Path(url) if not parsed.scheme and url.startswith("/") else None


def _media_urls(
    messages: Sequence[WireChatMessage], wanted: Callable[[str], bool]
) -> dict[str, str]:
    """Each ``wanted`` image or video URL of ``messages`` and the field of the first part that
    names it (e.g. ``messages[0].content[1].image_url``)."""
    found: dict[str, str] = {}
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            media = part.image_url if part.type == "image_url" else part.video_url
            url = media if isinstance(media, str) or media is None else media.url
            if part.type in _PARTS and url and wanted(url):
                found.setdefault(url, f"messages[{i}].content[{j}].{part.type}")
    return found


async def read_local(
    messages: Sequence[WireChatMessage], media_dirs: tuple[str, ...]
) -> dict[str, bytes]:
    """The bytes of every local image or video file of ``messages``, read in a worker thread
    (resolving, checking and reading a file is disk I/O, never done on the event loop); raises
    the 400s ``image_part`` documents for a file that may not be read."""
    read: dict[str, bytes] = {}
    for url, field in _media_urls(messages, lambda url: _local_path(url) is not None).items():
        path = _local_path(url)
        assert path is not None
        kind = "video" if field.endswith("video_url") else "image"
        read[url] = await anyio.to_thread.run_sync(_local_file, path, field, kind, media_dirs)
    return read


async def fetch_remote(
    messages: Sequence[WireChatMessage], enabled: bool, timeout_s: float
) -> dict[str, bytes]:
    """The bytes of every remote image URL of ``messages`` when fetching is ``enabled`` (else
    none: ``image_part`` refuses them); raises a 400 ``HttpError`` (``media_source_refused``)
    for one that fails, times out or is larger than ``FETCH_MAX_BYTES``."""
    urls = remote_urls(messages) if enabled else {}
    fetched: dict[str, bytes] = {}
    for url, where in urls.items():
        try:
            with anyio.fail_after(timeout_s):
                fetched[url] = await anyio.to_thread.run_sync(
                    _fetch, url, timeout_s, abandon_on_cancel=True
                )
        except TimeoutError as exc:
            raise _refused(where, f"{where} did not arrive within {timeout_s:g} s; retry") from exc
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise _refused(where, f"{where} could not be fetched: {exc}") from exc
    return fetched


def _fetch(url: str, timeout_s: float) -> bytes:
    try:
        response = urllib.request.urlopen(url, timeout=timeout_s)
    except urllib.error.HTTPError as error:
        error.close()  # it holds the response: answered, but not with an image
        raise ValueError(f"the server answered HTTP {error.code}") from None
    with response:
        data: bytes = response.read(FETCH_MAX_BYTES + 1)
    if len(data) > FETCH_MAX_BYTES:
        raise ValueError(f"it is more than {FETCH_MAX_BYTES} bytes")
    return data


class MediaSources(NamedTuple):
    """Where one request's media may come from: files under ``dirs``, and what ``fetch_remote``
    and ``read_local`` read for it (by URL)."""

    dirs: tuple[str, ...] = ()
    fetched: Mapping[str, bytes] = MappingProxyType({})


def image_part(url: str, where: str, sources: MediaSources) -> ImagePart:
    """The image ``url`` names (``where``: the part, e.g. ``messages[0].content[1]``); raises a
    400 ``HttpError``: ``invalid_media`` (a malformed data URL), ``media_source_refused``."""
    return ImagePart(data=_media_bytes(url, f"{where}.image_url", "image", sources), part=where)


def video_part(url: str, where: str, sources: MediaSources) -> VideoPart:
    """The video ``url`` names, as ``image_part`` reads an image (``data:video/...``)."""
    return VideoPart(data=_media_bytes(url, f"{where}.video_url", "video", sources), part=where)


def _media_bytes(url: str, field: str, kind: str, sources: MediaSources) -> bytes:
    """The bytes ``url`` names; ``field``: the part's field, ``kind``: image or video."""
    if url in sources.fetched:
        return sources.fetched[url]
    if url.startswith("data:"):
        return _data_url(url, field, kind)
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https"):
        raise _refused(
            field,
            f"{field} is a remote URL, and this server does not fetch media "
            f"(mlxrt serve --fetch-images): send the {kind} as a data URL "
            f"(data:{kind}/<format>;base64,...)",
        )
    path = _local_path(url)
    if path is not None:  # the server read it off the loop already (read_local); tests may not
        return _local_file(path, field, kind, sources.dirs)
    raise HttpError(
        400,
        f"{field} must be a data URL or a file: URL, not {url[:40]!r}",
        code=InvalidMedia.code,
        param=field,
    )


def _data_url(url: str, field: str, kind: str) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64") or not header[5:].startswith(f"{kind}/"):
        raise HttpError(
            400,
            f"{field} is not a base64 {kind} data URL; send data:{kind}/<format>;base64,<bytes>",
            code=InvalidMedia.code,
            param=field,
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise HttpError(
            400,
            f"{field} holds invalid base64 ({exc}); encode the {kind}'s bytes again",
            code=InvalidMedia.code,
            param=field,
        ) from exc


def _local_file(path: Path, field: str, kind: str, media_dirs: tuple[str, ...]) -> bytes:
    try:
        real = path.resolve(strict=True)
    except (OSError, RuntimeError):
        real = None
    allowed = [Path(d).resolve() for d in media_dirs]
    if real is None or not any(real.is_relative_to(d) for d in allowed):
        # The same answer for a missing file and a forbidden one: no probing the disk.
        raise _refused(
            field,
            f"{field} names a local file this server may not read; allowed: files "
            "under its --media-dir directories"
            + (f" ({', '.join(str(d) for d in allowed)})" if allowed else " (none are set)"),
        )
    if not real.is_file() or real.stat().st_size > _MAX_FILE_BYTES:
        raise HttpError(
            400,
            f"{field} is not a readable {kind} file of at most {_MAX_FILE_BYTES} bytes",
            code=InvalidMedia.code,
            param=field,
        )
    return real.read_bytes()


def _refused(field: str, message: str) -> HttpError:
    """``field``: the part's field, e.g. ``messages[0].content[1].video_url``."""
    return HttpError(400, message, code=MediaSourceRefused.code, param=field)
