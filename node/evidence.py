"""Round evidence and its replay: the node's half of refereed re-execution.

Owns, for a training process in mode "diloco" or "fedavg", what it keeps of each of its last rounds so that
another node can re-compute the round (`RoundEvidence`): the swarm's parameters the round started from, the inner
optimizer's state then, the data position of its first batch, its steps and samples, and the inner parameters it
ended with (whose distance from the start is what it sent into the average). And the replay (`replay`): the same
steps from the same start over the same batches, on a fresh copy of the job's workload, and how far the end the
node kept lies from the re-computed one, as a share of how far the round moved.

A round's steps are deterministic given their start, their optimizer state and their batches (the position fixes
the shard's seed and how many batches it had taken), so an honest round replays to within float noise, and a
node that trained less than it claims, or nothing, cannot write evidence that replays without doing the work.
Workloads whose steps draw random numbers (dropout) replay only as far as that noise allows: see
docs/security.md.

The evidence is a torch.save file of tensors and plain values, read back with weights_only=True: a referee never
unpickles objects that another node wrote, and `load` checks every field before a replay uses it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

EVIDENCE_FORMAT = "gpuswarm-round-evidence-1"
EVIDENCE_KEPT = 4  # rounds kept per job: an audit asks for a round within a heartbeat or two of its report
TOLERANCE = 0.05  # a replay passes when the kept end is within this share of the round's movement


class EvidenceError(ValueError):
    """A round's evidence is unreadable or inconsistent."""


def _flat(tensors) -> Any:
    import torch

    return torch.cat([t.detach().reshape(-1).float() for t in tensors]).clone()


class RoundEvidence:
    """Keeps this node's last `kept` rounds in `directory`, one file per epoch (`<epoch>.pt`)."""

    def __init__(self, directory: Path, kept: int = EVIDENCE_KEPT):
        self.directory, self.kept = directory, kept
        directory.mkdir(parents=True, exist_ok=True)
        self._start = self._position = None
        self.steps = self.samples = 0

    def begin(self, anchor) -> None:
        """A round starts from the swarm's parameters `anchor`."""
        self._start, self._position, self.steps, self.samples = _flat(anchor), None, 0, 0

    def record(self, steps: int, samples: int, position: dict[str, int]) -> None:
        """`steps` inner steps on batches of `samples` in all, after which the data stream stood at `position`."""
        if self._position is None:  # where the round's first batch came from: `steps` batches before this
            self._position = {**position, "batches": position["batches"] - steps}
        self.steps += steps
        self.samples += samples

    def end(self, epoch: int, inner, optimizer_state: Callable[[], dict]) -> Path | None:
        """The round of `epoch` ended with the inner parameters `inner`: write its evidence, with the inner
        optimizer's state dict at the round's start (`optimizer_state()`, the trainer's, read back by the worker
        only when there is a round to write), and drop the oldest."""
        import torch

        if self._start is None or self.steps == 0:
            return None
        path = self.directory / f"{epoch}.pt"
        partial = path.with_suffix(".part")
        torch.save({"format": EVIDENCE_FORMAT, "epoch": epoch, "steps": self.steps, "samples": self.samples,
                    "position": self._position, "start": self._start, "end": _flat(inner),
                    "inner_optimizer": optimizer_state()}, partial)
        partial.replace(path)
        self._start = None
        for old in sorted(self.directory.glob("*.pt"), key=lambda p: int(p.stem))[:-self.kept]:
            old.unlink(missing_ok=True)
        return path


def load(path: Path, parameter_count: int | None = None) -> dict[str, Any]:
    """A round's evidence, checked: its format, integer counts, a data position, and start and end vectors of
    `parameter_count` finite floats. EvidenceError otherwise."""
    import torch

    try:
        evidence = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever another node wrote: unreadable is a verdict, not a crash
        raise EvidenceError(f"the evidence is not a readable torch.save file of tensors: {e}") from None
    if not isinstance(evidence, dict) or evidence.get("format") != EVIDENCE_FORMAT:
        raise EvidenceError(f"the evidence is not of format {EVIDENCE_FORMAT}")
    for key in ("epoch", "steps", "samples"):
        if not isinstance(evidence.get(key), int) or isinstance(evidence[key], bool) or evidence[key] < 0:
            raise EvidenceError(f"the evidence's {key} is not a non-negative integer")
    if evidence["steps"] < 1:
        raise EvidenceError("the evidence holds no step")
    position = evidence.get("position")
    if not isinstance(position, dict) or any(not isinstance(position.get(k), int) or position[k] < 0
                                             for k in ("index", "count", "seed", "batches")) \
            or position["index"] >= position["count"]:
        raise EvidenceError("the evidence's data position is not {index < count, seed, batches}")
    for key in ("start", "end"):
        value = evidence.get(key)
        if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.dtype != torch.float32:
            raise EvidenceError(f"the evidence's {key} is not a flat float32 tensor")
        if parameter_count is not None and value.numel() != parameter_count:
            raise EvidenceError(f"the evidence's {key} has {value.numel()} values; the model has {parameter_count}")
        if not torch.isfinite(value).all():
            raise EvidenceError(f"the evidence's {key} is not finite")
    if not isinstance(evidence.get("inner_optimizer"), dict):
        raise EvidenceError("the evidence holds no inner optimizer state")
    return evidence


def distance(start, end, replayed) -> float:
    """How far the kept `end` lies from the `replayed` one, as a share of how far the replayed round moved
    from `start` (inf when it did not move and the kept end did)."""
    import torch

    off = torch.linalg.vector_norm(end - replayed).item()
    moved = torch.linalg.vector_norm(replayed - start).item()
    if moved == 0.0:
        return 0.0 if off == 0.0 else math.inf
    return off / moved


def replay(evidence: dict[str, Any], link, shared, local, optimizer_spec) -> dict[str, Any]:
    """Re-compute the round of `evidence` with the job's trainer (`link`), its shared buffers (`shared`, a
    worker.SharedParams), the worker's view of the inner parameters (`local`, a local_updates.LocalUpdates) and the
    workload's `optimizer_spec`, and judge it: a verdict of steps, samples, distance, passed and reason."""
    import io

    import torch
    from gpuswarm.node.local_updates import INNER_CHUNK_SECONDS

    start = evidence["start"]
    with torch.no_grad():
        for param, chunk in zip(shared.params, start.split(shared.sizes), strict=True):
            param.copy_(chunk.view(param.shape))
    try:  # checked here, on a copy of the parameters, before the trainer takes it
        optimizer_spec.build([torch.nn.Parameter(p.detach().clone()) for p in shared.params]).load_state_dict(
            evidence["inner_optimizer"])
    except Exception as e:  # noqa: BLE001 - another node's state: a mismatch is a verdict
        return verdict(evidence, 0, 0, math.inf, f"the inner optimizer state does not fit the model: {e}")
    shared.publish()
    state = io.BytesIO()
    torch.save(evidence["inner_optimizer"], state)
    link.give_file("inner.pt", state.getvalue())
    link.request("load_inner", "saved", "loading the round's inner optimizer state", version=shared.version,
                 name="inner.pt")
    position, steps, samples = evidence["position"], 0, 0
    while steps < evidence["steps"]:
        done = link.request("inner", "inner", f"re-computing step {steps + 1} of {evidence['steps']}",
                            extra_time=INNER_CHUNK_SECONDS, version=shared.version, steps=evidence["steps"] - steps,
                            seconds=INNER_CHUNK_SECONDS, index=position["index"], count=position["count"], step=0,
                            resume=position if steps == 0 else None)
        steps, samples = steps + done.steps, samples + done.samples
    shared.take_inner(local)
    d = distance(start, evidence["end"], local.flat)
    if samples != evidence["samples"]:
        return verdict(evidence, steps, samples, d, f"its batches hold {samples} samples, not the "
                                                    f"{evidence['samples']} it names")
    if not d <= TOLERANCE:
        return verdict(evidence, steps, samples, d, f"its end lies {d:.3g} of the round's movement "
                                                    f"from the re-computed one (at most {TOLERANCE})")
    return verdict(evidence, steps, samples, d, "")


def verdict(evidence: dict[str, Any], steps: int, samples: int, d: float, reason: str) -> dict[str, Any]:
    return {"epoch": evidence["epoch"], "steps": steps, "samples": samples,
            "distance": d if math.isfinite(d) else None, "passed": not reason, "reason": reason}
