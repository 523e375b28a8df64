"""The engine of one model: its waiting queue, its running batch and its prefix cache.

Every MLX call happens on the engine loop's thread (:mod:`scheduler.engine.loop`), which
serves the engines of every model: an engine started alone gets a loop of its own. The
async side talks to it through the loop's thread-safe inbox (``submit``, ``cancel``,
``call``) and receives events through each request's ``sink``. The loop blocks on the
inbox only when there is no work, so a new request is admitted on the next step, never
after a timer (mlx-lm's server polls every 0.1 s and runs 0.5 s budgets; see the
project's field notes).

The engine decides what enters its batch and when (admission, next-turn precomputes);
the running batch itself is :class:`scheduler.batch.Batch`. It owns its prefix cache:
the gateway asks it to flush, set quotas, close or report (:meth:`Engine.flush_cache`,
:meth:`Engine.apply_quotas`, :meth:`Engine.close_cache`,
:meth:`Engine.cache_bytes`), never the cache itself.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Callable, Optional

from prometheus_client import CollectorRegistry

from cache import PromptCacheManager
from scheduler.engine.core import PERSIST_SECONDS, EngineCore
from scheduler.batch.forward_cost import ForwardCost
from scheduler.engine.loop import EngineLoop
from scheduler.admission.precompute import Precompute
from scheduler.engine.prefetch import DiskPrefetch
from scheduler.engine.seat import LoopSeat, Seated
from scheduler.lora import admitted_adapter
from scheduler.request import EngineRequest
from scheduler.speculative import SpeculationConfig
from scheduler.batch.rows import AdmissionRecord, EngineDead, EngineOverloaded, EngineStats, TenantQueueFull

# The errors and records are importable from here too.
__all__ = ["PERSIST_SECONDS", "AdmissionRecord", "Engine", "EngineDead", "EngineOverloaded", "EngineStats",
           "TenantQueueFull"]


class Engine(Seated):
    """Serves :class:`EngineRequest` s on one model, from an :class:`EngineLoop` thread. Its
    parts: :attr:`core` (:class:`~scheduler.engine.core.EngineCore`, what the loop steps) and
    :attr:`seat` (:class:`~scheduler.engine.seat.LoopSeat`, its place on the loop).

    Args:
        model: an mlx-lm model (``mlx_lm.load``).
        eos_token_ids: token ids that end a generation.
        prompt_cache: the prefix-cache manager, owned by the engine from now on;
            snapshots are saved at each request's checkpoints and after it finishes
            (prompt + completion).
        prompt_concurrency: prompts prefilled together (prefill batch size).
        decode_concurrency: sequences decoded together (decode batch size).
        prefill_step_size: most tokens per prompt per prefill step while nothing decodes.
        prefill_budget: seconds a prefill step may take while other sequences decode
            (0: no budget). See :mod:`scheduler.batch.chunking`.
        max_waiting: waiting requests before :meth:`submit` raises :class:`EngineOverloaded`.
        registry: where the scheduler metrics are registered.
        pad_free_prefill: when true, only prompts that need no padding prefill
            together (set by the batch-equivalence guard for models whose padded
            batches are not exact).
        gather_wait: seconds an idle engine with a request to start waits for requests
            still being prepared (:attr:`arrivals`, :mod:`scheduler.admission.arrivals`); 0: never.
            Used by the loop :meth:`start` makes; a shared loop has its own.
        loop: the engine loop to run on (shared by every model of a gateway); None: the
            loop :meth:`start` makes for this engine alone.
        name: the served model's name, for logs.
        speculation: speculative decoding (:mod:`scheduler.speculative`); the model's
            cache types must allow it (:func:`scheduler.speculative.speculation_refusal`),
            and its recurrent and window layers are checked on the model itself (at load,
            else before the first draft: :func:`scheduler.speculative.rollback_refusal`;
            a model that fails decodes plainly).
        forward_cost: what a prefill forward costs (:func:`scheduler.batch.forward_cost.measure_forward_cost`):
            chunks are never cut below the size where their cost per token rises
            more than 20 % above the best chunk's; None: no such floor.
    """

    def __init__(self, model, eos_token_ids: set[int], prompt_cache: PromptCacheManager, *,
                 prompt_concurrency: int = 8, decode_concurrency: int = 32, prefill_step_size: int = 2048,
                 prefill_budget: float = 0.0, max_waiting: int = 1024, registry: Optional[CollectorRegistry] = None,
                 pad_free_prefill: bool = False, gather_wait: float = 0.0, loop: Optional[EngineLoop] = None,
                 name: str = "model", speculation: SpeculationConfig = SpeculationConfig(),
                 forward_cost: Optional[ForwardCost] = None):
        own = loop is None
        loop = loop or EngineLoop(gather_wait=gather_wait)
        self.core = EngineCore(model, eos_token_ids, prompt_cache, loop, prompt_concurrency=prompt_concurrency,
                               decode_concurrency=decode_concurrency, prefill_step_size=prefill_step_size,
                               prefill_budget=prefill_budget, max_waiting=max_waiting, registry=registry,
                               pad_free_prefill=pad_free_prefill, name=name, speculation=speculation,
                               forward_cost=forward_cost)
        self.seat = LoopSeat(self.core, loop, own)
        core = self.core  # its books and parts, shared with every thread
        self.model, self.name, self.prompt_cache, self.trimmable = model, name, prompt_cache, core.trimmable
        self.metrics, self.stats, self.admission_log = core.metrics, core.stats, core.admission_log
        self.precomputes, self.chunks, self.arrivals = core.precomputes, core.chunks, core.arrivals
        self.pad_free_prefill, self.max_waiting = core.pad_free_prefill, core.max_waiting
        self._prefetch = DiskPrefetch(prompt_cache, self._hand_over)

    # ----------------------------------------------------------------- public API
    @property
    def error(self) -> Optional[BaseException]:
        """What stopped the engine (set on the loop thread), or None."""
        return self.core.error

    def start(self, timeout: float = 60.0) -> None:
        """Start serving: on a loop of its own (started here), or attached to the shared
        loop given at construction (opened on its thread between two steps).

        Raises:
            EngineDead, TimeoutError: the shared loop is not running or did not take it.
        """
        self.seat.start(timeout)

    def stop(self, timeout: float = 10.0, reason: str = "engine stopped") -> None:
        """Stop serving; requests still waiting or running end with a 503 error event
        whose message is ``reason``. With a disk tier, the prompt cache is written to it
        first. An engine on a loop of its own stops that loop; one on a shared loop
        leaves it (the model is unloaded) and the loop serves the others."""
        self._prefetch.close()
        self.seat.stop(timeout, reason)

    def submit(self, request: EngineRequest) -> None:
        """Queue a request (thread-safe).

        Raises:
            EngineDead: the engine is not running.
            EngineOverloaded: ``max_waiting`` requests are already waiting.
            TenantQueueFull: ``request.max_queued`` requests of its tenant are waiting.
        """
        if not self.alive:
            raise EngineDead(f"engine is not running: {self.error!r}")
        with admitted_adapter(self.model, request):  # scheduler.lora: UnknownAdapter when not loaded
            self.core.enqueue(request)
        if not self._prefetch.start(request):  # else handed over once its disk entry is read
            self.seat.post("submit", request)

    def _hand_over(self, request: EngineRequest, cancelled: Optional[str]) -> None:
        """A request whose disk entry was read ahead (:mod:`scheduler.engine.prefetch`) goes in."""
        self.seat.post("submit", request)
        if cancelled is not None:
            self.seat.post("cancel", (request.id, cancelled))

    def reserve_precompute(self, limit: int = 8) -> bool:
        """Announce a next-turn precompute that is being rendered (thread-safe): until its
        :meth:`submit_precompute`, the engine does not count as idle. False (nothing
        reserved) when ``limit`` renders are already in flight or the engine is not running."""
        return self.alive and self.core.reserve(limit)

    def submit_precompute(self, p: Optional[Precompute]) -> None:
        """Queue a reserved next-turn precompute, or None when its render gave nothing
        (thread-safe; see :mod:`scheduler.admission.precompute`). It runs only while no engine of the
        loop has anything else to do, and is dropped when a request arrives."""
        self.seat.post("precompute", p)  # the reservation ends when the engine takes it
        if not self.alive:  # stopped meanwhile: nothing will take it
            self.core.end_reservation()

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        """End a request early (thread-safe); it leaves the batch on the engine's next step
        with a :class:`DoneEvent` whose finish reason is ``reason``: ``"cancelled"`` (the
        client left; counted as a cancellation) or ``"stop"`` (the gateway matched a stop
        string; counted as finished, and its prompt + completion are cached)."""
        self._prefetch.cancel(request_id, reason)
        self.seat.post("cancel", (request_id, reason))

    # The prefix cache, asked for through the engine (its snapshots are MLX arrays:
    # whatever may free them runs on the engine thread).
    def flush_cache(self, cache_group: Optional[str] = None, timeout: float = 60.0) -> int:
        """Drop the unleased prefix-cache snapshots of ``cache_group`` and of its draft
        model's rows (every group when None), on the engine thread; returns how many were
        dropped. Blocks the caller.

        Raises:
            EngineDead, TimeoutError: see :meth:`call`.
        """
        return self.call(lambda: self.prompt_cache.eviction.flush(cache_group), timeout)

    def apply_quotas(self, quotas: Callable[[], dict[str, int]], timeout: float = 60.0) -> Future:
        """Apply per-cache-group byte quotas (bytes; a smaller one evicts snapshots): at once
        on an engine not started yet, else on the engine thread without waiting (safe from
        a signal handler on the event loop). ``quotas()`` is read when they are applied, so
        two calls applied in either order leave the newest table.

        Returns:
            A Future done once they are applied; it holds :class:`EngineDead`,
            :class:`TimeoutError` or the error raised (ValueError: a negative quota).
        """
        if self.seat.started:
            return self.seat.post_call(lambda: self.prompt_cache.eviction.set_quotas(quotas()), timeout)
        done: Future = Future()
        try:
            done.set_result(self.prompt_cache.eviction.set_quotas(quotas()))
        except Exception as e:
            done.set_exception(e)
        return done

    def close_cache(self) -> None:
        """The model is unloaded (after :meth:`stop`): its prefix cache leaves the byte
        budget it shares with the other models' (``cache/budget.py``)."""
        self.prompt_cache.close()

    def set_memory_room(self, room: Callable[[], int]) -> None:
        """Admit requests by predicted memory within ``room()`` bytes (the budget left after
        every model's weights, asked at each admission: :mod:`scheduler.admission.memory`)."""
        self.core.memory.room = room

    def kv_bytes(self, timeout: float = 60.0) -> int:
        """Bytes of the running batch's KV caches (asked on the engine thread; 0 when idle).

        Raises:
            EngineDead, TimeoutError: see :meth:`call`.
        """
        return self.call(self.core.batch.kv_bytes, timeout)

    @property
    def cache_bytes(self) -> int:
        """Bytes the prefix cache holds (thread-safe read)."""
        return self.prompt_cache.nbytes

    @property
    def idle(self) -> bool:
        """No request waiting or running, no next-turn precompute pending (thread-safe)."""
        return self.core.idle

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block until no request is waiting or running; False on timeout."""
        return self.core.wait_idle(timeout)

    def prime_metrics(self, tenants, cache_groups) -> None:
        """Create the per-tenant and per-cache-group series at 0 (thread-safe)."""
        for t in tenants:
            self.metrics.queue_time.labels(t)
            self.metrics.work.labels(t)
        self.prompt_cache.metrics.prime(cache_groups)

    @property
    def num_running(self) -> int:
        """Rows in the batch (a snapshot)."""
        return len(self.core.batch.active)

    @property
    def num_waiting(self) -> int:
        """Requests submitted, not yet admitted or cancelled (thread-safe)."""
        return self.core.num_waiting
