"""Stored responses of the Responses API, per tenant, in memory.

Each tenant has its own least-recently-used table, bounded by a number of responses and
by bytes (the JSON size of what is kept). An entry keeps the response object (for
``GET /v1/responses/{id}``) and the conversation up to and including it as input items
(for ``previous_response_id``): the previous chain is flattened when the entry is
stored, so continuing from it is one lookup.

Lookups are by (tenant name, id): a tenant never sees another tenant's entries, and a
foreign id looks exactly like a missing one. The store is used from the event loop only
(no locks) and never touches MLX.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

DEFAULT_MAX_RESPONSES = 1000
DEFAULT_MAX_BYTES = 64 * 2**20


@dataclass
class StoredResponse:
    """A stored response: ``response`` is the object as returned, ``items`` the whole
    conversation (input items and its own output items), ``size`` its JSON bytes."""

    response: dict
    items: list[dict]
    size: int


def json_size(value) -> int:
    """Bytes of ``value`` as compact UTF-8 JSON."""
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())


class ResponseStore:
    """Per-tenant LRU tables of :class:`StoredResponse`.

    ``max_responses`` (count) and ``max_bytes`` (JSON bytes) bound each tenant's table;
    storing past either evicts that tenant's least recently used entries.

    Raises:
        ValueError: from the constructor, for a bound below 1.
    """

    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_responses < 1 or max_bytes < 1:
            raise ValueError("the response store's bounds must be at least 1")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._tables: dict[str, OrderedDict[str, StoredResponse]] = {}
        self._bytes: dict[str, int] = {}

    def put(self, tenant: str, response: dict, items: list[dict]) -> bool:
        """Store ``response`` (keyed by its ``id``) with its conversation ``items``,
        evicting the tenant's least recently used entries to stay within the bounds.
        Returns False (nothing stored) when the entry alone is over ``max_bytes``."""
        rid = response["id"]
        entry = StoredResponse(response, items, json_size(response) + json_size(items))
        self.delete(tenant, rid)
        if entry.size > self.max_bytes:
            return False
        table = self._tables.setdefault(tenant, OrderedDict())
        table[rid] = entry
        self._bytes[tenant] = self._bytes.get(tenant, 0) + entry.size
        while len(table) > self.max_responses or self._bytes[tenant] > self.max_bytes:
            _, old = table.popitem(last=False)
            self._bytes[tenant] -= old.size
        return True

    def get(self, tenant: str, rid: str) -> Optional[StoredResponse]:
        """The tenant's entry ``rid`` (now its most recently used), or None."""
        table = self._tables.get(tenant)
        entry = table.get(rid) if table is not None else None
        if entry is not None:
            table.move_to_end(rid)
        return entry

    def delete(self, tenant: str, rid: str) -> bool:
        """Forget the tenant's entry ``rid``; False when it has none."""
        table = self._tables.get(tenant)
        entry = table.pop(rid, None) if table is not None else None
        if entry is None:
            return False
        self._bytes[tenant] -= entry.size
        if not table:
            del self._tables[tenant], self._bytes[tenant]
        return True

    def count(self, tenant: str) -> int:
        """How many responses the tenant has stored."""
        return len(self._tables.get(tenant, ()))

    def size(self, tenant: str) -> int:
        """The JSON bytes of the tenant's stored responses."""
        return self._bytes.get(tenant, 0)
