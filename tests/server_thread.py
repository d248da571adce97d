"""Run an ASGI app under uvicorn on a background thread, on a loopback port the OS picks.

For tests and benchmarks that need a real HTTP server in-process. `specloop serve` does not use
it: there uvicorn runs on the main thread, where it handles SIGINT/SIGTERM.
"""

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI

_START_TIMEOUT_S = 30


@contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", send_buffer: int | None = None) -> Iterator[str]:
    """Yield the server's base URL once it accepts connections; shut it down on exit. `send_buffer`
    fixes each connection's kernel send buffer (accepted sockets inherit it), as a slow network would."""
    sock = socket.socket()
    if send_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    sock.bind((host, 0))  # binding here, not in uvicorn, means the port is known and never raced for
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
