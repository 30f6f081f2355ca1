"""Shared fixtures: the scripts/ lab helpers on the path, an autouse guard that no test leaves processes, and the
test's local swarm lab (`swarm_lab`), stopped after it with its logs kept when it failed."""

from __future__ import annotations

import shutil
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from localswarm import LocalSwarm  # noqa: E402


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


@pytest.fixture
def swarm_lab(tmp_path, artifacts_dir, request) -> Iterator[Callable[..., LocalSwarm]]:
    """Makes the test's LocalSwarm (keyword options as LocalSwarm's) under tmp_path/swarm. After the test every
    process of it is stopped, and when the test failed its logs are kept under test-artifacts/TEST_NAME for whoever
    reads the CI output."""
    labs: list[LocalSwarm] = []

    def make(**options) -> LocalSwarm:
        labs.append(LocalSwarm(tmp_path / "swarm", **options))
        return labs[-1]

    yield make
    for lab in labs:
        lab.stop()
        report = getattr(request.node, "rep_call", None)
        if report is None or report.failed:
            shutil.copytree(lab.logs, artifacts_dir / request.node.name, dirs_exist_ok=True)
