"""Where the cluster front (``front.py``) sends a request, and how it joins replicas'
answers: pure functions of a request, no I/O.

- :func:`around_router`: whether a request the router would serve goes straight to a
  replica instead;
- :func:`session_key`: the key a client gives to keep its requests together
  (``prompt_cache_key``, ``safety_identifier``, ``user``, Anthropic's ``metadata.user_id``);
- :func:`affinity_key`: what a conversation's turns share, hashed to pick its replica;
- :func:`merge_usage`: two replicas' ``/v1/usage`` answers as one.
"""

from __future__ import annotations

import json
from typing import Optional

from starlette.requests import Request


def around_router(request: Request, body: bytes) -> bool:
    """Whether a request the router would serve must go around it, straight to a replica:

    - a browser's (an ``Origin`` header, and every CORS preflight): the router answers CORS
      itself, with ``Access-Control-Allow-Origin: *`` unless given ``--cors-allowed-origins``,
      in place of the gateway's ``--allowed-origins`` and the tenants' ``origins``;
    - one that asks for a latency class (an ``x-priority`` header, or ``priority`` in a chat
      body): the router drops both (and every field of a chat body it does not know);
    - one that names its session (:func:`session_key`): it goes to its session's replica,
      which holds its prefix cache whatever the router's trees remember (they forget on a
      restart, on eviction, and do not follow a replica that joins); and the router drops
      a chat body's ``user``.
    """
    if request.method == "OPTIONS" or "origin" in request.headers or "x-priority" in request.headers:
        return True
    path = request.url.path
    if path not in ("/v1/chat/completions", "/v1/completions") or not any(
            f in body for f in (b'"priority"', b'"user"', b'"safety_identifier"', b'"prompt_cache_key"')):
        return False
    try:
        data = json.loads(body)
    except ValueError:
        return False
    if not isinstance(data, dict):
        return False
    return (path == "/v1/chat/completions" and "priority" in data) or session_key(path, data) is not None


SESSION_FIELDS = ("prompt_cache_key", "safety_identifier", "user")


def session_key(path: str, data: dict) -> Optional[str]:
    """The key a client gives to keep its requests on one replica, or None: OpenAI's
    ``prompt_cache_key`` (its documented use: requests sharing a prefix), else
    ``safety_identifier``, else ``user`` (chat, completions, Responses); Anthropic's
    ``metadata.user_id`` (Messages). Empty or non-string values are none."""
    if path.startswith("/v1/messages"):
        meta = data.get("metadata")
        value = meta.get("user_id") if isinstance(meta, dict) else None
        return value if isinstance(value, str) and value else None
    if path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        for name in SESSION_FIELDS:
            value = data.get(name)
            if isinstance(value, str) and value:
                return f"{name}={value}"
    return None


def affinity_key(path: str, data: dict) -> bytes:
    """What a conversation's requests share from its first turn on: the model and the
    client's :func:`session_key` when it gives one; else the model, and the system prompt
    (or instructions) with the first message (or input item, or the start of a
    completion's prompt)."""
    session = session_key(path, data)
    if session is not None:
        return json.dumps([data.get("model"), "session", session], default=str).encode()
    if path.startswith("/v1/messages"):
        messages = data.get("messages")
        parts = [data.get("system"), messages[0] if isinstance(messages, list) and messages else None]
    elif path == "/v1/responses":
        items = data.get("input")
        parts = [data.get("instructions"), items[0] if isinstance(items, list) and items else items]
    elif path in ("/v1/chat/completions", "/api/chat"):
        messages = data.get("messages")
        parts = messages[:2] if isinstance(messages, list) else [messages]
    elif path == "/v1/completions":
        prompt = data.get("prompt")
        parts = [prompt[:1024] if isinstance(prompt, (str, list)) else prompt]
    elif path == "/api/generate":
        prompt = data.get("prompt")
        parts = [data.get("system"), prompt[:1024] if isinstance(prompt, str) else prompt]
    else:
        parts = []
    return json.dumps([data.get("model"), *parts], sort_keys=True, default=str).encode()


def merge_usage(a, b):
    """Two replicas' ``/v1/usage`` answers as one: counts added, window starts the earliest,
    an admin's per-tenant lists joined by tenant."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = dict(a)
        for k, v in b.items():
            if k not in out:
                out[k] = v
            elif k in ("start", "since", "seconds"):
                out[k] = min(out[k], v) if all(isinstance(x, (int, float)) for x in (out[k], v)) else out[k]
            else:
                out[k] = merge_usage(out[k], v)
        return out
    if isinstance(a, list) and isinstance(b, list):
        by_tenant = {x.get("tenant"): x for x in a if isinstance(x, dict)}
        out = list(a)
        for x in b:
            t = x.get("tenant") if isinstance(x, dict) else None
            if t is not None and t in by_tenant:
                merged = merge_usage(by_tenant[t], x)
                out[out.index(by_tenant[t])] = merged
                by_tenant[t] = merged
            else:
                out.append(x)
        return out
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return a + b
    return a
