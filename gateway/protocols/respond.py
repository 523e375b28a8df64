"""The way out every protocol shares: an answer's events
(:func:`gateway.conversation.start.converse`) in the protocol's :class:`Format`, streamed
as SSE or collected into one JSON body (a 499 when its client left first)."""

from __future__ import annotations

from contextlib import aclosing
from typing import AsyncIterator, Optional

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.conversation.form import ChatResult, Comment, Finished, Piece
from gateway.conversation.run import Run
from gateway.conversation.start import Answer
from gateway.http.errors import APIError
from gateway.http.sse import SSEResponse, comment, guarded, wait_for_disconnect


class Format:
    """A protocol's answer: ``stream`` says whether the request streams; ``headers`` go on
    the response. A stream is :meth:`opening`, then the bytes of ``piece(run, piece)`` and
    ``await finish(run, finished)`` (``comment(text)`` between; ``error(api_error)`` for a
    failure once it began), then ``tail``, as ``media_type``; a whole answer is
    ``await whole(run, result)``, a :class:`ChatResult`'s JSON body."""

    stream, headers, tail = False, None, b""
    media_type = "text/event-stream; charset=utf-8"

    def opening(self) -> bytes:
        """What a stream sends at once."""
        return b""

    def comment(self, text: str) -> bytes:
        """A comment in the stream (progress, keep-alive): SSE's ``: text``."""
        return comment(text)


async def respond(request: Request, answer: Answer, form: Format) -> Response:
    """The response to ``answer`` in ``form``.

    Raises:
        APIError: what the answer raises before its run is submitted (or, for a stream,
            before it begins), and what a whole answer raises.
    """
    first = await anext(answer)  # hold, render, submit (or begin to load): their errors are the status
    headers = {**(form.headers or {}), **_cache_headers(first)} if isinstance(first, Run) else form.headers
    if form.stream:
        return SSEResponse(guarded(_stream(first, answer, form), form.error, form.tail), headers=headers,
                           send_timeout=request.app.state.front.config.client_timeout, media_type=form.media_type)
    result = await collect(request, first, answer)
    if result is None:
        return Response(status_code=499)
    return JSONResponse(await form.whole(first, result), headers=headers)


def _cache_headers(run: Run) -> dict[str, str]:
    """``x-request-id`` (the id ``GET /v1/cache/explain`` takes) and ``x-cache-miss`` (where
    and why the prompt leaves the prefix cache, :mod:`gateway.telemetry.cache_explain`)."""
    why = run.books.why
    out = {"x-request-id": run.books.request_id}
    if why is not None:
        out["x-cache-miss"] = why.header()
    return out


async def _stream(first, answer: Answer, form: Format) -> AsyncIterator[bytes]:
    """The stream's bytes: ``first`` (the run, or :class:`Loading`) and the rest of ``answer``."""
    async with aclosing(answer):
        run, ev, opening = None, first, form.opening()
        if opening:
            yield opening
        while ev is not None:
            if isinstance(ev, Run):
                run = ev
            elif isinstance(ev, Comment):
                out = form.comment(ev.text)
                if out:
                    yield out
            elif isinstance(ev, Piece):
                out = form.piece(run, ev)
                if out:
                    yield out
            elif isinstance(ev, Finished):
                yield await form.finish(run, ev)
            ev = await anext(answer, None)


async def collect(request: Request, run: Run, answer: Answer) -> Optional[ChatResult]:
    """The whole answer; None when the client left before it ended (the generation is
    cancelled as soon as it leaves). Raises what the answer raises (APIError)."""
    pieces, done, error = [], [], []
    async with anyio.create_task_group() as tg:

        async def consume() -> None:
            try:
                async for ev in answer:
                    if isinstance(ev, Piece):
                        pieces.append(ev)
                    elif isinstance(ev, Finished):
                        done.append(ev)
            except APIError as e:
                error.append(e)
            finally:
                with anyio.CancelScope(shield=True):
                    await answer.aclose()
            tg.cancel_scope.cancel()

        tg.start_soon(consume)
        await wait_for_disconnect(request.receive)
        tg.cancel_scope.cancel()
    if error:
        raise error[0]
    if not done:
        return None
    return ChatResult("".join(p.text for p in pieces), "".join(p.reasoning for p in pieces), run.calls, done[0],
                      [t for p in pieces for t in p.tokens], pieces)
