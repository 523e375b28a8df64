"""Metrics by LoRA adapter (names prefixed ``mlx_gateway_lora_``; docs/lora.md).

Labels are bounded: ``model`` is the base model's served name, ``adapter`` a served
adapter's name (from ``--lora-modules``, the models file or an admin's load, never from
request content), at most :data:`MAX_ADAPTER_LABELS` of them over the process's life;
adapters named after that are counted under :data:`OTHER`.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from scheduler.metrics import LATENCY_BUCKETS

MAX_ADAPTER_LABELS = 64
OTHER = "other"  # the adapter label of adapters past MAX_ADAPTER_LABELS
LOAD_RESULTS = ("loaded", "invalid", "no_room", "busy")


class LoraMetrics:
    """Requests, tokens and time to first token per adapter; resident adapters, their bytes
    and their loads per base model; registered on ``registry``."""

    def __init__(self, registry: CollectorRegistry):
        by_adapter = ["model", "adapter"]
        self.requests = Counter("mlx_gateway_lora_requests", "Generation requests run under a LoRA adapter.",
                                by_adapter, registry=registry)
        self.prompt_tokens = Counter("mlx_gateway_lora_prompt_tokens", "Prompt tokens of requests under a LoRA "
                                     "adapter.", by_adapter, registry=registry)
        self.completion_tokens = Counter("mlx_gateway_lora_completion_tokens", "Tokens generated under a LoRA "
                                         "adapter.", by_adapter, registry=registry)
        self.ttft = Histogram("mlx_gateway_lora_time_to_first_token_seconds", "Time from a request's arrival to "
                              "its first token, under a LoRA adapter, seconds (an adapter's read included).",
                              by_adapter, buckets=LATENCY_BUCKETS, registry=registry)
        self.resident = Gauge("mlx_gateway_lora_adapters_resident", "LoRA adapters resident on a base model "
                              "(at most --max-loras).", ["model"], registry=registry)
        self.bytes = Gauge("mlx_gateway_lora_adapter_bytes", "Bytes the resident LoRA adapters of a base model "
                           "hold, charged to it under the memory budget.", ["model"], registry=registry)
        self.loads = Counter("mlx_gateway_lora_loads", "LoRA adapter loads by result: loaded, invalid (400), "
                             "no_room (the memory budget), busy (every slot serving requests: a request waited for one, an admin's "
                             "load was refused).",
                             ["model", "result"], registry=registry)
        self.load_seconds = Histogram("mlx_gateway_lora_load_seconds", "Time to load a LoRA adapter: reading its "
                                      "files (off the engine thread) and installing it (on it), seconds.",
                                      ["model"], buckets=LATENCY_BUCKETS, registry=registry)
        self._lock = threading.Lock()
        self._named: set[str] = set()

    def label(self, adapter: str) -> str:
        """The ``adapter`` label of ``adapter``: itself for the first :data:`MAX_ADAPTER_LABELS`
        names met, :data:`OTHER` after."""
        with self._lock:
            if adapter in self._named:
                return adapter
            if len(self._named) < MAX_ADAPTER_LABELS:
                self._named.add(adapter)
                return adapter
        return OTHER

    def prime(self, model: str, adapter: str) -> None:
        """Create ``adapter``'s series on ``model`` at 0 (and the model's load series)."""
        a = self.label(adapter)
        for c in (self.requests, self.prompt_tokens, self.completion_tokens, self.ttft):
            c.labels(model, a)
        for r in LOAD_RESULTS:
            self.loads.labels(model, r)
        self.load_seconds.labels(model)
        self.resident.labels(model)
        self.bytes.labels(model)
