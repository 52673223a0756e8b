"""``OpenAIServer`` on uvicorn, stopped cleanly by SIGINT (Ctrl-C) or SIGTERM.

uvicorn alone, on a signal, waits for open streams up to its graceful timeout, then cancels them
mid-write (a traceback per stream, the client cut off without ``[DONE]``), and at the end raises
the signal again, so Ctrl-C ends in ``KeyboardInterrupt`` (exit 130) and SIGTERM in exit -15.
Here the signal first ends every open generation properly (``OpenAIServer.stop_generations``),
then uvicorn closes the idle connections and the lifespan leaves the runtime; the process returns
normally (exit 0) and says so in one line. A second Ctrl-C still forces the exit (uvicorn's).
"""

from __future__ import annotations

import contextlib
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from types import FrameType

import uvicorn

from runtime.server.app import OpenAIServer

STOP_GENERATIONS_S = 5.0  # how long their endings may take to be sent (a decode step or two)
_HANDLED = (signal.SIGINT, signal.SIGTERM)


class GracefulServer(uvicorn.Server):
    """A ``uvicorn.Server`` that ends the app's generations before closing its connections."""

    def __init__(self, config: uvicorn.Config, app: OpenAIServer) -> None:
        super().__init__(config)
        self._openai = app
        self.stop_signal: signal.Signals | None = None
        self.ended_generations = 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.stop_signal is None:
            self.stop_signal = signal.Signals(sig)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, without raising the signal again once the server has stopped: a requested
        stop is a clean exit."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in _HANDLED}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if not self.force_exit:
            self.ended_generations = await self._openai.stop_generations(STOP_GENERATIONS_S)
        await super().shutdown(sockets)


def serve(app: OpenAIServer, config: uvicorn.Config) -> None:
    """Serve ``app`` until SIGINT or SIGTERM, then stop cleanly and print one line saying so."""
    server = GracefulServer(config, app)
    server.run()
    if server.stop_signal is not None:
        ended = server.ended_generations
        open_note = f", {ended} open request{'s' if ended != 1 else ''} ended" if ended else ""
        print(f"mlxrt serve: stopped ({server.stop_signal.name}{open_note})", file=sys.stderr)
