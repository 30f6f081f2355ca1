"""The hivemind record validators every DHT peer gpuswarm runs installs (the coordinator's, each node daemon's,
each training process's and the operators' `gpuswarm dht`): `validators(authority, ...)` builds the set.

- `SwarmRecordValidator`: every record must end with a `proto.dht.RecordProof` that chains it to the swarm's
  authority (the coordinator's key): the authority's cert for the writing node and scope, the node's binding of a
  session key, and that key's signature over the record (see `gpuswarm.proto.dht`). It checks that the record's
  key is one its scope may write (`NODES_KEY` for `NODE_SCOPE`, the run's `RUN_SUFFIXES` keys for a run id), that
  its subkey is one the binding names, and that it expires no later than cert and binding (+ EXPIRY_SLACK). A
  peer given a proof (`proof=`) appends one to every record it writes in that proof's scope; `merge_with` lets a
  running DHT take a renewed proof through hivemind's public `DHT.add_validators`. `strict=False` (the operators'
  inspection peer) accepts everything, so that `gpuswarm dht` can show and mark what fails.
- `NodeAdvertValidator`: a record under `NODES_KEY` must be a signed advert (`proto.dht.decode_advert`) whose
  signer, and payload, name the node the subkey names, and must not outlive the expiry the node signed.
- hivemind's `RSASignatureValidator`: hivemind's progress records are RSA-signed by their owner.

`RecordValidatorBase` and `DHTRecord` are hivemind's public interface for validators; decoding raw records goes
through `gpuswarm.dht.hivemind_adapter`.
"""

from __future__ import annotations

import base64
import logging
from dataclasses import dataclass
from functools import lru_cache

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from gpuswarm.dht import hivemind_adapter
from gpuswarm.proto.dht import (
    EXPIRY_SLACK,
    NODE_SCOPE,
    NODES_KEY,
    RUN_SUFFIXES,
    DHTCert,
    DHTKeyBinding,
    RecordProof,
    attach_proof,
    decode_advert,
    record_message,
    split_proof,
    subkey_digest,
    verify_chain,
)
from gpuswarm.proto.signing import SignedEnvelope
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from pydantic import ValidationError

logger = logging.getLogger(__name__)


def scope_keys(scope: str) -> frozenset[bytes]:
    """The DHT key ids records of a scope may be stored under."""
    names = [NODES_KEY] if scope == NODE_SCOPE else [scope + suffix for suffix in RUN_SUFFIXES]
    return frozenset(hivemind_adapter.key_id(name) for name in names)


@dataclass(frozen=True)
class Chain:
    """A verified cert and binding, ready to check records with."""

    cert: DHTCert
    binding: DHTKeyBinding
    keys: frozenset[bytes]
    session_key: Ed25519PublicKey

    @property
    def expires_at(self) -> float:
        return min(self.cert.expires_at, self.binding.expires_at)


@lru_cache(maxsize=1024)
def _chain(cert_json: str, binding_json: str, authority: str) -> Chain:
    """Verified once per (cert, binding), keyed by their whole content: a peer sees the same proof on every record
    of one writer."""
    cert, binding = SignedEnvelope.model_validate_json(cert_json), SignedEnvelope.model_validate_json(binding_json)
    cert_payload, binding_payload = verify_chain(cert, binding, authority)
    key = Ed25519PublicKey.from_public_bytes(base64.b64decode(binding_payload.session_key, validate=True))
    return Chain(cert_payload, binding_payload, scope_keys(cert_payload.scope), key)


# Records up to this size are remembered once they pass (`check_record`): a peer reads the same few records over and
# over (hivemind's matchmaking polls its group key several times a second while it looks for a group, the tracker
# its progress key every second), and checking each copy again was a fifth of a training node's DHT process's CPU.
CACHED_RECORD_BYTES = 4096


def check_record(record: DHTRecord, authority: str) -> tuple[Chain, bytes]:
    """Check a raw record's proof: (its verified chain, its value without the proof). ValueError otherwise.

    The answer depends on the record's bytes and the authority alone, so a record that passed once passes again
    from the cache (`_passed`, keyed by all of them: any other value, signature or expiry is checked afresh); a
    failing one is never remembered."""
    if len(record.value) <= CACHED_RECORD_BYTES:
        return _passed(record.key, record.subkey, record.value, record.expiration_time, authority)
    return _check(record, authority)


@lru_cache(maxsize=2048)
def _passed(key: bytes, subkey: bytes, value: bytes, expiration_time: float, authority: str) -> tuple[Chain, bytes]:
    return _check(DHTRecord(key, subkey, value, expiration_time), authority)


def _check(record: DHTRecord, authority: str) -> tuple[Chain, bytes]:
    value, proof = split_proof(record.value)
    if proof is None:
        raise ValueError("the record carries no proof from a registered node")
    chain = _chain(proof.cert.model_dump_json(), proof.binding.model_dump_json(), authority)
    if record.key not in chain.keys:
        raise ValueError(f"the record's key is outside its cert's scope {chain.cert.scope!r}")
    if subkey_digest(record.subkey) not in chain.binding.subkeys:
        raise ValueError("the record's subkey is not one its writer's key binding names")
    if record.expiration_time > chain.expires_at + EXPIRY_SLACK:
        raise ValueError("the record expires after its cert")
    try:
        chain.session_key.verify(base64.b64decode(proof.signature, validate=True),
                                 record_message(record.key, record.subkey, value, record.expiration_time))
    except (InvalidSignature, ValueError):
        raise ValueError("the record's signature does not verify") from None
    return chain, value


@dataclass(frozen=True)
class WriterProof:
    """What a writing peer holds: the authority's cert, its node's binding, and the session key's private bytes
    (raw: a validator crosses into the DHT's process pickled, and cryptography's keys do not pickle)."""

    cert: SignedEnvelope
    binding: SignedEnvelope
    session_private: bytes

    @property
    def scope(self) -> str:
        return DHTCert.model_validate(self.cert.payload).scope


def new_session_key() -> tuple[bytes, str]:
    """A DHT peer's session key: (its raw private bytes, its public key in base64)."""
    from gpuswarm.proto.signing import public_key_b64

    key = Ed25519PrivateKey.generate()
    return key.private_bytes_raw(), public_key_b64(key.public_key())


def renewal_due(current: WriterProof | None, cert: SignedEnvelope) -> bool:
    """Whether a peer holding `current` should take `cert` (fresher by half a cert's life, another scope, or from
    another authority: a coordinator with a new database): a renewal costs the DHT's process a validator update,
    so not at every heartbeat."""
    if current is None or current.cert.payload.get("scope") != cert.payload.get("scope") \
            or current.cert.public_key != cert.public_key:
        return True
    life = float(cert.payload["expires_at"]) - cert.timestamp
    return float(cert.payload["expires_at"]) - float(current.cert.payload["expires_at"]) >= life / 2


class SwarmRecordValidator(RecordValidatorBase):
    def __init__(self, authority: str | None, proof: WriterProof | None = None, strict: bool = True):
        self.authority, self.proof, self.strict = authority, proof, strict
        self._keys: frozenset[bytes] | None = None

    def validate(self, record: DHTRecord) -> bool:
        if not self.strict:
            return True
        try:
            check_record(record, self.authority or "")
        except (ValueError, ValidationError, TypeError) as e:
            logger.debug("rejected a DHT record: %s", e)
            return False
        except Exception as e:  # never let a malformed record reach the DHT's loop
            logger.debug("rejected an undecodable DHT record: %r", e)
            return False
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        if self.proof is None:
            return record.value
        if self._keys is None:
            self._keys = scope_keys(self.proof.scope)
        if record.key not in self._keys:
            return record.value
        message = record_message(record.key, record.subkey, record.value, record.expiration_time)
        signature = Ed25519PrivateKey.from_private_bytes(self.proof.session_private).sign(message)
        return attach_proof(record.value, RecordProof(cert=self.proof.cert, binding=self.proof.binding,
                                                      signature=base64.b64encode(signature).decode()))

    def strip_value(self, record: DHTRecord) -> bytes:
        try:
            return split_proof(record.value)[0]
        except ValueError:
            return record.value

    @property
    def priority(self) -> int:
        return 20  # above RSASignatureValidator and NodeAdvertValidator: sign last, check and strip first

    def merge_with(self, other: RecordValidatorBase) -> bool:
        """One per peer: a later one (a renewed proof, via `DHT.add_validators`) replaces what it brings."""
        if not isinstance(other, SwarmRecordValidator):
            return False
        if other.authority is not None:
            self.authority, self.strict = other.authority, other.strict
        if other.proof is not None:
            self.proof, self._keys = other.proof, None
        return True


class NodeAdvertValidator(RecordValidatorBase):
    def __init__(self) -> None:
        self._nodes_key_id = hivemind_adapter.key_id(NODES_KEY)

    def validate(self, record: DHTRecord) -> bool:
        if record.key != self._nodes_key_id:
            return True  # not ours to judge
        try:
            subkey = hivemind_adapter.unpack(record.subkey)
            advert = decode_advert(hivemind_adapter.unpack(record.value))
        except (ValueError, ValidationError, TypeError, KeyError) as e:
            logger.debug("rejected advert record: %s", e)
            return False
        except Exception as e:  # malformed msgpack raises library-specific errors; never let it reach the DHT loop
            logger.debug("rejected undecodable advert record: %r", e)
            return False
        if subkey != advert.node_id:
            return False
        return record.expiration_time <= advert.expires_at + EXPIRY_SLACK

    @property
    def priority(self) -> int:
        return 10


def validators(authority: str | None, proof: WriterProof | None = None, strict: bool = True) -> list:
    """The validators of one gpuswarm DHT peer."""
    from hivemind.dht.crypto import RSASignatureValidator

    return [SwarmRecordValidator(authority, proof, strict), NodeAdvertValidator(), RSASignatureValidator()]
