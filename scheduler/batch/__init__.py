"""The running batch: mlx-lm's ``BatchGenerator`` and the requests in it (engine thread only).

Batching is mlx-lm's ``BatchGenerator`` (continuous batching with left padding) as
:class:`scheduler.batch.generator.JoiningBatchGenerator` runs it: rows that finish their
prompt join the decode step instead of running a forward of their own. A request's prompt
is inserted as *segments* cut at its own checkpoint offsets, so prefill never crosses a
checkpoint and each request's snapshot is extracted at exactly its own boundary, whatever
the other rows do (:mod:`scheduler.batch.insertion`, which also pauses and resumes rows).

The engine (:mod:`scheduler.engine`) decides what enters the batch and when;
:class:`Batch` steps it and accounts for every row until it leaves.
"""

from __future__ import annotations

import logging
import time
from itertools import filterfalse
from operator import attrgetter
from typing import Callable, Optional

from cache import PromptCacheManager
from scheduler.batch.chunking import ChunkPlanner
from scheduler.admission.fairness import FairShare
from scheduler.batch.first_tokens import FirstTokenStore, eligible
from scheduler.batch.generator import JoiningBatchGenerator
from scheduler.batch.insertion import RowInsertion
from scheduler.batch.row_failures import RowFailures
from scheduler.lora import rows_hook
from scheduler.metrics import SchedulerMetrics
from scheduler.admission.precompute import PrecomputeBook
from scheduler.request import DoneEvent, EngineRequest, ErrorEvent, Event, ProgressEvent, TokenEvent, one_wake_up
from scheduler.batch.rows import RECENT, EngineStats, Row, TokenRates, holds_decode
from scheduler.sampling import greedy, token_logprobs
from scheduler.speculative import DraftSnapshots, SpeculationConfig, speculator

log = logging.getLogger("mlx_gateway.engine")
DECODING, PRECOMPUTE = attrgetter("decoding"), attrgetter("precompute")


class Batch:
    """The ``BatchGenerator`` and its rows, by uid (:attr:`active`) and by request id
    (:attr:`by_id`); used on the engine thread only.

    The generator is made by :meth:`open` and dropped by :meth:`close`, both on the
    engine thread; a failed step replaces it with a fresh one, so read :attr:`gen` each
    time rather than keeping it. Its parts: :attr:`insertion` (rows in, paused, resumed:
    :class:`~scheduler.batch.insertion.RowInsertion`) and :attr:`failures` (rows that fail:
    :class:`~scheduler.batch.row_failures.RowFailures`).

    Args:
        model: an mlx-lm model.
        eos_token_ids: token ids that end a generation.
        prompt_concurrency: prompts prefilled together (prefill batch size).
        decode_concurrency: sequences decoded together (decode batch size).
        prefill_step_size: the generator's initial prefill step (each step sets its own
            from ``chunks``).
        trimmable: the model's caches can be trimmed (fewer snapshots are needed).
        prompt_cache: where rows restore their prefix and save their snapshots.
        chunks: sizes each step's prefill chunk.
        metrics, stats, precomputes: where the rows are accounted.
        fair: charged one token per generated token of a row's tenant.
        send: delivers events to a request's sink.
        speculation: speculative decoding of the decode batch (:mod:`scheduler.speculative`).
        first_tokens: where the first tokens of exact repeats come from, without a
            forward (:mod:`scheduler.batch.first_tokens`); None: not kept.
    """

    def __init__(self, model, eos_token_ids: set[int], *, prompt_concurrency: int, decode_concurrency: int,
                 prefill_step_size: int, trimmable: bool, prompt_cache: PromptCacheManager, chunks: ChunkPlanner,
                 metrics: SchedulerMetrics, stats: EngineStats, precomputes: PrecomputeBook, fair: FairShare,
                 send: Callable[[EngineRequest, list[Event]], None],
                 speculation: SpeculationConfig = SpeculationConfig(),
                 first_tokens: Optional[FirstTokenStore] = None):
        self.model = model
        self.prompt_concurrency = prompt_concurrency
        self.decode_concurrency = decode_concurrency
        self.prefill_step_size = prefill_step_size
        self.trimmable = trimmable
        self.prompt_cache = prompt_cache
        self.chunks = chunks
        self.metrics = metrics
        self.stats = stats
        self.precomputes = precomputes
        self.fair = fair
        self._send = send
        self.speculation = speculation
        self.first_tokens = first_tokens
        self.gen: Optional[JoiningBatchGenerator] = None
        self.active: dict[int, Row] = {}
        self.by_id: dict[str, Row] = {}
        self.failures = RowFailures(stats, precomputes, metrics, self._finish)
        self.insertion = RowInsertion(
            generator=lambda: self.gen, rows=self.active, by_id=self.by_id, prompt_cache=prompt_cache,
            trimmable=trimmable, eos_token_ids=eos_token_ids, first_tokens=first_tokens, failures=self.failures,
            stats=stats, send=send, finish=self._finish, token_event=self._token_event)
        self._step_prefilled_at = 0.0
        self._held = 0  # steps in a row that held the decoding rows back (scheduler.batch.rows.holds_decode)
        self.rates = TokenRates(metrics, stats, fair)  # tokens counted, and per second

    # ----------------------------------------------------------------- the generator
    def open(self) -> None:
        """Make the batch generator (on the engine thread)."""
        self.gen = self._new_generator()

    def _new_generator(self) -> JoiningBatchGenerator:
        gen = JoiningBatchGenerator(
            self.model, max_tokens=1 << 30, sampler=greedy, completion_batch_size=self.decode_concurrency,
            prefill_batch_size=self.prompt_concurrency, prefill_step_size=self.prefill_step_size,
            speculator=speculator(self.speculation, self.stats.speculation, self.metrics,
                                  DraftSnapshots(self.prompt_cache, self._namespace_of)),
        )
        gen.adapter_rows = rows_hook(self.model, self._namespace_of, self.prompt_cache)  # each row's LoRA adapter
        return gen

    def _namespace_of(self, uid: int) -> Optional[str]:
        """The prefix-cache namespace of the decoding row ``uid`` (None: not a request's)."""
        row = self.active.get(uid)
        return None if row is None else row.request.namespace

    def close(self) -> None:
        """Close the batch generator and drop it here, so that its clean-up (it restores
        Metal's wired-memory limit) runs on the engine thread, not wherever the garbage
        collector would find it."""
        gen, self.gen = self.gen, None
        if gen is not None:
            try:
                gen.close()
            except Exception:
                log.exception("closing the batch generator failed")
            del gen

    def kv_bytes(self) -> int:
        """Bytes of the generator's batch caches (:meth:`JoiningBatchGenerator.kv_bytes
        <scheduler.batch.generator.JoiningBatchGenerator.kv_bytes>`); 0 with no rows."""
        return self.gen.kv_bytes() if self.gen is not None and self.active else 0

    # ----------------------------------------------------------------- rows in and out
    def serving(self) -> bool:
        """Some row is a request (not a next-turn precompute)."""
        return not all(map(PRECOMPUTE, self.active.values()))  # (a scan in C: made twice a turn)

    def num_prefilling(self) -> int:
        """Rows still prefilling their prompt (a count in C: made several times a turn)."""
        return len(self.active) - sum(map(DECODING, self.active.values()))

    def prefilling(self) -> list[Row]:
        """The rows still prefilling their prompt, in order (a scan in C)."""
        return list(filterfalse(DECODING, self.active.values()))

    def _finish_precompute(self, a: Row) -> None:
        """``a``'s prefix is stored (or could not be): take it out of the batch."""
        self.gen.remove([a.uid])
        self._finish(a, DoneEvent("stop"))  # its sink discards events
        if a.stored >= len(a.request.tokens):
            self.precomputes.stored(a.precompute, a.cached)
        else:
            self.precomputes.outcome("failed")

    def preempt_precomputes(self) -> None:
        """A request waits: drop every precompute in the batch now (its finished chunks are
        lost; at most one chunk of work delayed the request)."""
        for a in [a for a in self.active.values() if a.precompute is not None]:
            self.gen.remove([a.uid])
            self._finish(a, DoneEvent("cancelled"))  # its sink discards events
            self.precomputes.outcome("preempted")

    def cancel(self, request_id: str, reason: str) -> bool:
        """End the row of ``request_id`` with a :class:`DoneEvent` whose finish reason is
        ``reason``; False if no such row runs. The caller counts the early end."""
        a = self.by_id.get(request_id)
        if a is None:
            return False
        if a.joining is not None:  # started from a kept first token, not in the generator yet
            a.joining = None
            self._finish(a, DoneEvent(reason))
            return True
        # A complete answer is cached like any other; so is a cancelled one's prompt on a
        # trimmable cache, which keeps no len-1 snapshot (a client's regenerate is often a
        # cancel and the same prompt again).
        if a.decoding and (reason == "stop" or self.trimmable):
            try:
                extracted = self.gen.extract_cache([a.uid]).get(a.uid)
            except Exception:
                log.exception("extracting the cache of request %s failed", a.request.id)
                extracted = None
            if extracted is not None:
                self._save_snapshot(a, extracted[1], extracted[0])
        self.gen.remove([a.uid])
        self._finish(a, DoneEvent(reason, max(0, a.stored - a.cached)))
        return True

    def _finish(self, a: Row, event: Event, before: Optional[list[Event]] = None) -> None:
        """Drop ``a`` from the engine, release its lease, send ``before`` then ``event``."""
        self.active.pop(a.uid, None)
        self.by_id.pop(a.request.id, None)
        self.prompt_cache.release(a.lease)
        a.lease = None
        self._send(a.request, [*(before or []), event])

    def _fail_row(self, a: Row, message: str) -> None:
        """Take ``a`` out of the generator and end it with a 500 ``message``; the other rows go on."""
        self.gen.remove([a.uid])
        self.failures.fail(a, message)

    def _fail_batch(self, error: Exception) -> None:
        """A batch step raised: fail the requests in it, start a fresh batch, keep serving."""
        self.failures.fail_step(list(self.active.values()), error)
        self.close()
        self.open()

    def drop_all(self, reason: str) -> None:
        """The engine stops: end every row with a 503 ``reason`` and release its lease."""
        for a in list(self.active.values()):
            self._send(a.request, [ErrorEvent(503, reason)])
            self.prompt_cache.release(a.lease)
        self.active.clear()
        self.by_id.clear()

    # ----------------------------------------------------------------- stepping
    def step(self, decode_only: bool = False, decoding_elsewhere: int = 0, cap: Optional[float] = None,
             share: float = 1.0) -> None:
        """Run one step of the generator (a prefill chunk and/or one decoded token per
        row) and account for it: progress, snapshots, tokens, finished and failed rows.

        Args:
            decode_only: advance only the decoding rows (another model's engine runs the
                loop's prefill chunk this turn).
            decoding_elsewhere: rows decoding in the other engines of the loop: the chunk
                is sized for them too (the gap bound holds across models).
            cap: seconds the step may take at most (:meth:`ChunkPlanner.next_chunk`).
            share: this engine's share of the loop's prefill budget this turn (other
                models prefill in the same turn).
        """
        self.insertion.join_ready()
        prefill_rows = self.prefilling()
        prefilling = len(prefill_rows)
        classes = tuple(sorted({a.rank for a in prefill_rows})) if prefilling else ()
        # what the next chunk attends to besides itself: the tokens in those rows' caches, their mean
        context = sum(a.cached + a.processed for a in prefill_rows) / prefilling if prefilling else None
        # the most tokens a prompt has to prefill before its last (fed as it joins the decoding rows)
        left = max(a.prompt_left - 1 for a in prefill_rows) if prefilling else None
        decoding = len(self.active) - prefilling
        hold = not decode_only and bool(prefill_rows) and holds_decode(self.active.values(), self._held)  # (scans)
        if hold:
            decoding = 0
        if decode_only:
            chunk = 0
        elif (prefilling and not decoding and not decoding_elsewhere
              and all(a.precompute is not None for a in self.active.values())):
            chunk = self.chunks.idle_chunk(prefilling, classes)  # preemptible: a request waits one chunk
        else:
            chunk = self.chunks.next_chunk(prefilling, decoding + decoding_elsewhere, cap, share, classes, context,
                                           left)
        if hold and not chunk:  # nothing to prefill this step (decode time owed elsewhere): decode
            hold = False
        self._held = self._held + 1 if hold else 0
        self.gen.prefill_step_size = chunk
        self.gen.hold_decode = hold
        # a request's prompt takes turns with the decoding rows: their steps verify no drafts
        self.gen.prompts_waiting = prefilling > 0 and not decode_only and any(a.precompute is None for a in prefill_rows)
        tic = time.perf_counter()
        try:
            prompt_responses, gen_responses = self.gen.next()
        except Exception as e:
            self._fail_batch(e)
            return
        seconds = time.perf_counter() - tic
        with one_wake_up():  # the step's events wake each event loop once, when all are sent
            self._step_prefilled_at = time.monotonic()  # the step's prompts are in the cache now
            self.stats.steps += 1
            if prefilling:
                self.metrics.prefill_batch.observe(prefilling)
                self.stats.max_prefill_batch = max(self.stats.max_prefill_batch, prefilling)
            if decoding:
                self.metrics.decode_batch.observe(decoding)
                self.stats.max_decode_batch = max(self.stats.max_decode_batch, decoding)
            prefilled = 0
            for pr in prompt_responses:
                a = self.active.get(pr.uid)
                if a is not None:
                    prefilled += self._on_prompt_progress(a, pr)
            self.chunks.record(chunk, prefilled, decoding + decoding_elsewhere, seconds, classes, context, prefilling)
            if hold:
                self.metrics.decode_holds.inc()
            self.failures.fail_faulty(self.active.values(), self._fail_row)
            counted: dict = {}  # (tenant, weight): tokens, accounted once for the step
            active, first_tokens, send = self.active, self.first_tokens, self._send
            recent = self.stats.generated_by_request
            row, events = None, []  # a row's events of the step, sent together (a verify step's are consecutive)
            for gr in gen_responses:
                a = active.get(gr.uid)
                if a is not row:
                    if events:
                        send(row.request, events)
                    row, events = a, []
                if a is None:
                    continue
                if not a.generated and first_tokens is not None and eligible(a.request):
                    try:
                        first_tokens.put(a.request, gr.logprobs)  # the logits after its prompt
                    except Exception:  # a repeat then takes the forward; the row goes on
                        log.exception("keeping the first-token logits of request %s failed", a.request.id)
                try:
                    if a.generated and not a.request.params.logprobs:  # (most tokens) _token_event's work inline
                        a.generated += 1
                        recent[a.request.id] = a.generated
                        counted[a.share_key] = counted.get(a.share_key, 0) + 1
                        events.append(TokenEvent(gr.token))
                    else:
                        events.append(self._token_event(a, gr, counted))
                except Exception as e:
                    log.exception("request %s failed while decoding", a.request.id)
                    self._fail_row(a, f"decoding failed: {e}")
                    events = []
                    continue
                if gr.finish_reason is not None:
                    self._save_snapshot(a, gr.all_tokens, gr.prompt_cache)
                    self.stats.finished += 1
                    self._finish(a, DoneEvent(gr.finish_reason, max(0, a.stored - a.cached)), events)
                    events = []
            if events:
                send(row.request, events)
            while len(recent) > RECENT:  # (the plain tokens' rows, trimmed once a step)
                del recent[next(iter(recent))]
            self.rates.count(counted)

    def _token_event(self, a: Row, gr, counted: Optional[dict] = None) -> TokenEvent:
        """The event of ``a``'s token ``gr.token``; the token is counted (stats, metrics,
        its tenant's fair share) into ``counted`` for :meth:`TokenRates.count
        <scheduler.batch.rows.TokenRates.count>`, or now when
        that is None."""
        n = a.generated = a.generated + 1
        recent = self.stats.generated_by_request
        recent[a.request.id] = n  # (a row pushed out by newer ones comes back with its next token)
        while len(recent) > RECENT:
            del recent[next(iter(recent))]
        if n == 1:
            a.request.timings["engine_first_token"] = time.monotonic()
        key = a.share_key
        if counted is None:
            self.rates.count({key: 1})
        else:
            counted[key] = counted.get(key, 0) + 1
        p = a.request.params
        if not p.logprobs:
            return TokenEvent(gr.token)
        return TokenEvent(gr.token, *token_logprobs(gr.logprobs, gr.token, p.top_logprobs))

    def _on_prompt_progress(self, a: Row, pr) -> int:
        """Account ``a``'s prefill progress; returns the prompt tokens prefilled this step."""
        done = a.progress_base + (pr.progress[0] if isinstance(pr.progress, tuple) else 0)
        delta = max(0, done - a.processed)
        if delta:
            self.stats.prefill_tokens += delta
            self.metrics.prefill_tokens.inc(delta)
            self.rates.prefilled += delta
            a.processed = done
            if not pr.end_of_prompt and a.progress_due(len(a.request.tokens), time.monotonic()):
                self._send(a.request, [ProgressEvent(a.cached + done, len(a.request.tokens))])
        position = a.cached + a.processed
        if pr.end_of_prompt:
            a.request.timings.setdefault("engine_prefilled", self._step_prefilled_at)
            a.decoding = True
            self.prompt_cache.release(a.lease)
            a.lease = None
            # The row's cache now holds exactly the prompt (its first token is sampled,
            # not yet fed back): the moment for a checkpoint at len(prompt).
            position = len(a.request.tokens)
        if (pr.end_of_segment or pr.end_of_prompt) and position in a.pending_snapshots:
            a.pending_snapshots = [p for p in a.pending_snapshots if p > position]
            try:
                extracted = self.gen.extract_cache([a.uid]).get(a.uid)
            except Exception as e:  # fails this request alone
                log.exception("extracting the cache of request %s failed", a.request.id)
                self._fail_row(a, f"saving its prompt cache failed: {e}")
                return delta
            if extracted is not None:
                cache, tokens = extracted
                self._save_snapshot(a, tokens, cache)
        if pr.end_of_prompt and a.precompute is not None:
            self._finish_precompute(a)
        return delta

    def _save_snapshot(self, a: Row, tokens, cache) -> None:
        """Store ``cache`` (covering ``tokens``) for ``a``'s namespace.

        Caches extracted from a batch are views that pin the whole batch buffer
        ``[B, H, T, D]``; the manager copies out only what it keeps (the KV of tokens it
        does not hold yet, and the other layers compacted).
        """
        if not tokens or cache is None:
            return
        keep, ns = a.request.keep.get(len(tokens)), a.request.namespace  # keep: a cache breakpoint's ttl
        try:  # refreshed (e.g. an exact repeat: no copy), else inserted
            if self.prompt_cache.refresh(ns, tokens, keep) or self.prompt_cache.insert(ns, list(tokens), cache, keep):
                a.stored = max(a.stored, min(len(tokens), len(a.request.tokens)))
        except Exception:
            log.exception("saving a snapshot for request %s failed", a.request.id)
