"""Chunked prefill: how many prompt tokens each engine step may prefill, so that a
long prompt never stalls the sequences that are decoding.

mlx-lm's ``BatchGenerator.next()`` runs one decode step of the decoding batch, then one
prefill step of up to ``prefill_step_size`` tokens per prompt. With the default 2048, a
long prompt stops every decoding stream for the whole chunk (seconds on a CPU). While
sequences decode, the planner instead:

* sizes each prefill chunk so that the step takes about ``budget`` seconds (times the
  ratio of prompts in prefill to streams decoding, when above 1: a cold burst whose
  first request already decodes is not slowed to protect that one stream), from the
  time per prompt token measured on the previous chunk of the same latency classes (a
  chunk's cost grows with the context it attends to, so the size adapts as a long
  prompt advances, and a short interactive prompt's fast chunk does not size the next
  chunk of long agent prompts); sizes are multiples of :data:`ALIGN` tokens
  (:data:`CAP_ALIGN` under a latency-class cap), the first chunk is
  :data:`FIRST_CHUNK` tokens;
* where the model's forward cost was measured at load, sizes the chunk instead from a
  cost per token that grows with the context it attends to, ``a + b c`` seconds for a
  token attending to ``c`` others (the prompt's position plus half the chunk), the
  least-squares line through the last :data:`POINTS` chunks timed (with one, or
  contexts too close together, through it and the load's figure at an empty context):
  sized from the cost per token of the chunk before, a chunk of a 3,000-token prompt
  beside four streams overshot the 0.2 s budget by 30-70 % on the medium benchmark
  model (steps of 0.25-0.34 s: the streams' largest gaps), as it attends to more
  context than the chunk it was sized from;
* after each prefill chunk, runs decode-only steps (a prefill step size of 0, which
  makes ``next()`` advance only the decoding batch) until the decoding rows have had
  :data:`DECODE_SHARE` of the chunk step's time, the decode step inside the chunk step
  counted (:class:`DecodeShare`, shared by the models of one engine loop), and at least
  :data:`MEDIAN_STEPS` of them: two of every three of the streams' gaps then stay those
  of decoding alone, and so does their median (with one, half their gaps are a chunk's).
  Not counting the decode inside the chunk step, the medium benchmark model ran three
  decode-only steps after most chunks instead of two: 11-12 % of the chunks' time, which
  the long prompt waited for. The step that moves a finished prompt to the decoding
  rows decodes them too, so it goes first. These steps, and the decode inside each
  chunk step, verify no speculative drafts (:meth:`Speculator.next
  <scheduler.speculative.step.Speculator.next>`): a verify step is wider than the decode
  step the share counts on;
* lets a prompt's last chunk take its tail (up to :data:`TAIL` of the chunk more) rather
  than leave it to a step of its own, which would pay a forward's fixed part and a
  decode step for a few tokens.

With nothing decoding, prompts prefill in full ``prefill_step_size`` chunks: TTFT is
then what it would be without a budget.

A time budget shrinks chunks on a slower machine, and each chunk pays a forward's fixed
cost (reading every weight, dispatching every layer's ops) whatever its size. So a chunk
is never sized below the floor of :mod:`scheduler.batch.forward_cost`: the fewest tokens whose
cost per token stays within 20 % of the best chunk's, from the model's forward cost
measured at load and the per-token cost measured on the prompt's recent chunks. Where
that floor is larger than the budget allows, the step takes longer than the budget: the
prompt keeps its throughput rather than the streams their gap. The one exception is a
latency-class cap (:meth:`ChunkPlanner.next_chunk`'s ``cap``), a promise to an
interactive request that it waits at most about that long.

How this compares: vLLM (V1) schedules decode tokens first and fills the rest of a
per-step token budget (``max_num_batched_tokens``) with prefill chunks, all in one
forward pass; SGLang caps each prefill at ``--chunked-prefill-size`` tokens and
alternates prefill and decode batches (or mixes them with ``--enable-mixed-chunk``).
Ours alternates like SGLang's default, because mlx-lm keeps prompt and decode rows in
separate batch caches, and adds the decode-only steps so that decoding keeps a share of
the time.
"""

from __future__ import annotations

import math
from typing import Optional

from scheduler.batch.forward_cost import ForwardCost

ALIGN = 32  # chunk sizes are multiples of this many tokens
# Under a latency-class cap (:meth:`ChunkPlanner.next_chunk`), chunks may be as small as
# this many tokens per prompt, so that several long prompts together still fit the cap.
CAP_ALIGN = 8
FIRST_CHUNK = 128  # tokens per prompt before any chunk has been timed
HEADROOM = 0.85  # aim this fraction of the budget, as the next chunk attends to more context
FITTED_HEADROOM = 0.95  # ... and this fraction when the growth with context is fitted (_context_cost)
POINTS = 6  # chunks of at least FIRST_CHUNK tokens a prompt whose cost-per-context line is fitted
SPREAD = 512  # tokens of context those chunks must span for their own slope
DECODE_SHARE = 0.1  # the decoding rows' time owed after a prefill chunk, as a fraction of its step's time
MEDIAN_STEPS = 2  # decode-only steps owed after a prefill chunk at least (the streams' median gap)
TAIL = 0.25  # a prompt's last tokens, at most this fraction of a chunk, go with the chunk before them


class DecodeShare:
    """Decode-only steps owed to the decoding rows after a prefill chunk: seconds of them,
    and a number of turns of the engine loop.

    One per engine loop, shared by the planners of every model on it: a chunk of one
    model owes the decoding rows of every model their share of time, the decode-only
    steps of every model pay it, and each turn in which the prefilling model's planner
    holds its chunk back pays one of the turns.
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self.turns = 0

    def owed(self) -> bool:
        """Decode-only steps are owed now."""
        return self.seconds > 0 or self.turns > 0

    def owe(self, seconds: float, turns: int = 0) -> None:
        """Owe ``seconds`` of decode-only steps, and ``turns`` of them at least."""
        self.seconds, self.turns = seconds, turns

    def pay(self, seconds: float) -> None:
        """A decode-only step took ``seconds``."""
        self.seconds -= seconds

    def pay_turn(self) -> None:
        """A turn of decode-only steps was given."""
        self.turns -= 1

    def clear(self) -> None:
        """Nothing is owed (no prompt prefills beside decoding rows)."""
        self.seconds, self.turns = 0.0, 0


class ChunkPlanner:
    """Chooses each step's prefill chunk (tokens per prompt); engine thread only.

    Args:
        step_size: tokens per prompt per step when nothing decodes (``--prefill-step-size``).
        budget: seconds a prefill step may take while at least as many sequences
            decode as prompts prefill (``--prefill-budget``); 0 disables chunking.
        share: the decode-only time owed, shared with the other models of one engine
            loop (None: a planner of its own).
        cost: the model's forward cost (:mod:`scheduler.batch.forward_cost`), for the floor
            below which no chunk is cut; None: no floor.
    """

    def __init__(self, step_size: int, budget: float, share: Optional[DecodeShare] = None,
                 cost: Optional[ForwardCost] = None) -> None:
        self.step_size = max(1, step_size)
        self.budget = max(0.0, budget)
        self.share = share or DecodeShare()
        self.cost = cost
        # Seconds per prompt token of the last timed chunk, by the latency classes prefilling in it.
        self._per_token: dict[tuple, float] = {}
        # The marginal seconds per prompt token (the fixed part of a forward taken out), likewise.
        self._marginal: dict[tuple, float] = {}
        # (tokens attended per prompt token, marginal seconds per prompt token) of the last
        # POINTS chunks timed, by classes: the cost's growth with context (_context_cost).
        self._points: dict[tuple, list[tuple[float, float]]] = {}
        self.decode_step = 0.0  # seconds of a step that only decodes (moving average)
        self.decode_only_steps = 0  # steps that advanced only the decoding batch
        self.budgeted_steps = 0  # prefill steps whose chunk the budget cut below step_size

    def next_chunk(self, prefilling: int, decoding: int, cap: Optional[float] = None, share: float = 1.0,
                   classes: tuple = (), context: Optional[float] = None, left: Optional[int] = None) -> int:
        """Tokens per prompt for the next step; 0 for a decode-only step.

        Args:
            prefilling: requests admitted and still in prefill.
            decoding: requests decoding (0 when the step holds the decoding rows back).
            cap: seconds the step may take at most, whatever decodes (the prompts are of a
                lower latency class than requests that may arrive: each new one waits for
                the step in progress); None: no cap.
            share: the part of the step's budgets this prefill may take (other models
                prefill in the same step).
            classes: the latency classes of the prompts prefilling (sorted): the chunk is
                sized from the cost per token last measured for the same classes.
            context: tokens already in the prefilling prompts' caches (their mean): the
                chunk attends to them (None: sized from the last chunk's cost per token).
            left: the most prompt tokens a prefilling prompt has still to prefill before
                its last one (which the step that moves it to the decoding batch feeds);
                None: unknown. At 0 the step only moves prompts over, and it decodes the
                rows too: it does not wait for owed decode-only steps (they follow it). A
                tail that a chunk would leave of at most :data:`TAIL` of the chunk goes
                with it.
        """
        capped = self.step_size if cap is None else self._sized(prefilling, cap * share, classes, CAP_ALIGN,
                                                                 floored=False)
        if not prefilling or not decoding or not self.budget:
            self.share.clear()
            return capped
        if self.share.owed() and left != 0:
            self.share.pay_turn()
            return 0
        # A prompt waiting for its first token is a user waiting too: when more prompts
        # prefill than streams decode, the step may take proportionally longer.
        chunk = self._sized(prefilling, share * self.budget * max(1.0, prefilling / decoding), classes,
                            context=context, decoding=True)
        if left is not None and 0 < left - chunk <= TAIL * chunk:
            chunk = left
        return min(capped, chunk)

    def idle_chunk(self, prefilling: int, classes: tuple = ()) -> int:
        """Tokens per prompt for a step that prefills only preemptible work (next-turn
        precompute) while nothing decodes: sized to the budget like a chunk beside decoding
        rows, so that a request arriving meanwhile waits at most about one budget; no
        decode-only steps follow it."""
        if not prefilling or not self.budget:
            return self.step_size
        return self._sized(prefilling, self.budget, classes)

    def floor(self, prefilling: int, classes: tuple = ()) -> int:
        """The fewest tokens per prompt a chunk of ``prefilling`` prompts may have: their
        forward's cost per token within 20 % of a full ``step_size`` chunk's
        (:meth:`ForwardCost.floor <scheduler.batch.forward_cost.ForwardCost.floor>`, with the
        marginal cost per token last measured for these classes), a multiple of
        :data:`ALIGN`; :data:`ALIGN` without a measured forward cost."""
        if self.cost is None or prefilling <= 0:
            return ALIGN
        total = self.cost.floor(self.step_size * prefilling, self._marginal.get(classes))
        per_row = -(-total // prefilling)
        return min(self.step_size, max(ALIGN, -(-per_row // ALIGN) * ALIGN))

    def _sized(self, prefilling: int, budget: float, classes: tuple, align: int = ALIGN, floored: bool = True,
               context: Optional[float] = None, decoding: bool = False) -> int:
        # Classes not timed yet: the costliest of those that were (a chunk too small, not too long).
        per_token = self._per_token.get(classes) or max(self._per_token.values(), default=0.0)
        model = self._context_cost(classes) if context is not None else None
        if per_token <= 0:
            per_row = FIRST_CHUNK
        elif model is not None:
            per_row = self._fitting(prefilling, FITTED_HEADROOM * budget, context, *model, decoding)
        else:
            per_row = int(HEADROOM * budget / per_token) // prefilling
        per_row = max(align, per_row - per_row % align)
        if floored:  # not under a latency-class cap: never below the efficient size
            per_row = max(per_row, self.floor(prefilling, classes))
        if per_row < self.step_size:
            self.budgeted_steps += 1
            return per_row
        return self.step_size

    def record(self, chunk: int, prefilled: int, decoding: int, seconds: float, classes: tuple = (),
               context: Optional[float] = None, prefilling: int = 1) -> None:
        """Account a finished step that took ``seconds``: planned with ``chunk`` tokens
        per prompt, it prefilled ``prefilled`` prompt tokens in all (of ``prefilling``
        prompts of the latency ``classes``, ``context`` tokens in their caches before it,
        on average) while ``decoding`` sequences decoded."""
        if not prefilled and decoding:
            self.decode_step = seconds if not self.decode_step else 0.8 * self.decode_step + 0.2 * seconds
        if chunk == 0:
            self.decode_only_steps += 1
            self.share.pay(seconds)
            return
        if prefilled and decoding and self.budget:  # (the step decoded them once: a decode step's time)
            self.share.owe(DECODE_SHARE * seconds - self.decode_step, MEDIAN_STEPS)
        if prefilled >= CAP_ALIGN:
            self._per_token[classes] = seconds / prefilled
            if self.cost is not None and prefilled >= ALIGN:
                forward = seconds - (self.decode_step if decoding else 0.0) - self.cost.fixed
                if forward > 0:
                    self._marginal[classes] = forward / prefilled
                    if context is not None and prefilled >= FIRST_CHUNK * max(1, prefilling):
                        # (smaller chunks: their fixed part, estimated, weighs too much)
                        attended = context + prefilled / max(1, prefilling) / 2
                        points = self._points.setdefault(classes, [])
                        points.append((attended, forward / prefilled))
                        del points[:-POINTS]

    def _context_cost(self, classes: tuple) -> Optional[tuple[float, float]]:
        """``(a, b)``: a prompt token attending to ``c`` tokens costs about ``a + b c``
        seconds (marginal: the forward's fixed part and the decode step taken out): the
        least-squares line through the last :data:`POINTS` chunks timed for ``classes``
        (a slope of at least 0) when their contexts span :data:`SPREAD` tokens or more
        (two chunks close together give a slope that is mostly noise), else the line
        through the last one and the load's cost per token at an empty context; None
        before any, or without a load-time cost."""
        points = self._points.get(classes)
        if not points or self.cost is None:
            return None
        cs = [c for c, _ in points]
        if max(cs) - min(cs) >= SPREAD:
            mean_c, mean_m = sum(cs) / len(cs), sum(m for _, m in points) / len(points)
            b = max(0.0, sum((c - mean_c) * (m - mean_m) for c, m in points) / sum((c - mean_c) ** 2 for c in cs))
            return max(0.0, mean_m - b * mean_c), b
        c, m = points[-1]
        b = max(0.0, (m - self.cost.per_token) / c) if c > 0 else 0.0
        return max(0.0, m - b * c), b

    def _fitting(self, prefilling: int, seconds: float, context: float, a: float, b: float, decoding: bool) -> int:
        """Tokens per prompt whose step takes about ``seconds``: the forward's fixed part
        and, beside decoding rows, a decode step, plus ``prefilling`` prompts of ``n``
        tokens at ``a + b (context + n / 2)`` each: the root of ``P b / 2 n^2 + P (a + b
        context) n = seconds - fixed``."""
        left = seconds - self.cost.fixed - (self.decode_step if decoding else 0.0)
        if left <= 0:
            return 0
        quadratic, linear = prefilling * b / 2, prefilling * (a + b * context)
        if quadratic <= 0:
            return int(left / linear) if linear > 0 else self.step_size
        return int((-linear + math.sqrt(linear * linear + 4 * quadratic * left)) / (2 * quadratic))
