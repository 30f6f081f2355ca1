"""`runner.torch_threads`: how many torch threads a job's worker and trainer get (a pure function)."""

from __future__ import annotations

import os

from gpuswarm.node.runner import torch_threads, usable_cpus
from hypothesis import given
from hypothesis import strategies as st


def test_examples():
    assert torch_threads(0, 0, 2, None) == 1  # a CPU node: its one job gets every core but one
    assert torch_threads(0, 0, 16, None) == 15
    assert torch_threads(0, 0, 1, None) == 1
    assert torch_threads(1, 1, 16, None) == 16  # one GPU, the whole machine
    assert torch_threads(1, 8, 16, None) == 2  # one of eight GPUs: an eighth of the cores
    assert torch_threads(8, 8, 16, None) == 16
    assert torch_threads(1, 4, 2, None) == 1  # never none
    assert torch_threads(1, 1, 16, 4.0) == 4  # the sandbox's CPU quota bounds it
    assert torch_threads(1, 1, 16, 0.5) == 1


@given(job=st.integers(0, 64), node=st.integers(0, 64), cpus=st.integers(1, 512),
       quota=st.none() | st.floats(0.01, 1024))
def test_a_share_of_the_cpus_within_the_quota(job, node, cpus, quota):
    threads = torch_threads(job, node, cpus, quota)
    assert 1 <= threads <= cpus
    if quota is not None:
        assert threads <= max(1, int(quota))
    if node > 0 and job <= node:
        # A job holding some of a node's GPUs gets at most that share of the cores (one thread at least).
        assert threads <= max(1, cpus * job // node)


def test_usable_cpus_is_within_this_process_affinity():
    assert 1 <= usable_cpus() <= len(os.sched_getaffinity(0))
