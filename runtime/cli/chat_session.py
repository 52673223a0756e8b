"""``mlxrt chat``: an interactive multi-turn chat in the terminal, on one runtime session.

The runtime runs on an event loop in a background thread (an anyio blocking portal); the main thread
owns the terminal, so ``input()`` gets readline editing and Ctrl-C arrives where it can be acted on:
during a reply it cancels that reply only, at the prompt it ends the chat. A cancelled reply keeps
what was shown as the assistant's turn; one cancelled before any text drops the turn, question
included. A model without a chat template gets no made-up one (unless ``--chat``): each line is
appended to the text so far and the model continues it. Typed commands: chat_commands.py.

See docs/cli.md.
"""

from __future__ import annotations

import contextlib
import importlib.util
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import anyio
from anyio.from_thread import BlockingPortal, start_blocking_portal

from runtime.backends.disk import DiskCacheConfig
from runtime.cli import chat_history
from runtime.cli.chat_commands import (
    HELP,
    Exit,
    Help,
    Reset,
    Say,
    SetSystem,
    Stats,
    Unknown,
    parse_line,
)
from runtime.cli.flags import Framing, Speed, framed_raw, raw_note
from runtime.errors import MlxRuntimeError
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import (
    Cancelled,
    ChatMessage,
    ChatOptions,
    Failed,
    Finished,
    ModelLoaded,
    ModelSpec,
    ReuseTier,
    Sampling,
    Started,
    TokensEmitted,
)

PROMPT = "> "
_HAVE_UVLOOP = importlib.util.find_spec("uvloop") is not None


@dataclass(frozen=True, slots=True)
class ChatSettings:
    """What ``mlxrt chat`` was started with."""

    max_tokens: int = 256
    temperature: float = 0.0
    system: str | None = None
    show_cache: bool = False
    stats: bool = False  # the speed after each reply
    framing: Framing = "auto"  # auto: raw for a model without a chat template
    quiet: bool = False  # no note that the chat is a raw completion
    disk_cache: DiskCacheConfig | None = None  # the prefix cache's disk tier (None: memory only)
    # Where the conversation is kept after each reply (None: not kept), and whether to go on
    # from what is kept there (runtime/cli/chat_history.py).
    history: Path | None = None
    resume: bool = False


@dataclass(slots=True)
class Conversation:
    """The chat so far: instructions, turns, and the runtime session they are sent under.

    A new session per conversation, so ``/reset`` unpins the old instructions prefix.
    """

    system: str | None = None
    turns: list[ChatMessage] = field(default_factory=list)
    session: str = field(default_factory=lambda: f"chat-{uuid.uuid4().hex}")
    raw: bool = False  # a raw completion: the model is sent ``text()``, not ``messages()``

    def messages(self) -> list[ChatMessage]:
        """What the model is sent: the instructions (when set), then every turn."""
        head = [ChatMessage(role="system", content=self.system)] if self.system else []
        return head + self.turns

    def text(self) -> str:
        """The raw completion so far: the instructions, then each line typed on a line of its
        own, each reply continuing the line before it."""
        text = self.system or ""
        for message in self.turns:
            if message.role == "user" and text:
                text += "\n"
            text += message.content
        return text

    def ask(self, text: str) -> None:
        self.turns.append(ChatMessage(role="user", content=text))

    def answered(self, reply: str) -> None:
        self.turns.append(ChatMessage(role="assistant", content=reply))

    def withdraw_question(self) -> None:
        """The last question got no reply (cancelled before any text, or failed): forget it."""
        if self.turns and self.turns[-1].role == "user":
            self.turns.pop()

    def drop_oldest_turns(self, count: int) -> None:
        """The history window left out ``count`` turns: forget them here too, so the next prompt
        starts as this one did and reuses its KV."""
        starts = [i for i, message in enumerate(self.turns) if message.role == "user"]
        if 0 < count < len(starts):
            del self.turns[: starts[count]]

    def reset(self) -> None:
        self.turns.clear()
        self.session = f"chat-{uuid.uuid4().hex}"


@dataclass(frozen=True, slots=True)
class Reply:
    """How one reply ended: its text, the prompt's reuse, and the terminal event."""

    text: str
    started: Started | None
    terminal: Finished | Cancelled | Failed | None
    refused: MlxRuntimeError | None = None  # the runtime refused it (the model restarting, say)
    speed: Speed | None = None  # how fast it came, once it has ended with a token or more


async def stream_reply(
    rt: Runtime,
    model: str,
    conversation: Conversation,
    settings: ChatSettings,
    write: Callable[[str], None],
    interrupted: anyio.Event,
    context_length: int,
) -> Reply:
    """Send the conversation and ``write`` the reply's text as it comes, until it ends or
    ``interrupted`` is set; then the request is cancelled (and has ended) before this returns."""
    parts: list[str] = []
    started: Started | None = None
    terminal: Finished | Cancelled | Failed | None = None
    refused: MlxRuntimeError | None = None
    began, first = time.perf_counter(), 0.0
    raw = conversation.raw

    async def cancel_when_interrupted(scope: anyio.CancelScope) -> None:
        await interrupted.wait()
        scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(cancel_when_interrupted, tg.cancel_scope)
        try:
            async with rt.generate(
                model,
                conversation.text() if raw else None,
                messages=None if raw else conversation.messages(),
                # The window drops the oldest turns rather than fail once the chat outgrows
                # the context.
                chat=None if raw else ChatOptions(history_budget_tokens=context_length),
                max_tokens=settings.max_tokens,
                sampling=Sampling(temperature=settings.temperature),
                session=conversation.session,
            ) as stream:
                async for event in stream:
                    match event:
                        case Started():
                            started = event
                        case TokensEmitted(text=text):
                            first = first or time.perf_counter()
                            parts.append(text)
                            write(text)
                        case Finished() | Cancelled() | Failed():
                            terminal = event
        except MlxRuntimeError as error:  # a Rejected, raised by the stream
            refused = error
        tg.cancel_scope.cancel()
    speed = None
    if isinstance(terminal, Finished | Cancelled) and first:
        used = terminal.usage
        speed = Speed(
            used.prompt_tokens, used.cached_prompt_tokens, used.completion_tokens,
            first - began, time.perf_counter() - first,
        )  # fmt: skip
    return Reply("".join(parts), started, terminal, refused, speed)


class ChatTerminal:
    """The read-reply loop on the main thread, over a ``Runtime`` running in ``portal``."""

    def __init__(
        self,
        portal: BlockingPortal,
        rt: Runtime,
        model: str,
        context_length: int,
        settings: ChatSettings,
        *,
        raw: bool = False,
        read_line: Callable[[str], str] = input,
        out: TextIO | None = None,
    ) -> None:
        """``raw``: a raw completion (the model has no chat template), not chat messages."""
        self._portal, self._rt, self._model = portal, rt, model
        self._context_length = context_length
        self._settings = settings
        self._read_line, self._out = read_line, out or sys.stdout
        self.conversation = Conversation(system=settings.system, raw=raw)
        self._last_speed: Speed | None = None
        self._resumed_note = self._resume() if settings.resume else None

    def _resume(self) -> str:
        """Take the kept conversation (``--system``, if given, replaces its instructions)."""
        saved, note = chat_history.resume(self._settings.history)
        if saved is not None:
            self.conversation.turns = list(saved.turns)
            if self._settings.system is None:
                self.conversation.system = saved.system
        return note

    def _keep(self) -> None:
        trouble = chat_history.keep(
            self._settings.history, self.conversation.system, self.conversation.turns
        )
        if trouble is not None:
            self._say(trouble)

    def run(self) -> None:
        """Until ``/exit``, Ctrl-D or Ctrl-C at the prompt."""
        self._say(HELP)
        if self._resumed_note is not None:
            self._say(self._resumed_note)
        while True:
            try:
                line = self._read_line(PROMPT)
            except (EOFError, KeyboardInterrupt):
                self._say("")
                return
            match parse_line(line):
                case None:
                    continue
                case Exit():
                    return
                case Help():
                    self._say(HELP)
                case Stats():
                    speed = self._last_speed
                    self._say(f"({speed.line()})" if speed else "(no reply yet)")
                case Reset():
                    self._end_session()
                    self.conversation.reset()
                    self._keep()
                    self._say("(new conversation)")
                case SetSystem(text=text):
                    self.conversation.system = text
                    self._say(f"(instructions: {text})" if text else "(instructions cleared)")
                case Unknown(name=name):
                    self._say(f"unknown command {name}; {HELP}")
                case Say(text=text):
                    self._reply_to(text)

    def _reply_to(self, text: str) -> None:
        self.conversation.ask(text)
        interrupted = self._portal.call(anyio.Event)
        future = self._portal.start_task_soon(
            stream_reply,
            self._rt,
            self._model,
            self.conversation,
            self._settings,
            self._write,
            interrupted,
            self._context_length,
        )
        reply = self._wait(future, interrupted)
        self._write("\n")
        self._last_speed = reply.speed or self._last_speed
        if reply.refused is not None:
            self.conversation.withdraw_question()
            self._say(f"(refused: {reply.refused.code}: {reply.refused.message})")
            return
        if reply.terminal is not None and reply.started is not None:
            self.conversation.drop_oldest_turns(reply.started.dropped_turns)
        match reply.terminal:
            case Failed(code=code, message=message):
                self.conversation.withdraw_question()
                self._say(f"(failed: {code}: {message})")
                return
            case Cancelled() | None if not reply.text:
                self.conversation.withdraw_question()
                self._say("(cancelled)")
                return
            case Cancelled() | None:
                self._say("(cancelled)")
        self.conversation.answered(reply.text)
        self._keep()
        if self._settings.show_cache and reply.started is not None:
            started = reply.started
            # Served by the disk tier (an earlier run's entries): said, as it explains the speed.
            where = " from disk" if started.tier is ReuseTier.DISK else ""
            self._say(f"[cached {started.cached_tokens}/{started.prompt_tokens}{where}]")
            usage = getattr(reply.terminal, "usage", None)
            if usage is not None and usage.drafted_tokens:  # the model speculates
                per_pass = tokens_per_pass(usage.completion_tokens, usage.accepted_tokens)
                self._say(
                    f"[drafts accepted {usage.accepted_tokens}/{usage.drafted_tokens}, "
                    f"{per_pass:.2f} tokens a pass]"
                )
        if self._settings.stats and reply.speed is not None:
            self._say(f"({reply.speed.line()})")

    def _wait(self, future: Future[Reply], interrupted: anyio.Event) -> Reply:
        """The reply once it has ended; Ctrl-C while waiting cancels the reply, not the chat."""
        while True:
            try:
                return future.result()
            except KeyboardInterrupt:  # the reply's task still ends: it returns what was shown
                self._portal.call(interrupted.set)

    def _end_session(self) -> None:
        # Only unpins the old instructions: a model that is gone has nothing left to unpin.
        with contextlib.suppress(MlxRuntimeError):
            self._portal.call(self._rt.end_session, self._model, self.conversation.session)

    def _write(self, text: str) -> None:
        self._out.write(text)
        self._out.flush()

    def _say(self, line: str) -> None:
        self._write(line + "\n")


@contextmanager
def running_runtime(
    spec: ModelSpec, config: RuntimeConfig | None = None
) -> Iterator[tuple[BlockingPortal, Runtime, ModelLoaded]]:
    """A ``Runtime`` with ``spec`` loaded, on an event loop in a background thread: the portal,
    the runtime and the model's load reply (its context length, whether it has a template)."""
    with contextlib.ExitStack() as stack:
        with _sigint_blocked():  # the loop's thread, and every thread it starts, inherit the mask
            portal = stack.enter_context(
                start_blocking_portal(backend_options={"use_uvloop": _HAVE_UVLOOP})
            )
        rt = stack.enter_context(portal.wrap_async_context_manager(Runtime(config)))
        loaded = portal.call(rt.load_model, spec)
        yield portal, rt, loaded


@contextmanager
def _sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread meanwhile: threads started meanwhile keep it blocked, so
    Ctrl-C always reaches the main thread (some systems deliver it to any thread)."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows: Ctrl-C goes to the main thread anyway
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def run_chat(
    spec: ModelSpec,
    settings: ChatSettings,
    *,
    read_line: Callable[[str], str] = input,
    out: TextIO | None = None,
) -> None:
    """Load ``spec`` (already prepared: fetched and converted) and chat until the user leaves."""
    with contextlib.suppress(ImportError):  # readline: input() gets line editing and history
        import readline  # noqa: F401
    config = RuntimeConfig(disk_cache=settings.disk_cache)
    with running_runtime(spec, config) as (portal, rt, loaded):
        raw = framed_raw(settings.framing, loaded.chat_template)
        if raw and settings.framing == "auto" and not settings.quiet:
            print(raw_note(spec.name, "chat"), file=sys.stderr, flush=True)
        terminal = ChatTerminal(
            portal, rt, spec.name, loaded.context_length, settings,
            raw=raw, read_line=read_line, out=out,
        )  # fmt: skip
        terminal.run()


def tokens_per_pass(completion_tokens: int, accepted_tokens: int) -> float:
    """Decoded tokens per forward pass: the first token comes from the prompt's prefill, and
    each decode pass after it gives one token of its own plus the drafts it accepted."""
    decoded = completion_tokens - 1
    passes = decoded - accepted_tokens
    return decoded / passes if passes > 0 else 1.0
