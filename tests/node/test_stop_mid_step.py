"""What a stop that cuts the node daemon's supervisor step short (NodeDaemon._step_unless_stopped) leaves behind.

- The step may be the registration that brings the mesh interface up. wireguard-go does not die with the daemon, so
  MeshLink.close takes down a backend whose `up` was still under way. The backend here stands in for wireguard-go
  at MeshBackend's interface (the real one is tested in tests/netns): its `up` blocks until the test lets it go on.
- The step may have left a thread hashing or unpacking in asyncio's default executor; `node start` does not wait for
  it at exit (node.cli._AbandonedAtExit), so the node still stops within its bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

from gpuswarm.mesh.backend import DeviceStatus, MeshBackend
from gpuswarm.node.cli import _AbandonedAtExit
from gpuswarm.node.meshlink import MeshLink
from gpuswarm.proto.models import MeshConfig


class SlowUp(MeshBackend):
    kind = "slow-up"
    interface = "gs0slow0"

    def __init__(self):
        self.started, self.release = threading.Event(), threading.Event()
        self.running = False
        self.downs = 0

    def up(self, address, cidr, listen_port, private_key):
        self.running = True  # the process is started; the rest of `up` (its configuration) takes a while
        self.started.set()
        self.release.wait(10)

    def add_or_update_peer(self, peer, fields=None):
        pass

    def remove_peer(self, public_key):
        pass

    def status(self):
        return DeviceStatus("", 0, ())

    def down(self, timeout: float = 5.0):
        self.downs += 1
        self.running = False

    def is_running(self):
        return self.running


def test_a_stop_during_up_still_takes_the_interface_down(tmp_path):
    backend = SlowUp()

    async def scenario():
        link = MeshLink(tmp_path, 0, backend=backend)
        applying = asyncio.create_task(link.apply(MeshConfig(address="10.77.0.5", cidr="10.77.0.0/16", version=1)))
        assert await asyncio.to_thread(backend.started.wait, 5)
        applying.cancel()  # what the daemon's stop does to its step
        with contextlib.suppress(asyncio.CancelledError):
            await applying
        await link.close()
        backend.release.set()

    asyncio.run(scenario())
    assert backend.downs == 1 and not backend.running


def test_the_daemons_loop_does_not_wait_for_its_executor_threads_at_exit():
    release, finished = threading.Event(), threading.Event()

    def hashing():  # a thread of a step that was cut short, still busy
        release.wait(30)
        finished.set()

    async def daemon():
        loop = asyncio.get_running_loop()
        loop.set_default_executor(_AbandonedAtExit())
        loop.run_in_executor(None, hashing)

    asyncio.run(daemon())  # with asyncio's own executor this returns only once `hashing` has
    assert not finished.is_set()
    release.set()
    assert finished.wait(5)
