"""What an HTTP server serves and to whom: ``ServerConfig``, and the per-key limits it asks for.

One frozen value a host (or ``mlxrt serve``) builds once: the models, the runtime's own config, the
request defaults OpenAI's clients expect, the keys and their allowances, CORS origins and where
media may be read from. ``allowances_of`` checks the parts msgspec cannot (keys given as plain
strings, a queue without a limit) and raises ``InvalidConfig`` naming them. See docs/http.md.
"""

from __future__ import annotations

import msgspec

from runtime.errors import InvalidConfig
from runtime.host.config import RuntimeConfig
from runtime.messages import ModelSpec
from runtime.server.allowance import Allowances, PerKeyLimits
from runtime.server.auth import ApiKeys


class ServerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What to serve. ``models`` load at start-up, in order (each with its own
    ``keep_alive_s``); a larger body than ``max_body_bytes`` is refused with 413 (the default
    holds a million-token prompt as JSON token ids; a larger one could only fail the context
    check, after tokenizing it). ``offer_cached_models``: the known models and the cached GGUF
    conversions are available too (loaded by ``POST /v1/models/load``, or on a request's demand
    with ``runtime.auto_load``), with ``keep_alive_s`` (None: kept loaded); off by default, so a
    host serves only its own models unless it asks (``mlxrt serve`` does)."""

    models: tuple[ModelSpec, ...]
    runtime: RuntimeConfig = RuntimeConfig()
    max_body_bytes: int = 8 << 20
    offer_cached_models: bool = False
    # The backend a catalog model loads on: "auto" picks per file (runtime/backends/choice.py).
    catalog_backend: str = "mlx"
    keep_alive_s: float | None = None
    # The temperature of a request that sends none: OpenAI's 1.0 (``mlxrt serve --temp``: 0).
    default_temperature: float = 1.0
    # Who may use it (gate.py, docs/http.md "Security"). ``api_keys`` None: anyone who reaches
    # the port. ``metrics_keys``: the only keys that read /metrics (else any API key does);
    # ``public_metrics``: /metrics needs none. Per key (or, without keys, for all clients
    # together): at most ``max_concurrent_per_key`` requests run, ``max_queued_per_key`` wait.
    api_keys: ApiKeys | None = None
    metrics_keys: ApiKeys | None = None
    public_metrics: bool = False
    max_concurrent_per_key: int | None = None
    max_queued_per_key: int = 0
    # The token limit of a request that sends none (``mlxrt serve --max-tokens``); None: OpenAI's
    # (16 for completions; chat: the rest of the context, up to runtime.default_max_tokens).
    default_max_tokens: int | None = None
    # Browser origins allowed to call the API (CORS; "*": any); empty: no CORS headers at all.
    allowed_origins: tuple[str, ...] = ()
    # Directories whose files ``image_url`` and ``video_url`` parts may name (``mlxrt serve
    # --media-dir``); empty: only data URLs.
    media_dirs: tuple[str, ...] = ()
    # Fetch remote (http/https) image and video URLs, each at most 20 MiB within ``fetch_timeout_s``
    # (``mlxrt serve --fetch-images``); off: they are refused.
    fetch_images: bool = False
    fetch_timeout_s: float = 10.0


def allowances_of(config: ServerConfig) -> Allowances | None:
    """The per-key limits; raises ``InvalidConfig`` for them, or for keys given as plain strings
    (msgspec does not check a struct's field types when it is built)."""
    for name in ("api_keys", "metrics_keys"):
        if not isinstance(getattr(config, name), ApiKeys | None):
            raise InvalidConfig(
                f"{name} must be runtime.server.ApiKeys([...]) (which keeps only their digests) "
                "or None, not plain strings"
            )
    if config.max_concurrent_per_key is None:
        if config.max_queued_per_key:
            raise InvalidConfig(
                "max_queued_per_key limits the queue of max_concurrent_per_key, which is unset; "
                "set both"
            )
        return None
    return Allowances(PerKeyLimits(config.max_concurrent_per_key, config.max_queued_per_key))
