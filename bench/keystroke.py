"""Editor autocomplete (``--scenarios keystroke``): a completion at every keystroke, over HTTP.

A person edits a Python file (``bench.code_sample``, ~500 tokens when opened). Every keystroke (a
few characters typed, a two-character typo then its erasure, once a comment inserted in the
middle of the file) sends the file as it stands for a short completion that replaces the previous
one: the client closes the previous stream, unread, before it sends the next. The HTTP API has no
``supersede`` field (``Runtime.generate`` has), so closing the connection is how an HTTP client
supersedes, on both servers; ours also gets a ``session`` per typing session (docs/http.md).

The person waits for the first token of each suggestion, then pauses 30-80 ms (seeded: both
systems get the same edits and pauses) before the next keystroke. At the end of each burst (every
8th keystroke, and the last) they read the whole suggestion, whose ``usage`` says how much of its
prompt came from a cache. The file is sent once, untimed, when it is opened, as an editor does.

- ``keystroke.latency_p50`` / ``keystroke.latency_p90``: keystroke to its suggestion's first
  token (ms), every keystroke of every repetition pooled.
- ``keystroke.cached_fraction``: cached / prompt tokens over the suggestions read to the end.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.code_sample import CODE_SAMPLE
from bench.http_client import (
    CompletionStream,
    RequestFailed,
    Server,
    complete,
    in_turn,
    open_completion,
    speaks_our_api,
)
from bench.models import BenchModel, Scaled
from bench.prompts import encode
from bench.results import Measurement

READ_EVERY = 8  # a burst of typing ends, and its suggestion is read, every 8th keystroke
TYPO_EVERY = 9  # a typo in every 9 keystrokes, erased by the next (a double backspace)
# Two characters that never merge into one token with the text before them: erasing a one-token
# typo makes a prompt equal to the dropped typo request's prompt minus its last token, which kills
# mlx_lm.server 0.32.2's generation thread ("empty prompt"; docs/performance.md).
TYPOS = ("x;", "j]", "q(", "w#")
PAUSE_S = (0.03, 0.08)
MIDDLE_EDIT = "    # Entries stay in use order: the first one is the next to evict.\n"


@dataclass(frozen=True)
class KeystrokeSizes:
    file_tokens: int = 500  # the file as opened
    keystrokes: int = 40
    max_tokens: int = 8
    repetitions: int = 2  # each a different file (its first line differs), so none reuses another


SIZES = Scaled(
    tiny=KeystrokeSizes(),
    tiny_quick=KeystrokeSizes(keystrokes=16, repetitions=1),
    real=KeystrokeSizes(),
    real_quick=KeystrokeSizes(file_tokens=120, keystrokes=10, repetitions=1),
)


@dataclass(frozen=True)
class Keystroke:
    """The file after one keystroke (the prompt), and what the person does next."""

    prompt: str
    read: bool  # wait for the whole suggestion, not only its first token
    pause_s: float


@dataclass
class Typed:
    """What one system's typing sessions measured, and why they stopped if they failed."""

    latencies: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)  # of the suggestions read to the end
    cached_tokens: list[int] = field(default_factory=list)
    failure: str | None = None


def schedule(tokenizer: Any, sizes: KeystrokeSizes, seed: int) -> tuple[str, list[Keystroke]]:
    """The file as opened, and the keystrokes that edit it (the same for every system)."""
    rng = random.Random(seed)
    opened, ahead = _split_at_tokens(tokenizer, CODE_SAMPLE, sizes.file_tokens)
    opened = f"# Draft {seed + 1}.\n{opened}"
    text, used, typo, edited = opened, 0, "", False
    keystrokes = []
    for i in range(sizes.keystrokes):
        if typo:
            text, typo = text[: -len(typo)], ""
        elif not edited and i >= sizes.keystrokes // 2:
            text, edited = _insert_in_middle(text, MIDDLE_EDIT), True
        elif i % TYPO_EVERY == TYPO_EVERY // 2:
            typo = rng.choice(TYPOS)
            text += typo
        else:
            step = rng.randint(2, 4)
            text += ahead[used : used + step]
            used += step
        read = i % READ_EVERY == READ_EVERY - 1 or i == sizes.keystrokes - 1
        keystrokes.append(Keystroke(text, read, rng.uniform(*PAUSE_S)))
    return opened, keystrokes


def _split_at_tokens(tokenizer: Any, text: str, target: int) -> tuple[str, str]:
    """The shortest run of whole lines of ``text`` with at least ``target`` tokens, and the rest."""
    lines = text.splitlines(keepends=True)
    for count in range(1, len(lines) + 1):
        head = "".join(lines[:count])
        if len(encode(tokenizer, head)) >= target:
            return head, text[len(head) :]
    raise ValueError(f"the code sample has fewer than {target} tokens")


def _insert_in_middle(text: str, line: str) -> str:
    middle = text.index("\n", len(text) * 2 // 5) + 1
    return text[:middle] + line + text[middle:]


async def _type(
    server: Server,
    opened: str,
    keystrokes: Sequence[Keystroke],
    sizes: KeystrokeSizes,
    rep: int,
    into: Typed,
) -> None:
    """One typing session against ``server``, its measurements added to ``into``."""
    extra = {"session": f"keystroke-{rep}"} if speaks_our_api(server.system) else None
    await complete(server, opened, sizes.max_tokens, extra=extra)  # the editor opened the file
    previous: CompletionStream | None = None
    try:
        for keystroke in keystrokes:
            pressed = time.perf_counter()
            if previous is not None:
                previous.drop()
            previous = await open_completion(
                server, keystroke.prompt, sizes.max_tokens, start=pressed, extra=extra
            )
            into.latencies.append(await previous.first_text())
            if keystroke.read:
                reply = await previous.finish()
                previous = None
                into.prompt_tokens.append(reply.prompt_tokens)
                into.cached_tokens.append(reply.cached_tokens or 0)
            await asyncio.sleep(keystroke.pause_s)
    finally:
        if previous is not None:
            previous.drop()


async def measure(servers: Sequence[Server], model: BenchModel, quick: bool) -> list[Measurement]:
    """Every system's typing sessions, the systems taking turns to go first.

    A server that fails a request keeps its rows, with no value and the reason; the others go on.
    Run this group last: a server that fails here may be dead for whatever comes after.
    """
    sizes = SIZES.pick(model, quick)
    results = {server.system: Typed() for server in servers}
    for rep in range(sizes.repetitions):
        opened, keystrokes = schedule(model.tokenizer, sizes, seed=rep)
        for server in in_turn(servers, rep):
            typed = results[server.system]
            if typed.failure is not None:
                continue
            before = len(typed.latencies)
            try:
                await _type(server, opened, keystrokes, sizes, rep, typed)
            except RequestFailed as exc:
                done = len(typed.latencies) - before
                after = await _next_request(server, opened)
                typed.failure = (
                    f"failed in session {rep + 1} after {done} keystrokes: {exc}; "
                    f"the next request: {after}"
                )
    return [row for system, typed in results.items() for row in _rows(system, model, sizes, typed)]


async def _next_request(server: Server, prompt: str) -> str:
    """Whether ``server`` still answers after a failure (the failure may have been a crash)."""
    try:
        await complete(server, prompt, 1)
    except RequestFailed as exc:
        return str(exc)
    return "answered"


def _rows(system: str, model: BenchModel, sizes: KeystrokeSizes, typed: Typed) -> list[Measurement]:
    how = "over HTTP (mlxrt serve), " if speaks_our_api(system) else ""
    note = (
        f"{how}{sizes.repetitions} session(s) of {sizes.keystrokes} keystrokes on a "
        f"{sizes.file_tokens}-token file, max_tokens {sizes.max_tokens}; the previous stream "
        f"closed unread; prompt tokens of the suggestions read: {typed.prompt_tokens}"
    )
    ms = [round(s * 1000, 3) for s in typed.latencies]
    pairs = zip(typed.cached_tokens, typed.prompt_tokens, strict=True)
    fractions = [round(cached / prompt, 3) for cached, prompt in pairs]
    p50, p90, cached = _quantile(ms, 50), _quantile(ms, 90), None
    if typed.prompt_tokens:
        cached = round(sum(typed.cached_tokens) / sum(typed.prompt_tokens), 3)
    if typed.failure is not None:  # samples kept, but no value from a session cut short
        p50 = p90 = cached = None
        note = f"{note}; {typed.failure}"
    return [
        Measurement(system, model.name, "keystroke.latency_p50", p50, "ms", ms),
        Measurement(system, model.name, "keystroke.latency_p90", p90, "ms"),
        Measurement(
            system, model.name, "keystroke.cached_fraction", cached, "frac", fractions, note
        ),
    ]


def _quantile(values: Sequence[float], percent: int) -> float | None:
    """The ``percent``-th percentile, interpolated between the nearest samples."""
    if len(values) < 2:
        return values[0] if values else None
    return round(statistics.quantiles(values, n=100, method="inclusive")[percent - 1], 3)
