"""Running the app: :class:`Server` binds a socket (port 0 = any free port) and serves the app
with uvicorn on a background thread (tests, embedding) or on the calling thread (the CLI)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Optional

from mstar_rt.serve.requests_in import MAX_BODY_BYTES


class Server:
    """``Server(app, host, port)``; ``start()`` returns once it accepts connections, ``stop()``
    shuts it down. ``port`` is the bound port (known as soon as the object exists)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning") -> None:
        import uvicorn

        self.app, self.host = app, host
        try:
            self._sock = _listen(host, port)
            self.port: int = self._sock.getsockname()[1]
            self._server = uvicorn.Server(uvicorn.Config(
                app, log_level=log_level, lifespan="off", timeout_graceful_shutdown=3,
                ws_max_size=MAX_BODY_BYTES))
        except BaseException:
            # The server owns the app's state from here on (stop() closes it); one that never
            # existed must close it too, or the state's thread pool outlives the failure.
            if hasattr(self, "_sock"):
                self._sock.close()
            self._close_state()
            raise
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # a literal IPv6 address
        return f"http://{host}:{self.port}"

    @property
    def ws_url(self) -> str:
        return "ws" + self.url[4:]

    def run(self) -> None:
        """Serves on this thread until interrupted (uvicorn handles SIGINT / SIGTERM)."""
        try:
            self._server.run(sockets=[self._sock])
        finally:
            self._close_state()

    def start(self, timeout: float = 30.0) -> "Server":
        self._server.config.install_signal_handlers = False  # not the main thread
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name=f"mstar-serve-{self.port}", daemon=True)
        self._thread.start()
        end = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > end:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self._server.force_exit = True
                self._thread.join(timeout)
        self._sock.close()
        self._close_state()

    def _close_state(self) -> None:
        state = getattr(getattr(self.app, "state", None), "serve", None)
        if state is not None:
            state.close()

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port``, or an OSError naming the config key to fix."""
    try:  # the family from the name: an IPv6-only name (ip6-localhost) binds too
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise OSError(f"cannot bind {host}:{port}: the host is not an address this machine "
                      f"resolves ({e}); check server.host") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        # Listening now, not when uvicorn starts: a client that connects as soon as the URL is
        # printed waits in the backlog instead of being refused.
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot bind {host}:{port} ({e}); pick another server.port "
                      "(0 = any free port), or check server.host") from None
    return sock
