"""The decode batch of :class:`scheduler.batch.generator.JoiningBatchGenerator`: mlx-lm's
``GenerationBatch`` with rows that join it with their last prompt token as their input
(:meth:`JoiningGenerationBatch.join`), and rows taken out and put back between two steps
with their state (:class:`DecodingState`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.generate import GenerationBatch
from mlx_lm.models.cache import BatchKVCache, TokenBuffer

from compat.mlx_lm import extend_cache
from scheduler.batch_merge import extend_with_rows, grow, settle
from scheduler.logit_bias import folded_step


@dataclass
class DecodingState:
    """A decoding row taken out of the decode batch between two steps
    (:meth:`scheduler.batch.generator.JoiningBatchGenerator.take_decoding`), to be put back as it was
    (:meth:`~scheduler.batch.generator.JoiningBatchGenerator.put_decoding`): its cache (one per layer, covering
    ``tokens``), its pending input (the token sampled last, ``[1]``, not fed yet; its last
    prompt token if it has not decoded yet) with its logprobs and whether it was reported
    already, and its sampler, processors, stop
    matcher, token context and counts, which carry on unchanged (a seeded sampler's key
    chain, a grammar's state)."""

    cache: list
    tokens: list[int]
    pending: Any  # mx.array [1]
    logprobs: Any
    reported: bool
    fresh: bool  # its pending input is its last prompt token (it has not decoded yet)
    sampler: Any
    processors: list
    stop: Any
    matcher: Any
    context: Any
    max_tokens: int
    num_tokens: int


# The decode batch's per-row lists and the DecodingState field of each (take, put).
ROW_FIELDS = (("tokens", "tokens"), ("samplers", "sampler"), ("logits_processors", "processors"),
              ("stop_sequences", "stop"), ("max_tokens", "max_tokens"), ("_next_logprobs", "logprobs"),
              ("_token_context", "context"), ("_num_tokens", "num_tokens"), ("_matchers", "matcher"),
              ("_fresh", "fresh"), ("_ahead", "reported"))
INT32_LIMIT = 1 << 31


def context_tokens(model, tokens: list[int]) -> list[int]:
    """``tokens`` as the logits processors' context (int32, mlx-lm's ``TokenBuffer``): a
    vision model's image positions (ids far above any vocabulary) become its image
    placeholder token (``model.image_token_id``), as in the prompt its processor made."""
    if not tokens or max(tokens) < INT32_LIMIT:
        return tokens
    placeholder = getattr(model, "image_token_id", 0)
    return [t if t < INT32_LIMIT else placeholder for t in tokens]


def _cut_padding(c, keep: list[int]) -> None:
    """Drop the positions of a batch layer cache ``c`` (``[B, H, T, D]``, float, quantized or
    holed) that are left padding in every row of ``keep``, as a view: the gather of those
    rows that follows then copies only the positions they use."""
    if not isinstance(c, BatchKVCache) or c.keys is None:
        return
    cut = int(c.left_padding[mx.array(keep)].min().item())
    if cut > 0:
        c.keys, c.values = tree_map(lambda x: x[..., cut:, :], (c.keys, c.values))
        c._idx -= cut
        c.left_padding = c.left_padding - cut
        if getattr(c, "holes", None) is not None:
            c.holes = c.holes[:, cut:]


class JoiningGenerationBatch(GenerationBatch):
    """mlx-lm's decode batch, plus :meth:`join`: rows whose pending input is their last
    prompt token. The token such a row's first step samples is its first one, reported
    at the end of that step (see :meth:`next`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._fresh = [False] * len(self.uids)  # input is the last prompt token
        self._ahead = [False] * len(self.uids)  # input is a token already reported
        self.speculator = None  # a scheduler.speculative.step.Speculator: its steps may verify drafts
        self.prompts_waiting = False  # a request's prompt prefills beside this batch: steps stay plain
        self._leaving: list[list] = []  # caches of rows the next filter takes out (leaving_cache)

    @classmethod
    def empty(cls, model, fallback_sampler) -> "JoiningGenerationBatch":
        return cls(model=model, fallback_sampler=fallback_sampler, uids=[], inputs=mx.array([], dtype=mx.uint32),
                   prompt_cache=[], tokens=[], samplers=[], logits_processors=[], max_tokens=[], stop_sequences=[])

    def join(self, uids, caches: list, last_tokens: list[int], tokens, samplers, logits_processors,
             stop_sequences, max_tokens, rows: bool = False) -> None:
        """Add rows decoding from their last prompt token.

        Args:
            caches: per layer, the rows' batch cache (their prompt minus its last token);
                with ``rows``, per row, its list of layer caches instead
                (:func:`extend_with_rows` puts them in).
            last_tokens: each row's last prompt token, its input in the next step.
            tokens: each row's tokens in its cache (the context of logits processors).
            samplers, logits_processors, stop_sequences, max_tokens: per row, as in mlx-lm.
        """
        self._land()
        self.uids.extend(uids)
        self.prompt_cache = (extend_with_rows(self.prompt_cache, caches) if rows
                             else extend_cache(self.prompt_cache, caches))
        settle(self.prompt_cache)
        for (name, _), new in zip(ROW_FIELDS, (tokens, samplers, logits_processors, stop_sequences, max_tokens)):
            getattr(self, name).extend(new)  # (the first five of ROW_FIELDS)
        last = mx.array(last_tokens, dtype=mx.uint32)
        pending = self._next_tokens
        self._next_tokens = last if pending is None or pending.size == 0 else mx.concatenate([pending, last])
        self._next_logprobs.extend(mx.zeros((1,)) for _ in uids)  # not reported
        self._token_context.extend(TokenBuffer(context_tokens(self.model, t)) for t in tokens)
        self._num_tokens.extend(0 for _ in uids)
        self._matchers.extend(ss.matcher() for ss in stop_sequences)
        self._fresh.extend(True for _ in uids)
        self._ahead.extend(False for _ in uids)

    def take(self, i: int) -> DecodingState:
        """Take row ``i`` out of the batch (between two steps); see :class:`DecodingState`."""
        state = DecodingState(cache=self.leaving_cache(i), pending=self._next_tokens[i:i + 1],
                              **{field: getattr(self, name)[i] for name, field in ROW_FIELDS})
        state.tokens = list(state.tokens)
        self.filter([j for j in range(len(self.uids)) if j != i])
        return state

    def put(self, uids: list[int], states: list[DecodingState]) -> None:
        """Put rows taken by :meth:`take` (or made as such, :mod:`scheduler.batch.first_tokens`)
        back under ``uids``, their caches merged in one copy: each one's next step feeds
        its pending token, as the step it missed would have."""
        # the merge first: if it raises, the batch's lists are as they were
        self._land()
        self.prompt_cache = extend_with_rows(self.prompt_cache, [s.cache for s in states])
        settle(self.prompt_cache)
        pending = self._next_tokens
        for state in states:
            pending = (state.pending if pending is None or pending.size == 0
                       else mx.concatenate([pending, state.pending.astype(pending.dtype)]))
        self.uids.extend(uids)
        for name, field in ROW_FIELDS:
            getattr(self, name).extend(getattr(state, field) for state in states)
        self._next_tokens = pending

    def _land(self) -> None:
        """Wait for the step in flight (mlx-lm evaluates the next step asynchronously): it
        holds every layer's old buffer, which a copy made meanwhile would live beside."""
        if self._next_tokens is not None:
            mx.eval(self._next_tokens)

    def extract_cache(self, i: int) -> list:
        """mlx-lm's, evaluated: a lazy row is a view pinning the whole batch buffer
        ``[B, H, T, D]``, which would live on beside the copy the next :meth:`filter` makes."""
        row = super().extract_cache(i)
        settle(row)
        return row

    def leaving_cache(self, i: int) -> list:
        """Row ``i``'s cache (one per layer) as it leaves in the next :meth:`filter`, which
        copies it out with the rows kept, a layer at a time (:func:`settle`): copied out
        first (:meth:`extract_cache`), the rows finishing in one step lived whole beside the
        batch they were still in."""
        row = super().extract_cache(i)
        self._leaving.append(row)
        return row

    def filter(self, keep):
        """mlx-lm's, with the left padding the rows kept no longer need cut before the
        gather of their rows, not after it (mlx-lm cuts a view of the gathered buffer,
        which pins it whole, as long as the rows that left, until a step copies it), and
        the layers evaluated one after another (:func:`settle`) once the step in flight is
        done (:meth:`_land`)."""
        self._land()
        if keep:
            for c in self.prompt_cache:
                _cut_padding(c, keep)
        super().filter(keep)
        settle(self.prompt_cache, self._leaving)
        self._leaving = []
        self._fresh = [self._fresh[i] for i in keep]
        self._ahead = [self._ahead[i] for i in keep]
        if self.speculator is not None:  # a draft model's rows leave with theirs
            self.speculator.forget(self.uids)

    def _step(self):
        """mlx-lm's step, the rows' ``logit_bias`` added in one op (:func:`folded_step`)."""
        return folded_step(self, super()._step)

    def next(self):
        """One decode step: the speculator's when one is set, else :meth:`plain_next`; the
        caches grown first for its widest forward (:func:`~scheduler.batch_merge.grow`)."""
        grow(self.prompt_cache, 1 + (self.speculator.config.num_draft_tokens if self.speculator is not None else 0))
        if self.speculator is not None:
            return self.speculator.next(self)
        return self.plain_next()

    def plain_next(self):
        """One decode step. A fresh row (its input was its last prompt token) gets its
        first token reported at the end of this step, once the forward is done, rather than
        in the next step as mlx-lm's pipelining would; the next step then skips it.

        Returns:
            ``GenerationBatch.Response`` per reported row, with the finish reason and, for
            a finished row, its cache and tokens (the row leaves the batch). A row stopped
            by its first token leaves with its prompt's cache and tokens.
        """
        if not self.uids:
            return []
        fresh, self._fresh = self._fresh, [False] * len(self.uids)
        ahead, self._ahead = self._ahead, [False] * len(self.uids)
        tokens, logprobs = self._step()
        # Fresh rows with room for more than one token: wait for this step's forward and
        # report their first token now. (A one-token row still ends in the next step, with
        # its token in its cache, as in mlx-lm: precomputes rely on that.)
        early = [f and self._num_tokens[i] + 1 < self.max_tokens[i] for i, f in enumerate(fresh)] if True in fresh else ()
        if any(early):
            mx.eval(self._next_tokens, [lp for lp, e in zip(self._next_logprobs, early) if e])
            tokens, logprobs = list(tokens), list(logprobs)
            first = self._next_tokens.tolist()
            for i in range(len(self.uids)):
                if early[i]:
                    tokens[i], logprobs[i] = first[i], self._next_logprobs[i]
                    self._ahead[i] = True
                    fresh[i] = False
        keep, responses = [], []
        counts, limits, matchers, response = self._num_tokens, self.max_tokens, self._matchers, self.Response
        for i, uid in enumerate(self.uids):
            if ahead[i] or fresh[i]:  # reported already, or nothing to report yet
                keep.append(i)
                continue
            n = counts[i] = counts[i] + 1
            finish = "length" if n >= limits[i] else None
            if matchers[i].advance(tokens[i]):
                finish = "stop"
            if finish is None:
                keep.append(i)
                responses.append(response(uid, tokens[i], logprobs[i], None, None, None))
            else:
                responses.append(self.Response(uid, tokens[i], logprobs[i], finish, self.leaving_cache(i),
                                               self.tokens[i]))
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses
