"""What the swarm keeps in its DHT, as contracts: the key names, a job's run id, and the signed node advert.

Each node keeps one advert under `NODES_KEY` with its node id as the subkey. The value is a signed envelope
(kind `ADVERT_KIND`) whose payload is a `NodeAdvert`; `decode_advert` checks one. A record may outlive the expiry
its node signed by at most `EXPIRY_SLACK` seconds. Enforcing these rules on every DHT peer is
`gpuswarm.dht.validators.NodeAdvertValidator`'s job, and running a DHT peer is `gpuswarm.dht.swarm.SwarmDHT`'s:
this module is pure (pydantic and the signed envelope; no hivemind, no I/O), so any package may use it.
"""

from __future__ import annotations

from gpuswarm.proto.models import NodeAdvert
from gpuswarm.proto.signing import SignatureError, SignedEnvelope, verify

NODES_KEY = "gpuswarm.nodes"
ADVERT_KIND = "advert"
EXPIRY_SLACK = 5.0  # seconds a record may outlive its signed expiry (clock skew between peers)


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
