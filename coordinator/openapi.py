"""The OpenAPI 3.1 document of the /v1 API, built from the app's own routes and the proto models.

Owns `describe` (a decorator that records who may call a handler, which proto model its body is and which model
its success answer is), `respond` (a handler's answer, serialised through that model) and `build`, which walks the
router, so a route cannot be served without appearing in the document. Request and response schemas come from
pydantic (`models_json_schema`, in validation mode: what a client accepts); the summary is the handler's docstring.
"""

from __future__ import annotations

import inspect
from typing import Any

from aiohttp import web
from gpuswarm.proto.signing import SignedEnvelope
from pydantic import BaseModel, ValidationError
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


def describe(*, auth: str, body: type[BaseModel] | None = None, signed: str | None = None,
             response: type[BaseModel] | None = None, status: int = 200):
    """Record a handler's caller (`auth`: anyone, owner, admin, node), its body: a proto model, sent plain or, when
    `signed` names an envelope kind, as the payload of a SignedEnvelope; and its success answer: `response`, a
    model of proto.api (or proto.models, proto.challenge), with HTTP `status`."""
    if auth not in AUTH:
        raise ValueError(f"unknown auth {auth!r}")

    def mark(handler):
        handler.__openapi__ = {"auth": auth, "body": body, "signed": signed, "response": response,
                               "status": status}
        return handler

    return mark


class ResponseMismatch(RuntimeError):
    """A handler built an answer its response model does not accept: the server's bug (500), not the caller's."""


def respond(answer: BaseModel | type[BaseModel], data: Any = None, *, status: int = 200) -> web.Response:
    """A handler's success answer, serialised through its response model: a model instance, or a model class and
    the `data` (plain values) it must accept. Enums go out as their values."""
    if isinstance(answer, type):
        try:
            answer = answer.model_validate(data)
        except ValidationError as e:
            raise ResponseMismatch(f"the answer does not fit {answer.__name__}: {e}") from e
    return web.json_response(answer.model_dump(mode="json"), status=status)


def build(app: web.Application) -> dict[str, Any]:
    operations: dict[str, dict[str, Any]] = {}
    refs: list[tuple[dict[str, Any], type[BaseModel]]] = []  # schemas to point at their model, once named
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource else {}
        path = info.get("formatter") or info.get("path")
        if not path or not path.startswith("/v1/") or route.method == "HEAD":
            continue
        meta = {"auth": "anyone", "body": None, "signed": None, "response": None, "status": 200} | getattr(
            route.handler, "__openapi__", {})
        doc = inspect.getdoc(route.handler) or route.handler.__name__.replace("_", " ")
        success: dict[str, Any] = {"description": "success (JSON)"}
        if meta["response"] is not None:
            schema: dict[str, Any] = {}
            refs.append((schema, meta["response"]))
            success["content"] = {"application/json": {"schema": schema}}
        operation: dict[str, Any] = {
            "operationId": route.handler.__name__, "summary": doc.splitlines()[0], "description": doc,
            "security": AUTH[meta["auth"]],
            "parameters": [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                           for name in _path_params(path)],
            "responses": {str(meta["status"]) if meta["response"] else "2XX": success,
                          "4XX": {"description": "refused", "content": {"application/json": {
                              "schema": ERROR_SCHEMA}}}},
        }
        if meta["body"] is not None:
            schema = {}
            refs.append((schema, SignedEnvelope if meta["signed"] else meta["body"]))
            if meta["signed"]:
                payload: dict[str, Any] = {}
                refs.append((payload, meta["body"]))
                operation["description"] += (f"\n\nThe body is a SignedEnvelope of kind `{meta['signed']}` whose "
                                             f"payload is a {meta['body'].__name__}.")
                operation["x-signed"] = {"kind": meta["signed"], "payload": payload}  # for clients and the fuzz test
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
        operations.setdefault(path, {})[route.method.lower()] = operation
    models = sorted({model for _, model in refs} | {SignedEnvelope}, key=lambda m: (m.__name__, m.__module__))
    named, definitions = models_json_schema([(m, "validation") for m in models],
                                            ref_template="#/components/schemas/{model}")
    for schema, model in refs:
        schema.update(named[(model, "validation")])
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
