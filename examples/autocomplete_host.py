"""An editor-autocomplete host: a simulated person fills in a bug-report form, one key at a time.

What an editor does with the runtime, and what this program does:

- **focus** on a field: ``prewarm`` the form as it stands up to the cursor, so the first keystroke
  finds its prompt already prefilled (or adopts the prewarm still running);
- **every keystroke**: ``generate`` a short completion in the field's ``session`` with
  ``supersede=True``, so it aborts the field's previous one (stopping its prefill part-way);
- **blur** (focus moves on): ``cancel`` the field's pending suggestion, nobody will see it.

Keys come at a human pace (100-200 ms apart by default, seeded), with typos erased by backspace,
an insertion before the end of a field (what follows the cursor is not in the prompt), and a
return to an earlier field. At the end it prints the keystroke-to-
suggestion latency percentiles, and from ``Runtime.stats()`` how many prefills were aborted, how
many prompt tokens came from the prefix cache, and by which path.

    python examples/autocomplete_host.py                        # the default model
    python examples/autocomplete_host.py --pace-ms 40 80        # a fast typist
    python examples/autocomplete_host.py --model path/to/model.gguf --max-tokens 6
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import anyio
from anyio.abc import TaskGroup

from runtime import (
    Cancelled,
    Failed,
    Finished,
    ModelSpec,
    Runtime,
    RuntimeConfig,
    RuntimeStats,
    Started,
    TokensEmitted,
)

HEADER = "Bug report for the mlx-actor-runtime project.\n\n"
FIELDS = ("Title", "Steps to reproduce", "Expected")
# What the person does: focus a field (the cursor lands at its end), type (a "~" is a typo: a
# wrong key erased by backspace), move the cursor left by some characters to insert there.
SCRIPT: tuple[tuple[str, str], ...] = (
    ("focus", "Title"),
    ("type", "Crash when a model unl~oads"),
    ("focus", "Steps to reproduce"),
    ("type", "Load a model, then unload it while a r~equest runs."),
    ("focus", "Expected"),
    ("type", "The request is cancelled."),
    ("left", "10"),
    ("type", "quietly "),
    ("focus", "Title"),
    ("type", " mid-request"),
)


@dataclass
class Form:
    """The document: each field's text and the cursor (in the focused field)."""

    texts: dict[str, str] = field(default_factory=lambda: dict.fromkeys(FIELDS, ""))
    focused: str = FIELDS[0]
    cursor: int = 0

    def focus(self, name: str) -> None:
        self.focused, self.cursor = name, len(self.texts[name])  # the cursor lands at the end

    def left(self, count: int) -> None:
        self.cursor = max(0, self.cursor - count)

    def press(self, key: str) -> None:
        """One key at the cursor: a character, or ``"\\b"`` (backspace)."""
        text = self.texts[self.focused]
        if key == "\b":
            self.texts[self.focused] = text[: self.cursor - 1] + text[self.cursor :]
            self.cursor -= 1
        else:
            self.texts[self.focused] = text[: self.cursor] + key + text[self.cursor :]
            self.cursor += 1

    def prompt(self) -> str:
        """The form up to the cursor: what a completion continues from."""
        done = "".join(f"{name}: {self.texts[name]}\n" for name in FIELDS[: self._index()])
        return f"{HEADER}{done}{self.focused}: {self.texts[self.focused][: self.cursor]}"

    def _index(self) -> int:
        return FIELDS.index(self.focused)


def keys_of(text: str, rng: random.Random) -> list[str]:
    """The keys that type ``text``: a ``~`` becomes a wrong letter then a backspace."""
    keys: list[str] = []
    for char in text:
        keys.extend([rng.choice("qxzj"), "\b"] if char == "~" else [char])
    return keys


@dataclass
class Tally:
    """What the person saw: one entry per keystroke's suggestion."""

    keystrokes: int = 0
    latencies_ms: list[float] = field(default_factory=list)  # keystroke to its suggestion
    endings: Counter[str] = field(default_factory=Counter)  # shown, superseded, dismissed, ...
    prewarms: Counter[str] = field(default_factory=Counter)  # prewarmed, adopted, superseded
    # field -> where its latest finished suggestion goes (the cursor then) and its text
    last_suggestion: dict[str, tuple[int, str]] = field(default_factory=dict)


class Editor:
    """Sends the runtime what an editor would, and tallies what came back."""

    def __init__(self, rt: Runtime, model: str, max_tokens: int, tasks: TaskGroup) -> None:
        self.rt, self.model, self.max_tokens, self.tasks = rt, model, max_tokens, tasks
        self.form = Form()
        self.tally = Tally()
        self._pending: dict[str, str] = {}  # field -> request id of its latest suggestion

    async def focus(self, name: str) -> None:
        request_id = self._pending.pop(self.form.focused, None)
        if request_id is not None:  # nobody will read that suggestion: stop it
            await self.rt.cancel(request_id)  # a no-op if it ended already
        self.form.focus(name)
        self.tasks.start_soon(self._prewarm, self.form.prompt(), name)

    async def press(self, key: str) -> None:
        pressed = time.perf_counter()
        self.form.press(key)
        self.tally.keystrokes += 1
        request_id = uuid.uuid4().hex
        self._pending[self.form.focused] = request_id
        self.tally.last_suggestion.pop(self.form.focused, None)  # typing hides the old one
        form = self.form
        self.tasks.start_soon(
            self._suggest, form.prompt(), form.focused, form.cursor, request_id, pressed
        )

    async def _prewarm(self, prompt: str, session: str) -> None:
        ended = await self.rt.prewarm(self.model, prompt, session=session)
        outcome = ended.reason if isinstance(ended, Finished | Cancelled) else ended.code
        self.tally.prewarms[str(outcome)] += 1

    async def _suggest(
        self, prompt: str, session: str, cursor: int, request_id: str, pressed: float
    ) -> None:
        shown = False
        text: list[str] = []
        async with self.rt.generate(
            self.model,
            prompt,
            max_tokens=self.max_tokens,
            stop=["\n"],
            session=session,
            supersede=True,  # this keystroke's suggestion replaces the field's previous one
            request_id=request_id,
        ) as stream:
            async for event in stream:
                if isinstance(event, TokensEmitted | Finished) and not shown:
                    self.tally.latencies_ms.append((time.perf_counter() - pressed) * 1e3)
                    shown = True
                match event:
                    case Started():
                        pass
                    case TokensEmitted(text=piece):
                        text.append(piece)
                    case Finished():
                        self.tally.endings["shown"] += 1
                        if self._pending.get(session) == request_id:  # no newer key yet
                            self.tally.last_suggestion[session] = (cursor, "".join(text))
                    case Cancelled(reason="superseded"):
                        why = "after" if shown else "before"
                        self.tally.endings[f"superseded by the next key {why} it showed"] += 1
                    case Cancelled():  # cancelled by ``focus``
                        self.tally.endings["dismissed on blur"] += 1
                    case Failed(code=code):
                        self.tally.endings[f"failed ({code})"] += 1
        if self._pending.get(session) == request_id:
            del self._pending[session]


def percentile(values: list[float], share: float) -> float:
    """The nearest-rank percentile (``share`` in 0..1) of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


def engine_counters(stats: RuntimeStats, model: str) -> Counter[str]:
    """The counters of every engine (one per load) of ``model``, summed."""
    total: Counter[str] = Counter()
    for address, actor in stats.actors.items():
        if address.startswith(f"engine:{model}#"):
            total.update(actor.counters)
    return total


def report(tally: Tally, counters: Counter[str], form: Form, seconds: float) -> None:
    print(f"\ntyped {tally.keystrokes} keys in {seconds:.1f} s; the form, [the last suggestion]:")
    for name in FIELDS:
        text = form.texts[name]
        if name in tally.last_suggestion:
            cursor, ghost = tally.last_suggestion[name]
            text = f"{text[:cursor]}[{ghost}]{text[cursor:]}"
        print(f"  {name}: {text}")
    endings = ", ".join(f"{n} {what}" for what, n in tally.endings.most_common())
    print(f"suggestions: {endings}")
    if tally.latencies_ms:
        p50, p90, p99 = (percentile(tally.latencies_ms, s) for s in (0.5, 0.9, 0.99))
        print(
            f"keystroke to suggestion: p50 {p50:.1f} ms, p90 {p90:.1f} ms, p99 {p99:.1f} ms "
            f"over {len(tally.latencies_ms)} suggestions"
        )
    prewarms = ", ".join(f"{n} {what}" for what, n in sorted(tally.prewarms.items()))
    print(f"prewarms on focus: {prewarms}")
    print(
        f"runtime: {counters['prefills_aborted']} prefills aborted part-way, "
        f"{counters['generates_superseded']} completions superseded, "
        f"{counters['prewarms_adopted']} prewarms adopted by a keystroke"
    )
    reused, computed = counters["cached_prompt_tokens"], counters["prefilled_tokens"]
    paths = ", ".join(
        f"{name.removeprefix('path_')} {n}" for name, n in sorted(counters.items())
        if name.startswith("path_")
    )  # fmt: skip
    print(
        f"prefix cache: {reused} prompt tokens reused, {computed} prefilled "
        f"({reused / max(1, reused + computed):.0%} reused); reuse paths: {paths}"
    )


async def run(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    async with Runtime(RuntimeConfig(kv_budget_bytes=256 << 20)) as rt:
        print(f"loading {args.model} (a known model is fetched and converted on first use)...")
        loaded = await rt.load_model(ModelSpec(name="editor-model", path=args.model))
        before = engine_counters(rt.stats(), loaded.model)
        began = time.perf_counter()
        async with anyio.create_task_group() as tasks:
            editor = Editor(rt, loaded.model, args.max_tokens, tasks)
            for action, value in SCRIPT:
                await anyio.sleep(rng.uniform(*args.pace_ms) / 1000)  # the person moves on
                if action == "focus":
                    await editor.focus(value)
                    continue
                if action == "left":
                    editor.form.left(int(value))
                    continue
                for key in keys_of(value, rng):
                    await anyio.sleep(rng.uniform(*args.pace_ms) / 1000)  # the person types
                    await editor.press(key)
        counters = engine_counters(rt.stats(), loaded.model)
        counters.subtract(before)
        report(editor.tally, counters, editor.form, time.perf_counter() - began)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="examples:\n"
        "  python examples/autocomplete_host.py\n"
        "  python examples/autocomplete_host.py --pace-ms 40 80 --seed 3\n"
        "  python examples/autocomplete_host.py --model gemma3-270m --max-tokens 4",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        metavar="PATH",
        help="an mlx-lm directory, a .gguf file or a known model (default: smollm2-135m-instruct)",
    )
    parser.add_argument(
        "--pace-ms",
        nargs=2,
        type=float,
        default=(100.0, 200.0),
        metavar=("LOW", "HIGH"),
        help="milliseconds between keys, drawn evenly from LOW to HIGH (default: 100 200)",
    )
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per suggestion (8)")
    parser.add_argument("--seed", type=int, default=0, help="draws the pauses and the typos")
    args = parser.parse_args(argv)
    if args.max_tokens < 1 or min(args.pace_ms) < 0 or args.pace_ms[0] > args.pace_ms[1]:
        parser.error(
            "--max-tokens must be at least 1, and --pace-ms LOW HIGH with 0 <= LOW <= HIGH"
        )
    anyio.run(run, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
