"""Loading one served model: weights, tokenizer, probes, prefix cache and engine.

:func:`load_model` runs on a loader thread, never on the engine loop's thread, so that
loading one model stalls no other model's decoding: the weights are read and evaluated
(and, on a Linux CPU, converted to float32) there, the batch-equivalence, logits and
speculation-rollback probes run there, and only the hand-over (attaching the new engine to the loop, which
opens its batch) happens on the loop's thread, between two steps. MLX 0.31.2 and later
give each thread its own default stream, so evaluating on the loader thread does not
touch the engine loop's stream.

Two steps of a first load hold Python's GIL, and so pause every other thread, the
engine loop's included, for as long as they run: parsing the tokenizer (the Rust
``tokenizers`` library) and building the grammar engine's index of the vocabulary
(llguidance's ``LLTokenizer``). Both grow with the vocabulary: about 0.3 s and 0.9 s for
Llama 3's 128k tokens, 0.6 s and 2.4 s for Gemma 3's 262k, a few milliseconds for a
small one (measured on a 2-core CPU). Both are kept, with the outcomes of the probes
(:mod:`gateway.models.load_memo`), so a model unloaded and loaded again (LRU,
``keep_alive``) pays neither, and the index is shared by models on the same tokenizer
(:func:`scheduler.grammar.vocabulary_index`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Callable, Iterator, Optional

from prometheus_client import CollectorRegistry

from cache import CacheBudget, PromptCacheManager
from cache.quantized import quantize_kv
from gateway.config import ServeConfig
from gateway.models import load_memo
from gateway.models.draft import check_draft, read_draft
from gateway.models.handle import ModelHandle
from gateway.models.spec import ModelSpec
from scheduler import Engine
from scheduler.engine.loop import EngineLoop
from scheduler.speculative import DraftModel, SpeculationConfig, rollback_refusal, speculation_refusal

log = logging.getLogger("mlx_gateway")

LOAD_SWITCH_INTERVAL = 0.001  # seconds: Python's thread switch interval while a load runs (default 0.005)
_loads_lock = threading.Lock()
_loads = [0, 0.005]  # loads running, the switch interval before the first


@contextlib.contextmanager
def load_switch_interval() -> Iterator[None]:
    """Let a model's load (on the calling thread) hand the GIL back to the engine loop
    quickly: while any load runs, Python's thread switch interval is
    :data:`LOAD_SWITCH_INTERVAL`, so the engine thread waits at most that long for the
    GIL between its MLX calls while the loader runs Python (the tokenizer's set-up),
    instead of 5 ms each time.

    The thread keeps its CPU priority. A load thread at the lowest priority (nice 19,
    as it once was) stalled the others' decoding longer wherever a third process took
    a core: starved, it held the GIL the engine waited for. Measured on 2 cores (a
    512-hidden 8-layer qwen3 decoding while a second loads, a busy-loop process beside
    them): the largest gap 131-184 ms at nice 19 against 67-80 ms at the usual
    priority; without the busy process 35-259 against 41-52 ms.
    """
    with _loads_lock:
        if _loads[0] == 0:
            _loads[1] = sys.getswitchinterval()
            sys.setswitchinterval(LOAD_SWITCH_INTERVAL)
        _loads[0] += 1
    try:
        yield
    finally:
        with _loads_lock:
            _loads[0] -= 1
            if _loads[0] == 0:
                sys.setswitchinterval(_loads[1])


class DiskTierUnusable(RuntimeError):
    """``--prompt-cache-dir`` passed the start-up check but its tier could not be opened
    (e.g. another server holds it)."""


def resolve_path(spec: ModelSpec) -> str:
    """The local directory or hub id to load for ``spec``: ``demo`` (when no ``./demo``
    directory exists) builds the tiny random-weight demo model; ``default`` fetches the
    default model (SmolLM2-135M-Instruct) the first time, then takes it from the cache.

    Raises:
        RuntimeError: the default model cannot be prepared; the message names the commands
            that prepare it by hand.
    """
    if spec.path == "demo" and not os.path.isdir("demo"):
        from gateway.models.demo_model import build_model_dir, default_demo_dir

        path = build_model_dir(default_demo_dir(), "qwen3")
        log.warning("%s: serving the built-in demo model (tiny qwen3 with RANDOM weights, its output is random "
                    "text) from %s", spec.name, path)
        return str(path)
    if spec.path == "default":
        from gateway.models.default_model import DEFAULT_MODEL_ID, DefaultModelError, ensure_default_model

        try:
            path = ensure_default_model()
        except DefaultModelError as e:
            raise RuntimeError(str(e)) from e
        log.info("%s: serving %s from %s", spec.name, DEFAULT_MODEL_ID, path)
        return str(path)
    return spec.path


def _speculation(spec: ModelSpec, refusal: Optional[str], draft: Optional[DraftModel] = None) -> SpeculationConfig:
    """The model's speculative decoding: off where ``refusal`` says why it cannot
    speculate (a warning when it was asked for, info for ``"auto"``), else ``spec``'s
    method (:attr:`~gateway.models.spec.ModelSpec.speculation_method`) with ``draft``
    (read and checked) for ``"draft"``; its rollback was checked at load."""
    method = spec.speculation_method
    if method == "off":
        return SpeculationConfig()
    if refusal is not None:
        (log.info if spec.speculative == "auto" else log.warning)(
            "%s: speculative decoding is off: %s", spec.name, refusal)
        return SpeculationConfig()
    log.info("%s: speculative decoding: %s, up to %d draft tokens a row and step%s", spec.name, method,
             spec.num_draft_tokens, " (auto; --speculative off turns it off)" if spec.speculative == "auto" else "")
    return SpeculationConfig(method, spec.num_draft_tokens, draft=draft, rollback_checked=True)


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


def open_disk_tier(cfg: ServeConfig, path: str, tokenizer, registry, loaded_as: Optional[str] = None,
                   served_as: Optional[str] = None):
    """The prefix cache's disk tier in ``cfg.prompt_cache_dir``, keyed by the identity of
    the model at ``path`` (weights, config, tokenizer, chat template, ``loaded_as``: how
    its weights were changed after loading, if they were, and ``served_as``: the name it
    is served under): models share the directory, each in a subdirectory of its own, so
    the same files served under two names keep two caches (renaming a model starts its
    disk cache afresh).

    Raises:
        OSError: the directory cannot be created or used (another server holds it,
            another user owns it, no permission).
    """
    from compat.mlx_lm import download

    from cache.disk import DiskTier
    from cache.disk_format import model_identity
    from cache.tiering import DiskLink

    template = getattr(tokenizer, "chat_template", None)
    identity = model_identity(download(path), template if isinstance(template, str) else None, loaded_as, served_as)
    tier = DiskTier(Path(cfg.prompt_cache_dir).expanduser(), cfg.prompt_cache_disk_bytes, identity, registry=registry)
    log.info("prompt-cache disk tier: %s (%d entries, %d bytes, bound %d bytes)",
             tier.dir, tier.num_entries, tier.nbytes, tier.max_bytes)
    return DiskLink(tier)


def tokenizer_and_grammars(model_path: Path, config: dict, n_vocab: int):
    """The model's tokenizer (mlx-lm's ``TokenizerWrapper``) and its grammar compiler
    (:class:`scheduler.grammar.Grammars`, its vocabulary index built), taken from an
    earlier load of the same files when there was one (see the module docstring)."""
    from mlx_lm.utils import load_tokenizer

    from scheduler.grammar import Grammars, json_schema_grammar

    key = (load_memo.tokenizer_key(model_path, config), n_vocab)
    kept = load_memo.tokenizers.get(key)
    if kept is not None:
        return kept
    tokenizer = load_tokenizer(model_path, eos_token_ids=config.get("eos_token_id", None))
    grammars = Grammars(tokenizer._tokenizer, n_vocab, tokenizer.eos_token_ids)
    grammars.check(json_schema_grammar({"type": "object"}))  # builds the vocabulary index now
    return load_memo.tokenizers.setdefault(key, (tokenizer, grammars))


def model_kind(spec: ModelSpec, model_path: Path) -> str:
    """What the model at ``model_path`` is: the spec's ``kind`` when given; else
    ``"embedding"`` for a sentence-transformers directory or an encoder
    (:func:`gateway.models.embedding.is_embedding_dir`), ``"vision"`` for a checkpoint
    with a ``vision_config`` when mlx-vlm is installed (without it, such a model is served
    as text, as mlx-lm loads it, and a warning says so), and ``"text"`` otherwise."""
    if spec.kind:
        return spec.kind
    try:
        config = json.loads((model_path / "config.json").read_text())
    except (OSError, ValueError):
        return "text"
    from gateway.models.embedding import is_embedding_dir

    if is_embedding_dir(model_path, config):
        return "embedding"
    if config.get("vision_config"):
        import importlib.util

        if importlib.util.find_spec("mlx_vlm") is not None:
            return "vision"
        log.warning("%s has a vision tower, but mlx-vlm is not installed: served as a text model "
                    "(pip install 'mlx-gateway[vision]' for images)", spec.name)
    return "text"


def load_embedding(spec: ModelSpec, cfg: ServeConfig, loop: EngineLoop, registry: CollectorRegistry,
                   reserve: Callable[[int], None], configure: Optional[Callable], model_path: Path,
                   path: str) -> ModelHandle:
    """Load an embedding model (mlx-embeddings) and attach its
    :class:`~scheduler.engine.embedding.EmbeddingEngine` to ``loop``; see :func:`load_model`."""
    from gateway.backend import backend, weights_bytes
    from gateway.models.embedding import load_embedding_model
    from scheduler.engine.embedding import EmbeddingEngine

    embedder, config = load_embedding_model(model_path)
    reserve(backend().served_bytes(embedder.model))
    backend().prepare_weights(embedder.model)
    weights = weights_bytes(embedder.model)
    engine = EmbeddingEngine(embedder, loop, max_batch_inputs=cfg.decode_concurrency,
                             max_batch_tokens=max(cfg.prefill_step_size, 512) * 4, max_waiting=cfg.max_waiting,
                             registry=registry, name=spec.name)
    if configure is not None:
        configure(engine)
    vocab = int(config.get("vocab_size") or 0)
    handle = ModelHandle(spec, embedder.tokenizer, engine, embedder.context_length, vocab, None, weights, path,
                         kind="embedding", embedder=embedder)
    engine.start()
    return handle


def load_model(spec: ModelSpec, cfg: ServeConfig, loop: EngineLoop, registry: CollectorRegistry,
               reserve: Callable[[int], None], cache_budget: Optional[CacheBudget] = None,
               configure: Optional[Callable[[Engine], None]] = None) -> ModelHandle:
    """Load ``spec`` and hand its engine to ``loop`` (see the module docstring).

    Args:
        cfg: the server's settings (engine sizes, disk tier).
        loop: the engine loop every model runs on.
        registry: where this model's engine, prefix-cache and disk-tier metrics go.
        reserve: called with the bytes the weights will take once served (known from
            their shapes before they are read), before they are read: the model's, then,
            with a draft model that will serve, the two together before the draft's are
            read. It may unload other models to make room, or raise to refuse the load.
        cache_budget: the byte bound shared by every model's prefix cache.
        configure: called with the new engine before it starts (the tenants' cache
            quotas and metric series).

    Raises:
        DiskTierUnusable: the disk tier cannot be opened.
        Exception: whatever loading, ``reserve`` or the probes raised.
    """
    from mlx_lm.utils import load_model as load_weights

    from compat.mlx_lm import download
    from gateway.backend import backend, weights_bytes
    from scheduler import distributed
    from scheduler.batch_merge import spread_merges
    from scheduler.batch.equivalence import batch_is_exact
    from scheduler.batch.forward_cost import measure_forward_cost

    path = resolve_path(spec)
    model_path = Path(download(path))
    kind = model_kind(spec, model_path)
    if kind == "embedding":
        return load_embedding(spec, cfg, loop, registry, reserve, configure, model_path, str(path))
    vision = None
    if kind == "vision":  # mlx-vlm's vision side on mlx-lm's text model (gateway.models.vision_load)
        from gateway.models.vision_load import load_vision_model

        config = json.loads((model_path / "config.json").read_text())
        model, vision = load_vision_model(model_path, config)  # shapes only: nothing read yet
    else:
        model, config = load_weights(model_path, lazy=True)  # shapes only: nothing read yet
    cluster = distributed.current()
    if cluster is not None:  # one model across the ranks of mlx.launch (gateway/ranks.py)
        cluster.shard(model)
    # why it cannot speculate: split across ranks (the other ranks replay plain steps only),
    # cache kinds that cannot roll back a draft, then (once read) layers that ignore padding
    refusal = "it runs split across ranks" if cluster is not None else speculation_refusal(model)
    if vision is not None:  # drafts could copy image positions, which are no tokens
        refusal = refusal or "it reads images"
    draft = draft_path = None
    if spec.speculation_method == "draft" and refusal is None:  # a bad path fails before any weight is read
        draft, draft_path = read_draft(spec.name, spec.draft_model)  # shapes only
    tuning = backend()
    reserve(tuning.served_bytes(model))
    # the probes' outcomes, kept for a later load of the same files (not across ranks)
    recall = load_memo.Recall(model_path if cluster is None else None, kind, spec.kv_bits, spec.kv_group_size,
                              type(tuning).__name__)
    # the CPU: only float32 matmuls use BLAS (docs/deployment.md, "Weights in float32"),
    # measured on one of its layers; across ranks every rank must decide alike: unmeasured
    loaded_as = recall("weights", lambda: tuning.prepare_weights(model, measure=cluster is None),
                       lambda was: tuning.prepare_weights(model, decided=was or "as stored"))
    if spec.kv_bits:
        try:
            quantize_kv(model, spec.kv_bits, spec.kv_group_size)
        except ValueError as e:
            raise ValueError(f"{spec.name}: --kv-bits {spec.kv_bits}: {e}") from None
    if spec.speculation_method != "off" and refusal is None:
        refusal = recall("rollback", lambda: rollback_refusal(model))
    if refusal is not None:
        draft = None  # a refused model never reads its draft's weights, nor makes room for them
    if draft is not None:
        reserve(tuning.served_bytes(model) + tuning.served_bytes(draft))
        tuning.prepare_weights(draft)
    if vision is not None:
        from gateway.models.vision_load import check_agreement

        why = check_agreement(model, vision)
        if why is not None:
            raise RuntimeError(f"{spec.name} cannot be served with images: {why}")
    weights, draft_weights = (weights_bytes(m) if m is not None else 0 for m in (model, draft))
    # the CPU: attention kernels, allocator, merge streams, measured; MLX's own across ranks
    # (gateway/backend.py); Metal: the weights wired
    tuning.prepare(model, measure=cluster is None)
    exact = recall("batch equivalence", lambda: batch_is_exact(model))
    vocab = logits_size(model)
    tokenizer, grammars = tokenizer_and_grammars(model_path, config, vocab)
    if draft is not None:
        check_draft(spec.name, draft, draft_path, tokenizer)
        # a decode step reads every weight once (quantized ones packed): its cost goes by bytes
        draft = DraftModel(draft, vocab, relative_cost=draft_weights / max(1, weights))
    if not exact:
        log.warning("%s: padded batches of this model do not match single requests; prompts will only be "
                    "batched when they need no padding", spec.name)
    manager = PromptCacheManager(spec.prompt_cache_bytes, cfg.prompt_cache_size, registry=registry,
                                 budget=cache_budget)
    if cfg.prompt_cache_dir:
        try:
            # quantized snapshots only ever go to a gateway quantizing the same way
            kv = f"kv{spec.kv_bits}g{spec.kv_group_size}" if spec.kv_bits else None
            changed = "+".join(x for x in (loaded_as, kv) if x) or None
            manager.attach_disk(open_disk_tier(cfg, path, tokenizer, registry, changed, spec.name))
        except OSError as e:
            manager.close()
            raise DiskTierUnusable(f"the prompt cache's disk tier cannot be used: {e}") from e
    # what a prefill forward costs here: chunked prefill never cuts a chunk below the size
    # where its cost per token rises 20 % above the best chunk's (scheduler/batch/forward_cost.py);
    # not across ranks, where a forward is a collective the other ranks do not join here
    cost = None
    if cfg.prefill_budget > 0 and cluster is None:
        cost = recall("forward cost", lambda: measure_forward_cost(model))
    recall.log(spec.name)
    if cost is not None:
        log.info("%s: a prefill forward costs %s here: chunks beside decoding rows of at least %d tokens",
                 spec.name, cost.describe(), cost.floor(cfg.prefill_step_size))
    engine = Engine(model, tokenizer.eos_token_ids, manager, speculation=_speculation(spec, refusal, draft),
                    prompt_concurrency=cfg.prompt_concurrency,
                    decode_concurrency=cfg.decode_concurrency, prefill_step_size=cfg.prefill_step_size,
                    prefill_budget=cfg.prefill_budget, max_waiting=cfg.max_waiting, registry=registry,
                    pad_free_prefill=not exact, loop=loop, name=spec.name, forward_cost=cost)
    if cluster is not None:
        distributed.lead(engine, cluster)
    if tuning.merge_streams > 1:  # the engine thread's merges (the loop serves every model)
        loop.call(lambda: spread_merges(tuning.merge_streams))
    if configure is not None:
        configure(engine)
    handle = ModelHandle(spec, tokenizer, engine, context_length(model, tokenizer), vocab, grammars,
                         weights + draft_weights, str(path), kind=kind, vision=vision)
    try:
        engine.start()  # the hand-over: the loop opens its batch between two steps
    except BaseException:
        manager.close()
        raise
    return handle
