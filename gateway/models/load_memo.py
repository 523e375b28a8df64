"""What a model's load keeps for later loads of the same model files in this process.

A load parses the tokenizer and builds the grammar index (seconds for a large vocabulary,
see :mod:`gateway.models.loader`), and probes and times the model: whether its weights
serve faster as float32 on the CPU (:mod:`gateway.cpu.weights`), whether its recurrent or
sliding-window layers roll back a draft (:func:`scheduler.speculative.rollback_refusal`),
whether padded batches are exact (:mod:`scheduler.batch.equivalence`) and what a prefill
forward costs (:mod:`scheduler.batch.forward_cost`). A server that unloads a model and
loads it again (LRU, ``keep_alive``, ``--max-loaded-models``) would pay them each time.
So they are kept here: the tokenizers of :data:`KEPT` sets of files, keyed by what they
are made from (:func:`tokenizer_key`: another directory of the same tokenizer shares
one), and the outcomes of :data:`MEASURED`, keyed by the files (path, names, sizes,
modification times) and the settings that change them; a later load takes the outcomes (a decision that
changes the model, float32 weights, is applied to the new model again, unmeasured). A
model split across ranks always measures: the ranks must do the same steps.

The attention kernels and the allocator setting need nothing here: the CPU tuning keeps
them for the process (:class:`gateway.backend.CpuTuning`), the kernels per attention shape.

Measured on the tiny test models (qwen3, llama, gemma3_text, qwen3_5, nemotron_h; a
shared 2-core CPU): a reload with the tokenizer kept took 0.08-2.2 s, 0.01-0.32 s with
the outcomes kept too (the batch-equivalence probe is most of the difference).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections import OrderedDict
from fnmatch import fnmatch
from pathlib import Path
from typing import Any, Callable, Hashable, Optional

log = logging.getLogger("mlx_gateway")

KEPT = 8  # sets of model files whose tokenizer (with its grammar index) is kept (40-350 MB each)
MEASURED = 64  # sets of model files (and settings) whose measurements are kept (a few values each)
# environment settings that change a measurement's outcome (gateway.cpu)
SETTINGS = ("MLX_GATEWAY_CPU_FLOAT32", "MLX_GATEWAY_CPU_ATTENTION", "MLX_GATEWAY_MALLOC_TUNE")


def files_key(model_path: Path) -> tuple:
    """What identifies a model directory's files: its resolved path, and the names, sizes
    (bytes) and modification times (ns) of its files."""
    files = sorted(p for p in model_path.iterdir() if p.is_file())
    return (str(model_path.resolve()), *((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files))


TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab*", "merges*", "*.tiktoken",
                   "*.jinja", "chat_template*", "*.model")  # what tokenizers are read from
TOKENIZER_CONFIG = ("model_type", "architectures", "tokenizer_class", "auto_map", "eos_token_id")  # and in config.json


def tokenizer_key(model_path: Path, config: dict) -> tuple:
    """What a tokenizer is made from: a digest (SHA-256) of the contents of the
    directory's tokenizer files (:data:`TOKENIZER_FILES`), with the config's fields that
    pick its class, its chat template and tool parser defaults and its EOS ids
    (:data:`TOKENIZER_CONFIG`). Directories of the same tokenizer share it (a model and its
    copies; the test models of one family), where a key of the path would parse it again:
    5-8 s for Gemma 3's vocabulary of 262,144 with its grammar index, on the 2-core machine
    of ``benchmarks/bench_cpu_attention.py``."""
    digest = hashlib.sha256()
    for f in sorted(p for p in model_path.iterdir() if p.is_file() and any(fnmatch(p.name, g) for g in TOKENIZER_FILES)):
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    return digest.hexdigest(), json.dumps([config.get(k) for k in TOKENIZER_CONFIG], sort_keys=True, default=str)


class Kept:
    """At most ``size`` values by key, the least recently used dropped first; thread-safe."""

    def __init__(self, size: int = KEPT):
        self.size = size
        self._items: "OrderedDict[Hashable, Any]" = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, default: Any = None) -> Any:
        with self._lock:
            if key not in self._items:
                return default
            self._items.move_to_end(key)
            return self._items[key]

    def setdefault(self, key: Hashable, value: Any) -> Any:
        """The value kept for ``key``, else ``value``, kept now."""
        with self._lock:
            self._items.setdefault(key, value)
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)
            return self._items[key]

    def items(self) -> list[tuple[Hashable, Any]]:
        with self._lock:
            return list(self._items.items())

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


tokenizers = Kept()  # (tokenizer_key(path, config), logits size) -> (tokenizer, grammars)
measurements = Kept(MEASURED)  # (files_key(path), settings, environment settings) -> {what: outcome}


def kept_tokenizer(model_path: Path) -> Any:
    """The tokenizer an earlier load kept for the files of ``model_path`` (mlx-lm's
    ``TokenizerWrapper``, shared: only to read), or None."""
    config = json.loads((model_path / "config.json").read_text()) if (model_path / "config.json").is_file() else {}
    made_of = tokenizer_key(model_path, config)
    return next((tok for (key, _), (tok, _) in tokenizers.items() if key == made_of), None)


def forget() -> None:
    """Forget every earlier load: the next load of any model measures, and reads its tokenizer, again."""
    tokenizers.clear()
    measurements.clear()


class Recall:
    """One load's measurements: each taken from an earlier load of the same files with the
    same ``settings`` (the kv quantization, the model kind, ...), else measured and kept.

    Args:
        model_path: the model's directory; None: measure everything, keep nothing (a model
            split across ranks).
        settings: what else changes the outcomes (hashable).
    """

    def __init__(self, model_path: Optional[Path], *settings: Hashable):
        self.outcomes: Optional[dict] = None
        if model_path is not None:
            key = (files_key(model_path), settings, tuple(os.environ.get(k) for k in SETTINGS))
            self.outcomes = measurements.setdefault(key, {})
        self.reused: list[str] = []  # what this load took from an earlier one

    def __call__(self, what: str, measure: Callable[[], Any], apply: Optional[Callable[[Any], Any]] = None) -> Any:
        """The outcome of ``measure()`` for ``what``; or the one an earlier load kept, or,
        with ``apply`` (which does to this model what ``measure`` did to that one), what
        ``apply`` returns for it (this load's outcome: a conversion can fail this time)."""
        if self.outcomes is None or what not in self.outcomes:
            outcome = measure()
            if self.outcomes is not None:
                self.outcomes[what] = outcome
            return outcome
        outcome = self.outcomes[what]
        self.reused.append(what)
        return outcome if apply is None else apply(outcome)

    def log(self, name: str) -> None:
        """Say, once, what this load reused (info), if anything."""
        if self.reused:
            log.info("%s: reused the measurements of an earlier load of the same files: %s",
                     name, ", ".join(self.reused))
