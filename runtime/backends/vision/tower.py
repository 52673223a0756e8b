"""The vision tower as an abortable job: a stop check before each of its encoder layers.

MLX evaluates a forward pass as one graph, so an abort used to wait for a whole image's tower.
While an image is encoded with a stop flag, each encoder of the vision model (a module holding a
``layers`` list) runs its layers through a ``Checked`` stand-in that evaluates the layer's input
and raises ``PrefillInterrupted`` once the flag is set; the lists are put back afterwards.
mlx-vlm's ``get_input_embeddings`` does the rest, so no family's tower is rewritten, and a run
whose flag is never set computes the same graph in more pieces. Swapping the lists is safe because
only the engine's compute thread runs the model.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from runtime.backends.contract import PrefillInterrupted

Module: Any = nn.Module  # type: ignore[attr-defined]  # mlx's type stubs leave it out
# Where mlx-vlm keeps a VLM's vision model (Gemma 3: vision_tower; Idefics3, SmolVLM: vision_model).
_TOWERS = ("vision_tower", "vision_model")
# What an encoder calls its list of layers (Qwen2-VL's vision tower: blocks).
_LISTS = ("layers", "blocks")


class Checked:
    """One encoder layer, run only while ``stop`` is clear (checked after its input is computed)."""

    def __init__(self, layer: Any, stop: threading.Event) -> None:
        self.layer = layer
        self._stop = stop

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        mx.eval(x)
        if self._stop.is_set():
            raise PrefillInterrupted("the sequence was aborted inside an image's encoding")
        return self.layer(x, *args, **kwargs)


def encoders(vlm: Any) -> list[Any]:
    """The modules of ``vlm``'s vision model that hold a list of layers."""
    found: list[Any] = []
    for name in _TOWERS:
        tower = getattr(vlm, name, None)
        if not isinstance(tower, Module):
            continue
        for _, module in tower.named_modules():
            if _layer_lists(module):
                found.append(module)
    return found


def _layer_lists(module: Any) -> list[str]:
    """The names under which ``module`` holds a non-empty list of layers."""
    return [
        name
        for name in _LISTS
        if isinstance(layers := module.get(name), list)
        and layers
        and all(isinstance(x, Module) for x in layers)
    ]


@contextlib.contextmanager
def layer_checks(vlm: Any, stop: threading.Event | None) -> Iterator[None]:
    """Within the block, ``vlm``'s encoder layers check ``stop`` first (none when it is None)."""
    if stop is None:
        yield
        return
    swapped = [
        (module, name, module[name]) for module in encoders(vlm) for name in _layer_lists(module)
    ]
    for module, name, layers in swapped:
        module[name] = [Checked(layer, stop) for layer in layers]
    try:
        yield
    finally:
        for module, name, layers in swapped:
            module[name] = layers
