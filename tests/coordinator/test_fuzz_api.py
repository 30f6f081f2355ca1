"""The whole /v1 API fuzzed from its own OpenAPI document: no input gets a 5xx, a refused request changes nothing,
and every success answer conforms to the schema the document declares for it.

Hypothesis draws an operation from GET /v1/openapi.json, then its path parameters (ids of rows that exist, or junk),
an Authorization header (none, the owner's, another owner's, the admin's, or junk: non-ASCII, far too long, the
wrong scheme), a query string, and a body: one generated from the operation's schema (`from_schema` below),
signed by a registered node for the node operations so that requests get past the signature to validation and the
handler; or hostile JSON (integers of thousands of digits, floats past 64 bits, deep nesting, NUL, NaN, invalid
UTF-8). The database is snapshotted around every request.

The supervisor's loop (matching, timeouts, settlement) does not run here: the API is the unit under test, and a tick
between two snapshots would be a change no request made.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import string
from urllib.parse import quote

import jsonschema
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from gpuswarm.coordinator import app as app_module
from gpuswarm.coordinator.config import ADMIN_TOKEN, MESH_VERSION, WAKE, CoordinatorConfig
from gpuswarm.coordinator.mesh import MeshVersion
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_api import job_spec, new_identity, new_owner_token, register, snapshot

CASES = {"sqlite": 1000, "postgres": 300}  # PostgreSQL adds its own types and limits; SQLite is 3 times faster
JSON_LEAVES = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
               | st.text(max_size=20))
JSON = st.recursive(JSON_LEAVES, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=10), inner, max_size=4), max_leaves=12)
HOSTILE_BODIES = st.sampled_from([
    b'{"a": ' + b"7" * 5000 + b"}", b"[" * 5000 + b"]" * 5000, b'{"a": 1e999}', b'{"a": NaN}', b'{"a": -Infinity}',
    b'{"name": "\\u0000"}', b"\xff\xfe{}", b"", b"null", b'"text"', b"[]", b'{"budget": 1e308}',
    b'{"credits": 9223372036854775808}', b'{"amount": -1e12, "memo": "x"}', b"{" + b'"k": 1,' * 3000 + b'"k": 2}',
])
HEADER_TEXT = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x2FF, exclude_characters="\x7f"), max_size=30)
JUNK_TOKENS = st.sampled_from(["Bearer ", "Bearer \u00e9t\u00e9", "bearer x", "Basic Zm9vOmJhcg==",
                               "Bearer " + "a" * 5000]) | HEADER_TEXT.map(lambda t: "Bearer " + t)


def from_schema(schema: dict, root: dict) -> st.SearchStrategy:
    """Values for a JSON schema as pydantic writes them ($ref, anyOf, objects, arrays, bounded numbers, patterns,
    enums): mostly valid, so requests reach the handlers; `JSON` mixed in at every level for the rest."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return st.deferred(lambda: from_schema(root["components"]["schemas"][name], root))
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([from_schema(s, root) for s in schema[key]])
    if "allOf" in schema:
        return from_schema(schema["allOf"][0], root)
    kind = schema.get("type")
    if kind == "object":
        properties = schema.get("properties", {})
        required = set(schema.get("required", ()))
        fields = {k: from_schema(v, root) for k, v in properties.items() if k in required}
        optional = {k: from_schema(v, root) for k, v in properties.items() if k not in required}
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict) and not properties:
            return st.dictionaries(st.text(max_size=16), from_schema(extra, root), max_size=3)
        return st.fixed_dictionaries(fields, optional=optional)
    if kind == "array":
        high = min(schema.get("maxItems", 4), 4)
        return st.lists(from_schema(schema.get("items", {}), root), min_size=min(schema.get("minItems", 0), high),
                        max_size=high)
    if kind == "string":
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True)
        return st.text(min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", 40), 40))
    if kind in ("integer", "number"):
        low, high = schema.get("minimum", schema.get("exclusiveMinimum")), schema.get("maximum",
                                                                                    schema.get("exclusiveMaximum"))
        if kind == "integer":
            return st.integers(None if low is None else int(low), None if high is None else int(high))
        return st.floats(low, high, allow_nan=False, allow_infinity=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return JSON


async def _no_supervisor(app: web.Application):
    app[WAKE] = asyncio.Event()
    app[MESH_VERSION] = MeshVersion()
    yield


class Harness:
    """A coordinator with an owner, a second owner, a registered node, a job and the operations of its document."""

    async def start(self, tmp_path, database_url):
        app = app_module.create_app(CoordinatorConfig(data_dir=tmp_path / "coordinator", database_url=database_url,
                                                      start_dht=False, loop_interval=3600))
        app.cleanup_ctx[app.cleanup_ctx.index(app_module._supervisor)] = _no_supervisor
        self.server = TestServer(app)
        await self.server.start_server()
        self.client = TestClient(self.server)
        await self.client.start_server()
        self.app = app
        self.tokens = {"owner": await new_owner_token(self.server, app, "owner", 1000.0),
                       "other": await new_owner_token(self.server, app, "other", 10.0),
                       "admin": app[ADMIN_TOKEN]}
        self.node = new_identity()
        await register(self.client, self.node)
        response = await self.client.post("/v1/jobs", json=job_spec(budget=5.0),
                                          headers={"Authorization": f"Bearer {self.tokens['owner']}"})
        assert response.status == 201, await response.text()
        self.job_id = (await response.json())["id"]
        owners = await (await self.client.get("/v1/owners/me", headers={
            "Authorization": f"Bearer {self.tokens['owner']}"})).json()
        self.ids = {"job_id": self.job_id, "owner_id": owners["id"], "node_id": self.node.node_id,
                    "name": "model.pt", "sha256": "0" * 64, "challenge_id": "c-000000000000"}
        self.doc = await (await self.client.get("/v1/openapi.json")).json()
        self.operations = [(path, method, op) for path, ops in self.doc["paths"].items() for method, op in ops.items()]
        return self

    async def stop(self):
        await self.client.close()
        await self.server.close()

    def schema(self, schema: dict) -> dict:
        return {**schema, "components": self.doc["components"]}

    def values(self, schema: dict) -> st.SearchStrategy:
        return from_schema(schema, self.doc) | JSON

    def bodies(self, op: dict) -> st.SearchStrategy[bytes | None]:
        """Bodies for one operation: from its schema (a node's signed payload signed by the registered node), or
        hostile."""
        options = [HOSTILE_BODIES, JSON.map(lambda v: json.dumps(v).encode()), st.just(None)]
        signed = op.get("x-signed")
        content = op.get("requestBody", {}).get("content", {}).get("application/json")
        if signed:
            # An envelope's payload is an object: the schema's, or any.
            payloads = from_schema(signed["payload"], self.doc) | st.dictionaries(st.text(max_size=10), JSON,
                                                                                  max_size=4)
            payloads = st.tuples(payloads, st.booleans()).map(lambda p: self._signed(signed["kind"], *p))
            options.append(payloads)
        elif content:
            options.append(self.values(content["schema"]).map(lambda v: json.dumps(v).encode()))
        return st.one_of(options)

    def _signed(self, kind: str, payload, as_node: bool) -> bytes:
        if as_node and isinstance(payload, dict) and "node_id" in payload:
            payload = payload | {"node_id": self.node.node_id}
        return json.dumps(self.node.sign(kind, payload).model_dump(mode="json")).encode()

    def requests(self) -> st.SearchStrategy[tuple]:
        def for_operation(entry):
            path, method, op = entry
            params = {name: st.sampled_from([self.ids.get(name, "x")]) | st.text(min_size=1, max_size=80)
                      for name in _params(path)}
            auth = st.sampled_from([None, "owner", "other", "admin"]).map(
                lambda who: who and f"Bearer {self.tokens[who]}") | JUNK_TOKENS
            query = st.dictionaries(st.sampled_from(["after", "state", "limit", "since"]),
                                    st.text(string.printable, max_size=12), max_size=2)
            return st.tuples(st.just(path), st.just(method), st.just(op), st.fixed_dictionaries(params), auth, query,
                             self.bodies(op))
        return st.sampled_from(self.operations).flatmap(for_operation) | st.tuples(
            st.just("/v1/jobs"), st.sampled_from(["TRACE", "PATCH", "DELETE", "OPTIONS"]), st.just({}),
            st.just({}), st.none(), st.just({}), st.none())

    async def check(self, path, method, op, params, auth, query, body) -> int:
        url = path.format(**{k: quote(v, safe="") for k, v in params.items()})
        headers = {"Content-Type": "application/json"}
        if auth is not None:
            headers["Authorization"] = auth
        before = await snapshot(self.app)
        response = await self.client.request(method.upper(), url, params=query, data=body, headers=headers,
                                             skip_auto_headers=["Content-Type"] if body is None else ())
        text = await response.read()
        assert response.status < 500, (method, url, body and body[:300], response.status, text[:500])
        if response.status >= 400:
            after = await snapshot(self.app)
            assert after == before, f"refused {method} {url} ({response.status}) changed the database"
            assert json.loads(text)["error"]["code"], text[:300]
            if response.status == 405:
                assert response.headers.get("Allow"), "a 405 without Allow"
        else:
            declared = op.get("responses", {}).get(str(response.status), {}).get("content", {})
            schema = declared.get("application/json", {}).get("schema")
            if schema is not None:
                jsonschema.validate(json.loads(text), self.schema(schema))
        return response.status


def _params(path: str) -> list[str]:
    return [part[1:-1] for part in path.split("/") if part.startswith("{")]


def test_no_input_gets_a_5xx_or_changes_the_database_when_refused(tmp_path, database_url):
    loop = asyncio.new_event_loop()
    harness = loop.run_until_complete(Harness().start(tmp_path, database_url))
    statuses: dict[int, int] = {}
    cases = CASES["sqlite" if database_url is None else "postgres"]
    try:
        @settings(max_examples=cases, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
        @given(harness.requests())
        def fuzz(request):
            status = loop.run_until_complete(harness.check(*request))
            statuses[status] = statuses.get(status, 0) + 1

        fuzz()
    finally:
        with contextlib.suppress(Exception):
            loop.run_until_complete(harness.stop())
        loop.close()
    print("statuses:", dict(sorted(statuses.items())))
    assert sum(statuses.values()) >= cases
    assert any(200 <= s < 300 for s in statuses), "no request got through: the fuzzer tests only the front door"
