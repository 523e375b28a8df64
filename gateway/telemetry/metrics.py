"""The gateway's request metrics (names prefixed ``mlx_gateway_``).

Labels are bounded: ``endpoint`` and ``status`` come from the routes, ``api`` is one of
:data:`APIS`, ``model`` is the served model, ``tenant`` comes from configuration; none
comes from request content.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from gateway.telemetry.lora_metrics import LoraMetrics
from gateway.tenancy.tenants import PRIORITIES
from scheduler.metrics import LATENCY_BUCKETS

# Time per output token, seconds: 1 ms to 2 s.
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)


class GatewayMetrics:
    """Request counts, latencies and token counters, registered on ``registry``."""

    def __init__(self, registry: CollectorRegistry):
        registry.register(MLXMemoryCollector())
        self.requests = Counter("mlx_gateway_requests", "Requests answered, by endpoint and HTTP status.",
                                ["tenant", "model", "endpoint", "status"], registry=registry)
        self.ttft = Histogram("mlx_gateway_time_to_first_token_seconds",
                              "Time from request arrival to its first generated token, seconds.",
                              ["tenant", "model", "api"], buckets=LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram("mlx_gateway_request_duration_seconds",
                             "Time from request arrival to its last token, seconds.", ["tenant", "model", "api"],
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.tpot = Histogram("mlx_gateway_time_per_output_token_seconds",
                              "Mean time between generated tokens of a request after the first, seconds.",
                              ["tenant", "model", "api"], buckets=TPOT_BUCKETS, registry=registry)
        self.prompt_tokens = Counter("mlx_gateway_prompt_tokens", "Prompt tokens of admitted requests.",
                                     ["tenant", "model", "api"], registry=registry)
        self.cached_tokens = Counter("mlx_gateway_cached_tokens", "Prompt tokens restored from the prefix cache.",
                                     ["tenant", "model", "api"], registry=registry)
        self.cache_misses = Counter("mlx_gateway_cache_misses",
                                    "Requests whose prompt left the prefix cache before its new content, by cause "
                                    "(gateway/telemetry/cache_explain.py CAUSES).", ["tenant", "model", "cause"],
                                    registry=registry)
        self.completion_tokens = Counter("mlx_gateway_completion_tokens", "Generated tokens.",
                                         ["tenant", "model", "api"], registry=registry)
        self.generations = Counter("mlx_gateway_generations",
                                   "Generations by how they ended (finish_reason): stop (end of sequence or a stop "
                                   "string), length, tool_calls, cancelled (the client left first) or error.",
                                   ["tenant", "model", "api", "finish_reason"], registry=registry)
        self.class_ttft = Histogram("mlx_gateway_class_time_to_first_token_seconds",
                                    "Time from request arrival to its first generated token, by latency class, seconds.",
                                    ["model", "priority"], buckets=LATENCY_BUCKETS, registry=registry)
        self.inter_token = Histogram("mlx_gateway_inter_token_seconds",
                                     "Time between two consecutive generated tokens of a request, by latency class, "
                                     "seconds.", ["model", "priority"], buckets=TPOT_BUCKETS, registry=registry)
        self.origin_refused = Counter("mlx_gateway_origin_refused", "Requests with a valid key refused (403) because "
                                      "their Origin is not one the key is bound to.", ["tenant"], registry=registry)
        self.rate_limited = Counter("mlx_gateway_rate_limited", "Requests refused with 429, by the limit they hit "
                                    "(requests|prompt_tokens|completion_tokens|concurrency|queue).",
                                    ["tenant", "limit"], registry=registry)
        # By modality: image input of the generating APIs, and embeddings.
        self.image_requests = Counter("mlx_gateway_image_requests", "Generation requests with at least one image.",
                                      ["tenant", "model", "api"], registry=registry)
        self.images = Counter("mlx_gateway_images", "Images received in generation requests.",
                              ["tenant", "model", "api"], registry=registry)
        self.image_tokens = Counter(
            "mlx_gateway_image_tokens", "Prompt tokens that stand for images (included in prompt_tokens).",
            ["tenant", "model", "api"], registry=registry)
        self.images_refused = Counter(
            "mlx_gateway_images_refused",
            "Requests refused for their images, by reason (too_large|too_many_pixels|too_many_images|"
            "malformed|fetch|not_vision|rate_limited).", ["tenant", "reason"], registry=registry)
        self.embedding_inputs = Counter("mlx_gateway_embedding_inputs", "Inputs embedded by /v1/embeddings.",
                                        ["tenant", "model"], registry=registry)
        self.embedding_tokens = Counter(
            "mlx_gateway_embedding_tokens", "Tokens of the inputs embedded by /v1/embeddings.",
            ["tenant", "model"], registry=registry)
        self.lora = LoraMetrics(registry)  # by LoRA adapter


IMAGE_REFUSALS = ("too_large", "too_many_pixels", "too_many_images", "malformed", "fetch", "not_vision",
                  "rate_limited")
RATE_LIMITS = ("requests", "prompt_tokens", "completion_tokens", "concurrency", "queue", "image_tokens")
# The ``api`` label: which protocol a generation came in on.
APIS = ("chat", "completions", "messages", "responses", "ollama")
# The ``finish_reason`` label of ``mlx_gateway_generations_total``.
FINISH_REASONS = ("stop", "length", "tool_calls", "cancelled", "error")


def prime(metrics: GatewayMetrics, tenants, model: str) -> None:
    """Create every (tenant, model, api) and (tenant, limit) series at 0, so that a counter's
    first increase is visible to ``rate()`` and dashboards show 0 rather than no data.

    Args:
        tenants: the configured tenant names (bounded: from configuration only).
    """
    for t in tenants:
        for c in (metrics.prompt_tokens, metrics.cached_tokens, metrics.completion_tokens):
            for api in APIS:
                c.labels(t, model, api)
        for api in APIS:
            for reason in FINISH_REASONS:
                metrics.generations.labels(t, model, api, reason)
        for limit in RATE_LIMITS:
            metrics.rate_limited.labels(t, limit)
        metrics.origin_refused.labels(t)
        for api in APIS:
            for c in (metrics.image_requests, metrics.images, metrics.image_tokens):
                c.labels(t, model, api)
        for reason in IMAGE_REFUSALS:
            metrics.images_refused.labels(t, reason)
        metrics.embedding_inputs.labels(t, model)
        metrics.embedding_tokens.labels(t, model)
    for p in PRIORITIES:
        metrics.class_ttft.labels(model, p)
        metrics.inter_token.labels(model, p)


class MLXMemoryCollector:
    """``mlx_gateway_mlx_memory_bytes{kind}``: MLX's allocator, read at scrape time.

    ``kind`` is ``active`` (``mx.get_active_memory()``: bytes in live arrays), ``peak``
    (``mx.get_peak_memory()``: the highest active since start) or ``cache``
    (``mx.get_cache_memory()``: freed buffers MLX keeps for reuse). On the CPU backend
    these count the same allocator as on Metal.

    Read on the scraping thread, not the engine's: each is a plain read of a counter the
    allocator keeps (no device, stream or array is touched), so a scrape never waits for
    an engine step and never races one.
    """

    def collect(self):
        import mlx.core as mx
        from prometheus_client.core import GaugeMetricFamily

        g = GaugeMetricFamily("mlx_gateway_mlx_memory_bytes", "MLX allocator memory, bytes.", labels=["kind"])
        for kind, read in (("active", mx.get_active_memory), ("peak", mx.get_peak_memory),
                           ("cache", mx.get_cache_memory)):
            g.add_metric([kind], float(read()))
        yield g

    def describe(self):
        return []
