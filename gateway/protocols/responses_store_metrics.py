"""The metrics of the Responses API's stored responses, read at scrape time from what the
store's last operations reported (no store I/O during a scrape):

- ``mlx_gateway_responses_stored`` (gauge, tenant): stored responses;
- ``mlx_gateway_responses_stored_bytes`` (gauge, tenant): their bytes (JSON);
- ``mlx_gateway_responses_evictions_total`` (counter, tenant): entries evicted by the bounds;
- ``mlx_gateway_responses_store_failures_total`` (counter, operation: put, get, delete):
  store calls that failed (the response was answered unstored, or the lookup with 503);
- ``mlx_gateway_responses_torn_total`` (counter): damaged entries found and dropped (at
  start, when a file store is checked, or on a read).

A tenant's gauges are those of its last store operation on this replica (with a shared
store, other replicas' writes show after this replica's next operation for that tenant).
Every configured tenant has its series from the start.
"""

from __future__ import annotations

from typing import Callable, Iterable

OPERATIONS = ("put", "get", "delete")


class StoreMetrics:
    """The counters and gauges above, as a prometheus-client collector; the store updates
    ``totals`` (tenant -> (count, bytes)), ``evictions`` (tenant -> n), ``failures``
    (operation -> n) and ``torn``; ``tenants()`` names the tenants always shown."""

    def __init__(self, tenants: Callable[[], Iterable[str]] = tuple):
        self.tenants = tenants
        self.totals: dict[str, tuple[int, int]] = {}
        self.evictions: dict[str, int] = {}
        self.failures: dict[str, int] = {op: 0 for op in OPERATIONS}
        self.torn = 0

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        names = sorted(set(self.tenants()) | set(self.totals) | set(self.evictions))
        count = GaugeMetricFamily("mlx_gateway_responses_stored",
                                  "Stored Responses API responses, per tenant.", labels=["tenant"])
        nbytes = GaugeMetricFamily("mlx_gateway_responses_stored_bytes",
                                   "Bytes (JSON) of the stored responses, per tenant.", labels=["tenant"])
        evicted = CounterMetricFamily("mlx_gateway_responses_evictions",
                                      "Stored responses evicted by the per-tenant bounds (least recently used "
                                      "first).", labels=["tenant"])
        for name in names:
            c, b = self.totals.get(name, (0, 0))
            count.add_metric([name], c)
            nbytes.add_metric([name], b)
            evicted.add_metric([name], self.evictions.get(name, 0))
        failures = CounterMetricFamily("mlx_gateway_responses_store_failures",
                                       "Response store calls that failed: put (the response was answered "
                                       "with store false), get and delete (answered with 503).",
                                       labels=["operation"])
        for op, n in sorted(self.failures.items()):
            failures.add_metric([op], n)
        torn = CounterMetricFamily("mlx_gateway_responses_torn",
                                   "Damaged stored responses found and dropped (at start or on a read).",
                                   value=self.torn)
        yield from (count, nbytes, evicted, failures, torn)

    def describe(self):
        return []
