"""Root fixtures shared by every test package: the embedded Kafka-compatible broker.

Tests run torch on one thread: with two OpenMP threads a tiny model's matmuls slowed 16x (62 s vs
3.8 s for the same test) whenever another process loaded the 2 cores, because the threads spin at
every barrier. Benchmarks, not tests, measure multi-threaded speed.

`broker` is one tansu process with memory storage for the whole session (fast; a restart would
lose everything, so tests that restart use `durable_broker`). `durable_broker` is a fresh tansu on
S3 storage against a moto server on loopback, per test, which keeps topics, records and committed
offsets across `restart()`. Both are real processes and are always stopped.
"""

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kernels.cpu_decode import load as load_cpu_kernels
from storage.broker import EmbeddedBroker, LocalS3

torch.set_num_threads(1)
# The first build of the C++ CPU kernels takes about 40 s; do it here, outside every test's timeout.
load_cpu_kernels()


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    log = tmp_path_factory.mktemp("broker") / "tansu.log"
    with open(log, "wb") as handle, EmbeddedBroker(log=handle) as running:
        yield running


@pytest.fixture
def durable_broker(tmp_path: Path) -> Iterator[EmbeddedBroker]:
    with open(tmp_path / "moto.log", "wb") as moto_log, open(tmp_path / "tansu.log", "wb") as log:
        with LocalS3(log=moto_log) as s3, EmbeddedBroker(s3=s3, log=log) as running:
            yield running
