"""Putting prompts into the batch generator: new rows, paused and resumed ones (engine thread only).

A request's prompt is inserted as *segments* cut at its checkpoint offsets (the marks
:func:`cache.checkpoints.row_snapshots` picks), over the prefix the prompt cache
restored for it, so prefill never crosses a checkpoint and the row's snapshot is
extracted at exactly its own boundary. A prefilling row can be taken out of the
generator between two steps with its cache kept (:meth:`RowInsertion.pause`, for a
request of a better latency class) and put back later to go on from there
(:meth:`RowInsertion.resume`); so can a decoding row, when a better class needs its
place in a full decode batch. An exact repeat of a prompt whose first token's
log-probabilities are kept (:mod:`scheduler.batch.first_tokens`) starts decoding at once, its
whole prompt restored (:meth:`RowInsertion.join_ready`).
"""

from __future__ import annotations

import logging
import time
from operator import attrgetter
from typing import Any, Callable, NamedTuple, Optional

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.generate import StopSequences
from mlx_lm.models.cache import TokenBuffer

from cache import PromptCacheManager
from cache.checkpoints import row_snapshots
from cache.entries import compact
from scheduler.batch.faults import RowFault
from scheduler.batch.first_tokens import FirstTokenStore, eligible
from scheduler.batch.generator import JoiningBatchGenerator
from scheduler.batch.row_failures import RowFailures
from scheduler.batch.decode_batch import DecodingState
from scheduler.request import DoneEvent, EngineRequest, ErrorEvent, Event, TokenEvent
from scheduler.batch.rows import EngineStats, Row
from scheduler.sampling import make_processors, make_sampler

log = logging.getLogger("mlx_gateway.engine")


class EndTokens(StopSequences):
    """mlx-lm's ``StopSequences`` of single tokens (``tokens``: the model's EOS tokens, or
    none): with no sequence longer than a token, a matcher keeps no state, and its
    ``advance(token)`` (True: the token ends the row) is the set's own membership test, a
    C call per row and step rather than mlx-lm's walk of its automaton."""

    def __init__(self, tokens: frozenset = frozenset()):
        super().__init__([[t] for t in sorted(tokens)])
        self.tokens = tokens

    def matcher(self) -> "_InSet":
        return _InSet(self.tokens.__contains__)


class _InSet(NamedTuple):
    advance: Callable[[int], bool]


class _First(NamedTuple):
    """A first token sampled at admission, as a step's response gives it."""

    token: int
    logprobs: Any


class RowInsertion:
    """How rows enter the generator, held by :class:`scheduler.batch.Batch` (engine thread only).

    Public: :meth:`start_row`, :meth:`join_ready`, :meth:`pause`, :meth:`resume`,
    :meth:`drop_paused`. A row it starts is added to ``rows`` (by uid) and ``by_id`` (by
    request id), the batch's own tables, and taken out of them when it pauses.

    Args:
        generator: returns the batch's current generator (a failed step replaces it).
        rows, by_id: the batch's rows by uid and by request id.
        prompt_cache: where a row's prefix is restored from.
        trimmable: the model's caches can be trimmed (fewer snapshots are needed).
        eos_token_ids: token ids that end a generation.
        first_tokens: the kept first tokens of exact repeats (None: not kept).
        failures: counts the rows that fail here.
        stats: counts the rows that finish at their first token.
        send: delivers events to a request's sink.
        finish: takes a row out of the tables, releases its lease, sends its events.
        token_event: accounts a sampled token of a row and makes its event.
    """

    def __init__(self, *, generator: Callable[[], JoiningBatchGenerator], rows: dict[int, Row],
                 by_id: dict[str, Row], prompt_cache: PromptCacheManager, trimmable: bool, eos_token_ids: set[int],
                 first_tokens: Optional[FirstTokenStore], failures: RowFailures, stats: EngineStats,
                 send: Callable[[EngineRequest, list[Event]], None], finish: Callable[..., None],
                 token_event: Callable[[Row, Any], TokenEvent]):
        self._gen = generator
        self._rows = rows
        self._by_id = by_id
        self.prompt_cache = prompt_cache
        self.trimmable = trimmable
        self.eos_token_ids = eos_token_ids
        self.first_tokens = first_tokens
        self._failures = failures
        self._stats = stats
        self._send = send
        self._finish = finish
        self._token_event = token_event
        self._joining_uid = 0  # rows started from a kept first token count down from -1 until they join

    preemptible = True  # rows may be taken out for memory (scheduler/admission/preemption.py)

    def start_row(self, r: EngineRequest, extra_checkpoints=(), background: bool = False,
                  carry: Any = None) -> Optional[Row]:
        """Fetch ``r``'s cached prefix and put its prompt into the batch, cut into segments
        where :func:`cache.checkpoints.row_snapshots` says; None (``r`` failed with a 500) if
        that raised. A ``background`` row is a next-turn precompute: its lookup stays out
        of the hit-rate metrics and it snapshots only at its end. With ``carry`` (a
        preempted row's ``sampler``, ``processors`` and ``fault``:
        :mod:`scheduler.admission.preemption`) the row goes on with those, and its lookup
        stays out of the hit-rate metrics too."""
        lease = None
        if carry is None:
            r.timings["engine_admitted"] = time.monotonic()
        keeps = (not background and carry is None and self.first_tokens is not None
                 and eligible(r))  # its first token's logits
        known = self.first_tokens.get(r) if keeps else None
        try:
            hit = self.prompt_cache.fetch(r.namespace, r.tokens, count=not background and carry is None,
                                          whole=known is not None)
            r.timings.setdefault("engine_restored", time.monotonic())  # a resumed request keeps its first
            lease, cached = hit.lease, hit.cached_tokens
            if known is not None and cached == len(r.tokens):
                return self._start_from_first_token(r, hit, known)
            marks, snapshots = row_snapshots(len(r.tokens), cached, r.checkpoints, extra_checkpoints,
                                             self.trimmable, precompute=background, whole=keeps)
            fault = RowFault() if carry is None else carry.fault
            uid = self._insert(r, cached, marks, hit.cache, list(r.tokens[:cached]), fault, carry)
        except Exception as e:
            self.prompt_cache.release(lease)
            log.exception("request %s could not be admitted", r.id)
            self._send(r, [ErrorEvent(500, f"could not start the request: {e}")])
            return None
        active = Row(r, uid, lease, cached, snapshots, fault=fault, cache_source=hit.source, marks=marks)
        self._rows[uid] = active
        self._by_id[r.id] = active
        return active

    def _start_from_first_token(self, r: EngineRequest, hit, logprobs) -> Row:
        """``r`` repeats a prompt whose first token's log-probabilities ``[V]`` are kept
        (:mod:`scheduler.batch.first_tokens`) and ``hit`` restored all of it: sample its first
        token now, and make it a decoding row whose pending input is that token; it joins
        the decode batch, and its token is sent, at the next step's start
        (:meth:`join_ready`)."""
        fault = RowFault()
        sampler = fault.sampler(make_sampler(r.params))
        lp = mx.array(logprobs)
        pending = sampler(lp[None])
        mx.eval(pending)
        stop = self._stops(r)
        state = DecodingState(cache=hit.cache, tokens=list(r.tokens), pending=pending, logprobs=lp, reported=True,
                              fresh=False, sampler=sampler, processors=[], stop=stop, matcher=stop.matcher(),
                              context=TokenBuffer(list(r.tokens)), max_tokens=r.params.max_tokens, num_tokens=1)
        self._joining_uid -= 1  # a uid of its own until it joins
        # its lease pins the restored pages until it joins (released then, or by _finish)
        a = Row(r, self._joining_uid, hit.lease, len(r.tokens), [], fault=fault, cache_source=hit.source,
                decoding=True, joining=state)
        self.first_tokens.count_hit()
        self._rows[a.uid] = a
        self._by_id[r.id] = a
        return a

    def join_ready(self) -> None:
        """Send the first token of each row started by :meth:`_start_from_first_token` and
        put those that go on into the decode batch, in one merge (at a step's start, so
        after the engine sent their prompt events)."""
        ready = list(filter(attrgetter("joining"), self._rows.values()))  # (a scan in C; joining: a dataclass)
        if not ready:
            return
        now = time.monotonic()
        going = []
        for a in ready:
            state, a.joining = a.joining, None
            reason = a.error()
            if reason is not None:
                log.error("request %s failed: %s", a.request.id, reason)
                self._failures.count(a)
                self._finish(a, ErrorEvent(500, reason))
                continue
            a.request.timings.setdefault("engine_prefilled", now)
            try:
                token = int(state.pending.item())
                event = self._token_event(a, _First(token, state.logprobs))
            except Exception as e:  # this row alone
                log.exception("request %s failed at its first token", a.request.id)
                self._failures.count(a)
                self._finish(a, ErrorEvent(500, f"decoding failed: {e}"))
                continue
            if state.matcher.advance(token):  # its first token ends it
                self._stats.finished += 1
                self._finish(a, DoneEvent("stop"), [event])
                continue
            self._send(a.request, [event])
            going.append((a, state))
        if not going:
            return
        try:
            uids = self._gen().put_decoding_all([state for _, state in going])
        except Exception as e:
            log.exception("joining %d repeated prompts to the decode batch failed", len(going))
            for a, _ in going:
                self._failures.count(a)
                self._finish(a, ErrorEvent(500, f"could not start the request: {e}"))
            return
        for (a, _), uid in zip(going, uids):
            del self._rows[a.uid]
            a.uid = uid
            self._rows[uid] = a
            self.prompt_cache.release(a.lease)
            a.lease = None

    def _stops(self, r: EngineRequest) -> EndTokens:
        """``r``'s stop tokens: an EOS token ends it, unless it ignores EOS."""
        return EndTokens(frozenset() if r.params.ignore_eos else frozenset(self.eos_token_ids))

    def _insert(self, r: EngineRequest, start: int, marks: list[int], cache, tokens: list[int],
                fault: RowFault, carry: Any = None) -> int:
        """Put ``r``'s prompt from ``start`` on (tokens) into the generator over ``cache``
        (covering ``tokens``), cut into segments at ``marks``; its uid. ``carry``: the
        sampler and processors a preempted row goes on with (see :meth:`start_row`)."""
        cuts = [start, *[m for m in marks if m > start], len(r.tokens)]
        processors = make_processors(r.params) + list(r.processors) + ([r.mask] if r.mask is not None else [])
        sampler = fault.sampler(make_sampler(r.params)) if carry is None else carry.sampler
        processors = fault.processors(processors) if carry is None else carry.processors
        (uid,) = self._gen().insert_segments(
            [[r.tokens[x:y] for x, y in zip(cuts, cuts[1:])]],
            max_tokens=[r.params.max_tokens],
            caches=[cache],
            all_tokens=[tokens],
            samplers=[sampler],
            logits_processors=[processors],
            stop_sequences=[self._stops(r)],
        )
        return uid

    def pause(self, a: Row) -> bool:
        """Take the row ``a`` out of the generator between two steps, its cache kept (a
        compact copy), to be put back by :meth:`resume` and go on from there: a prefilling
        row keeps what it has prefilled (and its lease), a decoding row its whole state
        (:class:`scheduler.batch.decode_batch.DecodingState`: its pending token, sampler, grammar).
        False (``a`` left as it was) if it could not be taken out."""
        if a.decoding:
            return self._pause_decoding(a)
        try:
            extracted = self._gen().extract_cache([a.uid]).get(a.uid)
            if extracted is None:
                return False
            cache, tokens = extracted
            _keep(cache)
            self._gen().remove([a.uid])
        except Exception:
            log.exception("pausing request %s failed; it goes on", a.request.id)
            return False
        self._rows.pop(a.uid, None)
        self._by_id.pop(a.request.id, None)
        a.paused = (cache, list(tokens))
        return True

    def _pause_decoding(self, a: Row) -> bool:
        try:
            state = self._gen().take_decoding(a.uid)
        except Exception:
            log.exception("pausing the decoding request %s failed; it goes on", a.request.id)
            return False
        if state is None:
            return False
        self._rows.pop(a.uid, None)
        self._by_id.pop(a.request.id, None)
        try:
            _keep(state.cache, state.pending)
        except Exception as e:  # out of the batch already: it fails alone
            log.exception("pausing the decoding request %s failed", a.request.id)
            self._failures.count(a)
            self._send(a.request, [ErrorEvent(500, f"pausing the request failed: {e}")])
            return False
        a.paused = state
        return True

    def preempt(self, a: Row, save: Callable[[Row, list, list], None]) -> tuple[str, Optional[list[int]], Any]:
        """Take the decoding row ``a`` out of the generator for memory
        (:mod:`scheduler.admission.preemption`), as :meth:`pause` does; then its pending
        token is reported if it was not yet (it may end the row: ``stop`` or ``length``),
        its cache goes into the prefix cache through ``save`` (``Batch._save_snapshot``, the
        store a finished row's cache takes) and its state is dropped.

        Returns:
            ``("out", tokens, state)``: it left, ``tokens`` (its prompt and every token it
            reported) to go on from, ``state`` its
            :class:`~scheduler.batch.decode_batch.DecodingState` without its cache (its
            sampler and processors go on); ``("ended", None, None)``: its pending token ended
            it (or it failed with a 500); ``("kept", None, None)``: it could not be taken out
            and goes on.
        """
        if not a.decoding or a.joining is not None:
            return "kept", None, None
        if not self._pause_decoding(a):  # (a failure there ended it with a 500)
            return ("kept" if a.request.id in self._by_id else "ended"), None, None
        return self.preempt_paused(a, save)

    def preempt_paused(self, a: Row, save: Callable[[Row, list, list], None]) -> tuple[str, Optional[list[int]], Any]:
        """:meth:`preempt` for the decoding row ``a`` paused for a better latency class
        (:meth:`pause`: already out of the generator, its state in ``a.paused``)."""
        state, a.paused = a.paused, None
        before, done = [], None
        try:
            tokens = [*state.tokens, int(state.pending.item())]
            if not (state.reported or state.fresh):  # sampled, not reported yet: report it now
                before.append(self._token_event(a, _First(tokens[-1], state.logprobs)))
                done = ("stop" if state.matcher.advance(tokens[-1])
                        else "length" if state.num_tokens + 1 >= state.max_tokens else None)
        except Exception as e:  # out of the batch already: it fails alone
            log.exception("preempting request %s failed", a.request.id)
            self._failures.count(a)
            self._finish(a, ErrorEvent(500, f"preempting the request failed: {e}"))
            return "ended", None, None
        save(a, state.tokens, state.cache)
        state.cache = None
        if done is not None:
            self._stats.finished += 1
            self._finish(a, DoneEvent(done, max(0, a.stored - a.cached)), before)
            return "ended", None, None
        if before:
            self._send(a.request, before)
        return "out", tokens, state

    def drop_paused(self, a: Row) -> None:
        """Forget the paused row ``a`` (its request ended while paused): its kept cache goes
        and its lease is released."""
        a.paused = None
        self.prompt_cache.release(a.lease)

    def resume(self, a: Row) -> bool:
        """Put the paused row ``a`` back into the generator: its prefill goes on from where
        it stopped, over its kept cache, or its decoding from its kept state. False (``a``
        failed with a 500) if that raised."""
        r = a.request
        try:
            if a.decoding:
                uid, base = self._gen().put_decoding(a.paused), a.progress_base
            else:
                cache, tokens = a.paused
                uid, base = self._insert(r, len(tokens), a.marks, cache, tokens, a.fault), len(tokens) - a.cached
        except Exception as e:
            log.exception("resuming request %s failed", r.id)
            a.paused = None
            self._failures.count(a)
            self.prompt_cache.release(a.lease)
            a.lease = None
            self._send(r, [ErrorEvent(500, f"could not resume the request: {e}")])
            return False
        a.uid, a.paused, a.progress_base = uid, None, base
        self._rows[uid] = a
        self._by_id[r.id] = a
        return True


def _keep(cache: list, *arrays) -> None:
    """Make each layer's state of an extracted ``cache`` a compact copy (not a view pinning
    the whole batch buffer) and evaluate it, with ``arrays``."""
    for layer in cache:
        layer.state = tree_map(compact, layer.state)
    mx.eval([layer.state for layer in cache], *arrays)
