"""A conversation's way to the engine (:func:`converse`, shared by every generating
protocol): hold the model it names, render its prompt, submit it, then its events. A
streamed request whose model must load first begins at once, with a ``: loading model``
comment every :data:`LOADING_TICK` seconds, so that a client (or a proxy) does not time out.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from contextlib import aclosing
from typing import AsyncIterator, Optional

import anyio

from gateway.conversation.form import Comment, Conversation, Finished, Loading, Piece
from gateway.conversation.images import RefusedImage, admit_images
from gateway.conversation.prepare import fit_context, prepare_chat, sampling_params, text_assembler
from gateway.conversation.run import Run
from gateway.front import Call
from gateway.http.errors import APIError
from gateway.models.handle import ModelHandle
from gateway.models.lora import ready_adapter
from gateway.models.slot import ModelUnavailable, Slot

LOADING_TICK = 1.0  # seconds between the ": loading model" comments of a stream that waits for its model

Answer = AsyncIterator[Loading | Run | Comment | Piece | Finished]


async def converse(call: Call, conv: Conversation) -> Answer:
    """Hold the model, render ``conv`` (worker thread), submit it: yields the :class:`Run`
    once submitted, then its events (first :class:`Loading` and loading comments for a
    stream whose model must load).

    Raises:
        APIError: 404 for the model, 503 when it cannot be loaded, 400 for an embedding
            model (``model_not_generating``) or a bad conversation, 413/429/503 when it
            cannot be queued, 499 when its client left while it waited for a LoRA adapter
            slot (:func:`gateway.models.lora.ready_adapter`); what the run raises.
    """
    call.record.stream = conv.stream
    loaded = hold(call, conv.model)
    if conv.stream and not loaded.done():  # the stream begins now, with a comment every LOADING_TICK
        yield Loading(call.slot.name)
        waited, started = asyncio.wrap_future(loaded), time.monotonic()
        while not waited.done():
            await asyncio.wait([waited], timeout=LOADING_TICK)
            if not waited.done():
                yield Comment(f"loading model {call.slot.name} ({time.monotonic() - started:.0f} s)")
    model = await ready(loaded)
    if call.adapter is not None:  # read into the model's adapter stack (its first request, or after LRU)
        await ready_adapter(call, model)
    if model.kind == "embedding":
        raise APIError(400, f"the model '{model.name}' is an embedding model: use POST /v1/embeddings",
                       param="model", code="model_not_generating")
    images = await admit_images(call, model, conv)
    params = sampling_params(model, call.tenant, conv.sampling)
    marks = call.record.marks if conv.raw is None else {}  # (a raw prompt has no render phases)
    with model.engine.arrivals.prepare(call.rank):  # the engine may wait for it
        marks["render_start"] = time.monotonic()
        try:
            (prompt, plan, mask, processors), why = await anyio.to_thread.run_sync(
                _prepare_and_explain, call, model, conv, marks, params.max_tokens, images)
        except RefusedImage as e:
            call.front.metrics.images_refused.labels(call.tenant.name, e.reason).inc()
            raise
        marks["render_end"] = time.monotonic()
        asm = text_assembler(model, conv.stop, prompt.opens_reasoning, reasoning=conv.raw is None)
        run = Run.submit(call, model, prompt, fit_context(model, prompt, params), asm, plan, mask, processors, why)
    yield run
    async with aclosing(run.events()) as events:
        async for ev in events:
            yield ev


def _prepare_and_explain(call: Call, model: ModelHandle, conv: Conversation, marks: dict, max_tokens: int, images):
    """:func:`prepare_chat`, then why its prompt will leave the prefix cache where it will
    (:meth:`gateway.telemetry.cache_explain.CacheExplainer.explain`), in one worker thread."""
    prepared = prepare_chat(model, conv, marks, max_tokens, images)
    t = call.tenant
    return prepared, call.front.explainer.explain(model, t.name, t.cache_group, call.adapter, prepared[0])


def hold(call: Call, name: Optional[str]) -> Future:
    """Find the model ``name`` names (a served name, an alias or a LoRA adapter's name; the
    first model the tenant may use when None) and hold it until the call is answered; a
    Future of its handle (done unless it must be loaded first). A request that reaches the
    base model of its tenant's default adapter (naming it or no model) runs under that adapter.

    Raises:
        APIError: 404 ``model_not_found`` for a model this server does not serve, and
            for a name the tenant may not use (the same answer: its existence is not revealed).
    """
    front, slot = call.front, find(call, name)
    future = front.models.hold(slot)
    call.slot = slot
    default = front.default_adapter(call.tenant)
    if name is not None and front.adapters.get(name) is not None:
        call.adapter = name
    elif default is not None and default.base == slot.name:
        call.adapter = default.name
    else:
        call.adapter = None
    call.record.model = call.adapter or slot.name  # an adapter's requests are counted under its name
    call.request.state.on_close.append(lambda: front.models.release(slot))
    return future


def find(call: Call, name: Optional[str]) -> Slot:
    """The model ``name`` names for this call's tenant (a served name, an alias, or a LoRA
    adapter's name: its base model; when None, its default adapter's base, else the first
    model the tenant may use), not held.

    Raises:
        APIError: 404 ``model_not_found``, as :func:`hold`.
    """
    front, tenant = call.front, call.tenant
    default = front.default_adapter(tenant)
    adapter = front.adapters.get(name)
    if name is None and default is not None:
        slot = front.models.find(default.base)
    elif name is None:
        slot = next((s for s in front.models.slots if any(map(tenant.may_use, s.spec.names))), None)
    elif adapter is not None:
        slot = front.models.find(adapter.base)
        slot = slot if tenant.may_use_adapter(name) else None
    else:
        slot = front.models.find(name)
        base_of_default = slot is not None and default is not None and default.base == slot.name
        slot = slot if slot is not None and (tenant.may_use(name) or base_of_default) else None
    if slot is None:
        raise APIError(404, f"the model '{name}' does not exist" if name is not None else
                       "no model is available to this key", param="model", code="model_not_found")
    return slot


async def ready(loaded: Future) -> ModelHandle:
    """The held model, once loaded.

    Raises:
        APIError: 503 (with ``Retry-After``) when it could not be loaded.
    """
    try:
        return await asyncio.wrap_future(loaded)
    except ModelUnavailable as e:
        raise unavailable(e)


def unavailable(e: ModelUnavailable) -> APIError:
    """The 503 for a model that could not be loaded."""
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after else None
    return APIError(503, e.message, param="model", code=e.code, headers=headers)
