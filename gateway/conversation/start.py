"""Starting a generation: hold the model a request names, render its prompt and submit it
as a :class:`~gateway.conversation.run.Run`, the start every protocol shares.

:func:`start_conversation` renders a :class:`Conversation` (template, tools, output
grammar) for the model it names, in a worker thread
(:func:`~gateway.conversation.prepare.prepare_chat`), and submits it; :func:`begin` holds
the model and starts a run on it, for conversations and plain completions alike.

A request for a model that is not loaded yet waits for its load; a streamed one gets
its stream at once, with a ``: loading model ...`` comment every second until the model
is ready (:class:`PendingRun`), so a client (or a proxy) does not time out meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from typing import AsyncIterator, Awaitable, Callable, Optional

import anyio

from gateway.conversation.calls import Call
from gateway.conversation.form import Comment, Conversation, Finished, Piece
from gateway.conversation.images import RefusedImage, images_of
from gateway.conversation.prepare import prepare_chat, sampling_params, text_assembler
from gateway.conversation.run import Run
from gateway.conversation.vision_admit import admit_images
from gateway.http.errors import APIError
from gateway.models.handle import ModelHandle

LOADING_TICK = 1.0  # seconds between the ": loading model" comments of a stream that waits for its model


async def begin(call: Call, model_name: Optional[str], stream: bool,
                start: Callable[[ModelHandle], Awaitable["Run"]]) -> "Run | PendingRun":
    """Hold the model ``model_name`` and ``start`` the run on it: at once when it is loaded,
    after its load otherwise (a stream gets a :class:`PendingRun` whose events begin with
    loading comments; ``start``'s errors then come as the stream's error event).

    Raises:
        APIError: 404 for the model; 503 when it cannot be loaded; what ``start`` raises.
    """
    future = call.hold_model(model_name)

    async def checked(model: ModelHandle) -> Run:
        require_generating(model)
        return await start(model)

    if future.done() or not stream:
        return await checked(await call.ready(future))
    return PendingRun(call, future, checked)


def require_generating(model: ModelHandle) -> None:
    """Raises:
        APIError: 400 ``model_not_generating`` for an embedding model asked to generate."""
    if model.kind == "embedding":
        raise APIError(400, f"the model '{model.name}' is an embedding model: use POST /v1/embeddings",
                       param="model", code="model_not_generating")


async def start_conversation(call: Call, conv: Conversation) -> "Run | PendingRun":
    """Hold the model, render ``conv`` (worker thread) and submit it: the start of every
    protocol whose requests are conversations.

    Raises:
        APIError: 404 for the model, 400 for a bad conversation, 413/429/503 when it
            cannot be queued.
    """
    call.record.stream = conv.stream

    refs = images_of(conv)

    async def start(model: ModelHandle) -> Run:
        params = sampling_params(model, call.tenant, conv.sampling)
        images = await admit_images(call, model, refs) if refs else None
        marks = call.record.marks
        with model.engine.arrivals.prepare(call.rank):  # the engine may wait for it
            marks["render_start"] = time.monotonic()
            try:
                prompt, plan, mask, processors = await anyio.to_thread.run_sync(
                    prepare_chat, model, conv, marks, params.max_tokens, images)
            except RefusedImage as e:
                call.front.metrics.images_refused.labels(call.tenant.name, e.reason).inc()
                raise
            marks["render_end"] = time.monotonic()
            asm = text_assembler(model, conv.stop, prompt.opens_reasoning)
            return Run.submit(call, model, prompt, params, asm, plan, mask, processors)

    return await begin(call, conv.model, conv.stream, start)


class PendingRun:
    """A streamed run whose model is still loading: :meth:`events` yields a loading
    comment every :data:`LOADING_TICK` seconds, then starts the run and yields its events.
    Once started, every attribute is the :class:`Run`'s."""

    def __init__(self, call: Call, future: Future, start: Callable[[ModelHandle], Awaitable["Run"]]):
        self._call, self._future, self._start = call, future, start
        self._run: Optional[Run] = None

    def __getattr__(self, name):
        run = self.__dict__.get("_run")
        if run is None:
            raise AttributeError(f"{name}: the run has not started (its model is loading)")
        return getattr(run, name)

    async def events(self) -> AsyncIterator[Piece | Comment | Finished]:
        """Loading comments, then the run's events.

        Raises:
            APIError: 503 when the model could not be loaded; what the run raises.
        """
        waited = asyncio.wrap_future(self._future)
        started = time.monotonic()
        while not waited.done():
            await asyncio.wait([waited], timeout=LOADING_TICK)
            if not waited.done():
                yield Comment(f"loading model {self._call.model_name} ({time.monotonic() - started:.0f} s)")
        self._run = await self._start(await self._call.ready(self._future))
        async for ev in self._run.events():
            yield ev

    async def aclose(self) -> None:
        if self._run is not None:
            await self._run.aclose()
