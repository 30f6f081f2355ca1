"""Reading a request: bounded JSON bodies, proto validation, the signed artifact header, query parameters.

Owns how the coordinator reads what a caller sent, before any database work: `read_json` (the size cap while
reading, malformed JSON, NUL characters), `parse` (a proto model or 422 with field details), the
`X-Gpuswarm-Envelope` header of artifact uploads, and small query and address helpers. It does not check
signatures or who the caller is: that is `auth`'s. It holds no state and touches no database.
"""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

from aiohttp import web
from gpuswarm.coordinator.config import CONFIG
from gpuswarm.coordinator.errors import BadRequest, PayloadTooLarge, Unauthorized, Unprocessable, validation_details
from gpuswarm.proto.models import ENVELOPE_HEADER
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)
MAX_STEP = 2**53  # proto's Count: no reported global_step is larger


async def read_json(request: web.Request, limit: int | None = None) -> Any:
    """The request body as JSON, refusing bodies over `limit` (default: the JSON cap) before reading them whole."""
    limit = limit or request.app[CONFIG].max_json_bytes
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"request body is {request.content_length} bytes; the limit is {limit}")
    raw = bytearray()
    while len(raw) <= limit and (chunk := await request.content.read(limit + 1 - len(raw))):
        raw += chunk
    if len(raw) > limit:
        raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
    data = _loads(raw, "")
    if _has_nul(data):
        # PostgreSQL text cannot hold NUL (SQLite would store it): refuse it here for every database alike.
        raise Unprocessable("text must not contain NUL characters (\\u0000)", code="nul_character")
    return data


def _loads(raw: bytes | str, where: str) -> Any:
    """JSON, or 400 malformed_json. ValueError covers more than syntax: undecodable bytes, and integers longer than
    Python's 4,300-digit conversion limit."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise BadRequest(f"malformed JSON{where}: nested too deeply", code="malformed_json") from None
    except ValueError as e:
        raise BadRequest(f"malformed JSON{where}: {str(e)[:200]}", code="malformed_json") from None


def _has_nul(data: Any) -> bool:
    stack = [data]
    while stack:  # a loop, not recursion: json.loads accepts nesting deeper than a recursive walk would survive
        item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def parse(model: type[M], data: Any, what: str) -> M:
    """`data` as a `model`, or 422 naming up to three invalid fields (all of them, up to 20, in `details`)."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        details = validation_details(e)
        summary = "; ".join(f"{d['field'] or what}: {d['message']}" for d in details[:3])
        raise Unprocessable(f"invalid {what}: {summary}", details=details) from None


def envelope_header(request: web.Request) -> Any:
    """The JSON of an artifact upload's signed header (the body is the artifact's bytes)."""
    header = request.headers.get(ENVELOPE_HEADER)
    if header is None:
        raise Unauthorized(f"artifact uploads need a signed {ENVELOPE_HEADER} header", code="bad_signature")
    return _loads(header, f" in {ENVELOPE_HEADER}")


def step_query(request: web.Request, name: str) -> int | None:
    """An optional query parameter holding a global step: a whole number from 0 to 2**53 (400 otherwise)."""
    raw = request.query.get(name)
    if raw is None:
        return None
    if not re.fullmatch(r"[0-9]{1,16}", raw) or int(raw) > MAX_STEP:
        raise BadRequest(f"{name} must be a global step: a whole number from 0 to {MAX_STEP}, not {raw[:40]!r}")
    return int(raw)


def observed_endpoint(request: web.Request, port: int) -> str | None:
    """The address the node's request came from, with its WireGuard port: a candidate it may not know itself."""
    host = request.remote
    if not host:
        return None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
