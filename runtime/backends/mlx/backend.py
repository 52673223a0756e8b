"""The real backend: an mlx-lm model and its per-layer caches, run on the engine's compute thread.

Loading never downloads: ``ModelSpec.path`` is a local mlx-lm model directory, or a Hugging Face
repo id that is already in the local cache. At load the backend runs one tiny prompt (the load
probe's first, so a probe need not run it again), which warms the weights and lets it measure the
cache layout (bytes per token, windows, fixed recurrent state) from real arrays instead of
trusting config fields that differ between architectures."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import cache as mlx_cache

from runtime.backends.contract import (
    CannotTrim,
    DecodeBatchHandle,
    DeferredProbe,
    ModelInfo,
    PrefillInterrupted,
    SequenceState,
    Snapshot,
)
from runtime.backends.disk.host import HostState
from runtime.backends.mlx import persist
from runtime.backends.mlx.batch import DecodeBatch
from runtime.backends.mlx.cache_kinds import check_supported, kind_of, price_of, snapshot_layers
from runtime.backends.mlx.capabilities import limit_by_probe
from runtime.backends.mlx.facts import (
    context_length_of,
    effective_eos_ids,
    loading_info,
    quantization_group,
    reuse_strategy,
    vocab_size_of,
    widen_half_quantized,
)
from runtime.backends.mlx.interrupt import can_interrupt, interruptible, stop_checks
from runtime.backends.mlx.loading import load_directory
from runtime.backends.mlx.probe import plain_run, probe_prompts
from runtime.backends.mlx.state import MlxSnapshot, MlxState, check_points, own_state
from runtime.backends.mlx.together import prefill_together, together_snapshot_tokens
from runtime.backends.mlx.upstream import patch_model
from runtime.backends.mlx.verify import draft_pass, rewind_pass, verify_pass
from runtime.backends.model_source import prepare_model
from runtime.backends.options import MlxOptions, options_as
from runtime.backends.vision.bidirectional import check_passes
from runtime.backends.vision.load import VisionMedia
from runtime.backends.vision.media import refuse_media
from runtime.blas import warn_if_slow
from runtime.errors import ModelLoadFailed
from runtime.messages import ChatMessage, ModelSpec
from runtime.text.chat import has_chat_template
from runtime.text.constraints import ConstraintEngine

_TIMED_PASSES = 8  # the fastest of these is the fixed cost of a pass (noise only adds to it)
# A prefill that keeps logits runs its last token as a pass of its own from this many tokens on:
# one more pass then costs less than projecting the other positions onto the vocabulary
# (measured on CPU, float32: from ~32-64 tokens on Gemma 3 270M's 262k vocabulary, ~128 on
# SmolLM2's 49k; mlx-lm's generate always runs the last prompt token apart).
_LAST_TOKEN_APART = 64
log = logging.getLogger("mlx_actor_runtime.mlx_backend")


class MlxBackend:
    """The backend contract (``runtime.backends.contract``) over mlx-lm, on one compute thread."""

    def __init__(self, model: Any, tokenizer: Any, info: ModelInfo, kv_bits: int | None) -> None:
        self._model = model
        self._tokenizer = tokenizer
        self._info = info
        self._kv_bits = kv_bits
        self._path = Path(".")
        self._kv_group = quantization_group(model) if kv_bits is not None else 64
        self.reach_back = False  # whether snapshots reach inside a pass (set at load)
        # Set at load where trimming proved wrong: snapshots then copy every layer (probe.py).
        self.whole_snapshots = False
        self.batch_decode = True  # whether the probe found batched decoding exact (set at load)
        self._constraints: ConstraintEngine | None = None  # made for the first constrained row
        self._deferred: DeferredProbe | None = None  # the load probe, where left for later
        self._media: VisionMedia | None = None  # a vision-language model's images (vision/)

    # ------------------------------------------------------------------ loading

    @classmethod
    def load(
        cls, spec: ModelSpec, options: MlxOptions | None = None, *, defer_probe: bool = False
    ) -> MlxBackend:
        """Load ``spec.path`` with its decoded ``options`` (decoded here when not given, as for a
        direct call); raises ``InvalidModelSpec`` (bad options) or ``ModelLoadFailed`` naming
        what is missing. ``defer_probe``: a probe with no cached verdict is left for the engine
        (``deferred_probe``) rather than run now."""
        if options is None:
            options = options_as(spec, MlxOptions)
        warn_if_slow()
        prepared = prepare_model(spec, options=options)
        path = prepared.path
        if prepared.note:
            log.info("model %r: %s", spec.name, prepared.note)
        model, tokenizer, config, media = load_directory(path, options)
        if mx.default_device() == mx.cpu and widen_half_quantized(model):
            log.info(
                "model %r: quantized with half-precision scales; widened them (and the other "
                "half-precision weights) to float32, which MLX's CPU kernels run ~40x faster",
                spec.name,
            )
        for applied in patch_model(model):
            log.info("model %r: worked around an mlx-lm defect: %s", spec.name, applied)
        backend = cls(model, tokenizer, loading_info(), options.kv_bits)
        backend._path = path
        backend._media = media
        # Refused here, not at a request: a cache class with no adapter cannot be served.
        check_supported(backend.new_state().caches, config.get("model_type"))
        try:
            backend._info = backend._measure(spec.name, options, config, defer_probe)
        except (ValueError, TypeError) as exc:  # e.g. an architecture the options do not fit
            raise ModelLoadFailed(f"the model at {path} failed its warm-up pass: {exc}") from exc
        return backend

    def _measure(
        self, name: str, options: MlxOptions, config: dict[str, Any], defer_probe: bool
    ) -> ModelInfo:
        """Run a tiny forward pass and read the cache layout off the real arrays."""
        # The warm-up pass (it also loads the weights: the timing follows) is the load probe's
        # plain run of its first prompt, which the probe then need not run again.
        first = plain_run(self, probe_prompts(vocab_size_of(config))[0])
        price = price_of(first.caches)
        strategy, reason = reuse_strategy(first.caches)
        self.reach_back = all(kind_of(c).reaches_back(c) for c in first.caches)
        state = self.copy_state(first, first.n_tokens)  # the timed passes leave ``first`` as run
        pass_s = min(self._timed_pass(state) for _ in range(_TIMED_PASSES))  # layout read first
        context = options.context_length or context_length_of(config)
        eos = effective_eos_ids(self._tokenizer, self._path, config)
        log.debug(  # the load's info line is the router's (actors/model_lifecycle.py)
            "model %r: context %d tokens, generation ends on token ids %s (%s)",
            name,
            context,
            sorted(eos),
            ", ".join(repr(self._tokenizer.decode([t])) for t in sorted(eos)),
        )
        templated = has_chat_template(self._tokenizer)
        if not templated:
            log.info(
                "model %r has no chat template: chat messages get the plain 'role: content' "
                "fallback format (docs/chat.md); a base model continues a raw prompt better",
                name,
            )
        self._info = ModelInfo(
            context_length=context,
            vocab_size=vocab_size_of(config),
            eos_token_ids=eos,
            reuse=strategy,
            reuse_reason=reason,
            bytes_per_token=price.per_token,
            window_tokens=price.window,
            window_bytes_per_token=price.window_per_token,
            fixed_state_bytes=price.fixed,
            alloc_step=mlx_cache.KVCache.step,
            pass_s=pass_s,
            stop_checks=stop_checks(state.caches),
            together_snapshot_tokens=together_snapshot_tokens(
                state.caches, context, self.reach_back
            ),
            chat_template=templated,
            weight_bytes=weight_bytes(self._model),
        )
        info, self._deferred = limit_by_probe(self, name, state.caches, first, defer=defer_probe)
        return info

    def _timed_pass(self, state: MlxState) -> float:
        start = time.perf_counter()
        self.prefill(state, [0], logits=False)
        return time.perf_counter() - start

    @property
    def info(self) -> ModelInfo:
        return self._info

    @info.setter
    def info(self, info: ModelInfo) -> None:
        self._info = info  # a deferred probe's piece runs with the info as measured

    @property
    def path(self) -> Path:
        """The model directory it was loaded from."""
        return self._path

    @property
    def kv_bits(self) -> int | None:
        return self._kv_bits

    # ------------------------------------------------------------------ tokens

    @property
    def chat_tokenizer(self) -> Any:
        if self._media is not None:  # images' keyed markers become their spans
            return self._media.chat_tokenizer
        return self._tokenizer  # mlx-lm's wrapper: encode() and the model's chat template

    def prepare_media(self, messages: tuple[ChatMessage, ...]) -> tuple[ChatMessage, ...]:
        if self._media is None:
            refuse_media(messages, "this model is text-only")
            return messages
        return self._media.prepare(messages)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text))

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(token_ids)))

    # ------------------------------------------------------------------ states

    def new_state(self) -> MlxState:
        caches = mlx_cache.make_prompt_cache(self._model)
        if self._kv_bits is not None:
            caches = [
                mlx_cache.QuantizedKVCache(group_size=self._kv_group, bits=self._kv_bits)
                if type(c) is mlx_cache.KVCache
                else c
                for c in caches
            ]
        return MlxState(caches)

    def can_trim(self, state: SequenceState) -> bool:
        """Whether every layer of ``state`` can be cut back (a rotating cache until it wraps)."""
        return not self.whole_snapshots and all(
            kind_of(c).trimmable(c) for c in own_state(state).caches
        )

    def copy_state(  # ``reach`` unused: an MLX ring holds no more than its window (rotating.py)
        self, state: SequenceState, length: int, snapshot: Snapshot | None = None, *, reach: int = 0
    ) -> MlxState:
        source = own_state(state)
        if not 0 <= length <= source.n_tokens:
            raise CannotTrim(f"cannot copy {length} tokens of a {source.n_tokens}-token state")
        drop = source.n_tokens - length
        logits = source.logits if drop == 0 else None
        if snapshot is not None:
            if not isinstance(snapshot, MlxSnapshot) or snapshot.n_tokens != length:
                raise CannotTrim(f"the snapshot does not hold {length} tokens of this state")
            caches = [
                kind_of(c).restore(c, snapshot.layers.get(i), drop)
                for i, c in enumerate(source.caches)
            ]
            return MlxState(caches, length, logits)
        if drop and not self.can_trim(source):
            raise CannotTrim(
                "a layer of this cache cannot be trimmed (sliding window or recurrent)"
            )
        return MlxState([kind_of(c).copy(c, drop) for c in source.caches], length, logits)

    take_state = copy_state  # never asked: take_tail_tokens is 0 here (docs/reuse.md)

    def snapshot(self, state: SequenceState) -> MlxSnapshot:
        """Copy the sliding-window and recurrent layers; full-attention KV is trimmed later."""
        snapshot = self._snapshot(own_state(state), 0)
        mx.eval(snapshot.arrays())
        return snapshot

    def _snapshot(self, source: MlxState, back: int) -> MlxSnapshot:
        layers = snapshot_layers(dict(enumerate(source.caches)), back, whole=self.whole_snapshots)
        return MlxSnapshot(layers, source.n_tokens - back)

    def prefill(
        self,
        state: SequenceState,
        token_ids: Sequence[int],
        *,
        logits: bool = True,
        snapshot_at: Sequence[int] = (),
        stop: threading.Event | None = None,
    ) -> list[MlxSnapshot]:
        own = own_state(state)
        if not token_ids:
            return []
        ids, start = list(token_ids), own.n_tokens
        end = start + len(ids)
        check_points(snapshot_at, start, end)
        if self._media is not None:  # the vision tower, an image at a time, stoppable between
            self._media.store.encode(ids, stop)
        # Passes end where a snapshot cannot reach back from further on (a recurrent state holds
        # only its last step), and before the last token of a long pass that keeps logits.
        cuts = set() if self.reach_back else set(snapshot_at)
        if logits and len(ids) >= _LAST_TOKEN_APART:
            cuts.add(end - 1)
        stops = [*sorted(c for c in cuts if start < c < end), end]
        check_passes(self._model, ids, [s - start for s in stops])
        if stop is None or not can_interrupt(own.caches, stops[0] - start):
            return self._passes(own, ids, stops, logits, snapshot_at)
        before = own.logits
        try:
            with interruptible(own.caches, stop):
                return self._passes(own, ids, stops, logits, snapshot_at)
        except PrefillInterrupted:
            own.n_tokens, own.logits = start, before
            raise

    def _passes(
        self,
        own: MlxState,
        ids: list[int],
        stops: list[int],
        logits: bool,
        snapshot_at: Sequence[int],
    ) -> list[MlxSnapshot]:
        """One model call per stretch of ``ids`` ending at each of ``stops``, evaluated once."""
        start = own.n_tokens
        snapshots: list[MlxSnapshot] = []
        out: mx.array | None = None
        for until in stops:
            piece = mx.array([ids[own.n_tokens - start : until - start]])
            out = self._model(piece, cache=own.caches)
            passed, own.n_tokens = own.n_tokens, until
            snapshots += [
                self._snapshot(own, until - p) for p in snapshot_at if passed < p <= until
            ]
        assert out is not None
        own.logits = out[0, -1].astype(mx.float32) if logits else None
        # One evaluation for every pass: the snapshots' slices of earlier rings are computed
        # with the rest (a pass's projection onto the vocabulary only where logits are kept).
        kept = [s.arrays() for s in snapshots]
        mx.eval([c.state for c in own.caches], kept, [] if own.logits is None else own.logits)
        return snapshots

    def prefill_together(
        self,
        states: Sequence[SequenceState],
        token_ids: Sequence[Sequence[int]],
        snapshot_at: Sequence[Sequence[int]] = (),
    ) -> list[list[MlxSnapshot]]:
        owns = [own_state(state) for state in states]
        points = list(snapshot_at) or [[] for _ in token_ids]
        if len(points) != len(token_ids):
            raise ValueError("snapshot_at takes one list of points per state")
        reach = self._info.together_snapshot_tokens
        for own, ids, at in zip(owns, token_ids, points, strict=True):
            start, end = own.n_tokens, own.n_tokens + len(ids)
            if at and end > reach:
                raise ValueError(
                    f"cannot snapshot inside a {end}-token prompt prefilled together "
                    f"(at most {reach})"
                )
            check_points(at, start, end)
            check_passes(self._model, ids, [*(p - start for p in at), len(ids) - 1])  # passes' ends
        return prefill_together(
            self._model, owns, token_ids, points, self.reach_back, self.whole_snapshots
        )

    def logits(self, state: SequenceState) -> mx.array:
        own = own_state(state)
        if own.logits is None:
            raise RuntimeError("logits() before any prefill")
        return own.logits

    def verify(self, state: SequenceState, token_ids: Sequence[int]) -> mx.array:
        return verify_pass(self._model, own_state(state), token_ids)

    def draft(self, state: SequenceState, token_ids: Sequence[int], n: int) -> list[int]:
        return draft_pass(self._model, own_state(state), token_ids, n)

    def vocabulary(self) -> list[str]:
        by_id = {i: t for t, i in self._tokenizer.get_vocab().items()}
        return [by_id.get(i, "") for i in range(max(by_id, default=-1) + 1)]

    def rewind(self, state: SequenceState, keep: int) -> None:
        rewind_pass(self._model, own_state(state), keep, cut=not self.whole_snapshots)

    @property
    def pipelined(self) -> bool:
        return True

    @property
    def queues_steps(self) -> bool:
        return True

    @property
    def decode_block(self) -> int:
        return 1  # pipelined: the next step is built before a token is read instead

    def feed(self, state: SequenceState, token: mx.array) -> mx.array:
        """One decode step on an unread token: the graph only; whoever reads the logits (or a
        draw made from them) evaluates it, after the step in flight, like mlx-lm's pipeline."""
        own = own_state(state)
        logits = self._model(token.astype(mx.int32).reshape(1, 1), cache=own.caches)
        own.logits = logits[0, -1].astype(mx.float32)
        own.n_tokens += 1
        return own.logits

    @property
    def model(self) -> Any:
        """The mlx-lm model, for the decode batch that runs it over many sequences."""
        return self._model

    def open_batch(self) -> DecodeBatchHandle | None:
        return DecodeBatch(self) if self.batch_decode and DecodeBatch.supports(self) else None

    def state_nbytes(self, state: SequenceState) -> int:
        return sum(kind_of(c).nbytes(c) for c in own_state(state).caches)

    # ------------------------------------------------------------------ the disk tier (persist.py)

    def fingerprint(self) -> str:
        return persist.fingerprint(self._path, self._model, self._kv_bits)

    def export_state(self, state: SequenceState, points: Mapping[int, Snapshot]) -> HostState:
        return persist.export_state(state, points)

    def import_state(self, host: HostState) -> tuple[MlxState, dict[int, MlxSnapshot]]:
        return persist.import_state(host)

    def constraint_engine(self) -> ConstraintEngine:
        if self._constraints is None:
            self._constraints = ConstraintEngine(self._tokenizer, self._info.eos_token_ids)
        return self._constraints

    def deferred_probe(self) -> DeferredProbe | None:
        deferred, self._deferred = self._deferred, None
        return deferred

    def tidy(self) -> bool:
        return False  # MLX arrays need no slots: nothing to do ahead of a request

    def close(self) -> None:
        """Drop the model (its weights go by reference count, no ``gc.collect()``: that holds
        the GIL over the host's whole heap, stalling its event loop) and return MLX's cached
        buffers. The thread's MLX streams are left to the thread's owner to clear
        (``runtime.kernel.actor.release_thread_resources``)."""
        if self._constraints is not None:
            self._constraints.close()
            self._constraints = None
        self._model = None
        self._tokenizer = None
        mx.clear_cache()


def weight_bytes(model: Any) -> int:
    """Bytes of a model's parameters."""
    leaves = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    return sum(array.nbytes for _, array in leaves)
