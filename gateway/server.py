"""Assemble and run the gateway: the engine loop, the model registry, the front and the app."""

from __future__ import annotations

import functools
import ipaddress
import logging
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from prometheus_client import CollectorRegistry, Info, ProcessCollector

from cache import CacheBudget
from gateway.config import ServeConfig
from gateway.front import Front
from gateway.conversation.prepare import warm_up
from gateway.backend import backend
from gateway.engine_fault import fault_handler
from gateway.models.budget import gib
from gateway.models.loader import load_model
from gateway.models.registry import ModelRegistry
from gateway.models.spec import ModelSpec, model_specs
from gateway.protocols.responses_store_open import check_responses_store
from gateway.routes.app import create_app
from gateway.telemetry.metrics import GatewayMetrics, prime
from gateway.telemetry.model_metrics import ModelMetrics
from gateway.telemetry.request_log import configure_logging
from gateway.telemetry.runtime import RuntimeCollector
from gateway.tenancy.limits_setup import check_limits_store, make_limiter
from gateway.tenancy.tenants import TenantsFileError, TenantTable, load_tenants, open_table, single_key_table
from scheduler.engine import PERSIST_SECONDS
from scheduler.engine.loop import EngineLoop
from scheduler.engine.watchdog import Watchdog

log = logging.getLogger("mlx_gateway")


@dataclass(eq=False)
class Gateway:
    """The assembled server (:func:`build_gateway`): one engine loop for every model, the
    model registry, the front every request meets, and the ASGI app."""

    config: ServeConfig
    registry: CollectorRegistry
    loop: EngineLoop
    models: ModelRegistry
    front: Front
    app: object
    watchdog: Optional[Watchdog] = None  # the engine loop's (scheduler.engine.watchdog)

    def start(self) -> None:
        """Start the engine loop and its watchdog, then load the models marked to load at
        start (in the background: ``/health`` answers 503 until they are ready)."""
        self.loop.start()
        if self.watchdog is not None:
            self.watchdog.start()
        self.models.start()

    def stop(self, timeout: Optional[float] = None) -> None:
        """Stop the engine loop: running requests end with a 503; prefix caches with a
        disk tier are written to it first (a graceful stop)."""
        if self.watchdog is not None:
            self.watchdog.stop()
        self.models.close()
        if timeout is None:
            timeout = PERSIST_SECONDS + 10 if self.config.prompt_cache_dir else 10
        self.loop.stop(timeout=timeout)

    def activity(self) -> Optional[int]:
        """The engines' step count while every one is idle; None while a request waits or
        runs, or while no model is loaded (what :class:`gateway.cpu.idle_trim.IdleTrimmer` watches)."""
        handles = self.models.handles()
        if not handles or any(not h.engine.idle for h in handles):
            return None
        return sum(h.engine.stats.steps for h in handles)


def build_gateway(cfg: ServeConfig, tenants: Optional[TenantTable] = None,
                  specs: Optional[list[ModelSpec]] = None) -> Gateway:
    """The gateway for ``cfg``, with ``tenants`` (read from ``cfg`` when None) and ``specs``
    (:func:`gateway.models.spec.model_specs` of ``cfg`` when None); nothing runs yet.

    Raises:
        TenantsFileError, ValueError: see :func:`tenant_table` and :func:`model_specs`.
    """
    specs = specs if specs is not None else model_specs(cfg)
    registry = CollectorRegistry()
    # Resident memory, CPU seconds, open files (from /proc: Linux only; elsewhere it adds
    # nothing). On MLX's CPU backend the arrays live in this process's heap.
    ProcessCollector(namespace="mlx_gateway", registry=registry)
    metrics = GatewayMetrics(registry)
    model_metrics = ModelMetrics(registry, [s.name for s in specs])
    budget = cfg.memory_budget if cfg.memory_budget is not None else backend().memory_budget()
    loop = EngineLoop(gather_wait=cfg.gather_wait, batch_share=cfg.batch_share,
                      interactive_budget=cfg.interactive_budget)
    cache_budget = CacheBudget(min(cfg.prompt_cache_bytes, budget))
    front: Optional[Front] = None

    def tenants_now() -> TenantTable:
        return front.tenants

    loader = functools.partial(_load, cfg=cfg, loop=loop, cache_budget=cache_budget, tenants=tenants_now)
    models = ModelRegistry(specs, loader, loop, model_metrics, budget, cfg.max_loaded_models, cache_budget,
                           cfg.prompt_cache_bytes)
    front = Front(cfg, models, metrics, tenants if tenants is not None else tenant_table(cfg),
                  limiter=make_limiter(cfg, registry))
    _build_info(registry, cfg, specs, budget)
    registry.register(RuntimeCollector(lambda: [h.engine for h in models.handles()]))
    prime_metrics(front)
    log.info("memory budget of the loaded models: %s%s", gib(budget),
             "" if cfg.memory_budget is not None else f" ({backend().budget_source}; --memory-budget sets it)")
    watchdog = Watchdog(loop, cfg.engine_stall_seconds, registry, fault_handler(front, cfg.on_engine_fault))
    return Gateway(cfg, registry, loop, models, front, create_app(front, registry), watchdog)


def _load(spec: ModelSpec, registry: CollectorRegistry, reserve, *, cfg: ServeConfig, loop: EngineLoop,
          cache_budget: CacheBudget, tenants):
    """:func:`load_model` with this server's settings, and the current tenants' cache
    quotas and metric series applied before the engine starts; a chat model prepares one
    small chat before it is reported loaded (:func:`gateway.conversation.prepare.warm_up`)."""

    def configure(engine) -> None:
        table = tenants()
        engine.apply_quotas(table.quotas).result()  # not started: applied now (raises if it failed)
        engine.prime_metrics([t.name for t in table.all()], {t.cache_group for t in table.all()})

    handle = load_model(spec, cfg, loop, registry, reserve, cache_budget, configure)
    if handle.kind != "embedding":
        warm_up(handle)
    return handle


def fetch_default_model(specs: list[ModelSpec]) -> None:
    """Prepare the default model (download and convert it the first time) when a served
    model is ``default``, before the server starts.

    Raises:
        SystemExit: it cannot be prepared; the message names the commands that prepare it
            by hand.
    """
    if not any(s.path == "default" for s in specs):
        return
    from gateway.models.default_model import DefaultModelError, ensure_default_model

    try:
        ensure_default_model()
    except DefaultModelError as e:
        raise SystemExit(f"mlx-gateway: {e}")


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


KEY_ENV = "MLX_GATEWAY_API_KEY"


def single_api_key(cfg: ServeConfig) -> Optional[str]:
    """The single tenant's key: ``--api-key``, else the first line of ``--api-key-file``
    (stripped), else the ``MLX_GATEWAY_API_KEY`` environment variable (empty: unset);
    None when none is given.

    Raises:
        ValueError: both ``--api-key`` and ``--api-key-file``, or a key file that cannot
            be read or whose first line is empty.
    """
    if cfg.api_key and cfg.api_key_file:
        raise ValueError("give the key once: --api-key or --api-key-file, not both")
    if cfg.api_key:
        return cfg.api_key
    if cfg.api_key_file:
        try:
            with open(cfg.api_key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-key-file {cfg.api_key_file}: cannot read it: {e}") from e
        if not key:
            raise ValueError(f"--api-key-file {cfg.api_key_file}: the first line is empty; it must hold the key")
        return key
    return os.environ.get(KEY_ENV, "").strip() or None


def tenant_table(cfg: ServeConfig) -> TenantTable:
    """The tenants to serve: ``--tenants FILE``, else one keyed tenant with the key of
    :func:`single_api_key`, else one open tenant (a WARNING is logged when that open
    tenant listens on a non-loopback address, with ``--allow-unauthenticated``).

    Raises:
        TenantsFileError: the tenants file is invalid.
        ValueError: ``--tenants`` with a single key (``--api-key``, ``--api-key-file`` or
            ``MLX_GATEWAY_API_KEY``), an unreadable or empty key file, or no key on a
            non-loopback host without ``--allow-unauthenticated``.
    """
    key = single_api_key(cfg)
    if cfg.tenants:
        if key is not None:
            given = ("--api-key" if cfg.api_key else "--api-key-file" if cfg.api_key_file
                     else f"the {KEY_ENV} environment variable")
            raise ValueError(
                f"--tenants and {given} were both given: with --tenants FILE the keys are the key_sha256 "
                f"lists of that file, and a single key would be ignored; remove {given} "
                "(or add its hash to the file: `mlx-gateway keys new NAME`)"
            )
        return load_tenants(cfg.tenants)
    if key is not None:
        return single_key_table(key)
    loopback = is_loopback(cfg.host)
    if not loopback and not cfg.allow_unauthenticated:
        raise ValueError(
            f"refusing to serve on {cfg.host} without API keys: give --tenants FILE, --api-key-file FILE or "
            f"{KEY_ENV} (or --api-key KEY, visible in `ps`), "
            "or --allow-unauthenticated to serve anyone who can reach this address"
        )
    if not loopback:
        log.warning("serving on %s WITHOUT API keys (--allow-unauthenticated): anyone who can reach this "
                    "address may generate, and read usage", cfg.host)
    return open_table(loopback)


def apply_tenants(front: Front, table: TenantTable) -> None:
    """Use ``table`` from now on: create its metric series and apply its cache-group quotas
    to every loaded model (on the engine thread, without waiting for it: this runs in the
    SIGHUP handler, on the event loop's thread). A model loaded later gets the table in use."""
    front.tenants = table
    prime_metrics(front)
    for h in front.models.handles():
        h.engine.apply_quotas(lambda: front.tenants.quotas())  # the newest table when it runs


def prime_metrics(front: Front) -> None:
    """Create the configured tenants' and cache groups' series at 0, for every model
    (:func:`prime`). Metric series only (no MLX, no cache entries): safe on any thread."""
    tenants = front.tenants.all()
    for slot in front.models.slots:
        prime(front.metrics, [t.name for t in tenants], slot.name)
    for a in front.adapters.all():
        front.metrics.lora.prime(a.base, a.name)
    for h in front.models.handles():
        h.engine.prime_metrics([t.name for t in tenants], {t.cache_group for t in tenants})


def reload_tenants(front: Front) -> bool:
    """Re-read the tenants file; on an error keep the current tenants and log why.

    Requests in flight are not touched: they keep the tenant they started with.
    Returns True when the new file is in use.
    """
    path = front.config.tenants
    if not path:
        log.info("no --tenants file to reload")
        return False
    try:
        table = load_tenants(path)
    except TenantsFileError as e:
        log.error("tenants file not reloaded, keeping the current tenants: %s", e)
        return False
    apply_tenants(front, table)
    log.info("tenants reloaded: %d tenants", len(table.tenants))
    return True


def _build_info(registry: CollectorRegistry, cfg: ServeConfig, specs: list[ModelSpec], budget: int) -> None:
    info = Info("mlx_gateway_build", "Versions, models and scheduling flags.", registry=registry)
    info.info({"mlx_gateway": _version("mlx-gateway"), "mlx": _version("mlx"), "mlx_lm": _version("mlx-lm"),
               "model": specs[0].name, "models": ",".join(s.name for s in specs), "memory_budget": str(budget),
               "prompt_concurrency": str(cfg.prompt_concurrency), "decode_concurrency": str(cfg.decode_concurrency),
               "prefill_step_size": str(cfg.prefill_step_size)})


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "unknown"


def _first_model_dir(cfg: ServeConfig) -> Optional[str]:
    """The directory of the first model to serve when it is at hand (``--model DIR``, or the
    default model once fetched), for the shapes of start-up measurements; else None."""
    from gateway.models.default_model import default_model_dir

    models = [cfg.model] if isinstance(cfg.model, str) else cfg.model
    if models:
        return models[0]
    return None if cfg.models_file else str(default_model_dir())


def serve(cfg: ServeConfig) -> None:
    """Run the gateway until SIGTERM or SIGINT (see :mod:`gateway.shutdown`: running
    requests get ``--shutdown-grace`` seconds to finish). The models to load at start load
    in the background; ``/health`` answers 503 until they are ready. SIGHUP reloads
    ``--tenants``.

    Raises:
        SystemExit: a bad models or tenants file or key flags, a ``--prompt-cache-dir`` that
            cannot be a private directory of this user, an open non-loopback host (see
            :func:`tenant_table`), a response store that cannot be opened, an
            ``MLX_GATEWAY_IDLE_TRIM_SECONDS`` that is not a finite number, or uvicorn could
            not start.
    """
    import uvicorn

    from gateway.shutdown import UVICORN_GRACE, GatewayServer

    configure_logging(cfg.log_level, cfg.log_format)
    from gateway.cpu.idle_trim import BUSY_FREE_SHARE, IdleTrimmer, idle_seconds_setting

    # The backend, decided once (gateway/backend.py). The CPU: re-executes with OpenBLAS
    # preloaded where it measures faster, or warns (before any thread); its other paths
    # are measured as a model loads (gateway.models.loader).
    backend().start(_first_model_dir(cfg))
    try:
        trim_after = idle_seconds_setting() if backend().trims_idle else 0.0
        # Refuse a bad models or tenants file, or an open non-loopback host, before any work,
        specs = model_specs(cfg)
        tenants = tenant_table(cfg)
        check_limits_store(cfg)
        check_responses_store(cfg)
        if cfg.prompt_cache_dir:  # and a disk-tier directory that cannot be used
            from cache.disk_files import secure_dir

            secure_dir(Path(cfg.prompt_cache_dir).expanduser())
    except (TenantsFileError, ValueError, OSError) as e:
        raise SystemExit(f"mlx-gateway: {e}")
    fetch_default_model(specs)
    from gateway.ranks import join, serve_follower, stop_if_load_fails

    cluster = join(cfg, specs)  # under mlx.launch: one model split across the ranks
    if cluster is not None and cluster.rank > 0:
        serve_follower(cfg, specs[0], cluster)
        return
    try:
        gateway = build_gateway(cfg, tenants, specs)
    except (ValueError, OSError, sqlite3.Error) as e:  # a response store that cannot be opened
        raise SystemExit(f"mlx-gateway: {e}")
    if trim_after > 0:  # the kept memory goes back after a quiet spell, or past an eighth of the budget
        IdleTrimmer(gateway.activity, trim_after, busy_free_limit=gateway.models.budget // BUSY_FREE_SHARE).start()
    gateway.start()
    if cluster is not None:
        stop_if_load_fails(gateway.models, cluster)
    config = uvicorn.Config(gateway.app, host=cfg.host, port=cfg.port, log_level=cfg.log_level.lower(),
                            timeout_graceful_shutdown=UVICORN_GRACE,
                            h11_max_incomplete_event_size=cfg.max_header_bytes, log_config=None)
    server = GatewayServer(config, gateway.front, gateway.models, on_reload=lambda: reload_tenants(gateway.front))
    link = None
    if cfg.router_url:
        from gateway.router_link import link_to_router

        link = link_to_router(cfg.router_url, cfg.host, cfg.port, cfg.advertise_url,
                              draining=lambda: gateway.front.draining)
    try:
        server.run()
    finally:
        if link is not None:
            link.close()  # out of the router, if the drain ended before the link saw it
        gateway.stop()  # a graceful stop writes the prompt caches to their disk tier first
    if cluster is not None and cluster.error:
        raise SystemExit(f"mlx-gateway: {cluster.error}")
    if not server.started:
        raise SystemExit(3)
