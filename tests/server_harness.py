"""A real uvicorn server on a free loopback port, in a background thread, for tests."""

from __future__ import annotations

import threading
import time

import uvicorn

from specav.config import ServerConfig
from specav.server.app import build_app


class RunningServer:
    """`with RunningServer(engine, config) as s:` serves `s.url` until the block ends."""

    def __init__(self, engine, config: ServerConfig = ServerConfig(port=0), model: str = "tiny",
                 state_identity: dict | None = None) -> None:
        self.engine = engine
        self.app = build_app(engine, config, model, state_identity)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "RunningServer":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def wait_until(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    """Poll until predicate() is true (a bounded wait for the server's threads, not a timing assert)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
