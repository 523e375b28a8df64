"""mlx-lm's private functions the project relies on, under public names.

mlx-lm (pinned to a minor release in ``pyproject.toml``) exports none of these; each is
imported here only, and ``tests/test_compat.py`` checks that each still behaves as its
callers rely on (arguments, what it returns), so a release that renames or changes one
fails there, naming it, instead of deep in a request.

Each under its public name: ``download`` (``mlx_lm.utils._download``: a directory or hub
id -> the local directory), ``get_classes`` (``_get_classes``: a ``config.json`` dict ->
``(Model, ModelArgs)``), ``merge_caches`` and ``extend_cache`` (``mlx_lm.generate``: rows'
caches -> one left-padded batch cache per layer; a batch with another's rows after its
own) and ``byte_decoder`` (``mlx_lm.tokenizer_utils``: GPT-2's byte map).
"""

from __future__ import annotations

from mlx_lm.generate import _extend_cache as extend_cache
from mlx_lm.generate import _merge_caches as merge_caches
from mlx_lm.tokenizer_utils import _byte_decoder as byte_decoder
from mlx_lm.utils import _download as download
from mlx_lm.utils import _get_classes as get_classes

__all__ = ["byte_decoder", "download", "extend_cache", "get_classes", "merge_caches"]
