"""The node's identity: an Ed25519 signing key kept in the state directory at mode 0600.

The node id is derived from the public key (`proto.signing.node_id_for`), so a node that restarts with the same
state directory is the same node to the coordinator and the DHT. A key file readable by others is refused, as
ssh does, rather than silently used.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    load_pem_private_key,
)
from gpuswarm.proto.signing import SignedEnvelope, node_id_for, public_key_b64, sign

KEY_FILE = "identity.key"


class IdentityError(RuntimeError):
    pass


@dataclass(frozen=True)
class Identity:
    private_key: Ed25519PrivateKey

    @property
    def public_key(self) -> str:
        return public_key_b64(self.private_key.public_key())

    @property
    def node_id(self) -> str:
        return node_id_for(self.public_key)

    def sign(self, kind: str, payload: dict) -> SignedEnvelope:
        return sign(self.private_key, kind, payload)


def write_private_file(path: Path, data: bytes) -> None:
    """Create `path` with mode 0600 from the first byte on (no window where it is readable), atomically."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)  # O_EXCL below: never reuse a leftover file's mode, never follow a planted link
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def load_or_create(state_dir: Path) -> Identity:
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = state_dir / KEY_FILE
    if path.exists():
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise IdentityError(f"{path} is readable by others (mode {mode:o}); run: chmod 600 {path}")
        try:
            key = load_pem_private_key(path.read_bytes(), password=None)
        except (ValueError, TypeError, UnsupportedAlgorithm) as e:  # TypeError: the key has a passphrase
            raise IdentityError(f"{path} is not a usable private key: {e}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise IdentityError(f"{path} holds a {type(key).__name__}, not an Ed25519 key")
        return Identity(key)
    key = Ed25519PrivateKey.generate()
    write_private_file(path, key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))
    return Identity(key)
