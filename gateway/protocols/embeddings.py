"""OpenAI ``POST /v1/embeddings``: vectors of texts or token sequences, from an embedding model.

The request is OpenAI's: ``input`` is a string, a list of strings, a list of token ids
or a list of such lists (at most :data:`MAX_INPUTS`); ``encoding_format`` is ``float``
(lists of numbers) or ``base64`` (each vector's little-endian float32 bytes, base64
encoded, as OpenAI sends them and its SDK decodes them); ``dimensions`` cuts each
vector to its first N values, normalized again, for models trained for it (Matryoshka
representation learning: :data:`gateway.models.embedding.MATRYOSHKA_TYPES`), and is
refused with a 400 for the others. Unknown fields are ignored.

Inputs are tokenized in a worker thread, charged to the tenant's prompt-token limit
before the engine sees them, and embedded by the model's engine
(:class:`scheduler.engine.embedding.EmbeddingEngine`), batched with other requests' inputs.
A model that is not an embedding model answers 400 ``model_not_embedding``; asking a
chat endpoint of an embedding model answers 400 too
(:func:`gateway.conversation.start.converse`).
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Literal, Optional, Union

import anyio
import numpy as np
from pydantic import Field, StrictInt, StrictStr
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.conversation.start import hold, ready
from gateway.front import Call, Front, admit
from gateway.http.errors import APIError
from gateway.models.embedding import truncate as truncate_dims
from gateway.models.handle import ModelHandle
from gateway.protocols.openai_schemas import MAX_TOKEN_ID, Strict, parse
from scheduler.engine.embedding import EmbeddingRequest, EmbeddingsEvent
from scheduler.request import ErrorEvent
from scheduler.batch.rows import EngineDead, EngineOverloaded

MAX_INPUTS = 2048  # OpenAI's bound on the inputs of one request


class EmbeddingsRequest(Strict):
    input: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    model: Optional[str] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[StrictInt] = Field(default=None, ge=1)
    user: Optional[str] = None


def _sequences(model: ModelHandle, raw, truncate: bool = False) -> list[list[int]]:
    """The request's inputs as token sequences (worker thread); with ``truncate``, each
    cut to the model's context.

    Raises:
        APIError: 400 for no input, an empty input, a token id outside the vocabulary, too
            many inputs, or an input longer than the model's context.
    """
    if isinstance(raw, str):
        raw = [raw]
    if not raw:
        raise APIError(400, "input must not be empty", param="input")
    if all(isinstance(x, int) for x in raw):
        raw = [raw]
    if len(raw) > MAX_INPUTS:
        raise APIError(400, f"input holds {len(raw)} items; at most {MAX_INPUTS} are allowed", param="input")
    vocab = model.vocab_size
    out = []
    for i, item in enumerate(raw):
        if isinstance(item, str):
            if not item:
                raise APIError(400, f"input[{i}] is an empty string", param="input")
            seq = model.embedder.encode(item)
        else:
            if not item:
                raise APIError(400, f"input[{i}] is an empty list of tokens", param="input")
            if any(t < 0 or t >= min(vocab, MAX_TOKEN_ID) for t in item):
                raise APIError(400, f"input[{i}]: token ids must be in [0, {vocab})", param="input")
            seq = list(item)
        if truncate:
            seq = seq[:model.context_length]
        if len(seq) > model.context_length:
            raise APIError(400, f"input[{i}] has {len(seq)} tokens; this model's maximum is "
                           f"{model.context_length} tokens", param="input", code="context_length_exceeded")
        out.append(seq)
    return out


def _encode(vector: np.ndarray, fmt: str):
    if fmt == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]


async def embed(call: Call, name: Optional[str], inputs, dimensions: Optional[int] = None,
                truncate: bool = False) -> tuple[ModelHandle, np.ndarray, int]:
    """Embed ``inputs`` (OpenAI's ``input`` forms) on the embedding model ``name``, batched
    in its engine with other requests': ``(model, vectors [n, D], prompt tokens)``. The tokens are
    charged to the tenant and booked in the metrics and usage. Used by ``/v1/embeddings``
    and Ollama's ``/api/embed`` and ``/api/embeddings``.

    Raises:
        APIError: 404 for the model, 400 for a model that is not an embedding model, bad
            ``dimensions`` or inputs, 413/429 from the tenant's limits, 503 when the
            engine cannot take them.
    """
    model = await ready(hold(call, name))
    if call.adapter is not None and call.adapter == name:
        raise APIError(400, f"'{name}' is a LoRA adapter of a generating model: adapters do not apply to "
                       "embeddings", param="model", code="model_not_embedding")
    if model.kind != "embedding":
        raise APIError(400, f"the model '{model.name}' is not an embedding model", param="model",
                       code="model_not_embedding")
    embedder = model.embedder
    if dimensions is not None and dimensions != embedder.dimensions:
        if not embedder.matryoshka:
            raise APIError(400, f"the model '{model.name}' does not support dimensions (its vectors have "
                           f"{embedder.dimensions})", param="dimensions")
        if dimensions > embedder.dimensions:
            raise APIError(400, f"dimensions must be at most {embedder.dimensions}", param="dimensions")
    with model.engine.arrivals.prepare(call.rank):
        seqs = await anyio.to_thread.run_sync(_sequences, model, inputs, truncate)
        n_tokens = sum(len(s) for s in seqs)
        call.ticket.charge_prompt(n_tokens)
        loop = asyncio.get_running_loop()
        answer: asyncio.Future = loop.create_future()

        def sink(events: list) -> None:
            loop.call_soon_threadsafe(lambda: answer.done() or answer.set_result(events[-1]))

        rid = f"emb-{uuid.uuid4().hex[:16]}"
        call.record.request_id = rid
        call.record.prompt_tokens = n_tokens
        try:
            model.engine.submit(EmbeddingRequest(rid, seqs, sink, tenant=call.tenant.name, priority=call.rank))
        except EngineDead as e:
            raise APIError(503, f"the model engine is not available: {e}", code="engine_unavailable")
        except EngineOverloaded as e:
            raise APIError(503, f"the server is overloaded: {e}", code="overloaded", headers={"Retry-After": "1"})
    try:
        event = await answer
    finally:
        if not answer.done():  # the client left: the engine drops what it has not embedded
            model.engine.cancel(rid)
    if isinstance(event, ErrorEvent):
        raise APIError(event.status, event.message)
    assert isinstance(event, EmbeddingsEvent)
    tenant, m = call.tenant.name, call.front.metrics
    m.embedding_inputs.labels(tenant, model.name).inc(len(seqs))
    m.embedding_tokens.labels(tenant, model.name).inc(n_tokens)
    call.front.usage.add(tenant, prompt=n_tokens)
    return model, truncate_dims(event.vectors, dimensions), n_tokens


async def embeddings(request: Request) -> Response:
    """``POST /v1/embeddings`` (see the module docstring)."""
    front: Front = request.app.state.front
    call = await admit(front, request, "embeddings", "embeddings")
    req = parse(EmbeddingsRequest, call.body)
    model, vectors, n_tokens = await embed(call, req.model, req.input, req.dimensions)
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, req.encoding_format)}
            for i, v in enumerate(vectors)]
    return JSONResponse({"object": "list", "data": data, "model": model.name,
                         "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})
