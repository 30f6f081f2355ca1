"""Ctrl-C for long-running commands (`gpuswarm dht ...`, `job status --follow`): a flag set by the signal
handler, raised only at safe points.

`take_ctrl_c` (for `dht`, the command group's callback, run before any subcommand and so before its imports of
hivemind and torch) installs a SIGINT handler that only sets a flag, and asks for system calls it interrupts to
be restarted. Our own code checks the flag at safe points (`interrupted`) and raises KeyboardInterrupt there. A
KeyboardInterrupt raised anywhere else was seen to be lost (swallowed while hivemind and torch were being imported)
or to hang the process for good (while an MPFuture, one per call into the DHT process, mapped shared memory
through torch, whose shared-memory client hangs on EINTR), or, in `--follow`, to hang the CLI when it landed inside
the API client's event loop. A second Ctrl-C leaves at once, exit code 130.

A leaf of the root package: imports nothing but the standard library, so installing the handler loads nothing.
"""

from __future__ import annotations

import os
import signal
import threading

_INTERRUPTED = threading.Event()


def _on_sigint(_signum, _frame) -> None:
    if _INTERRUPTED.is_set():
        os._exit(130)  # the second Ctrl-C: the user does not want to wait for a clean shutdown
    _INTERRUPTED.set()


def take_ctrl_c() -> None:
    """From now on Ctrl-C sets a flag, and system calls it interrupts are restarted."""
    signal.signal(signal.SIGINT, _on_sigint)
    signal.siginterrupt(signal.SIGINT, False)


def interrupted(wait: float = 0.0) -> None:
    """Raise KeyboardInterrupt here, in our code, if Ctrl-C was pressed (waiting up to `wait` seconds for it)."""
    if _INTERRUPTED.wait(wait):
        raise KeyboardInterrupt
