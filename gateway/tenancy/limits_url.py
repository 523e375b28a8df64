"""The ``--limits-store`` URL: checked before anything is contacted, and shown in logs
without its password."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def redacted(url: str) -> str:
    """``url`` without its password (for logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def check_url(url: str) -> None:
    """Raises:
        ValueError: ``url`` is not a ``redis://``, ``rediss://`` or ``unix://`` URL, or
            redis-py is not installed (nothing is contacted)."""
    if urlsplit(url).scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"--limits-store {redacted(url)}: expected a redis://host:port/db, rediss:// "
                         "or unix:// URL")
    try:
        import redis.asyncio  # noqa: F401 (only: is it there)
    except ImportError as e:
        raise ValueError("--limits-store needs the redis package: pip install 'redis>=5'") from e
