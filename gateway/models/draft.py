"""The draft model of ``--speculative draft``: read beside its target on the loader thread,
checked, and handed to the engine (:class:`scheduler.speculative.DraftModel`).

A draft must share the target's tokenizer (the same vocabulary, token for token: its
drafts are the target's token ids) and keep full-attention caches only (its rejected
drafts are taken back as the target's are, :mod:`scheduler.speculative.holes`).
"""

from __future__ import annotations

from pathlib import Path


class DraftModelError(ValueError):
    """The draft model cannot be read, or cannot draft for its target (the message says why)."""


def read_draft(name: str, path: str):
    """The draft model at ``path`` (a directory or hub id) with its weights not read yet
    (``lazy``: shapes only, so its bytes can be reserved first), and its directory.

    Raises:
        DraftModelError: no model there.
    """
    from compat.mlx_lm import download
    from mlx_lm.utils import load_model as load_weights

    try:
        where = Path(download(path))
        model, _ = load_weights(where, lazy=True)
    except Exception as e:
        raise DraftModelError(f"{name}: draft model {path!r} cannot be read: {e}") from None
    return model, where


def check_draft(name: str, draft, where: Path, tokenizer) -> None:
    """Refuse a draft that cannot draft for a target of ``tokenizer``.

    Raises:
        DraftModelError: another vocabulary, or layers other than full attention.
    """
    from mlx_lm.models.cache import KVCache, make_prompt_cache
    from mlx_lm.utils import load_tokenizer

    try:
        theirs = load_tokenizer(where).get_vocab()
    except Exception as e:
        raise DraftModelError(f"{name}: the draft model's tokenizer cannot be read: {e}") from None
    if theirs != tokenizer.get_vocab():
        raise DraftModelError(f"{name}: the draft model's tokenizer is not the served model's "
                              f"({len(theirs)} tokens against {len(tokenizer.get_vocab())}, or other ids)")
    kinds = sorted({type(c).__name__ for c in make_prompt_cache(draft)} - {KVCache.__name__})
    if kinds:  # the draft batch takes drafts back by masking (HoledKVCache) alone
        raise DraftModelError(f"{name}: the draft model cannot draft: its layers keep {', '.join(kinds)} "
                              "caches; a draft model's layers must all be full attention")
