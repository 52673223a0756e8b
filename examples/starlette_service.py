"""A service that embeds the runtime in its own Starlette app, beside its own routes.

A host with its own HTTP API (here, a writing assistant) that also wants the OpenAI-compatible
endpoints for clients that speak that protocol runs **one** runtime for both: it mounts the
runtime's ``OpenAIServer`` app under ``/openai`` and serves its own routes from the same
``Runtime`` (``OpenAIServer.runtime``). Starlette does not run a mounted app's lifespan, so the
host's lifespan enters it: that starts the ``Runtime`` and loads the model before the first request
is accepted, and leaving it (at shutdown) cancels what still runs and stops the runtime.

Routes:

- ``POST /suggest`` (the host's own): ``{"user": "ada", "text": "Dear Sir, I am writing"}`` ->
  ``{"status": "shown", "suggestion": "...", "cached_tokens": 12}``. A user's newer request
  supersedes their older one still running (``session=user, supersede=True``): the older one
  answers ``{"status": "superseded"}``, as an editor's keystrokes want;
- ``GET /status`` (the host's own): the runtime's counters for the model, from ``Runtime.stats()``;
- ``/openai/v1/completions``, ``/openai/v1/chat/completions``, ``/openai/v1/models``, ... : the
  runtime's OpenAI-compatible API (docs/http.md), base URL ``http://HOST:PORT/openai/v1``.

    python examples/starlette_service.py                  # the default model on 127.0.0.1:8000
    python examples/starlette_service.py --port 0         # any free port (printed when ready)
    curl -s localhost:8000/suggest -d '{"user": "ada", "text": "The capital of France is"}'
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import socket
import sys
from collections.abc import AsyncIterator, Callable

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route

from runtime import Cancelled, Failed, InvalidRequest, ModelSpec, RuntimeConfig
from runtime.server import OpenAIServer, ServerConfig


class SuggestRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The body of ``POST /suggest``."""

    user: str
    text: str
    max_tokens: int = 8


_suggest_decoder = msgspec.json.Decoder(SuggestRequest)
# The counters ``GET /status`` shows (docs/reuse.md lists them all).
STATUS_COUNTERS = (
    "prefilled_tokens",
    "cached_prompt_tokens",
    "decoded_tokens",
    "generates_superseded",
    "prefills_aborted",
)


def build_app(spec: ModelSpec, on_ready: Callable[[], None] = lambda: None) -> Starlette:
    """The host's app: its own routes, and the runtime's OpenAI API under ``/openai``.
    ``on_ready`` runs once the model is loaded, before the first request is accepted."""
    openai = OpenAIServer(
        ServerConfig(models=(spec,), runtime=RuntimeConfig(kv_budget_bytes=256 << 20))
    )

    async def suggest(request: Request) -> JSONResponse:
        try:
            body = _suggest_decoder.decode(await request.body())
        except msgspec.DecodeError as error:
            message = f'{error}; send {{"user": "NAME", "text": "TEXT", "max_tokens": 8}}'
            return JSONResponse({"error": message}, status_code=400)
        try:
            completion = await openai.runtime.complete(
                spec.name,
                body.text,
                max_tokens=body.max_tokens,
                stop=["\n"],
                session=body.user,
                supersede=True,  # this user's newer text makes the older suggestion moot
            )
        except InvalidRequest as error:  # e.g. max_tokens 0, or empty text
            return JSONResponse({"error": error.message, "code": error.code}, status_code=400)
        match completion.terminal:
            case Cancelled(reason=reason):
                return JSONResponse({"status": reason})
            case Failed(code=code, message=message, retryable=retryable):
                status = 503 if retryable else 400
                return JSONResponse({"error": message, "code": code}, status_code=status)
        started = completion.started
        return JSONResponse(
            {
                "status": "shown",
                "suggestion": completion.text,
                "cached_tokens": 0 if started is None else started.cached_tokens,
            }
        )

    async def status(_request: Request) -> JSONResponse:
        counters: dict[str, int] = dict.fromkeys(STATUS_COUNTERS, 0)
        for address, actor in openai.runtime.stats().actors.items():
            if address.startswith(f"engine:{spec.name}#"):  # one engine per load of the model
                for name in STATUS_COUNTERS:
                    counters[name] += actor.counters.get(name, 0)
        return JSONResponse({"model": spec.name, "counters": counters})

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        # The mounted OpenAI app's lifespan: the Runtime starts and the model loads here.
        async with openai.app.router.lifespan_context(openai.app):
            on_ready()
            yield

    return Starlette(
        routes=[
            Route("/suggest", suggest, methods=["POST"]),
            Route("/status", status, methods=["GET"]),
            Mount("/openai", app=openai.app),
        ],
        lifespan=lifespan,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="examples:\n"
        "  python examples/starlette_service.py\n"
        "  python examples/starlette_service.py --port 0 --model gemma3-270m\n"
        '  curl -s localhost:8000/suggest -d \'{"user": "ada", "text": "Once upon a"}\'\n'
        "  curl -s localhost:8000/openai/v1/completions "
        '-d \'{"model": "assistant", "prompt": "Hi"}\'',
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        metavar="PATH",
        help="an mlx-lm directory, a .gguf file or a known model (default: smollm2-135m-instruct)",
    )
    parser.add_argument("--name", default="assistant", help="the model's name in requests")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port")
    args = parser.parse_args(argv)
    # Bound before the app starts, so that the port is known (--port 0) and a request sent while
    # the model loads waits in the socket's backlog rather than being refused.
    listener = socket.create_server((args.host, args.port))
    host, port = listener.getsockname()[:2]

    def ready() -> None:
        print(f"ready on http://{host}:{port} (OpenAI API: http://{host}:{port}/openai/v1)")
        sys.stdout.flush()

    print(f"loading {args.model} (a known model is fetched and converted on first use)...")
    app = build_app(ModelSpec(name=args.name, path=args.model), on_ready=ready)
    config = uvicorn.Config(
        app,
        loop="uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        lifespan="on",
        log_level="warning",
    )
    # uvicorn shuts down gracefully on Ctrl-C, then raises it again: that is a clean exit here.
    with listener, contextlib.suppress(KeyboardInterrupt):
        uvicorn.Server(config).run(sockets=[listener])  # until Ctrl-C or SIGTERM
    return 0


if __name__ == "__main__":
    sys.exit(main())
