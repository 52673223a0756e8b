"""Every architecture mlx-lm ships, through the Runtime on the real MLX backend (issue 20).

For each tiny build of ``runtime.testing.arch_models`` (one Runtime per architecture, shared by
its cases): the cold greedy output equals raw mlx-lm's; then, in the same namespace, each reuse
case (extend, exact repeat, backspace, an edit in the middle, divergence after a long shared
prefix, chat turn 2) equals raw mlx-lm's output of its prompt and restores exactly the tokens
``ReuseOracle`` predicts (``Started.cached_tokens`` and the engine's ``prefilled_tokens``
counter); four concurrent fresh streams (decoded in one batch) and four that extend the cached
prompt (prefilled in one batched pass) each equal their prompt alone; a prefill cancelled midway
then rerun equals it too and resumes where it stopped. Outputs are compared only over the steps
whose top-2 logit margin is clear (``arch_oracle.MARGIN``), so rounding never decides a test.

Select with ``-m architectures``. ``MLXRT_ARCH_REPORT=path.json`` also writes what each case did
and each model's facts, from which ``python -m runtime.testing.arch_report`` writes the
"Architectures" table of docs/models.md. Known defects are ``KNOWN_FAILURES`` (strict xfail).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

import anyio
import anyio.from_thread
import msgspec
import pytest

from actors.engine.checkpoints import CheckpointPolicy
from runtime.backends.mlx.backend import MlxBackend
from runtime.backends.options import DEFAULT_CHECKPOINT_EVERY
from runtime.errors import UnsupportedCache
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import (
    Cancelled,
    ModelLoaded,
    ModelSpec,
)
from runtime.testing.arch_harness import (
    CANCELLED,
    CHUNK,
    CONCURRENT,
    MAX_TOKENS,
    REUSE_CASES,
    SPACING,
    TAILS,
    ArchModel,
    References,
    cancel_mid_prefill,
    case_prompt,
    prompt_tokens,
    run_concurrently,
)
from runtime.testing.arch_models import (
    UNBUILDABLE,
    arch_model_path,
    buildable_architectures,
    mlx_lm_architectures,
)
from runtime.testing.arch_oracle import cache_kinds
from runtime.testing.harness import engine_stats

pytestmark = [
    pytest.mark.architectures,
    pytest.mark.mlx,
    # transformers warns about the tiny configs' fields as it reads them with the tokenizer.
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

ARCHITECTURES = buildable_architectures()
CONFIG = RuntimeConfig(kv_budget_bytes=1 << 30)  # nothing is evicted or refused here

# Known defects, each naming what breaks (issue 20): strict xfails, so a fix that makes one pass
# fails the run until its entry goes. The whole architecture: every request fails (or the load).
# Refused at load, by design: the architecture keeps its cache in a class no adapter covers
# (runtime/backends/mlx/cache_kinds), so it is refused with a sentence naming the class and the
# architecture, never at a request. Architecture -> the class the refusal names.
REFUSED_AT_LOAD: dict[str, str] = {"deepseek_v41": "LayerCache"}
BROKEN_ARCHITECTURES: dict[str, str] = {}
# (architecture, case) -> the defect. Empty: the load probe switches off, per model, what mlx-lm
# gets wrong (gemma2, gpt_bigcode, afm7 and nemotron-nas decode one at a time; the recurrent,
# hybrid and n-gram models prefill one at a time); the Probe column of the table says what and why.
KNOWN_FAILURES: dict[tuple[str, str], str] = {}


def known_failure(arch: str, case: str) -> str | None:
    return KNOWN_FAILURES.get((arch, case)) or BROKEN_ARCHITECTURES.get(arch)


# ---------------------------------------------------------------------- results for the report

RESULTS: dict[str, dict[str, Any]] = {}


@contextlib.contextmanager
def recorded(arch: str, case: str) -> Iterator[None]:
    """Note what ``case`` did on ``arch`` (for ``MLXRT_ARCH_REPORT``), then let it fail."""
    cases = RESULTS.setdefault(arch, {}).setdefault("cases", {})
    try:
        yield
    except BaseException as exc:
        leaf = exc
        while isinstance(leaf, BaseExceptionGroup):  # a task group's: its first error says why
            leaf = leaf.exceptions[0]
        cases[case] = f"fail: {type(leaf).__name__}: {str(leaf).splitlines()[0][:400]}"
        raise
    cases[case] = "pass"


@pytest.fixture(scope="module", autouse=True)
def write_report() -> Iterator[None]:
    yield
    path = os.environ.get("MLXRT_ARCH_REPORT")
    if path:
        with open(path, "w", encoding="utf-8") as out:
            json.dump({"unbuildable": UNBUILDABLE, "architectures": RESULTS}, out, indent=1)


def default_load_facts(spec: ModelSpec) -> dict[str, Any]:
    """The periodic checkpoint spacing of ``spec``'s model under the default options, and what
    its load probe cost when it ran (the engine does not report its ``ModelInfo``, so a backend
    of its own is loaded; the probe's verdict is cached by then, so this load runs none)."""
    backend = MlxBackend.load(msgspec.structs.replace(spec, options={}))
    try:
        policy = CheckpointPolicy(DEFAULT_CHECKPOINT_EVERY, CONFIG.kv_budget_bytes)
        return {
            "checkpoint_spacing": policy.spacing(backend.info),
            "probe_s": round(backend.info.probe_s, 3),
        }
    finally:
        backend.close()


def model_facts(model: ArchModel) -> dict[str, Any]:
    """What the docs table says of a model beside its cases: its reuse path and the capabilities
    its load probe switched off, each with why (the engine's ``limits``)."""
    stats = engine_stats(model.rt, model.loaded)
    return {"reuse_path": model.loaded.reuse_path, "limits": dict(stats.limits)}


@pytest.fixture(scope="module", params=ARCHITECTURES)
def model(request: pytest.FixtureRequest) -> Iterator[ArchModel]:
    from mlx_lm import load

    arch: str = request.param
    path = arch_model_path(arch)
    spec = ModelSpec(
        name=arch,
        backend="mlx",
        path=str(path),
        prefill_chunk_tokens=CHUNK,
        options={"checkpoint_every_tokens": SPACING, "prefill_chunk_ms": 0},
    )
    raw, tokenizer = load(str(path))[:2]
    references = References.compute(raw)
    facts: dict[str, Any] = {"cache_kinds": cache_kinds(raw), "clear_steps": references.clear}
    del raw  # the Runtime loads its own
    if os.environ.get("MLXRT_ARCH_REPORT"):
        with contextlib.suppress(Exception):  # a model that does not load says so below
            facts.update(default_load_facts(spec))
    with contextlib.ExitStack() as stack:
        portal = stack.enter_context(anyio.from_thread.start_blocking_portal("asyncio"))
        rt = stack.enter_context(portal.wrap_async_context_manager(Runtime(CONFIG)))
        loaded: ModelLoaded | str
        try:
            loaded = portal.call(rt.load_model, spec)
        except Exception as exc:  # every case that needs the Runtime fails with it
            loaded = RESULTS.setdefault(arch, {})["load"] = f"{type(exc).__name__}: {exc}"
        built = ArchModel(arch, portal, rt, loaded, references, tokenizer)
        if not isinstance(loaded, str):
            facts.update(model_facts(built))
        RESULTS.setdefault(arch, {})["facts"] = facts
        yield built


def expect_failure(request: pytest.FixtureRequest, arch: str, case: str) -> None:
    if arch in REFUSED_AT_LOAD:
        pytest.skip(f"{arch} is refused at load (test_refused_at_load_with_a_sentence)")
    reason = known_failure(arch, case)
    if reason is not None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))


# ---------------------------------------------------------------------- the matrix


def test_every_architecture_is_built_or_listed() -> None:
    """A module mlx-lm adds is built by the matrix or listed with a reason; the list is current."""
    shipped = set(mlx_lm_architectures())
    assert set(UNBUILDABLE) <= shipped, "UNBUILDABLE names a module mlx-lm no longer ships"
    assert set(ARCHITECTURES) | set(UNBUILDABLE) == shipped
    assert len(ARCHITECTURES) >= 100


@pytest.mark.parametrize(("arch", "cache_class"), sorted(REFUSED_AT_LOAD.items()))
def test_refused_at_load_with_a_sentence(arch: str, cache_class: str) -> None:
    """A cache class without an adapter is refused by the load, naming the class, the
    architecture and what to do, and the Runtime stays usable."""

    async def scenario() -> None:
        spec = ModelSpec(name=arch, backend="mlx", path=str(arch_model_path(arch)))
        async with Runtime(CONFIG) as rt:
            with pytest.raises(UnsupportedCache) as refused:
                await rt.load_model(spec)
            assert refused.value.code == "unsupported_cache"
            message = str(refused.value)
            assert cache_class in message and repr(arch) in message and "adapter" in message

    anyio.run(scenario)


def test_cold_equals_mlx_lm(model: ArchModel, request: pytest.FixtureRequest) -> None:
    expect_failure(request, model.arch, "cold")
    with recorded(model.arch, "cold"):
        expected = model.reference(model.base)
        # Rarely undecided: a prompt whose first steps tie would test nothing.
        assert expected.clear_steps >= MAX_TOKENS // 2, f"margins {expected.margins}"

        async def scenario() -> None:
            model.walk = None  # this case starts the walk
            *_, cold = await model.walked()
            assert (str(cold.started.path), cold.prefilled) == ("miss", len(model.base))

        model.portal.call(scenario)


def test_margins_decide_most_steps(model: ArchModel) -> None:
    """Steps whose top-2 logits lie too close to call are not compared: they must stay rare, or
    the matrix would test little on this model."""
    assert model.reference.clear >= 0.75


@pytest.mark.parametrize("case", REUSE_CASES)
def test_reuse_equals_cold(model: ArchModel, case: str, request: pytest.FixtureRequest) -> None:
    expect_failure(request, model.arch, case)
    with recorded(model.arch, case):

        async def scenario() -> None:
            namespace, oracle, _ = await model.walked()
            answer = model.reference(model.base).tokens  # the prompt its reference was made for
            await model.expect(case_prompt(case, model.base, answer), namespace, oracle)

        model.portal.call(scenario)


def test_concurrent_streams_equal_each_alone(
    model: ArchModel, request: pytest.FixtureRequest
) -> None:
    """Four fresh prompts of 180-300 tokens at once: each prefilled alone (longer than a chunk),
    then decoded in one batch; each equals its prompt alone."""
    expect_failure(request, model.arch, "concurrent")
    prompts = CONCURRENT
    with recorded(model.arch, "concurrent"):
        joins = model.counter("batch_joins")
        runs = model.portal.call(run_concurrently, model, prompts, model.namespace())
        note(model, batch_joins=model.counter("batch_joins") - joins)
        for index, prompt in enumerate(prompts):
            expected = model.reference(prompt)
            assert expected.agree(runs[index].tokens), f"stream {index}: {runs[index].tokens}"


def test_concurrent_prefill_together(model: ArchModel, request: pytest.FixtureRequest) -> None:
    """Four prompts that extend one cached prompt by 6-30 tokens at once: their rests are
    prefilled in one left-padded batched pass where the engine batches; each equals it alone
    and restores what the oracle says."""
    expect_failure(request, model.arch, "together")
    with recorded(model.arch, "together"):
        namespace, oracle, _ = model.portal.call(model.walked)
        prompts = [model.base + prompt_tokens(n, seed=30 + n) for n in TAILS]
        together, prefilled = model.counter("prefills_together"), model.counter("prefilled_tokens")
        runs = model.portal.call(run_concurrently, model, prompts, namespace)
        note(model, prefills_together=model.counter("prefills_together") - together)
        reused = [oracle.reusable(prompt)[0] for prompt in prompts]
        assert [runs[i].started.cached_tokens for i in range(len(prompts))] == reused
        rests = sum(len(prompt) - n for prompt, n in zip(prompts, reused, strict=True))
        assert model.counter("prefilled_tokens") - prefilled == rests
        for index, prompt in enumerate(prompts):
            expected = model.reference(prompt)
            assert expected.agree(runs[index].tokens), f"stream {index}: {runs[index].tokens}"


def note(model: ArchModel, **facts: int) -> None:
    RESULTS.setdefault(model.arch, {}).setdefault("facts", {}).update(facts)


def test_cancel_mid_prefill_then_rerun(model: ArchModel, request: pytest.FixtureRequest) -> None:
    expect_failure(request, model.arch, "cancel")
    prompt = CANCELLED
    with recorded(model.arch, "cancel"):

        async def scenario() -> None:
            namespace, oracle = model.namespace(), model.oracle()
            before = model.counter("prefilled_tokens")
            progressed = lambda: model.counter("prefilled_tokens") - before >= 2 * CHUNK  # noqa: E731
            terminal = await cancel_mid_prefill(model.rt, model.arch, prompt, namespace, progressed)
            assert isinstance(terminal, Cancelled), f"ended {terminal}"[:300]
            stopped_at = model.counter("prefilled_tokens") - before
            assert 2 * CHUNK <= stopped_at < len(prompt), "the cancel missed the prefill"
            oracle.aborted(prompt, 0, stopped_at)
            rerun = await model.expect(prompt, namespace, oracle)
            assert rerun.started.cached_tokens == stopped_at

        model.portal.call(scenario)
