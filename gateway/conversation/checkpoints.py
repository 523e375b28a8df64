"""Checkpoint planning for chat prompts: token offsets at which prefill should save snapshots.

The engine cuts prefill chunks exactly at these offsets and stores a snapshot at
each, so that later requests sharing only part of the prompt find an *exact*
snapshot (required for recurrent caches, see :mod:`cache.kinds`). Offsets come from
rendering the chat template and comparing, never from guessing template syntax.

One extra rendering does it: the conversation with a marker at the start of every
message's content, followed by a placeholder assistant reply and a placeholder user
message (the shape of the *next* request). Where the markers land, once removed and
as long as the rendering still agrees with the prompt's text, are the offsets:

- **system end**: the start of the first non-system message's content;
- **last user message**: the start of its content (an edited last message);
- **next turn**: the start of the placeholder reply. This is where the next request
  really diverges from this one: a thinking model's next turn drops the old
  ``<think>`` block (Qwen3's template) and the generation prompt's empty think block
  when thinking is off, so the stored prompt + completion never prefixes it. With
  thinking on it is the whole prompt (offset ``len(prompt)``; the engine snapshots
  right after prefill);
- **message starts** (``boundaries=True``, for caches that cannot be trimmed):
  content starts, thinned by :func:`thin_boundaries`; an assistant message's is one
  token earlier, so that regenerating that turn (whose prompt ends there) finds a
  snapshot it may use (a fetch leaves at least one token to compute);
- every ``interval`` tokens (default 4096) for long contexts, snapped back to a
  message start lying in the last quarter of the interval.

Character offsets become token offsets through the tokenizer's offset mapping (the
tokens that end at or before the character). An offset can only cost reuse, never
exactness: a snapshot covers the prompt's own tokens, and the prefix tree matches
tokens.

Where a running request cuts its prefill and snapshots, from these offsets, is decided at
admission by :mod:`cache.checkpoints` (tokens only). All functions here are pure and
CPU-only (tokenizer work), meant for a worker thread.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional

from gateway.conversation.templates import common_chars, encode_with_ends, render_text, tokens_before

SENTINEL = "\u2063CKPT\u2063SENTINEL\u2063"
DEFAULT_INTERVAL = 4096
# Thinning of message-start checkpoints (non-trimmable caches): the last KEEP_LAST
# messages, and every KEEP_EVERY-th message (by index) before them.
KEEP_LAST = 8
KEEP_EVERY = 4

_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use code points around a marker's name
MARK_OPEN, MARK_CLOSE = _OPEN, _CLOSE  # for callers placing markers of their own (marker_offsets finds them)
_MARK = re.compile(f"{_OPEN}([a-z0-9]+){_CLOSE}")
_REPLY, _NEXT_USER = "a", "u"


def _marked(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with a marker before each string content, then the next turn's shape."""
    out = []
    for k, m in enumerate(messages):
        d = dict(m)
        if isinstance(d.get("content"), str):
            d["content"] = f"{_OPEN}{k}{_CLOSE}{d['content']}"
        out.append(d)
    out.append({"role": "assistant", "content": f"{_OPEN}{_REPLY}{_CLOSE}"})
    out.append({"role": "user", "content": f"{_OPEN}{_NEXT_USER}{_CLOSE}"})
    return out


def marker_offsets(prompt_text: str, marked_text: str) -> dict[str, int]:
    """Character offsets in ``prompt_text`` of the markers of ``marked_text`` (a rendering
    of :func:`_marked` messages): name -> offset, for the markers before the point where
    the marked rendering (markers removed) stops agreeing with the prompt."""
    pieces, found, removed = [], {}, 0
    last = 0
    for m in _MARK.finditer(marked_text):
        pieces.append(marked_text[last:m.start()])
        found[m.group(1)] = m.start() - removed
        removed += m.end() - m.start()
        last = m.end()
    pieces.append(marked_text[last:])
    agree = common_chars(prompt_text, "".join(pieces))
    return {name: pos for name, pos in found.items() if pos <= agree}


def thin_boundaries(indices: Iterable[int], keep_last: int = KEEP_LAST, keep_every: int = KEEP_EVERY) -> list[int]:
    """The message indices whose starts get a checkpoint on a non-trimmable cache: the
    last ``keep_last`` of ``indices`` and, before them, those divisible by ``keep_every``.

    Indices do not move as a conversation grows, so the older checkpoints one request
    planned are the ones later requests plan too (and find cached). Snapshots of a
    non-trimmable cache are full copies, so each costs memory; the byte bound and LRU
    eviction of the prompt cache apply to them like to any entry.
    """
    idx = sorted(set(indices))
    cut = len(idx) - keep_last
    return [i for n, i in enumerate(idx) if n >= cut or i % max(1, keep_every) == 0]


def periodic_checkpoints(num_tokens: int, interval: int = DEFAULT_INTERVAL, boundaries: Iterable[int] = (),
                         snap: float = 0.25) -> list[int]:
    """Offsets every ``interval`` tokens, each snapped back to the latest boundary in
    ``(target - snap * interval, target]`` when there is one.

    Args:
        num_tokens: prompt length (tokens); offsets are ``< num_tokens``.
        interval: tokens between checkpoints (``>= 1``).
        boundaries: preferred cut offsets (e.g. message starts), in tokens.
        snap: fraction of the interval to look back for a boundary.

    Raises:
        ValueError: if ``interval < 1``.
    """
    if interval < 1:
        raise ValueError("interval must be >= 1")
    bounds = sorted(set(b for b in boundaries if 0 < b < num_tokens))
    window = int(interval * snap)
    out = []
    last = 0
    while last + interval < num_tokens:
        target = last + interval
        cut = target
        i = bisect_right(bounds, target) - 1
        if i >= 0 and bounds[i] > target - window and bounds[i] > last:
            cut = bounds[i]
        out.append(cut)
        last = cut
    return out


def plan_completion_checkpoints(prompt_tokens: Sequence[int], interval: int = DEFAULT_INTERVAL) -> list[int]:
    """Checkpoints for a plain completions prompt: every ``interval`` tokens (sorted, in 1..len-1)."""
    return periodic_checkpoints(len(prompt_tokens), interval)


def plan_chat_checkpoints(tokenizer: Any, messages: Sequence[Mapping[str, Any]], prompt_tokens: Sequence[int],
                          template_kwargs: Mapping[str, Any] | None = None, interval: int = DEFAULT_INTERVAL, *,
                          prompt_text: Optional[str] = None, token_ends: Optional[Sequence[int]] = None,
                          boundaries: bool = False, trimmable: bool = False) -> list[int]:
    """Plan snapshot offsets for a chat prompt (see the module docstring).

    Args:
        tokenizer: mlx-lm's ``TokenizerWrapper`` (anything with a Hugging Face
            ``apply_chat_template``).
        messages: the messages the prompt was rendered from (template dicts).
        prompt_tokens: the rendered prompt (with the generation prompt).
        template_kwargs: the extra template arguments used for the prompt (e.g.
            ``enable_thinking``, ``tools``); ``add_generation_prompt`` and ``tokenize``
            are ignored.
        interval: tokens between periodic checkpoints (long contexts).
        prompt_text: the prompt's rendered text, when the caller has it (else rendered).
        token_ends: end character of each prompt token in ``prompt_text``
            (:func:`encode_with_ends`); else each offset is found by tokenizing the text
            before it.
        boundaries: also checkpoint message starts (thinned, :func:`thin_boundaries`);
            for models whose cache cannot be trimmed (recurrent, sliding window).
        trimmable: the model's cache can be trimmed: only the system end (which other
            requests of a burst wait for while this one prefills) and the periodic
            offsets; the prompt + completion snapshot stored at the end serves the rest.

    Returns:
        Sorted, deduplicated offsets in ``1 .. len(prompt_tokens)``; ``len(prompt_tokens)``
        (the next turn shares the whole prompt) is the only one that is not below it. A
        rendering the template rejects gives no offsets (the request itself is unaffected).
    """
    kw = dict(template_kwargs or {})
    n = len(prompt_tokens)
    try:
        text = prompt_text if prompt_text is not None else render_text(tokenizer, messages, True, kw)
        found = marker_offsets(text, render_text(tokenizer, _marked(messages), True, kw))
    except Exception:
        return plan_completion_checkpoints(prompt_tokens, interval)
    if prompt_text is None or token_ends is None:
        ids, token_ends = encode_with_ends(tokenizer, text)
        if ids != list(prompt_tokens):
            token_ends = None

    def before(chars: int) -> int:
        return tokens_before(tokenizer, text, prompt_tokens, token_ends, chars)

    points: set[int] = set()
    starts = {int(k): before(c) for k, c in found.items() if k.isdigit()}
    roles = [m.get("role") for m in messages]
    first = next((i for i, r in enumerate(roles) if r not in ("system", "developer")), None)
    if first and first in starts:  # system end: there is a system prompt before it
        points.add(starts[first])
    if trimmable:
        if n > interval:
            points.update(periodic_checkpoints(n, interval, set(starts.values()) | points))
        return sorted(p for p in points if 0 < p < n)
    last_user = max((i for i, r in enumerate(roles) if r == "user"), default=None)
    if last_user in starts:
        points.add(starts[last_user])
    if _REPLY in found:
        points.add(before(found[_REPLY]))
    else:  # an earlier message renders differently with a marker: render the next turn alone
        try:
            nxt = render_text(tokenizer, [*messages, {"role": "assistant", "content": SENTINEL},
                                          {"role": "user", "content": SENTINEL}], True, kw)
            points.add(before(common_chars(text, nxt)))
        except Exception:
            pass
    if boundaries:  # not the leading system messages' own starts: nothing precedes them
        for i in thin_boundaries(i for i in starts if first is not None and i >= first):
            points.add(starts[i] - (1 if roles[i] == "assistant" else 0))
    if n > interval:
        points.update(periodic_checkpoints(n, interval, set(starts.values()) | points))
    return sorted(p for p in points if 0 < p <= n)
