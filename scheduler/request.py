"""What the gateway hands the engine, and what the engine sends back."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings.

    ``temperature`` 0 means greedy. ``top_k`` 0 and ``top_p`` 1 disable those filters.
    ``max_tokens`` counts generated tokens. ``top_logprobs`` is how many alternatives
    to report per token (0-20) when ``logprobs`` is set. Penalties of 0 are off; they
    and ``logit_bias`` ((token id, bias) pairs) become mlx-lm logits processors.
    ``ignore_eos``: the model's end tokens do not end the generation (``max_tokens`` and
    the request's stop strings still do).
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    ignore_eos: bool = False


@dataclass
class TokenEvent:
    """One generated token. ``logprob`` and ``top_logprobs`` ((token id, logprob) pairs) are set only when asked for."""

    token: int
    logprob: Optional[float] = None
    top_logprobs: Optional[list[tuple[int, float]]] = None


@dataclass
class PromptEvent:
    """The request's prefill started: ``cached_tokens`` of its prompt came from the prefix
    cache; ``cache_source`` is ``"disk"`` when they were read from its disk tier."""

    cached_tokens: int
    cache_source: str = "memory"


@dataclass
class DoneEvent:
    """The request ended. ``finish_reason`` is ``stop``, ``length`` or ``cancelled``;
    ``cache_written`` is how many prompt tokens past its cached prefix the request
    stored in the prefix cache (tokens)."""

    finish_reason: str
    cache_written: int = 0


@dataclass
class ErrorEvent:
    """The request failed inside the engine; ``status`` is the HTTP status to answer with."""

    status: int
    message: str


@dataclass
class ProgressEvent:
    """Prefill progress: ``done`` of the prompt's ``total`` tokens are in the KV cache
    (cached tokens included)."""

    done: int
    total: int


Event = ProgressEvent | TokenEvent | PromptEvent | DoneEvent | ErrorEvent


@dataclass
class EngineRequest:
    """A tokenized request for the engine.

    Attributes:
        id: unique request id (also used for cancellation).
        tokens: the prompt token ids, ``len >= 1``.
        params: decoding settings.
        sink: called on the engine thread with each batch of events for this request;
            it must not block (the gateway posts them to the event loop). A sink that
            wakes another thread may defer that to the end of the engine's burst of
            deliveries (:func:`wake_after`).
        checkpoints: prompt offsets (tokens, ``0 < offset < len(tokens)``) at which the
            engine saves a prefix-cache snapshot during prefill.
        namespace: the prefix-cache namespace (a tenant's cache group).
        tenant: the tenant name, for fair share, queue bounds and metrics.
        weight: the tenant's scheduling weight (> 0) for fair share.
        max_queued: the most requests of this tenant that may wait for admission
            (None: only the engine's global bound applies).
        mask: the grammar's token mask (:class:`scheduler.grammar.TokenMask`) for
            constrained decoding, or None for free text. Used by this request only.
        priority: its latency class: 0 interactive, 1 standard, 2 batch; lower is served
            first (:mod:`scheduler.admission.policy`).
        keep: prompt offsets (tokens) of cache breakpoints, with the seconds the prefix
            cache keeps each snapshot taken there (each is also in ``checkpoints``).
        processors: further logits processors of this request alone, applied before its
            ``mask`` (e.g. a :class:`scheduler.thinking.ThinkingBudget`).
        adapter: the name of the LoRA adapter it runs under, None for the base model
            (:mod:`scheduler.lora`; the engine moves it into the adapter's cache namespace).
    """

    id: str
    tokens: list[int]
    params: SamplingParams
    sink: Callable[[list[Event]], None]
    checkpoints: list[int] = field(default_factory=list)
    namespace: str = "default"
    tenant: str = "default"
    weight: float = 1.0
    max_queued: Optional[int] = None
    mask: Optional[Any] = None
    priority: int = 1
    keep: dict = field(default_factory=dict)
    processors: list = field(default_factory=list)
    adapter: Optional[str] = None
    arrival: float = field(default_factory=time.monotonic)
    prefix_key: Optional[Any] = field(default=None, repr=False, compare=False)  # set by the policy
    # Monotonic times (s) the engine passed its stages: engine_admitted, engine_restored,
    # engine_prefilled, engine_first_token (written on the engine thread only).
    timings: dict = field(default_factory=dict, repr=False, compare=False)


_bursts = threading.local()  # the calling thread's open burst: its deferred wake-ups


class one_wake_up:
    """A burst of sink calls (the engine opens one around the events of a step): the
    wake-ups sinks defer with :func:`wake_after` run once each when it closes, so a step
    that reaches 32 streams wakes their event loop once rather than as often as it
    drains in between. Nested bursts join the outer one. A wake-up that raises is
    logged (as a sink that raises is) and the others still run."""

    def __enter__(self) -> None:
        self.outer = getattr(_bursts, "wakes", None) is None
        if self.outer:
            _bursts.wakes = []

    def __exit__(self, *exc) -> None:
        if not self.outer:
            return
        wakes, _bursts.wakes = _bursts.wakes, None
        for wake in wakes:
            try:
                wake()
            except Exception:
                logging.getLogger("mlx_gateway.engine").exception("a deferred wake-up raised")


def wake_after(wake: Callable[[], None]) -> bool:
    """Run ``wake`` when the calling thread's burst (:func:`one_wake_up`) closes; False,
    and ``wake`` not kept, when no burst is open (the caller wakes now)."""
    wakes = getattr(_bursts, "wakes", None)
    if wakes is None:
        return False
    wakes.append(wake)
    return True
