import base64
import hashlib

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from gpuswarm.proto.signing import (
    MAX_CLOCK_SKEW,
    SignatureError,
    SignedEnvelope,
    canonical_json,
    node_id_for,
    public_key_b64,
    sign,
    verify,
    verify_signer,
)

NOW = 1_700_000_000.0
KIND = "claim"


@pytest.fixture
def key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def node_id(key: Ed25519PrivateKey) -> str:
    return node_id_for(public_key_b64(key.public_key()))


def test_round_trip_through_the_wire(key):
    env = sign(key, KIND, {"node_id": node_id(key), "samples": 3, "loss": 0.5}, now=NOW)
    received = SignedEnvelope.model_validate_json(env.model_dump_json())
    assert verify(received, kind=KIND, now=NOW + 1) == node_id(key)
    verify_signer(received, kind=KIND, node_id=node_id(key), now=NOW)


@pytest.mark.parametrize("update", [
    {"payload": {"node_id": "x", "samples": 4}},
    {"timestamp": NOW + 1},
    {"nonce": "0" * 32},
])
def test_tampered_field_is_rejected(key, update):
    env = sign(key, KIND, {"node_id": "x", "samples": 3}, now=NOW)
    with pytest.raises(SignatureError):
        verify(env.model_copy(update=update), kind=KIND, now=NOW)


def test_tampered_kind_is_rejected_even_when_the_verifier_expects_it(key):
    env = sign(key, "claim", {}, now=NOW)
    with pytest.raises(SignatureError):
        verify(env.model_copy(update={"kind": "advert"}), kind="advert", now=NOW)


def test_wrong_kind_is_rejected(key):
    env = sign(key, "claim", {}, now=NOW)
    with pytest.raises(SignatureError, match="expected"):
        verify(env, kind="advert", now=NOW)


def test_signature_by_another_key_is_rejected(key):
    other = Ed25519PrivateKey.generate()
    forged = sign(other, KIND, {"node_id": node_id(key)}, now=NOW)
    forged = forged.model_copy(update={"public_key": public_key_b64(key.public_key())})
    with pytest.raises(SignatureError):
        verify(forged, kind=KIND, now=NOW)


@pytest.mark.parametrize("offset", [MAX_CLOCK_SKEW + 1, -(MAX_CLOCK_SKEW + 1), 86_400])
def test_stale_or_future_timestamp_is_rejected(key, offset):
    env = sign(key, KIND, {}, now=NOW)
    with pytest.raises(SignatureError, match="stale"):
        verify(env, kind=KIND, now=NOW + offset)


def test_timestamp_within_skew_is_accepted(key):
    env = sign(key, KIND, {}, now=NOW)
    assert verify(env, kind=KIND, now=NOW + MAX_CLOCK_SKEW - 1) == node_id(key)


def test_int_timestamp_signs_verifiably(key):
    # Regression (proto/signing.py sign): the signature covered the raw `now` (json "1700000000"), but the envelope
    # coerces the timestamp to float, so signed_bytes() serialised "1700000000.0" and the signature never verified.
    env = sign(key, KIND, {}, now=int(NOW))
    assert verify(env, kind=KIND, now=NOW) == node_id(key)


def test_node_id_is_derived_from_the_key(key):
    pub = public_key_b64(key.public_key())
    nid = node_id_for(pub)
    assert len(nid) == 16 and int(nid, 16) >= 0
    assert nid == hashlib.sha256(base64.b64decode(pub)).hexdigest()[:16]
    assert nid != node_id(Ed25519PrivateKey.generate())


def test_verify_signer_rejects_payload_for_another_node(key):
    other_id = node_id(Ed25519PrivateKey.generate())
    env = sign(key, KIND, {"node_id": other_id}, now=NOW)
    with pytest.raises(SignatureError):
        verify_signer(env, kind=KIND, node_id=other_id, now=NOW)  # signer is not other_id
    with pytest.raises(SignatureError):
        verify_signer(env, kind=KIND, node_id=node_id(key), now=NOW)  # payload names other_id


def test_verify_signer_rejects_payload_without_node_id(key):
    env = sign(key, KIND, {}, now=NOW)
    with pytest.raises(SignatureError):
        verify_signer(env, kind=KIND, node_id=node_id(key), now=NOW)


def test_canonical_json_is_key_order_independent():
    a = {"b": 1, "a": {"y": [1, 2], "x": "é"}}
    b = {"a": {"x": "é", "y": [1, 2]}, "b": 1}
    assert canonical_json(a) == canonical_json(b) == '{"a":{"x":"é","y":[1,2]},"b":1}'.encode()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_canonical_json_rejects_non_finite(bad):
    with pytest.raises(ValueError):
        canonical_json({"x": bad})


def test_sign_refuses_nan_payload(key):
    with pytest.raises(ValueError):
        sign(key, KIND, {"loss": float("nan")}, now=NOW)
