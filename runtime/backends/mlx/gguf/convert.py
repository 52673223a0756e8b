"""Convert a GGUF file into an mlx-lm model directory, once, in a cache keyed by its hash.

The directory is built beside its final place and renamed into it, so concurrent loads (threads
or processes) never see half a directory; a stamp file written last marks it complete. Formats:

- ``float32`` / ``bfloat16`` / ``float16``: every tensor dequantized exactly (by the ``gguf``
  package) and stored dense. float32 is the default on a CPU (see ``choose_weights``).
- ``quantized``: Q4_0, Q4_1 and Q8_0 tensors repacked bit for bit into MLX's affine format
  (group 32); other quantized types dequantized and quantized by MLX at 8 bits; the rest dense.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import numpy as np

from runtime.backends.mlx.gguf.architectures import Architecture, architecture_of
from runtime.backends.mlx.gguf.tensors import (
    FLOAT_TYPES,
    GROUP,
    NATIVE_TYPES,
    REQUANT_BITS,
    REQUANT_GROUP,
    affine_triple,
    bits_of,
    dense,
    quantize_dense,
)
from runtime.backends.mlx.gguf.tokenizer import write_tokenizer
from runtime.backends.options import WeightFormat
from runtime.blas import use_fast_blas
from runtime.errors import InvalidModelSpec, ModelLoadFailed
from runtime.progress import Progress, no_progress

WEIGHT_FORMATS: tuple[str, ...] = get_args(WeightFormat)
IMPORTER_VERSION = 1  # bump when the output of a conversion changes
STAMP = "gguf_import.json"
_HASH_CHUNK = 8 << 20


@dataclass(frozen=True)
class ConvertedModel:
    """An mlx-lm model directory made from a GGUF file, and what the conversion did."""

    path: Path
    architecture: str
    weights: str
    source_types: Mapping[str, int]  # GGUF tensor type -> count
    kept_quantized: int  # tensors repacked as they were
    requantized: int  # tensors MLX quantized again (``REQUANT_BITS``)
    reused: bool  # found in the cache, not converted now

    def describe(self) -> str:
        """One line for the load log: what the file held and what the directory keeps."""
        types = ", ".join(f"{kind} x{n}" for kind, n in sorted(self.source_types.items()))
        kept = ""
        if self.weights == "quantized":
            kept = (
                f"; {self.kept_quantized} kept quantized as they were, {self.requantized} "
                f"quantized by MLX to {REQUANT_BITS} bits"
            )
        return f"{self.architecture} GGUF ({types}) as {self.weights} weights{kept}"


def file_sha256(path: Path, progress: Progress = no_progress) -> str:
    """The hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    total = path.stat().st_size
    done = 0
    with path.open("rb") as stream:
        while chunk := stream.read(_HASH_CHUNK):
            digest.update(chunk)
            done += len(chunk)
            progress(f"hash {path.name}", done, total)
    return digest.hexdigest()


def convert_gguf(
    source: Path,
    cache_dir: Path,
    weights: str,
    *,
    sha256: str | None = None,
    progress: Progress = no_progress,
) -> ConvertedModel:
    """The mlx-lm directory for ``source`` in ``weights`` format, converting it if not cached.

    ``sha256``: the file's known hash (skips hashing it). Raises ``InvalidModelSpec`` for an
    unknown format, ``UnsupportedModelFormat`` for an architecture or tensor the importer does
    not know, ``ModelLoadFailed`` when the file cannot be read.
    """
    if weights not in WEIGHT_FORMATS:
        raise InvalidModelSpec(
            f"weights must be one of {', '.join(WEIGHT_FORMATS)} or auto (got {weights!r})"
        )
    if not source.is_file():
        raise ModelLoadFailed(f"no GGUF file at {source}")
    key = sha256 or file_sha256(source, progress)
    target = cache_dir / f"{key[:16]}-{weights}-v{IMPORTER_VERSION}"
    if (target / STAMP).is_file():
        return _read_stamp(target, reused=True)
    cache_dir.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(dir=cache_dir, prefix=f".{target.name}."))
    try:
        _build(source, building, weights, key, progress)
        try:
            os.replace(building, target)
        except OSError:
            if not (target / STAMP).is_file():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return _read_stamp(target, reused=False)


def _read_stamp(target: Path, *, reused: bool) -> ConvertedModel:
    """Raises ``ModelLoadFailed`` when the stamp is not the one ``_build`` writes (edited by
    hand, or the disk corrupted it)."""
    try:
        stamp = json.loads((target / STAMP).read_text())
        return ConvertedModel(
            path=target,
            architecture=stamp["architecture"],
            weights=stamp["weights"],
            source_types=stamp["source_types"],
            kept_quantized=stamp["kept_quantized"],
            requantized=stamp["requantized"],
            reused=reused,
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadFailed(
            f"the converted copy at {target} is damaged ({STAMP}: {exc!r}); delete that "
            "directory and load the model again to convert it anew"
        ) from exc


def read_metadata(source: Path) -> tuple[Any, dict[str, Any]]:
    """The ``gguf`` reader of a file and its metadata as plain values.

    Raises ``ModelLoadFailed`` when the file is not GGUF, or is cut short or corrupt.
    """
    from gguf import GGUFReader

    try:
        reader = GGUFReader(source)
        metadata = {name: field.contents() for name, field in reader.fields.items()}
    # gguf meets a header cut short with IndexError, a corrupt string with UnicodeDecodeError
    except (OSError, ValueError, IndexError) as exc:
        raise ModelLoadFailed(f"{source} is not a readable GGUF file: {exc}") from exc
    return reader, metadata


def _build(source: Path, directory: Path, weights: str, key: str, progress: Progress) -> None:
    import mlx.core as mx

    reader, meta = read_metadata(source)
    arch = architecture_of(meta)
    names = {t.name for t in reader.tensors}
    config = arch.config(meta, "output.weight" in names)
    tensors, quantization, counts = _convert_tensors(reader, meta, arch, weights, progress)
    if quantization:
        config["quantization"] = {"group_size": GROUP, "bits": 4, **quantization}
        config["quantization_config"] = config["quantization"]
    config.update(write_tokenizer(meta, directory))
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    mx.save_safetensors(str(directory / "model.safetensors"), tensors, metadata={"format": "mlx"})
    stamp = {
        "source": str(source),
        "sha256": key,
        "architecture": arch.name,
        "weights": weights,
        "importer_version": IMPORTER_VERSION,
        **counts,
    }
    (directory / STAMP).write_text(json.dumps(stamp, indent=2))  # last: marks it complete


def _convert_tensors(
    reader: Any, meta: Mapping[str, Any], arch: Architecture, weights: str, progress: Progress
) -> tuple[dict[str, Any], dict[str, dict[str, int]], dict[str, Any]]:
    """Every tensor under its mlx-lm name, the per-layer quantization, and what was done."""
    import mlx.core as mx

    half = mx.bfloat16 if arch.name.startswith("gemma") else mx.float16
    dense_dtype = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}.get(
        weights, half
    )
    out: dict[str, Any] = {}
    quantization: dict[str, dict[str, int]] = {}
    types: Counter[str] = Counter()
    kept = requantized = 0
    total = len(reader.tensors)
    for done, tensor in enumerate(reader.tensors, start=1):
        types[tensor.tensor_type.name] += 1
        name = arch.mlx_name(tensor.name)
        prefix = name.removesuffix(".weight")
        rows = arch.fix_rows(tensor.name, meta)
        if weights == "quantized" and tensor.tensor_type in NATIVE_TYPES:
            triple = affine_triple(tensor)
            if rows is not None:
                triple = (triple[0][rows], triple[1][rows], triple[2][rows])
            out[name] = mx.array(triple[0])
            out[f"{prefix}.scales"] = mx.array(triple[1]).astype(half)
            out[f"{prefix}.biases"] = mx.array(triple[2]).astype(half)
            quantization[prefix] = {"group_size": GROUP, "bits": bits_of(tensor)}
            kept += 1
        else:
            values = arch.fix(tensor.name, dense(tensor), meta)
            if rows is not None:
                values = np.ascontiguousarray(values[rows])
            quantizable = values.ndim == 2 and values.shape[1] % REQUANT_GROUP == 0
            if weights == "quantized" and tensor.tensor_type not in FLOAT_TYPES and quantizable:
                weight, scales, biases = quantize_dense(values, half)
                out[name], out[f"{prefix}.scales"], out[f"{prefix}.biases"] = weight, scales, biases
                quantization[prefix] = {"group_size": REQUANT_GROUP, "bits": REQUANT_BITS}
                requantized += 1
            else:
                out[name] = mx.array(values).astype(dense_dtype)
        progress("convert", done, total)
    counts = {"source_types": dict(types), "kept_quantized": kept, "requantized": requantized}
    return out, quantization, counts


def choose_weights(requested: str | None) -> tuple[str, str]:
    """The weight format to load and why: ``auto`` (or None) picks by MLX's default device."""
    if requested not in (None, "auto"):
        return str(requested), "asked for by the weights option"
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        # The 44x was measured with OpenBLAS: say so only where this process runs it.
        blas = "OpenBLAS, in use here" if use_fast_blas().fast else "OpenBLAS, not in use here"
        return "float32", (
            f"auto on a CPU: MLX's CPU quantized matmul is ~44x slower than float32 (measured "
            f"with {blas}; docs/models.md); weights=quantized keeps them small instead"
        )
    return "quantized", "auto on a GPU: quantized weights are faster there and 4-8x smaller"
