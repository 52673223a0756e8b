"""Branching (``--scenarios branch``): a long prompt re-sent with its last line changed.

Notes of ~900 (and ~1,800) tokens end with a question on their last line; a second request sends
the same notes with another question. A server that can rewind or restore its state near the end
re-processes only the new line (llama-server: 20 tokens, on Gemma 3 with its 512-token rewind);
one that cannot re-processes from its last usable checkpoint, or everything. Both requests are
streamed greedy completions; fresh notes every repetition, so nothing carries over between them.

- ``branch.N.cold_ttft``: TTFT of the first request (nothing cached), ms;
- ``branch.N.ttft``: TTFT of the second, ms;
- ``branch.N.reprocessed``: the second's prompt tokens not served from a cache (its
  ``prompt_tokens`` minus the ``cached_tokens`` the server reports; llama-server's own
  ``timings.prompt_n``);
- ``branch.N.ttft.eval``, ``branch.N.ttft.rest``: the second's TTFT split by the server's own
  ``timings.prompt_ms`` (``bench.results.split_ttft``), where it reports one;
- ``branch.N.cold/branch``: the ratio of the two TTFT medians (higher is better).

Raw mlx-lm has no row: it keeps no cache between two calls unless its host writes one.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from bench.http_client import Server, complete, in_turn
from bench.models import BenchModel, Scaled
from bench.prompts import WORDS, encode
from bench.results import Measurement, median, ratio, split_ttft, timed

QUESTIONS = (
    "Question: which of these notes mentions the sea, and what does it say?",
    "Question: how many of these notes talk about a city or a farm?",
)


@dataclass(frozen=True)
class BranchSizes:
    notes_tokens: tuple[int, ...] = (900, 1800)
    max_tokens: int = 8
    repetitions: int = 3


SIZES = Scaled(
    tiny=BranchSizes(),
    tiny_quick=BranchSizes(notes_tokens=(900,), repetitions=1),
    real=BranchSizes(),
    real_quick=BranchSizes(notes_tokens=(300,), repetitions=1),
)


def make_notes(tokenizer: object, target_tokens: int, seed: int) -> str:
    """Numbered one-sentence notes of common words, at least ``target_tokens`` long."""
    rng = random.Random(seed)
    lines: list[str] = []
    while len(encode(tokenizer, "\n".join(lines))) < target_tokens:
        for _ in range(8):  # sentence-sized steps, then one exact count
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 16)))
            lines.append(f"Note {len(lines) + 1}: {words.capitalize()}.")
    return "\n".join(lines)


async def measure(servers: Sequence[Server], model: BenchModel, quick: bool) -> list[Measurement]:
    """Every size on every server, the servers taking turns to go first."""
    sizes = SIZES.pick(model, quick)
    rows: list[Measurement] = []
    for size in sizes.notes_tokens:
        cold: dict[str, list[float]] = {server.system: [] for server in servers}
        branch: dict[str, list[float]] = {server.system: [] for server in servers}
        redone: dict[str, list[float]] = {server.system: [] for server in servers}
        evals: dict[str, list[float | None]] = {server.system: [] for server in servers}
        for rep in range(sizes.repetitions):
            notes = make_notes(model.tokenizer, size, 40000 + size + rep)
            first, second = (f"{notes}\n{question}" for question in QUESTIONS)
            for server in in_turn(servers, rep):
                cold[server.system].append((await complete(server, first, sizes.max_tokens)).ttft)
                reply = await complete(server, second, sizes.max_tokens)
                branch[server.system].append(reply.ttft)
                evals[server.system].append(reply.prompt_eval_s)
                prefilled = reply.prefilled_tokens  # None: no cache reported, so all of it
                redone[server.system].append(
                    reply.prompt_tokens if prefilled is None else prefilled
                )
        for system in cold:
            prefix = f"branch.{size}"
            cold_m = timed(system, model.name, f"{prefix}.cold_ttft", cold[system])
            branch_m = timed(system, model.name, f"{prefix}.ttft", branch[system])
            note = (
                f"~{size} tokens of notes, the question on the last line changed; "
                f"max_tokens {sizes.max_tokens}; tokens re-processed: {redone[system]}"
            )
            rows += [
                cold_m,
                Measurement(
                    system,
                    model.name,
                    f"{prefix}.reprocessed",
                    median(redone[system]),
                    "tokens",
                    redone[system],
                    note,
                ),
                branch_m,
                *split_ttft(system, model.name, f"{prefix}.ttft", branch[system], evals[system]),
                ratio(system, model.name, f"{prefix}.cold/branch", cold_m.value, branch_m.value),
            ]
    return rows
