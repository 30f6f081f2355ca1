"""Shared fixtures: the scripts/ lab helpers on the path, and an autouse guard that no test leaves processes."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))


def pytest_configure(config):
    # A SIGTERM (a CI timeout, a killed run) becomes KeyboardInterrupt, so fixtures still tear their swarms down:
    # swarm processes run in their own sessions and would otherwise outlive the test run.
    signal.signal(signal.SIGTERM, signal.default_int_handler)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Expose each phase's report as item.rep_setup / rep_call, so fixtures can tell whether the test failed."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


@pytest.fixture(autouse=True)
def kill_leftover_children(request):
    """Kill every process a test left behind (node daemons, training processes, p2pd), even after a failure.
    A module whose tests start processes for a shared, module-scoped fixture marks itself `keep_processes`;
    that fixture's own teardown stops them."""
    if request.node.get_closest_marker("keep_processes"):
        yield
        return
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    # New processes whose parent existed before the test belong to a longer-lived (module) fixture: leave them.
    leftovers = []
    for p in psutil.Process().children(recursive=True):
        try:
            # torch's shared-memory manager serves the whole pytest process, whichever test happened to start it.
            if p.pid not in before and not any(parent.pid in before for parent in p.parents()) \
                    and p.name() != "torch_shm_manager":
                leftovers.append(p)
        except psutil.NoSuchProcess:
            pass
    for p in leftovers:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(leftovers, timeout=10)


@pytest.fixture
def artifacts_dir() -> Path:
    """Where tests keep files worth looking at after a run (logs of failed swarms); ignored by git."""
    path = Path(__file__).resolve().parent.parent / "test-artifacts"
    path.mkdir(exist_ok=True)
    return path
