"""``mlxrt generate``: one prompt, its reply streamed to stdout, the speed on stderr (docs/cli.md).

A model without a chat template gets the prompt raw, and one line says so (``--chat`` frames it
anyway). A reader that stops early (``| head``) ends the generation quietly: the request is
cancelled when stdout closes, and the process exits 0 without a BrokenPipeError.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import anyio

from runtime.backends.model_store import DEFAULT_MODEL
from runtime.cli.flags import (
    Speed,
    add_backend,
    add_ctx_size,
    add_draft_model,
    add_framing,
    add_max_tokens,
    add_model,
    add_quiet,
    add_temperature,
    check_shared,
    framed_raw,
    model_options,
    raw_note,
    read_prompt,
)
from runtime.cli.model_args import model_specs, prepare_specs
from runtime.errors import MlxRuntimeError, error_for_code
from runtime.host.api import Runtime
from runtime.messages import (
    Cancelled,
    ChatMessage,
    Failed,
    Finished,
    Sampling,
    TokensEmitted,
    Usage,
)
from runtime.progress import tqdm_progress

_DESCRIPTION = """\
Generate from one prompt and stream the text to stdout; the speed follows on stderr (not with
--quiet). The prompt is framed by the model's chat template as a user message (as mlx_lm.generate
does); a model without a chat template gets it raw, and a line says so (--chat frames it anyway,
--raw never frames it). PROMPT or --prompt `-` reads the prompt from stdin."""
_EXAMPLES = """examples:
  mlxrt generate "What is the capital of France?"           the default model
  mlxrt generate --max-tokens 32 --quiet "Say hi."          no progress bars or notes
  mlxrt generate --model ~/models/llama.Q4_0.gguf "Hello"   any llama or gemma3 GGUF file
  mlxrt generate --backend simulated --model sim "hello"    no MLX: a deterministic stand-in
  mlxrt generate --model gemma3-270m $'Q: Why is the sky blue?\\nA:'   no chat template: raw
  echo "Summarize: ..." | mlxrt generate --temp 0.7 --ctx-size 4096 -   the prompt from stdin
  mlxrt generate "Count to 100." | head -n 3                stops generating when head exits
"""


def add_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``generate`` to ``mlxrt``'s commands."""
    gen = commands.add_parser(
        "generate",
        help="generate from one prompt",
        description=_DESCRIPTION,
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gen.add_argument("prompt_text", nargs="?", metavar="PROMPT", help="the prompt")
    add_model(gen, default=DEFAULT_MODEL)
    add_backend(gen)
    gen.add_argument("--prompt", help="the prompt (instead of PROMPT); - reads it from stdin")
    add_max_tokens(gen, 128, "to generate")
    add_temperature(gen, "0 (the default): greedy")
    add_ctx_size(gen)
    add_draft_model(gen)
    add_framing(gen)
    add_quiet(gen, "progress bars, load notes or speed line")
    gen.set_defaults(run=run)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``mlxrt generate``: 2 for bad input or a model that cannot load (one line says which)."""
    check_shared(args, parser)
    try:
        return anyio.run(generate, args, backend_options={"use_uvloop": True})
    except (ValueError, MlxRuntimeError) as error:
        print(f"mlxrt generate: {error}", file=sys.stderr)
        return 2


class Output:
    """stdout until its reader goes away; then writes are dropped (``closed``)."""

    def __init__(self) -> None:
        self.closed = False

    def write(self, text: str) -> None:
        if self.closed:
            return
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except BrokenPipeError:
            self.closed = True
            # Python flushes stdout again at exit: point it at /dev/null so that flush is quiet.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)


async def generate(args: argparse.Namespace) -> int:
    """Run ``mlxrt generate``; raises ``ValueError`` or ``MlxRuntimeError`` (the CLI prints it),
    also for a request that failed once accepted (its ``Failed`` code and message)."""
    prompt = read_prompt(args.prompt_text if args.prompt_text is not None else args.prompt)
    if prompt is None:
        raise ValueError('give a prompt: mlxrt generate "What is the capital of France?"')
    [spec] = model_specs([args.model], args.backend, model_options(args))
    [spec] = await anyio.to_thread.run_sync(lambda: prepare_specs((spec,), quiet=args.quiet))
    out = Output()
    async with Runtime() as rt:
        with tqdm_progress(disable=args.quiet) as progress:
            progress(f"load {spec.name}", 0, 1)
            loaded = await rt.load_model(spec)
            progress(f"load {spec.name}", 1, 1)
        raw = framed_raw(args.framing, loaded.chat_template)
        if raw and args.framing == "auto" and not args.quiet:
            print(raw_note(spec.name, "generate"), file=sys.stderr, flush=True)
        request: dict[str, object] = {"max_tokens": args.max_tokens}
        if raw:
            request["prompt"] = prompt
        else:  # like mlx_lm.generate: the chat template frames the prompt
            request["messages"] = [ChatMessage(role="user", content=prompt)]
        sampling = Sampling(temperature=args.temperature)
        began = time.perf_counter()
        first: float | None = None
        usage: Usage | None = None
        async with rt.generate(spec.name, sampling=sampling, **request) as stream:  # type: ignore[arg-type]
            async for event in stream:
                match event:
                    case TokensEmitted(text=text):
                        first = time.perf_counter() if first is None else first
                        out.write(text)
                        if out.closed:
                            break  # leaving the stream cancels the request
                    case Finished(usage=used) | Cancelled(usage=used):
                        usage = used
                    case Failed(code=code, message=message):  # e.g. past the context length
                        raise error_for_code(code, message)
        ended = time.perf_counter()
        out.write("\n")
    if usage is not None and first is not None and not args.quiet and not out.closed:
        speed = Speed(
            usage.prompt_tokens, usage.cached_prompt_tokens, usage.completion_tokens,
            first - began, ended - first,
        )  # fmt: skip
        print(speed.line(), file=sys.stderr)
    return 0
