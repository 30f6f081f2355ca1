"""The model file a finished job leaves (`gpuswarm job download`): its format, writing it, reading it back, and
re-measuring a built-in workload's model (`gpuswarm node evaluate`).

A model file is `torch.save` of a plain dict, loadable with `torch.load(path, weights_only=True)` and no gpuswarm:

    {"format": "gpuswarm-model/1", "workload": "digits-mlp" | None, "entrypoint": "pkg.mod:func" | None,
     "params": {...}, "state_dict": {...}, "metrics": {"accuracy": ...}, "metadata": {"job_id", "global_step", ...}}

Files from before this format (digits-mlp only: "workload", "hyperparameters", "state_dict", "metadata") are read
as the same thing. Rebuilding a custom workload's model needs its owner's code, which this module never imports.
"""

from __future__ import annotations

import io
import pickle
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from gpuswarm.sdk import Context
from gpuswarm.sdk.loader import WorkloadError, params_dict, validate_params

MODEL_FORMAT = "gpuswarm-model/1"
CHECKPOINT_FORMAT = "gpuswarm-checkpoint/2"
CHECKPOINT_FORMATS = ("gpuswarm-checkpoint/1", CHECKPOINT_FORMAT)


def load_checkpoint(path: Path) -> dict:
    """A checkpoint file: {"format", "step", "samples", "data_position", "model_file", "optimizer"}. `model_file`
    is the bytes of the model's state dict as the sandboxed trainer saved it (the trusted worker never unpickles
    what a workload wrote; format 1 held the state dict itself, as "model"). Loaded with weights_only: it was
    written by another node, and a pickle could run code here."""
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(saved, dict) or saved.get("format") not in CHECKPOINT_FORMATS:
        raise ValueError(f"{path.name} is not a gpuswarm checkpoint")
    return saved


def flat_optimizer_state(state: dict) -> dict:
    """A checkpoint's outer optimizer state (hivemind.Optimizer's state dict: a torch optimizer's, with
    "local_epoch" among its "state") for the worker's one flat parameter (worker.SharedParams.flat). Checkpoints
    written before the worker gave hivemind one tensor hold an entry per model tensor: each per-parameter buffer
    (SGD's momentum) is joined in the parameters' order, and other values (a step count) are kept from the first."""
    groups = state.get("param_groups") or []
    indexes = [i for group in groups for i in group["params"]]
    if len(groups) != 1 or len(indexes) <= 1:
        return state
    per_param = state.get("state", {})
    joined = {}
    if all(i in per_param for i in indexes):
        for key in set.intersection(*(set(per_param[i]) for i in indexes)):
            values = [per_param[i][key] for i in indexes]
            tensors = all(isinstance(v, torch.Tensor) and v.dim() > 0 for v in values)
            joined[key] = torch.cat([v.reshape(-1) for v in values]) if tensors else values[0]
    rest = {key: value for key, value in per_param.items() if not isinstance(key, int)}
    return {"state": {**rest, **({0: joined} if joined else {})}, "param_groups": [{**groups[0], "params": [0]}]}


def checkpoint_model_state(saved: dict) -> dict:
    """The model's state dict in a loaded checkpoint (either format). Only the sandboxed trainer calls this."""
    if "model_file" in saved:
        return torch.load(io.BytesIO(saved["model_file"]), map_location="cpu", weights_only=True)
    return saved["model"]


@dataclass
class SavedModel:
    workload: str | None  # a built-in's name, or None for a job owner's code
    entrypoint: str | None  # "pkg.mod:func" for a job owner's code
    params: dict[str, Any]
    state_dict: dict[str, torch.Tensor]
    metrics: dict[str, float] = field(default_factory=dict)  # what the job measured when it saved the model
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.workload or self.entrypoint or "?"


def save_model_file(path: Path, *, workload: str | None, entrypoint: str | None, params: Any,
                    model: torch.nn.Module, metrics: dict[str, float], metadata: dict[str, Any]) -> None:
    """Write `model` in the model file format (its state_dict on the CPU; `params` a Params instance or a dict)."""
    state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    torch.save({"format": MODEL_FORMAT, "workload": workload, "entrypoint": entrypoint, "params": params_dict(params),
                "state_dict": state, "metrics": {k: float(v) for k, v in metrics.items()},
                "metadata": dict(metadata)}, path)


def read_model_file(path: Path) -> SavedModel:
    """The model file at `path`; ValueError if it is not one (OSError if it cannot be read)."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as e:  # not torch's, truncated, not plain
        first_line = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise ValueError(f"{path} is not a gpuswarm model file: {first_line}") from None
    if not isinstance(saved, dict) or "state_dict" not in saved:
        raise ValueError(f"{path} is not a gpuswarm model file (no state_dict)")
    if saved.get("format") == MODEL_FORMAT:
        return SavedModel(workload=saved.get("workload"), entrypoint=saved.get("entrypoint"),
                          params=dict(saved.get("params") or {}), state_dict=saved["state_dict"],
                          metrics=dict(saved.get("metrics") or {}), metadata=dict(saved.get("metadata") or {}))
    if "format" in saved:
        raise ValueError(f"{path} is in model format {saved['format']!r}; this version reads {MODEL_FORMAT!r}")
    if "hyperparameters" in saved and "workload" in saved:  # the format before the SDK (digits-mlp only)
        metadata = dict(saved.get("metadata") or {})
        metrics = {"accuracy": float(metadata["accuracy"])} if metadata.get("accuracy") is not None else {}
        return SavedModel(workload=saved["workload"], entrypoint=None, params=dict(saved["hyperparameters"]),
                          state_dict=saved["state_dict"], metrics=metrics, metadata=metadata)
    raise ValueError(f"{path} is not a gpuswarm model file (no format)")


def evaluate_builtin(saved: SavedModel, device: torch.device | None = None) -> dict[str, float]:
    """Rebuild a built-in workload's model from its params and weights and measure it on the workload's own
    held-out data. WorkloadError for a job owner's code (it needs that code) or params this version refuses."""
    from gpuswarm.node.workloads import resolve_builtin

    if saved.workload is None:
        raise WorkloadError(f"the model was trained by the job owner's code ({saved.entrypoint}); evaluating it "
                            "needs that code: load it with torch.load and the owner's model class")
    cls = resolve_builtin(saved.workload)
    device = device or torch.device("cpu")
    with tempfile.TemporaryDirectory(prefix="gpuswarm-evaluate-") as workdir:
        workload = cls(Context(params=validate_params(cls, saved.params), dataset=None, device=device,
                               workdir=Path(workdir)))
        model = workload.build_model()
        model.load_state_dict(saved.state_dict)
        model.to(device).eval()
        with torch.no_grad():
            metrics = workload.evaluate(model)
    return {name: float(value) for name, value in metrics.items()}
