"""A server-wide notice that the server is stopping, and the open generations it must end.

On SIGINT or SIGTERM ``mlxrt serve`` (serving.py) calls ``OpenAIServer.stop_generations``
before uvicorn closes its connections: the notice is given, every open ``GenerationResponse``
stops reading its runtime stream (which cancels the request) and ends its answer properly, a
stream with a last chunk (``finish_reason`` "abort" and an ``error`` object, code
``server_shutting_down``) and ``data: [DONE]``, a request not yet answered with a 503. New
generations are refused the same way. ``wait_ended`` bounds the wait for them (docs/http.md).
"""

from __future__ import annotations

import math

import anyio

from runtime.errors import ServerShuttingDown
from runtime.server.errors import HttpError, error_for_runtime

# The shutdown ending's finish reason: vLLM's for a request it aborted.
SHUTDOWN_FINISH_REASON = "abort"


class ShutdownNotice:
    """Whether the server is stopping, and how many generations are still answering.

    Made inside the event loop (the lifespan): anyio events belong to the loop that runs them.
    """

    def __init__(self) -> None:
        self._stopping = anyio.Event()
        self._open = 0
        self._all_ended = anyio.Event()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    @property
    def open_generations(self) -> int:
        return self._open

    def give(self) -> None:
        """The server is stopping: every open generation ends its answer now."""
        self._stopping.set()
        if self._open == 0:
            self._all_ended.set()

    async def wait_given(self) -> None:
        await self._stopping.wait()

    def opened(self) -> None:
        """A generation started answering (``closed`` must follow, whatever happens)."""
        self._open += 1

    def closed(self) -> None:
        self._open -= 1
        if self._open == 0 and self.stopping:
            self._all_ended.set()

    async def wait_ended(self, within_s: float = math.inf) -> bool:
        """Wait for every open generation to end its answer, at most ``within_s`` seconds;
        False if some had not when the time ran out."""
        with anyio.move_on_after(within_s):
            await self._all_ended.wait()
            return True
        return False


def shutting_down() -> HttpError:
    """The answer to a generation the shutdown ends before its first token, or refuses."""
    return error_for_runtime(
        ServerShuttingDown("the server is shutting down; send the request again once it is back")
    )
