import os
import stat

import pytest
from cryptography.hazmat.primitives.asymmetric.ec import SECP256R1, generate_private_key
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import BestAvailableEncryption, Encoding, NoEncryption, PrivateFormat
from gpuswarm.node.identity import KEY_FILE, IdentityError, load_or_create
from gpuswarm.node.outbox import Outbox
from gpuswarm.proto import signing
from gpuswarm.proto.models import CLAIM_KIND, ContributionClaim, RoundReport
from gpuswarm.proto.signing import node_id_for, verify_signer

JOB = "j-0123456789ab"
KEY = Ed25519PrivateKey.generate()
NODE = node_id_for(signing.public_key_b64(KEY.public_key()))


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_key_is_created_private_and_reloads_to_the_same_node(tmp_path):
    state = tmp_path / "state"
    first = load_or_create(state)
    assert mode(state / KEY_FILE) == 0o600
    assert not list(state.glob("*.tmp"))
    again = load_or_create(state)
    assert again.node_id == first.node_id == node_id_for(first.public_key)
    assert load_or_create(tmp_path / "other").node_id != first.node_id


def test_identity_signs_for_its_node(tmp_path):
    ident = load_or_create(tmp_path)
    verify_signer(ident.sign("heartbeat", {"node_id": ident.node_id}), kind="heartbeat", node_id=ident.node_id)


@pytest.mark.parametrize("loose", [0o640, 0o604, 0o644, 0o660])
def test_key_readable_by_others_is_refused(tmp_path, loose):
    load_or_create(tmp_path)
    os.chmod(tmp_path / KEY_FILE, loose)
    with pytest.raises(IdentityError, match="chmod 600"):
        load_or_create(tmp_path)


@pytest.mark.parametrize("content", [b"", b"not a key",
                                     b"-----BEGIN PRIVATE KEY-----\ngarbage\n-----END PRIVATE KEY-----\n"])
def test_garbage_key_is_refused(tmp_path, content):
    (tmp_path / KEY_FILE).write_bytes(content)
    os.chmod(tmp_path / KEY_FILE, 0o600)
    with pytest.raises(IdentityError):
        load_or_create(tmp_path)
    assert (tmp_path / KEY_FILE).read_bytes() == content  # never silently replaced


def test_non_ed25519_key_is_refused(tmp_path):
    pem = generate_private_key(SECP256R1()).private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
    (tmp_path / KEY_FILE).write_bytes(pem)
    os.chmod(tmp_path / KEY_FILE, 0o600)
    with pytest.raises(IdentityError, match="Ed25519"):
        load_or_create(tmp_path)


def test_encrypted_key_is_refused_with_identity_error(tmp_path):
    # Regression (node/identity.py load_or_create): load_pem_private_key raises TypeError for an encrypted key, which
    # escapes as a raw TypeError instead of IdentityError (node/cli.py only turns IdentityError into a message).
    pem = Ed25519PrivateKey.generate().private_bytes(Encoding.PEM, PrivateFormat.PKCS8, BestAvailableEncryption(b"pw"))
    (tmp_path / KEY_FILE).write_bytes(pem)
    os.chmod(tmp_path / KEY_FILE, 0o600)
    with pytest.raises(IdentityError):
        load_or_create(tmp_path)


def test_key_is_private_even_over_a_leftover_temp_file(tmp_path):
    # Regression (node/identity.py write_private_file): os.open(O_CREAT) keeps the mode of an existing tmp file, so a
    # leftover world-readable identity.key.tmp makes the new key world-readable (and the next start refuses it).
    tmp = tmp_path / (KEY_FILE + ".tmp")
    tmp.write_bytes(b"")
    os.chmod(tmp, 0o644)
    load_or_create(tmp_path)
    assert mode(tmp_path / KEY_FILE) == 0o600


def report(epoch: int, samples: int = 10) -> RoundReport:
    claim = ContributionClaim(job_id=JOB, node_id=NODE, epoch=epoch, samples=samples, steps=1, compute_seconds=2.0,
                              window_start=1.0, window_end=2.0)
    envelope = signing.sign(KEY, CLAIM_KIND, claim.model_dump(mode="json")).model_dump(mode="json")
    return RoundReport(job_id=JOB, node_id=NODE, epoch=epoch, solo=True, claims=[envelope])


def test_outbox_add_pending_ack(tmp_path):
    box = Outbox(tmp_path / "outbox")
    assert box.pending() == []
    reports = [report(epoch, samples=epoch + 1) for epoch in (3, 10, 200)]
    for r in reversed(reports):
        box.add(r)
    assert box.pending() == reports  # in epoch order, unchanged by the round trip
    box.ack(reports[1])
    assert box.pending() == [reports[0], reports[2]]
    box.ack(reports[1])  # a second ack (resend acknowledged twice) is harmless
    assert Outbox(tmp_path / "outbox").pending() == [reports[0], reports[2]]  # survives a restart
    box.ack(reports[2], delivered=False)  # refused and dropped: not in the node's record of delivered claims
    assert box.delivered() == [{"job_id": JOB, "epoch": 10, "signature": reports[1].claims[0]["signature"]}]
    assert all(mode(p) == 0o600 for p in (tmp_path / "outbox").glob("round-*.json"))


@pytest.mark.parametrize("corrupt", [b"{not json", b"\xff\xfe\x00", b'{"job_id": "j-0123456789ab"}', b"[]"])
def test_corrupt_claim_file_is_dropped(tmp_path, corrupt):
    box = Outbox(tmp_path)
    good = report(1)
    box.add(good)
    bad = tmp_path / f"round-{JOB}-000000000999.json"
    bad.write_bytes(corrupt)
    assert box.pending() == [good]
    assert not bad.exists()
