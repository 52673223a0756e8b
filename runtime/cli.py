"""``mlxrt``: the command line. ``mlxrt demo`` runs the demo; ``mlxrt generate`` one prompt."""

from __future__ import annotations

import argparse
import sys

import anyio

from runtime.api import Runtime
from runtime.messages import ModelSpec, TokensEmitted


async def _generate(args: argparse.Namespace) -> int:
    async with Runtime() as rt:
        await rt.load_model(ModelSpec(name="model", path=args.model, backend=args.backend))
        async with rt.generate("model", args.prompt, max_tokens=args.max_tokens) as stream:
            async for event in stream:
                if isinstance(event, TokensEmitted):
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mlxrt", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="show the runtime on a simulated and a tiny model")
    gen = commands.add_parser("generate", help="generate from one prompt")
    gen.add_argument("--model", required=True, help="an mlx-lm model directory")
    gen.add_argument("--backend", default="mlx", choices=["mlx", "simulated"])
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from runtime.demo import main as demo

        demo()
        return 0
    return anyio.run(_generate, args, backend_options={"use_uvloop": True})


if __name__ == "__main__":
    sys.exit(main())
