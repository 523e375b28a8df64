"""Checkpoint planning: token offsets at which prefill should save snapshots.

The engine cuts prefill chunks exactly at these offsets and stores a snapshot at
each, so that later requests sharing only part of the prompt find an *exact*
snapshot (required for recurrent caches, see ``restore.py``). Offsets come from
re-rendering the chat template and comparing token prefixes, never from guessing
template syntax:

- end of the system prompt: render the leading system message(s) alone
  (``add_generation_prompt=False``) and take the common token prefix with the
  prompt;
- start of the last user message: render the conversation with that message's
  content replaced by a sentinel and take the common token prefix (templates do
  not always render ``messages[:-1]`` as a prefix of ``messages``);
- before the generation suffix (``<|im_start|>assistant\\n``, plus
  ``<think>\\n\\n</think>\\n\\n`` when thinking is disabled): render with
  ``add_generation_prompt=False`` and take the common prefix. A thinking model's
  next turn drops the old ``<think>`` block (Qwen3's template), so the stored
  prompt + completion never prefixes it; this checkpoint still does (the same
  observation as mlx-lm's server, which cuts a segment at ``<think>``);
- every ``interval`` tokens (default 4096) for long contexts, snapped back to a
  message boundary lying in the last quarter of the interval.

All functions are pure and CPU-only (tokenizer work), meant for a worker thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

SENTINEL = "\u2063CKPT\u2063SENTINEL\u2063"
DEFAULT_INTERVAL = 4096


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length (tokens) of the common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _render(tokenizer: Any, messages: list[Mapping[str, Any]], add_generation_prompt: bool,
            template_kwargs: Mapping[str, Any]) -> list[int]:
    out = tokenizer.apply_chat_template(
        list(messages), tokenize=True, add_generation_prompt=add_generation_prompt, **dict(template_kwargs)
    )
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    if out and isinstance(out[0], list):
        out = out[0]
    return [int(t) for t in out]


def _with_content(msg: Mapping[str, Any], content: str) -> dict[str, Any]:
    m = dict(msg)
    if isinstance(m.get("content"), list):
        m["content"] = [{"type": "text", "text": content}]
    else:
        m["content"] = content
    return m


def periodic_checkpoints(
    num_tokens: int, interval: int = DEFAULT_INTERVAL, boundaries: Iterable[int] = (), snap: float = 0.25
) -> list[int]:
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
        for b in reversed(bounds):  # few boundaries; linear scan is fine
            if b <= target:
                if b > target - window and b > last:
                    cut = b
                break
        out.append(cut)
        last = cut
    return out


def plan_completion_checkpoints(prompt_tokens: Sequence[int], interval: int = DEFAULT_INTERVAL) -> list[int]:
    """Checkpoints for a plain completions prompt: every ``interval`` tokens (sorted, in 1..len-1)."""
    return periodic_checkpoints(len(prompt_tokens), interval)


def message_boundaries(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], prompt_tokens: Sequence[int],
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token offsets where each message ends in ``prompt_tokens`` (common prefix of the
    rendering of ``messages[:k]`` with the prompt). O(len(messages)) renders."""
    kw = dict(template_kwargs or {})
    out = []
    for k in range(1, len(messages)):
        try:
            toks = _render(tokenizer, list(messages[:k]), False, kw)
        except Exception:
            continue
        out.append(common_prefix(toks, prompt_tokens))
    return sorted(set(out))


def plan_chat_checkpoints(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    prompt_tokens: Sequence[int],
    template_kwargs: Mapping[str, Any] | None = None,
    interval: int = DEFAULT_INTERVAL,
) -> list[int]:
    """Plan snapshot offsets for a chat prompt.

    Args:
        tokenizer: mlx-lm's ``TokenizerWrapper`` (anything with a Hugging Face
            ``apply_chat_template``).
        messages: the OpenAI ``messages`` the prompt was rendered from.
        prompt_tokens: the rendered prompt (with the generation prompt).
        template_kwargs: the extra template arguments used for the prompt (e.g.
            ``enable_thinking``, ``tools``, ``date_string``); ``add_generation_prompt``
            and ``tokenize`` must not be in it.
        interval: tokens between periodic checkpoints (long contexts).

    Returns:
        Sorted, deduplicated offsets in ``1 .. len(prompt_tokens) - 1``: system
        prompt end, last user message (content) start, end before the generation
        suffix, and periodic ones. A boundary whose re-rendering fails (template
        raises) is skipped.
    """
    kw = {k: v for k, v in dict(template_kwargs or {}).items() if k not in ("add_generation_prompt", "tokenize")}
    msgs = [dict(m) for m in messages]
    n = len(prompt_tokens)
    points: set[int] = set()

    # 1) end of the system prompt
    k = 0
    while k < len(msgs) and msgs[k].get("role") in ("system", "developer"):
        k += 1
    if 0 < k < len(msgs):
        try:
            points.add(common_prefix(_render(tokenizer, msgs[:k], False, kw), prompt_tokens))
        except Exception:
            pass

    # 2) start of the last user message's content
    last_user = max((i for i, m in enumerate(msgs) if m.get("role") == "user"), default=None)
    if last_user is not None:
        alt = list(msgs)
        alt[last_user] = _with_content(msgs[last_user], SENTINEL)
        try:
            gen = _render(tokenizer, alt, True, kw)
            points.add(common_prefix(gen, prompt_tokens))
        except Exception:
            pass

    # 3) before the generation suffix
    try:
        points.add(common_prefix(_render(tokenizer, msgs, False, kw), prompt_tokens))
    except Exception:
        pass

    # 4) periodic, snapped to message boundaries
    if n > interval:
        bounds = set(message_boundaries(tokenizer, msgs, prompt_tokens, kw)) | points
        points.update(periodic_checkpoints(n, interval, bounds))

    return sorted(p for p in points if 0 < p < n)
