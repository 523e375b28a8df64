"""``mlx-gateway serve`` under ``mlx.launch``: one model split across the ranks.

Rank 0 serves HTTP and schedules as in one process (its model is split when the loader
sees :func:`scheduler.distributed.current`); the other ranks load the same model the same
way (the collectives of the load-time probes run in the same order) and replay rank 0's
batch (:mod:`scheduler.distributed`). See docs/cluster.md, "One model across machines".
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Optional

from gateway.config import ServeConfig
from gateway.models.spec import ModelSpec
from scheduler import distributed

log = logging.getLogger("mlx_gateway.distributed")

# Set by mlx.launch (ring, jaccl), mpirun, or a PMI launcher.
_RANK_VARIABLES = ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def join(cfg: ServeConfig, specs: list[ModelSpec]) -> Optional[distributed.Cluster]:
    """Join the ranks this process was launched with; None when it runs alone.

    Raises:
        SystemExit: a setting that cannot be served across ranks.
    """
    cluster = distributed.init(cfg.pipeline) if any(v in os.environ for v in _RANK_VARIABLES) else None
    if cluster is None:
        if cfg.pipeline:
            log.warning("--pipeline: this process runs alone (not under mlx.launch); the model is not split")
        return None
    if len(specs) != 1:
        raise SystemExit("mlx-gateway: across ranks, exactly one model is served (one --model)")
    if cfg.prompt_cache_dir:
        raise SystemExit("mlx-gateway: --prompt-cache-dir (the disk tier) is not supported across ranks")
    # Loaded at start, never unloaded (keep_alive, admin): the other ranks leave with it.
    specs[0] = replace(specs[0], pin=True, preload=True, keep_alive=None)
    return cluster


def serve_follower(cfg: ServeConfig, spec: ModelSpec, cluster: distributed.Cluster) -> None:
    """Rank > 0: load ``spec`` split as rank 0 does, then replay rank 0's batch until it
    stops.

    Raises:
        SystemExit: a lost rank or a divergence (status 1 with its message).
    """
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model as load_weights
    from mlx_lm.utils import load_tokenizer

    from cache.restore import always_trimmable
    from compat.mlx_lm import download
    from gateway.backend import backend
    from gateway.models.loader import logits_size, resolve_path
    from cache.quantized import quantize_kv
    from scheduler.batch.equivalence import batch_is_exact

    # The same steps, and so the same collectives, as gateway.models.loader.load_model.
    model_path = Path(download(resolve_path(spec)))
    model, config = load_weights(model_path, lazy=True)
    try:
        cluster.shard(model)
    except ValueError as e:  # rank 0 reports it too, as a failed load
        raise SystemExit(f"mlx-gateway: rank {cluster.rank}: {e}")
    backend().prepare_weights(model, measure=False)  # as rank 0: every rank decides alike
    if spec.kv_bits:
        try:
            quantize_kv(model, spec.kv_bits, spec.kv_group_size)
        except ValueError as e:  # rank 0 reports it too, as a failed load
            raise SystemExit(f"mlx-gateway: rank {cluster.rank}: {e}")
    backend().prepare(model, measure=False)  # as rank 0: MLX's own paths on every rank
    batch_is_exact(model)
    logits_size(model)
    tokenizer = load_tokenizer(model_path, eos_token_ids=config.get("eos_token_id", None))
    cluster.connect()  # rank 0 does the same once its engine is made (scheduler.distributed.lead)
    log.info("rank %d of %d serves its part of %s (%s parallel)", cluster.rank, cluster.size, spec.name,
             cluster.split)
    _leave_with_rank0(cluster, cfg.shutdown_grace + FOLLOWER_MARGIN)
    try:
        distributed.follow(cluster, model, tokenizer.eos_token_ids, prompt_concurrency=cfg.prompt_concurrency,
                           decode_concurrency=cfg.decode_concurrency, prefill_step_size=cfg.prefill_step_size,
                           trimmable=always_trimmable(make_prompt_cache(model)))
    except distributed.ClusterLost as e:
        cluster.fail(str(e))
        raise SystemExit(f"mlx-gateway: rank {cluster.rank}: {e}")
    log.info("rank %d: rank 0 stopped; leaving", cluster.rank)


# Seconds a follower waits for rank 0's stop after SIGTERM or SIGINT, beyond rank 0's
# --shutdown-grace, before leaving anyway.
FOLLOWER_MARGIN = 30.0


def _leave_with_rank0(cluster: distributed.Cluster, grace: float) -> None:
    """SIGTERM and SIGINT (Ctrl-C reaches every rank of a local launch) do not end a
    follower at once: rank 0 drains its requests, then tells the followers to stop; were
    they gone first, its requests would fail. A follower still running ``grace`` seconds
    after the signal leaves anyway."""
    import signal
    import threading

    def later(signum, frame) -> None:
        log.info("rank %d: signal %d; leaving when rank 0 stops (at most %g s)", cluster.rank, signum, grace)
        timer = threading.Timer(grace, lambda: os._exit(0))
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, later)
    signal.signal(signal.SIGINT, later)


def stop_if_load_fails(models, cluster: distributed.Cluster) -> None:
    """Rank 0: a model load that fails after the split (the memory budget, the tokenizer,
    the probes) leaves the followers waiting in the load's collectives; stop the cluster
    then, with the load's error, instead of serving nothing with health "error".

    ``models`` is the gateway's :class:`gateway.models.registry.ModelRegistry`; watched by
    a daemon thread until the model is loaded or the cluster stops.
    """
    import threading
    import time

    def watch() -> None:
        while not cluster.failed and not cluster.stopped:
            state, why = models.startup()
            if state == "ok":
                return
            if state == "error":
                cluster.fail(f"loading the model failed on rank 0: {why}")
                return
            time.sleep(0.2)

    threading.Thread(target=watch, name="cluster-load-watch", daemon=True).start()

