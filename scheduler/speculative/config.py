"""Speculative decoding settings (``--speculative``, ``--num-draft-tokens``) and which
models can speculate."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from scheduler.speculative.draft_model import DraftModel

METHODS = ("off", "ngram", "draft")


@dataclass(frozen=True)
class SpeculationConfig:
    """How the decode batch drafts.

    Attributes:
        method: ``"off"``, ``"ngram"`` (prompt lookup, :mod:`scheduler.speculative.lookup`)
            or ``"draft"`` (a draft model, :mod:`scheduler.speculative.draft_model`).
        num_draft_tokens: most tokens drafted per row and step (``K``; a verification
            forward is ``[B, 1 + K]`` at most).
        min_n, max_n: the n-gram lengths prompt lookup matches, longest first (tokens).
        draft: the draft model, for ``"draft"`` (and only then).

    Raises:
        ValueError: an unknown method, ``K`` outside 1..16, or ``draft`` given with
            another method or missing with ``"draft"``.
    """

    method: str = "off"
    num_draft_tokens: int = 4
    min_n: int = 2
    max_n: int = 4
    draft: Optional[DraftModel] = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, not {self.method!r}")
        if not 1 <= self.num_draft_tokens <= 16:
            raise ValueError(f"num_draft_tokens must be 1..16, not {self.num_draft_tokens}")
        if (self.method == "draft") != (self.draft is not None):
            raise ValueError("the 'draft' method, and only it, needs a draft model")

    @property
    def enabled(self) -> bool:
        return self.method != "off"


def speculation_refusal(model) -> Optional[str]:
    """Why ``model`` cannot speculate, or None if it can.

    A rejected draft must be taken back out of every layer's cache. Full-attention layers
    (mlx-lm's ``KVCache``) can: the decode batch masks the rejected positions
    (:mod:`scheduler.speculative.holes`). Recurrent state (``ArraysCache``: Mamba, gated
    delta nets) has no per-token history to roll back to, and sliding windows
    (``RotatingKVCache``) overwrite the positions a rollback would need.
    """
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    layers = make_prompt_cache(model)
    if all(type(c) is KVCache for c in layers):
        return None
    kinds = {type(c).__name__ for c in layers}
    if "QuantizedKVRow" in kinds:
        return "its KV cache is quantized (--kv-bits), and quantized batches do not take drafts back yet"
    others = sorted(k for k in kinds if k != "KVCache")
    return f"its layers keep {', '.join(others)} caches, which cannot roll back a rejected draft"
