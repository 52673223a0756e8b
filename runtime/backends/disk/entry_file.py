"""One disk entry: a safetensors file whose metadata holds a msgspec header with a checksum.

Written whole to a temporary name in the same folder, flushed, then renamed over the final name
(``os.replace``): a reader, in this process or another, sees either no file or a whole one, and a
crash leaves at worst a temporary file (removed by the next scan). The header carries the model
fingerprint, the namespace, the exact tokens and a CRC-32 of every array (name, dtype, shape,
bytes); a file that fails any check is never used (``EntryInvalid``), so a truncated,
corrupt, foreign or wrong-model file can only cost a recompute.
"""

from __future__ import annotations

import hashlib
import os
import threading
import uuid
import zlib
from collections.abc import Iterable
from pathlib import Path

import msgspec
import numpy as np

from runtime.backends.disk.host import HostState

FORMAT_VERSION = 1
SUFFIX = ".safetensors"
_META_KEY = "mlxrt"


class EntryInvalid(Exception):
    """Raised when an entry file is unreadable, truncated, corrupt, foreign or not the one
    asked for; ``reason`` is the counter it is dropped under."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class LoadAborted(Exception):
    """Raised by ``read_entry`` when its stop flag was set between two arrays."""


class DiskHeader(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What an entry file says about itself (its safetensors metadata, msgspec JSON)."""

    format: int
    fingerprint: str
    namespace: str
    tokens: tuple[int, ...]
    trimmable: bool
    points: tuple[int, ...]
    layout: str
    digest: str


_header_decoder = msgspec.json.Decoder(DiskHeader)


def entry_name(namespace: str, tokens: Iterable[int]) -> str:
    """The file name of (namespace, tokens): the same entry gets the same name in every process."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(namespace.encode())
    digest.update(b"\0")
    digest.update(np.asarray(list(tokens), dtype=np.int64).tobytes())
    return digest.hexdigest() + SUFFIX


def _digest(arrays: Iterable[tuple[str, np.ndarray]]) -> str:
    """CRC-32 of every array's name, dtype, shape and bytes, in order: it catches the accidents a
    file meets (a torn or truncated write, a flipped bit) at ~3.5 GB/s here, where BLAKE2b's ~0.7
    GB/s would add a tenth of a second to reading 92 MB back (the header checks the rest)."""
    crc = 0
    for name, array in arrays:
        crc = zlib.crc32(f"{name}|{array.dtype.str}|{array.shape}|".encode(), crc)
        crc = zlib.crc32(np.ascontiguousarray(array).view(np.uint8).data, crc)
    return f"crc32:{crc:08x}"


def write_entry(
    folder: Path, fingerprint: str, namespace: str, tokens: tuple[int, ...], trimmable: bool,
    host: HostState,
) -> tuple[Path, int]:  # fmt: skip
    """Write one entry atomically; returns its path and size. Raises ``OSError`` (a full disk, a
    folder that cannot be written), leaving no temporary file behind."""
    from safetensors.numpy import save

    arrays = {name: np.ascontiguousarray(a) for name, a in sorted(host.arrays.items())}
    header = DiskHeader(
        format=FORMAT_VERSION,
        fingerprint=fingerprint,
        namespace=namespace,
        tokens=tokens,
        trimmable=trimmable,
        points=host.points,
        layout=host.layout,
        digest=_digest(arrays.items()),
    )
    payload = save(arrays, metadata={_META_KEY: msgspec.json.encode(header).decode()})
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / entry_name(namespace, tokens)
    temporary = folder / f".{final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(temporary, "wb") as out:
            out.write(payload)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, final)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return final, len(payload)


def read_header(path: Path) -> DiskHeader:
    """The header of the file at ``path`` (reads only the safetensors header); raises
    ``EntryInvalid`` (``disk_corrupt``, ``disk_foreign_format``) or ``FileNotFoundError``."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as opened:
            return _header(path, opened.metadata())
    except FileNotFoundError:
        raise
    except (SafetensorError, OSError, ValueError) as exc:
        raise EntryInvalid("disk_corrupt", f"{path.name}: {exc}") from exc


def _header(path: Path, meta: dict[str, str] | None) -> DiskHeader:
    text = (meta or {}).get(_META_KEY)
    if text is None:
        raise EntryInvalid("disk_foreign_format", f"{path.name} is not a prefix-cache entry")
    try:
        header = _header_decoder.decode(text)
    except msgspec.DecodeError as exc:
        raise EntryInvalid("disk_foreign_format", f"{path.name}: {exc}") from exc
    if header.format != FORMAT_VERSION:
        raise EntryInvalid("disk_foreign_format", f"{path.name} has format {header.format}")
    return header


def read_entry(
    path: Path,
    fingerprint: str,
    namespace: str,
    tokens: tuple[int, ...],
    stop: threading.Event | None = None,
) -> HostState:
    """The entry at ``path``, checked to be exactly (fingerprint, namespace, tokens) with every
    array matching its digest. Raises ``EntryInvalid``, ``LoadAborted`` (``stop`` set between
    two arrays) or ``FileNotFoundError`` (another process evicted it).

    Header and arrays come from one open file: another process may rename a new version over
    the name meanwhile, and this read must not mix the two."""
    from safetensors import SafetensorError, safe_open

    arrays: dict[str, np.ndarray] = {}
    try:
        with safe_open(str(path), framework="numpy") as opened:
            header = _header(path, opened.metadata())
            if header.fingerprint != fingerprint:
                raise EntryInvalid("disk_wrong_model", f"{path.name} was written by another model")
            if header.namespace != namespace or header.tokens != tokens:
                raise EntryInvalid("disk_foreign_entry", f"{path.name} holds other tokens")
            for name in sorted(opened.keys()):
                if stop is not None and stop.is_set():
                    raise LoadAborted(path.name)
                arrays[name] = opened.get_tensor(name)
    except FileNotFoundError:
        raise
    except (SafetensorError, OSError, ValueError) as exc:
        raise EntryInvalid("disk_corrupt", f"{path.name}: {exc}") from exc
    if _digest(sorted(arrays.items())) != header.digest:
        raise EntryInvalid("disk_corrupt", f"{path.name} fails its checksum")
    return HostState(len(tokens), header.layout, arrays, header.points)
