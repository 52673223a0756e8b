"""A chat host: two users' multi-turn conversations, each with its own instructions.

What a chat app does with the runtime, and what this program does:

- each conversation is a ``session`` (here, the user's name) whose instructions (the system
  message) the runtime pins in its prefix cache, so every turn reuses them even after the
  conversation's older turns were evicted or dropped; ``end_session`` unpins them;
- each turn sends the whole conversation as ``messages``; the runtime reuses the KV of the turns
  before it, so a turn prefills about its new user message only;
- ``ChatOptions(history_budget_tokens=...)``, the history window: the oldest turns are dropped
  when the conversation outgrows it (instructions and the latest turn never are);
- the reply streams: its text is printed as it comes.

After each reply it prints how many prompt tokens came from the cache and how many turns the
window dropped (``Started``), and the time to its first token.

    python examples/chat_host.py                        # the default model
    python examples/chat_host.py --history-tokens 400   # a wider window: fewer turns dropped
    python examples/chat_host.py --model gemma3-270m --max-tokens 64
"""

from __future__ import annotations

import argparse
import sys
import time

import anyio

from runtime import (
    ChatMessage,
    ChatOptions,
    Failed,
    Finished,
    ModelSpec,
    Runtime,
    RuntimeConfig,
    Started,
    TokensEmitted,
)

# user -> (instructions, what they ask, turn by turn)
CONVERSATIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "ada": (
        "You are a concise geography tutor. Answer in one short sentence.",
        (
            "What is the capital of France?",
            "And the capital of Germany?",
            "Which of those two cities is larger?",
            "Name a river that flows through each.",
        ),
    ),
    "bob": (
        "You are a friendly cooking assistant. Keep answers short.",
        (
            "How long should I boil an egg for a soft yolk?",
            "And for a hard yolk?",
        ),
    ),
}


async def turn(
    rt: Runtime,
    model: str,
    user: str,
    history: list[ChatMessage],
    args: argparse.Namespace,
) -> str:
    """One reply to ``history``, streamed to stdout; returns its text."""
    sent = time.perf_counter()
    first_token_ms: float | None = None
    parts: list[str] = []
    started: Started | None = None
    print(f"{user}> {history[-1].content}\nassistant> ", end="", flush=True)
    async with rt.generate(
        model,
        messages=history,
        chat=ChatOptions(history_budget_tokens=args.history_tokens),
        max_tokens=args.max_tokens,
        session=user,  # pins the instructions; one user's turns never cut another's short
    ) as stream:
        async for event in stream:
            match event:
                case Started():
                    started = event
                case TokensEmitted(text=text):
                    if first_token_ms is None:
                        first_token_ms = (time.perf_counter() - sent) * 1e3
                    parts.append(text)
                    print(text, end="", flush=True)
                case Finished(reason=reason):
                    print(f"  ({reason})" if reason != "stop" else "")
                case Failed(code=code, message=message):
                    print(f"\n[failed: {code}: {message}]")
                case _:  # cancelled: only when the runtime shuts down under us
                    print(f"\n[{event}]")
    if started is not None:
        print(
            f"    [cached {started.cached_tokens}/{started.prompt_tokens} prompt tokens, "
            f"turns dropped by the window: {started.dropped_turns}, first token after "
            f"{first_token_ms or 0:.0f} ms]"
        )
    return "".join(parts)


async def run(args: argparse.Namespace) -> None:
    async with Runtime(RuntimeConfig(kv_budget_bytes=256 << 20)) as rt:
        print(f"loading {args.model} (a known model is fetched and converted on first use)...")
        loaded = await rt.load_model(ModelSpec(name="chat-model", path=args.model))
        # The users take turns, as their messages arrive: each conversation keeps its own history.
        histories = {
            user: [ChatMessage(role="system", content=instructions)]
            for user, (instructions, _) in CONVERSATIONS.items()
        }
        questions = {user: list(asked) for user, (_, asked) in CONVERSATIONS.items()}
        while any(questions.values()):
            for user, waiting in questions.items():
                if not waiting:
                    continue
                histories[user].append(ChatMessage(role="user", content=waiting.pop(0)))
                reply = await turn(rt, loaded.model, user, histories[user], args)
                histories[user].append(ChatMessage(role="assistant", content=reply))
        for user in CONVERSATIONS:  # the conversation is closed: its instructions may be evicted
            ended = await rt.end_session(loaded.model, user)
            released = "released" if ended.unpinned else "none was pinned"
            print(f"session {user} ended: its pinned instructions prefix {released}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="examples:\n"
        "  python examples/chat_host.py\n"
        "  python examples/chat_host.py --history-tokens 400 --max-tokens 48\n"
        "  python examples/chat_host.py --model path/to/model.gguf",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        metavar="PATH",
        help="an mlx-lm directory, a .gguf file or a known model (default: smollm2-135m-instruct)",
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="most tokens per reply (32)")
    parser.add_argument(
        "--history-tokens",
        type=int,
        default=100,
        metavar="N",
        help="the history window: the prompt is kept within N tokens by dropping the oldest "
        "turns (100)",
    )
    args = parser.parse_args(argv)
    if args.max_tokens < 1 or args.history_tokens < 1:
        parser.error("--max-tokens and --history-tokens must be at least 1")
    anyio.run(run, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
