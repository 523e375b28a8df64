"""Embedding models: loaded through mlx-embeddings, run as batched forwards by
:class:`scheduler.engine.embedding.EmbeddingEngine`.

mlx-embeddings (PyPI ``mlx-embeddings``, the ``[embeddings]`` extra) builds the model of
the checkpoint's ``model_type`` (BERT, XLM-RoBERTa, ModernBERT, Qwen3, Gemma 3 text, ...)
and pools its hidden states the way that family's model card says: mean pooling for the
BERT sentence-transformers, the last token for Qwen3-Embedding, then L2 normalization.
Its output ``text_embeds [B, D]`` is what ``/v1/embeddings`` returns.

A batch is right-padded with the attention mask marking the padding, so a sequence's
vector does not depend on the other sequences of its batch (tests check it against the
sequence embedded alone).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

log = logging.getLogger("mlx_gateway")

# model_type values that only mlx-embeddings loads (encoders): a directory with one of
# these is an embedding model without being told.
ENCODER_TYPES = {"bert", "xlm_roberta", "xlm-roberta", "modernbert", "siglip", "llama_bidirec"}
# Families trained with Matryoshka representation learning: their vectors may be cut to
# fewer ``dimensions`` (then normalized again), as their model cards describe.
MATRYOSHKA_TYPES = {"qwen3", "gemma3_text"}


class EmbeddingsUnavailable(RuntimeError):
    """mlx-embeddings is not installed (``pip install 'mlx-gateway[embeddings]'``)."""


def is_embedding_dir(path: Path, config: dict) -> bool:
    """A model directory holds an embedding model: a sentence-transformers layout
    (``modules.json`` or ``config_sentence_transformers.json``), or an encoder-only
    ``model_type`` (:data:`ENCODER_TYPES`)."""
    if (path / "modules.json").is_file() or (path / "config_sentence_transformers.json").is_file():
        return True
    return str(config.get("model_type", "")).lower() in ENCODER_TYPES


class EmbeddingModel:
    """One embedding model: ``self(sequences) -> mx.array [B, D]`` (engine thread only).

    Attributes:
        model: the mlx-embeddings model.
        tokenizer: its tokenizer (mlx-embeddings' wrapper of the Hugging Face tokenizer;
            used off the engine thread).
        dimensions: the vector size ``D``.
        matryoshka: vectors may be truncated to fewer dimensions.
        context_length: the longest input (tokens).
        model_type: the checkpoint's ``model_type``.
    """

    def __init__(self, model, tokenizer, config: dict):
        self.model = model
        self.tokenizer = tokenizer
        self.model_type = str(config.get("model_type", "")).lower()
        self.dimensions = int(config.get("hidden_size") or config.get("d_model") or 0)
        self.matryoshka = self.model_type in MATRYOSHKA_TYPES
        self.context_length = int(config.get("max_position_embeddings") or 512)
        self.pad_id = int(getattr(_hf(tokenizer), "pad_token_id", None) or 0)

    def __call__(self, sequences: list[list[int]]):
        """Pooled, normalized vectors of ``sequences`` (right-padded, masked): ``[B, D]``."""
        import mlx.core as mx

        longest = max(len(s) for s in sequences)
        ids = mx.array([s + [self.pad_id] * (longest - len(s)) for s in sequences], dtype=mx.int32)
        mask = mx.array([[1] * len(s) + [0] * (longest - len(s)) for s in sequences], dtype=mx.int32)
        out = self.model(ids, attention_mask=mask)
        return out.text_embeds

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with the special tokens the model's tokenizer adds."""
        return list(_hf(self.tokenizer).encode(text))


def _hf(tokenizer):
    return getattr(tokenizer, "_tokenizer", tokenizer)


def load_embedding_model(model_path: Path) -> tuple[EmbeddingModel, dict]:
    """Load an embedding model directory through mlx-embeddings (weights read and
    evaluated by the caller's ``mx.eval``).

    Returns:
        ``(model, config)``.

    Raises:
        EmbeddingsUnavailable: mlx-embeddings is not installed.
        ValueError: mlx-embeddings does not know the model's ``model_type``.
    """
    try:
        from mlx_embeddings.utils import load
    except ImportError as e:
        raise EmbeddingsUnavailable("embedding models need mlx-embeddings: pip install 'mlx-gateway[embeddings]'"
                                    ) from e
    config = json.loads((model_path / "config.json").read_text())
    model, tokenizer = load(str(model_path), lazy=True)
    return EmbeddingModel(model, tokenizer, config), config


def truncate(vectors, dimensions: Optional[int]):
    """``vectors [n, D]`` (numpy) cut to their first ``dimensions`` and normalized again
    (L2); as they are when ``dimensions`` is None or ``D``."""
    import numpy as np

    if dimensions is None or dimensions >= vectors.shape[1]:
        return vectors
    cut = vectors[:, :dimensions]
    norms = np.linalg.norm(cut, axis=1, keepdims=True)
    return cut / np.maximum(norms, 1e-12)
