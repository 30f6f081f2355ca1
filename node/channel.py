"""The link between a trusted worker and its sandboxed trainer: framed JSON messages over a Unix socket, and the
shared memory that carries parameters and gradients.

Owns the framing (a 4-byte big-endian length, then at most `MAX_MESSAGE` bytes of JSON; file descriptors ride
along with SCM_RIGHTS) and `SharedTensor`: a float32 buffer in a sealed memfd, mapped by both processes. The worker
creates each memfd, sizes it and seals its size (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) before the trainer
ever sees it, so hostile code on the other side can scribble on the contents but can never truncate the file
under the worker's mapping (which would kill the worker with SIGBUS on its next read).
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import socket
import struct
import time

from gpuswarm.proto.trainer import MAX_MESSAGE

_LENGTH = struct.Struct(">I")
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class ChannelClosed(ConnectionError):
    """The other side closed the socket (or sent a broken frame)."""


class Channel:
    """One end of the socket. `recv` raises TimeoutError when a whole message has not come within `timeout`
    seconds (one deadline for the message, however it is dripped), ChannelClosed on EOF or on a frame that is too
    big or not JSON; `send` raises TimeoutError when the other side stops reading for `send_timeout` seconds. Both
    sides treat any of these as the end of the session."""

    def __init__(self, sock: socket.socket, send_timeout: float | None = None):
        self.sock, self.send_timeout = sock, send_timeout

    @classmethod
    def from_fd(cls, fd: int) -> Channel:
        return cls(socket.socket(fileno=fd))

    def send(self, message: dict, fds: list[int] | tuple[int, ...] = ()) -> None:
        data = json.dumps(message, allow_nan=False, separators=(",", ":")).encode()
        if len(data) > MAX_MESSAGE:
            raise ValueError(f"message of {len(data)} bytes is over the {MAX_MESSAGE}-byte limit")
        frame = _LENGTH.pack(len(data)) + data
        self.sock.settimeout(self.send_timeout)
        if fds:
            socket.send_fds(self.sock, [frame], list(fds))
        else:
            self.sock.sendall(frame)

    def recv(self, timeout: float | None = None, max_fds: int = 0) -> tuple[dict, list[int]]:
        deadline = None if timeout is None else time.monotonic() + timeout
        fds: list[int] = []
        header = self._exact(_LENGTH.size, fds, max_fds, deadline)
        (size,) = _LENGTH.unpack(header)
        if size > MAX_MESSAGE:
            raise ChannelClosed(f"a message of {size} bytes is over the {MAX_MESSAGE}-byte limit")
        try:
            message = json.loads(self._exact(size, fds, 0, deadline))
        except (ValueError, RecursionError) as e:  # RecursionError: JSON nested too deep
            raise ChannelClosed(f"a message that is not JSON: {str(e)[:200]}") from None
        if not isinstance(message, dict):
            raise ChannelClosed("a message that is not a JSON object")
        return message, fds

    def _exact(self, n: int, fds: list[int], max_fds: int, deadline: float | None) -> bytes:
        chunks, got = [], 0
        while got < n:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("no whole message before the deadline")
                self.sock.settimeout(left)
            else:
                self.sock.settimeout(None)
            if max_fds and not fds:
                data, new_fds, _, _ = socket.recv_fds(self.sock, n - got, max_fds)
                fds.extend(new_fds)
            else:
                data = self.sock.recv(n - got)
            if not data:
                raise ChannelClosed("the other side closed the channel")
            chunks.append(data)
            got += len(data)
        return b"".join(chunks)

    def close(self) -> None:
        self.sock.close()


class SharedTensor:
    """`numel` float32 values in shared memory, as a flat torch tensor (`.tensor`) over the mapping."""

    def __init__(self, fd: int, numel: int):
        import torch

        self.fd, self.numel = fd, numel
        size = max(4 * numel, 1)
        if os.fstat(fd).st_size != size:
            raise ValueError(f"shared buffer is {os.fstat(fd).st_size} bytes, expected {size}")
        self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.tensor = torch.frombuffer(self._map, dtype=torch.float32, count=numel) if numel else torch.empty(0)

    @classmethod
    def create(cls, numel: int, name: str) -> SharedTensor:
        """A new buffer (zeroed) whose size is sealed: nobody, including this process, can change it."""
        fd = os.memfd_create(f"gpuswarm-{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, max(4 * numel, 1))
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            return cls(fd, numel)
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        del self.tensor
        try:
            self._map.close()
        except BufferError:  # a view still exists somewhere; the mapping goes with the process
            pass
        os.close(self.fd)
