"""Speculative decoding settings (``--speculative``, ``--num-draft-tokens``) and which
models can speculate."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from cache.kinds import kind_of
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
        rollback_checked: the model's recurrent and window layers, if any, were found to
            roll back (:func:`rollback_refusal`, at load); False: the speculator checks
            them before its first draft.

    Raises:
        ValueError: an unknown method, ``K`` outside 1..16, or ``draft`` given with
            another method or missing with ``"draft"``.
    """

    method: str = "off"
    num_draft_tokens: int = 8
    min_n: int = 2
    max_n: int = 4
    draft: Optional[DraftModel] = field(default=None, compare=False, repr=False)
    rollback_checked: bool = field(default=False, compare=False)

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
    """Why ``model`` cannot speculate, or None if it can (as far as its cache types tell).

    A rejected draft must be taken back out of every layer's cache, as its kind's
    ``rollback`` column says (:mod:`cache.kinds`):

    - ``mask``: full-attention layers (mlx-lm's ``KVCache``, or quantized, ``--kv-bits``)
      mask the rejected positions (:mod:`scheduler.speculative.holes`);
    - ``recurrent`` (``ArraysCache``: gated delta nets, Mamba) and ``window`` (sliding
      windows, ``RotatingKVCache``): the layers go back to their state before the step and
      take the kept tokens again (:mod:`scheduler.speculative.rewind`). Whether the model's
      layers honour the padding that needs is checked on the model itself
      (:func:`rollback_refusal`, at load, or before an engine's first draft when it was not).

    Kinds with no ``rollback`` are refused.
    """
    from mlx_lm.models.cache import make_prompt_cache

    others = sorted({type(c).__name__ for c in make_prompt_cache(model) if kind_of(c).rollback is None})
    if others:
        return f"its layers keep {', '.join(others)} caches, which cannot roll back a rejected draft"
    return None


def rollback_refusal(model) -> Optional[str]:
    """Why the recurrent or sliding-window layers of ``model`` (one whose cache kinds
    :func:`speculation_refusal` accepts) cannot roll back a draft, or None if they can
    or it has none: the check that they honour right padding
    (:func:`~scheduler.speculative.rewind.right_padding_refusal`: a few small forwards,
    on a thread that may run the model). A check that raises refuses."""
    from mlx_lm.models.cache import make_prompt_cache

    from scheduler.speculative.rewind import REPLAYED, right_padding_refusal

    if not any(kind_of(c).rollback in REPLAYED for c in make_prompt_cache(model)):
        return None
    try:
        return right_padding_refusal(model)
    except Exception as e:  # a probe that cannot run refuses: the rows decode plainly
        return f"its layers could not be checked for rollback ({type(e).__name__}: {e})"
