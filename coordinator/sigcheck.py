"""Ed25519 checks of node messages in a child process, so that they use another core than the event loop's.

Owns `SignatureChecker`: `check(key, signature, message)` queues one check, and one task sends everything that
queued up meanwhile to the child as one frame and wakes each caller with its answer. Node requests are the
coordinator's hot path (every node heart-beats every 2 s) and a check costs 60-190 µs of CPU, about a third of a
heartbeat; in a thread it would not help, because each check returns into a wait for the GIL (decision 0041).

The child (`python -P -m gpuswarm.coordinator.sigcheck`) reads frames from stdin and answers on stdout, imports only
`proto.signing`, holds nothing secret, and ends when its stdin closes (the coordinator stopped or died). It starts
with `-P`, so nothing in the coordinator's working directory can stand in for its modules. If it dies, or does not
answer a frame within ROUND_TRIP_TIMEOUT (it is then killed), the checks it had are done in the event loop, and so is
every check until a new child is up (at most one start every RESPAWN_INTERVAL seconds): an answer may come later,
never wrong. A message over MAX_MESSAGE (a GPU challenge's proof) is checked in the event loop, as before.

Frames: a request is `!I` (byte length) and that many bytes of items, each `!I` (message length), the 32-byte
public key, the 64-byte signature and the message; the answer is one byte per item, 1 for a valid signature.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import struct
import sys
import time

from gpuswarm.coordinator import tasks
from gpuswarm.proto.signing import valid

logger = logging.getLogger(__name__)
KEY_BYTES, SIGNATURE_BYTES = 32, 64
MAX_BATCH = 512  # checks in one frame
# A larger message (a GPU challenge's proof, up to 2 MiB) is checked in the event loop, as it always was: frames
# stay small (at most MAX_BATCH x 64 KiB, the JSON cap), and a heartbeat never waits behind megabytes.
MAX_MESSAGE = 64 * 1024
ROUND_TRIP_TIMEOUT = 2.0  # a child that has not answered a frame by then is killed (a batch takes ~0.1 s)
RESPAWN_INTERVAL = 5.0
STOP_TIMEOUT = 2.0
_LENGTH = struct.Struct("!I")


def encode(items: list[tuple[bytes, bytes, bytes]]) -> bytes:
    """One request frame. Every key and signature must have their sizes (`check` refuses the others itself)."""
    body = b"".join(_LENGTH.pack(len(m)) + k + s + m for k, s, m in items)
    return _LENGTH.pack(len(body)) + body


def answer(body: bytes) -> bytes:
    """The child's answer to one frame's items."""
    out, at = bytearray(), 0
    while at < len(body):
        (length,) = _LENGTH.unpack_from(body, at)
        key = at + _LENGTH.size
        signature = key + KEY_BYTES
        message = signature + SIGNATURE_BYTES
        out.append(valid(body[key:signature], body[signature:message], body[message:message + length]))
        at = message + length
    return bytes(out)


def _child() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the coordinator, whose exit ends this at EOF
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while header := stdin.read(_LENGTH.size):
        (length,) = _LENGTH.unpack(header)
        stdout.write(answer(stdin.read(length)))
        stdout.flush()


class SignatureChecker:
    """Batches signature checks to a child process; `start` it inside the event loop, `stop` it at shutdown."""

    def __init__(self) -> None:
        self._batches: tasks.Batches[tuple[bytes, bytes, bytes], bool] = tasks.Batches(
            self._check_batch, MAX_BATCH, "signature-checker")
        self._process: asyncio.subprocess.Process | None = None
        self._started_at = -RESPAWN_INTERVAL

    async def start(self) -> None:
        await self._spawn()
        self._batches.start()

    async def check(self, key: bytes, signature: bytes, message: bytes) -> bool:
        if len(key) != KEY_BYTES or len(signature) != SIGNATURE_BYTES:
            return False
        if len(message) > MAX_MESSAGE:
            return valid(key, signature, message)
        return await self._batches.submit((key, signature, message))

    async def stop(self) -> None:
        await self._batches.stop()
        await self._end_child()

    async def _check_batch(self, items: list[tuple[bytes, bytes, bytes]]) -> list[bool]:
        answers = await self._remote(items)
        if answers is None:  # no child: check here (seconds of work at most, and never a wrong answer)
            return [valid(*item) for item in items]
        return [bool(a) for a in answers]

    async def _spawn(self) -> None:
        self._started_at = time.monotonic()
        try:
            # -P: the working directory is not on the child's sys.path, so no module there (a `gpuswarm/` of an
            # old checkout, a `struct.py`) can stand in for ours and answer "valid" to forged signatures.
            self._process = await asyncio.create_subprocess_exec(
                sys.executable, "-P", "-m", __name__, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        except OSError:
            logger.exception("cannot start the signature checker's process; checking in the event loop")
            self._process = None

    async def _end_child(self, kill: bool = False) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        with contextlib.suppress(OSError):
            process.stdin.close()  # the child ends at end of input
        if kill:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
        try:
            await asyncio.wait_for(process.wait(), STOP_TIMEOUT)
        except TimeoutError:
            process.kill()
            await process.wait()

    async def _remote(self, items: list[tuple[bytes, bytes, bytes]]) -> bytes | None:
        if self._process is None and time.monotonic() - self._started_at >= RESPAWN_INTERVAL:
            await self._spawn()
        if (process := self._process) is None:
            return None
        try:
            async with asyncio.timeout(ROUND_TRIP_TIMEOUT):
                process.stdin.write(encode(items))
                await process.stdin.drain()
                return await process.stdout.readexactly(len(items))
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as e:
            # Killed on a timeout: an answer it sent later would belong to the next frame.
            await self._end_child(kill=isinstance(e, TimeoutError))
            logger.warning("the signature checker's process %s (exit code %s); checking in the event loop until a "
                           "new one is up", "did not answer" if isinstance(e, TimeoutError) else "ended",
                           process.returncode)
            return None


if __name__ == "__main__":
    _child()
