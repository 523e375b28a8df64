"""Setting up the tenants' limits from the command line: ``--limits-store URL`` checked
before anything starts, the limiter it asks for, and the store's up gauge. The store
itself is :mod:`gateway.tenancy.limits_store`.
"""

from __future__ import annotations

from typing import Callable, Optional

from gateway.tenancy.limits import Limiter
from gateway.tenancy.limits_store import RedisLimitsStore
from gateway.tenancy.limits_url import check_url


class StoreUpCollector:
    """``mlx_gateway_limits_store_up``: 1 while the shared limits store is used, 0 while each
    gateway applies the limits on its own (read at scrape time)."""

    def __init__(self, store: RedisLimitsStore):
        self.store = store

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        yield GaugeMetricFamily("mlx_gateway_limits_store_up",
                                "1 while the shared limits store (--limits-store) answers, 0 while each "
                                "gateway applies the tenants' limits on its own.",
                                value=1.0 if self.store.up else 0.0)

    def describe(self):
        return []


def check_limits_store(config) -> None:
    """Check ``config.limits_store`` (if any) before anything starts; nothing is contacted.

    Raises:
        ValueError: see :func:`check_url`.
    """
    if config.limits_store:
        check_url(config.limits_store)


def make_limiter(config, registry=None, on_limited: Optional[Callable[[str, str], None]] = None,
                 **store_options) -> Limiter:
    """The limiter ``config`` asks for: shared through ``config.limits_store`` (its up gauge
    registered on ``registry``), else this process's own.

    Raises:
        ValueError: see :func:`check_url`.
    """
    store = RedisLimitsStore(config.limits_store, **store_options) if config.limits_store else None
    limiter = Limiter(on_limited, store=store) if on_limited is not None else Limiter(store=store)
    if store is not None and registry is not None:
        registry.register(StoreUpCollector(store))
    return limiter
