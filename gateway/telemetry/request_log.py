"""One log line per completion request, as text or JSON (``--log-format json``).

Records carry no API key and no prompt or completion text; with ``--log-prompts`` the
rendered prompt is added (field ``prompt``).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from typing import Optional

log = logging.getLogger("mlx_gateway.requests")


@dataclass
class RequestRecord:
    """What one request did. Times in seconds (None where the request never got there),
    tokens as counted by the engine."""

    request_id: Optional[str] = None
    tenant: Optional[str] = None
    model: str = ""
    endpoint: str = ""
    status: int = 0
    stream: bool = False
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: Optional[str] = None
    queue_seconds: Optional[float] = None
    ttft_seconds: Optional[float] = None
    total_seconds: float = 0.0
    prompt: Optional[str] = None

    def emit(self) -> None:
        """Log this record at INFO on ``mlx_gateway.requests``."""
        fields = {k: v for k, v in asdict(self).items() if v is not None}
        for k in ("queue_seconds", "ttft_seconds", "total_seconds"):
            if k in fields:
                fields[k] = round(fields[k], 6)
        log.info("request", extra={"record": fields})


class JSONFormatter(logging.Formatter):
    """A log record as one JSON object per line: ``ts``, ``level``, ``logger``,
    ``message``, and a request record's fields when present."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
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
