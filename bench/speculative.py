"""The speculative group (``--scenarios speculative``): decode tok/s of the runtime with prompt-
lookup speculation (system ``runtime``) and without (``runtime-nospec``), of raw mlx-lm
(``generate_step``) and of ``mlx_lm.server`` (over HTTP; it speculates only with a draft model, so
here it decodes plainly), on workloads that copy from their prompt and on free chat.

Decode tok/s is measured from the first token to the last (prefill excluded), greedy, the same
chat-templated prompt for every system, the in-process systems interleaved rep by rep (best of
the reps: the machine is shared); the runtime's greedy text must equal its text without
speculation (said in the row's note). Rows: ``speculative.<workload>.tok_s`` per system (the
free-chat one contains ``chat``) and ``speculative.<workload>.acceptance`` (accepted / drafted).
``python -m bench.speculative [model] [max_tokens] [reps] [workload,...]`` prints the same alone.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import anyio
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from bench.models import BenchModel, Scaled, load_bench_model
from bench.results import Measurement

_FUNCTION = '''def compute_totals(orders, tax_rate):
    """Sum each customer's orders and add tax."""
    totals = {}
    for order in orders:
        customer = order["customer"]
        amount = order["amount"] * (1 + tax_rate)
        totals[customer] = totals.get(customer, 0) + amount
    return totals
'''
_PASSAGE = (
    "The lighthouse keeper, Elias Marr, kept a log for forty years. He wrote that 'the sea is "
    "never the same twice, but the light must always be'. In 1911 a storm destroyed the lower "
    "gallery, and Marr rebuilt it alone over one winter. The log records that 'no ship was lost "
    "while the lamp was lit', a claim the harbour records confirm."
)
_CODE = """import math


def area_of_circle(radius):
    return math.pi * radius ** 2


def area_of_square(side):
    return side ** 2


def perimeter_of_circle(radius):
    return 2 * math.pi * radius


def perimeter_of_square(side):
"""
WORKLOADS = {
    "rewrite_rename": "Rewrite this function, renaming `orders` to `purchases` everywhere. "
    "Reply with the code only.\n\n" + _FUNCTION,
    "summarise_quotes": "Summarise this passage in two sentences, quoting it exactly where you "
    "can.\n\n" + _PASSAGE,
    "document_citations": "Answer from the document, citing the sentences you use in quotes: "
    "what did Marr rebuild, and when?\n\nDocument:\n" + _PASSAGE,
    "code_continue": "Continue this Python file with the next three functions.\n\n" + _CODE,
    "free_chat": "Tell me a short story about a fox who learns to play the violin.",
}
# A base model (no chat template: Gemma 3 270M's GGUF) does not follow an instruction given as raw
# text: asked to rewrite the function it wrote the signature, then prose and a run of zeros (34 of
# 96 tokens prose), so its "rename" row measured no rewrite. It gets each task framed as text to
# continue, the way a base model is prompted; every system gets the same prompt. (It copies the
# function verbatim, without the rename: this 270M base model does not rename.)
BASE_PROMPTS = {
    "rewrite_rename": "Rename `orders` to `purchases` everywhere in this function.\n\nBefore:\n"
    "```python\n" + _FUNCTION + "```\n\nAfter:\n```python\n",
    "summarise_quotes": "Passage:\n" + _PASSAGE + "\n\nA summary in two sentences, quoting the "
    "passage exactly where it can:\n",
    "document_citations": "Document:\n" + _PASSAGE + "\n\nQuestion: what did Marr rebuild, and "
    "when? Cite the sentences used, in quotes.\nAnswer:",
    "code_continue": _CODE,
    "free_chat": "Here is a short story about a fox who learns to play the violin.\n\n",
}
SYSTEMS = ("mlx-lm", "runtime", "runtime+speculative")
SIZES = Scaled(tiny=(48, 2), tiny_quick=(16, 1), real=(96, 3), real_quick=(24, 1))  # tokens, reps
DRAFTS = 10  # the most drafts a pass verifies (Sampling.speculative)


def _prompt(tokenizer: Any, workload: str) -> list[int]:
    """The workload's chat-templated instruction; a model without a template (Gemma 3 270M's
    GGUF) gets the task framed as text to continue (``BASE_PROMPTS``)."""
    if not getattr(tokenizer, "chat_template", None):
        return list(tokenizer.encode(BASE_PROMPTS[workload]))
    messages = [{"role": "user", "content": WORKLOADS[workload]}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def banned_ends(tokenizer: Any) -> dict[int, float]:
    """A base model (no chat template: Gemma 3 270M) given raw text may end at once (its greedy
    reply to the rename is one line), so every system decodes ``max_tokens`` with its end
    tokens' logits lowered by 100; an instruct model ends where it ends, for every system."""
    if getattr(tokenizer, "chat_template", None):
        return {}
    return dict.fromkeys(sorted(tokenizer.eos_token_ids), -100.0)


def raw_rate(
    model: Any, prompt: list[int], max_tokens: int, ends: set[int], bias: dict[int, float]
) -> tuple[float, list[int]]:
    """mlx-lm's ``generate_step``, stopped at an end token as the runtime stops."""
    cache = make_prompt_cache(model)
    stamps: list[float] = []
    out: list[int] = []
    processors = []
    if bias:
        ids, values = mx.array(list(bias)), mx.array(list(bias.values()))
        processors.append(lambda _tokens, logits: logits.at[:, ids].add(values))
    for token, _ in generate_step(
        mx.array(prompt),
        model,
        max_tokens=max_tokens,
        prompt_cache=cache,
        logits_processors=processors,
    ):
        if int(token) in ends:
            break
        out.append(int(token))
        stamps.append(time.perf_counter())
    return _rate(out, stamps), out


def _rate(tokens: list[int], stamps: list[float]) -> float:
    """Tokens per second after the first (0: fewer than two tokens)."""
    if len(tokens) < 2 or stamps[-1] <= stamps[0]:
        return 0.0
    return (len(tokens) - 1) / (stamps[-1] - stamps[0])


Row = dict[str, tuple[float, list[int]]]  # system -> (best decode tok/s, tokens)


async def measure_all(
    bench: Any, prompts: dict[str, list[int]], max_tokens: int, reps: int
) -> dict[str, tuple[Row, dict[str, int]]]:
    """Every workload, each system in turn ``reps`` times (interleaved, so that a busy machine
    slows them alike); the best rate of each, and the speculative runs' counters."""
    from runtime.host.api import Runtime
    from runtime.host.config import RuntimeConfig
    from runtime.messages import ModelSpec

    results: dict[str, tuple[Row, dict[str, int]]] = {}
    bias = banned_ends(bench.tokenizer)
    ends = set(bench.tokenizer.eos_token_ids)
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 31)) as rt:
        await rt.load_model(ModelSpec(name="m", backend="mlx", path=str(bench.path)))
        for name, prompt in prompts.items():
            row: Row = {}
            before = _counters(rt)
            for _ in range(reps):
                runs = {
                    "mlx-lm": raw_rate(bench.model, prompt, max_tokens, ends, bias),
                    "runtime": await _runtime_rate(rt, prompt, max_tokens, 0, bias),
                    "runtime+speculative": await _runtime_rate(
                        rt, prompt, max_tokens, DRAFTS, bias
                    ),
                }
                for system, (rate, tokens) in runs.items():
                    if system not in row or rate > row[system][0]:
                        row[system] = (rate, tokens)
            after = _counters(rt)
            results[name] = (row, {k: after.get(k, 0) - before.get(k, 0) for k in after})
    return results


async def _runtime_rate(
    rt: Any, prompt: list[int], max_tokens: int, drafts: int, bias: dict[int, float]
) -> tuple[float, list[int]]:
    from runtime.messages import Sampling, TokensEmitted

    stamps: list[float] = []
    tokens: list[int] = []
    async with rt.generate(
        "m",
        prompt_tokens=prompt,
        max_tokens=max_tokens,
        sampling=Sampling(speculative=drafts, logit_bias=bias),
        reuse_prefix=False,
    ) as stream:
        async for event in stream:
            if isinstance(event, TokensEmitted) and event.token_ids:
                tokens += event.token_ids
                stamps += [time.perf_counter()] * len(event.token_ids)
    return _rate(tokens, stamps), tokens


def _counters(rt: Any) -> dict[str, int]:
    return dict(next(s.counters for a, s in rt.stats().actors.items() if a.startswith("engine:")))


def measure(model: BenchModel, systems: set[str], quick: bool) -> list[Measurement]:
    """Every workload's rows on ``model`` for the systems of ``systems`` it has."""
    max_tokens, reps = SIZES.pick(model, quick)
    prompts = {name: _prompt(model.tokenizer, name) for name in WORKLOADS}
    results = anyio.run(measure_all, model, prompts, max_tokens, reps)
    served: dict[str, float | None] = {}
    if "mlx_lm.server" in systems:
        served = _served_rates(model, prompts, max_tokens, reps)
    rows: list[Measurement] = []
    how = f"{max_tokens} greedy tokens, best of {reps}"
    for name, (row, counters) in results.items():
        scenario = f"speculative.{name}.tok_s"
        same = row["runtime+speculative"][1] == row["runtime"][1]
        drafted = counters.get("drafted_tokens", 0)
        accepted = counters.get("accepted_tokens", 0)
        named = {"runtime": "runtime+speculative", "runtime-nospec": "runtime", "mlx-lm": "mlx-lm"}
        for system, key in named.items():
            note = f"{how}; greedy text identical without speculation: {same}"
            rate = round(row[key][0], 2) or None  # None: fewer than two tokens
            rows.append(Measurement(system, model.name, scenario, rate, "tok/s", [rate], note))
        if name in served:
            note = f"{how}, over HTTP (no draft model: plain decoding)"
            rows.append(
                Measurement("mlx_lm.server", model.name, scenario, served[name], "tok/s", [], note)
            )
        rate = round(accepted / drafted, 3) if drafted else None
        passes = counters.get("speculative_passes", 0)
        note = f"accepted {accepted} of {drafted} drafts in {passes} passes"
        accepted_row = f"speculative.{name}.acceptance"
        rows.append(Measurement("runtime", model.name, accepted_row, rate, "x", [], note))
    return rows


def _served_rates(
    model: BenchModel, prompts: dict[str, list[int]], max_tokens: int, reps: int
) -> dict[str, float | None]:
    """``mlx_lm.server``'s best decode tok/s per workload (None: it could not be measured)."""
    from bench.http_client import RequestFailed, complete
    from bench.serving import ServerUnavailable, mlx_lm_server, running

    bias = banned_ends(model.tokenizer)
    extra = {"logit_bias": {str(t): v for t, v in bias.items()}} if bias else None

    async def rates(server: Any) -> dict[str, float | None]:
        best: dict[str, float | None] = {}
        for name, prompt in prompts.items():
            text = model.tokenizer.decode(prompt)
            for _ in range(reps):
                reply = await complete(server, text, max_tokens, extra=extra)
                n = reply.completion_tokens or len(reply.chunks)
                span = reply.last_token_s - reply.ttft
                rate = round((n - 1) / span, 2) if n > 1 and span > 0 else None
                if rate is not None and (best.get(name) is None or rate > (best[name] or 0)):
                    best[name] = rate
                best.setdefault(name, rate)
        return best

    try:
        with running([mlx_lm_server(model.path)]) as (server,):
            return asyncio.run(rates(server))
    except (ServerUnavailable, RequestFailed, OSError, TimeoutError):
        return dict.fromkeys(prompts)


def main() -> None:
    model_name = sys.argv[1] if len(sys.argv) > 1 else "smollm2"
    max_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 96
    reps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    bench = load_bench_model(model_name)
    chosen = sys.argv[4].split(",") if len(sys.argv) > 4 else list(WORKLOADS)
    prompts = {name: _prompt(bench.tokenizer, name) for name in chosen}
    results = anyio.run(measure_all, bench, prompts, max_tokens, reps)
    print(
        f"model {model_name}, {max_tokens} tokens, greedy, best of {reps} interleaved; "
        "decode tok/s from the first token to the last"
    )
    for name, (row, counters) in results.items():
        base = row["mlx-lm"][0]
        plain, plain_tokens = row["runtime"]
        fast, fast_tokens = row["runtime+speculative"]
        drafted = counters.get("drafted_tokens", 0)
        accepted = counters.get("accepted_tokens", 0)
        print(
            f"speculative.{name}.tok_s  mlx-lm {base:6.2f}  runtime {plain:6.2f} "
            f"({plain / base:4.2f}x)  runtime+speculative {fast:6.2f} ({fast / base:4.2f}x)  "
            f"accepted {accepted}/{drafted} in {counters.get('speculative_passes', 0)} passes  "
            f"identical {fast_tokens == plain_tokens}"
        )


if __name__ == "__main__":
    main()
