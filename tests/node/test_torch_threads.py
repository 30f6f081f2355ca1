"""`runner.torch_threads`: how many torch threads a job's worker and trainer get (a pure function), and
`trainer.configure_torch`: how those threads compute."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
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


FLUSH_CHECK = """
import sys
from gpuswarm.node.trainer import configure_torch
import torch
if sys.argv[1] == "configured" and not configure_torch(2):
    print("unsupported")
else:
    torch.set_num_threads(2)
    small = torch.full((1 << 20,), 1e-30) * 1e-10  # 1e-40: a subnormal float32 unless flushed
    print(int((small != 0).sum()))
"""


def subnormals_left(how: str) -> str:
    return subprocess.run([sys.executable, "-c", FLUSH_CHECK, how], capture_output=True, text=True, timeout=120,
                          check=True).stdout.strip()


def test_configured_threads_flush_subnormals_on_every_intra_op_thread():
    # A million elements: torch splits the multiply over both threads, the pool's own included.
    flushed = subnormals_left("configured")
    if flushed == "unsupported":
        pytest.skip("this CPU cannot flush subnormals (not x86 with SSE3)")
    assert flushed == "0"
    assert subnormals_left("plain") == str(1 << 20)  # the same multiply keeps them without it
