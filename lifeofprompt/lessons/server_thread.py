"""The server in a background thread: how chapters 12 and 13, the server's tests and
``benchmarks/server_ttft.py`` run it beside their own code.

``with ServerThread(engine) as server:`` serves ``serving/server.py: build_app`` on 127.0.0.1 and a
free port, through the same uvicorn set-up as ``python -m lifeofprompt serve`` (``uvicorn_server``),
until the block ends. The ``serve`` command runs the server in the foreground and never uses this.

    from lifeofprompt.lessons.server_thread import ServerThread
    with ServerThread(engine) as server:          # 127.0.0.1, a free port
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
"""

from __future__ import annotations

import socket
import threading
import time

from ..serving.engine_loop import EngineLoop
from ..serving.server import ServerConfig, build_app, uvicorn_server


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ServerThread:
    """uvicorn in a background thread, for tests and notebooks: ``with ServerThread(engine) as s: s.url``.

    Binds 127.0.0.1 on a free port by default; leaving the block stops uvicorn and the engine thread.
    """

    def __init__(
        self,
        engine,
        host: str = "127.0.0.1",
        port: int | None = None,
        model_name: str | None = None,
        log_level: str = "warning",
        config: ServerConfig | None = None,
    ):
        self.engine = engine
        self.host, self.port = host, port or free_port(host)
        self.config = config or ServerConfig(shutdown_timeout=5)
        self.app = build_app(engine, model_name=model_name, config=self.config)
        self.server = uvicorn_server(self.app, self.host, self.port, log_level, self.config.shutdown_timeout)
        self.thread = threading.Thread(target=self.server.run, name="lifeofprompt-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def engine_loop(self) -> EngineLoop:
        return self.app.state.engine_loop

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.engine_loop.stop()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
