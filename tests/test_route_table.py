"""The one route table (``gateway/routes/table.py``) against what reads it: the routes a
live gateway serves, the paths of its ``openapi.json``, and the routes of the cluster front
(``deploy/cluster/front.py``), each rule sent to its handler."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from starlette.routing import Route as StarletteRoute

from conftest import live_server, model_path
from gateway.http.errors import APIError
from gateway.routes.table import (ANY, EVERY, FRONT, REPLICA, ROUTER, ROUTES, STORED, error_style, metrics_label,
                                 openapi_path)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy" / "cluster"))

import front  # noqa: E402

# The front's handler for each cluster rule.
FRONT_HANDLERS = {ROUTER: "to_router", REPLICA: "conversation", STORED: "stored_response", ANY: "any_replica",
                  EVERY: "every_replica", FRONT: "health"}


def table_methods() -> dict[str, set[str]]:
    """Each path of the table and its methods (``HEAD`` with every ``GET``, as Starlette serves it)."""
    out: dict[str, set[str]] = {}
    for r in ROUTES:
        out.setdefault(r.path, set()).update(r.methods, {"HEAD"} if "GET" in r.methods else set())
    return out


@pytest.fixture(scope="module")
def server():
    with live_server(model_path("qwen3")) as s:
        yield s


def test_the_table_is_well_formed():
    seen = set()
    for r in ROUTES:
        for m in r.methods:
            assert (m, r.path) not in seen, f"{m} {r.path} is declared twice"
            seen.add((m, r.path))
        assert r.cluster in FRONT_HANDLERS, r
        # an error shape APIError renders (any but OpenAI's own renders differently)
        openai = APIError(400, "x").response().body
        assert (APIError(400, "x").response(r.errors).body == openai) == (r.errors == "openai"), r
        assert {x.cluster for x in ROUTES if x.path == r.path} == {r.cluster}, f"{r.path}: one rule per path"
    ops = [r.doc.op for r in ROUTES if r.doc is not None]
    assert len(ops) == len(set(ops)), "operationIds are unique"


def test_the_served_routes_are_the_table(server):
    served: dict[str, set[str]] = {}
    for r in server.app.routes:
        if isinstance(r, StarletteRoute):
            served.setdefault(r.path, set()).update(r.methods)
    assert served == table_methods()
    handlers = {(r.path, m): f"{r.endpoint.__module__}:{r.endpoint.__name__}"
                for r in server.app.routes for m in r.methods}
    for r in ROUTES:
        for m in r.methods:
            assert handlers[(r.path, m)] == r.handler, (m, r.path)
    with server.client() as c:  # and over HTTP: a route not in the table is a 404 in its path's error shape
        assert c.get("/v1/embeddings").status_code == 405
        assert c.get("/v1/nothing").json()["error"]["type"] == "not_found_error"
        assert c.post("/v1/messages/batches", json={}).json()["type"] == "error"


def test_openapi_documents_the_public_routes(server):
    with server.client() as c:
        doc = c.get("/openapi.json").json()
    documented = {}
    for r in ROUTES:
        if r.doc is not None:
            documented.setdefault(openapi_path(r.path), set()).update(m.lower() for m in r.methods)
    assert {path: set(ops) for path, ops in doc["paths"].items()} == documented
    # every OpenAI, Anthropic and Responses route is public
    assert {openapi_path(r.path) for r in ROUTES if r.path.startswith("/v1/")} <= set(documented)
    embeddings = doc["paths"]["/v1/embeddings"]["post"]
    assert embeddings["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/EmbeddingsRequest")
    assert doc["components"]["schemas"]["EmbeddingsRequest"]["properties"]["model"]["anyOf"][0] == {
        "enum": ["test-model"]}
    model = doc["paths"]["/v1/models/{model_id}"]["get"]
    assert [p["name"] for p in model["parameters"]] == ["model_id"] and "404" in model["responses"]
    anthropic = doc["paths"]["/v1/messages"]["post"]["responses"]["400"]["content"]["application/json"]
    assert anthropic["schema"]["$ref"].endswith("/AnthropicError")


def test_the_cluster_front_serves_the_table_by_its_rules():
    app = front.FrontApp("http://127.0.0.1:9").app()
    *routes, rest = app.routes
    assert rest.path == "/{rest:path}" and rest.endpoint.__name__ == "to_router"  # anything else: the router
    got = {r.path: set(r.methods) - {"OPTIONS"} for r in routes}
    assert got == table_methods()
    for r in routes:  # CORS preflights follow the route, except on the front's own /health
        assert ("OPTIONS" in r.methods) == (r.path != "/health"), r.path
    rules = {r.path: r.cluster for r in ROUTES}
    assert {r.path: r.endpoint.__name__ for r in routes} == {p: FRONT_HANDLERS[c] for p, c in rules.items()}
    assert rules["/v1/responses/{response_id}/input_items"] == STORED and rules["/v1/embeddings"] == ROUTER


def test_metrics_labels_are_one_per_route():
    assert metrics_label("/v1/embeddings") == "/v1/embeddings"
    assert metrics_label("/v1/models/org/name") == metrics_label("/v1/models/m") == "/v1/models/{id}"
    assert metrics_label("/v1/responses/resp_1/input_items") == "/v1/responses/{id}"
    assert metrics_label("/admin/models/m/load") == "/admin/models/{id}"
    assert metrics_label("/v1/responses/a/b") == metrics_label("/nothing") == "other"


def test_error_style_follows_the_table():
    assert error_style("/v1/messages") == error_style("/v1/messages/count_tokens") == "anthropic"
    assert error_style("/v1/messages/batches") == "anthropic"  # not served: its path's shape
    for path in ("/v1/chat/completions", "/v1/responses/resp_1/input_items", "/v1/models/a/b", "/nothing"):
        assert error_style(path) == "openai", path
    for path in ("/", "/api/chat", "/api/not-served"):  # Ollama's root and its API's family
        assert error_style(path) == "ollama", path
    assert front.FrontApp.error("/v1/messages", 502, "x", "c").body.startswith(b'{"type":"error"')
    assert front.FrontApp.error("/api/chat", 502, "x", "c").body == b'{"error":"x"}'
