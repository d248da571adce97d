"""The command line that runs a `specloop` subcommand in a child process of this interpreter.

`python -m` puts the working directory first on `sys.path`. Started from a checkout, a child would then
import the checkout's folders (`kernels/`, `daemon/`) as top-level packages in place of installed
distributions of the same name: transformers imports Hugging Face's `kernels`. `-P` (Python 3.11's safe
path) leaves the working directory out; `PYTHONSAFEPATH` does the same for processes that torchrun
starts. specloop itself is only ever imported as `specloop.*`.
"""

import sys

SAFE_PATH_ENV = {"PYTHONSAFEPATH": "1"}


def specloop_command(*args: str) -> list[str]:
    """`specloop ARGS...` as a child of this interpreter (its venv, whatever PATH holds)."""
    return [sys.executable, "-P", "-m", "specloop.daemon.cli", *args]
