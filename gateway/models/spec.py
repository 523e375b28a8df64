"""Which models a gateway serves, and each one's settings: ``--model`` (repeatable) or
``--models FILE``.

A models file is TOML (read with ``tomllib``); each ``[models.NAME]`` table is one served
model, ``NAME`` the name clients send as ``model``::

    [models.chat]                  # served name
    path = "mlx-community/SmolLM2-360M-Instruct-4bit"   # hub id, local dir, "default" or "demo"
    aliases = ["small", "gpt-4o-mini"]
    pin = true                     # loaded at start, never unloaded
    keep_alive = "10m"             # unload after this much idle time; "0" right after use; "-1" never
    max_tokens = 1024              # max_tokens when a request gives none
    max_tokens_limit = 4096        # largest max_tokens a request may ask for
    temp = 0.7                     # sampling defaults: temp, top_p, top_k, min_p
    chat_template_args = { enable_thinking = false }
    prompt_cache_bytes = "2G"      # this model's share of the prefix cache
    max_prompt_tokens = 8192       # longest prompt (default: the model's context)
    checkpoint_every = 4096        # snapshot every N tokens of long prompts
    speculative = "ngram"          # speculative decoding: "auto" (the default), "ngram", "draft" or "off"
    draft_model = "path"           # the draft model of speculative = "draft"
    num_draft_tokens = 4           # most tokens drafted per row and step
    kv_bits = 8                    # quantized KV cache: 8 or 4 bits (default: float)
    kv_group_size = 64             # elements per quantization group
    kind = "embedding"             # "text", "vision" or "embedding" (default: found from its files)
    lora_modules = { support = "adapters/support" }  # LoRA adapters on this model, by name (docs/lora.md)

Every setting but ``path`` is optional; the ``serve`` flags of the same names are the
defaults (``--keep-alive`` for ``keep_alive``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from gateway.config import ServeConfig, parse_size, read_toml

DEMO_NAME = "mlx-gateway-demo"
DEFAULT_NAME = "SmolLM2-135M-Instruct"

_FIELDS = {"path", "aliases", "pin", "keep_alive", "max_tokens", "max_tokens_limit", "temp", "top_p", "top_k",
           "min_p", "chat_template_args", "prompt_cache_bytes", "max_prompt_tokens", "checkpoint_every",
           "speculative", "num_draft_tokens", "draft_model", "kv_bits", "kv_group_size", "kind", "lora_modules"}
KINDS = ("text", "vision", "embedding")
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


class ModelsFileError(ValueError):
    """The models file or the model flags are invalid (the message says which setting)."""


@dataclass(frozen=True)
class ModelSpec:
    """One served model and its settings.

    Attributes:
        name: the served name (what clients send as ``model``).
        path: a local directory or hub id for ``mlx_lm.load``, ``"demo"`` (the random-weight
            demo model) or ``"default"`` (SmolLM2-135M-Instruct, fetched once).
        aliases: other names it answers to.
        pin: loaded at start and never unloaded.
        keep_alive: seconds of idleness after which it is unloaded; 0 right after its last
            request; None never (it is unloaded only when the memory budget needs room).
        preload: loaded at start (pinned models, and models given with ``--model``), when
            it fits without unloading another.
        max_tokens: ``max_tokens`` when a request gives none; None: the answer runs until
            the model stops, the context ends or ``max_tokens_limit``.
        max_tokens_limit: the largest ``max_tokens`` a request may ask for.
        temp, top_p, top_k, min_p: default sampling settings.
        chat_template_args: passed to the chat template (a request's own win).
        prompt_cache_bytes: this model's bound on its prefix cache (bytes).
        max_prompt_tokens: the longest prompt (tokens); None: the model's context.
        checkpoint_every: a prefix-cache snapshot every N prompt tokens of long prompts.
        speculative: ``"ngram"``, ``"draft"`` or ``"off"`` (``scheduler.speculative``), or
            ``"auto"``: ``"draft"`` with a draft model, else ``"ngram"``, where the model can
            speculate, else ``"off"`` (logged at info, not as a warning: nobody asked for
            it); see :attr:`speculation_method`.
        num_draft_tokens: most tokens drafted per row and step.
        draft_model: the draft model's directory or hub id (``"draft"`` only).
        kv_bits, kv_group_size: a quantized KV cache (``cache.quantized``); None: float.
        kind: ``"text"``, ``"vision"`` (a vision-language model, loaded through mlx-vlm) or
            ``"embedding"`` (loaded through mlx-embeddings, for ``/v1/embeddings``); None:
            found from the model's files at load (:func:`gateway.models.loader.model_kind`).
    """

    name: str
    path: str
    aliases: tuple[str, ...] = ()
    pin: bool = False
    keep_alive: Optional[float] = None
    preload: bool = False
    max_tokens: Optional[int] = None
    max_tokens_limit: int = 32768
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    chat_template_args: dict = field(default_factory=dict)
    prompt_cache_bytes: int = 8 << 30
    max_prompt_tokens: Optional[int] = None
    checkpoint_every: int = 4096
    speculative: str = "auto"
    num_draft_tokens: int = 8
    draft_model: Optional[str] = None
    kv_bits: Optional[int] = None
    kv_group_size: int = 64
    kind: Optional[str] = None
    lora_modules: tuple[tuple[str, str], ...] = ()  # (adapter name, path) served on this model

    @property
    def names(self) -> tuple[str, ...]:
        """The served name, then the aliases."""
        return (self.name, *self.aliases)

    @property
    def speculation_method(self) -> str:
        """``"off"``, ``"ngram"`` or ``"draft"``: ``"auto"`` is ``"draft"`` with a draft
        model, else ``"ngram"`` (the loader turns either off where the model cannot
        speculate)."""
        if self.speculative == "auto":
            return "draft" if self.draft_model else "ngram"
        return self.speculative


def parse_keep_alive(value) -> Optional[float]:
    """Seconds from a keep-alive setting: a number of seconds, or a string with a unit
    (``"30s"``, ``"10m"``, ``"1h"``, ``"1d"``); ``0`` unloads right after use; a negative
    value (``"-1"``) never unloads (None).

    Raises:
        ValueError: anything else.
    """
    if isinstance(value, bool):
        raise ValueError(f"keep_alive must be a duration such as '10m', got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*([smhd]?)\s*", value)
        if m is None:
            raise ValueError(f"keep_alive must be a duration such as '10m', '30s', '0' or '-1', got {value!r}")
        seconds = float(m.group(1)) * _UNITS[m.group(2) or "s"]
    else:
        raise ValueError(f"keep_alive must be a duration such as '10m', got {value!r}")
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        raise ValueError(f"keep_alive must be finite, got {value!r}")
    return None if seconds < 0 else seconds


def defaults(cfg: ServeConfig) -> dict:
    """The per-model settings the ``serve`` flags give."""
    return dict(keep_alive=parse_keep_alive(cfg.keep_alive), max_tokens=cfg.max_tokens,
                max_tokens_limit=cfg.max_tokens_limit, temp=cfg.temp, top_p=cfg.top_p, top_k=cfg.top_k,
                min_p=cfg.min_p, chat_template_args=dict(cfg.chat_template_args),
                prompt_cache_bytes=cfg.prompt_cache_bytes, max_prompt_tokens=cfg.max_prompt_tokens,
                checkpoint_every=cfg.checkpoint_every,
                speculative=("draft" if cfg.draft_model else "auto") if cfg.speculative in (None, "auto")
                else cfg.speculative,
                num_draft_tokens=cfg.num_draft_tokens, draft_model=cfg.draft_model, kv_bits=cfg.kv_bits,
                kv_group_size=cfg.kv_group_size)


def served_name(path: str) -> str:
    """The name a ``--model`` value is served as: the value itself, ``mlx-gateway-demo`` for
    ``demo`` (unless a ``./demo`` directory exists) and SmolLM2-135M-Instruct for ``default``."""
    if path == "demo" and os.path.isdir("demo"):
        return path
    return {"demo": DEMO_NAME, "default": DEFAULT_NAME}.get(path, path)


def model_specs(cfg: ServeConfig) -> list[ModelSpec]:
    """The models ``cfg`` serves, in order (the first answers requests that name none).

    ``--models FILE`` gives them all; otherwise each ``--model`` is one model, served as
    given and loaded at start (a lone one is also pinned, with ``--served-model-name``
    as its aliases); with neither, the default model.

    Raises:
        ModelsFileError: an unreadable or invalid file, ``--models`` with ``--model``,
            ``--served-model-name`` with several models, two models answering to one name,
            or a ``draft`` speculation without a draft model.
    """
    if cfg.draft_model and cfg.speculative == "ngram":
        raise ModelsFileError("--draft-model drafts with --speculative draft, not ngram")
    base = defaults(cfg)
    if cfg.models_file:
        if cfg.model:
            raise ModelsFileError("give the models either with --model or in --models FILE, not both")
        if cfg.served_model_names:
            raise ModelsFileError("--served-model-name names the one model of --model; in --models FILE "
                                  "give each model its aliases = [...]")
        specs = load_models_file(cfg.models_file, base)
    else:
        paths = [cfg.model] if isinstance(cfg.model, str) else list(cfg.model or ["default"])
        if len(paths) > 1 and cfg.served_model_names:
            raise ModelsFileError("--served-model-name is for one model; with several --model flags, use "
                                  "--models FILE and give each model its aliases")
        alone = len(paths) == 1
        specs = [ModelSpec(name=served_name(p), path=p, pin=alone, preload=True,
                           aliases=tuple(cfg.served_model_names) if alone else (), **{**base,
                           "keep_alive": None if alone else base["keep_alive"]}) for p in paths]
    check_names(specs)
    for s in specs:
        if s.speculative == "draft" and not s.draft_model:
            raise ModelsFileError(f"models.{s.name}: speculative = 'draft' needs a draft model "
                                  "(--draft-model PATH, or draft_model in the models file)")
    return specs


def check_names(specs: list[ModelSpec]) -> None:
    """Raises:
        ModelsFileError: no model, or a name or alias used twice."""
    if not specs:
        raise ModelsFileError("no model to serve")
    owner: dict[str, str] = {}
    for s in specs:
        for n in s.names:
            if not n:
                raise ModelsFileError(f"models.{s.name}: an empty alias")
            if n in owner:
                raise ModelsFileError(f"the name {n!r} is given to models.{owner[n]} and models.{s.name}")
            owner[n] = s.name


def load_models_file(path: str | Path, base: dict) -> list[ModelSpec]:
    """Read and validate a models file; ``base`` are the defaults (:func:`defaults`).

    Raises:
        ModelsFileError: unreadable file, bad TOML, no ``[models.NAME]`` table, an unknown
            or invalid setting (the message names it).
    """
    path = Path(path)
    data = read_toml(path, ModelsFileError)
    if set(data) - {"models"}:
        raise ModelsFileError(f"{path}: unknown sections {sorted(set(data) - {'models'})}; expected [models.NAME]")
    tables = data.get("models")
    if not isinstance(tables, dict) or not tables:
        raise ModelsFileError(f"{path} defines no [models.NAME] table")
    return [_spec(name, table, base) for name, table in tables.items()]


def _spec(name: str, t, base: dict) -> ModelSpec:
    where = f"models.{name}"
    if not isinstance(t, dict):
        raise ModelsFileError(f"{where}: expected a table")
    unknown = set(t) - _FIELDS
    if unknown:
        raise ModelsFileError(f"{where}: unknown settings {sorted(unknown)}")
    path = t.get("path")
    if not isinstance(path, str) or not path:
        raise ModelsFileError(f"{where}: path must be a hub id, a directory, 'default' or 'demo'")
    aliases = t.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise ModelsFileError(f"{where}: aliases must be a list of names")
    pin = t.get("pin", False)
    if not isinstance(pin, bool):
        raise ModelsFileError(f"{where}: pin must be true or false")
    settings = dict(base)
    try:
        if "keep_alive" in t:
            settings["keep_alive"] = parse_keep_alive(t["keep_alive"])
        if "prompt_cache_bytes" in t:
            v = t["prompt_cache_bytes"]
            settings["prompt_cache_bytes"] = parse_size(v) if isinstance(v, str) else _number(v, int, 0)
    except ValueError as e:
        raise ModelsFileError(f"{where}: {e}") from e
    for key, kind, low in (("max_tokens", int, 1), ("max_tokens_limit", int, 1), ("top_k", int, 0),
                           ("max_prompt_tokens", int, 1), ("checkpoint_every", int, 1),
                           ("num_draft_tokens", int, 1),
                           ("temp", float, 0.0), ("top_p", float, 0.0), ("min_p", float, 0.0)):
        if key in t:
            try:
                settings[key] = _number(t[key], kind, low)
            except ValueError as e:
                raise ModelsFileError(f"{where}: {key} {e}") from e
    for key, allowed in (("speculative", ("auto", "off", "ngram", "draft")), ("kv_bits", (4, 8)),
                         ("kv_group_size", (32, 64, 128)), ("kind", KINDS)):
        if key in t:
            if isinstance(t[key], bool) or t[key] not in allowed:
                raise ModelsFileError(f"{where}: {key} must be one of {', '.join(map(str, allowed))}, "
                                      f"got {t[key]!r}")
            settings[key] = t[key]
    if "draft_model" in t:
        if not isinstance(t["draft_model"], str) or not t["draft_model"]:
            raise ModelsFileError(f"{where}: draft_model must be a directory or hub id")
        settings["draft_model"] = t["draft_model"]
        if t.get("speculative", "auto") == "auto":
            settings["speculative"] = "draft"
        elif t["speculative"] == "ngram":
            raise ModelsFileError(f"{where}: draft_model drafts with speculative = 'draft', not 'ngram'")
    if settings["num_draft_tokens"] > 16:
        raise ModelsFileError(f"{where}: num_draft_tokens must be <= 16")
    if "chat_template_args" in t:
        if not isinstance(t["chat_template_args"], dict):
            raise ModelsFileError(f"{where}: chat_template_args must be a table")
        settings["chat_template_args"] = {**base["chat_template_args"], **t["chat_template_args"]}
    lora = t.get("lora_modules", {})
    if not isinstance(lora, dict) or not all(isinstance(k, str) and k and isinstance(v, str) and v
                                             for k, v in lora.items()):
        raise ModelsFileError(f"{where}: lora_modules must be a table of adapter names to paths")
    return ModelSpec(name=name, path=path, aliases=tuple(aliases), pin=pin, preload=pin,
                     lora_modules=tuple(lora.items()), **settings)


def _number(value, kind: type, low: float):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ValueError(f"must be a{'n integer' if kind is int else ' number'}, got {value!r}")
    if value < low:
        raise ValueError(f"must be >= {low}, got {value!r}")
    return kind(value)
