"""Every prompt-cache miss explained: where a prompt left the longest cached prefix, in
which part of the conversation, and why, where that can be known.

:class:`CacheExplainer` (one per server, on the :class:`~gateway.front.Front`) explains a
request before it is submitted (:meth:`~CacheExplainer.explain`, a worker thread): from
the prefix cache's :class:`cache.prefix_report.PrefixReport` of its prompt, the part of
the conversation the divergence falls in (:mod:`gateway.conversation.prompt_parts`), and
the request of the same cache group that shared the most with it among the last ended
ones (:class:`Seen`). The answer, an :class:`Explanation`, goes in the request log
(``cache_miss``), the ``x-cache-miss`` response header, the counter
``mlx_gateway_cache_misses_total{cause}`` and ``GET /v1/cache/explain``.

Causes (:data:`CAUSES`, the counter's bounded label set), first that applies:

- ``none``: the cache served the prompt up to where its new content begins (stored keys
  end there, or the prompt differs only in its last user turn or beyond);
- ``evicted``: a longer prefix was stored and evicted (when: ``evicted_at``);
- ``other_tenant`` / ``other_adapter``: another cache group (tenant), or the same group
  under another LoRA adapter, holds a longer prefix (namespaces never share KV);
- ``never_seen``: nothing of the prompt is cached and no ended request shared it;
- ``no_checkpoint``: the prefix is cached, but a cache that cannot be trimmed (recurrent,
  sliding window) has no snapshot at the divergence to restore;
- ``other_image``: the divergence is an image (its token ids differ);
- ``not_stored``: an ended request shared more, but the cache never held it;
- ``changing_value``: the texts differ in a date, a time, a number or a hex nonce;
- ``system_changed``, ``tools_changed``: the system prompt or the tools changed;
- ``template_rerender``: a message the same as the previous request's (or the reply the
  model gave) renders differently now (a template dropping old reasoning, say);
- ``earlier_turn_edited``: an earlier message changed;
- ``prompt_changed``: a prompt without messages diverged.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import numpy as np

from gateway.conversation.prompt_parts import Place, locate
from gateway.models.vision_images import IMAGE_ID_BASE

log = logging.getLogger("mlx_gateway")

CAUSES = ("none", "evicted", "other_tenant", "other_adapter", "never_seen", "no_checkpoint", "other_image",
          "not_stored", "changing_value", "system_changed", "tools_changed", "template_rerender",
          "earlier_turn_edited", "prompt_changed")
KEPT = 512  # explanations kept for GET /v1/cache/explain (all tenants)
SEEN = 64  # ended requests kept per model and cache group to compare new ones with
SEEN_TOKENS = 1 << 16  # of each, its first tokens kept
EXCERPT_TOKENS = 24  # tokens each side of the divergence in an excerpt
ADAPTER_MARK = "/lora:"  # an adapter's namespace: "<group>/lora:<name>#<serial>" (scheduler.lora)

# A value that changes on every request: a date, a time, a number, a weekday or month name, a hex run.
_CHANGING = re.compile(
    r"[\s\d:./\-+,TZ]*\d[\s\d:./\-+,TZ]*|[0-9a-fA-F\-]{6,}|"
    r"(?i:mon|tue|wed|thu|fri|sat|sun|jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]*[\s\d,]*")

_WORD = re.compile(r"[\w:/\-]")  # a character of a word, a date or a time (not "." nor ",": they end sentences)


@dataclass
class Explanation:
    """Why one request's prompt left the cache where it did (tokens; times in seconds
    since the epoch). ``at``: the token where the cached text stops serving the prompt;
    ``cached_tokens``: what the engine restored (set when its prefill starts). Excerpts:
    ``before`` (shared text up to ``at``), ``prompt`` (this prompt's from ``at``),
    ``cached`` (the stored text from ``at``, within the same cache group only). ``part``
    is a :class:`~gateway.conversation.prompt_parts.Place`'s, or ``new`` for cause
    ``none`` (the prompt's new content: the template is not rendered again for it)."""

    request_id: str = ""
    tenant: str = ""
    model: str = ""
    cause: str = "never_seen"
    at: int = 0
    prompt_tokens: int = 0
    cached_tokens: Optional[int] = None
    part: str = "prompt"
    message: Optional[int] = None
    role: Optional[str] = None
    content_part: Optional[int] = None
    detail: Optional[str] = None
    evicted_at: Optional[float] = None
    before: str = ""
    prompt: str = ""
    cached: Optional[str] = None
    time: float = field(default_factory=time.time)

    def header(self) -> str:
        """The ``x-cache-miss`` header's value: ``<cause>; at=<token>; part=<part>[; message=<k>]``."""
        out = f"{self.cause}; at={self.at}; part={self.part}"
        return out + (f"; message={self.message}" if self.message is not None else "")

    def record(self, texts: bool = True) -> dict:
        """The fields, without the empty ones (the request log's ``cache_miss``, the explain
        route's items); without the prompt excerpts (``before``, ``prompt``, ``cached``)
        unless ``texts`` (the request log has them only with ``--log-prompts``)."""
        out = {k: v for k, v in asdict(self).items() if v is not None and v != ""}
        if not texts:
            for k in EXCERPTS:
                out.pop(k, None)
        return out


EXCERPTS = ("before", "prompt", "cached")  # the fields of an Explanation that quote prompt text


@dataclass
class Seen:
    """An ended request, as later ones are compared with it: its first tokens, its
    template messages, the text of its answer and its tools."""

    tokens: np.ndarray
    messages: Optional[list[dict]]
    reply: Optional[str] = None
    tools: Any = None  # the tools the template rendered


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two token arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def _text(tokenizer: Any, ids) -> str:
    """Decoded ids; an image's ids read ``<image>``."""
    out, run = [], []
    for t in ids:
        if t >= IMAGE_ID_BASE:
            if run:
                out.append(tokenizer.decode(run))
                run = []
            if not out or out[-1] != "<image>":
                out.append("<image>")
        else:
            run.append(int(t))
    if run:
        out.append(tokenizer.decode(run))
    return "".join(out)


def _content(m: Optional[dict]) -> Any:
    return None if m is None else (m.get("role"), m.get("content"), str(m.get("tool_calls") or ""))


def _differing(a: str, b: str) -> tuple[str, str]:
    """The middles of two strings once their common prefix and suffix are cut, widened to
    whole words (the differing part of ``2025-03-14`` and ``2025-03-15`` is the date)."""
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    j = 0
    while j < min(len(a), len(b)) - i and a[-1 - j] == b[-1 - j]:
        j += 1
    while i > 0 and _WORD.match(a[i - 1]):
        i -= 1
    while j > 0 and _WORD.match(a[len(a) - j]):
        j -= 1
    return a[i:len(a) - j], b[i:len(b) - j]


def _changing(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` differ only in a short date, time, number or nonce."""
    x, y = _differing(a, b)
    return 0 < max(len(x), len(y)) <= 40 and all(_CHANGING.fullmatch(s.strip()) or not s.strip() for s in (x, y)) \
        and any(s.strip() for s in (x, y))


class CacheExplainer:
    """The explanations of the last :data:`KEPT` requests and the ended requests they are
    compared with (thread-safe: explanations are made in worker threads).

    Args:
        metrics: the gateway's metrics (``cache_misses``), or None.
    """

    def __init__(self, metrics: Any = None):
        self.metrics = metrics
        self._lock = threading.Lock()
        self._kept: OrderedDict[str, Explanation] = OrderedDict()
        self._seen: dict[tuple[str, str], deque[Seen]] = {}

    # -- the ended requests ---------------------------------------------------
    def seen(self, model: str, namespace: str, tokens: list[int], messages: Optional[list[dict]],
             reply: Optional[str], tools: Any = None) -> None:
        """Remember an ended request of ``model`` in cache group ``namespace``."""
        s = Seen(np.asarray(tokens[:SEEN_TOKENS], dtype=np.int64), messages, reply, tools)
        with self._lock:
            self._seen.setdefault((model, namespace), deque(maxlen=SEEN)).append(s)

    def _closest(self, model: str, namespace: str, tokens: np.ndarray) -> tuple[Optional[Seen], int]:
        with self._lock:
            seen = list(self._seen.get((model, namespace), ()))
        best, n = None, 0
        for s in reversed(seen):  # the most recent first among equals
            k = _common(s.tokens, tokens)
            if k > n:
                best, n = s, k
        return best, n

    # -- explaining -----------------------------------------------------------
    def explain(self, model: Any, tenant: str, namespace: str, adapter: Optional[str], prompt: Any) -> Optional[Explanation]:
        """Explain ``prompt`` (a :class:`gateway.conversation.prompts.Prompt`) of
        ``tenant`` in cache group ``namespace`` (under LoRA ``adapter``, if set) on
        ``model`` (a :class:`~gateway.models.handle.ModelHandle`), as its cache stands
        now. Never raises: a failure is logged and gives None."""
        try:
            return self._explain(model, tenant, namespace, adapter, prompt)
        except Exception:
            log.exception("explaining the prompt cache's answer failed")
            return None

    def _explain(self, model, tenant, namespace, adapter, prompt) -> Explanation:
        cache, tok, tokens = model.engine.prompt_cache, model.tokenizer, prompt.tokens
        ns = namespace
        if adapter is not None:  # the adapter's own namespace, the newest load of it
            mine = [n for n in cache.namespaces() if n.startswith(f"{namespace}{ADAPTER_MARK}{adapter}#")]
            ns = max(mine, key=lambda n: int(n.rpartition("#")[2] or 0), default=ns)
        rep = cache.report(ns, tokens)
        arr = np.asarray(tokens, dtype=np.int64)
        prev, shared = self._closest(model.name, ns, arr)
        n, m = len(tokens), rep.matched
        why = Explanation(tenant=tenant, model=model.name, at=m, prompt_tokens=n)
        stored = rep.stored_next
        if not stored and prev is not None and shared > m:
            stored = prev.tokens[m:m + 32].tolist()
        why.cause = self._cause(rep, prev, shared, tokens, ns, model.trimmable)
        if why.cause in ("none", "no_checkpoint"):
            why.at = min(rep.restorable, m) if why.cause == "no_checkpoint" else m
        if rep.evicted is not None and why.cause == "evicted":
            why.evicted_at = round(rep.evicted[1], 3)
            why.detail = f"a snapshot of {rep.evicted[0]} tokens was evicted"
        at = why.at
        if why.cause == "none":  # the prompt only adds to what is stored: no part to find (no renders)
            why.part = "new"
            return why
        place: Place = locate(tok, prompt.messages, prompt.template_kwargs, tokens, at)
        why.part, why.message, why.role, why.content_part = place.part, place.message, place.role, place.content_part
        why.before = _text(tok, tokens[max(0, at - EXCERPT_TOKENS):at])
        why.prompt = _text(tok, tokens[at:at + EXCERPT_TOKENS])
        if stored and why.cause not in ("other_tenant", "other_adapter"):
            why.cached = _text(tok, stored[:EXCERPT_TOKENS])
        if why.cause == "change" and place.part in ("preamble", "system") and place.message in (None, 0) \
                and place.into == 0:
            why.cause = "never_seen"  # only the template's own text before the first message is shared
        elif why.cause == "change":
            why.cause, why.detail = self._change(place, prompt.messages, prev, why, prompt.template_kwargs.get("tools"))
        return why

    def _cause(self, rep, prev: Optional[Seen], shared: int, tokens, ns: str, trimmable: bool) -> str:
        """The cause the cache's facts give, or ``change`` for one the texts must tell."""
        n, m = len(tokens), rep.matched
        if m >= n:
            return "none"
        if rep.evicted is not None:
            return "evicted"
        if rep.elsewhere is not None:
            other = rep.elsewhere[0]
            same_group = other.partition(ADAPTER_MARK)[0] == ns.partition(ADAPTER_MARK)[0]
            return "other_adapter" if same_group else "other_tenant"
        if m == 0 and prev is None:
            return "never_seen"
        if not trimmable and rep.restorable < min(m, n - 1):
            return "no_checkpoint"
        nxt = rep.stored_next[0] if rep.stored_next else None
        if tokens[m] >= IMAGE_ID_BASE or (nxt is not None and nxt >= IMAGE_ID_BASE):
            return "other_image"
        if not rep.stored_next:
            return "not_stored" if prev is not None and shared > m else ("none" if m else "never_seen")
        return "change"

    @staticmethod
    def _change(place: Place, messages: Optional[list[dict]], prev: Optional[Seen], why: Explanation,
                tools: Any = None) -> tuple[str, Optional[str]]:
        """What changed where the stored text goes on differently: by the part the
        divergence falls in and, where there is one, the previous request's messages and
        tools (a template may render tools in several places: Llama 3.1's system header
        and first user message)."""
        k = place.message
        mine = messages[k] if messages is not None and k is not None else None
        before = prev.messages[k] if prev is not None and prev.messages and k is not None \
            and k < len(prev.messages) else None
        a = mine.get("content") if mine is not None else None
        b = before.get("content") if before is not None else None
        if isinstance(a, str) and isinstance(b, str) and a != b and _changing(a, b):
            x, y = _differing(a, b)
            return "changing_value", f"{y.strip()!r} became {x.strip()!r}"
        if why.cached is not None and _changing(why.prompt, why.cached):
            x, y = _differing(why.prompt, why.cached)
            return "changing_value", f"{y.strip()!r} became {x.strip()!r}"
        if prev is not None and prev.tools != tools and place.part != "generation" \
                and (before is None or _content(before) == _content(mine)):
            return "tools_changed", None
        if place.part == "system":
            return "system_changed", None
        if place.part == "tools":
            return "tools_changed", None
        if place.part == "generation":
            return "template_rerender", "the generation prompt renders differently"
        if place.part in ("prompt", "preamble"):
            return "prompt_changed" if messages is None else "template_rerender", None
        last = messages is not None and k == len(messages) - 1 and place.role == "user"
        if prev is not None and prev.messages is not None:
            if k < len(prev.messages):
                if _content(before) == _content(mine):
                    return "template_rerender", f"message {k} is the same but renders differently"
                return ("none", "the last message is new") if last else ("earlier_turn_edited", None)
            if k == len(prev.messages) and place.role == "assistant":
                same = prev.reply is not None and isinstance(a, str) and a.strip() == prev.reply.strip()
                return ("template_rerender", "the model's own reply renders differently") if same else \
                    ("earlier_turn_edited", "the assistant message differs from the reply it was given")
        if last or prev is None and k == len(messages) - 1:
            return "none", "the last message is new"
        return "earlier_turn_edited", None

    # -- the books ------------------------------------------------------------
    def keep(self, why: Explanation) -> None:
        """Keep ``why`` for :meth:`find` (its ``request_id`` set)."""
        with self._lock:
            self._kept[why.request_id] = why
            while len(self._kept) > KEPT:
                self._kept.popitem(last=False)

    def count(self, why: Explanation) -> None:
        """Count ``why``'s cause (once its prefill started), unless it is ``none``."""
        if self.metrics is not None and why.cause != "none":
            self.metrics.cache_misses.labels(why.tenant, why.model, why.cause).inc()

    def find(self, request_id: Optional[str] = None, tenant: Optional[str] = None, limit: int = 50) -> list[Explanation]:
        """The kept explanation of ``request_id``, or the last ``limit`` ones (newest
        first); only ``tenant``'s when it is given."""
        with self._lock:
            kept = list(self._kept.values())
        out = [w for w in reversed(kept) if (tenant is None or w.tenant == tenant)
               and (request_id is None or w.request_id == request_id)]
        return out[:limit]
