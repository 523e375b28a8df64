"""OpenAI Responses API: the input items of ``GET /v1/responses/{id}/input_items`` (the
route is in ``responses.py``), the items a stored response was generated from, as a
cursor-paginated list.

A response's input items are the whole conversation before its own output: the items
of every response its ``previous_response_id`` chain goes back through (their inputs and
outputs), then its own ``input``. Each is listed in the shape OpenAI lists them in: a
message with ``id``, ``status`` and a list of content parts (a plain-string content
becomes one ``input_text`` part, ``output_text`` for an assistant), the other items
(``function_call``, ``function_call_output``, ``reasoning``) as given, with an ``id``.

Input items get their ids when the response that first carried them is created
(:func:`with_ids`), so an item keeps its id along a chain and a page cursor (``after``)
stays valid.
"""

from __future__ import annotations

from gateway.http.errors import APIError
from gateway.protocols.responses_events import object_id
from gateway.protocols.responses_store import StoredResponse

# Id prefixes of input items that came without one (OpenAI's, where it has one).
ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
# ``limit``'s range and default (OpenAI's).
MAX_LIMIT, DEFAULT_LIMIT = 100, 20


def with_ids(items: list[dict]) -> list[dict]:
    """``items`` (input items as stored) with an ``id`` given to each one that has none."""
    return [it if it.get("id") else {**it, "id": object_id(ID_PREFIX.get(it.get("type", "message"), "item"))}
            for it in items]


def check_unique_ids(history: list[dict], items: list[dict]) -> None:
    """Refuse an input item whose id is already in the conversation (``history``, the
    ``previous_response_id`` chain's items, or an earlier input item), as OpenAI does: a
    list cursor (``after``) names an item by its id.

    Raises:
        APIError: 400 naming the id (param ``input``).
    """
    seen = {it.get("id") for it in history}
    for it in items:
        if it["id"] in seen:
            raise APIError(400, f"Duplicate item found with id {it['id']}. Remove duplicate items from your "
                                "input and try again.", param="input")
        seen.add(it["id"])


def listed(item: dict) -> dict:
    """One stored input item in the list's shape (see the module docstring)."""
    if item.get("type", "message") != "message":
        return item
    content = item["content"]
    if isinstance(content, str):
        kind = "output_text" if item["role"] == "assistant" else "input_text"
        content = [{"type": kind, "text": content}]
    return {"type": "message", "id": item["id"], "role": item["role"], "content": content,
            "status": item.get("status", "completed")}


def page(items: list[dict], after: str | None, limit: int, order: str) -> dict:
    """One page of ``items`` (oldest first) in ``order``, starting after the item ``after``.

    Returns:
        OpenAI's list object: ``{object: "list", data, first_id, last_id, has_more}``.

    Raises:
        APIError: 400 for an ``after`` that is no item of this list.
    """
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [it["id"] for it in ordered]
        if after not in ids:
            raise APIError(400, f"no input item with id '{after}' in this response", param="after")
        start = ids.index(after) + 1
    data = ordered[start:start + limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": start + limit < len(ordered)}


def page_query(query) -> tuple[str | None, int, str]:
    """``after``, ``limit`` (1 to 100, default 20) and ``order`` (``desc`` default, or
    ``asc``) of a request's ``query`` parameters (a mapping).

    Raises:
        APIError: 400 naming the parameter out of range.
    """
    try:
        limit = int(query.get("limit", DEFAULT_LIMIT))
    except ValueError:
        raise APIError(400, "limit must be an integer", param="limit") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise APIError(400, f"limit must be between 1 and {MAX_LIMIT}", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, "order must be 'asc' or 'desc'", param="order")
    return query.get("after"), limit, order


def input_items(entry: StoredResponse, after: str | None, limit: int, order: str) -> dict:
    """A page (:func:`page`) of the stored response's input items: everything in its
    conversation before its own output, listed (:func:`listed`)."""
    inputs = entry.items[:len(entry.items) - len(entry.response["output"])]
    return page([listed(it) for it in inputs], after, limit, order)
