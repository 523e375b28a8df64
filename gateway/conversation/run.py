"""One generation, from a rendered prompt to its events: the part every protocol shares.

:class:`Run` submits a prompt (rendered by :func:`gateway.conversation.prepare.prepare_chat`
for the model it names, started by :mod:`gateway.conversation.start`) to that model's
engine and turns the engine's token events into :data:`ChatEvent` pieces (text,
reasoning, tool-call pieces), while it keeps the books: usage, metrics (labelled by
``model`` and ``api``), the request log and the tenant's completion-token charge.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Optional

import anyio

from gateway.conversation.calls import Call
from gateway.conversation.form import ChatEvent, ChatResult, Comment, Finished, Piece, Usage
from gateway.conversation.generation import Generation, KeepAlive
from gateway.conversation.next_turn import schedule_next_turn
from gateway.conversation.prepare import fit_context
from gateway.conversation.prompts import Prompt
from gateway.conversation.textout import TextAssembler
from gateway.conversation.tool_stream import ToolCallStream
from gateway.conversation.tools import ToolPlan
from gateway.conversation.vision_admit import charge_image_tokens
from gateway.http.errors import APIError
from gateway.http.sse import wait_for_disconnect
from gateway.models.handle import ModelHandle
from scheduler import SamplingParams
from scheduler.grammar import TokenMask
from scheduler.request import DoneEvent, ErrorEvent, ProgressEvent, PromptEvent, TokenEvent


@dataclass
class Run:
    """A prompt in the engine, seen as :data:`ChatEvent` s.

    Built by :meth:`submit`; iterate :meth:`events` (streaming) or await :meth:`collect`.

    Its outcome is booked once (:meth:`_settle`), in the request log record, the metrics
    and the tenant's usage alike: the engine's reason (``stop``, ``length``), ``stop`` for
    a stop string, ``tool_calls`` when the answer is tool calls, ``error`` when it failed,
    and ``cancelled`` when the client left (or the answer was dropped) before it ended.
    """

    call: Call
    model: ModelHandle
    prompt: Prompt
    gen: Generation
    asm: TextAssembler
    plan: Optional[ToolPlan] = None
    tokens: list[TokenEvent] = field(default_factory=list)
    calls: list = field(default_factory=list)
    cached: int = 0
    cache_written: int = 0
    finish: str = "stop"  # how it ended; meaningful once ``ended``
    ended: bool = False  # the generation ended by itself: done, a stop string, or an error
    error_status: Optional[int] = None
    settled: bool = False
    first_at: Optional[float] = None  # monotonic seconds of the first token
    last_at: float = 0.0  # monotonic seconds of the latest token

    @classmethod
    def submit(cls, call: Call, model: ModelHandle, prompt: Prompt, params: SamplingParams,
               asm: TextAssembler, plan: Optional[ToolPlan] = None, mask: Optional[TokenMask] = None,
               processors: Optional[list] = None) -> "Run":
        """Check the prompt against the limits and hand it to the engine.

        Raises:
            APIError: 400 for a prompt over the context or the prompt limit, 413/429
                from the tenant's prompt-token limit, 429 when the tenant's queue is
                full, 503 when the engine cannot take it.
        """
        params = fit_context(model, prompt, params)
        call.ticket.charge_prompt(len(prompt.tokens))
        t = call.tenant
        if prompt.images:
            charge_image_tokens(call, model, prompt.images)
        gen = Generation(model.engine, prompt.tokens, params, prompt.checkpoints, namespace=t.cache_group,
                         tenant=t.name, weight=t.weight, max_queued=t.max_queued, mask=mask,
                         priority=call.rank, keep=prompt.breakpoints,
                         processors=processors)
        gen.request.adapter = call.adapter  # a LoRA adapter's name, or None (scheduler.lora)
        if prompt.images:  # in the engine's table until the request's last event (gateway.models.vision_images)
            table = model.vision.table
            table.add(prompt.images)
            gen.request.sink = table.releasing(gen.request.sink, prompt.images)
        call.record.request_id = gen.id
        call.record.prompt_tokens = len(prompt.tokens)
        if call.front.config.log_prompts:
            call.record.prompt = model.tokenizer.decode(prompt.tokens)
        call.record.marks["submitted"] = time.monotonic()
        try:
            gen.submit()
        except APIError as e:
            if prompt.images:
                model.vision.table.release(prompt.images)
            if e.status == 429:
                call.front.metrics.rate_limited.labels(t.name, "queue").inc()
            raise
        run = cls(call, model, prompt, gen, asm, plan)
        call.record.settle = run._settle  # at the latest when the request's line is written
        return run

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
            reason, matched = self.finish, self.asm.matched
            if self.calls and reason == "stop":
                reason = self.finish = "tool_calls"
            elif reason == "stop" and matched is not None:
                reason = "stop_sequence"
            self._settle()
            if reason in ("stop", "stop_sequence", "length"):
                t, front = self.call.tenant, self.call.front
                if front.config.precompute_next_turn and not front.draining:
                    schedule_next_turn(self.model, self.prompt, "".join(reply), self.gen.request.namespace,  # an
                                       t.name)  # adapter's own (scheduler.lora) or the tenant's; never raises
            yield Finished(reason, Usage(len(self.prompt.tokens), len(self.tokens), self.cached, self.cache_written,
                                         thought), matched)
        except Exception:
            self._end("error")  # no-op when the engine's error already ended it
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await pieces.aclose()
            self._settle()

    async def collect(self, request, on_event: Optional[Callable[[ChatEvent], None]] = None
                      ) -> Optional[ChatResult]:
        """The whole answer; None when the client left before it ended (the generation
        is cancelled as soon as it leaves). ``on_event`` sees every event on the way.

        Raises:
            APIError: the generation failed.
        """
        text, reasoning, done, error = [], [], [], []
        events = self.events()
        async with anyio.create_task_group() as tg:

            async def consume() -> None:
                try:
                    async for ev in events:
                        if on_event is not None:
                            on_event(ev)
                        if isinstance(ev, Piece):
                            text.append(ev.text)
                            reasoning.append(ev.reasoning)
                        elif isinstance(ev, Finished):
                            done.append(ev)
                except APIError as e:
                    error.append(e)
                finally:
                    with anyio.CancelScope(shield=True):
                        await events.aclose()
                tg.cancel_scope.cancel()

            tg.start_soon(consume)
            await wait_for_disconnect(request.receive)
            tg.cancel_scope.cancel()
        if error:
            raise error[0]
        if not done:
            return None
        return ChatResult("".join(text), "".join(reasoning), self.calls, done[0], self.tokens)

    def _end(self, reason: str) -> None:
        """Record that the generation ended by itself, with ``reason`` (first call wins)."""
        if not self.ended:
            self.ended, self.finish = True, reason

    async def _pieces(self) -> AsyncIterator[Piece | Comment]:
        """Engine events as text pieces; books prompt usage, time to first token, and how
        the generation ended (:meth:`_end`)."""
        call, gen = self.call, self.gen
        front = call.front
        tenant, rec, m = call.tenant.name, call.record, front.metrics
        labels = (tenant, self.model.name, call.api)
        prompt_len = len(self.prompt.tokens)
        async for ev in gen.events(keepalive=front.config.sse_keepalive):
            if isinstance(ev, KeepAlive):
                yield Comment("keep-alive")
            elif isinstance(ev, ProgressEvent):
                yield Comment(f"prefill {ev.done}/{ev.total}")
            elif isinstance(ev, PromptEvent):
                self.cached = ev.cached_tokens
                rec.queue_seconds = time.monotonic() - gen.arrival
                rec.cached_tokens = ev.cached_tokens
                rec.cache_source = ev.cache_source if ev.cached_tokens else None
                m.prompt_tokens.labels(*labels).inc(prompt_len)
                m.cached_tokens.labels(*labels).inc(ev.cached_tokens)
                front.usage.add(tenant, prompt=prompt_len, cached=ev.cached_tokens)
            elif isinstance(ev, TokenEvent):
                now = time.monotonic()
                if self.first_at is None:
                    self.first_at = now
                    rec.marks["first_token"] = self.first_at
                    rec.marks.update(gen.request.timings)  # the engine's marks, all set by now
                    rec.ttft_seconds = self.first_at - gen.arrival
                    m.ttft.labels(*labels).observe(self.first_at - gen.arrival)
                    m.class_ttft.labels(self.model.name, call.priority).observe(self.first_at - gen.arrival)
                else:
                    m.inter_token.labels(self.model.name, call.priority).observe(now - self.last_at)
                self.last_at = now
                self.tokens.append(ev)
                call.ticket.charge_completion(1)
                d = self.asm.feed(ev.token)
                if self.asm.stopped:  # a stop string: the answer is complete, the engine need not go on
                    self._end("stop")
                    gen.cancel("stop")
                yield Piece(d.content, d.reasoning, tokens=[ev])
                if self.asm.stopped:
                    break
            elif isinstance(ev, DoneEvent):
                if ev.finish_reason in ("stop", "length"):  # else the engine cancelled it: not an end
                    self._end(ev.finish_reason)
                self.cache_written = ev.cache_written
                break
            elif isinstance(ev, ErrorEvent):
                self._end("error")
                self.error_status = ev.status
                raise APIError(ev.status, ev.message)
        tail = self.asm.finish()
        if tail:
            yield Piece(tail.content, tail.reasoning)

    def _settle(self) -> None:
        """Book the outcome once (idempotent): completion tokens, ``finish_reason`` and
        timings in the request record, the metrics and the tenant's usage. Runs when the
        answer ends, or when the request's log line is written, whichever comes first; a
        generation that has not ended by then was left by its client and is cancelled."""
        if self.settled:
            return
        self.settled = True
        self.gen.cancel()
        call = self.call
        rec, m = call.record, call.front.metrics
        labels = (call.tenant.name, self.model.name, call.api)
        if self.ended:
            outcome = self.finish
        else:  # dropped before it ended: the client left, or the answer failed on the way out
            outcome = "error" if rec.status >= 500 else "cancelled"
        n = len(self.tokens)
        rec.completion_tokens = n
        rec.finish_reason = outcome
        if self.error_status is not None:
            rec.error_status = self.error_status
        m.completion_tokens.labels(*labels).inc(n)
        m.generations.labels(*labels, outcome).inc()
        call.front.usage.add(call.tenant.name, completion=n)
        if self.first_at is not None:
            now = time.monotonic()
            m.e2e.labels(*labels).observe(now - self.gen.arrival)
            if n > 1:
                m.tpot.labels(*labels).observe((now - self.first_at) / (n - 1))

    async def aclose(self) -> None:
        """Cancel the generation if it still runs (idempotent)."""
        self.gen.cancel()
