"""WireGuard keys: X25519 key pairs in WireGuard's base64 form, the hex form the UAPI speaks, and the key file.

Owns the node's WireGuard private key file (one line of base64, as `wg genkey` writes it, at mode 0600). It is
created atomically and exclusively, so two processes starting at once end up with the same key, and a file that
group or others can read is refused rather than used. Must not touch the node's Ed25519 identity key.
"""

from __future__ import annotations

import base64
import binascii
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

KEY_LEN = 32


class KeyFormatError(ValueError):
    """A key is not 32 bytes in WireGuard's base64 (or the UAPI's hex) form."""


class KeyFileError(RuntimeError):
    """The key file exists but cannot be used (readable by others, not a regular file, or not a key)."""


def decode_key(key: str) -> bytes:
    """WireGuard base64 → the 32 raw key bytes, or raise KeyFormatError."""
    if not isinstance(key, str):
        raise KeyFormatError(f"a WireGuard key is a base64 string, not {type(key).__name__}")
    try:
        raw = base64.b64decode(key.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise KeyFormatError("a WireGuard key must be base64 (44 characters)") from None
    if len(raw) != KEY_LEN:
        raise KeyFormatError(f"a WireGuard key is {KEY_LEN} bytes, this one is {len(raw)}")
    return raw


def validate_key(key: str) -> str:
    """Return `key` in canonical base64 form, or raise KeyFormatError."""
    return base64.b64encode(decode_key(key)).decode("ascii")


def key_to_hex(key: str) -> str:
    """WireGuard base64 → the lowercase hex the UAPI protocol uses."""
    return decode_key(key).hex()


def hex_to_key(value: str) -> str:
    """UAPI hex → WireGuard base64."""
    try:
        raw = bytes.fromhex(value.strip())
    except (ValueError, AttributeError):
        raise KeyFormatError(f"not a hex key: {value!r}") from None
    if len(raw) != KEY_LEN:
        raise KeyFormatError(f"a WireGuard key is {KEY_LEN} bytes, this hex holds {len(raw)}")
    return base64.b64encode(raw).decode("ascii")


def _clamp(raw: bytes) -> bytes:
    # The same clamping `wg genkey` applies; X25519 clamps on use anyway, so this only makes stored keys identical
    # in form to the ones WireGuard's own tools write.
    b = bytearray(raw)
    b[0] &= 248
    b[31] = (b[31] & 127) | 64
    return bytes(b)


def generate_private_key() -> str:
    raw = X25519PrivateKey.generate().private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    return base64.b64encode(_clamp(raw)).decode("ascii")


def public_key_for(private_key: str) -> str:
    """The WireGuard public key of a base64 private key."""
    priv = X25519PrivateKey.from_private_bytes(decode_key(private_key))
    return base64.b64encode(priv.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)).decode("ascii")


@dataclass(frozen=True)
class KeyPair:
    """A WireGuard key pair, both halves in base64. The private half stays out of repr() and logs."""

    private_key: str = field(repr=False)
    public_key: str

    @classmethod
    def generate(cls) -> KeyPair:
        return cls.from_private_key(generate_private_key())

    @classmethod
    def from_private_key(cls, private_key: str) -> KeyPair:
        private_key = validate_key(private_key)
        return cls(private_key=private_key, public_key=public_key_for(private_key))


def _read_key_file(path: Path) -> KeyPair:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise KeyFileError(f"cannot open {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(f"{path} is not a regular file")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise KeyFileError(f"{path} is readable by others (mode {mode:o}); run: chmod 600 {path}")
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    try:
        return KeyPair.from_private_key(data.decode("ascii").strip())
    except (UnicodeDecodeError, KeyFormatError) as e:
        raise KeyFileError(f"{path} does not hold a WireGuard private key: {e}") from None


def load_or_create_private_key(path: str | os.PathLike[str]) -> KeyPair:
    """Load the key pair from `path`, creating the file (mode 0600, parent 0700) if it does not exist.

    Creation writes a uniquely named temporary file with O_EXCL and links it into place, which fails if another
    process got there first; in that case its key is loaded, so concurrent starters agree on one key.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if os.path.lexists(path):
        return _read_key_file(path)
    pair = KeyPair.generate()
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        try:
            os.write(fd, (pair.private_key + "\n").encode("ascii"))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # atomic, and refuses to replace a file someone else created meanwhile
        except FileExistsError:
            return _read_key_file(path)
    finally:
        tmp.unlink(missing_ok=True)
    return pair
