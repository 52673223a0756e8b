"""The gate every HTTP request passes first: its API key, then its key's allowance.

A pure ASGI middleware (no ``BaseHTTPMiddleware``), so a streamed answer passes through untouched
and a disconnect reaches the route as it would without it. ``GET /health`` and ``OPTIONS`` (CORS
preflights carry no key) are open, ``/metrics`` as configured; everything else needs an API key (401
``invalid_api_key``, one body for a missing and a wrong key) and puts its ``Tenant`` in the scope.
``POST`` requests that make work take a ticket from their key's ``Allowance`` (429
``rate_limit_exceeded`` with ``Retry-After`` when none is left); a queued request whose client
leaves gives its place back, and the ticket is returned however the request ends. See docs/http.md,
"Security".
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.errors import InvalidApiKey, RateLimited
from runtime.server.allowance import Allowances, PerKeyLimits, Ticket
from runtime.server.auth import TENANT_SCOPE_KEY, ApiKeys, Tenant, presented_key
from runtime.server.errors import HttpError, error_for_code
from runtime.server.shutdown import ShutdownNotice, shutting_down

log = logging.getLogger("mlx_actor_runtime.server")

OPEN_PATHS = frozenset({"/health"})
METRICS_PATH = "/metrics"
UNLIMITED_PATHS = frozenset({"/v1/models/load", "/v1/models/unload"})  # no generation: admin
ANONYMOUS = ""  # the allowance of a server without keys: all its clients together


class KeyGate:
    """The ASGI middleware described above, around ``app``."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        keys: ApiKeys | None,
        metrics_keys: ApiKeys | None = None,
        public_metrics: bool = False,
        allowances: Allowances | None = None,
        shutdown: Callable[[], ShutdownNotice | None] = lambda: None,
    ) -> None:
        self._app = app
        self._shutdown = shutdown  # the server's notice, once its lifespan has made it
        self._keys = keys
        self._metrics_keys = metrics_keys
        self._public_metrics = public_metrics
        self._allowances = allowances

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        path = _route_path(scope)
        if scope["method"] == "OPTIONS" or path in OPEN_PATHS:
            await self._app(scope, receive, send)
            return
        headers = scope["headers"]
        if path == METRICS_PATH:
            if not self._may_read_metrics(presented_key(headers)):
                await _refuse(send, _unauthorized())
                return
            await self._app(scope, receive, send)
            return
        tenant: Tenant | None = None
        if self._keys is not None:
            tenant = self._keys.tenant_of(presented_key(headers))
            if tenant is None:
                await _refuse(send, _unauthorized())
                return
            scope = {**scope, TENANT_SCOPE_KEY: tenant}
        if self._allowances is None or scope["method"] != "POST" or path in UNLIMITED_PATHS:
            await self._app(scope, receive, send)
            return
        await self._within_allowance(
            ANONYMOUS if tenant is None else tenant.id, scope, receive, send
        )

    def _may_read_metrics(self, presented: str | None) -> bool:
        if self._public_metrics:
            return True
        for keys in (self._metrics_keys, self._keys):
            if keys is not None:
                return keys.tenant_of(presented) is not None
        return True  # a server without keys answers everyone

    async def _within_allowance(
        self, tenant: str, scope: Scope, receive: Receive, send: Send
    ) -> None:
        allowances = self._allowances
        assert allowances is not None
        ticket = allowances.enter(tenant)
        if ticket is None:
            log.debug("key %s is at its limit: request refused (429)", tenant or "(none)")
            await _refuse(send, _rate_limited(allowances.limits, tenant != ANONYMOUS))
            return
        try:
            if not ticket.granted:
                notice = self._shutdown()
                read = await _wait_for_turn(ticket, receive, notice)
                if read is None:
                    return  # its client left while it waited: nobody to answer
                if notice is not None and notice.stopping:  # answered, not dropped by uvicorn
                    await _refuse(send, shutting_down())
                    return
                receive = _replaying(read, receive)
            await self._app(scope, receive, send)
        finally:
            allowances.leave(tenant, ticket)  # every exit: done, failed, cancelled, disconnected


def _route_path(scope: Scope) -> str:
    """The path within this app: a host that mounts it (``Mount("/openai", server.app)``) hands
    it the whole path and the mount point as ``root_path``, as Starlette's router reads it."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) :].startswith("/"):
        return path[len(root) :]
    return path


async def _wait_for_turn(
    ticket: Ticket, receive: Receive, notice: ShutdownNotice | None
) -> list[Message] | None:
    """Wait for ``ticket``'s turn, or for the server to start stopping, reading the request
    meanwhile so a disconnect is seen: the messages read (for the app to read again), or None if
    the client left first."""
    read: list[Message] = []
    left = False

    async def watch(scope: anyio.CancelScope) -> None:
        nonlocal left
        while True:
            message = await receive()
            read.append(message)
            if message["type"] == "http.disconnect":
                left = True
                scope.cancel()
                return

    async def stopping(scope: anyio.CancelScope) -> None:
        assert notice is not None
        await notice.wait_given()
        scope.cancel()

    async with anyio.create_task_group() as task_group:
        task_group.start_soon(watch, task_group.cancel_scope)
        if notice is not None:
            task_group.start_soon(stopping, task_group.cancel_scope)
        await ticket.turn.wait()
        task_group.cancel_scope.cancel()
    return None if left else read


def _replaying(read: list[Message], receive: Receive) -> Callable[[], Awaitable[Message]]:
    """``receive`` that hands out the messages already ``read`` first."""
    pending = list(read)

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay


def _unauthorized() -> HttpError:
    message = (
        "this server needs an API key: send a valid one as the header "
        "Authorization: Bearer <key> (or x-api-key: <key>)"
    )
    return error_for_code(InvalidApiKey.code, message, retryable=False)


def _rate_limited(limits: PerKeyLimits, keyed: bool) -> HttpError:
    whose = "this API key's" if keyed else "this server's"
    message = (
        f"{whose} limit is {limits.max_concurrent} requests running and {limits.max_queued} "
        "waiting, and it has that many; try again when one of them ends"
    )
    return error_for_code(RateLimited.code, message, retryable=True)


async def _refuse(send: Send, error: HttpError) -> None:
    body = error.encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *((name.encode(), value.encode()) for name, value in error.headers().items()),
    ]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
