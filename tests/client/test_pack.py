"""Packing (client/pack.py): the same tree always gives the same bytes and SHA-256, whatever the files' times and
owners; include/exclude/max_bytes choose the files; the cache skips repacking an unchanged tree. Real files on disk."""

from __future__ import annotations

import hashlib
import os
import tarfile
from pathlib import Path

import pytest
from gpuswarm.client.pack import PackError, cache_dir, excluded, pack_directory, pack_file, sha256_of


def tree(root: Path, files: dict[str, bytes | str]) -> Path:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
    return root


CODE = {"pkg/__init__.py": "", "pkg/model.py": "X = 1\n", "pkg/data/big.bin": b"\0" * 5000, "README": "hi",
        "pkg/__pycache__/model.cpython-311.pyc": b"junk", "pkg/old.pyc": b"junk", ".git/HEAD": "ref"}


def names(pack) -> list[str]:
    with tarfile.open(pack.path) as tar:
        return tar.getnames()


def test_the_same_tree_gives_the_same_bytes_in_another_place_and_cache(tmp_path):
    first = pack_directory(tree(tmp_path / "a", CODE), cache=tmp_path / "c1")
    second = pack_directory(tree(tmp_path / "b", CODE), cache=tmp_path / "c2")
    assert first.sha256 == second.sha256 and first.path.read_bytes() == second.path.read_bytes()
    assert first.sha256 == hashlib.sha256(first.path.read_bytes()).hexdigest() == sha256_of(first.path)[0]
    assert first.size == first.path.stat().st_size and first.format == "tar"
    assert (first.files, first.content_bytes) == (4, 5000 + 6 + 2)
    assert names(first) == ["pkg", "pkg/data", "README", "pkg/__init__.py", "pkg/data/big.bin", "pkg/model.py"]


def test_headers_hold_nothing_of_this_machine(tmp_path):
    root = tree(tmp_path / "a", CODE)
    (root / "pkg/model.py").chmod(0o700)
    with tarfile.open(pack_directory(root, cache=tmp_path / "c").path) as tar:
        members = tar.getmembers()
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in members} == {(0, 0, 0, "", "")}
    assert {m.name: oct(m.mode) for m in members}["pkg/model.py"] == "0o755"  # the executable bit is kept
    assert {m.name: oct(m.mode) for m in members}["README"] == "0o644"
    assert all(m.isfile() or m.isdir() for m in members)


def test_touching_only_mtimes_keeps_the_hash_and_changing_a_byte_changes_it(tmp_path):
    root = tree(tmp_path / "a", CODE)
    cache = tmp_path / "cache"
    before = pack_directory(root, cache=cache)
    again = pack_directory(root, cache=cache)
    assert again.reused and again.sha256 == before.sha256
    for path in root.rglob("*"):
        os.utime(path, (1_000_000, 1_000_000))
    touched = pack_directory(root, cache=cache)
    assert not touched.reused and touched.sha256 == before.sha256  # packed again: same bytes
    (root / "pkg/model.py").write_text("X = 2\n")
    assert pack_directory(root, cache=cache).sha256 != before.sha256


def test_a_cached_pack_whose_tar_was_deleted_is_packed_again(tmp_path):
    root, cache = tree(tmp_path / "a", CODE), tmp_path / "cache"
    first = pack_directory(root, cache=cache)
    first.path.unlink()
    second = pack_directory(root, cache=cache)
    assert not second.reused and second.path.is_file() and second.sha256 == first.sha256


def test_the_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSWARM_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine" / "packs"
    pack = pack_directory(tree(tmp_path / "a", CODE))
    assert pack.path.parent == tmp_path / "mine" / "packs"


@pytest.mark.parametrize(("name", "patterns", "left_out"), [
    ("pkg/__pycache__/x.pyc", [], True), ("a/.git/config", [], True), ("mod.pyc", [], True),
    ("data/train.npy", ["data/*"], True), ("data/sub/x", ["data/*"], True), ("data", ["data"], True),
    ("sub/data/x", ["data/*"], False), ("x.npy", ["*.npy"], True), ("deep/x.npy", ["*.npy"], True),
    ("pkg/model.py", ["data/*"], False),
])
def test_excluded(name, patterns, left_out):
    assert excluded(name, patterns) is left_out


def test_exclude_and_include(tmp_path):
    root = tree(tmp_path / "a", {"a.py": "1", "b.txt": "2", "test/t.py": "3", "lib/c.py": "4", "lib/d.txt": "5"})
    pack = pack_directory(root, include=["*.py"], exclude=["test/*"], cache=tmp_path / "c")
    assert [n for n in names(pack) if "." in n] == ["a.py", "lib/c.py"]
    assert pack.files == 2
    with pytest.raises(PackError, match="nothing to pack .*every file is excluded"):
        pack_directory(root, include=["*.rs"], cache=tmp_path / "c")


def test_max_bytes_stops_in_sorted_order(tmp_path):
    root = tree(tmp_path / "a", {"a": b"x" * 40, "b": b"x" * 40, "c": b"x" * 40, "d": b"x"})
    pack = pack_directory(root, max_bytes=100, cache=tmp_path / "c")
    assert names(pack) == ["a", "b"] and pack.content_bytes == 80 and pack.left_out == 2  # stops at c: not d
    assert pack_directory(root, max_bytes=200, cache=tmp_path / "c").left_out == 0


def test_symlinks_inside_are_files_and_outside_are_skipped_with_a_warning(tmp_path):
    root = tree(tmp_path / "a", {"real.py": "1", "sub/x.py": "2"})
    tree(tmp_path, {"secret": "outside"})
    (root / "inside.py").symlink_to(root / "real.py")
    (root / "outside").symlink_to(tmp_path / "secret")
    (root / "subdir").symlink_to(root / "sub")
    (root / "broken").symlink_to(root / "nowhere")
    pack = pack_directory(root, cache=tmp_path / "c")
    assert names(pack) == ["sub", "inside.py", "real.py", "sub/x.py"]
    with tarfile.open(pack.path) as tar:
        assert tar.extractfile("inside.py").read() == b"1"
    assert sorted(pack.warnings) == ["skipped broken: a broken symlink",
                                     f"skipped outside: a symlink out of {root.resolve()}",
                                     "skipped subdir: a symlink to a directory"]


def test_a_single_file_is_used_as_it_is(tmp_path):
    data = tmp_path / "train.npy"
    data.write_bytes(b"abc" * 1000)
    pack = pack_file(data, "file", cache=tmp_path / "c")
    assert (pack.path, pack.format, pack.size, pack.files) == (data, "file", 3000, 1)
    assert pack.sha256 == hashlib.sha256(data.read_bytes()).hexdigest() and not pack.reused
    assert pack_file(data, "file", cache=tmp_path / "c").reused  # (path, size, mtime) unchanged: not read again
    data.write_bytes(b"abd" * 1000)
    os.utime(data, ns=(1, 1))
    assert pack_file(data, "file", cache=tmp_path / "c").sha256 == hashlib.sha256(b"abd" * 1000).hexdigest()


def test_what_cannot_be_packed_is_a_pack_error(tmp_path):
    with pytest.raises(PackError, match="is not a directory"):
        pack_directory(tmp_path / "missing", cache=tmp_path / "c")
    with pytest.raises(PackError, match="cannot read"):
        pack_file(tmp_path / "missing.whl", "wheel", cache=tmp_path / "c")
    with pytest.raises(PackError, match="not a regular file"):
        pack_file(tmp_path, "file", cache=tmp_path / "c")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PackError, match="nothing to pack"):
        pack_directory(tmp_path / "empty", cache=tmp_path / "c")
