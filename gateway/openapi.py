"""The app's OpenAPI 3.1 document, built from the request schemas in :mod:`gateway.schemas`."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.schemas import ChatRequest, CompletionRequest


def openapi_document() -> dict:
    """The OpenAPI 3.1 document of the public routes (request bodies from pydantic)."""
    paths = {}
    for path, model in (("/v1/chat/completions", ChatRequest), ("/v1/completions", CompletionRequest)):
        paths[path] = {
            "post": {
                "requestBody": {"required": True,
                                "content": {"application/json": {"schema": model.model_json_schema()}}},
                "responses": {"200": {"description": "a completion or an SSE stream"}},
            }
        }
    for path in ("/v1/models", "/health"):
        paths[path] = {"get": {"responses": {"200": {"description": "OK"}}}}
    return {"openapi": "3.1.0", "info": {"title": "mlx-gateway", "version": "0.1.0"}, "paths": paths}


async def openapi_json(request: Request) -> Response:
    """``GET /openapi.json``."""
    return JSONResponse(openapi_document())
