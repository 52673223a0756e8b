"""A draft model: a second, smaller model whose greedy tokens are a sequence's drafts.

Prompt lookup (drafting.py) drafts only where the text copies; a draft model drafts anywhere, at the
price of its own passes. Its drafts are greedy, so each is certain given the history and the
sampler's rule for a certain draft keeps the target's distribution exactly. Its state follows the
sequence's history: a pass feeds it the tokens it lacks, drafts in one lazy graph
(``Backend.draft``), and ``Backend.rewind`` keeps only the accepted drafts. The pair must share its
vocabulary exactly (``check_pair``); its state is priced in the sequence's KV reservation.

See docs/design.md, "Speculative decoding with a draft model".
"""

from __future__ import annotations

from collections.abc import Sequence

from runtime.backends.contract import Backend, BackendLoader, ModelInfo, SequenceState
from runtime.backends.options import EngineOptions, decode_options
from runtime.errors import DraftModelIncompatible
from runtime.messages import ModelSpec

DRAFTS_WITH_MODEL = 8
_CATCH_UP = 512  # a longer catch-up (a prompt) is prefilled in pieces of this many first


class DraftModel:
    """The engine's draft model: its backend, what one of its passes costs against a one-token
    pass of the target (``cost``), and how many sequences hold a state of it (``live``)."""

    def __init__(self, backend: Backend, cost: float) -> None:
        self.backend = backend
        self.cost = cost
        self.live = 0

    def kv_bytes(self, n_tokens: int) -> int:
        """Bytes a draft state of ``n_tokens`` needs (priced like the target's, from its layout)."""
        return self.backend.info.kv_bytes(n_tokens)

    def close(self) -> None:
        self.backend.close()


def close_models(backend: Backend, draft: DraftModel | None) -> None:
    """Close a model and its draft model (on the compute thread, at unload)."""
    backend.close()
    if draft is not None:
        draft.close()


def default_drafts(spec: ModelSpec, options: EngineOptions) -> int:
    """The most drafts a pass takes for a request that does not say: the ``speculative`` option,
    or with a draft model and no such option ``DRAFTS_WITH_MODEL`` (naming one asks for it)."""
    if options.draft_model is not None and "speculative" not in spec.options:
        return DRAFTS_WITH_MODEL
    return options.speculative


def load_draft(
    spec: ModelSpec, options: EngineOptions, load_backend: BackendLoader, target: Backend
) -> DraftModel | None:
    """The draft model ``options`` name for ``spec``'s model (loaded by the same backend kind),
    or None; raises ``DraftModelIncompatible`` (closing the draft) when the pair cannot work."""
    if options.draft_model is None:
        return None
    name, path = f"{spec.name} draft", options.draft_model
    draft_spec = ModelSpec(name=name, backend=spec.backend, path=path)
    draft = load_backend(draft_spec, decode_options(draft_spec))
    try:
        check_pair(spec.name, target, options.draft_model, draft)
    except BaseException:
        draft.close()
        raise
    cost = options.draft_cost
    return DraftModel(draft, default_cost(target.info, draft.info) if cost is None else cost)


def check_pair(name: str, target: Backend, draft_name: str, draft: Backend) -> None:
    """Raise ``DraftModelIncompatible`` naming the first difference that stops ``draft`` from
    drafting for ``target``: a drafted id must mean the same token to both, and the sequence
    must end (and begin) on the same tokens."""
    t, d = target.info, draft.info
    pair = f"draft model {draft_name!r} for {name!r}"
    if not t.verifies or not d.verifies:
        which = name if not t.verifies else draft_name
        raise DraftModelIncompatible(
            f"{pair}: {which!r} runs on a backend with no verification pass; use MLX models"
        )
    if d.window_tokens is not None or d.fixed_state_bytes:
        raise DraftModelIncompatible(
            f"{pair}: the draft has sliding-window or recurrent layers, which cannot be cut back "
            "after its one-token passes; choose a full-attention draft model"
        )
    if t.vocab_size != d.vocab_size:
        raise DraftModelIncompatible(
            f"{pair}: vocabulary sizes differ ({name!r} {t.vocab_size}, draft {d.vocab_size})"
        )
    differ = _first_difference(target.vocabulary(), draft.vocabulary())
    if differ is not None:
        raise DraftModelIncompatible(f"{pair}: the tokenizers differ: {differ}")
    if t.eos_token_ids != d.eos_token_ids:
        raise DraftModelIncompatible(
            f"{pair}: end-of-sequence token ids differ ({name!r} {sorted(t.eos_token_ids)}, "
            f"draft {sorted(d.eos_token_ids)})"
        )
    if target.encode("") != draft.encode(""):
        raise DraftModelIncompatible(
            f"{pair}: begin-of-sequence tokens differ ({name!r} {target.encode('')}, "
            f"draft {draft.encode('')})"
        )


def _first_difference(target: Sequence[str], draft: Sequence[str]) -> str | None:
    for i, (a, b) in enumerate(zip(target, draft, strict=False)):
        if a != b:
            return f"token id {i} is {a!r} in the target and {b!r} in the draft"
    if len(target) != len(draft):
        return f"the target's tokenizer has {len(target)} tokens, the draft's {len(draft)}"
    return None


class DraftSource:
    """One sequence's draft state: a prefix of its history, plus the drafts of an open pass until
    ``settle``. Compute thread only, except ``close`` (once the sequence has ended)."""

    def __init__(self, model: DraftModel) -> None:
        self._model = model
        self._state: SequenceState | None = None
        self._fed = 0  # tokens the open pass fed before its drafts (0: no pass open)
        self._drafted = 0

    @property
    def cost(self) -> float:
        return self._model.cost

    def drafts(self, history: Sequence[int], n: int) -> list[int]:
        """The draft model's ``n`` greedy tokens after ``history``."""
        backend = self._model.backend
        self.settle(0)  # a pass whose drafts were all cut (a grammar) accepted none
        if self._state is None:
            self._state = backend.new_state()
            self._model.live += 1
        behind = list(history[self._state.length :])
        while len(behind) > _CATCH_UP:
            backend.prefill(self._state, behind[:_CATCH_UP], logits=False)
            del behind[:_CATCH_UP]
        drafts = backend.draft(self._state, behind, n)
        self._fed, self._drafted = len(behind), n
        return drafts

    def settle(self, accepted: int) -> None:
        """The target accepted ``accepted`` of the open pass's drafts: the state keeps those (the
        last draft was never fed), so it is again a prefix of the history."""
        if self._fed and self._state is not None:
            keep = self._fed + min(accepted, self._drafted - 1)
            self._fed = 0
            self._model.backend.rewind(self._state, keep)

    def close(self) -> None:
        """Drop the state (the sequence ended): its memory goes with its reservation."""
        if self._state is not None:
            self._state = None
            self._model.live -= 1
        self._fed = 0


def default_cost(target: ModelInfo, draft: ModelInfo) -> float:
    """A draft pass against a target pass: their weight bytes' ratio (1 when unknown)."""
    if target.weight_bytes and draft.weight_bytes:
        return draft.weight_bytes / target.weight_bytes
    return 1.0
