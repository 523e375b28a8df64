"""Next-turn precompute, the gateway's half: render what a conversation's next request
will start with, and queue it on the engine (see :mod:`scheduler.admission.precompute`).

The next request of a chat is this one's messages, the reply as the client got it, and
a new user message. Rendering that with the chat template, with a placeholder for the
new message, and cutting where the placeholder begins gives the shared prefix exactly
as the template will show it: a thinking model's old ``<think>`` block dropped, the
reply re-tokenized the way the next request's prompt will be. Rendering and
tokenizing run on a worker thread, never the event loop or the engine thread.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from gateway.conversation.templates import render_text, tokens_before
from gateway.conversation.segments import encode_chat
from scheduler.admission.precompute import Precompute

if TYPE_CHECKING:
    from gateway.conversation.prompts import Prompt
    from gateway.models.handle import ModelHandle

log = logging.getLogger("mlx_gateway.next_turn")

_PLACEHOLDER = "\ue002next\ue003"
_STAND_IN = "Next"  # tokenized in the placeholder's place: a user message starts with some text
_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx-gateway-next-turn")


def next_turn_prefix(tokenizer: Any, messages: Sequence[Mapping[str, Any]], template_kwargs: Mapping[str, Any],
                     reply: str) -> Optional[list[int]]:
    """Tokens the next request of this conversation starts with, up to where its new user
    message begins; None when the template cannot show it (it raises, or drops the
    placeholder).

    Args:
        tokenizer: mlx-lm's ``TokenizerWrapper``.
        messages: this request's template messages (:attr:`Prompt.messages`).
        template_kwargs: the template arguments this request was rendered with.
        reply: the reply's content as the client received it (no reasoning).
    """
    msgs = [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": _PLACEHOLDER}]
    try:
        text = render_text(tokenizer, msgs, True, template_kwargs)
    except Exception:
        log.debug("the template cannot render the next turn", exc_info=True)
        return None
    cut = text.find(_PLACEHOLDER)
    if cut <= 0:
        return None
    full = text.replace(_PLACEHOLDER, _STAND_IN)
    ids, ends = encode_chat(tokenizer, full)  # the conversation's pieces were tokenized for its request
    return ids[:tokens_before(tokenizer, full, ids, ends, cut)]


def schedule_next_turn(model: "ModelHandle", prompt: "Prompt", reply: str, namespace: str, tenant: str) -> None:
    """Render the next turn's prefix on a worker thread and queue it on ``model``'s engine,
    when the prompt came from a chat template (the caller checks
    ``--precompute-next-turn`` and that the server is not draining). The engine is told
    at once (it does not count as idle until the render is done); at most 8 renders are
    in flight, more are skipped. Never raises."""
    engine = model.engine
    if prompt.messages is None or not engine.reserve_precompute():
        return

    def work() -> None:
        p = None
        try:
            tokens = next_turn_prefix(model.tokenizer, prompt.messages, prompt.template_kwargs, reply)
            if tokens and len(tokens) > len(prompt.tokens) // 2 and len(tokens) < model.context_length:
                p = Precompute(tokens, namespace, tenant)
        except Exception:
            log.exception("rendering the next turn failed")
        finally:
            engine.submit_precompute(p)

    try:
        _POOL.submit(work)
    except RuntimeError:  # interpreter shutting down
        engine.submit_precompute(None)
