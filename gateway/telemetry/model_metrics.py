"""Metrics of the served models: the registry's own series, and each loaded model's
engine, prefix-cache and disk-tier series under a ``model`` label.

The scheduler and the cache know nothing of models: each engine registers its metrics on
a registry of its own (:meth:`PerModelCollector.add`), and :class:`PerModelCollector`
re-labels them at scrape time, merging the series of one name across models. A model
that is unloaded takes its series with it; its counters start again from 0 when it is
loaded again (Prometheus's ``rate()`` treats that as a counter reset).
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import Metric

# Seconds: a tiny model loads in well under a second, a large one over a minute.
LOAD_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
# Why a model was unloaded: the memory budget or --max-loaded-models needed room (lru),
# its keep_alive ran out, an admin asked, or the server stopped.
UNLOAD_REASONS = ("lru", "keep_alive", "admin", "failed")


class PerModelCollector:
    """Collects each model's private registry, adding ``model="<name>"`` to every sample."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._registries: dict[str, CollectorRegistry] = {}

    def add(self, model: str, registry: CollectorRegistry) -> None:
        with self._lock:
            self._registries[model] = registry

    def remove(self, model: str) -> None:
        with self._lock:
            self._registries.pop(model, None)

    def collect(self):
        with self._lock:
            registries = list(self._registries.items())
        merged: dict[str, Metric] = {}
        for model, registry in registries:
            for family in registry.collect():
                out = merged.get(family.name)
                if out is None:
                    out = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                for s in family.samples:
                    out.add_sample(s.name, {**s.labels, "model": model}, s.value, s.timestamp, s.exemplar)
        yield from merged.values()

    def describe(self):
        return []


class ModelMetrics:
    """``mlx_gateway_model_loaded{model}`` (1 loaded, 0 not), ``..._model_state{model,state}``,
    ``..._model_load_seconds{model}``, ``..._model_unloads_total{model,reason}``,
    ``..._model_weights_bytes{model}``, ``..._model_requests_in_flight{model}`` and
    ``..._memory_budget_bytes``, plus every loaded model's own series (see the module docstring)."""

    def __init__(self, registry: CollectorRegistry, models: list[str]):
        self.per_model = PerModelCollector()
        registry.register(self.per_model)
        self.loaded = Gauge("mlx_gateway_model_loaded", "1 while the model is loaded, else 0.", ["model"],
                            registry=registry)
        self.load_seconds = Histogram("mlx_gateway_model_load_seconds", "Seconds a model took to load.",
                                      ["model"], buckets=LOAD_BUCKETS, registry=registry)
        self.unloads = Counter("mlx_gateway_model_unloads", "Models unloaded, by reason (lru: the memory budget "
                               "or --max-loaded-models needed room; keep_alive; admin; failed: its engine "
                               "stopped).", ["model", "reason"], registry=registry)
        self.weights = Gauge("mlx_gateway_model_weights_bytes", "Bytes of a loaded model's weights.", ["model"],
                             registry=registry)
        self.in_flight = Gauge("mlx_gateway_model_requests_in_flight",
                               "Requests holding the model (loading it, queued or generating).", ["model"],
                               registry=registry)
        self.budget = Gauge("mlx_gateway_memory_budget_bytes",
                            "The memory budget of the loaded models (weights, running KV, prefix caches).",
                            registry=registry)
        for m in models:
            self.loaded.labels(m).set(0)
            self.load_seconds.labels(m)
            self.weights.labels(m).set(0)
            self.in_flight.labels(m).set(0)
            for reason in UNLOAD_REASONS:
                self.unloads.labels(m, reason)
