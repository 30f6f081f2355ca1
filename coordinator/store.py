"""The content-addressed artifact store: bytes named by their SHA-256, written once, read and deleted by digest.

Owns the bytes only: `BlobStore` is the interface (what an object store, S3 or GCS, would implement) and
`LocalBlobStore` the default, files under `data_dir/blobs/ab/<sha256>`. Who may write, read or reference a blob,
which blobs exist for the database (`db.Blob`, its holders and references) and when one is removed are the views'
and `blobs.py`'s business, never this module's: it knows nothing of owners, jobs or the database.

A write has two steps. `stage` streams the body to a temporary place in chunks (never the whole body in memory),
hashing it on the way, and checks the digest and size it was promised; `StagedBlob.commit` then moves it into place
atomically, so a name in the store always holds exactly the bytes it names. Writing bytes the store already has
checks them the same way and keeps the copy in place. The split lets the caller commit the bytes and the database
row that records them under one lock (`config.BLOB_LOCK`), which the retention pass takes to delete both, while the
slow part, receiving the bytes, runs unlocked.
"""

from __future__ import annotations

import abc
import asyncio
import hashlib
import logging
import os
import re
import secrets
from collections.abc import AsyncIterable, AsyncIterator
from pathlib import Path

logger = logging.getLogger(__name__)
SHA256_RE = re.compile(r"[0-9a-f]{64}")  # used with fullmatch: "$" would let a trailing newline in
CHUNK = 1 << 20


class StoreError(Exception):
    """The bytes offered do not match what they were promised to be (the caller's fault, a 4xx)."""


class SizeMismatch(StoreError):
    pass


class DigestMismatch(StoreError):
    pass


def check_digest(sha256: str) -> str:
    if not SHA256_RE.fullmatch(sha256):
        raise ValueError(f"not a SHA-256 in lowercase hex: {sha256[:80]!r}")
    return sha256


class StagedBlob(abc.ABC):
    """Bytes received and checked (`BlobStore.stage`), not yet visible in the store. Commit or discard it."""

    def __init__(self, sha256: str, size: int):
        self.sha256, self.size = sha256, size

    @abc.abstractmethod
    async def commit(self) -> bool:
        """Put the bytes in place under their digest; True if the store did not have them yet."""

    @abc.abstractmethod
    async def discard(self) -> None:
        """Drop the bytes (after a commit: nothing to do)."""


class BlobStore(abc.ABC):
    """What the coordinator needs of a store of immutable blobs named by their SHA-256: an object store (S3, GCS)
    implements these five calls. A commit must be all-or-nothing (a reader never sees a partial blob) and
    idempotent (committing a digest the store has is fine)."""

    @abc.abstractmethod
    async def stage(self, sha256: str, size: int, chunks: AsyncIterable[bytes]) -> StagedBlob:
        """Receive `chunks`, which must be exactly `size` bytes whose SHA-256 is `sha256`; raise `SizeMismatch` or
        `DigestMismatch`, keeping nothing, otherwise."""

    @abc.abstractmethod
    async def exists(self, sha256: str) -> bool:
        """Whether the store holds the blob."""

    @abc.abstractmethod
    def read(self, sha256: str) -> AsyncIterator[bytes]:
        """The blob's bytes in chunks (FileNotFoundError if absent)."""

    @abc.abstractmethod
    async def delete(self, sha256: str) -> None:
        """Remove the blob; a blob that is not there is not an error."""

    def local_path(self, sha256: str) -> Path | None:
        """A file holding the blob, for stores on this machine (served with sendfile); None for remote stores."""
        return None

    async def write(self, sha256: str, size: int, chunks: AsyncIterable[bytes]) -> bool:
        """`stage` and `commit` at once. True if the store did not have the bytes."""
        staged = await self.stage(sha256, size, chunks)
        try:
            return await staged.commit()
        finally:
            await staged.discard()


class _LocalStaged(StagedBlob):
    def __init__(self, sha256: str, size: int, tmp: Path, final: Path):
        super().__init__(sha256, size)
        self.tmp, self.final = tmp, final

    async def commit(self) -> bool:
        if self.final.is_file():
            return False  # the same bytes are in place already (their name says so)
        self.final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.tmp, self.final)
        return True

    async def discard(self) -> None:
        self.tmp.unlink(missing_ok=True)


class LocalBlobStore(BlobStore):
    """Blobs as files under `root/ab/<sha256>` (the first two hex digits fan out the directory); temporary files
    under `root/tmp/`, on the same file system so that the final rename is atomic."""

    def __init__(self, root: Path):
        self.root = root
        self.tmp = root / "tmp"

    def setup(self) -> None:
        """Create the directories and clear temporary files a crash left behind."""
        self.tmp.mkdir(parents=True, exist_ok=True)
        for leftover in self.tmp.iterdir():
            leftover.unlink(missing_ok=True)

    def path(self, sha256: str) -> Path:
        check_digest(sha256)
        return self.root / sha256[:2] / sha256

    def local_path(self, sha256: str) -> Path | None:
        path = self.path(sha256)
        return path if path.is_file() else None

    async def exists(self, sha256: str) -> bool:
        return self.path(sha256).is_file()

    async def stage(self, sha256: str, size: int, chunks: AsyncIterable[bytes]) -> StagedBlob:
        final = self.path(sha256)
        self.tmp.mkdir(parents=True, exist_ok=True)
        tmp = self.tmp / f"{sha256}.{secrets.token_hex(4)}.part"
        digest, written = hashlib.sha256(), 0
        try:
            with open(tmp, "wb") as f:
                async for chunk in chunks:
                    written += len(chunk)
                    if written > size:
                        raise SizeMismatch(f"the body is longer than the promised {size} bytes")
                    digest.update(chunk)
                    f.write(chunk)
                f.flush()
                await asyncio.to_thread(os.fsync, f.fileno())
            if written != size:
                raise SizeMismatch(f"the body is {written} bytes, not the promised {size}")
            if digest.hexdigest() != sha256:
                raise DigestMismatch(f"the body's SHA-256 is {digest.hexdigest()}, not the promised {sha256}")
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return _LocalStaged(sha256, size, tmp, final)

    async def adopt(self, sha256: str, source: Path) -> bool:
        """Move a file that is believed to hold `sha256` into the store, after hashing it (an artifact file of an
        older data directory). False, leaving the file where it is, when its bytes are not `sha256`."""
        digest = await asyncio.to_thread(file_sha256, source)
        if digest != sha256:
            return False
        final = self.path(sha256)
        final.parent.mkdir(parents=True, exist_ok=True)
        if final.is_file():
            source.unlink()
        else:
            os.replace(source, final)
        return True

    async def read(self, sha256: str) -> AsyncIterator[bytes]:
        with open(self.path(sha256), "rb") as f:
            while chunk := await asyncio.to_thread(f.read, CHUNK):
                yield chunk

    async def delete(self, sha256: str) -> None:
        self.path(sha256).unlink(missing_ok=True)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


async def put_bytes(store: BlobStore, data: bytes) -> str:
    """Store a small in-memory value (the TensorBoard file the coordinator renders); returns its SHA-256."""
    sha256 = hashlib.sha256(data).hexdigest()

    async def once() -> AsyncIterator[bytes]:
        yield data

    await store.write(sha256, len(data), once())
    return sha256
