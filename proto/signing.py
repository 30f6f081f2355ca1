"""The signed envelope: Ed25519 over canonical JSON, with a timestamp and a nonce.

A node wraps every claim it makes in an envelope. The verifier checks the signature against the embedded public
key, that the key belongs to the claimed node id, and that the timestamp is fresh; the caller checks the nonce
against its own store (this module does no I/O), so replays are caught by whoever keeps state.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import math
import secrets
import time
from typing import Annotated, Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

MAX_CLOCK_SKEW = 120.0  # seconds a signed message may be ahead of or behind the verifier's clock


class SignatureError(ValueError):
    """The envelope is forged, tampered with, stale or signed by the wrong key."""


class SignedEnvelope(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    kind: Annotated[str, StringConstraints(pattern=r"^[a-z_.]{1,64}$")]
    payload: dict[str, Any]
    public_key: Annotated[str, StringConstraints(min_length=40, max_length=64)]
    timestamp: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    nonce: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]
    signature: Annotated[str, StringConstraints(min_length=80, max_length=100)]

    def signed_bytes(self) -> bytes:
        return canonical_json(
            {"kind": self.kind, "payload": self.payload, "public_key": self.public_key,
             "timestamp": self.timestamp, "nonce": self.nonce}
        )


def canonical_json(value: Any) -> bytes:
    """One byte string per value: sorted keys, no spaces, UTF-8, and no NaN or infinity."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def public_key_b64(key: Ed25519PublicKey) -> str:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return base64.b64encode(key.public_bytes(Encoding.Raw, PublicFormat.Raw)).decode()


def node_id_for(public_key: str) -> str:
    """A node's id is derived from its signing key, so nobody can register under another node's id."""
    return hashlib.sha256(base64.b64decode(public_key)).hexdigest()[:16]


def sign(
    private_key: Ed25519PrivateKey, kind: str, payload: dict[str, Any], *, now: float | None = None
) -> SignedEnvelope:
    unsigned = {
        "kind": kind,
        "payload": payload,
        "public_key": public_key_b64(private_key.public_key()),
        "timestamp": float(time.time() if now is None else now),
        "nonce": secrets.token_hex(16),
    }
    signature = private_key.sign(canonical_json(unsigned))
    return SignedEnvelope(**unsigned, signature=base64.b64encode(signature).decode())


def unpack(envelope: SignedEnvelope, *, kind: str) -> tuple[bytes, bytes, bytes]:
    """The first half of `verify`: the kind checked, and the raw public key, signature and signed bytes."""
    if envelope.kind != kind:
        raise SignatureError(f"expected a {kind!r} message, got {envelope.kind!r}")
    try:  # ValueError: bad base64, or a NaN in the payload (canonical JSON has none, so nobody signed it)
        return (base64.b64decode(envelope.public_key, validate=True),
                base64.b64decode(envelope.signature, validate=True), envelope.signed_bytes())
    except ValueError as e:
        raise SignatureError("bad signature") from e


@functools.lru_cache(maxsize=4096)  # a node signs with one key for its lifetime; loading one costs a tenth of a check
def _public_key(raw: bytes) -> Ed25519PublicKey:
    return Ed25519PublicKey.from_public_bytes(raw)


def valid(key: bytes, signature: bytes, message: bytes) -> bool:
    """Whether `signature` is the Ed25519 signature of `message` by the raw public `key`."""
    try:
        _public_key(key).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


def fresh_signer(envelope: SignedEnvelope, *, now: float | None = None, max_skew: float = MAX_CLOCK_SKEW) -> str:
    """The second half of `verify`, once the signature checked out: the timestamp is fresh. Returns the node id."""
    now = time.time() if now is None else now
    if not math.isfinite(envelope.timestamp) or abs(now - envelope.timestamp) > max_skew:
        raise SignatureError(f"stale timestamp: {now - envelope.timestamp:+.0f}s from the verifier's clock")
    return node_id_for(envelope.public_key)


def verify(envelope: SignedEnvelope, *, kind: str, now: float | None = None, max_skew: float = MAX_CLOCK_SKEW) -> str:
    """Check signature, kind and freshness. Return the signer's node id. Raise SignatureError otherwise."""
    if not valid(*unpack(envelope, kind=kind)):
        raise SignatureError("bad signature")
    return fresh_signer(envelope, now=now, max_skew=max_skew)


def verify_signer(envelope: SignedEnvelope, *, kind: str, node_id: str, now: float | None = None) -> None:
    """`verify`, plus: the signer is `node_id` and the payload speaks for that same node."""
    signer = verify(envelope, kind=kind, now=now)
    if signer != node_id or envelope.payload.get("node_id") != node_id:
        raise SignatureError(f"message for node {envelope.payload.get('node_id')!r} is not signed by that node")
