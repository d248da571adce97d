"""The one long-lived thread that runs torch in a server: it builds the model and the engine, then
runs the engine loop.

libgomp gives every OS thread that starts a parallel region its own team of worker threads, and
those teams outlive their work (even, here, the thread that made them). Once a process holds more
of these threads than there are cores, libgomp stops spinning between parallel regions and parks
its workers in the kernel, so every region pays a wake-up. Measured here (SmolLM2, bf16, batch 1,
2 cores): the engine decoded at 98 tok/s on the thread that had loaded the model and built its KV
cache, and at 57-62 tok/s on a second thread, whether the first had loaded the model itself or
had handed loading to a thread that had already exited. So `specloop serve` does all of its torch
work on this thread. (`OMP_WAIT_POLICY=ACTIVE` hides the wake-ups in a benchmark, but then idle
workers spin: 2.0 CPU-seconds in 2 idle seconds, and the served speed measured lower, 41-44.)

This file is only that thread; which work runs on it is `engine/server/cli.py`'s and
`engine/runtime/llm_engine.py`'s.
"""

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


class TorchThread:
    """A daemon thread that runs the callables given to `submit`, one after another, in order."""

    def __init__(self, name: str = "specloop-engine") -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], object], Future]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T]) -> "Future[T]":
        done: Future[T] = Future()
        self._jobs.put((fn, done))
        return done

    def run(self, fn: Callable[[], T]) -> T:
        """`fn()` on this thread; blocks until it returns, and raises what it raised."""
        return self.submit(fn).result()

    def _work(self) -> None:
        while True:
            fn, done = self._jobs.get()
            if done.set_running_or_notify_cancel():
                try:
                    done.set_result(fn())
                except BaseException as e:  # handed to the caller through the future
                    done.set_exception(e)
