from __future__ import annotations

import base64
import os
import shutil
import stat
import subprocess
import threading

import pytest
from gpuswarm.mesh.keys import (
    KeyFileError,
    KeyFormatError,
    KeyPair,
    generate_private_key,
    hex_to_key,
    key_to_hex,
    load_or_create_private_key,
    public_key_for,
    validate_key,
)


def test_generated_keys_are_wireguard_shaped():
    pair = KeyPair.generate()
    for key in (pair.private_key, pair.public_key):
        assert len(key) == 44 and len(base64.b64decode(key)) == 32
    raw = base64.b64decode(pair.private_key)
    assert raw[0] & 7 == 0 and raw[31] & 0x80 == 0 and raw[31] & 0x40  # clamped like `wg genkey`
    assert pair.public_key == public_key_for(pair.private_key)
    assert pair.private_key not in repr(pair)
    assert generate_private_key() != generate_private_key()


@pytest.mark.skipif(shutil.which("wg") is None, reason="wireguard-tools (wg) is not installed")
def test_public_key_matches_wg_pubkey():
    private = generate_private_key()
    out = subprocess.run(["wg", "pubkey"], input=private + "\n", capture_output=True, text=True, check=True)
    assert out.stdout.strip() == public_key_for(private)


def test_hex_round_trip():
    key = KeyPair.generate().public_key
    as_hex = key_to_hex(key)
    assert len(as_hex) == 64 and as_hex == as_hex.lower()
    assert hex_to_key(as_hex) == key
    assert hex_to_key(as_hex.upper()) == key


@pytest.mark.parametrize("bad", ["", "abc", "A" * 44, base64.b64encode(b"x" * 31).decode(), "!" * 44])
def test_bad_keys_are_refused(bad):
    with pytest.raises(KeyFormatError):
        validate_key(bad)


@pytest.mark.parametrize("bad", ["zz" * 32, "00" * 31, ""])
def test_bad_hex_is_refused(bad):
    with pytest.raises(KeyFormatError):
        hex_to_key(bad)


def test_key_file_is_created_private_and_reused(tmp_path):
    path = tmp_path / "state" / "wireguard.key"
    first = load_or_create_private_key(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert path.read_text().strip() == first.private_key
    assert load_or_create_private_key(path) == first
    assert [p.name for p in path.parent.iterdir()] == ["wireguard.key"]  # no temporary file left behind


def test_key_file_readable_by_others_is_refused(tmp_path):
    path = tmp_path / "wireguard.key"
    load_or_create_private_key(path)
    os.chmod(path, 0o640)
    with pytest.raises(KeyFileError, match="readable by others"):
        load_or_create_private_key(path)


def test_key_file_symlink_and_garbage_are_refused(tmp_path):
    target = tmp_path / "real.key"
    load_or_create_private_key(target)
    link = tmp_path / "link.key"
    link.symlink_to(target)
    with pytest.raises(KeyFileError):
        load_or_create_private_key(link)
    garbage = tmp_path / "garbage.key"
    garbage.write_text("not a key\n")
    os.chmod(garbage, 0o600)
    with pytest.raises(KeyFileError, match="does not hold"):
        load_or_create_private_key(garbage)


def test_concurrent_creators_agree_on_one_key(tmp_path):
    path = tmp_path / "wireguard.key"
    results: list[KeyPair] = []
    barrier = threading.Barrier(8)

    def create():
        barrier.wait()
        results.append(load_or_create_private_key(path))

    threads = [threading.Thread(target=create) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({r.private_key for r in results}) == 1
    assert results[0].private_key == path.read_text().strip()
