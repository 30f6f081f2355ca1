"""The worker-trainer link's transport: framed messages, passed file descriptors, and sealed shared buffers that
the other side can write but never resize."""

from __future__ import annotations

import os
import socket
import struct

import pytest
import torch
from gpuswarm.node.channel import Channel, ChannelClosed, SharedTensor
from gpuswarm.proto.trainer import MAX_MESSAGE, TRAINER_MESSAGE
from pydantic import ValidationError


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield Channel(a), Channel(b)
    a.close()
    b.close()


def test_messages_and_fds_cross(pair):
    ours, theirs = pair
    buf = SharedTensor.create(10, "t")
    ours.send({"op": "buffers", "n": 1}, fds=[buf.fd])
    message, fds = theirs.recv(timeout=5, max_fds=2)
    assert message == {"op": "buffers", "n": 1} and len(fds) == 1
    mapped = SharedTensor(fds[0], 10)
    mapped.tensor.copy_(torch.arange(10.0))
    assert torch.equal(buf.tensor, torch.arange(10.0))  # one memory, two mappings
    mapped.close()
    buf.close()


def test_sealed_buffer_cannot_be_resized():
    buf = SharedTensor.create(1000, "sealed")
    other = os.open(f"/proc/self/fd/{buf.fd}", os.O_RDWR)  # what a hostile process holding the fd could do
    try:
        for size in (0, 10, 8000):
            with pytest.raises(PermissionError):
                os.ftruncate(other, size)
        assert os.fstat(buf.fd).st_size == 4000
        assert float(buf.tensor.sum()) == 0.0  # still readable: no SIGBUS
    finally:
        os.close(other)
        buf.close()


def test_a_wrong_size_buffer_is_refused():
    buf = SharedTensor.create(10, "small")
    with pytest.raises(ValueError, match="expected 400"):
        SharedTensor(buf.fd, 100)
    buf.close()


def test_oversized_broken_and_closed_frames(pair):
    ours, theirs = pair
    theirs.sock.sendall(struct.pack(">I", MAX_MESSAGE + 1))
    with pytest.raises(ChannelClosed, match="over"):
        ours.recv(timeout=5)
    theirs.sock.sendall(struct.pack(">I", 3) + b"{x]")
    with pytest.raises(ChannelClosed, match="not JSON"):
        ours.recv(timeout=5)
    theirs.sock.sendall(struct.pack(">I", 2) + b"[]")
    with pytest.raises(ChannelClosed, match="not a JSON object"):
        ours.recv(timeout=5)
    with pytest.raises(TimeoutError):
        ours.recv(timeout=0.2)
    with pytest.raises(ValueError, match="limit"):
        ours.send({"x": "a" * MAX_MESSAGE})
    theirs.close()
    with pytest.raises(ChannelClosed):
        ours.recv(timeout=5)


def test_a_dripped_message_still_meets_one_deadline(pair):
    import threading
    import time

    ours, theirs = pair

    def drip():
        theirs.sock.sendall(struct.pack(">I", 100))
        for _ in range(20):
            time.sleep(0.1)
            try:
                theirs.sock.sendall(b" ")
            except OSError:
                return

    threading.Thread(target=drip, daemon=True).start()
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        ours.recv(timeout=0.5)
    assert time.monotonic() - started < 1.5


def test_a_peer_that_stops_reading_times_the_sender_out():
    a, b = socket.socketpair()
    ours = Channel(a, send_timeout=0.3)
    with pytest.raises(TimeoutError):
        for _ in range(100_000):  # the socket buffer fills; b never reads
            ours.send({"op": "step", "pad": "x" * 1000})
    a.close()
    b.close()


def test_deeply_nested_json_is_a_broken_frame(pair):
    ours, theirs = pair
    data = b"[" * 5000 + b"]" * 5000
    theirs.sock.sendall(struct.pack(">I", len(data)) + data)
    with pytest.raises(ChannelClosed, match="not JSON"):
        ours.recv(timeout=5)


@pytest.mark.parametrize("bad", [
    {"kind": "step", "samples": 0, "seconds": 1.0, "loss": 0.5, "position": {"index": 0, "count": 1, "seed": 0,
                                                                            "batches": 1}},
    {"kind": "step", "samples": 4, "seconds": 1.0, "loss": float("nan"),
     "position": {"index": 0, "count": 1, "seed": 0, "batches": 1}},
    {"kind": "metrics", "metrics": {"bad name!": 1.0}},
    {"kind": "metrics", "metrics": {"loss": float("inf")}},
    {"kind": "hello", "params": [], "batch_size": 1, "target_batch_size": 1, "matchmaking_time": 1,
     "averaging_timeout": 1, "optimizer": {}, "metrics": {}, "devices": []},
    {"kind": "hello", "params": [{"name": "w", "shape": [2]}], "batch_size": 1, "target_batch_size": 1,
     "matchmaking_time": 1, "averaging_timeout": 1, "optimizer": {"name": "evil"}, "metrics": {}, "devices": []},
    {"kind": "pwned"},
    {"kind": "saved", "extra": 1},
])
def test_trainer_messages_are_checked(bad):
    with pytest.raises(ValidationError):
        TRAINER_MESSAGE.validate_python(bad)


def test_optimizer_spec_builds_torch_optimizers():
    from gpuswarm.proto.trainer import OptimizerSpec

    params = [torch.nn.Parameter(torch.zeros(3))]
    assert isinstance(OptimizerSpec().build(params), torch.optim.Adam)
    adamw = OptimizerSpec(name="adamw", lr=0.01, betas=(0.9, 0.95), weight_decay=0.1).build(params)
    assert isinstance(adamw, torch.optim.AdamW) and adamw.defaults["betas"] == (0.9, 0.95)
    sgd = OptimizerSpec(name="sgd", lr=0.1, momentum=0.9, nesterov=True).build(params)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["nesterov"] is True
