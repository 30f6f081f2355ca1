"""The node's artifact cache: job code, datasets and checkpoints, downloaded once, kept by SHA-256 under a bound.

Owns the cache directory (`<state_dir>/cache`): one file per blob named by its SHA-256, and for a packed directory
(a tar) its unpacked tree beside it. Every download is verified against the hash the job names before it enters
the cache, and every use verifies the cached bytes again, so a corrupted entry is dropped and fetched anew, never
trained on. The total size (blobs plus unpacked trees) stays under `max_bytes`: the least recently used entries
that no running job needs are evicted first, and an artifact larger than the whole bound is refused with a clear
error. It knows nothing of the coordinator: the caller passes the function that downloads a blob.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tarfile
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

from gpuswarm.client.api import file_digest

logger = logging.getLogger(__name__)
UNPACKED_SUFFIX = ".d"

# Writes the blob to the given path and returns the SHA-256 it computed while writing (the client's fetch does).
Download = Callable[[Path], Awaitable[str]]


class CacheError(Exception):
    """An artifact that cannot be had: over the bound, a hash mismatch, a bad archive. The message is for the job's
    owner (it ends up in `job logs`)."""


def sha256_of(path: Path) -> str:
    return file_digest(path)[0]


def tree_size(path: Path) -> int:
    """Bytes under `path` (links not counted); 0 for what vanished meanwhile (another job's eviction)."""
    try:
        if path.is_file():
            return path.stat().st_size
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())
    except FileNotFoundError:
        return 0


class ArtifactCache:
    def __init__(self, root: Path, max_bytes: int):
        self.root, self.max_bytes = root, max_bytes
        root.mkdir(parents=True, exist_ok=True)
        self._locks: dict[str, asyncio.Lock] = {}
        self._evicting = threading.Lock()  # evictions run in worker threads, for several jobs at once
        for stale in root.glob("*.part"):  # downloads a crash interrupted
            stale.unlink(missing_ok=True)

    def blob_path(self, sha256: str) -> Path:
        return self.root / sha256

    async def get(self, sha256: str, size: int, download: Download, *, keep: set[str] = frozenset(),
                  what: str = "artifact") -> Path:
        """The verified blob `sha256`, downloading it when it is missing or corrupted. `keep`: blobs that running
        jobs use, never evicted to make room."""
        async with self._locks.setdefault(sha256, asyncio.Lock()):
            path = self.blob_path(sha256)
            if path.exists():
                if await asyncio.to_thread(sha256_of, path) == sha256:
                    os.utime(path)  # most recently used
                    return path
                logger.warning("cached %s %s is corrupted; dropping it and fetching it again", what, sha256[:12])
                self.drop(sha256)
            if size > self.max_bytes:
                raise CacheError(f"the job's {what} is {size} bytes, over this node's artifact cache bound of "
                                 f"{self.max_bytes} bytes")
            await asyncio.to_thread(self.evict, size, keep | {sha256})
            part = self.root / f"{sha256}.{os.getpid()}.part"
            try:
                got = await download(part)
                if got != sha256:
                    raise CacheError(f"the job's {what} failed verification: expected sha256 {sha256}, got {got}")
                os.replace(part, path)
            finally:
                part.unlink(missing_ok=True)
            logger.info("cached %s %s (%d bytes)", what, sha256[:12], size)
            return path

    async def unpacked(self, sha256: str, blob: Path, *, keep: set[str] = frozenset()) -> Path:
        """The tree of the tar `blob`, unpacked once beside it (member names are checked: nothing outside the tree,
        no links or devices)."""
        async with self._locks.setdefault(sha256 + UNPACKED_SUFFIX, asyncio.Lock()):
            target = self.root / (sha256 + UNPACKED_SUFFIX)
            done = target / ".complete"
            if done.exists():
                os.utime(target)
                return target
            shutil.rmtree(target, ignore_errors=True)
            await asyncio.to_thread(self.evict, blob.stat().st_size, keep | {sha256})
            try:
                await asyncio.to_thread(self._extract, blob, target)
            except (tarfile.TarError, OSError, ValueError) as e:
                shutil.rmtree(target, ignore_errors=True)
                raise CacheError(f"cannot unpack the job's archive {sha256[:12]}: {e}") from None
            done.touch()
            return target

    def named(self, sha256: str, name: str) -> Path:
        """The blob `sha256` under its file name `name` (a link beside the cache entry), for workloads that read a
        dataset file by its name or extension."""
        directory = self.root / (sha256 + UNPACKED_SUFFIX)
        directory.mkdir(exist_ok=True)
        link = directory / name
        if not link.is_symlink():
            link.symlink_to(Path("..") / sha256)
        return link

    @staticmethod
    def _extract(blob: Path, target: Path) -> None:
        target.mkdir(parents=True)
        with tarfile.open(blob) as tar:
            for member in tar.getmembers():
                if not (member.isfile() or member.isdir()):
                    raise ValueError(f"{member.name!r} is neither a file nor a directory")
            # The "data" filter refuses absolute paths, '..', and anything that would land outside the target.
            tar.extractall(target, filter="data")

    def entries(self) -> list[tuple[float, str, Path, int]]:
        """(last used, key, path, bytes) of every cache entry, least recently used first."""
        out = []
        for path in self.root.iterdir():
            if path.name.endswith(".part"):
                continue
            key = path.name.removesuffix(UNPACKED_SUFFIX)
            try:
                used = path.stat().st_mtime
            except FileNotFoundError:
                continue
            out.append((used, key, path, tree_size(path)))
        return sorted(out)

    def used_bytes(self) -> int:
        return sum(size for *_, size in self.entries())

    def evict(self, need: int, keep: set[str]) -> None:
        """Make room for `need` more bytes by removing least recently used entries that are not in `keep`."""
        with self._evicting:
            self._evict(need, keep)

    def _evict(self, need: int, keep: set[str]) -> None:
        entries = self.entries()
        used = sum(size for *_, size in entries)
        for _, key, path, size in entries:
            if used + need <= self.max_bytes:
                return
            if key in keep:
                continue
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
            used -= size
            logger.info("evicted %s (%d bytes) from the artifact cache", path.name, size)
        if used + need > self.max_bytes:
            raise CacheError(f"this node's artifact cache ({self.max_bytes} bytes) cannot hold {need} more bytes "
                             f"beside what its running jobs use ({used} bytes)")

    def drop(self, sha256: str) -> None:
        self.blob_path(sha256).unlink(missing_ok=True)
        shutil.rmtree(self.root / (sha256 + UNPACKED_SUFFIX), ignore_errors=True)
