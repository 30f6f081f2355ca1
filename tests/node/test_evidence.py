"""Round evidence and its replay (gpuswarm.node.evidence) with real processes: rounds of digits-mlp's local steps
are recorded as the worker records them (a real trainer computes the batches), and a referee's worker
(`worker --replay`) re-computes one from its file. The honest round passes; a lazy node's (it kept the start as
its end), one that names more samples than its batches hold, and a file that is not evidence fail, each with its
reason. `load` refuses malformed evidence field by field."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gpuswarm.node.evidence import EVIDENCE_FORMAT, TOLERANCE, EvidenceError, RoundEvidence, load
from gpuswarm.node.local_updates import LocalUpdates
from gpuswarm.node.trainer_link import Inputs, Settings, TrainerLink
from gpuswarm.node.worker import EVENT_PREFIX, SharedParams
from gpuswarm.proto.models import JobSpec

SPEC = JobSpec.model_validate({"workload": "digits-mlp"})
CHUNKS = (1, 7, 4)
STEPS = sum(CHUNKS)


@pytest.fixture(scope="module")
def rounds(tmp_path_factory) -> dict:
    """Two rounds of one member, as the worker keeps them: the second starts mid-training (the inner optimizer's
    moments are not zero, the data stream is 12 batches in)."""
    root = tmp_path_factory.mktemp("evidence")
    link = TrainerLink(root / "job", Settings(sandboxed=False, answer_timeout=60))
    try:
        hello = link.start(SPEC.model_dump(mode="json"), Inputs(), gpus=[], threads=1, nice=0)
        shared = SharedParams(link)
        local = LocalUpdates([shared.flat])
        evidence = RoundEvidence(root / "evidence")
        paths = []
        for epoch in range(2):
            evidence.begin([shared.flat])
            for i, chunk in enumerate(CHUNKS):  # the worker asks for a round's steps in chunks of a few seconds
                done = link.request("inner", "inner", "inner steps", version=shared.version, steps=chunk,
                                    seconds=60.0, index=1, count=2, step=0, resume=None, round_start=i == 0)
                assert done.steps == chunk
                shared.take_inner(local)
                evidence.record(done.steps, done.samples, done.position.model_dump())

            def inner_state() -> dict:
                link.request("save_inner", "saved", "saving", version=shared.version, name="inner.pt")
                return torch.load(io.BytesIO(link.take_file("inner.pt", 2**30)), weights_only=True)

            paths.append(evidence.end(epoch, local.params, inner_state))
            with torch.no_grad():  # the outer step of a lone member at rate 1: the swarm takes its parameters
                shared.flat.copy_(local.flat)
            local.restart()
            shared.publish()
        return {"root": root, "paths": paths, "batch": hello.batch_size, "size": sum(shared.sizes)}
    finally:
        link.close()


def replay(root: Path, evidence: Path) -> dict:
    """A referee's worker re-computing `evidence`: its verdict event."""
    spec = root / "spec.json"
    spec.write_text(json.dumps({"spec": SPEC.model_dump(mode="json")}))
    done = subprocess.run([sys.executable, "-m", "gpuswarm.node.worker", str(spec), "--workdir",
                           str(root / f"referee-{evidence.stem}"), "--replay", str(evidence), "--no-sandbox"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    [verdict] = [json.loads(line[len(EVENT_PREFIX):]) for line in done.stdout.splitlines()
                 if line.startswith(EVENT_PREFIX) and '"verdict"' in line]
    return verdict


def tampered(rounds: dict, name: str, change) -> Path:
    kept = torch.load(rounds["paths"][1], weights_only=True)
    change(kept)
    path = rounds["root"] / f"{name}.pt"
    torch.save(kept, path)
    return path


def test_an_honest_round_replays_to_its_own_end(rounds):
    verdict = replay(rounds["root"], rounds["paths"][1])
    assert verdict["passed"] and verdict["reason"] == "", verdict
    # The shard's last batch is a short one: the replay took the same batches, to the sample.
    assert verdict["epoch"] == 1 and verdict["steps"] == STEPS
    assert verdict["samples"] == load(rounds["paths"][1])["samples"] < STEPS * rounds["batch"]
    assert verdict["distance"] <= TOLERANCE / 100, verdict  # same CPU, one thread: float noise at most


def test_a_lazy_round_fails(rounds):
    lazy = tampered(rounds, "lazy", lambda e: e.update(end=e["start"].clone()))  # trained nothing
    verdict = replay(rounds["root"], lazy)
    assert not verdict["passed"] and "of the round's movement" in verdict["reason"], verdict
    assert verdict["distance"] == pytest.approx(1.0, abs=1e-3)


def test_a_round_naming_more_samples_than_its_batches_fails(rounds):
    inflated = tampered(rounds, "inflated", lambda e: e.update(samples=e["samples"] * 10))
    verdict = replay(rounds["root"], inflated)
    assert not verdict["passed"] and "samples" in verdict["reason"], verdict


def test_a_file_that_is_not_evidence_fails_without_running_anything_of_it(rounds, tmp_path):
    hostile = tmp_path / "hostile.pt"
    torch.save({"format": EVIDENCE_FORMAT, "payload": Path("/etc/passwd")}, hostile)  # an object, not a tensor
    verdict = replay(rounds["root"], hostile)
    assert not verdict["passed"] and "not a readable torch.save file of tensors" in verdict["reason"], verdict


@pytest.mark.parametrize("change, reason", [
    (lambda e: e.update(format="other"), "format"),
    (lambda e: e.update(steps=0), "no step"),
    (lambda e: e.update(samples=-1), "samples"),
    (lambda e: e.update(epoch=True), "epoch"),
    (lambda e: e.update(position={"index": 2, "count": 2, "seed": 1, "batches": 3}), "data position"),
    (lambda e: e.update(position="0/2"), "data position"),
    (lambda e: e.update(start=e["start"][:-1]), "values"),
    (lambda e: e.update(end=e["end"].double()), "float32"),
    (lambda e: e["end"].__setitem__(0, float("nan")), "not finite"),
    (lambda e: e.pop("inner_optimizer"), "optimizer"),
])
def test_load_refuses_malformed_evidence(rounds, change, reason):
    path = tampered(rounds, "malformed", change)
    with pytest.raises(EvidenceError, match=reason):
        load(path, rounds["size"])


def test_a_node_keeps_its_last_rounds_only(tmp_path):
    evidence = RoundEvidence(tmp_path, kept=3)
    params = [torch.nn.Parameter(torch.zeros(4))]
    state = torch.optim.SGD(params, lr=0.1).state_dict()
    for epoch in range(6):
        evidence.begin(params)
        assert evidence.end(epoch, params, lambda: state) is None  # no step, no evidence
        evidence.begin(params)
        evidence.record(3, 24, {"index": 0, "count": 1, "seed": 5, "batches": 3 + epoch})
        evidence.end(epoch, params, lambda: state)
    assert sorted(int(p.stem) for p in tmp_path.glob("*.pt")) == [3, 4, 5]
    # The round's first batch: three batches before where its one chunk of three steps left the stream.
    assert load(tmp_path / "5.pt", 4)["position"] == {"index": 0, "count": 1, "seed": 5, "batches": 5}
