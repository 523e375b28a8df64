"""Drafts from a small model of the same tokenizer (``--speculative draft``), its KV cache
kept in step with the decode batch's rows.

The draft model keeps its own batch of rows (:class:`ModelDrafter`): a
:class:`~scheduler.speculative.holes.HoledKVCache` per layer, ``[B_d, H, T, D]``, one row
per decoding row that has drafted, matched to the decode batch by uid.

- **Joining.** A row that may draft and is not in the draft batch starts from the
  longest prefix of its tokens stored in the prefix cache
  (:mod:`scheduler.speculative.draft_snapshots`), if any, and prefills the rest into a
  cache of its own, :data:`PREFILL_CHUNK` tokens per drafting step over all joining rows
  (the row with the fewest tokens left first), so a long context does not hold the other
  rows' decode step for its whole prefill. It drafts nothing until its cache holds all
  its tokens (it emits a few per step); then its cache is merged into the draft batch. A
  step where only joining rows want drafts runs no other draft forward.
- **Catching up.** A row's draft cache may lag its tokens: by the plain steps it took
  without drafting (cool-down, width 1, a step with no candidates, steps beside a prompt
  in prefill), and by one token after it accepted every draft (the last draft is never
  fed to the draft model). A row more than :data:`PREFILL_CHUNK` tokens behind leaves the
  draft batch with its cache and joins again, a chunk per step. A drafting
  step that finds rows behind starts with one forward ``[B_d, M]`` of every row's missing
  tokens, rows shorter than ``M`` filled at the end with positions that are then taken
  back as holes (they come after the row's real tokens, which never see them); only the
  cache is evaluated, so no ``[B_d, M, V]`` logits are computed.
- **Drafting.** A forward ``[B_d, 1]`` of each row's pending input gives the first draft
  (its argmax); ``K - 1`` more give the rest, greedily. A draft is deterministic, so speculative
  sampling's rule (accept ``d`` with probability ``p(d)``, :mod:`.verify`) keeps sampled
  rows' distribution.
- **Settling.** After verification, each row keeps the drafts it accepted (at most the
  ``K - 1`` fed) and takes the rest back as holes: the draft cache never holds a token the
  row did not emit.

Rows that leave the decode batch (finished, paused) leave the draft batch with it
(:meth:`forget`), their draft caches stored in the prefix cache; a paused row that comes
back joins again, restoring what it left.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from cache.restore import layer_bytes
from scheduler.speculative.draft_snapshots import DraftSnapshots
from scheduler.speculative.holes import HoledKVCache
from scheduler.speculative.rewind import held_arrays

PREFILL_CHUNK = 512  # tokens of joining rows' prefill in the draft model, per drafting step


@dataclass(frozen=True)
class DraftModel:
    """A loaded draft model and the target's logits size.

    Attributes:
        model: an mlx-lm model whose layers all keep ``KVCache`` s, with the target's
            tokenizer (the gateway checks both at load).
        vocab: entries in the target's logits; draft logits beyond them are never
            proposed (padded embedding tables differ between sizes of one family).
        relative_cost: a draft forward's cost in target decode steps before any is
            measured (the gateway gives the ratio of their parameter counts: a decode
            step reads every weight once).
    """

    model: Any
    vocab: int
    relative_cost: float = 0.1


class ModelDrafter:
    """The ``draft`` method over a decode batch (engine thread only); the drafter
    interface of :class:`scheduler.speculative.step.Speculator`.

    Args:
        draft: the draft model.
        snapshots: where rows leaving the draft batch are stored and joining rows are
            restored from (the prefix cache); None: every join prefills its whole context.
        stats: counts of the tokens joins restore and prefill (``draft_restored``,
            ``draft_prefilled``), if given.

    Attributes:
        forward_seconds: time of one ``[B_d, 1]`` draft forward in the last
            :meth:`propose` (None when it drafted one token): the cost of a drafted
            position, without the catch-up and joins, which do not grow with the width.
    """

    costly = True  # proposing runs the draft model: the step decides its width first

    def __init__(self, draft: DraftModel, snapshots: Optional[DraftSnapshots] = None, stats=None):
        self.model, self.vocab = draft.model, draft.vocab
        self.snapshots, self.stats = snapshots, stats
        self._layers = len(make_prompt_cache(draft.model))
        self.k = 0  # tokens drafted per row in the current step
        self.forward_seconds: Optional[float] = None  # of one [B_d, 1] draft forward, last step
        self.uids: list[int] = []  # the draft batch's rows, by the decode batch's uids
        self.fed: list[int] = []  # tokens of each row in its draft cache
        self.cache: Optional[list[HoledKVCache]] = None
        self._base: list[int] = []  # tokens each row had before this step's drafts were fed
        self._joining: dict[int, tuple[list, int]] = {}  # uid -> (its own draft cache, tokens in it)
        self._rows: dict[int, tuple[Optional[str], list[int]]] = {}  # uid -> (draft namespace, its tokens)
        self._embeddings: Optional[int] = None

    # ----------------------------------------------------------------- rows
    def forget(self, uids: list[int]) -> None:
        """Drop the rows not in ``uids`` (they left the decode batch), storing their draft
        caches in :attr:`snapshots` first."""
        live = set(uids)
        for u in [u for u in self._joining if u not in live]:
            cache, done = self._joining.pop(u)
            self._save(u, done, lambda cache=cache: cache)
        keep = [j for j, u in enumerate(self.uids) if u in live]
        if len(keep) == len(self.uids):
            return
        for j, u in enumerate(self.uids):
            if u not in live:
                self._save(u, self.fed[j], lambda j=j: [c.extract(j) for c in self.cache])
        self._keep(keep)

    def _keep(self, keep: list[int]) -> None:
        """Keep the draft batch's rows at indices ``keep`` (in order), dropping the others."""
        if not keep:
            self.uids, self.fed, self.cache = [], [], None
            return
        for c in self.cache:
            c.filter(keep)
        self.uids = [self.uids[j] for j in keep]
        self.fed = [self.fed[j] for j in keep]

    def _save(self, uid: int, fed: int, cache) -> None:
        """Store row ``uid``'s draft cache (``cache()``: its layers after its first ``fed``
        tokens, built only if stored) as it leaves."""
        namespace, tokens = self._rows.pop(uid, (None, []))
        if self.snapshots is not None and 0 < fed <= len(tokens):
            self.snapshots.save(namespace, tokens[:fed], cache)

    def _start(self, uid: int, tokens: list[int]) -> None:
        """Row ``uid`` (``tokens``: the decode batch's list of its tokens, which grows in
        place) starts joining, from the longest prefix of its tokens stored in
        :attr:`snapshots`, if any."""
        cache, done = None, 0
        if self.snapshots is not None:
            namespace = self.snapshots.namespace(uid)
            self._rows[uid] = (namespace, tokens)
            cache, done = self.snapshots.restore(namespace, tokens, self._layers)
        if self.stats is not None:
            self.stats.draft_restored += done
        self._joining[uid] = (cache if cache is not None else make_prompt_cache(self.model), done)

    def _join(self, batch, index: dict[int, int], new: list[int]) -> None:
        """Start joining the decode batch's rows ``new`` (their uids); prefill up to
        :data:`PREFILL_CHUNK` tokens of joining rows, the row closest to drafting first
        (a long context does not hold the short ones back), and merge each into the
        draft batch once its cache holds all its tokens (a row emits a few per step)."""
        for u in new:
            self._start(u, batch.tokens[index[u]])
        budget = PREFILL_CHUNK
        while self._joining and budget > 0:
            uid = min(self._joining, key=lambda u: len(batch.tokens[index[u]]) - self._joining[u][1])
            cache, done = self._joining[uid]
            tokens = batch.tokens[index[uid]]
            chunk = list(tokens[done: done + budget])
            if chunk:
                self.model(self._ids(mx.array([chunk], dtype=mx.uint32)), cache=cache)
                mx.eval([c.state for c in cache])
            done += len(chunk)
            budget -= len(chunk)
            if self.stats is not None:
                self.stats.draft_prefilled += len(chunk)
            if done < len(tokens):
                self._joining[uid] = (cache, done)
                return
            del self._joining[uid]
            self._merge(uid, cache, done)

    def _merge(self, uid: int, cache: list, done: int) -> None:
        """Row ``uid``'s own draft cache (``done`` tokens) joins the draft batch."""
        merged = [HoledKVCache.adopt(BatchKVCache.merge([layer])) for layer in cache]
        if self.cache is None:
            self.cache = merged
        else:
            for mine, more in zip(self.cache, merged):
                mine.extend(more)
        self.uids.append(uid)
        self.fed.append(done)

    def _ids(self, ids: mx.array) -> mx.array:
        """Token ids (``[B, T]``, uint32) for the draft model, ids beyond its embedding
        table clipped (only the target's padding ids are: their drafts are then merely
        wrong)."""
        if self._embeddings is None:
            self._embeddings = int(self.model(mx.array([[0]])).shape[-1])
        return mx.minimum(ids, self._embeddings - 1)

    # ----------------------------------------------------------------- the drafter interface
    def kv_bytes(self) -> int:
        """Bytes of the draft model's caches: the draft batch and the joining rows'."""
        return layer_bytes((self.cache or []) + [c for cache, _ in self._joining.values() for c in cache])

    def hint(self, batch, i: int) -> bool:
        """Every row with tokens in its cache may draft."""
        return len(batch.tokens[i]) > 0

    def propose(self, batch, candidates: list[bool], inputs: list[int], rooms: list[int]) -> list[list[int]]:
        """Per row of ``batch`` (a decode batch), up to ``rooms[i]`` greedy draft tokens
        to follow ``inputs[i]`` (its pending input); empty for rows not ``candidates``.
        Every row of the draft batch catches up and drafts ``k``, the most any candidate
        has room for (see the module docstring); :meth:`settle` must follow, with what
        each row accepted."""
        self.k = max((r for r, c in zip(rooms, candidates) if c), default=0)
        if self.k <= 0:
            return [[] for _ in inputs]
        index = {u: i for i, u in enumerate(batch.uids)}
        self._rejoin_far_behind(batch, index)
        known = set(self.uids) | set(self._joining)
        self._join(batch, index, [batch.uids[i] for i, c in enumerate(candidates) if c and batch.uids[i] not in known])
        if not any(candidates[index[u]] for u in self.uids):  # only joining rows want drafts
            return [[] for _ in inputs]
        behind = [list(batch.tokens[index[u]][f:]) for u, f in zip(self.uids, self.fed)]
        self._catch_up(behind)
        tokens = mx.array([[inputs[index[u]]] for u in self.uids], dtype=mx.uint32)
        logits = self.model(self._ids(tokens), cache=self.cache)
        drafted = [mx.argmax(logits[:, -1, : self.vocab], axis=-1)]
        mx.eval(drafted[0])
        tic = time.perf_counter()
        for _ in range(self.k - 1):
            logits = self.model(self._ids(drafted[-1][:, None]), cache=self.cache)
            drafted.append(mx.argmax(logits[:, -1, : self.vocab], axis=-1))
        out = mx.stack(drafted, axis=1)
        mx.eval(out)
        self.forward_seconds = (time.perf_counter() - tic) / (self.k - 1) if self.k > 1 else None
        out = out.tolist()
        self._base = [f + len(b) + 1 for f, b in zip(self.fed, behind)]  # those behind, then the input
        self.fed = [b + self.k - 1 for b in self._base]
        drafts = [[] for _ in inputs]
        for j, u in enumerate(self.uids):
            i = index[u]
            if candidates[i]:
                drafts[i] = out[j][: rooms[i]]
        return drafts

    def _rejoin_far_behind(self, batch, index: dict[int, int]) -> None:
        """Rows more than :data:`PREFILL_CHUNK` tokens behind leave the draft batch with their
        draft caches and join again (:meth:`_join`: a chunk per step, drafting once
        caught up), so that a catch-up forward never feeds a row more than a chunk. Rows
        fall that far behind over plain steps: a long cool-down, or steps beside a prompt in
        prefill (:meth:`Speculator.next <scheduler.speculative.step.Speculator.next>`), which
        would otherwise end in one forward of every token decoded meanwhile."""
        far = {j for j, (u, f) in enumerate(zip(self.uids, self.fed))
               if len(batch.tokens[index[u]]) - f > PREFILL_CHUNK}
        if not far:
            return
        for j in far:
            self._joining[self.uids[j]] = ([c.extract(j) for c in self.cache], self.fed[j])
        self._keep([j for j in range(len(self.uids)) if j not in far])

    def _catch_up(self, behind: list[list[int]]) -> None:
        """Feed each row the tokens it emitted since its draft cache last saw it (``behind``,
        per draft row, possibly empty): one forward ``[B_d, M]``, shorter rows filled at
        the end with positions taken back as holes. Only the cache is evaluated, so the
        output layer's ``[B_d, M, V]`` logits are never computed."""
        width = max(len(b) for b in behind)
        if width == 0:
            return
        grid = [b + [b[-1] if b else 0] * (width - len(b)) for b in behind]
        self.model(self._ids(mx.array(grid, dtype=mx.uint32)), cache=self.cache)
        for c in self.cache:
            c.reject([width - len(b) for b in behind])
        mx.eval([a for c in self.cache for a in held_arrays(c)])  # not .state: it would compact

    def settle(self, uids: list[int], accepted: list[int]) -> None:
        """The decode batch's rows ``uids`` accepted ``accepted[i]`` drafts each (0 for a
        step that did not verify): the draft cache keeps those and takes the other fed
        drafts back."""
        if self.cache is None or not self._base or self.k <= 0:
            return
        took = dict(zip(uids, accepted))
        rejected = []
        for j, u in enumerate(self.uids):
            keep = min(took.get(u, 0), self.k - 1)
            rejected.append(self.k - 1 - keep)
            self.fed[j] = self._base[j] + keep
        self._base = []
        if any(rejected):
            for c in self.cache:
                c.reject(rejected)
