"""Which part of a chat a prompt token falls in: the template's preamble, the system
prompt, the tools, message ``k`` (its role and content part) or the generation suffix.

Found the way :mod:`gateway.conversation.checkpoints` finds message starts: by rendering
again, never by guessing template syntax. A rendering with a marker before each message's
text gives where each message's text starts; one without the tools, where the tools
block sits (what the two renderings do not share); one without the generation prompt,
where the generation suffix begins. CPU work only (the template and the tokenizer), for a
worker thread; a template that rejects a rendering leaves that part unknown.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Any, Optional

from gateway.conversation.checkpoints import MARK_CLOSE, MARK_OPEN, marker_offsets
from gateway.conversation.segments import encode_chat
from gateway.conversation.templates import common_chars, render_text

SYSTEM_ROLES = ("system", "developer")


@dataclass
class Place:
    """Where a token falls: ``part`` is ``preamble`` (template text before the first
    message), ``system``, ``tools``, ``message``, ``generation`` (the generation prompt
    after the last message) or ``prompt`` (a prompt without messages); ``message`` is
    the message's index in the request's messages, ``role`` its role, ``content_part``
    the index of its content part (list contents only); ``char`` the character offset in
    the rendered prompt, ``into`` in the message's (or content part's) text."""

    part: str
    message: Optional[int] = None
    role: Optional[str] = None
    content_part: Optional[int] = None
    char: int = 0
    into: int = 0


def _marked(messages: list[dict]) -> list[dict]:
    """``messages`` with a marker before each text: ``k`` for a string content, ``kpj``
    for the ``j``-th text part of a list content."""
    out = []
    for k, m in enumerate(messages):
        d = dict(m)
        c = d.get("content")
        if isinstance(c, str):
            d["content"] = f"{MARK_OPEN}{k}{MARK_CLOSE}{c}"
        elif isinstance(c, list):
            d["content"] = [dict(p, text=f"{MARK_OPEN}{k}p{j}{MARK_CLOSE}{p['text']}")
                            if isinstance(p, dict) and isinstance(p.get("text"), str) else p for j, p in enumerate(c)]
        out.append(d)
    return out


def char_of(tokenizer: Any, text: str, tokens: list[int], at: int) -> int:
    """The character of ``text`` (the prompt's rendering) where token ``at`` begins: from
    the token ends when ``text`` tokenizes to ``tokens``, else the length of the decoded
    first ``at`` tokens."""
    if at <= 0:
        return 0
    ids, ends = encode_chat(tokenizer, text)
    if ids == tokens and ends is not None:
        return ends[at - 1]
    return len(tokenizer.decode([t for t in tokens[:at] if t < len(tokenizer)]))


def locate(tokenizer: Any, messages: Optional[list[dict]], template_kwargs: dict, tokens: list[int],
           at: int) -> Place:
    """The :class:`Place` of token ``at`` of a chat prompt rendered from ``messages``
    (with the generation prompt) and ``template_kwargs``; ``prompt`` when there are no
    messages (a raw prompt, a prefill) or the template rejects the conversation."""
    if not messages:
        return Place("prompt")
    kw = dict(template_kwargs)
    try:
        text = render_text(tokenizer, messages, True, kw)
    except Exception:
        return Place("prompt")
    char = char_of(tokenizer, text, tokens, at)
    place = Place("preamble", char=char)
    if kw.get("tools"):
        try:
            bare = render_text(tokenizer, messages, True, {k: v for k, v in kw.items() if k != "tools"})
            t0 = common_chars(text, bare)
            if t0 <= char < t0 + len(text) - len(bare):
                return Place("tools", char=char)
        except Exception:
            pass
    try:
        no_gen = render_text(tokenizer, messages, False, kw)
        if len(no_gen) < len(text) and text.startswith(no_gen) and char >= len(no_gen):
            return Place("generation", char=char)
    except Exception:
        pass
    try:
        found = marker_offsets(text, render_text(tokenizer, _marked(messages), True, kw))
    except Exception:
        return place
    starts = sorted((pos, name) for name, pos in found.items())
    i = bisect_right([p for p, _ in starts], char) - 1
    if i < 0:
        return place
    name = starts[i][1]
    k, _, j = name.partition("p")
    k = int(k)
    role = messages[k].get("role")
    leading = all(m.get("role") in SYSTEM_ROLES for m in messages[:k + 1])
    return Place("system" if leading else "message", k, role, int(j) if j else None, char, char - starts[i][0])
