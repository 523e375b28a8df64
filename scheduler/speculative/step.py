"""The speculative decode step over :class:`scheduler.batch.decode_batch.JoiningGenerationBatch`.

Each step (:meth:`Speculator.next`):

1. waits for the rows' pending input tokens (the ones sampled last step), since drafts
   follow them (plain decoding overlaps this wait with building the next step's graph);
2. asks its drafter for up to ``K`` tokens for each row that may draft (prompt lookup,
   :mod:`.lookup`, or a draft model, :mod:`.draft_model`): not a row's first step, not
   rows whose acceptance rate is cooling down; a row's grammar cuts its draft at the first
   token it forbids (:mod:`scheduler.speculative.processors`);
3. picks the step's width ``W`` (:func:`~scheduler.speculative.acceptance.best_width`);
   ``W = 1`` is a plain step (mlx-lm's);
4. else runs one forward ``[B, W]`` (each row's input token, its drafts, then filler),
   applies each row's logits processors (penalties, ``logit_bias``, grammar, thinking
   budget) at every position it verifies, verifies every row
   (:mod:`scheduler.speculative.verify`), takes each row's rejected positions back out of
   the cache (holes in full-attention layers,
   :class:`~scheduler.speculative.holes.HoledKVCache`; a replay of the kept tokens for
   recurrent and window layers, :mod:`scheduler.speculative.rewind`) and out of its
   processors' state, and reports the input token and the accepted drafts, in order,
   with their log-probs.
   The token after them is the row's next input, as in plain decoding.

A row that finishes on an accepted draft (EOS, ``max_tokens``) leaves with the cache and
tokens up to that token, exactly what plain decoding would have left.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from mlx_lm.sample_utils import greedy_sampler

from scheduler.sampling import TemperatureSampler, greedy
from scheduler.speculative.acceptance import BatchAcceptance, RealizedRate, RowAcceptance, StepCost, best_width
from scheduler.speculative.config import SpeculationConfig, rollback_refusal
from scheduler.speculative.draft_model import ModelDrafter
from scheduler.speculative.lookup import LookupDrafter
from scheduler.speculative.processors import apply_along, draftable, grammar_prefix, rewind
from scheduler.speculative.rewind import Rewind, holed, needs_replay, replay, take_back
from scheduler.speculative.verify import accept_greedy, accept_sampled


log = logging.getLogger(__name__)

PLAIN_SAMPLE = 8  # one plain step in this many is timed (waiting for it costs its overlap)
GREEDY = (None, greedy, greedy_sampler)  # argmax samplers (ours, mlx-lm's; None: the batch's default)


def _greedy(sampler) -> bool:
    return any(sampler is g for g in GREEDY)


@dataclass
class SpeculationStats:
    """Counts since start (tokens unless noted): drafted and accepted tokens, and decode
    steps by kind (``verify_steps`` are the ``[B, W > 1]`` ones)."""

    drafted: int = 0
    accepted: int = 0
    plain_steps: int = 0
    verify_steps: int = 0
    ended_inside_draft: int = 0  # rows that stopped before the last of their accepted drafts
    replays: int = 0  # verify steps whose recurrent or window layers were fed the kept tokens again
    draft_restored: int = 0  # draft-model tokens rows joining the draft batch took from the prefix cache
    draft_prefilled: int = 0  # draft-model tokens rows joining the draft batch prefilled


class Speculator:
    """Drafting, verification and rollback for one decode batch (engine thread only).

    Args:
        config: the method and ``K``.
        stats: where counts go (shared with the engine's other statistics).
        on_verify: called after each verify step with ``(drafted, accepted, width)``
            (metrics).
        snapshots: for ``"draft"``, where the draft model's rows are stored and restored
            (:class:`~scheduler.speculative.draft_snapshots.DraftSnapshots`), if anywhere.
    """

    def __init__(self, config: SpeculationConfig, stats: Optional[SpeculationStats] = None, on_verify=None,
                 snapshots=None):
        self.config = config
        self.stats = stats or SpeculationStats()
        self.cost = StepCost(draft=config.draft.relative_cost if config.draft is not None else 0.0)
        self.realized = RealizedRate()
        self._on_verify = on_verify
        if config.method == "draft":
            self.drafter = ModelDrafter(config.draft, snapshots, self.stats)
        else:
            self.drafter = LookupDrafter(config.min_n, config.max_n)
        self._acceptance: dict[int, RowAcceptance] = {}
        self._overall = BatchAcceptance()
        # drafts found but not verified (a plain step paid more): uid -> (index in the row's
        # tokens where the draft would have gone, the draft), scored as the row goes on
        self._unverified: dict[int, tuple[int, list[int]]] = {}
        # why the model's layers cannot roll back ("" if they can; None: not checked yet)
        self.refusal: Optional[str] = "" if config.rollback_checked else None

    # ----------------------------------------------------------------- per row
    def _rate(self, uid: int) -> RowAcceptance:
        rate = self._acceptance.get(uid)
        if rate is None:
            # prompt lookup drafts only where a row's text repeats, so each row starts afresh;
            # a draft model drafts for every row, so new rows start from what recent rows accepted
            rate = self._acceptance[uid] = self._overall.new_row() if self.drafter.costly else RowAcceptance()
        return rate

    def forget(self, uids: list[int]) -> None:
        """The batch's rows are now ``uids``: the others left (their draft rows, if any, are
        stored as they leave)."""
        for by_row in (self._acceptance, self._unverified):
            if len(by_row) > len(uids):
                live = set(uids)
                for uid in [u for u in by_row if u not in live]:
                    del by_row[uid]
        self.drafter.forget(uids)

    def _hold_unverified(self, batch, drafts: list[list[int]]) -> None:
        """Keep the drafts of a step that ran plain (no width paid) to score them later
        (:meth:`_score_unverified`). A draft follows the row's pending input token, which
        the step appends to ``batch.tokens[i]`` (the tokens in its cache), so it would
        start one past the row's current length."""
        for i, (uid, draft) in enumerate(zip(batch.uids, drafts)):
            if draft and uid not in self._unverified:
                self._unverified[uid] = (len(batch.tokens[i]) + 1, draft)

    def _score_unverified(self, batch) -> None:
        """Score held drafts against the tokens their rows went on to decode, once these
        settle them (a token differs, or the whole draft was decoded), into the rows'
        acceptance. For a greedy row this is exactly what verifying them would have
        accepted (a draft token is accepted when it is the argmax, the token decoded); for
        a sampled row its expectation (a fixed draft token is accepted with its
        probability). It costs no forward; without it a row whose rate fell to where no
        width pays, but not low enough to cool down, would never draft again, however
        much its text came to repeat (a loop after a few wrong guesses)."""
        for i, uid in enumerate(batch.uids):
            held = self._unverified.get(uid)
            if held is None:
                continue
            start, draft = held
            decoded = batch.tokens[i][start:start + len(draft)]
            right = next((j for j, (d, t) in enumerate(zip(draft, decoded)) if d != t), len(decoded))
            if right < len(decoded) or len(decoded) == len(draft):
                self._rate(uid).record(len(draft), right)
                del self._unverified[uid]

    def _may_draft(self, batch, i: int) -> bool:
        """Row ``i`` may draft this step, and its drafter expects to find a draft."""
        if batch._fresh[i] or not draftable(batch.logits_processors[i] or []):
            return False
        sampler = batch.samplers[i]
        if not _greedy(sampler):
            inner = getattr(sampler, "inner", sampler)
            # a seeded row keeps its draws independent of the batch: it takes one key per
            # token, which verifying a draft (a uniform draw, then a token) would not
            if not isinstance(inner, TemperatureSampler) or inner.seeded:
                return False
        if batch.max_tokens[i] - batch._num_tokens[i] <= 2 or not self._rate(batch.uids[i]).may_draft():
            return False
        return self.drafter.hint(batch, i)

    def _drafts(self, batch, candidates: list[bool], inputs: list[int], k: int) -> list[list[int]]:
        """Per row, up to ``k`` drafts (room left for them), cut by the row's grammar."""
        rooms = [min(m - n - 2, k) for m, n in zip(batch.max_tokens, batch._num_tokens)]
        drafts = self.drafter.propose(batch, candidates, inputs, rooms)
        for i, (token, draft) in enumerate(zip(inputs, drafts)):
            processors = batch.logits_processors[i]
            if processors and draft:
                drafts[i] = draft[:grammar_prefix(processors, token, draft)]
                if not drafts[i]:  # none the grammar allows: as a rejected draft, or it would never stop
                    self._rate(batch.uids[i]).record(len(draft), 0)
        return drafts

    # ----------------------------------------------------------------- the step
    def next(self, batch) -> list:
        """One decode step of ``batch`` (a ``JoiningGenerationBatch``), speculative when
        drafts pay; returns its ``GenerationBatch.Response`` s (several per row when
        drafts were accepted, in order).

        A step where no row's tokens suggest a draft is mlx-lm's plain step, pipelined as
        usual: only steps that may draft wait for the rows' pending tokens first. So is
        every step while a request's prompt prefills in chunks beside the batch
        (``batch.prompts_waiting``): the chunk planner gives the decoding rows a share of
        the prompt's time, and a verify step, wider, spends that share on drafts. On the
        medium benchmark model, a 3,000-token prompt beside four streams whose answers
        loop reached its first token at 1.25-1.35x its time alone with verify steps there
        and 1.19-1.21x without (four runs each), the streams' median gap 1.74x theirs
        alone against 1.31x.
        """
        if not batch.uids:
            return []
        self.forget(batch.uids)
        if self._unverified:
            self._score_unverified(batch)
        if batch.prompts_waiting:  # a prompt waits for this step: no verify step's extra time
            return self._plain(batch, timed=False)
        start = time.perf_counter()
        size = len(batch.uids)
        candidates = [self._may_draft(batch, i) for i in range(size)]
        if not any(candidates) or not self._rolls_back(batch) or self.realized.paused(size):
            return self._plain(batch, timed=self.stats.plain_steps % PLAIN_SAMPLE == 0, start=start)
        probe = self.realized.probe(size)  # the plain rate to compare with, while every row drafts
        if probe is not None:
            return self._plain(batch, timed=False, start=start if probe else None)
        rows = [self._rate(uid) for uid in batch.uids]
        k = self.config.num_draft_tokens
        beta = self.cost.beta_at(size)
        if self.drafter.costly:
            # drafting costs forwards of the draft model: decide the width before paying for it
            planned = best_width([k if c else 0 for c in candidates], rows, beta + self.cost.draft)
            if planned == 1:  # still a plain, pipelined step, as when no row may draft
                return self._plain(batch, timed=self.stats.plain_steps % PLAIN_SAMPLE == 0, start=start)
            k = planned - 1
        mx.eval(batch._next_tokens)
        inputs = batch._next_tokens.tolist()
        drafts = self._drafts(batch, candidates, inputs, k)
        width = best_width([len(d) for d in drafts], rows, lambda w: self.cost.relative(size, w))
        if width == 1:  # no draft pays: a plain step, its forward not waited for unless sampled
            self.drafter.settle(batch.uids, [0] * len(inputs))
            self._hold_unverified(batch, drafts)
            return self._plain(batch, timed=self.stats.plain_steps % PLAIN_SAMPLE == 0)
        tic = time.perf_counter()
        batch.prompt_cache = holed(batch.prompt_cache)
        responses = self._verify(batch, inputs, [d[: width - 1] for d in drafts], width)
        end = time.perf_counter()
        self.cost.wide(len(inputs), width, end - tic, self.drafter.forward_seconds)
        self.realized.record("verify", size, len(responses), end - start)
        return responses

    def _rolls_back(self, batch) -> bool:
        """Whether a rejected draft can be taken back out of every layer of the batch's
        model: checked once, on the model itself, when it has recurrent or sliding-window
        layers (:func:`~scheduler.speculative.config.rollback_refusal`), unless the loader
        did; if not, every step stays plain."""
        if self.refusal is None:
            self.refusal = rollback_refusal(batch.model) or ""
            if self.refusal:
                log.warning("speculative decoding is off: %s", self.refusal)
        return not self.refusal

    def _plain(self, batch, timed: bool, start: Optional[float] = None) -> list:
        """mlx-lm's step; ``timed``: wait for its forward and time it (the cost model);
        ``start``: when the step began, for its delivered rate (:class:`RealizedRate`) when
        it was not made to wait."""
        tic = time.perf_counter()
        rows = len(batch.uids)
        responses = batch.plain_next()
        if timed and batch._next_tokens is not None:
            mx.eval(batch._next_tokens)
            self.cost.plain(rows, time.perf_counter() - tic)
        elif start is not None:
            self.realized.record("plain", rows, len(responses), time.perf_counter() - start)
        self.stats.plain_steps += 1
        return responses

    def _logprobs(self, batch, inputs: mx.array, drafts: list[list[int]]) -> mx.array:
        """The forward ``[B, W] -> [B, W, V]`` log-probabilities, each row's logits
        processors applied at its input and draft positions (the rest is filler)."""
        logits = batch.model(inputs, cache=batch.prompt_cache)
        if any(batch.logits_processors):
            rows = []
            for e, processors in enumerate(batch.logits_processors):
                row = logits[e]
                if processors:
                    context = batch._token_context[e]
                    context.update_and_fetch(inputs[e, :1])
                    k = len(drafts[e])
                    row = mx.concatenate([apply_along(processors, context, row[: k + 1], drafts[e]), row[k + 1:]])
                rows.append(row)
            logits = mx.stack(rows)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def _verify(self, batch, inputs: list[int], drafts: list[list[int]], width: int) -> list:
        grid = [[t, *d, *[t] * (width - 1 - len(d))] for t, d in zip(inputs, drafts)]
        fed = [1 + len(d) for d in drafts]  # each row's real positions in the forward
        saved = Rewind(batch.prompt_cache)  # recurrent and window layers: saved, then padded
        saved.pad(fed, width)
        logprobs = self._logprobs(batch, mx.array(grid, dtype=mx.uint32), drafts)  # [B, W, V]
        saved.unpad()
        targets = mx.argmax(logprobs, axis=-1)
        mx.eval(targets, logprobs)
        targets = targets.tolist()
        accepted, following = [], []
        for i, d in enumerate(drafts):
            sampler = batch.samplers[i]
            if _greedy(sampler):
                a = accept_greedy(targets[i], d)
                accepted.append(a)
                following.append(targets[i][a])
            elif d:
                try:
                    a, token = accept_sampled(getattr(sampler, "inner", sampler), logprobs[i, : len(d) + 1], d)
                except Exception:  # as a plain step: the row's guarded sampler records the fault
                    a, token = 0, int(sampler(logprobs[i, 0:1]).item())
                accepted.append(a)
                following.append(token)
            else:
                accepted.append(0)
                following.append(int(sampler(logprobs[i, 0:1]).item()))
        self.drafter.settle(batch.uids, accepted)
        previous = batch._next_logprobs
        batch._next_tokens = mx.array(following, dtype=mx.uint32)
        batch._next_logprobs = [logprobs[i, a] for i, a in enumerate(accepted)]
        for i, (t, d, a) in enumerate(zip(inputs, drafts, accepted)):
            batch.tokens[i].extend([t, *d[:a]])
            if d:
                self._rate(batch.uids[i]).record(len(d), a)
                self._overall.record(len(d), a)
                if batch.logits_processors[i]:
                    rewind(batch.logits_processors[i], batch._token_context[i], len(d) - a)
        drafted = sum(len(d) for d in drafts)
        self.stats.drafted += drafted
        self.stats.accepted += sum(accepted)
        self.stats.verify_steps += 1
        if self._on_verify is not None:
            self._on_verify(drafted, sum(accepted), width)
        outcomes = self._outcomes(batch, inputs, drafts, accepted, previous, logprobs)
        kept = [1 + a - extra for a, (_, _, extra) in zip(accepted, outcomes)]
        self._roll_back(batch, saved, [[t, *d[: k - 1]] for t, d, k in zip(inputs, drafts, kept)], fed, width)
        return self._respond(batch, outcomes)

    def _roll_back(self, batch, saved: Rewind, kept: list[list[int]], fed: list[int], width: int) -> None:
        """Leave each row's cache holding exactly the tokens ``kept[b]`` of this step
        (its input and the drafts it keeps; fewer when it ends inside its draft), out of
        the ``width`` positions written (``fed[b]`` of them real)."""
        counts = [len(k) for k in kept]
        if needs_replay(saved, fed, counts):
            replay(batch.model, batch.prompt_cache, saved, kept, width)
            self.stats.replays += 1
            return
        take_back(batch.prompt_cache, [width - n for n in counts])

    def _outcomes(self, batch, inputs, drafts, accepted, previous, logprobs) -> list:
        """Per row, what this step reports: its (token, logprob) pairs (the input token
        unless reported already, then the accepted drafts, then a fresh row's first
        token), cut after the one that finishes it; the finish reason (None: it goes
        on); and how many of the step's cached positions come after that token."""
        fresh, batch._fresh = batch._fresh, [False] * len(batch.uids)
        ahead, batch._ahead = batch._ahead, [False] * len(batch.uids)
        outcomes = []
        for i in range(len(batch.uids)):
            out = [] if (ahead[i] or fresh[i]) else [(inputs[i], previous[i])]
            out += [(drafts[i][j], logprobs[i, j]) for j in range(accepted[i])]
            if fresh[i] and batch._num_tokens[i] + 1 < batch.max_tokens[i]:
                # a row's first token is reported as soon as it is known (as in plain steps)
                out.append((int(batch._next_tokens[i].item()), batch._next_logprobs[i]))
                batch._ahead[i] = True
            finish, extra = None, 0
            for n, (token, _) in enumerate(out, start=1):
                batch._num_tokens[i] += 1
                if batch._num_tokens[i] >= batch.max_tokens[i]:
                    finish = "length"
                if batch._matchers[i].advance(token):
                    finish = "stop"
                if finish is not None:
                    # cached tokens after this one (out's last token may be the pending one)
                    extra = max(0, len(out) - n - (1 if batch._ahead[i] else 0))
                    out = out[:n]
                    break
            outcomes.append((out, finish, extra))
        return outcomes

    def _respond(self, batch, outcomes: list) -> list:
        """The step's responses; rows that finish leave the batch with their cache (rolled
        back to their last token already) and tokens."""
        keep, responses = [], []
        for i, (uid, (out, finish, extra)) in enumerate(zip(batch.uids, outcomes)):
            for token, lp in out if finish is None else out[:-1]:
                responses.append(batch.Response(uid, token, lp, None, None, None))
            if finish is None:
                keep.append(i)
                continue
            tokens = batch.tokens[i]
            if extra:
                self.stats.ended_inside_draft += 1
                tokens = tokens[: len(tokens) - extra]
            token, lp = out[-1]
            responses.append(batch.Response(uid, token, lp, finish, batch.leaving_cache(i), tokens))
        if len(keep) < len(batch.uids):
            batch.filter(keep)
        return responses
