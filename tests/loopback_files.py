"""A loopback HTTP server handing out fixed bytes by path, for the tests of remote media fetching
(tests/test_vision_http.py, tests/test_vision_video.py)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@contextlib.contextmanager
def loopback_files(
    routes: Mapping[str, bytes], *, hold: Callable[[str], None] | None = None
) -> Iterator[str]:
    """Serve ``routes`` (path -> body; any other path: 404) on 127.0.0.1, yielding the base URL;
    ``hold(path)`` runs before each answer (a test's slow host waits in it)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if hold is not None:
                hold(self.path)
            payload = routes.get(self.path)
            if payload is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
