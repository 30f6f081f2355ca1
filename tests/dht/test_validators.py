import contextlib
import os
import signal
import subprocess
import sys
import time

import hivemind
import psutil
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from gpuswarm.dht.swarm import SwarmDHT
from gpuswarm.dht.validators import NodeAdvertValidator
from gpuswarm.node.identity import Identity
from gpuswarm.proto.dht import ADVERT_KIND, EXPIRY_SLACK, NODES_KEY, decode_advert
from gpuswarm.proto.models import NodeAdvert, NodeState, Resources
from gpuswarm.proto.signing import SignatureError
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

NODES_KEY_ID = DHTID.generate(source=NODES_KEY).to_bytes()


def identity() -> Identity:
    return Identity(Ed25519PrivateKey.generate())


def advert(signer: Identity, *, node_id: str | None = None, expires_at: float, state=NodeState.IDLE) -> dict:
    """A signed advert exactly as node/advertiser.py builds it (the DHT value before msgpack)."""
    payload = NodeAdvert(node_id=node_id or signer.node_id, state=state, software_version="0.1.0",
                         resources=Resources(cpu_cores=4, ram_gb=8), maddrs=["/ip4/127.0.0.1/tcp/1"],
                         expires_at=expires_at)
    return signer.sign(ADVERT_KIND, payload.model_dump(mode="json")).model_dump(mode="json")


def record(subkey, value, expiration_time: float, key: bytes = NODES_KEY_ID, raw_value: bytes | None = None):
    return DHTRecord(key=key, subkey=MSGPackSerializer.dumps(subkey),
                     value=MSGPackSerializer.dumps(value) if raw_value is None else raw_value,
                     expiration_time=expiration_time)


@pytest.fixture
def validator() -> NodeAdvertValidator:
    return NodeAdvertValidator()


EXP = time.time() + 30


def test_valid_advert_is_accepted_and_decodes(validator):
    a = identity()
    value = advert(a, expires_at=EXP)
    assert validator.validate(record(a.node_id, value, EXP))
    assert validator.validate(record(a.node_id, value, EXP + EXPIRY_SLACK))
    assert decode_advert(value).node_id == a.node_id


def test_advert_under_another_nodes_subkey_is_rejected(validator):
    a, b = identity(), identity()
    assert not validator.validate(record(a.node_id, advert(b, expires_at=EXP), EXP))


def test_regular_value_under_nodes_key_is_rejected(validator):
    a = identity()
    assert not validator.validate(record(None, advert(a, expires_at=EXP), EXP))


def test_payload_naming_another_node_is_rejected(validator):
    a, b = identity(), identity()
    value = advert(b, node_id=a.node_id, expires_at=EXP)  # b signs an advert that claims to be a
    assert not validator.validate(record(a.node_id, value, EXP))
    assert not validator.validate(record(b.node_id, value, EXP))
    with pytest.raises(SignatureError):
        decode_advert(value)


@pytest.mark.parametrize("field, new", [("state", "offline"), ("expires_at", EXP + 3600), ("price_per_gpu_hour", 9.0)],
                         ids=["state", "expires_at", "price"])  # stable ids: EXP is a time
def test_tampered_payload_is_rejected(validator, field, new):
    a = identity()
    value = advert(a, expires_at=EXP)
    value["payload"] = value["payload"] | {field: new}
    assert not validator.validate(record(a.node_id, value, EXP))


def test_tampered_signature_is_rejected(validator):
    a = identity()
    value = advert(a, expires_at=EXP)
    other = advert(a, expires_at=EXP + 1)
    value["signature"] = other["signature"]
    assert not validator.validate(record(a.node_id, value, EXP))


def test_record_outliving_signed_expiry_is_rejected(validator):
    a = identity()
    value = advert(a, expires_at=EXP)
    assert not validator.validate(record(a.node_id, value, EXP + EXPIRY_SLACK + 1))
    assert not validator.validate(record(a.node_id, value, EXP + 86_400))


@pytest.mark.parametrize("raw", [b"", b"\xc1\xc1\xc1", b"\x92\x01", MSGPackSerializer.dumps("hello"),
                                 MSGPackSerializer.dumps({"kind": "advert"}), MSGPackSerializer.dumps([1, 2, 3])])
def test_garbage_value_is_rejected_without_raising(validator, raw):
    assert validator.validate(record(identity().node_id, None, EXP, raw_value=raw)) is False


def test_garbage_subkey_is_rejected_without_raising(validator):
    a = identity()
    rec = DHTRecord(NODES_KEY_ID, b"\xc1", MSGPackSerializer.dumps(advert(a, expires_at=EXP)), EXP)
    assert validator.validate(rec) is False


def test_records_under_other_keys_are_not_judged(validator):
    other_key = DHTID.generate(source="gpuswarm_j_0123456789ab_progress").to_bytes()
    assert validator.validate(record("anything", b"\xc1 not even msgpack", EXP, key=other_key, raw_value=b"\xc1"))


def _visible(dht: hivemind.DHT, node_id: str):
    found = dht.get(NODES_KEY, latest=True)
    if found is None or not isinstance(found.value, dict) or node_id not in found.value:
        return None
    return decode_advert(found.value[node_id].value)


@pytest.mark.timeout(120)
def test_dht_peer_cannot_overwrite_another_nodes_advert():
    a, b = identity(), identity()
    dht_a = dht_b = None
    try:
        dht_a = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                             record_validators=[NodeAdvertValidator()])
        dht_b = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                             initial_peers=[str(m) for m in dht_a.get_visible_maddrs()],
                             record_validators=[NodeAdvertValidator()])
        expires = get_dht_time() + 60
        assert dht_a.store(NODES_KEY, subkey=a.node_id, value=advert(a, expires_at=expires), expiration_time=expires)

        # B signs its own (valid) advert, claiming OFFLINE, with a later expiry, but stores it under A's subkey.
        later = expires + 10
        forged = advert(b, expires_at=later, state=NodeState.OFFLINE)
        assert not dht_b.store(NODES_KEY, subkey=a.node_id, value=forged, expiration_time=later)
        # B signs an advert that names A; the signer does not match.
        impostor = advert(b, node_id=a.node_id, expires_at=later, state=NodeState.OFFLINE)
        assert not dht_b.store(NODES_KEY, subkey=a.node_id, value=impostor, expiration_time=later)
        # A's own advert, but kept alive beyond its signed expiry.
        replay = advert(a, expires_at=expires)
        assert not dht_b.store(NODES_KEY, subkey=a.node_id, value=replay, expiration_time=expires + 600)

        for dht in (dht_a, dht_b):
            seen = _visible(dht, a.node_id)
            assert seen is not None and seen.node_id == a.node_id and seen.state is NodeState.IDLE

        # B's own advert under its own subkey is fine and visible from A.
        assert dht_b.store(NODES_KEY, subkey=b.node_id, value=advert(b, expires_at=later), expiration_time=later)
        assert _visible(dht_a, b.node_id).node_id == b.node_id
    finally:
        for dht in (dht_b, dht_a):
            if dht is not None:
                dht.shutdown()



def test_swarm_dht_ignores_a_group_sigterm_and_terminate_kills_it():
    """A SIGTERM to the whole process group is for the daemon, which still needs its DHT to say goodbye; the last
    resort of DHT.shutdown (terminate) must still work."""
    dht = SwarmDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        os.kill(dht.pid, signal.SIGTERM)
        dht.join(timeout=2)
        assert dht.is_alive()
        dht.terminate()
        dht.join(timeout=5)
        assert not dht.is_alive()
    finally:
        if dht.is_alive():
            os.kill(dht.pid, signal.SIGKILL)


OWNER = """
import os, signal, sys
from gpuswarm.dht.swarm import SwarmDHT
import hivemind
signal.signal(signal.SIGTERM, lambda *_: None)  # a daemon's own handler, as aiohttp and asyncio install one
dht = (SwarmDHT if sys.argv[1] == "swarm" else hivemind.DHT)(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
print(dht.pid, flush=True)
os._exit(0)  # the owner dies without shutting its DHT down (a crash, a SIGKILL)
"""


@pytest.mark.parametrize("kind", ["hivemind", "swarm"])
def test_a_dht_process_dies_with_its_owner_only_as_swarm_dht(kind, tmp_path):
    # Into a file, not a pipe: an orphaned DHT process would hold a pipe open for as long as it lives.
    with open(tmp_path / "pid", "w") as out:
        subprocess.run([sys.executable, "-c", OWNER, kind], stdout=out, stderr=subprocess.DEVNULL, timeout=120)
    pid = int((tmp_path / "pid").read_text().split()[0])
    try:
        # hivemind's own DHT process outlives its owner (the bug SwarmDHT fixes); a SwarmDHT process does not.
        assert wait_gone(pid) == (kind == "swarm"), (kind, pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def wait_gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.1)
    return False
