"""What the backend does with one mlx-lm cache class: the ``CacheKind`` base and its price."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import mlx.core as mx

from runtime.backends.contract import CannotTrim


@dataclasses.dataclass(frozen=True)
class Price:
    """Bytes a layer's cache holds, read off its arrays after a pass: per token of full attention,
    per token of a bounded window (up to ``window`` tokens), and fixed (recurrent state)."""

    per_token: int = 0
    window: int | None = None
    window_per_token: int = 0
    fixed: int = 0

    def __add__(self, other: Price) -> Price:
        windows = [w for w in (self.window, other.window) if w is not None]
        return Price(
            per_token=self.per_token + other.per_token,
            window=max(windows) if windows else None,
            window_per_token=self.window_per_token + other.window_per_token,
            fixed=self.fixed + other.fixed,
        )


class CacheKind:
    """One mlx-lm cache class's behaviour, in one place (``registry.KINDS`` maps the class here).

    ``layer`` is an instance of that class, per sequence (batch size 1). A *kept* layer is what a
    snapshot holds of one (``snapshot``): None where the layer is cut back from the state the
    snapshot came from instead of copied. The defaults fit a cache of whole arrays that updates by
    making new ones or writing past its old length.
    """

    name = "cache"
    # How mlx-lm batches it: the batched class and how rows are padded, or why it cannot.
    batched_form = "no batched form in mlx-lm"

    def describe(self, layer: Any) -> str:
        """The kind as the load log and ``reuse_reason`` name it (with its window, if any)."""
        return type(layer).__name__

    def cut_back(self, layer: Any) -> bool:
        """Whether a checkpoint restores this layer by cutting back a longer state of the same
        history (its snapshot keeps nothing), rather than from a copy the snapshot keeps."""
        return False

    def trimmable(self, layer: Any) -> bool:
        """Whether this layer, as it is now, can be cut back to any shorter prefix."""
        return bool(layer.is_trimmable())

    def copy(self, layer: Any, drop: int) -> Any:
        """An independent copy minus the last ``drop`` tokens; raises ``CannotTrim``."""
        raise NotImplementedError

    def snapshot(self, layer: Any, back: int) -> Any | None:
        """What a checkpoint keeps of this layer as it was ``back`` tokens ago (None: nothing,
        it is cut back at restore); raises ``CannotTrim`` if the layer no longer holds that point.
        Never more than later updates read, and no array shared with ``layer``'s buffers."""
        raise NotImplementedError

    def restore(self, layer: Any, kept: Any | None, drop: int) -> Any:
        """The layer of a state restored at a checkpoint: from what it kept, or cut back from
        ``layer`` (the state the checkpoint came from, ``drop`` tokens past it)."""
        return self.copy(layer, drop) if kept is None else self.copy(kept, 0)

    def rewind(self, layer: Any, drop: int) -> Any | None:
        """The layer minus the last ``drop`` tokens of the multi-token pass it just ran (a
        speculative verification), without copying what it keeps; None where it cannot be cut
        back (the backend then restores it from before the pass and runs the kept tokens again).
        ``layer`` itself is left as it is."""
        try:
            return self.copy(layer, drop)
        except CannotTrim:
            return None

    def reaches_back(self, layer: Any) -> bool:
        """Whether ``snapshot`` reaches back inside this layer's last multi-token update, so a
        prefill need not end a pass at each snapshot point."""
        return False

    def ring(self, layer: Any) -> bool:
        """Whether the layer holds a sliding-window ring (mlx-lm's batched ring refuses a
        one-token piece of a right-padded pass, so such a pass cannot be cut)."""
        return False

    def price(self, layer: Any) -> Price:
        """What this layer costs, read off its arrays after a pass (see ``Price``)."""
        raise NotImplementedError

    def nbytes(self, layer: Any) -> int:
        """Bytes a layer (or a kept one) holds now."""
        return 0 if layer.empty() else int(layer.nbytes)

    def arrays(self, layer: Any) -> list[Any]:
        """What to evaluate so a layer (or a kept one) is computed."""
        return [] if layer.empty() else [layer.state]

    def interruptible(self, layer: Any) -> bool:
        """Whether a multi-token pass over this layer can be undone by putting back the copy
        ``undo_copy`` made before it (its updates make new arrays or write past the old end)."""
        return True

    def undo_copy(self, layer: Any) -> Any:
        """A shallow copy to put back if a pass over ``layer`` is given up (``interrupt.py``)."""
        return clone_layer(layer)

    def updaters(self, layer: Any) -> list[Any]:
        """The cache objects whose ``update_and_fetch`` a pass calls once each (an attention
        layer each): where an interruptible pass checks its stop flag."""
        return [layer] if hasattr(layer, "update_and_fetch") else []

    def batch_refusal(self, layer: Any) -> str | None:
        """Why mlx-lm cannot batch this layer, or None when it can (``batched_form``)."""
        return f"{type(layer).__name__} has {self.batched_form}"

    def children(self, layer: Any) -> list[Any]:
        """The caches this one is made of (``CacheList``), checked at load like any layer."""
        return []

    def extracted(self, layer: Any) -> Any:
        """A row just taken out of a batched layer (mlx-lm's ``extract``), made ready to go on
        alone: a kind that grows in steps gets its buffer back to a whole step (``padded_to``)."""
        return layer


def whole_steps(cells: int, step: int) -> int:
    """``cells`` rounded up to mlx-lm's allocation ``step``: what a cache that grew alone holds,
    and what ``ModelInfo.kv_bytes`` prices. A buffer cut to an unaligned length would grow a whole
    step past it on its next update and outgrow its KV reservation."""
    return -(-cells // step) * step


def padded_to(layer: Any, cells: int) -> Any:
    """``layer`` (keys and values of shape batch, heads, tokens, dim) with its buffers grown with
    zeros to ``cells``. mlx-lm's ``extract`` cuts a row's buffers to its exact length: a 40-token
    row then held 296 cells after its next token where 256 are priced."""
    have = int(layer.keys.shape[2])
    if cells > have:
        layer.keys, layer.values = (
            mx.concatenate([a, mx.zeros((*a.shape[:2], cells - have, a.shape[3]), a.dtype)], 2)
            for a in (layer.keys, layer.values)
        )
    return layer


def clone_layer(layer_cache: Any) -> Any:
    """A shallow copy of one layer's cache object, without the per-call hook a pass may have put
    on the original (``interrupt.py``): a snapshot taken mid-call must not update the original."""
    clone = copy.copy(layer_cache)
    vars(clone).pop("update_and_fetch", None)
    return clone


def kv_bytes_per_token(layer_cache: Any) -> int:
    """Bytes one token adds to a KV layer: keys plus values, across heads (quantized or not)."""
    keys, values = layer_cache.keys, layer_cache.values
    if keys is None:  # still empty after the load's pass: a layer the model never writes to
        return 0  # (nemotron-nas's no-op attention)
    parts = [*keys, *values] if isinstance(keys, tuple) else [keys, values]
    return sum(int(a.nbytes) // int(a.shape[2]) for a in parts)
