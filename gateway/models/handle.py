"""A loaded model as request code sees it: one narrow object per served model."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from gateway.models.spec import ModelSpec
from scheduler import Engine
from scheduler.grammar import Grammars


@dataclass(eq=False)
class ModelHandle:
    """A served model that is loaded: what a request needs of it, and nothing of the server.

    Attributes:
        spec: its name, aliases and settings (sampling defaults, template arguments,
            token limits).
        tokenizer: mlx-lm's ``TokenizerWrapper`` (used off the engine thread: it is not MLX).
        engine: its engine (batch, prefix cache), on the gateway's one engine loop.
        context_length: the model's context (tokens).
        vocab_size: entries in its logits (embedding rows; often more than the tokenizer has).
        grammars: the constrained-decoding compiler for its vocabulary.
        weights_bytes: bytes its parameters take in memory, as served.
        path: the local directory it was loaded from.
        loaded_at: wall-clock time of the load (seconds since the epoch).
        kind: ``"text"``, ``"vision"`` (it reads images, :mod:`gateway.models.vision_load`) or
            ``"embedding"`` (``/v1/embeddings`` only; its ``engine`` is a
            :class:`scheduler.engine.embedding.EmbeddingEngine`, ``grammars`` None).
        vision: the vision side of a vision model (:class:`gateway.models.vision_images.VisionModel`).
        embedder: the embedding model (:class:`gateway.models.embedding.EmbeddingModel`).
    """

    spec: ModelSpec
    tokenizer: Any
    engine: Engine
    context_length: int
    vocab_size: int
    grammars: Grammars
    weights_bytes: int
    path: str
    loaded_at: float = field(default_factory=time.time)
    kind: str = "text"
    vision: Any = None
    embedder: Any = None

    @property
    def name(self) -> str:
        """The served name."""
        return self.spec.name

    @property
    def trimmable(self) -> bool:
        """Its caches can be trimmed (fewer prompt checkpoints are needed)."""
        return self.engine.trimmable
