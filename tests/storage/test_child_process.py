"""Helper processes die with a parent that is killed outright."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="parent-death signals are a Linux feature")

PARENT = """
import subprocess, sys
from specloop.storage.child_process import die_with_parent
preexec = die_with_parent() if sys.argv[1] == "guarded" else None
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=preexec)
print(child.pid, flush=True)
child.wait()
"""


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for a reaper that may never come here)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _orphan_after_killing_its_parent(mode: str) -> int:
    root = str(Path(__file__).resolve().parents[2])
    parent = subprocess.Popen([sys.executable, "-c", PARENT, mode], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": root})
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    return child


def test_a_guarded_child_is_stopped_when_its_parent_is_killed() -> None:
    child = _orphan_after_killing_its_parent("guarded")
    deadline = time.monotonic() + 10
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(child)


def test_an_unguarded_child_outlives_it() -> None:
    # The control: without the guard the same child survives, so the test above can fail.
    child = _orphan_after_killing_its_parent("unguarded")
    try:
        time.sleep(0.5)
        assert _running(child)
    finally:
        os.kill(child, 9)
