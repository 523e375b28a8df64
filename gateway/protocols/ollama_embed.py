"""Ollama's ``POST /api/embed`` (inputs in a batch, ``embeddings``) and the older
``POST /api/embeddings`` (one ``prompt``, ``embedding``), on the path of
``/v1/embeddings`` (:func:`gateway.protocols.embeddings.embed`): the same engine, batching,
limits and books.

``truncate`` (true unless false) cuts an input to the model's context; false makes an
input over it a 400. An empty input loads the model and answers no vectors, as Ollama
does. ``options`` are accepted and ignored.
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.conversation.start import hold, ready
from gateway.front import Front, admit
from gateway.protocols.embeddings import embed
from gateway.protocols.ollama_run import keep_alive
from gateway.protocols.ollama_schemas import EmbedRequest, LegacyEmbeddingsRequest, parse, served_name


async def embed_route(request: Request) -> Response:
    """``POST /api/embed``: ``{"model", "embeddings": [[...], ...], "total_duration",
    "load_duration", "prompt_eval_count"}`` (durations in nanoseconds; the load's wait is
    counted in ``total_duration``, ``load_duration`` is 0).

    Raises:
        APIError: 400 for a bad body, a model that does not embed or an input over the
            context without ``truncate``; 404 for the model; 413/429/503.
    """
    front: Front = request.app.state.front
    call = await admit(front, request, "ollama_embed", "embeddings")
    req = parse(EmbedRequest, call.body)
    req.model = served_name(front, req.model)
    inputs = [req.input] if isinstance(req.input, str) else list(req.input)
    inputs = [t for t in inputs if t] if len(inputs) == 1 else inputs
    if not inputs:
        model = await ready(hold(call, req.model))
        vectors, n = [], 0
    else:
        model, vectors, n = await embed(call, req.model, inputs, req.dimensions, truncate=req.truncate is not False)
    keep_alive(call, req.keep_alive)
    return JSONResponse({"model": model.name, "embeddings": [[float(x) for x in v] for v in vectors],
                         "total_duration": int((time.monotonic() - call.record.marks["received"]) * 1e9),
                         "load_duration": 0,
                         "prompt_eval_count": n})


async def embeddings_route(request: Request) -> Response:
    """``POST /api/embeddings``: ``{"embedding": [...]}`` (empty for an empty prompt).

    Raises:
        APIError: as :func:`embed_route`.
    """
    front: Front = request.app.state.front
    call = await admit(front, request, "ollama_embeddings", "embeddings")
    req = parse(LegacyEmbeddingsRequest, call.body)
    req.model = served_name(front, req.model)
    if not req.prompt:
        await ready(hold(call, req.model))
        vector = []
    else:
        _, vectors, _ = await embed(call, req.model, [req.prompt], truncate=True)
        vector = [float(x) for x in vectors[0]]
    keep_alive(call, req.keep_alive)
    return JSONResponse({"embedding": vector})
