"""One log line per completion request, as text or JSON (``--log-format json``).

Records carry no API key and no prompt or completion text; with ``--log-prompts`` the
rendered prompt is added (field ``prompt``).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Callable, Iterator, Optional

log = logging.getLogger("mlx_gateway.requests")

# The phases of a request up to its first token, as (name, start mark, end mark):
# HTTP admission (key, limits, body read and JSON parse), the API's schema parse,
# chat template and tokenizer (in a worker thread; the hop to it and back is
# thread_hop), waiting for an engine step, the prefix-cache fetch (lookup, copy,
# restore), the uncached suffix's prefill, the first decode step, the hand-over of the
# first token from the engine thread to the event loop, and its first SSE write.
PHASES = (
    ("http_admit", "received", "admitted"),
    ("parse", "admitted", "render_start"),
    ("template_tokenize", "render_in", "render_out"),
    ("thread_hop", "render_start", "render_end"),
    ("queue", "submitted", "engine_admitted"),
    ("cache_fetch", "engine_admitted", "engine_restored"),
    ("prefill", "engine_restored", "engine_prefilled"),
    ("first_decode", "engine_prefilled", "engine_first_token"),
    ("to_event_loop", "engine_first_token", "first_token"),
    ("first_write", "first_token", "first_write"),
)

# Status logged for a generation the client left before it ended (nginx's "client closed request").
CLIENT_CLOSED = 499
_UNLOGGED = {"log": False}


@dataclass
class RequestRecord:
    """What one request did. Times in seconds (None where the request never got there),
    tokens as counted by the engine. ``error`` is set when the server cut the request
    before it ended (e.g. at the end of the shutdown grace period); its ``finish_reason``
    is then logged as ``error``.

    ``finish_reason`` of a generation: ``stop`` (end of sequence or a stop string),
    ``length``, ``tool_calls``, ``cancelled`` (the client left first) or ``error``.
    ``status`` is the HTTP status; the line logs the outcome's status instead where a
    streamed 200 was already sent (see :meth:`final_status`). ``settle``, when set, is
    called once just before the line is written, so that the generation can fill in its
    outcome (the end of a stream whose client left is otherwise only noticed later).
    ``error_status`` and ``settle`` are not logged.

    ``marks`` are monotonic times (seconds) at which the request passed each stage of
    :data:`PHASES` (the engine's come from its thread); :meth:`emit` logs the time spent
    in each phase reached as ``phases`` (seconds), the per-phase breakdown of TTFT.
    """

    request_id: Optional[str] = None
    tenant: Optional[str] = None
    model: str = ""
    endpoint: str = ""
    priority: Optional[str] = None  # the latency class
    status: int = 0
    stream: bool = False
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cache_source: Optional[str] = None  # "memory" or "disk" (the prompt cache's disk tier)
    cache_miss: Optional[dict] = None  # where and why the prompt left the cache (telemetry.cache_explain)
    completion_tokens: int = 0
    finish_reason: Optional[str] = None
    queue_seconds: Optional[float] = None
    ttft_seconds: Optional[float] = None
    total_seconds: float = 0.0
    prompt: Optional[str] = None
    error: Optional[str] = None
    phases: Optional[dict] = None
    marks: dict = field(default_factory=dict, metadata=_UNLOGGED)
    error_status: Optional[int] = field(default=None, metadata=_UNLOGGED)
    settle: Optional[Callable[[], None]] = field(default=None, repr=False, compare=False, metadata=_UNLOGGED)

    def final_status(self) -> int:
        """The status to log: ``status``, except after a 200 whose generation did not
        end well: :data:`CLIENT_CLOSED` (499) when the client left first, the error's
        status (``error_status``, else 500) when it failed."""
        if self.status >= 400:
            return self.status
        if self.error is not None or self.finish_reason == "error":
            return self.error_status or 500
        if self.finish_reason == "cancelled":
            return CLIENT_CLOSED
        return self.status

    def phase_seconds(self) -> dict[str, float]:
        """Seconds spent in each phase of :data:`PHASES` whose marks are both set;
        ``thread_hop`` excludes the template work done in the thread."""
        m, out = self.marks, {}
        for name, a, b in PHASES:
            if a in m and b in m:
                out[name] = round(m[b] - m[a], 6)
        if "thread_hop" in out and "template_tokenize" in out:
            out["thread_hop"] = round(out["thread_hop"] - out["template_tokenize"], 6)
        return out

    def emit(self) -> None:
        """Settle the record (``settle``), then log it at INFO on ``mlx_gateway.requests``."""
        settle, self.settle = self.settle, None
        if settle is not None:
            settle()
        self.phases = self.phase_seconds() or None
        fields = {f.name: getattr(self, f.name) for f in dataclass_fields(self) if f.metadata.get("log", True)}
        fields = {k: v for k, v in fields.items() if v is not None}
        fields["status"] = self.final_status()
        if self.error is not None:
            fields["finish_reason"] = "error"
        for k in ("queue_seconds", "ttft_seconds", "total_seconds"):
            if k in fields:
                fields[k] = round(fields[k], 6)
        log.info("request", extra={"record": fields})


class JSONFormatter(logging.Formatter):
    """A log record as one JSON object per line: ``ts``, ``level``, ``logger``,
    ``message``, and a request record's fields when present."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
               "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
        out.update(getattr(record, "record", {}))
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """The usual text format; a request record's fields follow as ``key=value``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = getattr(record, "record", None)
        if fields:
            text += " " + " ".join(f"{k}={json.dumps(v, ensure_ascii=False) if isinstance(v, str) else v}"
                                   for k, v in fields.items())
        return text


def configure_logging(level: str, fmt: str) -> None:
    """Root logging at ``level`` with the ``text`` or ``json`` formatter."""
    handler = logging.StreamHandler()
    handler.setFormatter(JSONFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def read_json_log(path: Path) -> Iterator[dict]:
    """The JSON objects of a ``--log-format json`` log, in order: request records and the
    other log lines alike (a caller picks by their fields); lines that are not a JSON
    object (text written by other processes, a torn last line) are skipped."""
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            yield record
