"""The node's artifact cache: verified downloads, reuse by hash, corrupted entries fetched again, the disk bound,
least-recently-used eviction that spares running jobs' artifacts, and safe unpacking of packed directories."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import time
from pathlib import Path

import pytest
from gpuswarm.node.cache import ArtifactCache, CacheError


def blob(data: bytes) -> tuple[str, int]:
    return hashlib.sha256(data).hexdigest(), len(data)


class Source:
    """Serves bytes the way the coordinator's blob route does: writes them to the path, returns their SHA-256."""

    def __init__(self, data: bytes):
        self.data, self.calls = data, 0

    async def __call__(self, dest: Path) -> str:
        self.calls += 1
        dest.write_bytes(self.data)
        return hashlib.sha256(self.data).hexdigest()


async def test_a_blob_is_downloaded_once_verified_and_reused(tmp_path):
    cache = ArtifactCache(tmp_path, 10_000)
    data = b"x" * 1000
    source = Source(data)
    first = await cache.get(*blob(data), source)
    second = await cache.get(*blob(data), source)
    assert first == second and first.read_bytes() == data and source.calls == 1


async def test_a_corrupted_entry_is_dropped_and_fetched_again(tmp_path):
    cache = ArtifactCache(tmp_path, 10_000)
    data = b"dataset bytes" * 10
    source = Source(data)
    path = await cache.get(*blob(data), source)
    path.write_bytes(b"flipped" + data[7:])
    again = await cache.get(*blob(data), source)
    assert again.read_bytes() == data and source.calls == 2


async def test_bytes_that_do_not_match_the_hash_never_enter_the_cache(tmp_path):
    cache = ArtifactCache(tmp_path, 10_000)
    sha, size = blob(b"what the job names")
    with pytest.raises(CacheError, match="failed verification"):
        await cache.get(sha, size, Source(b"something else entirely"), what="dataset")
    assert list(tmp_path.iterdir()) == []


async def test_an_artifact_over_the_bound_is_refused_with_its_size(tmp_path):
    cache = ArtifactCache(tmp_path, 100)
    data = b"y" * 101
    with pytest.raises(CacheError, match=r"dataset is 101 bytes, over this node's artifact cache bound of 100"):
        await cache.get(*blob(data), Source(data), what="dataset")


async def test_eviction_takes_the_least_recently_used_and_spares_running_jobs(tmp_path):
    cache = ArtifactCache(tmp_path, 250)
    a, b, c = b"a" * 100, b"b" * 100, b"c" * 100
    await cache.get(*blob(a), Source(a))
    await cache.get(*blob(b), Source(b))
    old = time.time() - 100
    os.utime(cache.blob_path(blob(a)[0]), (old, old))  # a is the least recently used
    await cache.get(*blob(c), Source(c), keep={blob(b)[0]})
    assert not cache.blob_path(blob(a)[0]).exists()
    assert cache.blob_path(blob(b)[0]).exists() and cache.blob_path(blob(c)[0]).exists()
    assert cache.used_bytes() <= 250
    # Nothing evictable is left beside what running jobs keep: a fourth blob cannot fit.
    d = b"d" * 100
    with pytest.raises(CacheError, match="cannot hold"):
        await cache.get(*blob(d), Source(d), keep={blob(b)[0], blob(c)[0]})


def tar_bytes(members: list[tarfile.TarInfo], payloads: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for info in members:
            data = payloads.get(info.name)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return out.getvalue()


def file_member(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    return info


async def test_a_packed_directory_is_unpacked_once(tmp_path):
    cache = ArtifactCache(tmp_path / "cache", 100_000)
    data = tar_bytes([file_member("pkg/__init__.py", 5), file_member("pkg/model.py", 9)],
                     {"pkg/__init__.py": b"x = 1", "pkg/model.py": b"y = 2 + 3"})
    path = await cache.get(*blob(data), Source(data))
    tree = await cache.unpacked(blob(data)[0], path)
    assert (tree / "pkg" / "model.py").read_text() == "y = 2 + 3"
    assert await cache.unpacked(blob(data)[0], path) == tree


async def test_an_absolute_member_lands_inside_the_tree(tmp_path):
    cache = ArtifactCache(tmp_path / "cache", 100_000)
    data = tar_bytes([file_member("/tmp/gpuswarm-evil-test", 3)], {"/tmp/gpuswarm-evil-test": b"bad"})
    tree = await cache.unpacked(blob(data)[0], await cache.get(*blob(data), Source(data)))
    assert (tree / "tmp" / "gpuswarm-evil-test").read_bytes() == b"bad"
    assert not Path("/tmp/gpuswarm-evil-test").exists()


@pytest.mark.parametrize("member", ["../escape.py", "link"])
async def test_an_archive_that_reaches_outside_its_tree_is_refused(tmp_path, member):
    cache = ArtifactCache(tmp_path / "cache", 100_000)
    if member == "link":
        info = tarfile.TarInfo("link")
        info.type, info.linkname = tarfile.SYMTYPE, "/root/.ssh/id_rsa"
        data = tar_bytes([info], {})
    else:
        data = tar_bytes([file_member(member, 3)], {member: b"bad"})
    path = await cache.get(*blob(data), Source(data))
    with pytest.raises(CacheError, match="cannot unpack"):
        await cache.unpacked(blob(data)[0], path)
    assert not (tmp_path / "escape.py").exists()
    assert not (tmp_path / "cache" / (blob(data)[0] + ".d")).exists()


async def test_a_dataset_file_is_handed_over_under_its_own_name(tmp_path):
    cache = ArtifactCache(tmp_path, 10_000)
    data = b"a,b\n1,2\n"
    await cache.get(*blob(data), Source(data))
    path = cache.named(blob(data)[0], "train.csv")
    assert path.name == "train.csv" and path.read_bytes() == data
    assert cache.named(blob(data)[0], "train.csv") == path
    assert cache.used_bytes() == len(data)  # the link takes no room of its own
