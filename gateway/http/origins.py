"""Browser origins as Ollama takes them: exact origins and patterns with one ``*`` wildcard
(``chrome-extension://*``, ``http://localhost:*``), ``OLLAMA_ORIGINS``, and Ollama's
default list of local origins.

Ollama (``envconfig.AllowedOrigins``, matched by gin-contrib/cors with wildcards on) allows
``OLLAMA_ORIGINS`` (comma-separated) and, always, ``http(s)://`` + ``localhost``,
``127.0.0.1`` and ``0.0.0.0`` with or without a port, ``app://*``, ``file://*``,
``tauri://*``, ``vscode-webview://*`` and ``vscode-file://*``. A ``*`` stands for any run
of characters (a pattern is a prefix and a suffix); a lone ``*`` is every origin.
"""

from __future__ import annotations

import functools
import os
from typing import Iterable, Mapping, Optional

ENV = "OLLAMA_ORIGINS"

OLLAMA_LOCAL_ORIGINS = tuple(
    [f"{scheme}://{host}{port}" for host in ("localhost", "127.0.0.1", "0.0.0.0")
     for scheme in ("http", "https") for port in ("", ":*")]
    + ["app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*"])


def check_pattern(pattern: str) -> str:
    """``pattern`` without a trailing ``/``.

    Raises:
        ValueError: an empty pattern, or one with more than one ``*`` (Ollama refuses those too).
    """
    p = pattern.strip().rstrip("/")
    if not p:
        raise ValueError("an empty origin")
    if p.count("*") > 1:
        raise ValueError(f"an origin pattern may hold one '*', got {pattern!r}")
    return p


def split_origins(text: str) -> list[str]:
    """The origins of a comma-separated list (``--allowed-origins``, ``OLLAMA_ORIGINS``).

    Raises:
        ValueError: a pattern :func:`check_pattern` refuses.
    """
    return [check_pattern(o) for o in text.split(",") if o.strip()]


def configured_origins(flag: Optional[list[str]], environ: Mapping[str, str] = os.environ) -> list[str]:
    """The origins allowed on every path: ``--allowed-origins`` when given, else
    ``OLLAMA_ORIGINS`` when set (quotes and spaces around it stripped, as Ollama does),
    else none.

    Raises:
        ValueError: ``OLLAMA_ORIGINS`` holds a pattern :func:`check_pattern` refuses.
    """
    if flag is not None:
        return list(flag)
    value = environ.get(ENV, "").strip().strip("'\"").strip()
    try:
        return split_origins(value)
    except ValueError as e:
        raise ValueError(f"{ENV}: {e}") from e


class OriginPatterns:
    """A set of origins and ``*`` patterns (see the module's docstring).

    Args:
        patterns: exact origins and patterns, e.g. ``chrome-extension://*``; a trailing
            ``/`` is ignored.
    """

    def __init__(self, patterns: Iterable[str]):
        self.exact: set[str] = set()
        self.wild: list[tuple[str, str]] = []
        for p in patterns:
            p = p.rstrip("/")
            if "*" in p:
                head, _, tail = p.partition("*")
                self.wild.append((head, tail))
            else:
                self.exact.add(p)

    def __bool__(self) -> bool:
        return bool(self.exact or self.wild)

    def match(self, origin: str) -> bool:
        """Whether ``origin`` (an ``Origin`` header value) is one of them."""
        origin = origin.rstrip("/")
        return origin in self.exact or any(
            len(origin) >= len(h) + len(t) and origin.startswith(h) and origin.endswith(t) for h, t in self.wild)


@functools.lru_cache(maxsize=64)
def patterns_of(origins: frozenset[str]) -> OriginPatterns:
    """:class:`OriginPatterns` of ``origins``, made once per set (the tenants' origins
    are asked for at every request)."""
    return OriginPatterns(origins)
