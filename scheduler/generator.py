"""mlx-lm's ``BatchGenerator`` with rows that join the decode forward.

mlx-lm moves a row from prompt processing to decoding by copying the prompt batch
(``PromptProcessingBatch.split`` deep-copies every row's cache), running a forward of
its own for the rows' last prompt token (``GenerationBatch.__init__``), then
concatenating their caches onto the decode batch. On a warm hit, where all but one
prompt token is cached, that extra forward and those copies are most of the time to
first token (issue 13's per-phase breakdown: ``first_decode``).

:class:`JoiningBatchGenerator` instead adds such rows to the decode batch *before* its
step, with their last prompt token as their input: the step's forward computes their
first token together with everyone else's next one, and that step reports it. A row
inserted with only that token left (a prefix-cache hit of ``len - 1`` tokens) never
enters the prompt batch; a whole prompt batch that finishes together is moved, not
copied. The last prompt token is fed once, through the same model call, in a
left-padded batch like every other decode step; since that batch is the decode batch
rather than the joining rows alone, logprobs agree with mlx-lm's within 1e-4 rather
than bit for bit (``tests/test_generator.py`` checks tokens and logprobs per
architecture).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch, _extend_cache
from mlx_lm.models.cache import BatchKVCache, TokenBuffer

from cache.restore import layer_bytes
from scheduler.batch_merge import extend_with_rows, merge_with_room


@dataclass
class DecodingState:
    """A decoding row taken out of the decode batch between two steps
    (:meth:`JoiningBatchGenerator.take_decoding`), to be put back as it was
    (:meth:`JoiningBatchGenerator.put_decoding`): its cache (one per layer, covering
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


INT32_LIMIT = 1 << 31


def context_tokens(model, tokens: list[int]) -> list[int]:
    """``tokens`` as the logits processors' context (int32, mlx-lm's ``TokenBuffer``): a
    vision model's image positions (ids far above any vocabulary) become its image
    placeholder token (``model.image_token_id``), as in the prompt its processor made."""
    if not tokens or max(tokens) < INT32_LIMIT:
        return tokens
    placeholder = getattr(model, "image_token_id", 0)
    return [t if t < INT32_LIMIT else placeholder for t in tokens]


def _last_token_only(segments: list[list[int]]) -> bool:
    """A row's remaining prompt segments are just its last token."""
    return len(segments) == 1 and len(segments[0]) == 1


def make_room(caches: list, tokens: int) -> None:
    """Let each plain KV layer cache of ``caches`` (mlx-lm's ``BatchKVCache``; other kinds
    are left alone) take ``tokens`` more at its next growth, rounded up to its usual step.

    mlx-lm grows a KV cache by 256 tokens' room at a time, copying what it holds into the
    new buffer each time a chunk does not fit: a prompt prefilled in chunks beside decoding
    rows copied its cache at nearly every chunk. Given its whole prompt's room at once it
    copies it once. Measured on the 2-core CPU (cache updates alone, MLX's own timing):
    the medium benchmark model's shapes (6 layers, 4 KV heads of 32), 3,000 tokens in
    five chunks: 28-47 ms, 15 ms with room made; the default model's (30 layers, 3 KV
    heads of 64), 30,000 tokens in 2,048-token chunks: 2.5-6.6 s, 0.4-0.8 s.
    ``tokens`` of 0 gives the caches back their usual step (a decoding batch grows 256 at
    a time again).
    """
    for c in caches:
        if type(c) is BatchKVCache:
            usual = BatchKVCache.step
            c.step = max(usual, -(-tokens // usual) * usual)


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
        self.uids.extend(uids)
        self.prompt_cache = (extend_with_rows(self.prompt_cache, caches) if rows
                             else _extend_cache(self.prompt_cache, caches))
        self.tokens.extend(tokens)
        self.samplers.extend(samplers)
        self.logits_processors.extend(logits_processors)
        self.stop_sequences.extend(stop_sequences)
        self.max_tokens.extend(max_tokens)
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
        state = DecodingState(
            cache=self.extract_cache(i), tokens=list(self.tokens[i]), pending=self._next_tokens[i:i + 1],
            logprobs=self._next_logprobs[i], reported=self._ahead[i], fresh=self._fresh[i],
            sampler=self.samplers[i], processors=self.logits_processors[i], stop=self.stop_sequences[i],
            matcher=self._matchers[i],
            context=self._token_context[i], max_tokens=self.max_tokens[i], num_tokens=self._num_tokens[i])
        self.filter([j for j in range(len(self.uids)) if j != i])
        return state

    def put(self, uids: list[int], states: list[DecodingState]) -> None:
        """Put rows taken by :meth:`take` (or made as such, :mod:`scheduler.first_tokens`)
        back under ``uids``, their caches merged in one copy: each one's next step feeds
        its pending token, as the step it missed would have."""
        # the merge first: if it raises, the batch's lists are as they were
        self.prompt_cache = extend_with_rows(self.prompt_cache, [s.cache for s in states])
        self.uids.extend(uids)
        pending = self._next_tokens
        for state in states:
            self.tokens.append(state.tokens)
            self.samplers.append(state.sampler)
            self.logits_processors.append(state.processors)
            self.stop_sequences.append(state.stop)
            self.max_tokens.append(state.max_tokens)
            pending = (state.pending if pending is None or pending.size == 0
                       else mx.concatenate([pending, state.pending.astype(pending.dtype)]))
            self._next_logprobs.append(state.logprobs)
            self._token_context.append(state.context)
            self._num_tokens.append(state.num_tokens)
            self._matchers.append(state.matcher)
            self._fresh.append(state.fresh)
            self._ahead.append(state.reported)
        self._next_tokens = pending

    def filter(self, keep):
        super().filter(keep)
        self._fresh = [self._fresh[i] for i in keep]
        self._ahead = [self._ahead[i] for i in keep]
        if self.speculator is not None:  # a draft model's rows leave with theirs
            self.speculator.forget(self.uids)

    def next(self):
        """One decode step: the speculator's when one is set, else :meth:`plain_next`."""
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
        early = [f and self._num_tokens[i] + 1 < self.max_tokens[i] for i, f in enumerate(fresh)]
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
        for i, uid in enumerate(self.uids):
            if ahead[i] or fresh[i]:  # reported already, or nothing to report yet
                keep.append(i)
                continue
            self._num_tokens[i] += 1
            finish = "length" if self._num_tokens[i] >= self.max_tokens[i] else None
            if self._matchers[i].advance(tokens[i]):
                finish = "stop"
            if finish is None:
                keep.append(i)
                responses.append(self.Response(uid, tokens[i], logprobs[i], None, None, None))
            else:
                responses.append(self.Response(uid, tokens[i], logprobs[i], finish, self.extract_cache(i),
                                               self.tokens[i]))
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses


class JoiningBatchGenerator(BatchGenerator):
    """mlx-lm's ``BatchGenerator`` (same constructor, ``insert_segments``, ``next``,
    ``remove``, ``extract_cache``) whose rows join the decode batch before its step.

    One step (:meth:`next`):

    1. admit waiting sequences: one with only its last prompt token left joins the decode
       batch directly; the others enter the prompt batch (mlx-lm's);
    2. prompt-batch rows with only their last token left join the decode batch (the
       whole prompt batch is moved when all of them do, else mlx-lm's split copies them);
    3. one decode step over every decoding row, the joined ones included;
    4. one prefill chunk (``prefill_step_size`` tokens at most per row) of the rest,
       cut at segment ends as in mlx-lm, if the decode batch has room (as in mlx-lm).

    With :attr:`hold_decode` set, step 3 is skipped: the decoding rows wait one step, their
    caches and pending tokens untouched, while a prompt of a better latency class prefills
    alone.

    A chunk runs only when the decode batch has room, and a step starts with the batch it
    ended with, so a row whose prompt is done always joins at the next step's start: no
    row ever waits in the prompt batch with only its last token left. Its end-of-prompt
    response comes in the step it joins, after the forward that fed that token (its cache
    then holds exactly its prompt, as ``Batch`` expects for snapshots), and so does its
    first token: that step waits for its forward instead of overlapping it with the next
    step's graph building (mlx-lm's pipelining), which would report the token a whole
    step later.
    """

    generation_batch_class = JoiningGenerationBatch  # the decode batch's class (scheduler.distributed)

    def __init__(self, model, speculator=None, **kwargs):
        super().__init__(model, **kwargs)
        self._generation_batch = self.generation_batch_class.empty(self.model, self.sampler)
        self._generation_batch.speculator = speculator
        self.hold_decode = False  # the next steps skip the decode forward (set per step by the batch)
        # A request's prompt prefills in chunks beside the decode batch (set per step by the
        # batch): decode steps verify no drafts, since a verify step's extra time is the prompt's.
        self.prompts_waiting = False

    def kv_bytes(self) -> int:
        """Bytes of the prompt and decode batch caches, a draft model's included
        (``.nbytes`` of each layer cache; nothing is evaluated)."""
        caches = [c for b in (self._prompt_batch, self._generation_batch) for c in getattr(b, "prompt_cache", None) or []]
        speculator = self._generation_batch.speculator
        return layer_bytes(caches) + (speculator.drafter.kv_bytes() if speculator is not None else 0)

    def take_decoding(self, uid: int) -> Optional[DecodingState]:
        """Take the decoding row ``uid`` out of the decode batch (between two steps), its
        state kept; None if it is not decoding."""
        gen = self._generation_batch
        if uid not in gen.uids:
            return None
        return gen.take(gen.uids.index(uid))

    def put_decoding(self, state: DecodingState) -> int:
        """Put a row taken by :meth:`take_decoding` back into the decode batch; its new uid."""
        return self.put_decoding_all([state])[0]

    def put_decoding_all(self, states: list[DecodingState]) -> list[int]:
        """Put rows taken by :meth:`take_decoding` (or made as such) into the decode batch,
        their caches merged in one copy; their new uids."""
        uids = list(range(self._uid_count, self._uid_count + len(states)))
        self._uid_count += len(states)
        self._generation_batch.put(uids, states)
        return uids

    def _next(self):
        prompt_responses: list = []
        generation_responses: list = []
        gen = self._generation_batch
        if len(gen) < self.completion_batch_size:
            prompt_responses += self._admit()
            prompt_responses += self._join_finished_prompts()
        if len(gen) > 0 and not self.hold_decode:
            gen.prompts_waiting = self.prompts_waiting
            tic = time.perf_counter()
            generation_responses = gen.next()
            self._counters.decode_time += time.perf_counter() - tic
            self._counters.generation_tokens += len(generation_responses)
            self._counters.generation_steps += 1
            if self._counters.generation_steps % 512 == 0:
                mx.clear_cache()
        if len(gen) < self.completion_batch_size:
            prompt_responses += self._prefill_chunk()
        return prompt_responses, generation_responses

    def _admit(self) -> list:
        """Move waiting sequences in: straight to the decode batch when only their last
        token is left, else to the prompt batch."""
        n = min(self.prefill_batch_size - len(self._prompt_batch),
                self.completion_batch_size - len(self._generation_batch),
                len(self._unprocessed_sequences))
        if n <= 0:
            return []
        taken = [self._unprocessed_sequences.popleft() for _ in range(n)]
        direct = [s for s in taken if _last_token_only(s[1])]
        to_prompt = [s for s in taken if not _last_token_only(s[1])]
        if to_prompt:
            self._unprocessed_sequences.extendleft(reversed(to_prompt))
            self._prompt_batch.extend(self._make_batch(len(to_prompt)))
            make_room(self._prompt_batch.prompt_cache, max(seq[2] - seq[1] for seq in self._currently_processing))
        if not direct:
            return []
        # (uid, segments, max_tokens, cache, tokens, sampler, processors, stop sequences)
        self._generation_batch.join(
            [s[0] for s in direct], [s[3] for s in direct], [s[1][0][0] for s in direct],
            [s[4] for s in direct], [s[5] for s in direct], [s[6] for s in direct], [s[7] for s in direct],
            [s[2] for s in direct], rows=True,
        )
        return [PromptProcessingBatch.Response(s[0], (1, 1), True, True) for s in direct]

    def _join_finished_prompts(self) -> list:
        """Prompt-batch rows with only their last token left join the decode batch."""
        done = [i for i, seq in enumerate(self._currently_processing) if _last_token_only(seq[0])]
        if not done:
            return []
        rows = [self._currently_processing[i] for i in done]
        if len(done) == len(self._prompt_batch):
            moving = self._prompt_batch
            self._prompt_batch = PromptProcessingBatch.empty(self.model, self.sampler,
                                                             prefill_step_size=moving.prefill_step_size)
        else:
            moving = self._prompt_batch.split(done)
        gone = set(done)
        self._currently_processing = [s for i, s in enumerate(self._currently_processing) if i not in gone]
        self._generation_batch.join(moving.uids, moving.prompt_cache, [seq[0][0][0] for seq in rows], moving.tokens,
                                    moving.samplers, moving.logits_processors, moving.stop_sequences,
                                    moving.max_tokens)
        make_room(self._generation_batch.prompt_cache, 0)  # the prompt batch's caches may be the decode batch's now
        return [PromptProcessingBatch.Response(uid, (seq[2], seq[2]), True, True)
                for uid, seq in zip(moving.uids, rows)]

    def _prefill_chunk(self) -> list:
        """One prefill chunk for every prompt-batch row, none crossing a segment end."""
        prompts, responses = [], []
        for uid, seq in zip(self._prompt_batch.uids, self._currently_processing):
            segments = seq[0]
            n = min(len(segments[0]), self.prefill_step_size)
            prompts.append(segments[0][:n])
            segments[0] = segments[0][n:]
            end_of_segment = not segments[0]
            if end_of_segment:
                segments.pop(0)
            seq[1] += n
            responses.append(PromptProcessingBatch.Response(uid, (seq[1], seq[2]), end_of_segment, False))
        if prompts:
            self._counters.prompt_tokens += sum(len(p) for p in prompts)
            tic = time.perf_counter()
            self._prompt_batch.prompt(prompts)
            self._counters.prompt_time += time.perf_counter() - tic
        return responses
