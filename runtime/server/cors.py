"""CORS for browser UIs: ``ServerConfig.allowed_origins`` (``mlxrt serve --allowed-origins``,
mlx_lm.server's flag) through Starlette's ``CORSMiddleware``; none by default (docs/http.md,
Browsers)."""

from __future__ import annotations

from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware


def cors_middleware(origins: tuple[str, ...]) -> list[Middleware]:
    """Starlette's CORS for the allowed origins (preflight ``OPTIONS`` answered, the
    ``Access-Control-*`` headers sent); none without them: a browser page on another origin
    cannot read a reply (the browser's same-origin rule), as before."""
    if not origins:
        return []
    return [
        Middleware(
            CORSMiddleware,
            allow_origins=list(origins),
            allow_methods=["GET", "POST"],
            allow_headers=["*"],  # Authorization, Content-Type, the OpenAI SDK's x-stainless-*
            expose_headers=["x-request-id", "retry-after"],
        )
    ]
