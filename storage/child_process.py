"""Helper processes that do not outlive the process that started them.

`specloop up` and the test fixtures start the broker, moto and the sink as child processes and stop
them in order on SIGINT or SIGTERM. A parent killed outright (SIGKILL, the OOM killer, a test's
timeout) runs no clean-up, and its children used to live on: a broker and a sink of a killed test
run were found still running two hours later, holding ports and a consumer group. On Linux the
kernel can signal a child when its parent dies (`PR_SET_PDEATHSIG`); the children get SIGTERM, so
the sink still flushes and commits what it holds.

The signal follows the *thread* that started the child, so start these from a thread that lives as
long as the process (the main thread, everywhere here). Elsewhere than Linux this does nothing.

Not here: starting or stopping any particular process (`storage/broker.py`, `daemon/stack.py`). It
lives in storage, the lower of its two users: the broker here, and `specloop up`, which imports storage.
"""

import ctypes
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
# Loaded here, before any fork: the function below runs between fork and exec, where little is safe.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def die_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` for `subprocess.Popen` that has the child sent SIGTERM when this process dies,
    or None where the OS cannot."""
    if _LIBC is None:
        return None
    parent = os.getpid()

    def set_parent_death_signal() -> None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the request took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return set_parent_death_signal
