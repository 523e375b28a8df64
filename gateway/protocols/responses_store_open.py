"""Which response store ``--responses-store`` names, checked before the server starts and
opened when the app is built.

- ``memory``: this process's memory (:mod:`gateway.protocols.responses_store_memory`);
- ``sqlite:PATH``: a SQLite file (:mod:`gateway.protocols.responses_store_sqlite`);
- ``redis://host:port/db``, ``rediss://...``, ``unix:///path?db=0``: Redis, shared by the
  replicas (:mod:`gateway.protocols.responses_store_redis`);
- not given: ``sqlite:`` :data:`DEFAULT_FILE` in the data directory
  (:func:`gateway.data_dir.data_root`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Iterable, Optional
from urllib.parse import urlsplit

from gateway.data_dir import data_root
from gateway.protocols.responses_store import Backend, ResponseStore

log = logging.getLogger("mlx_gateway.responses_store")

DEFAULT_FILE = "responses.sqlite3"
REDIS_SCHEMES = ("redis", "rediss", "unix")


def store_spec(value: Optional[str]) -> tuple[str, str]:
    """``(kind, where)`` for a ``--responses-store`` value: ``("memory", "")``,
    ``("sqlite", path)`` or ``("redis", url)``; None is the default SQLite file.

    Raises:
        ValueError: a value of none of these forms.
    """
    if value is None:
        return "sqlite", str(data_root() / DEFAULT_FILE)
    if value == "memory":
        return "memory", ""
    if value.startswith("sqlite:"):
        path = value[len("sqlite:"):]
        if not path:
            raise ValueError("--responses-store sqlite:PATH needs a path")
        return "sqlite", str(Path(path).expanduser())
    if urlsplit(value).scheme in REDIS_SCHEMES:
        return "redis", value
    raise ValueError(f"--responses-store {value!r}: expected memory, sqlite:PATH, or a redis://host:port/db, "
                     "rediss:// or unix:// URL")


def check_responses_store(config) -> None:
    """Check ``config.responses_store`` before anything starts: its form, redis-py for a Redis
    URL (nothing is contacted), and that a SQLite file can be created.

    Raises:
        ValueError, OSError: saying what is wrong.
    """
    kind, where = store_spec(config.responses_store)
    if kind == "redis":
        try:
            import redis  # noqa: F401
        except ImportError as e:
            raise ValueError("--responses-store with a Redis URL needs the redis package: "
                             "pip install 'redis>=5'") from e
    elif kind == "sqlite":
        from gateway.protocols.responses_store_sqlite import prepare_file

        prepare_file(Path(where))


def open_backend(config) -> Backend:
    """The backend ``config.responses_store`` names, with the ``responses_store_*`` bounds and TTL.

    Raises:
        ValueError, OSError, sqlite3.Error: see :func:`store_spec` and the backends.
    """
    kind, where = store_spec(config.responses_store)
    bounds = (config.responses_store_count, config.responses_store_bytes, config.responses_store_ttl or None)
    if kind == "memory":
        from gateway.protocols.responses_store_memory import MemoryBackend

        return MemoryBackend(*bounds)
    if kind == "redis":
        from gateway.protocols.responses_store_redis import RedisBackend

        return RedisBackend(where, *bounds)
    from gateway.protocols.responses_store_sqlite import SQLiteBackend

    return SQLiteBackend(Path(where), *bounds)


def open_response_store(config, tenants: Callable[[], Iterable[str]] = tuple) -> ResponseStore:
    """The :class:`ResponseStore` of ``config`` (``tenants()``: the configured tenant names,
    whose metric series exist from the start). A SQLite file is checked as it opens.

    Raises:
        ValueError, OSError, sqlite3.Error: see :func:`open_backend`.
    """
    backend = open_backend(config)
    store = ResponseStore(backend, tenants)
    if store_spec(config.responses_store)[0] == "sqlite":
        totals = backend.totals()
        log.info("response store: %s (%d responses of %d tenants%s)", backend.describe(),
                 sum(n for n, _ in totals.values()), len(totals),
                 f"; {backend.torn_at_open} damaged entries dropped" if backend.torn_at_open else "")
    else:
        log.info("response store: %s", backend.describe())
    return store
