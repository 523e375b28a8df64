"""Ollama's counts and durations, its ``context`` and its ``keep_alive``: what its answers
carry beyond the shared pipeline's events.

A request starts like every other API's, through
:func:`gateway.conversation.start.converse`: ``/api/chat`` and ``/api/generate`` as a
conversation; ``raw`` as the prompt as it is (``Conversation.raw``); ``context`` (the
tokens an earlier answer returned: its prompt and its answer) before the new turn
(``Conversation.context``), so the prefix cache serves everything the earlier request
evaluated.

Counts and durations (:func:`stats`) are Ollama's: ``prompt_eval_count`` is the prompt
tokens evaluated (the prompt less what the prefix cache held: a cache hit shows a small
count), ``eval_count`` the generated tokens, durations in nanoseconds.
"""

from __future__ import annotations

import time

from gateway.conversation.form import Usage
from gateway.front import Call
from gateway.protocols.ollama_schemas import keep_alive_seconds


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def stats(run, usage: Usage) -> dict:
    """Ollama's counts and durations (nanoseconds) of a finished run: ``total_duration``
    (since the request arrived), ``load_duration`` (waiting for the model to load),
    ``prompt_eval_count``/``_duration`` (prompt tokens evaluated; from submission to the
    first token), ``eval_count``/``_duration`` (tokens generated; first token to last)."""
    books = run.books
    marks = books.call.record.marks
    now = time.monotonic()
    start = marks.get("received", run.gen.arrival)
    loaded = marks.get("render_start", marks.get("admitted", start))
    first = books.first_at if books.first_at is not None else now
    return {"total_duration": _ns(now - start), "load_duration": _ns(loaded - marks.get("admitted", start)),
            "prompt_eval_count": max(1, usage.prompt - usage.cached) if usage.prompt else 0,
            "prompt_eval_duration": _ns(first - run.gen.arrival), "eval_count": usage.completion,
            "eval_duration": _ns((books.last_at or first) - first)}


def context_of(run, tokens: list) -> list[int]:
    """The tokens ``/api/generate`` returns as ``context``: the prompt, then the answer's
    ``tokens`` (token events) as generated (send them back to continue; the prefix cache
    holds them)."""
    return list(run.prompt.tokens) + [t.token for t in tokens]


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
