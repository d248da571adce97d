"""`TorchThread` runs everything on one thread, in order, and the engine loop runs where it is told."""

import threading
import time

import pytest

from specloop.engine.runtime.llm_engine import EngineConfig, LLMEngine
from specloop.engine.runtime.torch_thread import TorchThread
from tests.engine.runtime.test_llm_engine import tiny

pytestmark = pytest.mark.timeout(60)


def test_runs_in_order_on_one_thread_and_passes_errors_back() -> None:
    worker = TorchThread("test-torch")
    seen: list[tuple[int, str]] = []
    futures = [worker.submit(lambda i=i: seen.append((i, threading.current_thread().name))) for i in range(5)]
    assert worker.run(lambda: 7) == 7
    assert all(f.done() for f in futures)
    assert seen == [(i, "test-torch") for i in range(5)]
    with pytest.raises(ZeroDivisionError):
        worker.run(lambda: 1 / 0)
    assert worker.run(lambda: "still working") == "still working"


def test_engine_loop_runs_on_the_thread_that_built_it() -> None:
    worker = TorchThread("test-engine")
    engine = worker.run(lambda: LLMEngine(tiny(), EngineConfig(num_slots=1, max_len=64), [], thread=worker))
    engine.start()
    probe = worker.submit(lambda: threading.current_thread().name)
    time.sleep(0.2)
    assert engine.alive and not probe.done()  # the loop holds the worker thread
    engine.stop()
    assert probe.result(timeout=10) == "test-engine" and not engine.alive
