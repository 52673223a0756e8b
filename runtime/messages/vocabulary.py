"""The shared vocabulary: the ``Message`` base every message derives from, and the value types
messages carry (sampling and its constraints, chat messages and tools, usage, logprobs, model specs,
and the enums naming reuse paths, finish reasons and request kinds), and the one operation on
token ids every layer uses: their common prefix.

``Message`` sets ``tag=True``: a message's wire form is tagged with its bare class name, whatever
module defines it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Final, Literal

import msgspec

TokenIds = tuple[int, ...]


def common_prefix_length(a: Sequence[int], b: Sequence[int], limit: int | None = None) -> int:
    """How many leading tokens ``a`` and ``b`` share (at most ``limit``): what a trimmable cache
    can reuse. By bisection on slice equality, which compares in C: a 2,000-token prompt against
    hundreds of cached prefixes stays cheap."""
    a, b = tuple(a), tuple(b)  # slices of a list and a tuple never compare equal
    low, high = 0, min(len(a), len(b), len(a) if limit is None else limit)
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


class PromptFacts(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What rendering a chat prompt found beside its tokens (``runtime.text.chat.PreparedPrompt``):
    carried with the tokens when a request moves to another replica of its model, so the replica
    it moves to skips tokenizing it again."""

    instructions_tokens: int = 0
    message_ends: TokenIds = ()
    dropped_turns: int = 0
    reasoning_open: bool = False


class Message(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag=True):
    """Base of every message: immutable, strict, tagged with its class name."""


class JsonSchemaConstraint(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag=True
):
    """Generated text must be one JSON value valid under ``schema`` (the schema's JSON text).

    ``strict`` (OpenAI's ``strict: true``) rejects a schema the engine cannot enforce exactly;
    ``strict=False`` lets the engine skip keywords it does not support (e.g. ``format``).
    """

    schema: str
    strict: bool = True


class JsonObjectConstraint(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag=True
):
    """JSON mode (OpenAI's ``{"type": "json_object"}``): any one JSON object."""


class RegexConstraint(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag=True
):
    """Generated text must match ``pattern`` in full (Rust ``regex`` syntax, no look-around)."""

    pattern: str


class GrammarConstraint(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag=True
):
    """Generated text must be a sentence of ``grammar``: llguidance's Lark dialect, or GBNF
    (llama.cpp's format, translated to Lark by the engine)."""

    grammar: str
    syntax: Literal["lark", "gbnf"] = "lark"


# What the generated tokens must spell; prompt tokens are never constrained.
Constraint = JsonSchemaConstraint | JsonObjectConstraint | RegexConstraint | GrammarConstraint


class Sampling(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to pick the next token. ``temperature == 0`` is greedy; every other default is "off".

    Penalties look at the last ``penalty_context`` tokens (prompt and output). ``logprobs`` asks
    for the chosen token's log-probability, ``top_logprobs`` for that many alternatives.
    ``constraint`` restricts the generated text to a JSON Schema, a regex or a grammar (see
    docs/structured.md): disallowed tokens are masked before the other samplers run.
    ``speculative`` caps the tokens drafted per pass (see below); it changes speed, not output.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    top_n_sigma: float = 0.0  # >0: keep tokens within n standard deviations of the max logit
    typical_p: float = 1.0  # <1: locally typical sampling keeps this mass (runtime/text/typical.py)
    xtc_probability: float = 0.0  # exclude-top-choices: chance per step to apply it
    xtc_threshold: float = 0.1
    dry_multiplier: float = 0.0  # >0: "don't repeat yourself" n-gram penalty
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_sequence_breakers: tuple[str, ...] = ("\n", ":", '"', "*")
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_context: int = 64
    logit_bias: dict[int, float] = {}
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    constraint: Constraint | None = None
    # Prompt-lookup speculative decoding: the most tokens drafted per verification pass (0: off;
    # None: the model's ``speculative`` option). Greedy output is unchanged by it and sampled
    # output keeps its distribution (docs/design.md, speculative decoding).
    speculative: int | None = None


Role = Literal["system", "developer", "user", "assistant", "tool"]


class Tool(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A function the model may call: ``parameters`` is its arguments' JSON Schema, as JSON text
    (text keeps the message pure data whatever the schema holds; see runtime/text/tools.py)."""

    name: str
    description: str | None = None
    parameters: str = '{"type": "object", "properties": {}}'


class ToolCall(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One call an assistant message made: ``arguments`` is a JSON object's text."""

    id: str
    name: str
    arguments: str


# Where an image of ``ChatMessage.images`` stands in its ``content`` (one per image, in order).
IMAGE_PLACEHOLDER: Final = "<|image|>"


class ImagePart(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An image of a chat message: the bytes of an image file (PNG, JPEG, WebP, GIF, BMP), as a
    data URL or an allowed local file held them. Decoded on the engine's compute thread."""

    data: bytes
    # Where the client put it, for error messages (the HTTP server: ``messages[0].content[1]``);
    # None: ``messages[i].images[j]``.
    part: str | None = None


# Where a video of ``ChatMessage.videos`` stands in its ``content`` (one per video, in order).
VIDEO_PLACEHOLDER: Final = "<|video|>"


class VideoPart(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A video of a chat message (video-capable vision-language models only), either ``data``:
    a video file's bytes (MP4, MOV, WebM/MKV, AVI), sampled by the engine, or ``frames``: image
    files' bytes already sampled, ``fps`` of them a second (their timestamps). Decoded on the
    engine's compute thread; docs/models.md (video)."""

    data: bytes = b""
    frames: tuple[bytes, ...] = ()
    fps: float = 1.0
    # As ``ImagePart.part``; None: ``messages[i].videos[j]``.
    part: str | None = None

    @classmethod
    def from_file(cls, path: str) -> VideoPart:
        """The video file at ``path`` (read here, in the caller's process)."""
        with open(path, "rb") as file:
            return cls(data=file.read())


class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One chat message as the OpenAI API sends it.

    An assistant message may carry ``tool_calls`` (its ``content`` then may be empty); a ``tool``
    message answers the call named by ``tool_call_id``. ``images`` (vision-language models
    only): each stands where ``content`` holds an ``IMAGE_PLACEHOLDER``, in order; a content
    with none has them all before its text. ``videos`` likewise, at ``VIDEO_PLACEHOLDER``s.
    """

    role: Role
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    images: tuple[ImagePart, ...] = ()
    videos: tuple[VideoPart, ...] = ()


class ChatOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to prepare a chat prompt (see ``runtime.text.chat``).

    ``history_budget_tokens`` turns on the history window (oldest turns dropped to fit it); when
    ``None`` nothing is ever dropped. ``add_generation_prompt=False`` renders the messages as
    complete turns, with no assistant header and no prefill continuation. ``tools`` are rendered
    into the prompt (by the template when it supports them, else a fallback system section);
    ``parallel_tool_calls=False`` tells the model to make at most one call.
    ``template_kwargs``: a JSON object's text whose keys become variables of the model's chat
    template (``{"enable_thinking": false}``), as ``apply_chat_template(**kwargs)`` takes them;
    a model without a template ignores them.
    """

    keep_reasoning: bool = False
    history_budget_tokens: int | None = None
    add_generation_prompt: bool = True
    tools: tuple[Tool, ...] = ()
    parallel_tool_calls: bool = True
    template_kwargs: str | None = None


class Usage(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Token counts of one request, exact on every terminal event. ``max_tokens_clamped_to``:
    the request's ``max_tokens`` was more than the room its prompt left in the context, and the
    engine lowered it to this (``RuntimeConfig.strict_max_tokens`` off); None otherwise.
    ``drafted_tokens`` / ``accepted_tokens``: prompt-lookup drafts its speculative passes verified
    and accepted (``Sampling.speculative``)."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    max_tokens_clamped_to: int | None = None
    drafted_tokens: int = 0
    accepted_tokens: int = 0


class TokenLogprob(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One emitted token's log-probability and the ``top`` alternatives (id, logprob)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class ReusePath(enum.StrEnum):
    """How a sequence's prompt state was obtained from the prefix cache."""

    EXACT = "exact"  # a whole cached entry is a prefix of the prompt
    TRIM = "trim"  # a trimmable entry cut back to the common prefix
    CHECKPOINT = "checkpoint"  # a non-trimmable snapshot whose tokens prefix the prompt
    ADOPTED = "adopted"  # took over an in-flight prewarm of the same session
    MISS = "miss"  # cold prefill


class ReuseTier(enum.StrEnum):
    """Where a sequence's reused prompt state came from (``Started.tier``)."""

    RAM = "ram"  # a prefix entry held in memory (or an adopted prewarm)
    DISK = "disk"  # an entry the disk tier loaded back (docs/design.md, "The disk tier")
    COLD = "cold"  # nothing reused: the whole prompt was prefilled


class FinishReason(enum.StrEnum):
    """Why a sequence stopped normally."""

    STOP = "stop"  # end-of-sequence token or stop string
    LENGTH = "length"  # max_tokens reached
    PREWARMED = "prewarmed"  # a prewarm's state is cached (by itself, or by an identical one)
    ADOPTED = "adopted"  # a prewarm whose work a request that extends it took over


class ModelSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What to load: ``backend`` names a backend kind ("mlx", "llamacpp", "simulated", or
    "auto": chosen at load, ``runtime.backends.choice``).

    ``keep_alive_s``: once no request of the model has run for this long, the router unloads it
    (0: as soon as it is idle; None: never). Unloaded so, it stays known: with
    ``RuntimeConfig.auto_load`` a later request loads it again.

    ``replicas``: how many engines serve it (each its own load, ``NAME@i``, with its own KV and
    prefix cache; on Ray each in a process of its own); the router routes each request to one
    (actors/replicas.py, docs/cluster.md): by ``routing``, "affinity" (sessions sticky, then the
    replica holding the longest prefix of the prompt unless overloaded), or, for comparison,
    "round_robin" or "power_of_two" (the less busy of two drawn replicas).
    """

    name: str
    backend: str = "mlx"
    path: str | None = None
    options: dict[str, str | int | float | bool | None] = {}
    # The most tokens a prefill chunk takes; None: the backend's (256; llama.cpp: n_batch).
    prefill_chunk_tokens: int | None = None
    keep_alive_s: float | None = None
    replicas: int = 1
    routing: str = "affinity"


class RequestKind(enum.StrEnum):
    GENERATE = "generate"
    PREWARM = "prewarm"
