"""A prefill pass that gives up between layers once its sequence is aborted.

MLX evaluates a forward pass as one graph, so an abort used to wait for the whole chunk. Here each
attention layer's cache update first evaluates the layer's keys and values (so every layer before it
has run) and checks the abort flag; once it is set the pass stops and every cache is put back as it
was before the call, from shallow copies taken first. That bounds an abort's wait by the work
between two attention layers, so chunks can stay long enough to run efficiently. Which cache kinds a
shallow copy restores is said at ``can_interrupt``.

See docs/design.md, "One step".
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx

from runtime.backends.contract import PrefillInterrupted
from runtime.backends.mlx.cache_kinds import kind_of


def can_interrupt(caches: list[Any], first_pass_tokens: int) -> bool:
    """Whether a call over these caches whose first pass feeds ``first_pass_tokens`` can be
    stopped and undone."""
    # Undone from shallow copies (each kind's ``undo_copy``): right for every kind whose update
    # writes past the old length (KVCache, QuantizedKVCache, ChunkedKVCache), makes new arrays (a
    # multi-token RotatingKVCache update, ArraysCache, ConcatenateKVCache), or writes the ring in
    # place only on a one-token update, harmless after a multi-token one (``interruptible``).
    return first_pass_tokens > 1 and all(kind_of(c).interruptible(c) for c in caches)


def stop_checks(caches: list[Any]) -> int:
    """How many times an interruptible pass over these caches checks its stop flag (0: never)."""
    if not can_interrupt(caches, 2):
        return 0
    return sum(len(kind_of(c).updaters(c)) for c in caches)


@contextlib.contextmanager
def interruptible(caches: list[Any], stop: threading.Event) -> Iterator[None]:
    """Run the block's passes over ``caches``, stopping between layers once ``stop`` is set.

    Raises ``PrefillInterrupted`` with ``caches`` restored in place to their state before the block.
    """
    saved = [kind_of(c).undo_copy(c) for c in caches]
    hooked = [u for c in caches for u in kind_of(c).updaters(c)]
    for updater in hooked:  # per instance: copies drop it (cache_kinds.clone_layer)
        updater.update_and_fetch = _checked(updater.update_and_fetch, stop)
    try:
        yield
    except PrefillInterrupted:
        caches[:] = saved
        raise
    finally:
        for updater in hooked:
            updater.__dict__.pop("update_and_fetch", None)


def _checked(update: Callable[[mx.array, mx.array], Any], stop: threading.Event) -> Any:
    def update_and_fetch(keys: mx.array, values: mx.array) -> Any:
        mx.eval(keys, values)  # runs every layer before this one
        if stop.is_set():
            raise PrefillInterrupted("the sequence was aborted during this prefill pass")
        return update(keys, values)

    return update_and_fetch
