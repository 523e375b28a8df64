"""One generation, from a rendered prompt to its events: the part every protocol shares.

:class:`Run` submits a prompt (rendered by :func:`gateway.conversation.prepare.prepare_chat`
for the model it names, started by :mod:`gateway.conversation.start`) to that model's
engine and turns the engine's token events into pieces (text, reasoning, tool-call
pieces); its :class:`~gateway.conversation.books.Books` keep the books.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

import anyio

from gateway.conversation.books import Books
from gateway.conversation.form import Comment, Finished, Piece, Usage
from gateway.conversation.generation import Generation, KeepAlive
from gateway.conversation.prompts import Prompt
from gateway.conversation.textout import TextAssembler
from gateway.conversation.tool_stream import ToolCallStream
from gateway.conversation.tools import ToolPlan
from gateway.front import Call
from gateway.http.errors import APIError
from gateway.telemetry.cache_explain import Explanation
from gateway.models.handle import ModelHandle
from scheduler import SamplingParams
from scheduler.grammar import TokenMask
from scheduler.request import DoneEvent, ErrorEvent, ProgressEvent, PromptEvent, TokenEvent

COALESCE_MAX = 64  # tokens one coalesced piece holds at most (a reader behind the engine)


@dataclass
class Run:
    """A prompt in the engine, seen as pieces: built by :meth:`submit`, iterated by
    :meth:`events`; ``books`` observe it."""

    model: ModelHandle
    prompt: Prompt
    gen: Generation
    asm: TextAssembler
    books: Books
    plan: Optional[ToolPlan] = None
    calls: list = field(default_factory=list)  # the answer's tool calls, once it ended
    cached: int = 0
    cache_written: int = 0
    keepalive: Optional[float] = None  # seconds without an event before a keep-alive comment

    @classmethod
    def submit(cls, call: Call, model: ModelHandle, prompt: Prompt, params: SamplingParams,
               asm: TextAssembler, plan: Optional[ToolPlan] = None, mask: Optional[TokenMask] = None,
               processors: Optional[list] = None, why: Optional[Explanation] = None) -> "Run":
        """Charge the prompt to the tenant and hand it to the engine (``params`` fit the
        context: :func:`gateway.conversation.prepare.fit_context`).

        Raises:
            APIError: 413/429 from the tenant's prompt-token or image-token limit, 429
                when the tenant's queue is full, 503 when the engine cannot take it.
        """
        books = Books(call, model, prompt, why)
        books.charge()
        t = call.tenant
        gen = Generation(books.request_id, model.engine, prompt.tokens, params, prompt.checkpoints,
                         namespace=t.cache_group, tenant=t.name, weight=t.weight, max_queued=t.max_queued, mask=mask,
                         priority=call.rank, keep=prompt.breakpoints, processors=processors)
        gen.request.adapter = call.adapter  # a LoRA adapter's name, or None (scheduler.lora)
        if prompt.images:  # in the engine's table until the request's last event (gateway.models.vision_images)
            table = model.vision.table
            table.add(prompt.images)
            gen.request.sink = table.releasing(gen.request.sink, prompt.images)
        try:
            gen.submit()
        except APIError as e:
            if prompt.images:
                model.vision.table.release(prompt.images)
            books.refused(e)
            raise
        books.gen = gen
        call.record.settle = books.settle  # at the latest when the request's line is written
        return cls(model, prompt, gen, asm, books, plan, keepalive=call.front.config.sse_keepalive)

    async def events(self) -> AsyncIterator[Piece | Comment | Finished]:
        """The answer as it is generated, ending with :class:`Finished`.

        Raises:
            APIError: the engine failed the request.
        """
        tools = ToolCallStream(self.plan) if self.plan is not None and self.plan.parses else None
        pieces = self._pieces()
        reply: list[str] = []
        thought = 0  # tokens that carried only reasoning
        try:
            async for piece in pieces:
                if isinstance(piece, Comment):
                    yield piece
                    continue
                if tools is not None and piece.text:
                    piece.text, piece.tool_calls = tools.feed(piece.text)
                if piece.text or piece.reasoning or piece.tool_calls or piece.tokens:
                    thought += len(piece.tokens) if piece.reasoning and not (piece.text or piece.tool_calls) else 0
                    reply.append(piece.text)
                    yield piece
            if tools is not None:
                text, deltas = tools.finish()
                if text or deltas:
                    reply.append(text)
                    yield Piece(text=text, tool_calls=deltas)
            self.calls = tools.calls if tools is not None else []
            books, matched = self.books, self.asm.matched
            reason = books.finish
            if self.calls and reason == "stop":
                reason = books.finish = "tool_calls"
            elif reason == "stop" and matched is not None:
                reason = "stop_sequence"
            books.settle()
            if reason in ("stop", "stop_sequence", "length"):
                books.next_turn("".join(reply))
                books.seen("".join(reply))
            yield Finished(reason, Usage(len(self.prompt.tokens), books.completion, self.cached,
                                         self.cache_written, thought), matched)
        except Exception:
            self.books.end("error")  # no-op when the engine's error already ended it
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await pieces.aclose()
            self.books.settle()

    async def _pieces(self) -> AsyncIterator[Piece | Comment]:
        """Engine events as text pieces, told to the books as they come; behind the engine
        (more at hand, :meth:`Generation.ready`), consecutive tokens of one kind (text,
        reasoning, neither) make one piece of at most :data:`COALESCE_MAX` tokens: one
        chunk, the text concatenated (bounded, so that a long backlog still yields to the
        other streams on the loop)."""
        gen, books, held = self.gen, self.books, None
        async for ev in gen.events(keepalive=self.keepalive):
            if held is not None and not isinstance(ev, TokenEvent):
                yield held
                held = None
            if isinstance(ev, KeepAlive):
                yield Comment("keep-alive")
            elif isinstance(ev, ProgressEvent):
                yield Comment(f"prefill {ev.done}/{ev.total}")
            elif isinstance(ev, PromptEvent):
                self.cached = ev.cached_tokens
                books.prompt_read(ev)
            elif isinstance(ev, TokenEvent):
                books.token()
                d = self.asm.feed(ev.token)
                if self.asm.stopped:  # a stop string: the answer is complete, the engine need not go on
                    books.end("stop")
                    gen.cancel("stop")
                if held is not None and (held.text > "", held.reasoning > "") == (d.content > "", d.reasoning > ""):
                    held.text, held.reasoning = held.text + d.content, held.reasoning + d.reasoning
                    held.tokens.append(ev)
                else:
                    if held is not None:
                        yield held
                    held = Piece(d.content, d.reasoning, tokens=[ev])
                if self.asm.stopped:
                    break
                if not gen.ready() or len(held.tokens) >= COALESCE_MAX:
                    yield held
                    held = None
            elif isinstance(ev, DoneEvent):
                if ev.finish_reason in ("stop", "length"):  # else the engine cancelled it: not an end
                    books.end(ev.finish_reason)
                self.cache_written = ev.cache_written
                break
            elif isinstance(ev, ErrorEvent):
                books.end("error", ev.status)
                raise APIError(ev.status, ev.message, headers={"Retry-After": "1"} if ev.status == 503 else None)
        if held is not None:
            yield held
        tail = self.asm.finish()
        if tail:
            yield Piece(tail.content, tail.reasoning)
