"""Fair share across tenants: a weighted virtual token counter per tenant.

The rule is the Virtual Token Counter (VTC) of Sheng et al., "Fairness in Serving
Large Language Models" (OSDI 2024): every tenant has a counter of the work it has been
given, in tokens divided by its weight; admission serves the backlogged tenant with the
smallest counter; a tenant that becomes backlogged is lifted to the smallest counter of
the tenants already backlogged, so idling never banks credit. Work is charged as it is
done: the uncached prompt tokens when a request is admitted, each generated token as
it is produced.

With equal weights, a tenant that floods the queue cannot delay another tenant's next
request by more than about one request of its own; with weights ``w_a : w_b``, the work
admitted while both are backlogged follows ``w_a : w_b``.
"""

from __future__ import annotations

from typing import Iterable


class FairShare:
    """Weighted virtual token counters, one per tenant (engine thread only).

    Counters are in weighted tokens (tokens / weight). Weights are taken from each
    charge, so a reloaded tenants file applies to the next request.
    """

    def __init__(self) -> None:
        self._counter: dict[str, float] = {}

    def counter(self, tenant: str) -> float:
        """The tenant's counter (weighted tokens); 0 for a tenant never seen."""
        return self._counter.get(tenant, 0.0)

    def on_backlogged(self, tenant: str, backlogged: Iterable[str]) -> None:
        """``tenant`` has just gone from no waiting request to one.

        Args:
            tenant: the tenant becoming backlogged.
            backlogged: the other tenants that have waiting requests now.

        Lifts its counter to the smallest counter among ``backlogged`` (or, if none,
        to the largest counter known, so that every tenant restarts level).
        """
        others = [self.counter(t) for t in backlogged if t != tenant]
        if others:
            floor = min(others)
        else:
            floor = max(self._counter.values(), default=0.0)
        self._counter[tenant] = max(self.counter(tenant), floor)

    def charge(self, tenant: str, tokens: float, weight: float) -> None:
        """Add ``tokens`` of work done for ``tenant`` at scheduling ``weight`` (> 0)."""
        self._counter[tenant] = self.counter(tenant) + tokens / max(weight, 1e-6)
