"""proto.dht, the DHT's contracts: pure (no hivemind), and what a valid advert is. The validator that enforces
these rules on DHT peers is tested in tests/dht/test_validators.py."""

import subprocess
import sys
import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from gpuswarm.node.identity import Identity
from gpuswarm.proto.dht import ADVERT_KIND, decode_advert, job_run_id
from gpuswarm.proto.models import NodeAdvert, NodeState, Resources
from gpuswarm.proto.signing import SignatureError


def test_proto_dht_does_not_import_hivemind():
    code = "import sys, gpuswarm.proto.dht; print('hivemind' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_job_run_id():
    assert job_run_id("j-0123456789ab") == "gpuswarm_j_0123456789ab"


def signed_advert(signer: Identity, node_id: str | None = None) -> dict:
    payload = NodeAdvert(node_id=node_id or signer.node_id, state=NodeState.IDLE, software_version="0.1.0",
                         resources=Resources(cpu_cores=4, ram_gb=8), expires_at=time.time() + 30)
    return signer.sign(ADVERT_KIND, payload.model_dump(mode="json")).model_dump(mode="json")


def test_decode_advert_accepts_a_node_signing_its_own_advert_only():
    a, b = Identity(Ed25519PrivateKey.generate()), Identity(Ed25519PrivateKey.generate())
    assert decode_advert(signed_advert(a)).node_id == a.node_id
    with pytest.raises(SignatureError):
        decode_advert(signed_advert(b, node_id=a.node_id))
    with pytest.raises(ValueError):
        decode_advert({"kind": ADVERT_KIND})
