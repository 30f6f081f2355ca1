"""The built-in workloads: `gpuswarm.sdk.Workload` subclasses the node runs exactly as it runs a job owner's code.

Owns `BUILTINS` (name -> where its class is; each class's `Params` is proto's schema of the same name, which the
coordinator checks at submit), `resolve_builtin` (which imports a built-in on first use), and the saved model file
(`saved`): its format, reading it back and re-evaluating a built-in's model. It knows nothing of hivemind, the
daemon or the coordinator; `gpuswarm.node.worker` drives a workload. Adding a built-in means a params schema in
`gpuswarm.proto.workloads` and a class here, listed in `BUILTINS`.
"""

from __future__ import annotations

import importlib

from gpuswarm.sdk import Workload
from gpuswarm.sdk.loader import WorkloadError

# name -> "module:class", imported on first use: a process that runs no built-in never imports its libraries.
# digits-mlp's scikit-learn (with scipy) cost 2 CPU-seconds at every trainer's and worker's start (a third of the
# trainer's imports), job owners' code and tinylm included, as the package imported every built-in up front.
BUILTINS: dict[str, str] = {"digits-mlp": "gpuswarm.node.workloads.digits:DigitsMLP"}


def resolve_builtin(name: str) -> type[Workload]:
    """The class of built-in workload `name`; a WorkloadError naming the known ones if there is none."""
    try:
        module, _, attribute = BUILTINS[name].partition(":")
    except KeyError:
        raise WorkloadError(f"this node has no built-in workload {name!r}; it has: {', '.join(sorted(BUILTINS))}") \
            from None
    return getattr(importlib.import_module(module), attribute)


__all__ = ["BUILTINS", "resolve_builtin"]
