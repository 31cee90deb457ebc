"""Running an app on uvicorn: on a socket bound first (so a busy port is a clear error and port 0 works), in the
foreground with graceful Ctrl-C / SIGTERM, or in a background thread (tests, notebooks, benchmarks)."""
from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI

BACKSTOP_S = 5.0  # after the drain's aborts, how long streams get to end before uvicorn cancels them


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 picks a free one. Raises OSError naming the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn that, on shutdown, stops accepting, lets running requests finish for `drain_s`, then aborts the
    rest through the engine: their clients get finish_reason "abort" and a proper end of stream, not a cut
    connection. uvicorn's own graceful timeout stays as a backstop behind it."""

    def __init__(self, config: uvicorn.Config, abort_all: Callable[[], None], drain_s: float):
        super().__init__(config)
        self._abort_all = abort_all
        self._drain_s = drain_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(self._drain_s, self._abort_all)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def server_for(app: FastAPI, shutdown_timeout_s: float, access_log: bool = True,
               log_level: str = "info") -> DrainingServer:
    """A server for an app from build_app (whose engine, app.state.engine, it aborts on a slow shutdown)."""
    config = uvicorn.Config(app, timeout_graceful_shutdown=shutdown_timeout_s + BACKSTOP_S, access_log=access_log,
                            log_level=log_level)
    return DrainingServer(config, app.state.engine.abort_all, shutdown_timeout_s)


class ServerThread:
    """`with ServerThread(app) as server:` serves `app` on server.url until the block ends."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, shutdown_timeout_s: float = 5.0):
        self.socket = bind_socket(host, port)
        self.host, self.port = host, self.socket.getsockname()[1]
        self.server = server_for(app, shutdown_timeout_s, access_log=False, log_level="warning")
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc_info) -> None:
        self.server.should_exit = True
        self._thread.join()
        self.socket.close()
