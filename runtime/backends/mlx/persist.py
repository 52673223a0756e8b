"""MLX states as host arrays for the disk tier (``runtime.backends.disk.host.Persistent``).

Each layer's cache is written as mlx-lm's own ``state`` of its class (the same fields its
``save_prompt_cache`` writes) and made back with that class's ``from_state``; only classes with a
``CacheKind`` adapter are made back, so a file cannot name arbitrary code. A full-attention layer
is written up to its offset (not its spare capacity). bfloat16 arrays travel as their uint16 bits
(numpy has no bfloat16). The fingerprint names the weights (every weight file's name, size and
modification time, and the config), the weight dtype, the KV quantisation, mlx-lm's version and
this layout's version: a state is never imported into a model it was not computed by.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from importlib.metadata import version
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import cache as mlx_cache

from runtime.backends.contract import SequenceState, Snapshot
from runtime.backends.disk.host import HostState
from runtime.backends.mlx.cache_kinds import KINDS
from runtime.backends.mlx.state import MlxSnapshot, MlxState, own_state

LAYOUT_VERSION = 1
_CLASSES = {cls.__name__: cls for cls in KINDS}
_FULL = (mlx_cache.KVCache, mlx_cache.QuantizedKVCache)


def fingerprint(path: Path, model: Any, kv_bits: int | None) -> str:
    """A hex digest of everything an exported state depends on (see the module docstring)."""
    h = hashlib.sha256()
    h.update(f"mlx|layout {LAYOUT_VERSION}|mlx-lm {version('mlx-lm')}|kv {kv_bits}|".encode())
    resolved = path.resolve()
    h.update(str(resolved).encode())
    for weight in sorted(resolved.glob("*.safetensors")) + sorted(resolved.glob("*.npz")):
        stat = weight.stat()
        h.update(f"|{weight.name}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    config = resolved / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    flat = cast(list[tuple[str, Any]], tree_flatten(model.parameters()))
    weights = [a for _, a in flat if isinstance(a, mx.array)]
    h.update(f"|dtype {weights[0].dtype if weights else None}".encode())
    return h.hexdigest()


def export_state(state: SequenceState, points: Mapping[int, Snapshot]) -> HostState:
    """Host views of ``state``'s layers and ``points``' snapshots (computed here, not copied)."""
    own = own_state(state)
    arrays: dict[str, mx.array] = {}
    layers = [_encode(_layer_state(c), f"s{i}", arrays) for i, c in enumerate(own.caches)]
    kept: dict[str, Any] = {}
    for length, snapshot in sorted(points.items()):
        if not isinstance(snapshot, MlxSnapshot):
            raise TypeError(f"not an MLX snapshot: {type(snapshot).__name__}")
        kept[str(length)] = {
            str(i): [type(c).__name__, _encode(c.state, f"p{length}.{i}", arrays)]
            for i, c in snapshot.layers.items()
        }
    dtypes = {name: "bfloat16" for name, a in arrays.items() if a.dtype == mx.bfloat16}
    bits = {n: a.view(mx.uint16) if n in dtypes else a for n, a in arrays.items()}
    mx.eval(list(bits.values()))
    layout = {
        "version": LAYOUT_VERSION,
        "classes": [type(c).__name__ for c in own.caches],
        "layers": layers,
        "points": kept,
        "dtypes": dtypes,
    }
    host = {name: np.asarray(a) for name, a in bits.items()}
    return HostState(own.n_tokens, json.dumps(layout), host, tuple(sorted(points)))


def import_state(host: HostState) -> tuple[MlxState, dict[int, MlxSnapshot]]:
    """The state and snapshots ``host`` holds; raises ``ValueError`` on a layout that is not
    this version's or names a cache class without an adapter."""
    try:
        layout = json.loads(host.layout)
        if layout.get("version") != LAYOUT_VERSION:
            raise ValueError(f"layout version {layout.get('version')!r}")
        dtypes: dict[str, str] = layout["dtypes"]

        def array(name: str) -> mx.array:
            made = mx.array(host.arrays[name])
            return made.view(mx.bfloat16) if dtypes.get(name) == "bfloat16" else made

        caches = [
            _make(name, _decode(encoded, array))
            for name, encoded in zip(layout["classes"], layout["layers"], strict=True)
        ]
        snapshots = {
            int(length): MlxSnapshot(
                {int(i): _make(name, _decode(enc, array)) for i, (name, enc) in kept.items()},
                int(length),
            )
            for length, kept in layout["points"].items()
        }
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"an exported state that does not fit: {exc!r}") from exc
    if set(snapshots) != set(host.points):
        raise ValueError("an exported state whose points do not match its snapshots")
    mx.eval([a for c in caches for a in _arrays(c)], [s.arrays() for s in snapshots.values()])
    return MlxState(caches, host.length), snapshots


def _layer_state(layer: Any) -> Any:
    """mlx-lm's ``state`` of a layer, a full-attention one cut to its offset."""
    if type(layer) in _FULL and layer.keys is not None:
        end = int(layer.offset)
        cut = [_cut(part, end) for part in (layer.keys, layer.values)]
        return [*cut, *list(layer.state)[2:]]
    return layer.state


def _cut(part: Any, end: int) -> Any:
    if isinstance(part, (tuple, list)):  # quantized: (data, scales, biases)
        return [a[..., :end, :] for a in part]
    return part[..., :end, :]


def _encode(obj: Any, name: str, arrays: dict[str, mx.array]) -> Any:
    if isinstance(obj, mx.array):
        arrays[name] = obj
        return {"t": name}
    if isinstance(obj, (list, tuple)):
        return [_encode(x, f"{name}.{i}", arrays) for i, x in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise ValueError(f"a cache state holds a {type(obj).__name__}, which cannot be written")


def _decode(obj: Any, array: Any) -> Any:
    if isinstance(obj, dict):
        return array(obj["t"])
    if isinstance(obj, list):
        return [_decode(x, array) for x in obj]
    return obj


def _make(class_name: str, state: Any) -> Any:
    cls = _CLASSES.get(class_name)
    if cls is None:
        raise ValueError(f"an exported state names the cache class {class_name!r}")
    if cls is mlx_cache.CacheList:  # its state names its children's classes: check them too
        for _, child in state:
            if child not in _CLASSES:
                raise ValueError(f"an exported state names the cache class {child!r}")
    return cls.from_state(state)  # type: ignore[attr-defined]


def _arrays(layer: Any) -> list[mx.array]:
    flat = cast(list[tuple[str, Any]], tree_flatten(layer.state))
    return [a for _, a in flat if isinstance(a, mx.array)]
