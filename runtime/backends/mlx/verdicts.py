"""The load probe's verdicts, cached by the model's fingerprint so a reload costs nothing.

The fingerprint covers everything a verdict depends on: the model's config.json, its weight files
(names, sizes, modification times: hashing gigabytes would cost more than the probe), the options
that change its caches (``kv_bits``), the cache classes its layers got (a host may swap them), the
MLX device, the MLX and mlx-lm versions and the probe's own version. One small JSON file per
fingerprint under ``<cache root>/probe/``; an unreadable or foreign one is ignored and probed
again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import mlx.core as mx
import msgspec

from runtime.backends.mlx.probe import PROBE_VERSION, ProbeResult
from runtime.backends.model_store import cache_root

log = logging.getLogger("mlx_actor_runtime.mlx_backend")
_WEIGHT_SUFFIXES = (".safetensors", ".npz", ".gguf", ".bin")
_decoder = msgspec.json.Decoder(ProbeResult)


def fingerprint(path: Path, kv_bits: int | None, caches: Sequence[Any] = ()) -> str:
    """A hex digest naming the model at ``path`` as loaded with ``kv_bits`` here, its layers
    holding ``caches``."""
    digest = hashlib.sha256()
    config = path / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"")
    weights = sorted(p for p in path.iterdir() if p.suffix in _WEIGHT_SUFFIXES)
    for weight in weights:
        info = weight.stat()
        digest.update(f"{weight.name}:{info.st_size}:{info.st_mtime_ns};".encode())
    versions = {
        "probe": PROBE_VERSION,
        "kv_bits": kv_bits,
        "caches": [_layout(c) for c in caches],
        "device": str(mx.default_device()),
        "mlx": _version("mlx"),
        "mlx-lm": _version("mlx-lm"),
    }
    digest.update(json.dumps(versions, sort_keys=True).encode())
    return digest.hexdigest()


def _layout(layer: Any) -> str:
    """A layer's cache class, a ``CacheList``'s children included."""
    children = getattr(layer, "caches", None)
    inner = (
        f"({','.join(_layout(c) for c in children)})" if isinstance(children, tuple | list) else ""
    )
    return f"{type(layer).__module__}.{type(layer).__qualname__}{inner}"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unknown"


def probe_dir() -> Path:
    """Where the verdicts are kept."""
    return cache_root() / "probe"


def verdict_file(key: str) -> Path:
    """Where the verdict of fingerprint ``key`` is kept."""
    return probe_dir() / f"{key}.json"


def cached(key: str) -> ProbeResult | None:
    """The verdict stored under ``key``, or None (none yet, or not readable)."""
    try:
        return _decoder.decode(verdict_file(key).read_bytes())
    except (OSError, msgspec.DecodeError):
        return None


def store(key: str, result: ProbeResult) -> None:
    """Keep ``result`` under ``key`` (written aside, then renamed: a reader never sees half);
    a cache that cannot be written only costs the next load a probe."""
    target = verdict_file(key)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".probe-")
        with os.fdopen(fd, "wb") as out:
            out.write(msgspec.json.encode(result))
        os.replace(tmp, target)
    except OSError as exc:
        log.warning("could not cache the load probe's verdict at %s: %s", target, exc)
