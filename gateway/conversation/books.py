"""The books of one generation, kept beside its events by :class:`Books`, the observer
of a :class:`~gateway.conversation.run.Run`: the tenant's charges (prompt, image and
completion tokens; ``image_tokens_per_minute`` bounds the tokens that stand for images,
refilled over :data:`IMAGE_TOKEN_WINDOW`), usage, metrics (labelled by ``model`` and
``api``), the request log record and the next turn's precompute."""

from __future__ import annotations

import itertools
import math
import threading
import time
import uuid
from typing import Optional

from gateway.conversation.generation import Generation
from gateway.conversation.next_turn import schedule_next_turn
from gateway.conversation.prompts import Prompt
from gateway.front import Call
from gateway.http.errors import APIError
from gateway.models.handle import ModelHandle
from gateway.telemetry.cache_explain import Explanation
from gateway.tenancy.limits import TokenBucket
from scheduler.request import PromptEvent

IMAGE_TOKEN_WINDOW = 60.0  # seconds: image_tokens_per_minute refills over a minute

_ids = itertools.count()  # numbers the requests' ids
_buckets: dict[str, TokenBucket] = {}  # tenant -> its image-token bucket (this process)
_lock = threading.Lock()


class Books:
    """What one generation is booked as. Its outcome is booked once (:meth:`settle`), in
    the request log record, the metrics and the tenant's usage alike: the engine's reason
    (``stop``, ``length``), ``stop`` for a stop string, ``tool_calls`` when the answer is
    tool calls, ``error`` when it failed, and ``cancelled`` when the client left (or the
    answer was dropped) before it ended."""

    def __init__(self, call: Call, model: ModelHandle, prompt: Prompt, why: Optional[Explanation] = None):
        self.call, self.model, self.prompt, self.why = call, model, prompt, why
        self.labels = (call.tenant.name, model.name, call.api)
        self.lora = None if call.adapter is None else (model.name, call.front.metrics.lora.label(call.adapter))
        self.request_id = f"req-{next(_ids)}-{uuid.uuid4().hex[:8]}"
        self.gen: Optional[Generation] = None  # once submitted
        self.completion = 0  # tokens generated
        self.finish = "stop"  # how it ended; meaningful once ``ended``
        self.ended = False  # the generation ended by itself: done, a stop string, or an error
        self.error_status: Optional[int] = None
        self.settled = False
        self.first_at: Optional[float] = None  # monotonic seconds of the first token
        self.last_at = 0.0  # monotonic seconds of the latest token

    def charge(self) -> None:
        """Charge the prompt's tokens to the tenant (count its images and charge theirs),
        then record the request as it goes to the engine.

        Raises:
            APIError: 413/429 from the tenant's prompt-token limit; 413
                ``image_tokens_exceeded`` for more image tokens than its
                ``image_tokens_per_minute``, 429 ``rate_limit_exceeded`` (with
                ``Retry-After``) over it.
        """
        self.call.ticket.charge_prompt(len(self.prompt.tokens))
        if self.prompt.images:
            self._charge_images()
        rec = self.call.record
        rec.request_id = self.request_id
        rec.prompt_tokens = len(self.prompt.tokens)
        if self.call.front.config.log_prompts:
            rec.prompt = self.model.tokenizer.decode(self.prompt.tokens)
        rec.marks["submitted"] = time.monotonic()
        if self.why is not None:
            self.why.request_id = self.request_id
            self.call.front.explainer.keep(self.why)

    def _charge_images(self) -> None:
        tenant, m, images = self.call.tenant, self.call.front.metrics, self.prompt.images
        n = sum(im.tokens for im in images)
        limit = tenant.image_tokens_per_minute
        if limit:
            now = time.monotonic()
            with _lock:
                bucket = _buckets.get(tenant.name)
                if bucket is None:
                    bucket = _buckets[tenant.name] = TokenBucket(limit, limit / IMAGE_TOKEN_WINDOW, now)
                elif bucket.capacity != limit:
                    bucket.resize(limit, limit / IMAGE_TOKEN_WINDOW)
                if n > bucket.capacity:
                    m.images_refused.labels(tenant.name, "rate_limited").inc()
                    raise APIError(413, f"the request's images take {n} tokens; this key's image_tokens_per_minute "
                                   f"is {limit}", param="messages", code="image_tokens_exceeded")
                wait = bucket.wait_for(n, now)
                if wait > 0:
                    m.images_refused.labels(tenant.name, "rate_limited").inc()
                    m.rate_limited.labels(tenant.name, "image_tokens").inc()
                    raise APIError(429, f"image token limit reached ({limit} per minute): retry in "
                                   f"{math.ceil(wait)} s", code="rate_limit_exceeded",
                                   headers={"Retry-After": str(max(1, math.ceil(wait)))})
                bucket.take(n)
        m.image_requests.labels(*self.labels).inc()
        m.images.labels(*self.labels).inc(len(images))
        m.image_tokens.labels(*self.labels).inc(n)

    def refused(self, e: APIError) -> None:
        """Count the engine's refusal: a 429 (the tenant's queue is full)."""
        if e.status == 429:
            self.call.front.metrics.rate_limited.labels(self.call.tenant.name, "queue").inc()

    def prompt_read(self, ev: PromptEvent) -> None:
        """The engine has the prompt: queue time, cache reads, prompt usage."""
        call, gen, n = self.call, self.gen, len(self.prompt.tokens)
        rec, m = call.record, call.front.metrics
        rec.queue_seconds = time.monotonic() - gen.arrival
        rec.cached_tokens = ev.cached_tokens
        rec.cache_source = ev.cache_source if ev.cached_tokens else None
        m.prompt_tokens.labels(*self.labels).inc(n)
        m.cached_tokens.labels(*self.labels).inc(ev.cached_tokens)
        if self.lora is not None:
            m.lora.requests.labels(*self.lora).inc()
            m.lora.prompt_tokens.labels(*self.lora).inc(n)
        call.front.usage.add(call.tenant.name, prompt=n, cached=ev.cached_tokens)
        if self.why is not None:
            self.why.cached_tokens = ev.cached_tokens
            if ev.cached_tokens > self.why.at:  # stored after it was explained (while it waited)
                if self.why.cause != "none":
                    self.why.cause, self.why.detail = "none", "stored while it waited"
                self.why.at = ev.cached_tokens
            call.front.explainer.count(self.why)
            rec.cache_miss = self.why.record(texts=call.front.config.log_prompts)

    def seen(self, reply: str) -> None:
        """The generation ended with ``reply``: later requests of its cache group are compared with it."""
        self.call.front.explainer.seen(self.model.name, self.gen.request.namespace, self.prompt.tokens,
                                       self.prompt.messages, reply, self.prompt.template_kwargs.get("tools"))

    def token(self) -> None:
        """One more token: time to first token, inter-token time, the completion charge."""
        call, gen, m = self.call, self.gen, self.call.front.metrics
        now = time.monotonic()
        if self.first_at is None:
            self.first_at = now
            rec = call.record
            rec.marks["first_token"] = now
            rec.marks.update(gen.request.timings)  # the engine's marks, all set by now
            rec.ttft_seconds = now - gen.arrival
            m.ttft.labels(*self.labels).observe(now - gen.arrival)
            m.class_ttft.labels(self.model.name, call.priority).observe(now - gen.arrival)
            if self.lora is not None:
                m.lora.ttft.labels(*self.lora).observe(now - gen.arrival)
            self._inter_token = m.inter_token.labels(self.model.name, call.priority)  # (looked up once)
        else:
            self._inter_token.observe(now - self.last_at)
        self.last_at = now
        self.completion += 1
        call.ticket.charge_completion(1)

    def end(self, reason: str, error_status: Optional[int] = None) -> None:
        """The generation ended by itself, with ``reason`` (first call wins)."""
        if not self.ended:
            self.ended, self.finish = True, reason
        if error_status is not None:
            self.error_status = error_status

    def next_turn(self, reply: str) -> None:
        """Precompute the next turn's prefix after ``reply`` (when configured; never raises)."""
        t, front = self.call.tenant, self.call.front
        if front.config.precompute_next_turn and not front.draining:
            # under the request's namespace: an adapter's own (scheduler.lora) or the tenant's group
            schedule_next_turn(self.model, self.prompt, reply, self.gen.request.namespace, t.name)

    def settle(self) -> None:
        """Book the outcome once (idempotent): completion tokens, ``finish_reason`` and
        timings in the request record, the metrics and the tenant's usage. Runs when the
        answer ends, or when the request's log line is written, whichever comes first; a
        generation that has not ended by then was left by its client and is cancelled."""
        if self.settled:
            return
        self.settled = True
        self.gen.cancel()
        call, n = self.call, self.completion
        rec, m = call.record, call.front.metrics
        if self.ended:
            outcome = self.finish
        else:  # dropped before it ended: the client left, or the answer failed on the way out
            outcome = "error" if rec.status >= 500 else "cancelled"
        rec.completion_tokens = n
        rec.finish_reason = outcome
        if self.error_status is not None:
            rec.error_status = self.error_status
        m.completion_tokens.labels(*self.labels).inc(n)
        m.generations.labels(*self.labels, outcome).inc()
        if self.lora is not None:
            m.lora.completion_tokens.labels(*self.lora).inc(n)
        call.front.usage.add(call.tenant.name, completion=n)
        if self.first_at is not None:
            now = time.monotonic()
            m.e2e.labels(*self.labels).observe(now - self.gen.arrival)
            if n > 1:
                m.tpot.labels(*self.labels).observe((now - self.first_at) / (n - 1))
