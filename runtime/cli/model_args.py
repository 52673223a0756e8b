"""The ``--model`` arguments of ``mlxrt``: specs from ``[NAME=]PATH`` values, and the fetch and
conversion that run before the runtime starts (docs/cli.md, "The model argument")."""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec

from runtime.backends.choice import resolve_backend
from runtime.backends.model_source import prepare_model, prepared_spec
from runtime.backends.model_store import DEFAULT_MODEL, KNOWN_MODELS, fetch_model
from runtime.backends.options import OptionValue, option_from_text
from runtime.messages import ModelSpec
from runtime.progress import tqdm_progress


def prepare_specs(specs: tuple[ModelSpec, ...], *, quiet: bool) -> tuple[ModelSpec, ...]:
    """Fetch and convert the models before the runtime starts, showing progress; the specs
    with their paths replaced by the prepared directories (so the engines' loads neither fetch
    nor hash a GGUF file again)."""
    prepared_specs: list[ModelSpec] = []
    with tqdm_progress(disable=quiet) as progress:
        for spec in specs:
            known = KNOWN_MODELS.get(spec.path or "")
            if spec.backend == "llamacpp" and known is not None:
                fetch_model(known, progress=progress)  # llama.cpp loads the file as it is
            elif spec.backend == "mlx":
                prepared = prepare_model(spec, progress)
                if prepared.note and not quiet:
                    print(f"{spec.name}: {prepared.note}", file=sys.stderr)
                spec = prepared_spec(spec, prepared)
            prepared_specs.append(spec)
    return tuple(prepared_specs)


def model_name(path: str) -> str:
    """The name a model is served under when only its path is given: a known model's own name,
    else the file or directory name without a ``.gguf`` suffix."""
    if path in KNOWN_MODELS:
        return path
    name = Path(path.rstrip("/")).name
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name


def model_specs(values: list[str], backend: str, options: list[str]) -> tuple[ModelSpec, ...]:
    """``--model`` arguments as specs: ``PATH`` (served under a name derived from it) or
    ``NAME=PATH``; PATH is an mlx-lm directory, a .gguf file or a known model; a simulated model
    needs only ``NAME``. No values: the default model. ``KEY=VALUE`` options go to every model,
    each value converted to the type the backend declares for it (``kv_bits=4`` is 4,
    ``batching=False`` is False).

    Raises ``ValueError`` with a sentence for a malformed option or a malformed or repeated name,
    ``InvalidModelSpec`` (a ``ValueError``) for an unknown option or a value of the wrong type.
    """
    texts: dict[str, str] = {}
    for option in options:
        key, equals, text = option.partition("=")
        if not key or not equals:
            raise ValueError(f"--model-option {option!r}: write KEY=VALUE")
        texts[key] = text
    specs: list[ModelSpec] = []
    files = backend != "simulated"  # every other kind loads a model from a path
    for value in values or ([DEFAULT_MODEL] if files else []):
        name, equals, path = value.partition("=")
        if not equals or "/" in name:  # a bare path (which may itself contain "=")
            name, path = (model_name(value), value) if files else (value, "")
        if not name or (files and not path):
            raise ValueError(
                f"--model {value!r}: write PATH or NAME=PATH (an mlx-lm model directory, a "
                f".gguf file, or a known model: {', '.join(KNOWN_MODELS)})"
            )
        if any(spec.name == name for spec in specs):
            raise ValueError(f"--model {name!r} is given twice; each model needs its own name")
        spec = resolve_backend(ModelSpec(name=name, path=path or None, backend=backend))
        parsed: dict[str, OptionValue] = {
            key: option_from_text(spec, key, text) for key, text in texts.items()
        }
        specs.append(msgspec.structs.replace(spec, options=parsed))
    return tuple(specs)
