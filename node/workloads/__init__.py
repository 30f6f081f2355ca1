"""The built-in workloads: `gpuswarm.sdk.Workload` subclasses the node runs exactly as it runs a job owner's code.

Owns `BUILTINS` (name -> class; each class's `Params` is proto's schema of the same name, which the coordinator
checks at submit), `resolve_builtin`, and the saved model file (`saved`): its format, reading it back and
re-evaluating a built-in's model. It knows nothing of hivemind, the daemon or the coordinator;
`gpuswarm.node.worker` drives a workload. Adding a built-in means a params schema in `gpuswarm.proto.workloads`
and a class here.
"""

from __future__ import annotations

from gpuswarm.node.workloads.digits import DigitsMLP
from gpuswarm.sdk import Workload
from gpuswarm.sdk.loader import WorkloadError

BUILTINS: dict[str, type[Workload]] = {"digits-mlp": DigitsMLP}


def resolve_builtin(name: str) -> type[Workload]:
    """The class of built-in workload `name`; a WorkloadError naming the known ones if there is none."""
    try:
        return BUILTINS[name]
    except KeyError:
        raise WorkloadError(f"this node has no built-in workload {name!r}; it has: {', '.join(sorted(BUILTINS))}") \
            from None


__all__ = ["BUILTINS", "DigitsMLP", "resolve_builtin"]
