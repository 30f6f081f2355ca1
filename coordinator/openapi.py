"""The OpenAPI 3.1 document of the /v1 API, built from the app's own routes and the proto models.

Owns `describe` (a decorator that records who may call a handler and which proto model its body is) and `build`,
which walks the router, so a route cannot be served without appearing in the document. Request schemas come from
pydantic (`models_json_schema`); the summary is the handler's docstring.
"""

from __future__ import annotations

import inspect
from typing import Any

from aiohttp import web
from gpuswarm.proto.signing import SignedEnvelope
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from gpuswarm import __version__

ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["code", "message"],
    "properties": {"code": {"type": "string"}, "message": {"type": "string"}, "details": {"type": "array"}}}}}
AUTH = {
    "anyone": [],
    "owner": [{"ownerToken": []}],
    "admin": [{"adminToken": []}],
    "node": [],  # nodes sign the body (a SignedEnvelope); there is no header to declare
}


def describe(*, auth: str, body: type[BaseModel] | None = None, signed: str | None = None):
    """Record a handler's caller (`auth`: anyone, owner, admin, node) and body: a proto model, sent plain or, when
    `signed` names an envelope kind, as the payload of a SignedEnvelope."""
    if auth not in AUTH:
        raise ValueError(f"unknown auth {auth!r}")

    def mark(handler):
        handler.__openapi__ = {"auth": auth, "body": body, "signed": signed}
        return handler

    return mark


def build(app: web.Application) -> dict[str, Any]:
    operations: dict[str, dict[str, Any]] = {}
    models: set[type[BaseModel]] = {SignedEnvelope}
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource else {}
        path = info.get("formatter") or info.get("path")
        if not path or not path.startswith("/v1/") or route.method == "HEAD":
            continue
        meta = getattr(route.handler, "__openapi__", {"auth": "anyone", "body": None, "signed": None})
        doc = inspect.getdoc(route.handler) or route.handler.__name__.replace("_", " ")
        operation: dict[str, Any] = {
            "operationId": route.handler.__name__, "summary": doc.splitlines()[0], "description": doc,
            "security": AUTH[meta["auth"]],
            "parameters": [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                           for name in _path_params(path)],
            "responses": {"2XX": {"description": "success (JSON)"},
                          "4XX": {"description": "refused", "content": {"application/json": {
                              "schema": ERROR_SCHEMA}}}},
        }
        if meta["body"] is not None:
            models.add(meta["body"])
            schema = {"$ref": f"#/components/schemas/{meta['body'].__name__}"}
            if meta["signed"]:
                operation["description"] += (f"\n\nThe body is a SignedEnvelope of kind `{meta['signed']}` whose "
                                             f"payload is a {meta['body'].__name__}.")
                schema = {"$ref": "#/components/schemas/SignedEnvelope"}
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
        operations.setdefault(path, {})[route.method.lower()] = operation
    _, definitions = models_json_schema([(m, "validation") for m in sorted(models, key=lambda m: m.__name__)],
                                        ref_template="#/components/schemas/{model}")
    return {
        "openapi": "3.1.0",
        "info": {"title": "gpuswarm coordinator", "version": __version__},
        "paths": dict(sorted(operations.items())),
        "components": {"schemas": definitions.get("$defs", {}), "securitySchemes": {
            "ownerToken": {"type": "http", "scheme": "bearer", "description": "a job owner's API token (gso_...)"},
            "adminToken": {"type": "http", "scheme": "bearer", "description": "DATA_DIR/admin.token"}}},
    }


def _path_params(path: str) -> list[str]:
    return [part[1:-1] for part in path.split("/") if part.startswith("{") and part.endswith("}")]
