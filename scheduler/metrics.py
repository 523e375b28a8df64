"""The scheduler's Prometheus metrics (names prefixed ``mlx_gateway_``)."""

from __future__ import annotations

from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Seconds: from 1 ms to 2 minutes, so both 10 ms and 60 s waits land in a bucket.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0,
                   120.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)


class SchedulerMetrics:
    """Queue, batch and token metrics of one engine, registered on ``registry``.

    A labelled metric's children are looked up once and kept (:meth:`work_of`,
    :attr:`queued_of_class`): ``labels()`` takes a lock and builds a key each call, and the
    engine updates them every step.
    """

    def __init__(self, registry: CollectorRegistry):
        gauge, counter, histogram = (partial(kind, registry=registry) for kind in (Gauge, Counter, Histogram))
        self.waiting = gauge("mlx_gateway_requests_waiting", "Requests waiting for admission.")
        self.running = gauge("mlx_gateway_requests_running", "Requests admitted to the engine (prefill or decode).")
        self.queue_time = histogram("mlx_gateway_queue_time_seconds",
                                    "Time from submission to admission into a prefill batch, seconds.", ["tenant"],
                                    buckets=LATENCY_BUCKETS)
        self.gather_wait = histogram(
            "mlx_gateway_gather_wait_seconds",
            "Seconds an idle engine waited for requests the gateway was still preparing "
            "before starting them (--gather-wait).",
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2))
        self.prefill_batch = histogram("mlx_gateway_prefill_batch_size", "Prompts in a prefill step.",
                                       buckets=BATCH_BUCKETS)
        self.decode_batch = histogram("mlx_gateway_decode_batch_size", "Sequences in a decode step.",
                                      buckets=BATCH_BUCKETS)
        self.prefill_tokens = counter("mlx_gateway_prefill_tokens",
                                      "Prompt tokens computed by the model (cache hits excluded).")
        self.decode_tokens = counter("mlx_gateway_decode_tokens", "Tokens generated.")
        self.prefill_rate = gauge("mlx_gateway_prefill_tokens_per_second",
                                  "Prompt tokens computed per second over the last second of work (0 when idle).")
        self.decode_rate = gauge("mlx_gateway_decode_tokens_per_second",
                                 "Tokens generated per second over the last second of work (0 when idle).")
        self.prefill_remaining = gauge("mlx_gateway_prefill_remaining_tokens",
                                       "Prompt tokens of admitted requests still to be prefilled.")
        self.work = counter(
            "mlx_gateway_scheduled_work_tokens",
            "Work given to a tenant by the fair-share scheduler: uncached prompt tokens at "
            "admission plus generated tokens (unweighted).",
            ["tenant"])
        self.grouping_saved_tokens = counter(
            "mlx_gateway_shared_prefix_saved_tokens",
            "Prompt tokens not recomputed because a request waited for a shared prefix "
            "that another request in its burst was prefilling.")
        self.memory_refused = counter(
            "mlx_gateway_memory_refused",
            "Requests answered 503 because their predicted memory (prompt + max_tokens of KV) cannot fit the "
            "memory budget even alone.")
        self.memory_waits = counter(
            "mlx_gateway_memory_waits",
            "Admission rounds in which the next request waited for running rows to end: its predicted memory "
            "did not fit beside theirs.")
        self.preemptions = counter(
            "mlx_gateway_preemptions",
            "Decoding rows whose reservation could not grow (scheduler/admission/preemption.py), by the row's "
            "latency class and outcome: requeued (its KV into the prefix cache, its request back at the head of "
            "the waiting queue) or length (alone, it ended with finish_reason length).",
            ["priority", "outcome"])
        self.preemption_resumes = counter(
            "mlx_gateway_preemption_resumes",
            "Preempted requests put back into the batch, by how their KV came back: cache (the prefix cache "
            "restored all of it) or recompute (some of it was prefilled again).", ["how"])
        self.cancelled = counter("mlx_gateway_requests_cancelled",
                                 "Requests cancelled before they finished because the client left.")
        self.queued_by_class = gauge(
            "mlx_gateway_requests_queued_by_class",
            "Requests waiting for admission or paused (their prefill or decoding), by latency class "
            "(priority: 0 interactive, 1 standard, 2 batch).",
            ["priority"])
        self.pauses = counter(
            "mlx_gateway_prefill_pauses",
            "Prefills paused between two chunks for a better latency class (their KV kept), "
            "by the paused row's class.", ["priority"])
        self.resumes = counter("mlx_gateway_prefill_resumes", "Paused prefills put back into the batch, by class.",
                               ["priority"])
        self.decode_holds = counter(
            "mlx_gateway_decode_holds",
            "Engine steps in which the decoding rows (all of lower latency classes) waited "
            "while an interactive prompt prefilled alone.")
        self.decode_pauses = counter(
            "mlx_gateway_decode_pauses",
            "Decoding requests taken out of a full decode batch for a request of a better "
            "latency class (their state kept; they go on later), by the paused request's class.",
            ["priority"])
        for c in ("0", "1", "2"):
            self.decode_pauses.labels(c)
            self.pauses.labels(c)
            self.resumes.labels(c)
        self.queued_of_class = tuple(self.queued_by_class.labels(c) for c in ("0", "1", "2"))  # by class
        self._work_of: dict = {}
        self._published: tuple = (None,) * 6  # what publish_queue last set
        self.draft_tokens = counter(
            "mlx_gateway_speculative_draft_tokens",
            "Tokens drafted for speculative decoding (--speculative) and verified.")
        self.accepted_tokens = counter(
            "mlx_gateway_speculative_accepted_tokens",
            "Drafted tokens the model accepted (each one a decode step saved).")
        self.verify_steps = counter("mlx_gateway_speculative_verify_steps",
                                    "Decode steps that verified drafts (a [B, 1 + K] forward).")
        self.repeat_first_tokens = counter(
            "mlx_gateway_repeat_first_tokens",
            "Exact repeats of a recent prompt whose first token was sampled from the "
            "log-probabilities kept after its earlier run, with no forward (scheduler.batch.first_tokens).")
        self.first_token_store_bytes = gauge(
            "mlx_gateway_first_token_store_bytes",
            "Bytes of log-probabilities kept for the first tokens of exact repeats "
            "(at most scheduler.batch.first_tokens.MAX_BYTES).")
        self.engine_errors = counter("mlx_gateway_engine_step_errors",
                                     "Engine steps that raised; the requests in that step failed.")

    def work_of(self, tenant: str):
        """The :attr:`work` counter of ``tenant`` (its child, made on first use and kept)."""
        child = self._work_of.get(tenant)
        if child is None:
            child = self._work_of[tenant] = self.work.labels(tenant)
        return child

    def publish_queue(self, prefill_remaining: int, running: int, waiting: int, queued: dict[int, int]) -> None:
        """Set the queue gauges: prompt tokens left to prefill, requests running, requests
        waiting, and ``queued`` (waiting or paused requests by latency class 0-2); each
        one only when its value changed since the last call (the engine calls this every
        turn, a scrape reads the same values)."""
        values = (prefill_remaining, running, waiting, queued.get(0, 0), queued.get(1, 0), queued.get(2, 0))
        if values == self._published:
            return
        gauges = (self.prefill_remaining, self.running, self.waiting, *self.queued_of_class)
        for gauge, old, new in zip(gauges, self._published, values):
            if old != new:
                gauge.set(new)
        self._published = values
