"""Prefix-cache reuse of an agent session, measured from the gateway's own request log.

The gateway logs one record per completion request on ``mlx_gateway.requests``; with
``log_prompts`` the record carries the rendered prompt. :class:`RequestLog` keeps those
records while a session runs. :func:`reuse_rows` re-tokenizes each prompt with the served
model's tokenizer and sets each request's *ideal*: the longest token prefix it shares with
a request of the session that started before it (at most ``prompt_tokens - 1``: the last
prompt token is always computed, to produce the first answer token).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import Iterator, Optional

from cache.checkpoints import common_prefix

LOGGER = "mlx_gateway.requests"


class RequestLog(logging.Handler):
    """The request records logged while installed (:func:`request_log`), each with
    ``started`` (epoch seconds: the line's time less ``total_seconds``)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[dict] = []
        self.guard = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "record", None)
        if fields is not None:
            with self.guard:
                self.records.append({**fields, "started": record.created - fields.get("total_seconds", 0.0)})


@contextlib.contextmanager
def request_log() -> Iterator[RequestLog]:
    """Collect the gateway's request records until the block ends."""
    handler, logger = RequestLog(), logging.getLogger(LOGGER)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@dataclass
class Row:
    """One generation request of a session: ``endpoint`` (chat, messages, responses...),
    tokens as the gateway counted them, ``ideal`` as defined above, TTFT in seconds
    (None if it produced no token), and ``retokenized`` (the logged prompt's tokens when
    tokenized again; equal to ``prompt_tokens`` unless decoding lost something)."""

    endpoint: str
    status: int
    prompt_tokens: int
    cached_tokens: int
    ideal: int
    ttft: Optional[float]
    retokenized: int


def reuse_rows(records: list[dict], tokenizer) -> list[Row]:
    """The session's generation requests (records with a prompt), in start order, with
    their ideal reuse. ``tokenizer`` is the served model's (``encode(text,
    add_special_tokens=False)``)."""
    records = sorted((r for r in records if r.get("prompt") and r.get("prompt_tokens")), key=lambda r: r["started"])
    rows, seen = [], []
    for r in records:
        tokens = tokenizer.encode(r["prompt"], add_special_tokens=False)
        best = max((common_prefix(tokens, t) for t in seen), default=0)
        rows.append(Row(r.get("endpoint", "?"), r.get("status", 0), r["prompt_tokens"], r.get("cached_tokens", 0),
                        min(best, r["prompt_tokens"] - 1), r.get("ttft_seconds"), len(tokens)))
        seen.append(tokens)
    return rows


def totals(rows: list[Row]) -> tuple[int, int, int]:
    """(prompt tokens, cached tokens, ideal) summed over ``rows``."""
    return (sum(r.prompt_tokens for r in rows), sum(r.cached_tokens for r in rows), sum(r.ideal for r in rows))


def table(title: str, rows: list[Row]) -> str:
    """``rows`` as a Markdown table, with a total line (docs/agents.md quotes these)."""
    out = [f"{title}", "", "| # | endpoint | prompt tokens | cached | ideal | TTFT (s) |", "|---|---|---:|---:|---:|---:|"]
    for i, r in enumerate(rows, 1):
        ttft = f"{r.ttft:.2f}" if r.ttft is not None else "-"
        note = "" if r.retokenized == r.prompt_tokens else f" (re-tokenized: {r.retokenized})"
        out.append(f"| {i} | {r.endpoint} | {r.prompt_tokens:,}{note} | {r.cached_tokens:,} | {r.ideal:,} | {ttft} |")
    p, c, i = totals(rows)
    share = f"{c / i:.1%} of ideal" if i else "no reuse possible"
    out.append(f"| | **total** | {p:,} | {c:,} | {i:,} | {share} |")
    return "\n".join(out)
