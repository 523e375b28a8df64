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
from contextlib import contextmanager, nullcontext
from typing import Optional

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, PromptProcessingBatch
from mlx_lm.models.cache import BatchKVCache

from cache.restore import layer_bytes
from scheduler.batch.decode_batch import DecodingState, JoiningGenerationBatch
from scheduler.batch_merge import grow, settle


# A finished prompt whose cache holds at least this many times the tokens of the decode
# batch's longest row takes its first token from a forward of its own before it joins
# (JoiningBatchGenerator._join_apart): joined as it is, it would widen every row's cache
# to its length (left padding) in the step that computes its first token.
APART_WIDTH = 4


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


@contextmanager
def _finalized_after(caches: list):
    """mlx-lm's ``PromptProcessingBatch.prompt`` rolls the right padding of chunks of unequal
    lengths back (``finalize``) in every layer, then evaluates them at once: every layer's
    rolled copy beside its old buffer. Here each layer rolls after the prompt, a layer at a
    time (:func:`settle`): two rows of 501 tokens of the tests' tiny model took 0.55 MB
    beside their 1 MB of KV rolled at once, 0.02 MB a layer at a time."""
    rolled = [c for c in caches if hasattr(c, "finalize")]
    for c in rolled:
        c.finalize = lambda: None
    try:
        yield
    finally:
        for c in rolled:
            del c.finalize
    for c in rolled:
        c.finalize()
    settle(caches)


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

    A prompt much longer than every decoding row (:data:`APART_WIDTH` times their longest
    cache or more) joins apart instead (:meth:`_join_apart`): a forward of its own gives
    its first token, reported at once, and the decoding rows skip that step; the merge
    into their batch, which widens every row's cache to the prompt's length, is left to
    the next step's forward. Its first token then waits for neither the merge nor a
    forward of the widened batch: on the medium benchmark model (2-core CPU) the step
    joining a 3,000-token prompt beside four decoding streams took 29-51 ms (five traced
    runs), the prompt's own last-token forward 7-9 ms. The other rows wait for that forward
    once. SGLang and vLLM likewise sample a prompt's first token from its own last prefill
    forward, and mlx-lm from a forward of the joining rows alone.

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
    joins_apart = True  # long prompts may join apart (_join_apart); not where ranks run every forward in step

    def __init__(self, model, speculator=None, **kwargs):
        super().__init__(model, **kwargs)
        self._generation_batch = self.generation_batch_class.empty(self.model, self.sampler)
        self._generation_batch.speculator = speculator
        self.hold_decode = False  # the next steps skip the decode forward (set per step by the batch)
        # A request's prompt prefills in chunks beside the decode batch (set per step by the
        # batch): decode steps verify no drafts, since a verify step's extra time is the prompt's.
        self.prompts_waiting = False
        # Rows that joined apart this step (_join_apart): their first tokens' responses, and
        # their caches as their own forward left them, for extract_cache until the next step.
        self._apart_responses: Optional[list] = None
        self._apart_caches: dict[int, tuple] = {}
        # The adapter selection of a batch's forwards (scheduler.lora.rows_hook; set by the batch).
        self.adapter_rows = lambda batch: nullcontext()

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

    def extract_cache(self, uids):
        """mlx-lm's, except that a row that joined apart this step gives the cache its own
        forward left (its prompt exactly), not a slice of the merge into the decode batch,
        which the next step's forward computes."""
        apart = {uid: self._apart_caches[uid] for uid in uids if uid in self._apart_caches}
        rest = [uid for uid in uids if uid not in apart]
        found = super().extract_cache(rest) if rest else {}
        found.update(apart)
        return found

    def _next(self):
        prompt_responses: list = []
        generation_responses: list = []
        gen = self._generation_batch
        self._apart_responses, self._apart_caches = None, {}
        if (self._unprocessed_sequences or self._currently_processing) and len(gen) < self.completion_batch_size:
            prompt_responses += self._admit()
            prompt_responses += self._join_finished_prompts()
        if self._apart_responses is not None:  # this step's forward was the joining rows' own
            generation_responses = self._apart_responses
        elif len(gen) > 0 and not self.hold_decode:
            gen.prompts_waiting = self.prompts_waiting
            tic = time.perf_counter()
            with self.adapter_rows(gen):
                generation_responses = gen.next()
            self._counters.decode_time += time.perf_counter() - tic
            self._counters.generation_steps += 1
            if self._counters.generation_steps % 512 == 0:
                mx.clear_cache()
        self._counters.generation_tokens += len(generation_responses)
        if self._currently_processing and len(gen) < self.completion_batch_size:
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
            settle(self._prompt_batch.prompt_cache)  # the merge, a layer at a time
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
        last_tokens = [seq[0][0][0] for seq in rows]
        if self._joins_apart_now(moving.tokens):
            self._join_apart(moving, last_tokens)
        else:
            self._generation_batch.join(moving.uids, moving.prompt_cache, last_tokens, moving.tokens, moving.samplers,
                                        moving.logits_processors, moving.stop_sequences, moving.max_tokens)
        make_room(self._generation_batch.prompt_cache, 0)  # the prompt batch's caches may be the decode batch's now
        return [PromptProcessingBatch.Response(uid, (seq[2], seq[2]), True, True)
                for uid, seq in zip(moving.uids, rows)]

    def _joins_apart_now(self, tokens: list) -> bool:
        """Rows whose caches hold ``tokens`` join apart (:meth:`_join_apart`): rows decode,
        this step decodes them, and the longest joining cache is :data:`APART_WIDTH` times
        their longest or more."""
        gen = self._generation_batch
        if not self.joins_apart or self.hold_decode or not gen.uids or not tokens:
            return False
        return max(len(t) for t in tokens) >= APART_WIDTH * max(1, max(len(t) for t in gen.tokens))

    def _join_apart(self, moving, last_tokens: list[int]) -> None:
        """The rows of ``moving`` (a prompt batch whose rows have only their last token
        left) decode once in a batch of their own: its forward samples their first tokens,
        reported this step (:attr:`_apart_responses`; the decoding rows skip the step).
        Then they are put into the decode batch, whose next forward merges them in; a row
        stopped by its first token leaves instead, with its cache."""
        apart = self.generation_batch_class.empty(self.model, self.sampler)
        apart.join(moving.uids, moving.prompt_cache, last_tokens, moving.tokens, moving.samplers,
                   moving.logits_processors, moving.stop_sequences, moving.max_tokens)
        with self.adapter_rows(apart):
            self._apart_responses = apart.plain_next()
        uids = list(apart.uids)
        states = [apart.take(0) for _ in uids]
        self._apart_caches = {uid: (state.cache, state.tokens) for uid, state in zip(uids, states)}
        if states:
            self._generation_batch.put(uids, states)

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
            caches = self._prompt_batch.prompt_cache
            grow(caches, max(len(p) for p in prompts))
            with self.adapter_rows(self._prompt_batch), _finalized_after(caches):
                self._prompt_batch.prompt(prompts)
            self._counters.prompt_time += time.perf_counter() - tic
        return responses
