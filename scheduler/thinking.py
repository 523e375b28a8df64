"""A thinking budget: the reasoning block is closed once it has taken its tokens.

Anthropic's ``thinking.budget_tokens`` (and the budget a constrained answer gives a
thinking model before its grammar begins) caps the tokens between the think tags:
:class:`ThinkingBudget` is an mlx-lm logits processor that counts them and, at the
budget, allows only the end tag, so the answer follows. Like a grammar's token mask it
runs on the engine thread, one per request, and never raises into the batch.
"""

from __future__ import annotations

from collections import deque

import mlx.core as mx

HISTORY = 32  # calls a budget can take back (a draft is at most 16 tokens)


class ThinkingBudget:
    """``(tokens, logits [1, V]) -> logits [1, V]``: once ``budget`` tokens of reasoning
    have been generated (after ``start_id``, or from the first token when the prompt
    opened the block: ``inside``), every token but ``end_id`` is set to ``-inf``.

    Args:
        start_id, end_id: the think tags' token ids (e.g. Qwen3's ``<think>``, ``</think>``).
        budget: reasoning tokens allowed (>= 1).
        inside: the prompt ends inside a think block (the template opened it).
    """

    def __init__(self, start_id: int, end_id: int, budget: int, inside: bool = False):
        self.start_id, self.end_id, self.budget = start_id, end_id, max(1, budget)
        self.inside = inside
        self.spent = 0
        self.closed = False
        self._started = False
        self._before: deque = deque(maxlen=HISTORY)  # the state before each of the last calls

    def rollback(self, n: int) -> None:
        """Take back the last ``n`` calls (a rejected draft's tokens; at most
        :data:`HISTORY`)."""
        for _ in range(min(n, len(self._before))):
            self.inside, self.spent, self.closed = self._before.pop()

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        self._before.append((self.inside, self.spent, self.closed))
        if self._started and not self.closed:
            last = int(tokens[-1].item())
            if last == self.start_id:
                self.inside, self.spent = True, 0
            elif last == self.end_id:
                self.inside, self.closed = False, True
            elif self.inside:
                self.spent += 1
        self._started = True
        if not self.inside or self.closed or self.spent < self.budget:
            return logits
        keep = mx.arange(logits.shape[-1]) == self.end_id
        return mx.where(keep, logits, mx.array(-float("inf"), dtype=logits.dtype))
