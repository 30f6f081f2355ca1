"""Packing a job's code and dataset into the bytes the coordinator stores, reproducibly, with their SHA-256.

Owns `pack_directory` (a directory becomes an uncompressed tar whose bytes depend only on the files' relative
paths, contents and executable bits: sorted entries, mtime 0, uid/gid 0, no user or group names, regular files and
directories only), `pack_file` (a single dataset file or a wheel is used as it is), the pack cache and `PackError`.
The same tree always gives the same SHA-256, so an unchanged dataset is never uploaded twice; a tree whose files'
(path, size, mtime) list is unchanged is not even packed again (the cache, `cache_dir()`).

Symlinks: one to a regular file inside the tree is packed as that file; any other (to a directory, or out of the
tree) is skipped with a warning in `Pack.warnings`, as are sockets, pipes and devices. Empty directories are not
packed. Files are streamed through the hash, never read whole. No network and no printing: the CLI shows
`Pack.files`, `Pack.content_bytes` and the warnings.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import stat
import tarfile
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import BinaryIO

CHUNK = 1 << 20
PACK_VERSION = 1  # part of every cache key: a change in the tar layout must not reuse older packs
ALWAYS_EXCLUDED_NAMES = {"__pycache__", ".git"}
ALWAYS_EXCLUDED_SUFFIXES = (".pyc",)


class PackError(ValueError):
    """What cannot be packed (a missing path, an unreadable file, a file that changed while it was read)."""


@dataclass(frozen=True)
class Pack:
    """What is uploaded for a code or dataset source: `path` holds exactly the bytes `sha256` names."""

    source: Path  # the directory or file packed
    path: Path  # the bytes to upload: a tar in the cache, or the source file itself
    format: str  # "tar", "wheel" or "file"
    sha256: str
    size: int  # bytes of `path`
    files: int  # files packed (1 for a single file)
    content_bytes: int  # bytes of those files (a tar adds its headers and padding)
    reused: bool = False  # found in the cache: nothing was read again
    left_out: int = 0  # files left out by max_bytes
    warnings: tuple[str, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class _Entry:
    name: str  # the relative POSIX path inside the tar
    path: Path  # the file on disk (a symlink's target, resolved)
    size: int
    mtime_ns: int
    executable: bool


def cache_dir() -> Path:
    """Where packs and their index live: $GPUSWARM_CACHE_DIR/packs, else ~/.cache/gpuswarm/packs."""
    base = os.environ.get("GPUSWARM_CACHE_DIR")
    root = Path(base).expanduser() if base else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") \
        / "gpuswarm"
    return root / "packs"


def sha256_of(path: Path) -> tuple[str, int]:
    """The SHA-256 (hex) and size of the file at `path`, read in chunks."""
    digest, size = hashlib.sha256(), 0
    try:
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
                size += len(chunk)
    except OSError as e:
        raise PackError(f"cannot read {path}: {e.strerror or e}") from None
    return digest.hexdigest(), size


def pack_file(path: Path, format: str, cache: Path | None = None) -> Pack:
    """A single file (a dataset file, a wheel) as it is; its hash is cached by (path, size, mtime)."""
    try:
        st = path.stat()
    except OSError as e:
        raise PackError(f"cannot read {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise PackError(f"{path} is not a regular file")
    key = _cache_key({"file": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    known = _cached(cache, key)
    if known is not None:
        return Pack(path, path, format, known["sha256"], st.st_size, 1, st.st_size, reused=True)
    digest, size = sha256_of(path)
    _remember(cache, key, {"sha256": digest})
    return Pack(path, path, format, digest, size, 1, size)


def pack_directory(root: Path, *, include: Iterable[str] = (), exclude: Iterable[str] = (),
                   max_bytes: int | None = None, cache: Path | None = None) -> Pack:
    """`root` as a reproducible tar in the cache (see the module docstring), reused when its inputs are unchanged.

    `include`: globs on relative paths (fnmatch: `*` crosses "/") of which a file must match one, when given;
    `exclude`: globs that leave a file out, or a directory with everything in it. `max_bytes`: files are added in
    sorted order until the next would take their bytes over it; that one and all after it are left out."""
    root = root.resolve()
    if not root.is_dir():
        raise PackError(f"{root} is not a directory")
    include, exclude = tuple(include), tuple(exclude)
    entries, warnings = _walk(root, include, exclude)
    entries, left_out = _limit(entries, max_bytes)
    if not entries:
        raise PackError(f"nothing to pack in {root}" + (" (every file is excluded)" if include or exclude else ""))
    content = sum(e.size for e in entries)
    key = _cache_key({"dir": str(root), "include": include, "exclude": exclude, "max_bytes": max_bytes,
                      "entries": [(e.name, e.size, e.mtime_ns, e.executable) for e in entries]})
    known = _cached(cache, key)
    target = _cache(cache) / f"{known['sha256']}.tar" if known else None
    if target is not None and target.is_file() and target.stat().st_size == known.get("size"):
        return Pack(root, target, "tar", known["sha256"], known["size"], len(entries), content, True, left_out,
                    tuple(warnings))
    path, digest, size = _write_tar(entries, _cache(cache))
    _remember(cache, key, {"sha256": digest, "size": size})
    return Pack(root, path, "tar", digest, size, len(entries), content, False, left_out, tuple(warnings))


# ---------------------------------------------------------------------------------------------------- the walk


def excluded(name: str, patterns: Iterable[str]) -> bool:
    """Whether the relative POSIX path `name` is left out: always __pycache__, .git and *.pyc, else by a glob."""
    parts = PurePosixPath(name).parts
    if any(p in ALWAYS_EXCLUDED_NAMES for p in parts) or name.endswith(ALWAYS_EXCLUDED_SUFFIXES):
        return True
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, p.rstrip("/")) for p in patterns)


def _walk(root: Path, include: tuple[str, ...], exclude: tuple[str, ...]) -> tuple[list[_Entry], list[str]]:
    """The files to pack under `root`, sorted by relative path, and a warning for each thing skipped."""
    entries: list[_Entry] = []
    warnings: list[str] = []

    def on_error(e: OSError) -> None:
        raise PackError(f"cannot list {e.filename}: {e.strerror or e}")

    for directory, dirs, files in os.walk(root, onerror=on_error):
        here = Path(directory)
        rel = here.relative_to(root).as_posix()
        prefix = "" if rel == "." else rel + "/"
        dirs[:] = sorted(d for d in dirs if not excluded(prefix + d, exclude) and _walkable(here / d, prefix + d,
                                                                                             warnings))
        for name in sorted(files):
            relative = prefix + name
            if excluded(relative, exclude) or (include and not any(fnmatch.fnmatchcase(relative, p)
                                                                   for p in include)):
                continue
            entry = _entry(root, here / name, relative, warnings)
            if entry is not None:
                entries.append(entry)
    entries.sort(key=lambda e: e.name)
    return entries, warnings


def _walkable(path: Path, relative: str, warnings: list[str]) -> bool:
    if path.is_symlink():  # os.walk does not follow it; say so rather than leave it out silently
        warnings.append(f"skipped {relative}: a symlink to a directory")
        return False
    return True


def _entry(root: Path, path: Path, relative: str, warnings: list[str]) -> _Entry | None:
    """The file at `path` as a tar entry; None (with a warning) for what is not packed."""
    try:
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            target = path.resolve()
            if not target.is_relative_to(root):
                warnings.append(f"skipped {relative}: a symlink out of {root}")
                return None
            if not target.exists():
                warnings.append(f"skipped {relative}: a broken symlink")
                return None
            st = target.stat()
            path = target
    except OSError as e:
        raise PackError(f"cannot read {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        warnings.append(f"skipped {relative}: not a regular file")
        return None
    return _Entry(relative, path, st.st_size, st.st_mtime_ns, bool(st.st_mode & stat.S_IXUSR))


def _limit(entries: list[_Entry], max_bytes: int | None) -> tuple[list[_Entry], int]:
    """The entries up to `max_bytes` of content, in order, and how many were left out."""
    if max_bytes is None:
        return entries, 0
    total = 0
    for i, e in enumerate(entries):
        if total + e.size > max_bytes:
            return entries[:i], len(entries) - i
        total += e.size
    return entries, 0


# ---------------------------------------------------------------------------------------------------- the tar


class _HashingWriter:
    """A write-only file that hashes and counts what passes through it on the way to `out`."""

    def __init__(self, out: BinaryIO):
        self.out, self.digest, self.size = out, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.out.write(data)

    def tell(self) -> int:
        return self.size


def _tar_info(name: str, *, directory: bool = False, size: int = 0, executable: bool = False) -> tarfile.TarInfo:
    """A header with nothing of this machine in it: mtime 0, root's ids without names, a mode from the kind."""
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE if directory else tarfile.REGTYPE
    info.mode = 0o755 if directory or executable else 0o644
    info.size, info.mtime, info.uid, info.gid, info.uname, info.gname = size, 0, 0, 0, "", ""
    return info


def _directories(entries: list[_Entry]) -> list[str]:
    """Every directory that holds a packed file, parents first."""
    names = {str(parent) for e in entries for parent in PurePosixPath(e.name).parents if str(parent) != "."}
    return sorted(names)


def _write_tar(entries: list[_Entry], directory: Path) -> tuple[Path, str, int]:
    """Write the tar of `entries` into `directory` as SHA256.tar; return its path, SHA-256 and size."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=".pack-", suffix=".part", dir=directory)
    except OSError as e:
        raise PackError(f"cannot write packs to {directory}: {e.strerror or e} (set GPUSWARM_CACHE_DIR)") from None
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            writer = _HashingWriter(out)
            with tarfile.open(fileobj=writer, mode="w", format=tarfile.PAX_FORMAT, encoding="utf-8") as tar:
                for name in _directories(entries):
                    tar.addfile(_tar_info(name, directory=True))
                for e in entries:
                    _add_file(tar, e)
        digest = writer.digest.hexdigest()
        target = directory / f"{digest}.tar"
        os.replace(tmp, target)
        return target, digest, writer.size
    finally:
        tmp.unlink(missing_ok=True)


def _add_file(tar: tarfile.TarFile, entry: _Entry) -> None:
    try:
        with open(entry.path, "rb") as f:
            tar.addfile(_tar_info(entry.name, size=entry.size, executable=entry.executable), f)
    except OSError as e:  # tarfile raises OSError("unexpected end of data") when a file shrank while read
        raise PackError(f"cannot pack {entry.path}: {e.strerror or e} (did it change while being packed?)") \
            from None


# ---------------------------------------------------------------------------------------------------- the cache


def _cache(cache: Path | None) -> Path:
    return cache if cache is not None else cache_dir()


def _cache_key(inputs: dict) -> str:
    text = json.dumps({"version": PACK_VERSION, **inputs}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _cached(cache: Path | None, key: str) -> dict | None:
    try:
        known = json.loads((_cache(cache) / "index" / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None
    return known if isinstance(known, dict) and isinstance(known.get("sha256"), str) else None


def _remember(cache: Path | None, key: str, facts: dict) -> None:
    """Record a pack's facts under its inputs' key; a cache that cannot be written only costs a repack."""
    index = _cache(cache) / "index"
    try:
        index.mkdir(parents=True, exist_ok=True)
        tmp = index / f".{key}.{os.getpid()}.part"
        tmp.write_text(json.dumps(facts))
        os.replace(tmp, index / f"{key}.json")
    except OSError:
        pass
