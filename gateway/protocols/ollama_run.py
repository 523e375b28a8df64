"""Where Ollama's API meets the conversation pipeline: starting a run, and the counts and
durations its answers carry.

A conversation (``/api/chat``, ``/api/generate``) starts through
:func:`gateway.conversation.start.start_conversation`, like every other API's. Two forms
of ``/api/generate`` have a prompt that is not a rendered conversation, and start through
:func:`gateway.conversation.start.begin` with their own tokens, as ``/v1/completions``
does:

- ``raw``: the prompt as it is, no template;
- ``context`` (the tokens an earlier answer returned: its prompt and its answer): those
  tokens, then the new turn rendered by the template (without a leading BOS), so the
  prefix cache serves everything the earlier request evaluated.

Counts and durations (:func:`stats`) are Ollama's: ``prompt_eval_count`` is the prompt
tokens evaluated (the prompt less what the prefix cache held: a cache hit shows a small
count), ``eval_count`` the generated tokens, durations in nanoseconds.
"""

from __future__ import annotations

import time
from typing import Optional

import anyio

from gateway.conversation.calls import Call
from gateway.conversation.form import Conversation, Usage
from gateway.conversation.prepare import prepare_chat, sampling_params, text_assembler
from gateway.conversation.prompts import Prompt
from gateway.conversation.run import Run
from gateway.conversation.start import PendingRun, begin, start_conversation
from gateway.conversation.structured import output_mask
from gateway.http.errors import APIError
from gateway.models.handle import ModelHandle
from gateway.protocols.ollama_schemas import keep_alive_seconds
from cache.checkpoints import plan_completion_checkpoints


async def start(call: Call, conv: Conversation, context: Optional[list[int]] = None,
                raw: Optional[str] = None) -> "Run | PendingRun":
    """Start ``conv`` on its model: rendered by its template (the usual path), or, for a
    ``raw`` prompt or one that continues ``context``, as tokens (see the module docstring).

    Raises:
        APIError: 404 for the model, 400 for a bad conversation or a context token outside
            the vocabulary, 413/429/503 when it cannot be queued.
    """
    if context is None and raw is None:
        return await start_conversation(call, conv)
    call.record.stream = conv.stream

    async def submit(model: ModelHandle) -> Run:
        params = sampling_params(model, call.tenant, conv.sampling)
        with model.engine.arrivals.prepare(call.rank):
            call.record.marks["render_start"] = time.monotonic()
            prompt, mask, opens = await anyio.to_thread.run_sync(_tokens, model, conv, context, raw, params.max_tokens)
            asm = text_assembler(model, conv.stop, opens, reasoning=raw is None)
            return Run.submit(call, model, prompt, params, asm, None, mask)

    return await begin(call, conv.model, conv.stream, submit)


def _tokens(model: ModelHandle, conv: Conversation, context: Optional[list[int]], raw: Optional[str],
            max_tokens: int) -> tuple[Prompt, object, bool]:
    """The prompt of a raw or continued request (worker thread): ``(prompt, token mask,
    whether it opens a think block)``."""
    tok = model.tokenizer
    before = list(context or [])
    vocab = len(tok)
    if any(not 0 <= t < vocab for t in before):
        raise APIError(400, f"context: token ids must be in [0, {vocab})", param="context")
    if raw is not None:
        tokens = list(tok.encode(raw, add_special_tokens=not before)) if raw else []
        mask = output_mask(model.grammars, conv, None) if conv.output_schema is not None else None
        prompt = Prompt(before + tokens, plan_completion_checkpoints(before + tokens,
                                                                      interval=model.spec.checkpoint_every))
        opens = False
    else:
        turn, _, mask, _ = prepare_chat(model, conv, None, max_tokens)
        tokens = turn.tokens
        bos = getattr(tok, "bos_token_id", None)
        if before and tokens and bos is not None and tokens[0] == bos:
            tokens = tokens[1:]
        shift = len(before) + len(tokens) - len(turn.tokens)
        prompt = Prompt(before + tokens, sorted({c + shift for c in turn.checkpoints if c + shift > 0}),
                        turn.opens_reasoning)
        opens = turn.opens_reasoning
    if not prompt.tokens:
        raise APIError(400, "the prompt is empty", param="prompt")
    return prompt, mask, opens


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def stats(run, usage: Usage) -> dict:
    """Ollama's counts and durations (nanoseconds) of a finished run: ``total_duration``
    (since the request arrived), ``load_duration`` (waiting for the model to load),
    ``prompt_eval_count``/``_duration`` (prompt tokens evaluated; from submission to the
    first token), ``eval_count``/``_duration`` (tokens generated; first token to last)."""
    marks = run.call.record.marks
    now = time.monotonic()
    start = marks.get("received", run.gen.arrival)
    loaded = marks.get("render_start", marks.get("admitted", start))
    first = run.first_at if run.first_at is not None else now
    return {
        "total_duration": _ns(now - start),
        "load_duration": _ns(loaded - marks.get("admitted", start)),
        "prompt_eval_count": max(1, usage.prompt - usage.cached) if usage.prompt else 0,
        "prompt_eval_duration": _ns(first - run.gen.arrival),
        "eval_count": usage.completion,
        "eval_duration": _ns((run.last_at or first) - first),
    }


def context_of(run) -> list[int]:
    """The tokens ``/api/generate`` returns as ``context``: the prompt, then the answer's
    tokens as generated (send them back to continue; the prefix cache holds them)."""
    return list(run.prompt.tokens) + [t.token for t in run.tokens]


def keep_alive(call: Call, value) -> None:
    """Apply a request's ``keep_alive`` to the model the call holds: that long after its
    last use (0: unloaded once idle; negative: kept), or, when absent, its configured
    keep-alive, as Ollama's server default applies to a request without one.

    Raises:
        APIError: 400 for a value that is not a duration.
    """
    slot = call.slot
    if slot is not None:
        seconds = keep_alive_seconds(value) if value is not None else slot.spec.keep_alive
        call.front.models.keep_for(slot, seconds)
