"""The speculative group: decode tok/s of the runtime with and without prompt-lookup speculation,
and of raw mlx-lm (``generate_step``), on workloads that copy from their prompt and on free chat.

Decode tok/s is measured from the first token to the last (prefill excluded), greedy, the same
chat-templated prompt for every system; the runtime's greedy text must equal its text without
speculation. ``python -m bench.speculative [model] [max_tokens]`` prints one row per workload
and system, named ``speculative.<workload>.tok_s`` (the free-chat one contains ``chat``), plus
the ratios to raw mlx-lm and the acceptance rate.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import anyio
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from bench.models import load_bench_model

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
SYSTEMS = ("mlx-lm", "runtime", "runtime+speculative")


def _prompt(tokenizer: Any, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def raw_rate(model: Any, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    cache = make_prompt_cache(model)
    stamps: list[float] = []
    out: list[int] = []
    for token, _ in generate_step(
        mx.array(prompt), model, max_tokens=max_tokens, prompt_cache=cache
    ):
        out.append(int(token))
        stamps.append(time.perf_counter())
    return (len(out) - 1) / (stamps[-1] - stamps[0]), out


async def runtime_rates(
    path: str, prompts: dict[str, list[int]], max_tokens: int
) -> dict[tuple[str, int], tuple[float, list[int], dict[str, int]]]:
    from runtime.api import Runtime
    from runtime.config import RuntimeConfig
    from runtime.messages import ModelSpec, Sampling, TokensEmitted

    results: dict[tuple[str, int], tuple[float, list[int], dict[str, int]]] = {}
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 31)) as rt:
        await rt.load_model(ModelSpec(name="m", backend="mlx", path=path))
        for name, prompt in prompts.items():
            for drafts in (0, 10):
                before = _counters(rt)
                stamps: list[float] = []
                tokens: list[int] = []
                async with rt.generate(
                    "m",
                    prompt_tokens=prompt,
                    max_tokens=max_tokens,
                    sampling=Sampling(speculative=drafts),
                    reuse_prefix=False,
                ) as stream:
                    async for event in stream:
                        if isinstance(event, TokensEmitted) and event.token_ids:
                            tokens += event.token_ids
                            stamps += [time.perf_counter()] * len(event.token_ids)
                after = _counters(rt)
                delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
                rate = (len(tokens) - 1) / (stamps[-1] - stamps[0])
                results[(name, drafts)] = (rate, tokens, delta)
    return results


def _counters(rt: Any) -> dict[str, int]:
    return dict(next(s.counters for a, s in rt.stats().actors.items() if a.startswith("engine:")))


def main() -> None:
    model_name = sys.argv[1] if len(sys.argv) > 1 else "smollm2"
    max_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 96
    bench = load_bench_model(model_name)
    prompts = {name: _prompt(bench.tokenizer, text) for name, text in WORKLOADS.items()}
    raw = {name: raw_rate(bench.model, p, max_tokens) for name, p in prompts.items()}
    ours = anyio.run(runtime_rates, str(bench.path), prompts, max_tokens)
    print(f"model {model_name}, {max_tokens} tokens, greedy; decode tok/s (first to last token)")
    for name in prompts:
        base, _ = raw[name]
        plain, plain_tokens, _ = ours[(name, 0)]
        fast, fast_tokens, counters = ours[(name, 10)]
        drafted = counters.get("drafted_tokens", 0)
        accepted = counters.get("accepted_tokens", 0)
        same = fast_tokens == plain_tokens
        print(
            f"speculative.{name}.tok_s  mlx-lm {base:6.2f}  runtime {plain:6.2f} "
            f"({plain / base:4.2f}x)  runtime+speculative {fast:6.2f} ({fast / base:4.2f}x)  "
            f"accepted {accepted}/{drafted}  passes {counters.get('speculative_passes', 0)}  "
            f"identical {same}"
        )


if __name__ == "__main__":
    main()
