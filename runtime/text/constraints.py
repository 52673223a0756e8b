"""Constrained decoding: a ``Constraint`` (JSON Schema, regex, grammar) made a token mask by
llguidance.

``grammar_of`` compiles a constraint and raises ``InvalidSchema`` / ``InvalidGrammar`` naming the
problem; it needs no tokenizer, so requests are checked at the edge. A ``ConstraintEngine`` belongs
to one loaded model: it imports the tokenizer into llguidance once, on its own worker thread (3 s
for a 262k vocabulary: never on the event loop), and makes one ``TokenMatcher`` per constrained
sequence. A matcher computes the next mask on the worker thread right after a token is accepted
(llguidance releases the GIL), so the mask is ready while the model computes. Each matcher must be
``release``d (``live_matchers`` counts them). See docs/structured.md.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from runtime.errors import (
    ConstraintDeadEnd,
    ConstraintsUnsupported,
    InvalidGrammar,
    InvalidSchema,
)
from runtime.messages import (
    Constraint,
    GrammarConstraint,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
)

if TYPE_CHECKING:  # the engine imports this module for live_matchers: MLX only when masking
    import mlx.core as mx

__all__ = [
    "ConstraintEngine",
    "TokenMatcher",
    "grammar_of",
    "import_grammar_engine",
    "live_matchers",
]

# Compact JSON: a small model left free to add whitespace can pad until max_tokens; a schema may
# still ask for more with llguidance's "x-guidance" options.
_WHITESPACE_FLEXIBLE = False

_live_lock = threading.Lock()
_live_in_process = 0


def live_matchers() -> int:
    """Matchers made and not released yet, over every model in the process (an engine's stats
    gauge ``live_matchers``): 0 whenever no constrained sequence is live."""
    with _live_lock:
        return _live_in_process


def _count_live(change: int) -> None:
    global _live_in_process
    with _live_lock:
        _live_in_process += change


def import_grammar_engine() -> None:
    """Import llguidance, off the event loop: its first import reads package metadata from disk
    (~0.35 s on a loaded CPU), and ``grammar_of`` runs on the loop (``Runtime`` calls this in a
    worker thread as it starts, so the first constrained request finds it imported)."""
    import llguidance  # noqa: F401


def grammar_of(constraint: Constraint) -> str:
    """llguidance grammar text for ``constraint``; raises ``InvalidSchema`` or ``InvalidGrammar``
    with the engine's own words on what is wrong."""
    import llguidance

    matcher = llguidance.LLMatcher
    if isinstance(constraint, JsonSchemaConstraint):
        grammar = matcher.grammar_from_json_schema(
            _schema_object(constraint.schema),
            defaults={
                "whitespace_flexible": _WHITESPACE_FLEXIBLE,
                "lenient": not constraint.strict,
            },
        )
        error = matcher.validate_grammar(grammar, None)
        if error:
            raise InvalidSchema(f"the JSON schema cannot be enforced: {error}")
        return grammar
    if isinstance(constraint, JsonObjectConstraint):
        return matcher.grammar_from_json_schema(
            {"type": "object"}, defaults={"whitespace_flexible": _WHITESPACE_FLEXIBLE}
        )
    if isinstance(constraint, RegexConstraint):
        grammar = matcher.grammar_from_regex(constraint.pattern)
        what = "regex"
    elif isinstance(constraint, GrammarConstraint):
        text = constraint.grammar
        if constraint.syntax == "gbnf":
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                text = gbnf_to_lark(text)
            except Exception as exc:  # the converter raises assorted errors on bad input
                raise InvalidGrammar(f"the GBNF grammar cannot be read: {exc}") from exc
        grammar = matcher.grammar_from_lark(text)
        what = f"{constraint.syntax} grammar"
    else:
        raise InvalidGrammar(f"unknown constraint {type(constraint).__name__}")
    error = matcher.validate_grammar(grammar, None)
    if error:
        raise InvalidGrammar(f"the {what} cannot be enforced: {error}")
    return grammar


def _schema_object(text: str) -> dict[str, Any]:
    try:
        schema = json.loads(text)
    except (json.JSONDecodeError, TypeError) as exc:
        raise InvalidSchema(f"the JSON schema is not valid JSON: {exc}") from exc
    if schema is True:
        return {}
    if not isinstance(schema, dict):
        raise InvalidSchema(
            f"a JSON schema must be an object (or true), got {type(schema).__name__}: "
            'send e.g. {"type": "object", "properties": {...}}'
        )
    return schema


class ConstraintEngine:
    """llguidance over one model's vocabulary: the tokenizer import and the mask worker thread.
    ``close`` stops the worker (after the model's last step)."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Iterable[int]) -> None:
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-masks")
        self._tokenizer: Future[Any] = self._pool.submit(
            _import_tokenizer, hf_tokenizer, sorted(eos_token_ids)
        )

    def matcher(self, constraint: Constraint) -> TokenMatcher:
        """A matcher at the start of ``constraint`` (raises ``InvalidSchema``/``InvalidGrammar``);
        waits for the tokenizer import the first time."""
        import llguidance

        grammar = grammar_of(constraint)
        tokenizer = self._tokenizer.result()
        inner = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if inner.is_error():
            error = (
                InvalidSchema if isinstance(constraint, JsonSchemaConstraint) else InvalidGrammar
            )
            raise error(f"the constraint cannot be enforced: {inner.get_error()}")
        _count_live(+1)
        return TokenMatcher(self, inner, tokenizer.vocab_size)

    def submit(self, work: Any) -> Future[None]:
        return self._pool.submit(work)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _import_tokenizer(hf_tokenizer: Any, eos_token_ids: list[int]) -> Any:
    import llguidance.hf
    from transformers import PreTrainedTokenizerFast

    # mlx-lm wraps the Hugging Face tokenizer; llguidance reads the fast tokenizer's JSON.
    inner = hf_tokenizer
    if not isinstance(inner, PreTrainedTokenizerFast):
        inner = getattr(hf_tokenizer, "_tokenizer", hf_tokenizer)
    if not isinstance(inner, PreTrainedTokenizerFast):
        raise ConstraintsUnsupported(
            "this model's tokenizer has no tokenizer.json (a fast tokenizer), the only kind the "
            "grammar engine reads; drop the constraint or use a model that ships one"
        )
    return llguidance.hf.from_tokenizer(inner, eos_token=eos_token_ids or None)


class TokenMatcher:
    """One sequence's grammar state: which tokens may come next, advanced by each token read.

    Used by one thread at a time (the compute thread; the mask is computed on the engine's worker
    between ``accept`` and the next ``apply``). ``release`` is idempotent.
    """

    def __init__(self, engine: ConstraintEngine, inner: Any, vocab_size: int) -> None:
        self._engine = engine
        self._inner: Any = inner
        self._bits = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)
        self._next_mask: Future[None] | None = None
        self._prefetch()  # the first generated token is masked too

    @property
    def released(self) -> bool:
        return self._inner is None

    def _prefetch(self) -> None:
        inner, bits = self._inner, self._bits
        self._next_mask = self._engine.submit(
            lambda: inner.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        )

    def apply(self, logits: mx.array) -> mx.array:
        """``logits`` (one row) with every token the grammar forbids next set to -inf."""
        import mlx.core as mx

        assert self._next_mask is not None, "apply after release"
        self._next_mask.result()
        words = mx.array(self._bits[0].view(np.uint32))
        # Made here, not at import: MLX arrays belong to the stream of the thread that made them.
        shifts = mx.arange(32, dtype=mx.uint32)
        allowed = ((words[:, None] >> shifts) & 1).reshape(-1).astype(mx.bool_)
        vocab = int(logits.shape[-1])
        if allowed.shape[0] < vocab:  # the model's padding rows are never in the grammar
            allowed = mx.concatenate([allowed, mx.zeros((vocab - allowed.shape[0],), mx.bool_)])
        return mx.where(allowed[:vocab], logits, float("-inf"))

    def accept(self, token: int) -> bool:
        """Advance by ``token``; True when the grammar is complete and allows nothing more (the
        sequence ends as if it read an EOS). Raises ``ConstraintDeadEnd`` if it was not allowed,
        e.g. an EOS the engine offered as the only way out of an error (a limit it reached)."""
        assert self._next_mask is not None, "accept after release"
        self._next_mask.result()  # the worker must be done with the state before it moves
        self._next_mask = None
        inner = self._inner
        if not inner.consume_token(token) or inner.is_error():
            why = inner.get_error() or "the grammar allows nothing here"
            raise ConstraintDeadEnd(
                f"the constraint cannot continue after token {token}: {why}; "
                "simplify the schema or grammar"
            )
        if inner.is_stopped():
            return True
        self._prefetch()
        return False

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens``, in order, the grammar allows from here (the state is left as
        it is): speculative drafts past that are cut before they are verified."""
        assert self._next_mask is not None, "valid_prefix after release"
        self._next_mask.result()  # the worker must be done with the state first
        return int(self._inner.validate_tokens(tokens))

    def release(self) -> None:
        """Drop the grammar state (any mask being computed finishes on the worker first)."""
        if self._inner is None:
            return
        self._inner = None
        self._next_mask = None
        _count_live(-1)
