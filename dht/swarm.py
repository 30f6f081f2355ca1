"""`SwarmDHT`: the hivemind DHT peer every gpuswarm process runs, whose process never outlives its owner.

Forked from a daemon with a SIGTERM handler of its own (aiohttp's run_app, asyncio's add_signal_handler, the
worker's stop flag), hivemind's DHT process inherited that handler, ignored the SIGTERM of `DHT.shutdown`'s last
resort, and was found alive half an hour after its coordinator had exited. A SwarmDHT process ignores SIGTERM on
purpose (a signal to the whole process group, from systemd or a terminal, is for its owner, which still needs the
DHT to say goodbye), gets SIGKILL when its owner dies (PR_SET_PDEATHSIG), and `terminate`, the last resort, is
SIGKILL.

It overrides only `multiprocessing.Process` methods (`run`, `terminate`) of `hivemind.DHT`, which is a ForkProcess;
that hivemind 1.1.12's `DHT.shutdown` falls back to `terminate` is what makes `terminate` the last resort.
Owns the process's lifecycle only: which record validators a peer installs is its caller's choice
(`gpuswarm.dht.validators`).
"""

from __future__ import annotations

import ctypes
import os
import signal

import hivemind

PR_SET_PDEATHSIG = 1


class SwarmDHT(hivemind.DHT):
    authority: str | None = None  # for readers (gpuswarm.dht.inspect): the coordinator's key records are checked with

    def __init__(self, *args, **kwargs):
        self._owner_pid = os.getpid()  # before hivemind's __init__, which may start the process
        super().__init__(*args, **kwargs)

    def run(self) -> None:  # in the forked DHT process
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != self._owner_pid:  # the owner died before prctl took effect
            os._exit(1)
        super().run()

    def terminate(self) -> None:  # hivemind's DHT.shutdown calls it when the process did not stop in time
        self.kill()
