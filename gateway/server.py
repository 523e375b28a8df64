"""Assemble and run the gateway: load the model, start the engine, serve the app."""

from __future__ import annotations

import gc
import ipaddress
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from prometheus_client import CollectorRegistry, Info, ProcessCollector

from gateway.http.app import ServerState, create_app
from gateway.config import ServeConfig
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.request_log import configure_logging
from gateway.tenancy.tenants import TenantsFileError, TenantTable, load_tenants, open_table, single_key_table

if TYPE_CHECKING:
    from cache.tiering import DiskLink

log = logging.getLogger("mlx_gateway")


def context_length(model, tokenizer, default: int = 32768) -> int:
    """The model's context in tokens: ``max_position_embeddings`` of its config,
    else the tokenizer's ``model_max_length`` when sensible, else ``default``."""
    args = getattr(model, "args", None)
    for obj in (args, getattr(args, "text_config", None)):
        if isinstance(obj, dict):
            value = obj.get("max_position_embeddings")
        else:
            value = getattr(obj, "max_position_embeddings", None)
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(tokenizer, "model_max_length", None)
    return value if isinstance(value, int) and 0 < value < 10_000_000 else default


def logits_size(model) -> int:
    """Entries in the model's logits (embedding rows, often more than the tokenizer has),
    read from one forward pass of a single token."""
    import mlx.core as mx

    return int(model(mx.array([[0]])).shape[-1])


def resolve_model(cfg: ServeConfig) -> tuple[str, str]:
    """(path or hub id to load, id to serve it as).

    ``--model PATH_OR_ID`` is served as given. ``--model demo`` (when no ``./demo``
    directory exists) builds the tiny random-weight demo model, served as
    ``mlx-gateway-demo``. Without ``--model`` the default model (SmolLM2-135M-Instruct) is
    downloaded and converted the first time, then taken from the cache.

    Raises:
        SystemExit: the default model cannot be prepared; the message names the commands
            that prepare it by hand.
    """
    if cfg.model == "demo" and not os.path.isdir("demo"):
        from gateway.models.demo_model import build_model_dir, default_demo_dir

        path = build_model_dir(default_demo_dir(), "qwen3")
        log.warning(
            "--model demo: serving the built-in demo model (tiny qwen3 with RANDOM weights, "
            "its output is random text) from %s", path,
        )
        return str(path), "mlx-gateway-demo"
    if cfg.model:
        return cfg.model, cfg.model
    from gateway.models.default_model import DEFAULT_MODEL_ID, DefaultModelError, ensure_default_model

    try:
        path = ensure_default_model()
    except DefaultModelError as e:
        raise SystemExit(f"mlx-gateway: {e}")
    log.info("no --model given: serving %s from %s", DEFAULT_MODEL_ID, path)
    return str(path), DEFAULT_MODEL_ID


class DiskTierUnusable(RuntimeError):
    """``--prompt-cache-dir`` passed the start-up check but its tier could not be opened
    (e.g. another server holds it)."""


def open_disk_tier(cfg: ServeConfig, path: str, tokenizer, registry, loaded_as: Optional[str] = None) -> "DiskLink":
    """The prefix cache's disk tier in ``cfg.prompt_cache_dir``, keyed by the identity of
    the model at ``path`` (weights, config, tokenizer, chat template, and ``loaded_as``:
    how its weights were changed after loading, if they were).

    Raises:
        OSError: the directory cannot be created or used (another server holds it,
            another user owns it, no permission).
    """
    from mlx_lm.utils import _download

    from cache.disk import DiskTier
    from cache.disk_format import model_identity
    from cache.tiering import DiskLink

    template = getattr(tokenizer, "chat_template", None)
    identity = model_identity(_download(path), template if isinstance(template, str) else None, loaded_as)
    tier = DiskTier(Path(cfg.prompt_cache_dir).expanduser(), cfg.prompt_cache_disk_bytes, identity, registry=registry)
    log.info("prompt-cache disk tier: %s (%d entries, %d bytes, bound %d bytes)",
             tier.dir, tier.num_entries, tier.nbytes, tier.max_bytes)
    return DiskLink(tier)


def load_into(state: ServerState, path: str) -> None:
    """Load the model and start the engine; on failure set ``state.load_error``."""
    import mlx_lm

    from cache import PromptCacheManager
    from gateway.conversation.prompts import warm_up
    from gateway.cpu.weights import float32_weights_for_cpu_backend
    from scheduler import Engine
    from scheduler.equivalence import batch_is_exact
    from scheduler.grammar import Grammars, json_schema_grammar

    cfg = state.config
    try:
        # Every MLX call of start-up (loading, the batch-equivalence and logits probes) is
        # made here, on this thread, before the engine thread exists; from engine.start()
        # on only the engine thread uses MLX (MLX from several threads is a crash class).
        model, tokenizer = mlx_lm.load(path)
        # Linux CPU: only float32 matmuls use BLAS (README: "Weights in float32")
        loaded_as = "float32" if float32_weights_for_cpu_backend(model) is None else None
        exact = batch_is_exact(model)
        vocab_size = logits_size(model)
        if not exact:
            log.warning("padded batches of this model do not match single requests; "
                        "prompts will only be batched when they need no padding")
        manager = PromptCacheManager(cfg.prompt_cache_bytes, cfg.prompt_cache_size, registry=state.registry)
        if cfg.prompt_cache_dir:
            try:
                manager.attach_disk(open_disk_tier(cfg, path, tokenizer, state.registry, loaded_as))
            except OSError as e:
                raise DiskTierUnusable(f"the prompt cache's disk tier cannot be used: {e}") from e
        manager.set_quotas(state.tenants.quotas())
        engine = Engine(
            model,
            tokenizer.eos_token_ids,
            manager,
            prompt_concurrency=cfg.prompt_concurrency,
            decode_concurrency=cfg.decode_concurrency,
            prefill_step_size=cfg.prefill_step_size,
            prefill_budget=cfg.prefill_budget,
            max_waiting=cfg.max_waiting,
            registry=state.registry,
            pad_free_prefill=not exact,
            gather_wait=cfg.gather_wait,
        )
        state.tokenizer = tokenizer
        warm_up(tokenizer, cfg.chat_template_args, cfg.checkpoint_every)
        state.context_length = context_length(model, tokenizer)
        state.vocab_size = vocab_size
        state.grammars = Grammars(tokenizer._tokenizer, state.vocab_size, tokenizer.eos_token_ids)
        state.grammars.check(json_schema_grammar({"type": "object"}))  # builds the vocabulary index now
        engine.start()
        state.engine = engine
        state.set_tenants(state.tenants)  # metric series, and quotas of a table reloaded while loading
        # What exists now (model, tokenizer, grammar index) lives as long as the server:
        # keep it out of every later cyclic-GC pass. (A cold burst's wall time is bimodal,
        # 1.5 or 2.5 s, and consistently 1.5 s with the GC disabled; see the README.)
        gc.collect()
        gc.freeze()
        log.info("model %s ready (context %d tokens)", state.model_id, state.context_length)
    except Exception as e:
        log.exception("loading %s failed", path)
        state.load_error = str(e) if isinstance(e, DiskTierUnusable) else f"loading the model failed: {e}"


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


def build_state(cfg: ServeConfig, model_id: str, tenants: Optional[TenantTable] = None) -> ServerState:
    """The server state for ``cfg``, with ``tenants`` (read from ``cfg`` when None).

    Raises:
        TenantsFileError, ValueError: see :func:`tenant_table`.
    """
    registry = CollectorRegistry()
    # Resident memory, CPU seconds, open files (from /proc: Linux only; elsewhere it adds
    # nothing). On MLX's CPU backend the arrays live in this process's heap.
    ProcessCollector(namespace="mlx_gateway", registry=registry)
    state = ServerState(config=cfg, registry=registry, metrics=GatewayMetrics(registry), model_id=model_id,
                        tenants=tenants if tenants is not None else tenant_table(cfg))
    _build_info(registry, cfg, model_id)
    state.prime_metrics()
    return state


def reload_tenants(state: ServerState) -> bool:
    """Re-read the tenants file; on an error keep the current tenants and log why.

    Requests in flight are not touched: they keep the tenant they started with.
    Returns True when the new file is in use.
    """
    path = state.config.tenants
    if not path:
        log.info("no --tenants file to reload")
        return False
    try:
        table = load_tenants(path)
    except TenantsFileError as e:
        log.error("tenants file not reloaded, keeping the current tenants: %s", e)
        return False
    state.set_tenants(table)
    log.info("tenants reloaded: %d tenants", len(table.tenants))
    return True


def _build_info(registry: CollectorRegistry, cfg: ServeConfig, model_id: str) -> None:
    info = Info("mlx_gateway_build", "Versions, model and scheduling flags.", registry=registry)
    info.info({
        "mlx_gateway": _version("mlx-gateway"),
        "mlx": _version("mlx"),
        "mlx_lm": _version("mlx-lm"),
        "model": model_id,
        "prompt_concurrency": str(cfg.prompt_concurrency),
        "decode_concurrency": str(cfg.decode_concurrency),
        "prefill_step_size": str(cfg.prefill_step_size),
    })


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "unknown"


def engine_activity(state: ServerState) -> Optional[int]:
    """The engine's step count while it is idle; None while a request waits or runs, or
    before the model has loaded (what :class:`gateway.cpu.idle_trim.IdleTrimmer` watches)."""
    engine = state.engine
    if engine is None or not engine.idle:
        return None
    return engine.stats.steps


def serve(cfg: ServeConfig) -> None:
    """Run the gateway until SIGTERM or SIGINT (see :mod:`gateway.shutdown`: running
    requests get ``--shutdown-grace`` seconds to finish). The model loads in the
    background; ``/health`` answers 503 until it is ready. SIGHUP reloads ``--tenants``.

    Raises:
        SystemExit: a bad tenants file or key flags, a ``--prompt-cache-dir`` that cannot
            be a private directory of this user, an open non-loopback host (see
            :func:`tenant_table`), an ``MLX_GATEWAY_IDLE_TRIM_SECONDS`` that is not a
            finite number, or uvicorn could not start.
    """
    import uvicorn

    from gateway.shutdown import UVICORN_GRACE, GatewayServer

    configure_logging(cfg.log_level, cfg.log_format)
    from gateway.cpu.allocator import keep_freed_memory
    from gateway.cpu.attention import install_for_cpu_backend
    from gateway.cpu.blas import ensure_fast_blas
    from gateway.cpu.idle_trim import IdleTrimmer, idle_seconds_setting

    ensure_fast_blas()  # Linux CPU: re-executes with OpenBLAS preloaded, or warns (before any thread)
    # Linux CPU: freed buffers are reused instead of page-faulted in again, and attention
    # gets a compiled exp (it makes more temporaries than MLX's: only with reused memory).
    keeping_freed = keep_freed_memory() is None
    if keeping_freed:
        install_for_cpu_backend()
    try:
        trim_after = idle_seconds_setting() if keeping_freed else 0.0
        tenants = tenant_table(cfg)  # refuse a bad tenants file or an open non-loopback host before any work
        if cfg.prompt_cache_dir:  # and a disk-tier directory that cannot be used
            from cache.disk import secure_dir

            secure_dir(Path(cfg.prompt_cache_dir).expanduser())
    except (TenantsFileError, ValueError, OSError) as e:
        raise SystemExit(f"mlx-gateway: {e}")
    path, model_id = resolve_model(cfg)
    state = build_state(cfg, model_id, tenants)
    if trim_after > 0:  # the kept memory goes back to the kernel after a quiet spell
        IdleTrimmer(lambda: engine_activity(state), trim_after).start()
    app = create_app(state)
    threading.Thread(target=load_into, args=(state, path), name="model-loader", daemon=True).start()
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level.lower(),
                            timeout_graceful_shutdown=UVICORN_GRACE,
                            h11_max_incomplete_event_size=cfg.max_header_bytes, log_config=None)
    server = GatewayServer(config, state, on_reload=lambda: reload_tenants(state))
    try:
        server.run()
    finally:
        from scheduler.engine import PERSIST_SECONDS

        if state.engine is not None:
            # A graceful stop writes the prompt cache to its disk tier first.
            state.engine.stop(timeout=PERSIST_SECONDS + 10 if cfg.prompt_cache_dir else 10)
    if not server.started:
        raise SystemExit(3)
