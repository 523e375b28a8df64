"""Chat-template text and its tokens: the rendering that prompt building, checkpoint
planning (:mod:`gateway.conversation.checkpoints`), segment-wise tokenization and the
next-turn precompute share. CPU-only tokenizer work, meant for a worker thread.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from cache.checkpoints import common_prefix


def common_chars(a: str, b: str) -> int:
    """Length (characters) of the common prefix of two strings: a binary search of
    slice comparisons, O(n log n) in C rather than a Python loop over characters."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo



def render_text(tokenizer: Any, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The chat template's text for ``messages`` (no tokenization).

    Raises:
        whatever the template raises (jinja errors, ``raise_exception``).
    """
    kw = {k: v for k, v in dict(template_kwargs or {}).items() if k not in ("add_generation_prompt", "tokenize")}
    return tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **kw)


def encode_with_ends(tokenizer: Any, text: str) -> tuple[list[int], Optional[list[int]]]:
    """Tokenize a rendered chat (``add_special_tokens=False``, as ``apply_chat_template``
    does) and return ``(token ids, end character of each token)``; the ends are None
    when the tokenizer gives no usable offset mapping (slow tokenizers)."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    if getattr(hf, "is_fast", False):
        enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = [int(t) for t in enc["input_ids"]]
        ends = [int(e) for _, e in enc["offset_mapping"]]
        if all(a <= b for a, b in zip(ends, ends[1:])):
            return ids, ends
        return ids, None
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)], None


def tokens_before(tokenizer: Any, text: str, ids: Sequence[int], ends: Optional[Sequence[int]], chars: int) -> int:
    """How many of ``ids`` (the tokens of ``text``) lie wholly before character ``chars``:
    from the token ends (:func:`encode_with_ends`) when given, else by tokenizing
    ``text[:chars]`` and comparing."""
    if ends is not None:
        return bisect_right(ends, chars)
    return common_prefix(list(tokenizer.encode(text[:chars], add_special_tokens=False)), ids)
