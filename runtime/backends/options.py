"""The vocabulary of model options: what ``ModelSpec.options`` may say, per backend kind.

``ModelSpec.options`` stays a plain dict on the wire; code reads these typed structs instead.
``Runtime.load_model`` decodes them to refuse a bad spec before anything is admitted; the engine
decodes them once as it starts and loads the backend with that struct (``BackendLoader`` takes it),
so the backend does not decode them again (its ``load`` decodes only when called directly, without
options). Every kind's struct extends ``EngineOptions``, the options the engine reads whatever the
backend, so any one decode checks every name and type a spec carries. A typo, a wrong type or an
unknown backend is an ``InvalidModelSpec`` that names the option and says what is accepted;
``option_from_text`` types command-line text the same way.
"""

from __future__ import annotations

import functools
import os
import types
import typing
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from runtime.errors import InvalidModelSpec
from runtime.messages import ModelSpec

OptionValue = str | int | float | bool | None  # what a ``ModelSpec.options`` value may be

DEFAULT_CHECKPOINT_EVERY = 512
DEFAULT_PREFILL_CHUNK_MS = 10.0
DEFAULT_MAX_BATCH = 8
DEFAULT_DECODE_STALL_MS = 1000.0
DEFAULT_MAX_CONCURRENT = 32
# Prompt-lookup drafts per verification pass at most (Sampling.speculative; 0: off): how many a
# pass takes is chosen from the acceptance rate (actors/engine/drafting.py).
DEFAULT_SPECULATIVE = 0
DEFAULT_LLAMACPP_CONTEXT = 4096
DEFAULT_LLAMACPP_BATCH = 512
# A taken entry's tail given up at most on llama.cpp: a changed last line or question and a short
# reply (why this many: docs/reuse.md, "Taking an entry instead of copying it").
TAKE_TAIL_TOKENS = 32
DEFAULT_CHUNK_TOKENS = 256  # ModelSpec.prefill_chunk_tokens's default, but on llama.cpp

# Ranges, checked where options are decoded: a zero batch or admission gate would admit nothing.
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]

# How a .gguf file's weights are stored once converted (docs/models.md); "auto" picks by device.
WeightFormat = Literal["float32", "bfloat16", "float16", "quantized"]
WeightsOption = Literal["auto", WeightFormat]


class EngineOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options the engine reads, whatever the backend."""

    # The widest snapshot spacing in prefills of non-trimmable caches; cheap snapshots space
    # closer (actors/engine/checkpoints.py). 0: no periodic snapshots.
    checkpoint_every_tokens: NonNegativeInt = DEFAULT_CHECKPOINT_EVERY
    # Time a prefill chunk aims at: a decode-batch step or another request waits about this long
    # behind it (an abort less: a pass gives up between layers). A chunk never takes less than
    # 8 to 16 one-token passes' time, so on most models that floor decides and the 10 ms default
    # only bounds fast ones (actors/engine/chunking.py). 0: every chunk takes
    # ModelSpec.prefill_chunk_tokens, which also caps them.
    prefill_chunk_ms: NonNegativeFloat = DEFAULT_PREFILL_CHUNK_MS
    # How long decoding streams may pause while newcomers whose prompts finish in one chunk
    # prefill ahead of them, so that the next batch step serves those too (actors/engine/turns.py).
    # 0: newcomers' chunks and decode steps always take turns.
    decode_stall_ms: NonNegativeFloat = DEFAULT_DECODE_STALL_MS
    batching: bool = True  # False: every stream stays on the B=1 fast path
    max_batch: PositiveInt = DEFAULT_MAX_BATCH  # most sequences in one decode batch
    max_concurrent: PositiveInt = DEFAULT_MAX_CONCURRENT  # sequences past the admission gate
    # The most prompt-lookup drafts a pass verifies for a request that does not say (0: off).
    speculative: Annotated[int, msgspec.Meta(ge=0, le=64)] = DEFAULT_SPECULATIVE
    # A sequence's prefix lookup rides on its KV reservation: the keeper sends it on once it
    # grants (actors/engine/admission.py). False: the engine asks after the grant (to measure).
    lookup_with_reserve: bool = True
    # A second model (a path or a known name, loaded by the same backend) whose greedy tokens are
    # the drafts instead of prompt lookup; it shares the vocabulary (actors/engine/draft_model.py).
    draft_model: str | None = None
    # What one draft-model pass costs, as a fraction of a one-token pass of this model; None: the
    # ratio of their weight bytes (a decode pass reads every weight once).
    draft_cost: Annotated[float, msgspec.Meta(gt=0)] | None = None

    @property
    def chunk_tokens(self) -> int:
        """A prefill chunk's most tokens where ``ModelSpec.prefill_chunk_tokens`` is None."""
        return DEFAULT_CHUNK_TOKENS


class MlxOptions(EngineOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of an mlx-lm model (``backend="mlx"``)."""

    kv_bits: Literal[4, 8] | None = None  # quantized KV for full-attention layers
    context_length: NonNegativeInt | None = None  # None (or 0): the model's own config decides
    # Only for a .gguf file or a known model: the format they are converted to.
    weights: WeightsOption | None = None
    # A model's first load (no cached verdict): "background" serves at once with every probed
    # capability off and runs the load probe while idle; "at_load" runs it before the model is
    # ready. None: $MLXRT_LOAD_PROBE, else "background" (runtime/backends/mlx/capabilities.py).
    load_probe: Literal["background", "at_load"] | None = None
    # Vision-language models only (docs/models.md, vision): per request, the most images; per
    # image, the most bytes of its file and pixels once decoded (larger ones: invalid_media).
    max_images: Annotated[int, msgspec.Meta(ge=0, le=256)] = 8
    max_image_bytes: PositiveInt = 20 * 1024 * 1024
    max_image_pixels: PositiveInt = 4096 * 4096
    # Video-capable families only (SmolVLM2): the most frames sampled from one video (None: the
    # processor's own ``video_sampling.max_frames``), a video file's most bytes and seconds.
    max_video_frames: Annotated[int, msgspec.Meta(ge=1, le=1024)] | None = None
    max_video_bytes: PositiveInt = 64 * 1024 * 1024
    max_video_seconds: PositiveInt = 3600


class LlamaCppOptions(EngineOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of a GGUF model run by llama.cpp (``backend="llamacpp"``, docs/models.md)."""

    # The most tokens one sequence may hold; None (or 0): the model's training context, at most
    # 4096. Every sequence slot gets this many KV cells, allocated at load.
    context_length: NonNegativeInt | None = None
    # Sequences the llama.cpp context holds at once (n_seq_max); more states are kept by moving
    # the least recently used ones to host memory. None: max_batch + 3.
    max_sequences: Annotated[int, msgspec.Meta(ge=3, le=256)] | None = None
    n_threads: NonNegativeInt = 0  # 0: $OMP_NUM_THREADS (Ray: the engine's CPUs), else every CPU
    n_batch: PositiveInt = DEFAULT_LLAMACPP_BATCH  # tokens in one llama_decode (n_ubatch too)
    # True: a token decoded alone equals the same token inside a prompt, so reusing a reply's
    # KV equals prefilling it (llamacpp/passes.py). Costs a throwaway row per sequence and step:
    # 1.83x a B=1 decode step on SmolLM2 (docs/models.md). False, as in llama-server: the reused
    # output may differ from a cold run's where two tokens nearly tie.
    exact_reuse: bool = False
    # >0: a generate's restore takes a cached entry in place (no copy; it leaves the cache) when
    # at most this many of its tokens lie past the reuse point and no other sequence holds or
    # may still look it up (docs/reuse.md, "Taking an entry instead of copying it"). 0: every
    # restore copies.
    take_tail_tokens: Annotated[int, msgspec.Meta(ge=0, le=4096)] = TAKE_TAIL_TOKENS
    # Tokens a lone stream's decode step may decode back to back on the compute thread before
    # the event loop sees them (Backend.decode_block): fewer loop round trips per token, which
    # on a CPU the model's threads fill cost decode speed; an abort still lands at the next token.
    decode_block: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4

    @property
    def chunk_tokens(self) -> int:
        """One ``llama_decode`` call's tokens: an abort stops a call between graph nodes, so a
        chunk need not be shorter, and a lone prompt prefills fastest in calls this long (a
        1,400-token prompt: 1.00x llama-server's TTFT on SmolLM2 in 512-token chunks, 1.07x in
        256, flash attention on)."""
        return self.n_batch


class SimulatedModelOptions(EngineOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of a simulated model (``backend="simulated"``)."""

    # False: behaves like a hybrid model's caches: the per-token KV still trims, but a recurrent
    # state of ``fixed_state_bytes`` does not, so reuse short of the whole state needs a snapshot.
    trimmable: bool = True
    context_length: int = 4096
    bytes_per_token: int = 1024
    fixed_state_bytes: int = 0
    prefill_s_per_token: float = 0.0
    decode_s_per_token: float = 0.0
    load_s: float = 0.0
    eos_every: int = 0  # >0: the prefix hash emits EOS about once every this many tokens
    fail_load: bool = False
    fail_prefill_call: int = 0  # >0: the n-th prefill call (1-based, per load) raises
    fail_sample_call: int = 0  # >0: the n-th sample call raises
    # True: every join of a decode batch raises, as on a model whose states cannot be merged.
    fail_join: bool = False
    # True: the engine pipelines decode steps as on MLX (Backend.pipelined): a step is built on a
    # token before it is read, and a lone stream's next step is queued behind the running one.
    pipelined: bool = False
    # True: a lone stream's next step is queued behind the running one without pipelining, as on
    # llama.cpp (Backend.queues_steps); ``pipelined`` implies it.
    queue_steps: bool = False
    # >1: a lone stream's decode step reads up to this many tokens (Backend.decode_block; not
    # with ``pipelined``).
    decode_block: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    # >0: the model loads as a first load with no cached probe verdict does on MLX: every probed
    # capability off (no batching, no reuse path) until the engine has run its deferred probe, in
    # this many pieces of ``probe_step_s`` each (``Backend.deferred_probe``).
    probe_steps: NonNegativeInt = 0
    probe_step_s: NonNegativeFloat = 0.0
    # >0: each prefill leaves the backend this many pieces of idle housekeeping, each
    # ``tidy_step_s`` long (Backend.tidy, as llama.cpp's spilling a state ahead of need).
    tidy_pieces: NonNegativeInt = 0
    tidy_step_s: NonNegativeFloat = 0.0
    # >0: the engine takes an entry nobody else holds in place when at most this many of its
    # tokens lie past the reuse point (ModelInfo.take_tail_tokens, as on llama.cpp).
    take_tail_tokens: NonNegativeInt = 0
    # >0: a state that is not trimmable still cuts back, without a snapshot, to a length at most
    # this many tokens short of its own (Backend.copy_state's ``reach``, as a llama.cpp sliding
    # ring that keeps cells past its window).
    reach_back_tokens: NonNegativeInt = 0
    # True: a prefill stopped past one of its snapshot points keeps the state at the last one
    # (PrefillInterrupted.kept, as llama.cpp's sliding-window models do) instead of undoing it.
    interrupt_keeps_snapshots: bool = False


ModelOptions = MlxOptions | LlamaCppOptions | SimulatedModelOptions


def probe_in_background(options: MlxOptions) -> bool:
    """Whether a first load runs its probe in the background (``MlxOptions.load_probe``)."""
    choice = options.load_probe or os.environ.get("MLXRT_LOAD_PROBE") or "background"
    if choice not in ("background", "at_load"):
        raise InvalidModelSpec(
            f"MLXRT_LOAD_PROBE={choice!r} is not a load probe choice: use 'background' or 'at_load'"
        )
    return choice == "background"


OPTIONS_BY_BACKEND: dict[str, type[ModelOptions]] = {
    "mlx": MlxOptions,
    "llamacpp": LlamaCppOptions,
    "simulated": SimulatedModelOptions,
}
BACKEND_KINDS = tuple(OPTIONS_BY_BACKEND)

OptionsT = TypeVar("OptionsT", bound=EngineOptions)


def decode_options(spec: ModelSpec) -> ModelOptions:
    """``spec.options`` as its backend kind's struct; raises ``InvalidModelSpec``."""
    return options_as(spec, options_type(spec))


def options_as(spec: ModelSpec, kind: type[OptionsT]) -> OptionsT:
    """``spec.options`` as ``kind``; raises ``InvalidModelSpec`` naming a bad option."""
    fields = _fields(kind)
    # One option at a time, so that the error names the option (msgspec's names a path).
    values = {
        key: _convert(spec, fields, key, value, strict=True) for key, value in spec.options.items()
    }
    return kind(**values)


def option_from_text(spec: ModelSpec, key: str, text: str) -> OptionValue:
    """A ``KEY=VALUE`` option typed as ``spec``'s backend declares it (``"False"`` is False,
    ``"4"`` is 4, ``"null"`` is None); raises ``InvalidModelSpec`` naming the option."""
    value = _convert(spec, _fields(options_type(spec)), key, text, strict=False)
    return typing.cast(OptionValue, value)  # every option's type is one of OptionValue's


def options_type(spec: ModelSpec) -> type[ModelOptions]:
    """The options struct of ``spec``'s backend kind; raises ``InvalidModelSpec`` for none."""
    kind = OPTIONS_BY_BACKEND.get(spec.backend)
    if kind is None:
        raise InvalidModelSpec(
            f"unknown backend {spec.backend!r} for model {spec.name!r}; use one of {BACKEND_KINDS}"
        )
    return kind


@functools.cache
def _fields(kind: type[EngineOptions]) -> dict[str, Any]:
    return {f.name: f.type for f in msgspec.structs.fields(kind)}


def _convert(
    spec: ModelSpec, fields: dict[str, Any], key: str, value: object, *, strict: bool
) -> Any:
    if key not in fields:
        raise InvalidModelSpec(
            f"unknown option {key!r} for model {spec.name!r} (backend {spec.backend!r}); "
            f"known: {', '.join(sorted(fields))}"
        )
    try:
        return msgspec.convert(value, fields[key], strict=strict)
    except msgspec.ValidationError:
        raise InvalidModelSpec(
            f"option {key!r} of model {spec.name!r} (backend {spec.backend!r}) must be "
            f"{accepted(fields[key])} (got {value!r})"
        ) from None


def accepted(annotation: Any) -> str:
    """What a value of this option type may be, said to a person ("4 or 8, or null")."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        base, *metas = typing.get_args(annotation)
        bounds = [
            f"{sign} {getattr(meta, field)}"
            for meta in metas
            for field, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
            if getattr(meta, field, None) is not None
        ]
        return " ".join([accepted(base), *bounds])
    if origin is Literal:
        choices = [repr(arg) for arg in typing.get_args(annotation)]
        return " or ".join(choices) if len(choices) < 3 else f"one of {', '.join(choices)}"
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        said = ", or ".join(accepted(arg) for arg in args if arg is not type(None))
        return f"{said}, or null" if type(None) in args else said
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))
