"""A `specloop serve` process for benchmarks: started on a free loopback port, yielded once ready.

Benchmarks measure the server as users run it, in its own process: an in-process server thread
would share libgomp and the GIL with the benchmark's other systems (see engine/runtime/torch_thread.py).
"""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from specloop.storage.broker import free_port

READY_S = 300  # the first start on a fresh machine also builds the CPU kernels


def wait_ready(url: str, process: subprocess.Popen, log: Path, timeout_s: float) -> None:
    """Return once the server `process` (output in `log`) answers /ready with 200."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with status {process.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/ready").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"server at {url} not ready within {timeout_s} s: {log.read_text()[-2000:]}")


@dataclass(frozen=True)
class Server:
    url: str
    pid: int

    def cpu_s(self) -> float:
        """User + system CPU seconds of the process so far, all threads (from /proc)."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def server_process(args: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[Server]:
    """`specloop serve <args>` with output in `log`; SIGTERMed on exit."""
    port = free_port()
    command = [str(Path(sys.executable).parent / "specloop"), "serve", "--port", str(port), *args]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, process, log, READY_S)
            yield Server(url, process.pid)
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(60)
