"""Logits processors along a draft: penalties, ``logit_bias``, grammars and thinking
budgets applied at every verified position, so that rows with them draft too.

A row's processors see, at each decode step, its tokens so far ending with the token
just fed (mlx-lm's ``(tokens, logits [1, V]) -> logits [1, V]``). Verifying a draft
feeds ``W`` tokens at once: position ``j`` of the forward predicts the token after
``input, draft[:j]``, so its logits go through the processors with that context, in
order. Afterwards the row keeps the context and processor state of the accepted tokens
only: stateful processors rewind the rest (:meth:`rollback`), the token context is cut.

Which processors may do this (:func:`draftable`):

* mlx-lm's own (repetition, presence and frequency penalties, ``logit_bias``): plain
  functions of the context, with no state;
* ours with a ``rollback(n)`` method: :class:`scheduler.grammar.TokenMask` (llguidance
  rolls its matcher back) and :class:`scheduler.thinking.ThinkingBudget`.

A grammar also bounds the draft itself (:func:`grammar_prefix`): its matcher must never
be fed a token it forbids, so a draft is cut at the first such token.
"""

from __future__ import annotations

import types

import mlx.core as mx


def _inner(processor):
    """The processor under :class:`scheduler.batch.faults.RowFault`'s guard."""
    return getattr(processor, "inner", processor)


def draftable(processors: list) -> bool:
    """Every processor can be applied along a draft and rewound: a plain function (no
    state) or an object with ``rollback``."""
    for p in map(_inner, processors):
        if not (isinstance(p, types.FunctionType) or callable(getattr(p, "rollback", None))):
            return False
    return True


def grammar_prefix(processors: list, token: int, draft: list[int]) -> int:
    """How many leading tokens of ``draft`` (after the input ``token``) the processors
    with a ``validate`` method allow (all when none has one)."""
    allowed = len(draft)
    for p in map(_inner, processors):
        validate = getattr(p, "validate", None)
        if callable(validate):
            allowed = min(allowed, max(0, validate([token, *draft]) - 1))
    return allowed


def apply_along(processors: list, context, logits: mx.array, draft: list[int]) -> mx.array:
    """The row's logits ``[len(draft) + 1, V]`` through its processors, position by
    position. ``context`` is the row's token buffer (mlx-lm's ``TokenBuffer``), which
    already ends with the input token; the draft is appended to it (see :func:`rewind`)."""
    rows = []
    for j in range(len(draft) + 1):
        if j:
            ctx = context.update_and_fetch(mx.array(draft[j - 1:j], dtype=mx.int32))
        else:
            ctx = context.state[:context._size]
        row = logits[j:j + 1]
        for p in processors:
            row = p(ctx, row)
        rows.append(row)
    return mx.concatenate(rows, axis=0)


def rewind(processors: list, context, rejected: int) -> None:
    """Take back the last ``rejected`` draft tokens: from the token buffer and from every
    stateful processor (each saw one call per token)."""
    if rejected <= 0:
        return
    context._size -= rejected  # mlx-lm's TokenBuffer: its contents are [:_size]
    for p in map(_inner, processors):
        rollback = getattr(p, "rollback", None)
        if callable(rollback):
            rollback(rejected)
