"""Finding a workload and checking its params: the node's training process and `gpuswarm job submit` both use it.

Owns importing an entrypoint (`package.module:function`) from a code directory or wheel, reading the params schema
a workload declares, and validating params against it with readable errors. As a command
(`python -m gpuswarm.sdk.loader --code PATH --entrypoint E --params JSON`) it prints one JSON line, so that the job
owner's CLI can check params in a separate process that imports the owner's code, not in its own.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import inspect
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

Factory = Callable[..., Any]


class WorkloadError(Exception):
    """The workload cannot be loaded or its params are wrong; the message says why, for the job owner."""


def import_entrypoint(entrypoint: str, code: Path | None = None) -> Factory:
    """The callable `entrypoint` names, importing its module from `code` (a directory or a wheel) first."""
    module_name, sep, attr = entrypoint.partition(":")
    if not sep or not module_name or not attr:
        raise WorkloadError(f"entrypoint {entrypoint!r} must look like package.module:function")
    if code is not None:
        sys.path.insert(0, str(code))
        importlib.invalidate_caches()
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # owners' code: anything may go wrong while it imports
        raise WorkloadError(f"cannot import {module_name!r} (entrypoint {entrypoint}): {type(e).__name__}: {e}") \
            from e
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise WorkloadError(f"module {module_name!r} has no callable {attr!r} (entrypoint {entrypoint})")
    return factory


def params_schema(factory: Factory) -> type[BaseModel] | None:
    """The pydantic model a factory declares for its params (`Params`, on a Workload class or on the function)."""
    schema = getattr(factory, "Params", None)
    if schema is None:
        return None
    if not (inspect.isclass(schema) and issubclass(schema, BaseModel)):
        raise WorkloadError(f"{getattr(factory, '__name__', factory)}.Params must be a pydantic model class")
    return schema


def validate_params(factory: Factory, params: dict[str, Any]) -> Any:
    """`params` as the factory's schema reads them (a model instance), or the dict itself when there is none."""
    schema = params_schema(factory)
    if schema is None:
        return dict(params)
    if schema.model_config.get("extra") != "allow":  # a typo is an error, not a silently ignored key
        unknown = sorted(set(params) - set(schema.model_fields))
        if unknown:
            hints = {name: difflib.get_close_matches(name, list(schema.model_fields), n=1) for name in unknown}
            raise WorkloadError("invalid params: " + "; ".join(
                f"{name}: unknown param" + (f"; did you mean {hints[name][0]!r}?" if hints[name] else "")
                for name in unknown))
    try:
        return schema.model_validate(params)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'params'}: {err['msg']}"
                             for err in e.errors())
        raise WorkloadError(f"invalid params: {problems}") from None


def params_dict(params: Any) -> dict[str, Any]:
    """Validated params as plain JSON-able data (what is saved with a model)."""
    return params.model_dump(mode="json") if isinstance(params, BaseModel) else dict(params)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuswarm.sdk.loader",
                                     description="Check a workload entrypoint and its params; print one JSON line.")
    parser.add_argument("--code", type=Path, required=True, help="the code directory or wheel")
    parser.add_argument("--entrypoint", required=True)
    parser.add_argument("--params", default="{}", help="the params as a JSON object")
    args = parser.parse_args(argv)
    try:
        factory = import_entrypoint(args.entrypoint, args.code)
        params = validate_params(factory, json.loads(args.params))
        print(json.dumps({"ok": True, "params": params_dict(params),
                          "schema": getattr(params_schema(factory), "__name__", None)}))
        return 0
    except WorkloadError as e:
        print(json.dumps({"ok": False, "error": str(e)}))
        return 1


if __name__ == "__main__":
    sys.exit(main())
