"""OpenAI ``POST /v1/completions`` (legacy text completions): a raw prompt, no template,
no tools, no reasoning split."""

from __future__ import annotations

from typing import Optional

from starlette.requests import Request
from starlette.responses import Response

from gateway.conversation.form import ChatResult, Conversation, Finished, Piece, Sampling
from gateway.conversation.run import Run
from gateway.conversation.start import converse
from gateway.front import admit
from gateway.http.sse import HOLE, sse, text_events
from gateway.protocols.openai_format import (LogprobFormatter, OpenAIFormat, finish_reason, text_completion, usage,
                                             usage_chunk)
from gateway.protocols.openai_schemas import CompletionRequest, parse
from gateway.protocols.respond import respond

LEGACY_MAX_TOKENS = 16  # OpenAI's legacy completions default, which vLLM keeps too


def to_conversation(req: CompletionRequest) -> Conversation:
    """A completions request as the internal form: its prompt ``raw``; no ``max_tokens``
    means :data:`LEGACY_MAX_TOKENS` unless the operator set ``--max-tokens``."""
    sampling = Sampling(
        max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
        seed=req.seed, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, logit_bias=req.logit_bias, logprobs=req.logprobs is not None,
        top_logprobs=req.logprobs or 0, ignore_eos=req.ignore_eos, unset_max_tokens=LEGACY_MAX_TOKENS)
    return Conversation([], sampling, stop=list(req.stop or []), model=req.model, stream=req.stream, raw=req.prompt)


class CompletionFormat(OpenAIFormat):
    """Text completions' answer: ``text_completion`` or its chunks."""

    offset = 0  # characters of the answer streamed so far
    _text_chunk = None  # text -> a chunk of that text (no logprobs), made at the first

    def _logprobs(self, run: Run, tokens: list, offset: int) -> Optional[dict]:
        if self.req.logprobs is not None and self.logprobs is None:
            self.logprobs = LogprobFormatter(run.model.tokenizer)
        return self.logprobs.completion_entries(tokens, offset) if self.logprobs else None

    def piece(self, run: Run, piece: Piece) -> bytes:
        lp = self._logprobs(run, piece.tokens, self.offset) if piece.tokens else None
        self.offset += len(piece.text)
        if lp is None and piece.text:
            if self._text_chunk is None:
                self._text_chunk = text_events(text_completion(self.rid, self.call.model_name, HOLE, None, None, None,
                                                               self.created))
            return self._text_chunk(piece.text)
        return sse(text_completion(self.rid, self.call.model_name, piece.text, None, lp, None, self.created)
                   ) if piece.text or lp else b""

    async def finish(self, run: Run, ev: Finished) -> bytes:
        model = self.call.model_name
        out = sse(text_completion(self.rid, model, "", finish_reason(ev.reason), None, None, self.created))
        if self.req.stream_options and self.req.stream_options.include_usage:
            out += sse(usage_chunk(self.rid, model, self.created, "text_completion", usage(ev.usage)))
        return out

    async def whole(self, run: Run, result: ChatResult) -> dict:
        return text_completion(self.rid, self.call.model_name, result.text, finish_reason(result.finished.reason),
                               self._logprobs(run, result.tokens, 0), usage(result.finished.usage))


async def completions(request: Request) -> Response:
    """``POST /v1/completions``: admitted, parsed, answered (:func:`converse`, :func:`respond`)."""
    call = await admit(request.app.state.front, request, "completions", "completions")
    req = parse(CompletionRequest, call.body)
    return await respond(request, converse(call, to_conversation(req)), CompletionFormat(req, call, "cmpl"))
