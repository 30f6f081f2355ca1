"""coordinator/sigcheck.py: signature checks in a real child process, batched, and what happens when it dies."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from aiohttp.test_utils import TestServer
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from gpuswarm.coordinator import sigcheck
from gpuswarm.coordinator.app import create_app
from gpuswarm.coordinator.config import SIGNATURES, CoordinatorConfig
from gpuswarm.coordinator.sigcheck import SignatureChecker
from gpuswarm.proto.signing import valid


def raw(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def cases() -> list[tuple[tuple[bytes, bytes, bytes], bool]]:
    """(key, signature, message) items with the answer each must get: genuine, tampered, wrong key, bad sizes."""
    a, b = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    out = []
    for n in range(40):
        message = f"heartbeat {n}".encode() * (n + 1)
        signature = a.sign(message)
        out += [((raw(a), signature, message), True),
                ((raw(a), signature, message + b"!"), False),
                ((raw(b), signature, message), False),
                ((raw(a), signature[:-1], message), False),
                ((raw(a)[:31], signature, message), False),
                ((b"\x00" * 32, signature, message), False)]
    return out


@pytest.fixture
async def checker():
    checker = SignatureChecker()
    await checker.start()
    yield checker
    await checker.stop()


async def test_concurrent_checks_get_each_their_own_answer(checker: SignatureChecker):
    items = cases()
    answers = await asyncio.gather(*(checker.check(*item) for item, _ in items))
    assert answers == [expected for _, expected in items]
    assert answers == [valid(*item) for item, _ in items]


def test_the_childs_frame_answers_item_by_item():
    items = [item for item, _ in cases() if len(item[0]) == 32 and len(item[1]) == 64]
    frame = sigcheck.encode(items)
    assert sigcheck.answer(frame[4:]) == bytes(valid(*item) for item in items)


async def test_a_dead_child_costs_no_answer_and_is_replaced(checker: SignatureChecker, monkeypatch):
    items = cases()
    first = checker._process
    os.kill(first.pid, signal.SIGKILL)
    await first.wait()
    monkeypatch.setattr(sigcheck, "RESPAWN_INTERVAL", 3600.0)  # no new child yet: checked in the event loop
    assert await asyncio.gather(*(checker.check(*item) for item, _ in items)) == [e for _, e in items]
    assert checker._process is None
    monkeypatch.setattr(sigcheck, "RESPAWN_INTERVAL", 0.0)
    assert await asyncio.gather(*(checker.check(*item) for item, _ in items)) == [e for _, e in items]
    assert checker._process is not None and checker._process.pid != first.pid
    assert checker._process.returncode is None


async def test_stop_ends_the_child_within_its_timeout():
    checker = SignatureChecker()
    await checker.start()
    process = checker._process
    started = time.monotonic()
    await checker.stop()
    assert process.returncode == 0  # it saw the end of its input and left on its own
    assert time.monotonic() - started < sigcheck.STOP_TIMEOUT + 1


async def test_the_app_starts_the_child_only_when_configured_and_ends_it(tmp_path):
    for apart in (False, True):
        app = create_app(CoordinatorConfig(data_dir=tmp_path / str(apart), start_dht=False, signature_process=apart))
        async with TestServer(app):
            assert (SIGNATURES in app) is apart
            process = app[SIGNATURES]._process if apart else None
            assert process is None or process.returncode is None
        assert process is None or process.returncode == 0


async def test_a_child_that_stops_answering_is_killed_and_costs_no_answer(checker: SignatureChecker, monkeypatch):
    monkeypatch.setattr(sigcheck, "ROUND_TRIP_TIMEOUT", 0.5)
    monkeypatch.setattr(sigcheck, "RESPAWN_INTERVAL", 3600.0)
    stuck = checker._process
    os.kill(stuck.pid, signal.SIGSTOP)
    items = cases()
    started = time.monotonic()
    assert await asyncio.gather(*(checker.check(*item) for item, _ in items)) == [e for _, e in items]
    assert time.monotonic() - started < 5
    assert stuck.returncode == -signal.SIGKILL and checker._process is None


async def test_large_messages_are_checked_too(checker: SignatureChecker):
    key = Ed25519PrivateKey.generate()
    message = b"p" * (sigcheck.MAX_MESSAGE + 1)
    signature = key.sign(message)
    assert await checker.check(raw(key), signature, message)
    assert not await checker.check(raw(key), signature, message[:-1] + b"q")


async def test_a_module_in_the_working_directory_cannot_answer_for_the_child(tmp_path, monkeypatch):
    """A `gpuswarm` package where the coordinator was started (an old checkout) would shadow ours in `python -m`."""
    fake = tmp_path / "gpuswarm" / "coordinator"
    fake.mkdir(parents=True)
    (tmp_path / "gpuswarm" / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "sigcheck.py").write_text(
        "import sys\n"
        "while header := sys.stdin.buffer.read(4):\n"
        "    body = sys.stdin.buffer.read(int.from_bytes(header, 'big'))\n"
        "    sys.stdout.buffer.write(b'\\x01' * 512)\n"
        "    sys.stdout.buffer.flush()\n")
    monkeypatch.chdir(tmp_path)
    checker = SignatureChecker()
    await checker.start()
    try:
        key = Ed25519PrivateKey.generate()
        assert not await checker.check(raw(key), key.sign(b"genuine"), b"forged")
        assert checker._process is not None and checker._process.returncode is None  # our child answered
    finally:
        await checker.stop()
