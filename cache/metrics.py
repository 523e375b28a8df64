"""Prometheus metrics of the prompt cache, on a caller-supplied ``CollectorRegistry``.

Exposed names (dashboards rely on them; vLLM's ``prefix_cache_queries`` /
``prefix_cache_hits`` are counted in tokens the same way, so
``rate(hits_tokens)/rate(queries_tokens)`` is the token hit rate):

- ``mlx_gateway_prefix_cache_queries_tokens_total{cache_group}`` (counter, tokens looked up)
- ``mlx_gateway_prefix_cache_hits_tokens_total{cache_group}`` (counter, tokens restored)
- ``mlx_gateway_prefix_cache_queries_total{cache_group}`` (counter, fetch calls)
- ``mlx_gateway_prefix_cache_hits_total{cache_group}`` (counter, fetches that restored >= 1 token)
- ``mlx_gateway_prompt_cache_evictions_total{reason}`` (counter; bytes|entries|quota|flush|budget,
  the last for the byte bound shared by every model's cache, ``budget.py``)
- ``mlx_gateway_prompt_cache_bytes{cache_type,cache_group}`` (gauge, bytes)
- ``mlx_gateway_prompt_cache_entries{cache_type,cache_group}`` (gauge, snapshots holding
  at least one layer of that class)
- ``mlx_gateway_prompt_cache_tokens{cache_group}`` (gauge, unique tokens whose KV is held
  in pages; bytes / tokens is the cost per unique token)
- ``mlx_gateway_prompt_cache_quota_bytes{cache_group}`` (gauge, bytes; only groups with a quota)

A cache group is a prefix-cache namespace: the manager's ``namespace`` argument. A
companion namespace (an adapter's, one per load; a draft model's) counts its lookups in
its owner's group, and has gauges only while it holds snapshots: the label set stays bounded.
- ``mlx_gateway_prompt_cache_breakpoints_evicted_total`` (counter: snapshots kept by a
  cache breakpoint that memory forced out before their ttl)
- ``mlx_gateway_prompt_cache_active_leases`` (gauge)
- ``mlx_gateway_prompt_cache_fetch_seconds{phase}`` (histogram, seconds;
  phase lookup|copy|restore)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)


class CacheMetrics:
    """The cache's metric objects, registered on ``registry`` (a fresh private one if None)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        # prometheus-client appends "_total" to counter names.
        self.query_tokens = Counter("mlx_gateway_prefix_cache_queries_tokens",
                                    "Prompt tokens looked up in the prefix cache", ["cache_group"], registry=r)
        self.hit_tokens = Counter("mlx_gateway_prefix_cache_hits_tokens",
                                  "Prompt tokens restored from the prefix cache", ["cache_group"], registry=r)
        self.queries = Counter("mlx_gateway_prefix_cache_queries", "Prefix cache lookups (requests)", ["cache_group"],
                               registry=r)
        self.hits = Counter("mlx_gateway_prefix_cache_hits", "Prefix cache lookups that restored at least one token",
                            ["cache_group"], registry=r)
        self.evictions = Counter("mlx_gateway_prompt_cache_evictions", "Snapshots dropped from the prompt cache",
                                 ["reason"], registry=r)
        self.bytes = Gauge("mlx_gateway_prompt_cache_bytes", "Bytes held by stored snapshots",
                           ["cache_type", "cache_group"], registry=r)
        self.entries = Gauge("mlx_gateway_prompt_cache_entries", "Stored snapshots", ["cache_type", "cache_group"],
                             registry=r)
        self.tokens = Gauge("mlx_gateway_prompt_cache_tokens", "Unique tokens whose KV the prompt cache holds",
                            ["cache_group"], registry=r)
        self.quota = Gauge("mlx_gateway_prompt_cache_quota_bytes", "Byte quota of a cache group", ["cache_group"],
                           registry=r)
        self.kept_evicted = Counter(
            "mlx_gateway_prompt_cache_breakpoints_evicted",
            "Snapshots kept by a cache breakpoint (cache_control) that memory forced out before their ttl",
            registry=r,
        )
        self.leases = Gauge("mlx_gateway_prompt_cache_active_leases",
                            "Snapshots leased by running requests (lease count)", registry=r)
        self.fetch_seconds = Histogram("mlx_gateway_prompt_cache_fetch_seconds", "Time spent in fetch, by phase",
                                       ["phase"], buckets=_BUCKETS, registry=r)
        for reason in ("bytes", "entries", "quota", "flush", "budget"):
            self.evictions.labels(reason=reason)
        for phase in ("lookup", "copy", "restore"):
            self.fetch_seconds.labels(phase=phase)

    def prime(self, cache_groups) -> None:
        """Create the per-group lookup counters at 0 for ``cache_groups``."""
        for g in cache_groups:
            for c in (self.query_tokens, self.hit_tokens, self.queries, self.hits):
                c.labels(cache_group=g)

    def looked_up(self, cache_group: str, tokens: int) -> None:
        """Count one lookup of ``tokens`` tokens in ``cache_group``."""
        self.queries.labels(cache_group=cache_group).inc()
        self.query_tokens.labels(cache_group=cache_group).inc(tokens)

    def fetched(self, cache_group: str, timings: dict[str, float], restored: int) -> None:
        """Record a fetch's phases (``timings``: phase -> seconds) and, when it restored
        ``restored`` > 0 tokens, its hit."""
        for phase, secs in timings.items():
            self.fetch_seconds.labels(phase=phase).observe(secs)
        if restored:
            self.hits.labels(cache_group=cache_group).inc()
            self.hit_tokens.labels(cache_group=cache_group).inc(restored)

    def held(self, cache_group: str, by_type: dict, page_bytes: int, tokens: int, paged_type: str,
             drop_empty: bool = False) -> None:
        """Set ``cache_group``'s gauges: per layer type (``by_type``: type -> (bytes, snapshots))
        its bytes (``paged_type``'s with the group's ``page_bytes``) and snapshots, and its
        unique ``tokens``; with ``drop_empty``, a group that holds nothing loses its series
        instead (so that short-lived groups leave no label behind)."""
        if drop_empty and not tokens and not any(count for _, count in by_type.values()):
            for typ in by_type:
                for gauge in (self.bytes, self.entries):
                    try:
                        gauge.remove(typ, cache_group)
                    except KeyError:
                        pass
            try:
                self.tokens.remove(cache_group)
            except KeyError:
                pass
            return
        for typ, (b, count) in by_type.items():
            paged = page_bytes if typ == paged_type else 0
            self.bytes.labels(cache_type=typ, cache_group=cache_group).set(b + paged)
            self.entries.labels(cache_type=typ, cache_group=cache_group).set(count)
        self.tokens.labels(cache_group=cache_group).set(tokens)
