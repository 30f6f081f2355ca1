"""What the swarm keeps in its DHT, as contracts: the key names, a job's run id, the signed node advert, and the
proof every record carries.

Each node keeps one advert under `NODES_KEY` with its node id as the subkey. The value is a signed envelope
(kind `ADVERT_KIND`) whose payload is a `NodeAdvert`; `decode_advert` checks one. A record may outlive the expiry
its node signed by at most `EXPIRY_SLACK` seconds.

Every record in the swarm's DHT (adverts, and the keys a training run derives from its run id: `RUN_SUFFIXES`)
ends with a `RecordProof` that chains it to the coordinator (the swarm's *authority*, one Ed25519 key):
- a `DHTCert` (kind `CERT_KIND`), signed by the authority: node N may write under `scope` until `expires_at`.
  Scope `NODE_SCOPE` is the node's own advert; a run id is the run N is currently assigned to. The coordinator
  issues certs only to registered nodes and tickets only for active assignments, for at most `MAX_CERT_TTL`;
- a `DHTKeyBinding` (kind `KEY_KIND`), signed by N: this session key writes for me in that scope, under these
  subkeys only. The session key lives in the DHT peer that writes (a training process never holds N's key);
- the session key's signature over the record itself (`record_message`): key, subkey, value and expiry.
So a record written by an unregistered key, by a node for a run it is not (or no longer) assigned to, under
another member's subkey, or expiring after its cert, fails everywhere. The trailer's byte layout
(`attach_proof`, `split_proof`) is: value, proof JSON, its length (4 bytes, big endian), `PROOF_MAGIC`.
Enforcing this on every DHT peer is `gpuswarm.dht.validators`' job, and running a DHT peer is
`gpuswarm.dht.swarm.SwarmDHT`'s: this module is pure (pydantic and the signed envelope; no hivemind, no I/O), so
any package may use it.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Annotated

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from gpuswarm.proto.models import NodeAdvert, NodeId
from gpuswarm.proto.signing import SignatureError, SignedEnvelope, sign, verify
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

NODES_KEY = "gpuswarm.nodes"
ADVERT_KIND = "advert"
EXPIRY_SLACK = 5.0  # seconds a record may outlive its signed expiry (clock skew between peers)
MEMBERS_SUFFIX = ".members"  # a run's members check in under `run_id + MEMBERS_SUFFIX` (gpuswarm.node.worker)
# The keys a run writes: hivemind 1.1.12's progress, averager matchmaking and state-download keys
# (gpuswarm.dht.hivemind_adapter pins them), and the members key.
RUN_SUFFIXES = ("_progress", MEMBERS_SUFFIX, "_grad_averager.0b", "_state_averager.0b",
                "_grad_averager.all_averagers", "_state_averager.all_averagers")
CERT_KIND = "dht_cert"
KEY_KIND = "dht_key"
NODE_SCOPE = "node"
MAX_CERT_TTL = 3600.0  # longer certs are refused: a node that is revoked or loses its run drops out within it
PROOF_MAGIC = b"\x00gpswrm1"
MAX_PROOF_BYTES = 4096
RUN_ID_PATTERN = r"^gpuswarm_[A-Za-z0-9_]{1,54}$"
Scope = Annotated[str, StringConstraints(pattern=rf"^{NODE_SCOPE}$|{RUN_ID_PATTERN}")]
SubkeyDigest = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]


def job_run_id(job_id: str) -> str:
    """The hivemind run id of a job; hivemind derives its progress and averaging keys from it."""
    return f"gpuswarm_{job_id.replace('-', '_')}"


def decode_advert(envelope: dict) -> NodeAdvert:
    """Verify a signed advert (as stored in the DHT) and return it. Raise ValueError when it is not valid."""
    env = SignedEnvelope.model_validate(envelope)
    # The DHT record's own expiry bounds an advert's life; the envelope timestamp only needs to be sane.
    signer = verify(env, kind=ADVERT_KIND, max_skew=float("inf"))
    advert = NodeAdvert.model_validate(env.payload)
    if advert.node_id != signer:
        raise SignatureError("advert is not signed by the node it describes")
    return advert


class _Payload(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DHTCert(_Payload):
    """The authority's word: `node_id` may write DHT records in `scope` until `expires_at`."""

    node_id: NodeId
    scope: Scope
    expires_at: Annotated[float, Field(ge=0, allow_inf_nan=False)]


class DHTKeyBinding(_Payload):
    """The node's word: `session_key` (raw Ed25519, base64) writes for it in `scope`, under `subkeys` only."""

    node_id: NodeId
    scope: Scope
    session_key: Annotated[str, StringConstraints(min_length=40, max_length=64)]
    subkeys: list[SubkeyDigest] = Field(min_length=1, max_length=8)
    expires_at: Annotated[float, Field(ge=0, allow_inf_nan=False)]


class RecordProof(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    cert: SignedEnvelope
    binding: SignedEnvelope
    signature: Annotated[str, StringConstraints(min_length=80, max_length=100)]  # base64 Ed25519


def subkey_digest(packed_subkey: bytes) -> str:
    """How a binding names a subkey: a digest of the subkey as hivemind packs it in a record."""
    return hashlib.sha256(packed_subkey).hexdigest()[:32]


def record_message(key: bytes, packed_subkey: bytes, value: bytes, expiration: float) -> bytes:
    """The bytes a session key signs for one record (its value without the proof)."""
    return b"".join((PROOF_MAGIC, struct.pack(">HHId", len(key), len(packed_subkey), len(value), expiration),
                     key, packed_subkey, value))


def attach_proof(value: bytes, proof: RecordProof) -> bytes:
    raw = proof.model_dump_json().encode()
    return value + raw + struct.pack(">I", len(raw)) + PROOF_MAGIC


def split_proof(value: bytes) -> tuple[bytes, RecordProof | None]:
    """(the value without its proof, the proof); (value, None) when it carries none. ValueError: a malformed one."""
    if not value.endswith(PROOF_MAGIC):
        return value, None
    end = len(value) - len(PROOF_MAGIC)
    if end < 4:
        raise ValueError("truncated record proof")
    (length,) = struct.unpack(">I", value[end - 4:end])
    if length > MAX_PROOF_BYTES or length > end - 4:
        raise ValueError("record proof of an impossible length")
    start = end - 4 - length
    try:
        return value[:start], RecordProof.model_validate(json.loads(value[start:end - 4]))
    except (ValidationError, ValueError) as e:
        raise ValueError(f"malformed record proof: {e}") from None


def verify_chain(cert_env: SignedEnvelope, binding_env: SignedEnvelope, authority: str
                 ) -> tuple[DHTCert, DHTKeyBinding]:
    """Check the cert (signed by `authority`, a base64 Ed25519 public key, for at most MAX_CERT_TTL) and the
    binding (signed by the cert's node, same scope, expiring no later). Raise ValueError otherwise."""
    verify(cert_env, kind=CERT_KIND, max_skew=float("inf"))
    if cert_env.public_key != authority:
        raise SignatureError("the record's cert is not signed by this swarm's coordinator")
    cert = DHTCert.model_validate(cert_env.payload)
    if cert.expires_at - cert_env.timestamp > MAX_CERT_TTL + EXPIRY_SLACK:
        raise SignatureError("the record's cert is valid for longer than any coordinator issues")
    signer = verify(binding_env, kind=KEY_KIND, max_skew=float("inf"))
    binding = DHTKeyBinding.model_validate(binding_env.payload)
    if signer != cert.node_id or binding.node_id != cert.node_id:
        raise SignatureError("the record's session key is not bound by the node its cert names")
    if binding.scope != cert.scope or binding.expires_at > cert.expires_at:
        raise SignatureError("the record's key binding reaches beyond its cert")
    return cert, binding


def issue_cert(authority: Ed25519PrivateKey, node_id: str, scope: str, ttl: float, now: float) -> SignedEnvelope:
    """The authority's cert for `node_id` in `scope`, valid `ttl` seconds (at most MAX_CERT_TTL) from `now`."""
    cert = DHTCert(node_id=node_id, scope=scope, expires_at=now + min(ttl, MAX_CERT_TTL))
    return sign(authority, CERT_KIND, cert.model_dump(mode="json"), now=now)


def binding_for(cert_env: SignedEnvelope, session_key: str, packed_subkeys: list[bytes]) -> dict:
    """The payload a node signs (kind KEY_KIND) to let `session_key` write under `packed_subkeys` in its cert's
    scope, for as long as the cert lasts."""
    cert = DHTCert.model_validate(cert_env.payload)
    return DHTKeyBinding(node_id=cert.node_id, scope=cert.scope, session_key=session_key,
                         subkeys=[subkey_digest(s) for s in packed_subkeys],
                         expires_at=cert.expires_at).model_dump(mode="json")
