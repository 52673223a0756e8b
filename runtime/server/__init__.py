"""An OpenAI-compatible HTTP API over the ``Runtime`` (Starlette on uvicorn); see docs/http.md.

Modules, one job each: ``app`` (routes, lifespan), ``schema`` (wire format), ``translate``
(request bodies → ``generate`` arguments), ``render`` (events → bodies and chunks),
``generation`` (one request's response: JSON or SSE, cancelled on disconnect), ``errors``
(runtime codes → HTTP statuses and OpenAI error bodies), ``metrics`` (``GET /metrics``: the
registry, and what the HTTP layer observes), ``stats_collector`` (``Runtime.stats()`` as
Prometheus metric families at scrape time), ``gate`` (API keys and per-key limits before every
route), ``auth`` (keys and tenants), ``allowance`` (each key's running and waiting requests).
"""

from runtime.server.app import OpenAIServer
from runtime.server.auth import ApiKeys
from runtime.server.config import ServerConfig

__all__ = ["ApiKeys", "OpenAIServer", "ServerConfig"]
