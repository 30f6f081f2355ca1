"""Strict input: the base of every model a job owner or an operator sends, and the wording of validation errors.

Owns `OwnerModel` (unknown keys are errors, scalars are not coerced: "2" is not an int, true is not a number, 5 is
a fine float), `close_key` (the "did you mean" suggestion), `drop_unknown_keys` (how a strict model is read back
when it is relayed: a newer coordinator's extra keys are dropped, so an older node or client still parses it), and
`error_details` (one `{field, message}` per error, the full key path in `field`), which the coordinator's 422
answers and the job owner's CLI both print, so that both say the same thing.

Node-to-coordinator wire models are not strict and must not be: they ignore unknown fields so that mixed versions
still talk (`proto.models.WireModel`). Pure pydantic; it imports nothing else of gpuswarm.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

UNKNOWN_KEY = "unknown_key"  # the error type of an unknown key, in place of pydantic's extra_forbidden
_PREFIXES = ("Value error, ", "Assertion failed, ")  # what pydantic puts before a validator's own message


def close_key(name: str, known: Iterable[str]) -> str | None:
    """The known key `name` was most likely meant to be (a typo, a wrong plural), or None when none is close."""
    matches = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    if not matches:  # "Budget" for "budget", "MAX_NODES" for "max_nodes"
        matches = [k for k in known if k.lower() == name.lower()][:1]
    return matches[0] if matches else None


def unknown_key_message(name: str, known: Iterable[str]) -> str:
    known = list(known)
    meant = close_key(name, known)
    if meant is not None:
        return f"unknown key; did you mean {meant!r}?"
    return f"unknown key; the known keys are {', '.join(known)}" if known else "unknown key"


class OwnerModel(BaseModel):
    """Base of what owners and operators send: immutable, strict scalars, and every unknown key an error that
    names the key and, when one is close, the key meant."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    @model_validator(mode="wrap")
    @classmethod
    def _name_unknown_keys(cls, data: Any, handler: Any) -> Any:
        try:
            return handler(data)
        except ValidationError as e:
            errors = e.errors()
            if not any(err["type"] == "extra_forbidden" and len(err["loc"]) == 1 for err in errors):
                raise
            # Nested models have already renamed their own unknown keys: only this level's are left to do.
            known = list(cls.model_fields)
            details = [_unknown_key(err, known) if err["type"] == "extra_forbidden" and len(err["loc"]) == 1
                       else _as_is(err) for err in errors]
            raise ValidationError.from_exception_data(cls.__name__, details) from None


def _unknown_key(err: Any, known: list[str]) -> InitErrorDetails:
    message = unknown_key_message(str(err["loc"][0]), known)
    return InitErrorDetails(type=PydanticCustomError(UNKNOWN_KEY, message), loc=err["loc"], input=err["input"])


def _as_is(err: Any) -> InitErrorDetails:
    # The message is already rendered: kept as it is (a custom error's template is only filled with a context).
    return InitErrorDetails(type=PydanticCustomError(err["type"], err["msg"]), loc=err["loc"], input=err["input"])


def drop_unknown_keys(model: type[BaseModel], data: Any) -> Any:
    """`data` with the keys `model` (and the strict models nested in it) does not know removed.

    For a strict model read back where it is relayed rather than sent by its owner, e.g. the job spec inside a
    node's assignment: a newer coordinator may know keys this version does not."""
    if not isinstance(data, dict):
        return data
    kept: dict[str, Any] = {}
    for key, value in data.items():
        field = model.model_fields.get(key)
        if field is None:
            continue
        nested = _model_in(field.annotation)
        kept[key] = drop_unknown_keys(nested, value) if nested is not None else value
    return kept


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model class an annotation holds (`M`, `M | None`), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [m for arg in typing.get_args(annotation) if (m := _model_in(arg)) is not None]
        return models[0] if len(models) == 1 else None
    return None


def key_path(loc: tuple[int | str, ...]) -> str:
    """A validation error's location as a key path: `stop.max_epochs`, `requirements.gpu_models.0`."""
    return ".".join(str(part) for part in loc)


def error_details(error: ValidationError) -> list[dict[str, str]]:
    """One `{"field": key path, "message": what is wrong}` per error, in pydantic's order."""
    return [{"field": key_path(err["loc"]), "message": _message(err)} for err in error.errors()]


def _message(err: Any) -> str:
    message = err["msg"]
    for prefix in _PREFIXES:
        if message.startswith(prefix):
            message = message[len(prefix):]
    if err["type"].endswith("_type") or err["type"] == "int_from_float":
        message += f", got {_kind_of(err['input'])}"
    return message


def _kind_of(value: Any) -> str:
    """What a wrong-typed value is, in the words of JSON and TOML."""
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:40] + "…"
        return f"the string {shown!r}"
    if isinstance(value, int | float):
        return f"the number {value!r}"
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "an object (table)"
    if isinstance(value, list | tuple):
        return "a list"
    return f"a {type(value).__name__}"
