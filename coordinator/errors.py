"""One error type for the API and the one place that turns errors into HTTP responses.

Handlers and queries raise `ApiError` subclasses deep down; `error_middleware` maps them, and every other failure
(malformed JSON, validation errors, oversized bodies, unknown routes, bugs) to the same JSON shape:
{"error": {"code": "...", "message": "...", "details": [...]}}. A validation error's details are
`proto.strict.error_details`' (the full key path in `field`; for an unknown key, the key meant when one is close:
"budgett: unknown key; did you mean 'budget'?"), the same words the job owner's CLI prints for a bad job file.
"""

from __future__ import annotations

import logging

from aiohttp import web
from gpuswarm.proto.strict import error_details
from pydantic import ValidationError

logger = logging.getLogger(__name__)


class ApiError(Exception):
    status = 400
    code = "bad_request"

    def __init__(self, message: str, *, code: str | None = None, details: list | None = None):
        super().__init__(message)
        self.message = message
        self.code = code or self.code
        self.details = details


class BadRequest(ApiError):
    pass


class Unauthorized(ApiError):
    status, code = 401, "unauthorized"


class Forbidden(ApiError):
    status, code = 403, "forbidden"


class NotFound(ApiError):
    status, code = 404, "not_found"


class Conflict(ApiError):
    status, code = 409, "conflict"


class PaymentRequired(ApiError):
    status, code = 402, "insufficient_funds"


class LengthRequired(ApiError):
    status, code = 411, "length_required"


class PayloadTooLarge(ApiError):
    status, code = 413, "payload_too_large"


class Unprocessable(ApiError):
    status, code = 422, "invalid"


def error_body(code: str, message: str, details: list | None = None) -> dict:
    body: dict = {"code": code, "message": message}
    if details:
        body["details"] = details
    return {"error": body}


def validation_details(error: ValidationError) -> list[dict]:
    """Up to 20 `{"field": "stop.max_epochs", "message": "..."}`, one per invalid or unknown key."""
    return error_details(error)[:20]


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        if "\x00" in request.path or any("\x00" in k or "\x00" in v for k, v in request.query.items()):
            # PostgreSQL text cannot hold NUL (SQLite would look it up): refused for every route and database alike,
            # as read_json refuses it in bodies.
            raise Unprocessable("the URL must not contain NUL characters (%00)", code="nul_character")
        return await handler(request)
    except ApiError as e:
        return web.json_response(error_body(e.code, e.message, e.details), status=e.status)
    except ValidationError as e:
        details = validation_details(e)
        summary = "; ".join(f"{d['field'] or 'body'}: {d['message']}" for d in details[:3])
        return web.json_response(error_body("invalid", f"invalid request: {summary}", details), status=422)
    except web.HTTPRequestEntityTooLarge as e:
        return web.json_response(error_body("payload_too_large", e.text or "request body too large"), status=413)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        # aiohttp's own headers stay: a 405's Allow lists the methods the path takes.
        headers = {k: v for k, v in e.headers.items() if k in ("Allow",)}
        return web.json_response(error_body(e.reason.lower().replace(" ", "_"), e.reason), status=e.status,
                                 headers=headers)
    except Exception:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return web.json_response(error_body("internal", "internal server error"), status=500)
